"""Uploading committed local steps to the bucket (SPEC §4): ``daemon`` (the sidecar loop, which owns
one ``Uploader``), ``uploader`` (``Uploader``: backlog, markers, retention; ``UploadPolicy``),
``session`` (what every step upload of one uploader shares), ``step_upload`` and ``shard_upload``
(one step, one shard of this node), ``transfer`` (send and
confirm one shard), ``commit`` (THE remote commit protocol), ``retention`` and ``pending_aborts``
(remote rotation, abandoned multipart uploads), ``metrics``. Imports only the shared modules of
``tiered_ckpt.remote``; re-exports nothing.
"""
