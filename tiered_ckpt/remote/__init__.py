"""Remote tier (SPEC §4-5): uploading committed steps to an S3-compatible bucket, and restoring them.

Modules: ``commit`` (THE remote commit protocol of one step: shards, confirmation records, upload
manifest with If-None-Match, ``latest``), ``catalogue`` (the one meaning of "remotely committed"),
``transfer`` (send and confirm one shard through the ``ObjectStore`` interface), ``shard_upload`` and
``step_upload`` (one shard, one step from this node), ``upload`` (the ``Uploader``: backlog and loop),
``retention`` (remote rotation, abandoned multipart uploads), ``restore_plan``, ``download`` and
``restore`` (restore after cluster loss), ``verify`` (``verify --remote``), ``handle`` (the store a call
works on), ``daemon`` and ``metrics`` (the sidecar process), ``errors``. The public names are re-exported
by :mod:`tiered_ckpt`; this face re-exports nothing, so that importing one module stays cheap.
"""
