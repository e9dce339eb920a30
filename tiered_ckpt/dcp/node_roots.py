"""DCP saves into node-local roots: each node's ranks pass the same path, a different directory per
node, and every node's root ends up a committed step of its own (its ranks' shards, the global
manifest, ``node_ranks.json``, the DCP metadata), as the native manager's node-local roots.

DCP calls ``finish`` on its coordinator only, and nothing on other nodes after it, so the other
nodes are committed by a collective after ``dcp.save`` (or ``dcp.async_save``'s future) returned on
every rank. Lifecycle of one save (:func:`tiered_ckpt.dcp.save` / ``async_save`` and
:class:`~tiered_ckpt.dcp.DCPCheckpointManager` run it; with plain ``dcp.save`` the caller does):

1. (all, before the save) :func:`node_groups`: which ranks share a root, found from the filesystem
   (node token files, :func:`tiered_ckpt.training.dist.find_disk_groups`; never host names).
2. (all) ``dcp.save`` with ``TieredStorageWriter(root, step, node_ranks=<this rank's group>)`` and
   :class:`NodeLocalSavePlanner` ``(groups)``: every item that several nodes' ranks hold (replicated
   values, byte items) is written once per node, so each node's root holds a copy; the coordinator's
   ``finish`` commits its own node's root (``local_ranks``: its group).
3. (all) :func:`commit_node_roots`: the coordinator reads back the manifest it committed and the DCP
   metadata from its shard and broadcasts both; every other node's lowest rank writes the metadata
   into ``<step>/dcp_metadata.json`` (its sha256 is in the manifest's ``extra["dcp"]``), commits the
   same manifest bytes over its own ranks' shards and rotates; the outcomes are all-gathered: a
   failure anywhere raises :class:`~tiered_ckpt.errors.DistributedSaveError` on every rank (the
   nodes committed before stay committed).

A save that dies between 2 and 3 leaves the coordinator's node committed and the others
uncommitted (readers never see them; ``gc`` sweeps them); a load then finds the step on no rank's
root but the coordinator's node, and picks an older one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan

from tiered_ckpt.dcp.planners import TieredSavePlanner
from tiered_ckpt.errors import CheckpointError, DistributedSaveError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.layout import DCP_METADATA_NAME
from tiered_ckpt.local.catalogue import read_manifest_bytes, step_path
from tiered_ckpt.local.commit import commit_step, durable_write_bytes
from tiered_ckpt.local.rotation import RotationPolicy, rotate
from tiered_ckpt.local.verified_read import ShardReader
from tiered_ckpt.training.dist import all_gather_json, broadcast_bytes, find_disk_groups

log = logging.getLogger(__name__)


def _group_rank_and_size(process_group: Any) -> tuple[int, int]:
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def node_groups(root: str | Path, process_group: Any = None) -> list[list[int]]:
    """The ranks (of ``process_group``, default the whole job) that share each root, ascending
    (step 1 of the module docstring; one group on a shared root). A collective: every rank calls
    it with its own root. Raises :class:`DistributedSaveError` (a token that cannot be written, a
    failed collective)."""
    rank, world = _group_rank_and_size(process_group)
    return find_disk_groups(Path(root).absolute(), process_group, rank, world)


def group_of(groups: Sequence[Sequence[int]], rank: int) -> list[int]:
    """The group of ``groups`` that holds ``rank``. Raises ``ValueError`` when none does."""
    for g in groups:
        if rank in g:
            return sorted(g)
    raise ValueError(f"rank {rank} is in no node group of {[list(g) for g in groups][:8]}")


class NodeLocalSavePlanner(TieredSavePlanner):
    """:class:`TieredSavePlanner` for node-local roots: after DCP's deduplication (each item that
    several ranks hold kept on one rank), the item is given back to the lowest rank holding it on
    every other node (``groups``: :func:`node_groups`), so that every node's root has a copy. The
    metadata places such an item on one of its copies (the writer's placement); the reader finds
    the copy of its own root by the item's stored name. Picklable before ``set_up_planner``. Raises
    ``ValueError`` for groups that do not partition the ranks (in ``create_global_plan``)."""

    def __init__(self, groups: Sequence[Sequence[int]]) -> None:
        super().__init__()
        self.groups = [sorted(int(r) for r in g) for g in groups]

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        node_of = {r: i for i, g in enumerate(self.groups) for r in g}
        if sorted(node_of) != list(range(len(all_plans))):
            raise ValueError(
                f"node groups {self.groups[:8]} do not partition the {len(all_plans)} ranks"
            )
        holders: dict[MetadataIndex, list[int]] = {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                holders.setdefault(item.index, []).append(rank)
        plans, metadata = super().create_global_plan(all_plans)
        copies: list[list[Any]] = [[] for _ in plans]
        for kept_rank, plan in enumerate(plans):
            for item in plan.items:
                nodes_done = {node_of[kept_rank]}
                for rank in holders.get(item.index, ()):  # ascending: each node's lowest holder
                    if node_of[rank] not in nodes_done:
                        nodes_done.add(node_of[rank])
                        copies[rank].append(item)
        out = [
            SavePlan(
                items=[*p.items, *extra],
                storage_data=p.storage_data,
                planner_data=p.planner_data,
                usable=p.usable,
            )
            if extra
            else p
            for p, extra in zip(plans, copies)
        ]
        self.global_metadata = metadata
        return out, metadata


def metadata_sha256(data: bytes) -> str:
    """Hex sha256 of the encoded DCP metadata (``extra["dcp"]["metadata_sha256"]``)."""
    return hashlib.sha256(data).hexdigest()


def _coordinator_payload(root: Path, step: int) -> bytes:
    """The coordinator's broadcast: the manifest it committed and the metadata tensor's bytes, read
    verified from its shard."""
    raw = read_manifest_bytes(step_path(root, step))
    if raw is None:
        raise CheckpointError(f"step {step} is not committed under {root}")
    m = ShardManifest.from_json(raw.decode())
    info = (m.extra or {})["dcp"]
    with ShardReader(step_path(root, step), m, info["metadata_rank"]) as rd:
        md = bytes(rd.read_range(info["metadata_tensor"], 0, info["metadata_bytes"]))
    return json.dumps(
        {"manifest": raw.decode(), "metadata": base64.b64encode(md).decode("ascii")}
    ).encode()


def _commit_here(
    root: Path,
    step: int,
    payload: dict[str, Any],
    ranks: list[int],
    *,
    replace: bool,
    rotation: RotationPolicy | None,
    rank: int,
) -> None:
    """A non-coordinator node's commit (step 3 of the module docstring) by its lowest rank."""
    raw = payload["manifest"].encode()
    m = ShardManifest.from_json(payload["manifest"])
    md = base64.b64decode(payload["metadata"])
    info = (m.extra or {}).get("dcp") or {}
    if info.get("metadata_sha256") != metadata_sha256(md) or m.step != step:
        raise CheckpointError(
            f"step {step}: the coordinator's metadata or manifest does not match what it committed"
        )
    sdir = step_path(root, step)
    if not sdir.is_dir():
        raise CheckpointError(f"step {step}: {sdir} does not exist (no rank of this node wrote?)")
    durable_write_bytes(sdir / DCP_METADATA_NAME, md)
    got = commit_step(
        root,
        step,
        m.world_size,
        m.shards,
        m.extra,
        save_id=m.save_id,
        replace=replace,
        wall_clock_seconds=m.wall_clock_seconds,
        local_ranks=ranks,
        created_at=m.created_at,
        run_id=m.run_id,
        attempt=m.attempt,
    )
    if got.to_json().encode() != raw:  # pragma: no cover - commit_step rebuilds the same record
        log.error("step %d: node root %s got a manifest unlike the coordinator's", step, root)
    if rotation is not None:
        try:
            rotate(root, rotation, rank=rank, just_committed=step)
        except OSError as exc:  # the save itself succeeded; retention retries after the next one
            log.error("rank %d step %d: rotation after the commit failed: %s", rank, step, exc)


def commit_node_roots(
    root: str | Path,
    step: int,
    groups: Sequence[Sequence[int]],
    *,
    process_group: Any = None,
    replace: bool = False,
    rotation: RotationPolicy | None = None,
) -> bool:
    """Step 3 of the module docstring, on every rank of ``process_group`` (default: the whole job)
    after the DCP save of ``step`` returned everywhere; ``root``: this rank's root, ``groups``: what
    :func:`node_groups` returned before the save. ``replace``/``rotation``: as given to the
    writers. Returns whether this rank committed a root (DCP's coordinator, and every other node's
    lowest rank). Three collectives (two broadcasts from group rank 0, one all-gather). Raises
    :class:`DistributedSaveError` on every rank when the coordinator could not read its commit back,
    any node's commit failed, or a collective failed."""
    r = Path(root).absolute()
    rank, world = _group_rank_and_size(process_group)
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    mine = group_of(groups, rank)
    coordinator_node = group_of(groups, 0)
    payload: bytes | None = None
    error: str | None = None
    if rank == 0:
        try:
            payload = _coordinator_payload(r, step)
        except Exception as exc:  # reported to every rank in the broadcast
            error = f"{type(exc).__name__}: {exc}"
            payload = json.dumps({"error": error}).encode()
    try:
        got = json.loads(broadcast_bytes(payload, src, process_group))
    except RuntimeError as exc:
        raise DistributedSaveError(
            f"rank {rank} step {step}: broadcasting the commit (a rank died or timed out?): {exc}"
        ) from exc
    if "error" in got:
        raise DistributedSaveError(
            f"step {step}: the coordinator cannot read its commit back: {got['error']}",
            {0: got["error"]},
        )
    committer = mine != coordinator_node and rank == mine[0]
    outcome: dict[str, Any] = {"rank": rank}
    failure: BaseException | None = None
    if committer:
        try:
            _commit_here(r, step, got, mine, replace=replace, rotation=rotation, rank=rank)
        except Exception as exc:  # reported to every rank below, then re-raised here
            failure = exc
            outcome["error"] = f"{type(exc).__name__}: {exc}"
    try:
        outcomes = all_gather_json(outcome, process_group, world)
    except RuntimeError as exc:
        raise DistributedSaveError(
            f"rank {rank} step {step}: gathering node commits (a rank died or timed out?): {exc}"
        ) from exc
    failures = {g["rank"]: g["error"] for g in outcomes if "error" in g}
    if failures:
        log.error("rank %d step %d: node commit failed on rank(s) %s", rank, step, sorted(failures))
        raise DistributedSaveError(
            f"step {step}: committing node roots failed on rank(s) {sorted(failures)}", failures
        ) from failure
    if committer:
        log.info("rank %d step %d: node root %s committed (ranks %s)", rank, step, r, mine)
    return committer or rank == 0


__all__ = [
    "NodeLocalSavePlanner",
    "commit_node_roots",
    "group_of",
    "metadata_sha256",
    "node_groups",
]
