"""``TieredStorageWriter``: a DCP StorageWriter whose save of step ``S`` is an ordinary step of the
local tier (shards by :func:`tiered_ckpt.local.writer.write_shard`, then ``manifest.json`` by
:func:`tiered_ckpt.local.commit.commit_step`).

DCP's lifecycle (``dcp.save`` / ``dcp.async_save``; in process mode all of it runs in DCP's
checkpoint process):

0. (all) ``reset(checkpoint_id)``: root and step from a ``<root>/step_XXXXXXXXXX`` id
   (:meth:`validate_checkpoint_id`).
1. (all) ``set_up_storage_writer``: the rank's role; ``use_collectives=False`` is refused.
2. (all) ``prepare_local_plan``: refuses an item a shard cannot hold (dtype, name:
   :func:`~tiered_ckpt.dcp.items.check_item`); tags the plan with this rank's step and a fresh
   nonce of this save.
3. (coordinator) ``prepare_global_plan``: same step everywhere, not committed (unless
   ``replace``); one save id; a :class:`ShardPlan` per rank (the nonce of that rank's plan echoed).
   Nothing is written before this, except on DCP's plan-cache path (below).
4. (all) ``write_data``: refuses a planner that is not a DCP ``DefaultSavePlanner`` (any subclass,
   :class:`~tiered_ckpt.dcp.planners.TieredSavePlanner` included; ``planner=None`` is one);
   encodes every non-tensor value from the planner's own object
   (``planner.lookup_object(item.index)``, never the pickle of ``transform_object``) as
   :func:`~tiered_ckpt.dcp.items.encode_value` does, refusing one that is neither JSON-able nor
   bytes before this rank writes anything; writes the rank's shard durably (the coordinator's with
   the JSON metadata: the planner's ``metadata``, its items placed from the planner's
   ``global_plan``); returns the item results plus one
   (:data:`~tiered_ckpt.dcp.items.SHARD_RESULT_FQN`) carrying the ``ShardRecord``.

DCP's plan caching (``DefaultSavePlanner(enable_plan_caching=True)``): from the second save on, a
rank whose plan has not changed sends an empty plan, the coordinator's ``prepare_global_plan``
gets empty ("unusable") plans, and the rank then writes its cached final plan, whose
:class:`ShardPlan` is the first save's. So the coordinator, seeing an unusable plan, claims the
step's writer lock for the new save id in ``prepare_global_plan`` (before DCP scatters the plans),
and a rank whose :class:`ShardPlan` does not echo this save's nonce takes the save id from that
lock; the placement and the metadata come from the planner (its cached ``global_plan`` and
``metadata``), not from the plans the writer saw.
5. (coordinator) ``finish``: checks the metadata against 4, then ``commit_step`` with
   ``extra["dcp"]``. From then on the step is like any other.

A save killed before 5 leaves an uncommitted directory that readers never see and ``gc`` sweeps
(its lock and temp files name a dead owner). On a failed save :func:`tiered_ckpt.dcp.save` (and
thread-mode ``async_save``) call :meth:`abort` on every rank, so the step can be saved again at
once. A failed save nobody aborts (a plain ``dcp.save``; process-mode ``async_save``, whose writer
is a copy in DCP's checkpoint process; a rank that succeeded while another failed) leaves files
that name a live process, which ``gc`` leaves alone: the process's next save through this writer,
of any step, removes them first (:class:`UnfinishedSaves`: every save a process wrote for and
whose thread has ended since, or is the one saving now, is over; unless its step is committed,
its shard and writer lock are removed and its empty step directory with them; a rank's shard is
judged by its own root's ``manifest.json``). By default every rank writes into the same ``root``
and the coordinator commits every rank's shard; with ``node_ranks`` (node-local roots) it commits
its own node's ranks only and the other nodes are committed after ``dcp.save`` returned
(:mod:`tiered_ckpt.dcp.node_roots`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tiered_ckpt.dcp import metadata_json
from tiered_ckpt.dcp.items import (
    METADATA_TENSOR,
    SHARD_RESULT_FQN,
    ItemLocation,
    check_item,
    encode_value,
    item_name,
    stored_name,
    tensor_array,
)
from tiered_ckpt.dcp.staging import TieredStager
from tiered_ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    ConcurrentSaveError,
    UnsupportedPlannerError,
    UnsupportedStateError,
)
from tiered_ckpt.format.dcp_metadata import EXTRA_FORMAT, EXTRA_KEY
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.fs import new_save_id, unlink_quietly
from tiered_ckpt.layout import SAVE_LOCK_NAME, parse_step_dir_name, step_dir_name
from tiered_ckpt.local.catalogue import is_committed, step_path
from tiered_ckpt.local.commit import (
    check_written_shard,
    claim_save_lock,
    commit_step,
    ensure_step_dir,
    lock_holder,
    release_save_lock,
)
from tiered_ckpt.local.rotation import RotationPolicy, rotate
from tiered_ckpt.local.writer import check_chunk_bytes, write_shard

log = logging.getLogger(__name__)

#: CRC32C chunk size of DCP shards (bytes): partial (resharding) reads verify chunk by chunk.
DCP_CHUNK_BYTES = 16384


@dataclass(frozen=True)
class ShardPlan:
    """The coordinator's word to one rank (its ``SavePlan.storage_data``): the save id shared by all
    ranks, the rank's index, the world size, the rank whose shard holds the DCP metadata and the
    nonce of the rank's local plan (``""``: none), by which the rank tells this save's word from a
    cached one."""

    save_id: str
    rank: int
    world_size: int
    metadata_rank: int
    nonce: str = ""


@dataclass(frozen=True)
class _Unfinished:
    root: Path
    step: int
    save_id: str
    record: ShardRecord | None
    thread: threading.Thread


class UnfinishedSaves:
    """This process's DCP saves that wrote a shard or claimed a writer lock and may not have
    committed (DCP tells a writer nothing when a save fails elsewhere). :meth:`sweep` (every rank's
    ``write_data``, before it writes) removes what such a save left, once it is over: its thread has
    ended or is the caller's (a DCP save runs in one thread from planning to ``finish``, so a thread
    that saves again has finished the earlier save). A save whose step is committed (by it, or by
    a later save that replaced it) is forgotten; otherwise its shard (only if the file is still that save's), its writer lock (only if still
    that save's) and then its step directory if empty are removed. Never raises for a file that is
    gone."""

    _guard = threading.Lock()
    _entries: list[_Unfinished] = []

    @classmethod
    def add(cls, root: Path, step: int, save_id: str, record: ShardRecord | None) -> None:
        with cls._guard:
            cls._entries.append(
                _Unfinished(root, step, save_id, record, threading.current_thread())
            )

    @classmethod
    def forget(cls, root: Path, step: int, save_id: str) -> None:
        with cls._guard:
            cls._entries = [
                e for e in cls._entries if (e.root, e.step, e.save_id) != (root, step, save_id)
            ]

    @classmethod
    def sweep(cls, current_save_id: str | None = None) -> list[Path]:
        """Clean up after every save that is over (see the class docstring) except
        ``current_save_id``; returns the paths removed."""
        me = threading.current_thread()
        with cls._guard:
            over = [
                e
                for e in cls._entries
                if e.save_id != current_save_id and (e.thread is me or not e.thread.is_alive())
            ]
            cls._entries = [e for e in cls._entries if not any(e is o for o in over)]
        removed: list[Path] = []
        for e in over:
            removed += _remove_unfinished(e)
        return removed


def _remove_unfinished(e: _Unfinished) -> list[Path]:
    sdir = step_path(e.root, e.step)
    if is_committed(sdir):
        return []
    removed = []
    if e.record is not None:
        try:
            check_written_shard(sdir, e.record, e.step, e.save_id)
        except CheckpointError:
            pass  # gone, or another save's file now: not ours to remove
        else:
            unlink_quietly(sdir / e.record.path)
            removed.append(sdir / e.record.path)
    if lock_holder(sdir) == e.save_id:
        release_save_lock(sdir, e.save_id)
        removed.append(sdir / SAVE_LOCK_NAME)
    with contextlib.suppress(OSError):
        os.rmdir(sdir)  # only when empty: another save may be writing into it
        removed.append(sdir)
    if removed:
        log.warning(
            "step %d: removed what the unfinished DCP save %s left in %s: %s",
            e.step,
            e.save_id,
            sdir,
            [p.name for p in removed],
        )
    return removed


def step_of_checkpoint_id(checkpoint_id: str | os.PathLike[str]) -> tuple[Path, int]:
    """``(root, step)`` of a step directory path ``<root>/step_XXXXXXXXXX``; ``ValueError``
    otherwise."""
    p = Path(checkpoint_id)
    step = parse_step_dir_name(p.name)
    if step is None:
        raise ValueError(
            f"checkpoint_id {str(checkpoint_id)[:200]!r} is not a step directory <root>/step_XXXXXXXXXX"
        )
    return p.parent, step


def is_step_checkpoint_id(checkpoint_id: str | os.PathLike[str]) -> bool:
    """Whether ``checkpoint_id`` names a step directory ``<root>/step_XXXXXXXXXX`` (no I/O): the
    writer's and the reader's ``validate_checkpoint_id``."""
    try:
        step_of_checkpoint_id(checkpoint_id)
    except (ValueError, TypeError):
        return False
    return True


#: The nonce of each rank's last usable plan the coordinator of this process saw (DCP's plan cache is
#: per process too): a plan that carries it again is a cached one.
_LAST_NONCES: dict[int, str] = {}


class TieredStorageWriter(StorageWriter, AsyncStager):
    """Writes a DCP save as step ``step`` of the local root ``root`` (see the module docstring for
    the lifecycle). ``replace``: re-save a committed step (it is un-committed first); otherwise a
    committed step raises :class:`~tiered_ckpt.errors.CheckpointExistsError` in planning, before
    anything is written. ``extra``: JSON step metadata for the manifest (the key ``"dcp"`` is the
    backend's). ``chunk_bytes``: the shards' CRC32C chunk size (power of two, 4 KiB .. 1 GiB).
    ``rotation``: applied right after the commit, in ``finish``
    (:func:`tiered_ckpt.local.rotation.rotate`; a failure is logged, the save stays committed).
    ``run_id``/``attempt``: the lineage the manifest records (default: the root's ``run.json``; see
    :func:`~tiered_ckpt.local.commit.commit_step`). ``node_ranks``: the ranks that share this
    rank's ``root`` when roots are node-local (:func:`tiered_ckpt.dcp.node_roots.node_groups`); the
    coordinator then commits only those ranks' shards (``node_ranks.json`` says so) and records the
    metadata's sha256 for the other nodes' copies. ``None``: one root for every rank.

    ``dcp.async_save`` stages through the writer (DCP's ``AsyncStager`` protocol): the copy of
    ``stager`` (a :class:`~tiered_ckpt.dcp.staging.TieredStager`: parallel copy threads, buffers
    reused from one save to the next; pass the same one to every writer to reuse them), or, by
    default, a stager of this writer's own (its buffers live as long as the writer).

    Picklable (process-mode ``async_save``; the stager travels without its buffers).
    ``ValueError`` for a bad step, ``extra`` or ``chunk_bytes``.
    """

    _synchronize_after_execute = False  # stage() returns a finished copy

    def __init__(
        self,
        root: str | os.PathLike[str],
        step: int,
        *,
        replace: bool = False,
        extra: dict[str, Any] | None = None,
        chunk_bytes: int = DCP_CHUNK_BYTES,
        rotation: RotationPolicy | None = None,
        run_id: str | None = None,
        attempt: int | None = None,
        node_ranks: Sequence[int] | None = None,
        stager: TieredStager | None = None,
    ) -> None:
        super().__init__()
        step_dir_name(step)  # validates step
        if extra is not None and (not isinstance(extra, dict) or EXTRA_KEY in extra):
            raise ValueError(
                f"extra must be a dict without the key {EXTRA_KEY!r} (the DCP backend's)"
            )
        self.root = Path(root).absolute()
        self.step = step
        self.replace = replace
        self.extra = dict(extra) if extra is not None else None
        self.chunk_bytes = check_chunk_bytes(chunk_bytes)
        self.rotation, self.run_id, self.attempt = rotation, run_id, attempt
        self.node_ranks = sorted(int(r) for r in node_ranks) if node_ranks is not None else None
        self.stager = stager
        self._own_stager = stager is None
        self._reset_save()

    # --- staging (dcp.async_save)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` in host buffers (:meth:`TieredStager.stage
        <tiered_ckpt.dcp.staging.TieredStager.stage>` of :attr:`stager`, made on first use)."""
        if self.stager is None:
            self.stager = TieredStager()
        return self.stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns a finished copy."""

    def close(self) -> None:
        """Free the buffers of a stager this writer made itself (not of one passed in)."""
        if self._own_stager and self.stager is not None:
            self.stager.close()
            self.stager = None

    def _reset_save(self) -> None:
        self.is_coordinator = False
        self.rank = 0
        self.save_id: str | None = None
        self._nonce = ""
        self._placement: dict[MetadataIndex, ItemLocation] = {}
        self._metadata_bytes: bytes | None = None
        self._written: ShardRecord | None = None

    # --- 0. identity

    @property
    def checkpoint_id(self) -> str:
        """The step directory (what DCP logs)."""
        return str(step_path(self.root, self.step))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` names a step directory ``<root>/step_XXXXXXXXXX`` (no I/O)."""
        return is_step_checkpoint_id(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins; with ``checkpoint_id`` (a step directory) it goes to that root and
        step."""
        if checkpoint_id is not None:
            self.root, self.step = step_of_checkpoint_id(checkpoint_id)
            self.root = self.root.absolute()
        self._reset_save()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    # --- 1-3. planning

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise CheckpointError(
                "the tiered DCP backend needs use_collectives=True (one commit for all ranks)"
            )
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse (:class:`UnsupportedStateError` naming the key) an item a shard cannot hold, then
        tag the plan with this rank's step and this save's nonce."""
        for item in plan.items:
            dtype = item.tensor_data.properties.dtype if item.tensor_data is not None else None
            check_item(item.index, None if item.type == WriteItemType.BYTE_IO else dtype)
        self._nonce = new_save_id()
        return dataclasses.replace(plan, storage_data={"step": self.step, "nonce": self._nonce})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator's planning (see the module docstring, step 3). Raises
        :class:`ConcurrentSaveError` (ranks of other steps, or another live save holds the step),
        :class:`CheckpointExistsError`, and on the plan-cache path the errors of claiming the
        writer lock."""
        tags = [p.storage_data if isinstance(p.storage_data, dict) else {} for p in plans]
        # A plan DCP took from its cache: empty (unusable), or merged from a rank's cached plan,
        # whose nonce this coordinator has seen before (a fresh one is new at every save).
        cached = [
            not p.usable or _LAST_NONCES.get(rank) == t.get("nonce", "")
            for rank, (p, t) in enumerate(zip(plans, tags))
        ]
        for rank, (p, t) in enumerate(zip(plans, tags)):
            if p.usable and t.get("nonce"):
                _LAST_NONCES[rank] = str(t["nonce"])
        steps = {t.get("step") for t, c in zip(tags, cached) if not c}
        if steps - {self.step}:
            raise ConcurrentSaveError(
                f"the ranks of one DCP save write different steps: {sorted(map(str, steps))[:8]}"
            )
        if not self.replace and is_committed(step_path(self.root, self.step)):
            raise CheckpointExistsError(
                f"step {self.step} is already committed under {self.root}; "
                "pass replace=True to overwrite it"
            )
        save_id = new_save_id()
        if any(cached):
            # DCP's plan cache: some ranks will write their cached plan, whose ShardPlan is an
            # earlier save's; they find this save's id in the writer lock, claimed before DCP
            # scatters the plans.
            sdir = ensure_step_dir(self.root, self.step)
            claim_save_lock(sdir, self.step, save_id)
            UnfinishedSaves.add(self.root, self.step, save_id, None)
            log.debug(
                "rank %d step %d: ranks %s write plans from DCP's cache; save %s named by the lock",
                self.rank,
                self.step,
                [r for r, c in enumerate(cached) if c][:16],
                save_id,
            )
        self.save_id = save_id
        return [
            dataclasses.replace(
                p,
                storage_data=ShardPlan(
                    save_id, rank, len(plans), self.rank, str(tags[rank].get("nonce", ""))
                ),
            )
            for rank, p in enumerate(plans)
        ]

    def _save_id_of(self, sp: ShardPlan) -> str:
        """This save's id: the ShardPlan's when it echoes this rank's nonce, else (a plan DCP took
        from its cache) the one in the step's writer lock, which the coordinator claimed for this
        save. Raises :class:`CheckpointError` when there is none."""
        if sp.nonce and sp.nonce == self._nonce:
            return sp.save_id
        sid = lock_holder(step_path(self.root, self.step))
        if sid is None:
            raise CheckpointError(
                f"step {self.step}: the save plan is an earlier save's (DCP's plan cache) and the "
                "step has no writer lock naming this save"
            )
        return sid

    # --- 4. write

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's shard (see the module docstring, step 4). Raises
        :class:`UnsupportedPlannerError` (before anything is written) for a planner that is not a
        ``DefaultSavePlanner``, :class:`UnsupportedStateError` naming the key (before this rank
        writes anything) for a value neither tensor, JSON-able nor bytes, and the errors of
        :func:`~tiered_ckpt.local.writer.write_shard`."""
        if not isinstance(planner, DefaultSavePlanner):
            raise UnsupportedPlannerError(
                f"TieredStorageWriter writes with DCP's DefaultSavePlanner or a subclass of it "
                f"(planner=None, DefaultSavePlanner(...), tiered_ckpt.dcp.TieredSavePlanner), not "
                f"{type(planner).__module__}.{type(planner).__qualname__}"
            )
        sp = plan.storage_data
        if not isinstance(sp, ShardPlan):
            raise CheckpointError(
                f"the save plan carries no ShardPlan from prepare_global_plan ({type(sp).__name__})"
            )
        save_id = self._save_id_of(sp)
        self.save_id = save_id
        UnfinishedSaves.sweep(save_id)
        arrays: dict[str, np.ndarray] = {}
        results: list[WriteResult] = []
        if sp.rank == sp.metadata_rank:
            self._placement = self._placement_of(planner)
            self._metadata_bytes = metadata_json.encode(self._stored_metadata(planner))
            arrays[METADATA_TENSOR] = np.frombuffer(self._metadata_bytes, dtype=np.uint8)
        for item in plan.items:
            key = item_name(item.index)
            if item.type == WriteItemType.BYTE_IO:
                raw = encode_value(planner.lookup_object(item.index), item.index.fqn)
                arr = np.frombuffer(raw, dtype=np.uint8)
            else:
                arr = self._tensor_array(planner.resolve_data(item), item)
            arrays[key] = arr
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=arr.nbytes,
                    storage_data=ItemLocation(sp.rank, stored_name(key)),
                )
            )
        rec = write_shard(
            self.root,
            self.step,
            sp.rank,
            arrays,
            save_id=save_id,
            replace=self.replace,
            chunk_bytes=self.chunk_bytes,
        )
        self._written = rec
        UnfinishedSaves.add(self.root, self.step, save_id, rec)
        results.append(
            WriteResult(
                index=MetadataIndex(SHARD_RESULT_FQN),
                size_in_bytes=rec.size_bytes,
                storage_data=rec.to_json(),
            )
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    @staticmethod
    def _placement_of(planner: DefaultSavePlanner) -> dict[MetadataIndex, ItemLocation]:
        """Where each item of the save lies: the rank whose plan writes it in the planner's global
        plan (the full one, also on DCP's plan-cache path). Raises :class:`CheckpointError` when
        the planner has none (create_global_plan did not run)."""
        plans = getattr(planner, "global_plan", None)
        if not isinstance(plans, list):
            raise CheckpointError(
                "the planner has no global plan on the coordinator (create_global_plan did not run)"
            )
        return {
            item.index: ItemLocation(rank, stored_name(item_name(item.index)))
            for rank, p in enumerate(plans)
            for item in p.items
        }

    @staticmethod
    def _tensor_array(t: Any, item: Any) -> np.ndarray:
        if not isinstance(t, torch.Tensor):
            raise UnsupportedStateError(
                f"state key {item.index.fqn[:200]!r}: the planner resolved a "
                f"{type(t).__name__}, not a tensor"
            )
        want = (
            tuple(item.tensor_data.chunk.sizes) if item.tensor_data is not None else tuple(t.shape)
        )
        want_dtype = item.tensor_data.properties.dtype if item.tensor_data is not None else t.dtype
        if tuple(t.shape) != want or t.dtype != want_dtype:  # the state changed after planning
            raise UnsupportedStateError(
                f"state key {item.index.fqn[:200]!r}: tensor of shape {tuple(t.shape)} "
                f"and dtype {t.dtype}, the plan says {want} and {want_dtype}"
            )
        return tensor_array(t, item.index.fqn)

    def _stored_metadata(self, planner: DefaultSavePlanner) -> Metadata:
        """The coordinator's global metadata as it is stored: the planner's (``metadata``, set by
        ``DefaultSavePlanner.create_global_plan``, cached or not), with the placement, the storage
        meta and DCP's version."""
        md = getattr(planner, "metadata", None)
        if not isinstance(md, Metadata):
            raise CheckpointError(
                "the planner has no global metadata on the coordinator (create_global_plan "
                "did not run)"
            )
        return dataclasses.replace(
            md,
            storage_data=dict(self._placement),
            storage_meta=self.storage_meta(),
            version=CURRENT_DCP_VERSION,
        )

    # --- 5. commit

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit the step (coordinator; see the module docstring, step 5). Fills ``metadata`` in
        place as stored. Raises :class:`CheckpointError` when the results or the metadata disagree
        with what was written, and the errors of :func:`~tiered_ckpt.local.commit.commit_step`."""
        records = [
            ShardRecord.from_json(wr.storage_data)
            for rank_results in results
            for wr in rank_results
            if wr.index.fqn == SHARD_RESULT_FQN
        ]
        if sorted(r.rank for r in records) != list(range(len(results))):
            raise CheckpointError(
                f"step {self.step}: write results hold shard records of ranks "
                f"{sorted(r.rank for r in records)[:8]} for {len(results)} ranks"
            )
        metadata.storage_data = dict(self._placement)
        metadata.storage_meta = self.storage_meta()
        metadata.version = CURRENT_DCP_VERSION
        if self._metadata_bytes is None or metadata_json.encode(metadata) != self._metadata_bytes:
            raise CheckpointError(
                f"step {self.step}: the metadata given to finish differs from the one written "
                "in the coordinator's shard (did a planner change it after create_global_plan?)"
            )
        info = {
            "format": EXTRA_FORMAT,
            "metadata_rank": self.rank,
            "metadata_tensor": METADATA_TENSOR,
            "metadata_bytes": len(self._metadata_bytes),
        }
        if self.node_ranks is not None:  # node-local: other nodes keep a checked copy
            info["metadata_sha256"] = hashlib.sha256(self._metadata_bytes).hexdigest()
        commit_step(
            self.root,
            self.step,
            len(results),
            records,
            {**(self.extra or {}), EXTRA_KEY: info},
            save_id=self.save_id,
            replace=self.replace,
            run_id=self.run_id,
            attempt=self.attempt,
            local_ranks=self.node_ranks,
        )
        if self.rotation is not None:
            try:
                rotate(self.root, self.rotation, rank=self.rank, just_committed=self.step)
            except (
                OSError
            ) as exc:  # the save itself succeeded; retention retries after the next one
                log.error("step %d: rotation after the commit failed: %s", self.step, exc)

    def abort(self) -> None:
        """After a save that failed on some rank (call on every rank, after DCP returned): unless
        the step got committed, this rank's shard of this save is removed if the file is still this
        save's (not when another save of the step has replaced it since) and the writer lock
        released if it is still this save's. Nothing happens for a save that wrote nothing here.
        Never raises for a missing file."""
        sdir = step_path(self.root, self.step)
        if self.save_id is None:
            return
        UnfinishedSaves.forget(self.root, self.step, self.save_id)
        if is_committed(sdir):
            return
        rec, self._written = self._written, None
        if rec is not None:
            try:
                check_written_shard(sdir, rec, self.step, self.save_id)
            except CheckpointError:
                pass  # gone, or another save's file now: not ours to remove
            else:
                unlink_quietly(sdir / rec.path)
        release_save_lock(sdir, self.save_id)


__all__ = [
    "DCP_CHUNK_BYTES",
    "EXTRA_FORMAT",
    "EXTRA_KEY",
    "ShardPlan",
    "TieredStorageWriter",
    "UnfinishedSaves",
    "is_step_checkpoint_id",
    "step_of_checkpoint_id",
]
