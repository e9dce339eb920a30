"""Restoring remotely committed steps (SPEC §5): ``plan`` (which step, its manifests and shard
objects), ``download`` (every shard's ranged parts through one window, verified as they arrive),
``restorer`` (``restore``: into a local root through the local commit protocol), ``ranged_read``
(verified ranged GETs of one shard for the DCP reader). Imports only the shared modules of
``tiered_ckpt.remote``; re-exports nothing.
"""
