"""A ``torch.distributed.checkpoint`` (DCP) storage backend on the tiers (needs torch, the
``tiered-ckpt[torch]`` extra: ``import tiered_ckpt`` works without it, ``import tiered_ckpt.dcp``
does not).

A DCP save of step ``S`` is an ordinary step of the local tier (one safetensors shard per rank,
``manifest.json`` committed last, one save id), so ``tiered-ckpt ls/verify/gc``, rotation, upload
and restore work on it unchanged. The DCP metadata is JSON in the coordinator's shard; non-tensor
values are JSON (typed JSON where plain JSON would change their types: tuples, int keys) or raw
``bytes``; nothing is pickled either way, with any planner.

Use with DCP directly, with DCP's default planners (``planner=None``,
``DefaultSavePlanner(enable_plan_caching=True)``, subclasses) or this package's::

    dcp.save(sd, storage_writer=TieredStorageWriter(root, step))
    dcp.load(sd, storage_reader=TieredStorageReader(root, step))

or through :func:`save`, :func:`async_save` and :func:`load` (which also turn DCP's
``CheckpointException`` into this package's typed errors). :class:`DCPCheckpointManager`: policy,
async saves, rotation and upload gating, lineage, restore from the bucket. Node-local roots
(each node its own directory): :mod:`tiered_ckpt.dcp.node_roots`. Comparison with DCP's
own backend: docs/design.md, "DCP backend".
"""

from tiered_ckpt.dcp.api import async_save, load, save
from tiered_ckpt.dcp.manager import DCPCheckpointManager
from tiered_ckpt.dcp.node_roots import NodeLocalSavePlanner, commit_node_roots, node_groups
from tiered_ckpt.dcp.planners import TieredLoadPlanner, TieredSavePlanner
from tiered_ckpt.dcp.storage_reader import TieredStorageReader
from tiered_ckpt.dcp.storage_writer import TieredStorageWriter

__all__ = [
    "DCPCheckpointManager",
    "NodeLocalSavePlanner",
    "TieredLoadPlanner",
    "TieredSavePlanner",
    "TieredStorageReader",
    "TieredStorageWriter",
    "async_save",
    "commit_node_roots",
    "load",
    "node_groups",
    "save",
]
