"""CheckpointManager: the native engine of :class:`~tiered_ckpt.training.core.ManagerCore` (one
safetensors shard per rank, ``manifest.json`` committed last, rotation after the commit).

``save`` stages the state (copies arrays into reused host buffers on a pool of copy threads,
deep-copies JSON; :class:`~tiered_ckpt.training.staging.Stager`) in the caller's
thread, then one background thread writes the shard, hashes it, gathers the records, commits and
rotates (:class:`~tiered_ckpt.training.dist.SaveCoordinator` for several ranks). ``load`` reads this
rank's shard (:func:`tiered_ckpt.local.load_shard`), restoring it from the bucket first when it is
missing locally (:mod:`tiered_ckpt.training.resume`). torch is imported only for several ranks, a
given ``process_group`` or a torch tensor in ``load(into=...)``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from tiered_ckpt.fs import new_save_id
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.load_committed import load_shard
from tiered_ckpt.local.rotation import rotate
from tiered_ckpt.local.writer import write_shard
from tiered_ckpt.training.core import OUTCOME_HISTORY, ManagerCore, SaveOutcome, SavePolicy
from tiered_ckpt.training.staging import Stager, copy_json

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

__all__ = ["OUTCOME_HISTORY", "CheckpointManager", "SaveOutcome", "SavePolicy", "fill_in_place"]


class CheckpointManager(ManagerCore):
    """Periodic, asynchronous, multi-rank checkpointing into ``root`` (the shared keywords:
    :class:`~tiered_ckpt.training.core.ManagerCore`).

    ``rank``/``world_size``: within ``process_group`` (default: the whole job). For ``world_size >
    1`` torch.distributed must be initialized, and constructing the manager is a collective (two
    gloo groups with ``collective_timeout_s``). ``shared_filesystem``: ``root`` is the same
    directory for every node (rank 0 alone commits); by default each node's lowest rank commits the
    global manifest into its own root.

    ``save``'s ``state``: nested ``dict`` of ``str`` -> numpy array / ``GlobalSlice`` /
    ``Replicated`` / JSON value (or torch tensors, converted bit-exactly); an unstorable value raises
    ``UnsupportedStateError`` before anything starts. A ``Replicated`` value must be identical on
    every rank (sha256-checked before anything is written: ``ReplicatedMismatchError``) and is
    stored once per node.
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
        s3_client: Any = None,  # a botocore S3 client (no interface type for it above store/)
        on_save_outcome: Callable[[SaveOutcome], None] | None = None,
        collective_timeout_s: float = 600.0,
        process_group: ProcessGroup | None = None,
        rank: int = 0,
        world_size: int = 1,
        shared_filesystem: bool = False,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank ({rank}) < world_size ({world_size})")
        coord = None
        if world_size > 1 or process_group is not None:
            from tiered_ckpt.training.dist import SaveCoordinator  # imports torch

            coord = SaveCoordinator(
                rank,
                world_size,
                process_group,
                timeout_s=collective_timeout_s,
                shared_filesystem=shared_filesystem,
            )
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
        )
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tiered-ckpt-save-r{rank}")
            if async_save
            else None
        )
        self._stager = Stager()

    def _save_sync(self, step: int, state: Any, extra: Mapping[str, Any] | None) -> bool:
        assert self._lineage is not None
        lin = {"run_id": self._lineage.run_id, "attempt": self._lineage.attempt}
        wall = time.monotonic() - self._started
        if self._coord is not None:
            return self._coord.save(self.root, step, state, extra, wall, **lin).committed_here
        sid = new_save_id()
        rec = write_shard(self.root, step, self.rank, state, save_id=sid)
        commit_step(self.root, step, 1, [rec], extra, save_id=sid, wall_clock_seconds=wall, **lin)
        return True

    def _save_async(
        self, step: int, state: Any, extra: Mapping[str, Any] | None
    ) -> tuple[Future[Any], float]:
        assert self._executor is not None
        t0 = time.perf_counter()
        staged = self._stager.stage(state)
        extra_copy = copy_json(dict(extra), "extra") if extra is not None else None
        stage_s = time.perf_counter() - t0
        log.debug(
            "rank %d step %d: staged %d bytes in %.3f s",
            self.rank,
            step,
            self._stager.nbytes,
            stage_s,
        )

        def persist() -> None:
            # Hand the GIL straight back to the caller of save(): otherwise this thread may hold it
            # for a whole switch interval (5 ms) of Python bookkeeping before save() can return.
            time.sleep(0)
            started = time.perf_counter()
            self._finish_save(
                step, started, stage_s, lambda: self._save_sync(step, staged, extra_copy)
            )

        return self._executor.submit(persist), stage_s

    def _after_commit(self, step: int) -> None:
        try:
            rotate(self.root, self.rotation, rank=self.rank, just_committed=step)
        except OSError as exc:  # the save itself succeeded; retention retries after the next one
            log.error("rank %d step %d: rotation failed: %s", self.rank, step, exc)

    def _load(self, step: int, into: Any) -> Any:
        state = load_shard(self.root, self.rank, self.world_size, step)
        return state if into is None else fill_in_place(into, state)

    def _release(self, hung: bool) -> None:
        if self._executor is not None:  # a hung save's thread is left behind, not waited for
            self._executor.shutdown(wait=not hung, cancel_futures=hung)
        self._stager.close()
        super()._release(hung)


def fill_in_place(into: MutableMapping[str, Any], state: Mapping[str, Any]) -> Any:
    """Copy ``state`` into ``into`` and return ``into``: a numpy array or torch tensor of ``into``
    with the loaded value's shape and dtype is copied into (``np.copyto`` / ``Tensor.copy_``),
    nested dicts are recursed, every other value is replaced. Keys only in ``into`` stay."""
    for key, value in state.items():
        dst = into.get(key)
        if isinstance(dst, MutableMapping) and isinstance(value, Mapping):
            fill_in_place(dst, value)
        elif (
            isinstance(dst, np.ndarray)
            and isinstance(value, np.ndarray)
            and (dst.shape, dst.dtype) == (value.shape, value.dtype)
        ):
            np.copyto(dst, value)
        elif isinstance(value, np.ndarray) and type(dst).__module__.startswith("torch"):
            from tiered_ckpt.training.torch_tensors import numpy_to_tensor  # imports torch

            src = numpy_to_tensor(value)
            if (src.shape, src.dtype) == (dst.shape, dst.dtype):
                dst.copy_(src)
            else:
                into[key] = src
        else:
            into[key] = value
    return into
