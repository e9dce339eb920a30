"""Remote tier (SPEC §4-5): uploading committed steps to an S3-compatible bucket, and restoring
them.

Modules: ``commit`` (THE remote commit protocol of one save: shards, confirmation records, fence,
upload manifest with If-None-Match, ``latest``), ``lineage`` (the run claim and lineage record of a
prefix, SPEC §11), ``catalogue`` (the one meaning of "remotely committed": current saves only),
``transfer`` (send and confirm one shard through the ``ObjectStore`` interface), ``shard_upload``
and ``step_upload`` (one shard, one step from this node), ``upload`` (the ``Uploader``: backlog),
``retention`` (remote rotation, abandoned multipart uploads), ``restore_plan``, ``download`` and
``restore`` (restore after cluster loss), ``ranged_read`` (verified partial reads of one shard
object by ranged GETs, for a reader without the shard locally), ``verify`` (``verify --remote``),
``handle`` (the store a call works on), ``daemon`` (the sidecar's loop: backoff, stall deadline,
signals) and ``metrics``, ``errors``. The public names are re-exported by :mod:`tiered_ckpt`; this
face re-exports nothing, so that importing one module stays cheap.
"""
