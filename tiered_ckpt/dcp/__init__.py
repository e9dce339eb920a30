"""A ``torch.distributed.checkpoint`` (DCP) storage backend on the tiers ( needs torch, the
``tiered-ckpt[torch]`` extra: ``import tiered_ckpt`` works without it, ``import tiered_ckpt.dcp``
does not).

A DCP save of step ``S`` is an ordinary step of the local tier: ``<root>/step_XXXXXXXXXX/`` with one
safetensors shard per rank (plain ``safetensors`` opens them) and ``manifest.json`` committed last,
with one save id for all ranks; the DCP metadata is JSON in the coordinator's shard, never pickle.
So ``tiered-ckpt ls/verify/gc``, rotation, upload and restore work on it unchanged. Non-tensor
values are stored as JSON (tuples come back as lists) or raw ``bytes``; anything else is refused
before anything is written. Loading unpickles nothing: only this package's planners are accepted.

Use with DCP directly::

    dcp.save(sd, storage_writer=TieredStorageWriter(root, step), planner=TieredSavePlanner())
    dcp.load(sd, storage_reader=TieredStorageReader(root, step), planner=TieredLoadPlanner())

or through :func:`save`, :func:`async_save` and :func:`load` (which also turn DCP's
``CheckpointException`` into this package's typed errors).

Modules: ``items`` (item names, byte encoding, dtypes), ``metadata_json`` (DCP's Metadata as JSON),
``planners``, ``storage_writer``, ``storage_reader``, ``api``, ``manager``
(:class:`DCPCheckpointManager`: policy, DCP's async saves, rotation and upload gating at the commit,
lineage, restore from the bucket).
"""

from tiered_ckpt.dcp.api import async_save, load, save
from tiered_ckpt.dcp.manager import DCPCheckpointManager
from tiered_ckpt.dcp.planners import TieredLoadPlanner, TieredSavePlanner
from tiered_ckpt.dcp.storage_reader import TieredStorageReader
from tiered_ckpt.dcp.storage_writer import TieredStorageWriter

__all__ = [
    "DCPCheckpointManager",
    "TieredLoadPlanner",
    "TieredSavePlanner",
    "TieredStorageReader",
    "TieredStorageWriter",
    "async_save",
    "load",
    "save",
]
