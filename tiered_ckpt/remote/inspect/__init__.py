"""Read-only views of a bucket: ``verify`` (``verify --remote``), ``stored_checksums`` (``verify
--fast``), ``run_status`` (``tiered-ckpt status``). May import ``tiered_ckpt.remote.upload`` (the
commit protocol's record reads) and ``tiered_ckpt.remote.restore`` (plan, download); nothing imports
it back. Re-exports nothing.
"""
