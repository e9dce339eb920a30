"""DCPCheckpointManager: the DCP engine of :class:`~tiered_ckpt.training.core.ManagerCore` for a
torchtitan-style loop (every rank; one shared ``root``, or node-local roots)::

    mgr = DCPCheckpointManager(root, save_every_steps=100, remote_url="s3://bucket/run")  # collective
    state = {"model": msd, "optim": osd, "extra": {...}}   # msd, osd = get_state_dict(model, optimizer)
    mgr.load(into=state)                     # NoCheckpointError: fresh start; then set_state_dict(...)
    step = mgr.loaded_step
    ...
    if mgr.should_save(step):
        mgr.save(step, state)                # returns once DCP has staged the state
    mgr.close()

Saves run through **DCP's** async machinery: ``dcp.async_save`` (:func:`tiered_ckpt.dcp.async_save`)
with one :class:`~tiered_ckpt.dcp.staging.TieredStager` kept for the manager's life (parallel copy
threads, buffers reused from one save to the next) and, in ``async_mode="thread"``, the save
group of a :class:`~tiered_ckpt.training.dist.SaveCoordinator` (a dedicated gloo group); in
``"process"`` mode DCP's checkpoint process runs the save (scripts need a ``__main__`` guard).
Rotation and upload gating run at the commit, in the storage writer's ``finish`` on DCP's
coordinator (:class:`~tiered_ckpt.dcp.storage_writer.TieredStorageWriter` carries the rotation
policy and lineage). A load at another world size is resharded by DCP; with ``remote_url`` a step
missing locally is restored from the bucket first, and a shard still missing is read from the bucket
(ranged, verified reads). torch.distributed not initialized: one process, no process group.

Node-local roots (the ranks of a node pass one directory, each node its own): which ranks share a
root is found once, at construction (node token files, :func:`tiered_ckpt.dcp.node_roots.node_groups`
on the save group); each save then commits every node's root (:mod:`tiered_ckpt.dcp.node_roots`),
each node's lowest rank rotating its own root. A load then needs each rank's own shard (restored
from the bucket when missing, as the native manager does), so it loads at the saved world size only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tiered_ckpt.dcp import api
from tiered_ckpt.dcp.node_roots import group_of, node_groups
from tiered_ckpt.dcp.staging import TieredStager
from tiered_ckpt.errors import CheckpointError
from tiered_ckpt.training.core import ManagerCore, SaveOutcome
from tiered_ckpt.training.dist import SaveCoordinator

_ASYNC_MODES = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}


class DCPCheckpointManager(ManagerCore):
    """Periodic, asynchronous DCP checkpointing into ``root``, shared or node-local (the shared
    keywords: :class:`~tiered_ckpt.training.core.ManagerCore`).

    ``process_group``: the ranks that save (default: the whole job when torch.distributed is
    initialized). ``async_mode`` (with ``async_save``): ``"thread"`` or ``"process"`` (needs
    torch.distributed initialized). ``save``'s state: a DCP state dict (non-tensor values JSON or
    ``bytes``); ``extra`` has no key ``"dcp"``. ``load()`` without ``into`` loads every item of the
    step as saved (plain CPU tensors of the global shape; on every rank). :class:`SaveOutcome`
    ``committed_here``: this rank is DCP's coordinator, or on node-local roots its node's lowest
    rank. ``handle_sigterm``: :meth:`install_sigterm_handler` (the final save is synchronous).
    Raises ``ValueError`` for a bad setting, ``DistributedSaveError`` when finding which ranks share
    a root fails.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        async_save: bool = True,
        save_timeout_s: float | None = 3600.0,
        handle_sigterm: bool = False,
        keep_last: int = 3,
        upload_gated: bool | None = None,
        max_pending_uploads: int = 8,
        keep_every_steps: int | None = None,
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        remote_url: str | None = None,
        s3_client: Any = None,
        on_save_outcome: Callable[[SaveOutcome], None] | None = None,
        collective_timeout_s: float = 600.0,
        process_group: Any = None,
        async_mode: str = "thread",
    ) -> None:
        if async_mode not in _ASYNC_MODES:
            raise ValueError(f"async_mode must be 'thread' or 'process', got {async_mode!r}")
        distributed = dist.is_available() and dist.is_initialized()
        if async_save and async_mode == "process" and not distributed:
            raise ValueError(
                "async_mode='process' needs torch.distributed initialized (DCP's checkpoint "
                "process joins the job's rendezvous)"
            )
        rank = dist.get_rank(process_group) if distributed else 0
        world_size = dist.get_world_size(process_group) if distributed else 1
        coord = None
        if distributed or process_group is not None:
            coord = SaveCoordinator(
                rank,
                world_size,
                process_group,
                timeout_s=collective_timeout_s,
                shared_filesystem=True,
            )
        groups = None
        if coord is not None and world_size > 1:
            found = node_groups(root, coord.save_group)
            groups = found if len(found) > 1 else None
        self.node_groups: list[list[int]] | None = groups
        super().__init__(
            root,
            rank=rank,
            world_size=world_size,
            coord=coord,
            async_save=async_save,
            save_timeout_s=save_timeout_s,
            handle_sigterm=handle_sigterm,
            keep_last=keep_last,
            upload_gated=upload_gated,
            max_pending_uploads=max_pending_uploads,
            keep_every_steps=keep_every_steps,
            save_every_steps=save_every_steps,
            save_every_seconds=save_every_seconds,
            remote_url=remote_url,
            s3_client=s3_client,
            on_save_outcome=on_save_outcome,
            resharding=groups is None,
        )
        self.async_mode = async_mode
        self._stager = TieredStager() if async_save else None

    def _writer_kw(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        assert self._lineage is not None
        return {
            "process_group": self._coord.save_group if self._coord is not None else None,
            "node_groups": self.node_groups or [list(range(self.world_size))],
            "rotation": self.rotation,
            "run_id": self._lineage.run_id,
            "attempt": self._lineage.attempt,
            "extra": dict(extra) if extra is not None else None,
        }

    def _save_sync(self, step: int, state: Any, extra: Mapping[str, Any] | None) -> bool:
        api.save(state, self.root, step, **self._writer_kw(extra))
        return self._committer

    def _save_async(
        self, step: int, state: Any, extra: Mapping[str, Any] | None
    ) -> tuple[Future[Any], float]:
        t0 = time.perf_counter()
        fut = api.async_save(
            state,
            self.root,
            step,
            async_stager=self._stager,
            async_checkpointer_type=_ASYNC_MODES[self.async_mode],
            **self._writer_kw(extra),
        )
        staged = time.perf_counter()
        out: Future[Any] = Future()

        def done(f: Future[Any]) -> None:
            def persist() -> bool:
                if f.cancelled():
                    raise CheckpointError("the save was cancelled")
                f.result()
                return self._committer

            try:
                self._finish_save(step, staged, staged - t0, persist)
            except BaseException as exc:  # noqa: BLE001 - handed to wait() through the future
                out.set_exception(exc)
            else:
                out.set_result(None)

        fut.add_done_callback(done)
        return out, staged - t0

    @property
    def _committer(self) -> bool:
        """Whether this rank commits a root: DCP's coordinator, and each node's lowest rank."""
        if self.node_groups is None:
            return self.rank == 0
        return self.rank == group_of(self.node_groups, self.rank)[0]

    def _load(self, step: int, into: Any) -> Any:
        state = into if into is not None else {}
        api.load(
            state,
            self.root,
            step,
            process_group=self._coord.policy_group if self._coord is not None else None,
            remote_url=self.remote_url,
            s3_client=self.s3_client,
            whole_step=into is None,
        )
        return state

    def _release(self, hung: bool) -> None:
        """DCP's checkpoint process (``"process"`` mode) is DCP's: it ends with this process."""
        if self._stager is not None:
            self._stager.close()
        super()._release(hung)


__all__ = ["DCPCheckpointManager"]
