"""Format layer (SPEC §2, §4): what the bytes mean, with no I/O, no threads and no S3.

Modules: ``manifest`` (the step manifest: frozen dataclasses, strict validation), ``migration``
(schema versions and the registry that upgrades older manifests), ``lineage`` (``run.json``: run id,
attempts, which steps are superseded; SPEC §11), ``upload_manifest`` (the remote commit point
and the ``latest`` pointer), ``records`` (per-shard confirmation record, local ``uploaded.json``
marker), ``shard_file`` (the safetensors layout and the state tree in its header), ``crc32c``
(CRC32C and per-chunk checksums), ``validate`` (the typed JSON validators they share). Import the
module you need; this face re-exports nothing.
"""
