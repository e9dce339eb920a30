"""Local tier (SPEC §2): a package marker. Other layers import what they need from its modules
directly (``from tiered_ckpt.local.catalogue import read_manifest``); users have ``tiered_ckpt``.

Modules: ``catalogue`` (which steps exist, manifests, ``run.json`` reads), ``commit`` (the local
commit protocol and the coordinator's ``commit_step``), ``writer`` (one rank's shard),
``single_process_save`` (``save_sharded``: every rank's shard from one process, then the commit),
``load_committed`` (fail-loud loads of committed steps), ``verified_read`` (verified partial and
streaming reads of one shard, its header), ``shard_io`` (streaming write/read with a hashing
thread), ``reshard_plan`` + ``reshard``, ``rotation``, ``trash``, ``scan`` (ls / verify),
``sweep`` (gc), ``leftovers``, ``markers`` (the uploader's ``uploaded.json``), ``lineage`` (the
root's ``run.json`` and its superseded steps, SPEC §11), ``pins`` (``pinned.json``),
``held_ranks`` (which ranks a root and its steps hold, ``node_ranks.json``).
"""
