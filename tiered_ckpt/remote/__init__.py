"""Remote tier (SPEC §4-5): uploading committed steps to an S3-compatible bucket, and restoring
them. One folder per direction, over shared modules:

- ``upload/`` (the sidecar loop, the ``Uploader``, the remote commit protocol, retention);
- ``restore/`` (plan, download, ``restore``, ranged reads for the DCP reader);
- ``inspect/`` (read-only: ``verify``, stored checksums, ``status``); imports ``upload/`` and
  ``restore/``, neither imports it nor each other;
- shared, imported by all three: ``catalogue`` (the one meaning of "remotely committed"),
  ``lineage`` (run claim and record, SPEC §11), ``pointer`` (``latest``), ``handle`` (the store a
  call works on), ``limits`` (size caps), ``at_risk``, ``errors``.

The public names are re-exported by :mod:`tiered_ckpt`; this face re-exports nothing, so that
importing one module stays cheap.
"""
