"""DCPCheckpointManager: periodic DCP saves of a torchtitan-style training loop into the tiers.

Three lines in the loop (every rank, the ranks sharing one ``root``)::

    mgr = DCPCheckpointManager(root, save_every_steps=100, remote_url="s3://bucket/run")  # collective
    state = {"model": msd, "optim": osd, "extra": {...}}   # msd, osd = get_state_dict(model, optimizer)
    step = mgr.load(into=state)              # NoCheckpointError: fresh start; then set_state_dict(...)
    ...
    if mgr.should_save(step):
        mgr.save(step, state)                # returns once DCP has staged the state
    mgr.close()                              # waits for the last save, raises its failure

Whose async machinery runs: **DCP's**. ``save`` calls ``dcp.async_save`` (through
:func:`tiered_ckpt.dcp.async_save`) with one ``DefaultStager`` kept for the manager's life (its
staging buffers are reused across saves) and, in ``"thread"`` mode, the save group of a
:class:`~tiered_ckpt.training.dist.SaveCoordinator` (a dedicated gloo group, so the background
thread's collectives never meet the training loop's); in ``"process"`` mode DCP's checkpoint process
runs the save (it builds its own gloo group; scripts need a ``if __name__ == "__main__":`` guard).
This manager only keeps DCP's future: the next ``save`` (and ``wait``, ``load``, ``close``) waits
for it first and raises its failure as :class:`~tiered_ckpt.errors.CheckpointError` instead of doing
anything else, as :meth:`tiered_ckpt.CheckpointManager.wait` does. ``async_mode=None`` saves inside
``save`` (``dcp.save``).

Where rotation and upload gating hook in: **at the commit**, in the storage writer's ``finish`` on
DCP's coordinator (:class:`~tiered_ckpt.dcp.storage_writer.TieredStorageWriter`, given this
manager's :class:`~tiered_ckpt.local.rotation.RotationPolicy` and lineage): right after
``manifest.json`` is committed, :func:`tiered_ckpt.local.rotation.rotate` runs there, in whichever
thread or process DCP runs ``finish`` in (``upload_gated``: steps the sidecar has not uploaded are
kept, up to ``max_pending_uploads``).

Lineage (SPEC §11) and resume: :meth:`load` (or the first :meth:`save` without one) decides the run
and attempt every save records (:class:`~tiered_ckpt.training.lineage_decision.LineageDecider`,
collectives on the coordinator's policy group). A load at another world size than the save's is
legal: DCP reshards through its planner (``resharding=True``). With ``remote_url``, a step missing
locally (a lost cluster) is restored from the bucket by rank 0 first; a shard still missing is read
from the bucket by the DCP reader (ranged, verified reads).

Every rank's ``root`` must be one shared directory (the DCP backend commits every rank's shard from
the coordinator). torch.distributed initialized: constructing the manager is a collective (two
``new_group`` calls); not initialized: one process, no process group.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tiered_ckpt.dcp import api
from tiered_ckpt.errors import CheckpointError
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.local.rotation import RotationPolicy
from tiered_ckpt.training.dist import SaveCoordinator
from tiered_ckpt.training.lineage_decision import LineageDecider
from tiered_ckpt.training.outcomes import SaveOutcome, SavePolicy

log = logging.getLogger(__name__)

_ASYNC_MODES = {
    "thread": AsyncCheckpointerType.THREAD,
    "process": AsyncCheckpointerType.PROCESS,
    None: None,
}


class DCPCheckpointManager:
    """Periodic, asynchronous DCP checkpointing into ``root`` (see the module docstring).

    ``process_group``: the ranks that save (default: the whole job when torch.distributed is
    initialized). ``save_every_steps`` / ``save_every_seconds``: :class:`SavePolicy`. ``keep_last``,
    ``upload_gated``, ``max_pending_uploads``, ``keep_every_steps``: :class:`RotationPolicy`,
    applied at each commit. ``remote_url`` (``s3://bucket/prefix``, the sidecar's) and
    ``remote_s3_client`` (an injected botocore client; default boto3's chain): where :meth:`load`
    restores from (the restore and the DCP reader's ranged reads of a shard still missing both use
    the client). ``async_mode``: ``"thread"``, ``"process"`` (needs torch.distributed initialized)
    or ``None`` (synchronous). ``collective_timeout_s``: timeout of the manager's gloo groups
    (seconds). ``on_save_outcome``: called with each save's
    :class:`~tiered_ckpt.training.SaveOutcome` on every rank (``seconds``: from the end of staging
    to DCP's future completing, i.e. write + ``finish``'s commit and rotation; the whole save when
    synchronous; ``stage_seconds``: how long ``save`` blocked to stage; ``committed_here``: this
    rank is DCP's coordinator, which commits), in the thread that completes DCP's future (the
    background thread when async), before the next save starts. As for
    :class:`tiered_ckpt.CheckpointManager`: quick, no call into the manager; an exception it raises
    is logged and does not change the save's result.

    Raises ``ValueError`` for a bad setting, ``CheckpointError`` for a ``process_group`` without
    torch.distributed initialized.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        process_group: Any = None,
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        keep_last: int = 3,
        upload_gated: bool = False,
        max_pending_uploads: int = 8,
        keep_every_steps: int | None = None,
        remote_url: str | None = None,
        remote_s3_client: Any = None,
        async_mode: str | None = "thread",
        collective_timeout_s: float = 600.0,
        on_save_outcome: Callable[[SaveOutcome], None] | None = None,
    ) -> None:
        if async_mode not in _ASYNC_MODES:
            raise ValueError(f"async_mode must be 'thread', 'process' or None, got {async_mode!r}")
        distributed = dist.is_available() and dist.is_initialized()
        if async_mode == "process" and not distributed:
            raise ValueError(
                "async_mode='process' needs torch.distributed initialized (DCP's checkpoint "
                "process joins the job's rendezvous)"
            )
        self.root = Path(root).absolute()
        self.policy = SavePolicy(save_every_steps, save_every_seconds)
        self.rotation = RotationPolicy(
            keep_last, upload_gated, max_pending_uploads, keep_every_steps=keep_every_steps
        )
        self.async_mode = async_mode
        self.remote_url = remote_url
        self._remote_s3_client = remote_s3_client
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        self.root.mkdir(parents=True, exist_ok=True)
        self._coord: SaveCoordinator | None = None
        if distributed or process_group is not None:
            self._coord = SaveCoordinator(
                self.rank,
                self.world_size,
                process_group,
                timeout_s=collective_timeout_s,
                shared_filesystem=True,
            )
        self._decider = LineageDecider(
            self.root,
            self.rank,
            self._coord,
            remote_url=remote_url,
            s3_client=remote_s3_client,
            world_size=self.world_size,
        )
        self._lineage: RunLineage | None = None
        self._stager = (
            DefaultStager(StagingOptions(False, False, False, False)) if async_mode else None
        )
        self._future: Future[Any] | None = None
        self._pending_step: int | None = None
        self._last_commit = time.monotonic()
        self._closed = False
        self._on_save_outcome = on_save_outcome

    # --- policy

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step`` (:meth:`SavePolicy.due`; rank 0's clock for the time policy).
        With several ranks and ``save_every_seconds`` a collective (one all-reduce on the policy
        group): call it on every rank at every step."""
        judge = self._coord is None or self.rank == 0
        due = self.policy.due(step, time.monotonic() - self._last_commit if judge else None)
        if self._coord is not None and self.policy.save_every_seconds is not None:
            (due,) = self._coord.any_true([due])
        return due

    # --- save

    def save(
        self, step: int, state: dict[str, Any], extra: Mapping[str, Any] | None = None
    ) -> None:
        """Save the DCP state dict ``state`` (e.g. ``{"model": ..., "optim": ..., "extra": {...}}``
        from ``get_state_dict``; non-tensor values JSON or ``bytes``) as step ``step`` (every rank,
        same ``step``). ``extra``: step-level JSON for the manifest (the coordinator's is used; no
        key ``"dcp"``). Async: returns once DCP has staged the state (the caller may then change
        every tensor). First waits for the previous save and raises its failure instead of starting
        this one; a synchronous save raises its own (``UnsupportedStateError`` naming the key,
        before anything is written; ``CheckpointExistsError``; ``CheckpointWriteError``; ...)."""
        if self._closed:
            raise CheckpointError("DCPCheckpointManager is closed")
        self.wait()
        if (
            self._lineage is None
        ):  # the first save without a load decides the lineage (a collective)
            self._lineage = self._decider.at_first_save(step)
        kw: dict[str, Any] = dict(
            rotation=self.rotation,
            run_id=self._lineage.run_id,
            attempt=self._lineage.attempt,
            extra=dict(extra) if extra is not None else None,
        )
        pg = self._coord.save_group if self._coord is not None else None
        t0 = time.perf_counter()
        if self.async_mode is None:
            try:
                api.save(state, self.root, step, process_group=pg, **kw)
            except BaseException as exc:
                self._record(step, time.perf_counter() - t0, 0.0, exc)
                raise
            self._last_commit = time.monotonic()
            self._record(step, time.perf_counter() - t0, 0.0, None)
            return
        fut = api.async_save(
            state,
            self.root,
            step,
            process_group=pg,
            async_stager=self._stager,
            async_checkpointer_type=_ASYNC_MODES[self.async_mode],
            **kw,
        )
        staged = time.perf_counter()
        fut.add_done_callback(lambda f: self._on_done(f, step, staged, staged - t0))
        self._future, self._pending_step = fut, step

    def _on_done(self, fut: Future[Any], step: int, staged: float, stage_s: float) -> None:
        exc = fut.exception() if not fut.cancelled() else CheckpointError("the save was cancelled")
        if exc is None:
            self._last_commit = time.monotonic()
        self._record(step, time.perf_counter() - staged, stage_s, exc)

    def _record(self, step: int, seconds: float, stage_s: float, exc: BaseException | None) -> None:
        """Hand the :class:`SaveOutcome` of ``step`` to ``on_save_outcome`` (if any)."""
        if self._on_save_outcome is None:
            return
        outcome = SaveOutcome(
            step,
            self.rank,
            seconds,
            stage_s,
            committed_here=exc is None and self.rank == 0,
            error=None if exc is None else f"{type(exc).__name__}: {exc}",
        )
        try:
            self._on_save_outcome(outcome)
        except Exception:  # a reporting hook must not turn a committed save into a failed one
            log.exception("rank %d step %d: on_save_outcome callback failed", self.rank, step)

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; raise its failure as
        ``CheckpointError`` (another exception is wrapped, the original kept as ``__cause__``)."""
        fut, step = self._future, self._pending_step
        if fut is None:
            return
        self._future = self._pending_step = None
        try:
            fut.result()
        except CheckpointError as exc:
            log.error("rank %d step %d: background DCP save failed: %s", self.rank, step, exc)
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            log.error("rank %d step %d: background DCP save failed: %s", self.rank, step, exc)
            raise CheckpointError(
                f"rank {self.rank} step {step}: background DCP save failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    # --- read

    def latest_step(self) -> int | None:
        """The newest current step committed in ``root`` (read from disk; an in-flight save counts
        once committed). No collective."""
        steps = committed_steps(self.root)
        return steps[-1] if steps else None

    def load(self, into: dict[str, Any], step: int | None = None) -> int:
        """Load step ``step`` (``None``: the newest current step every rank can load, the bucket's
        too with ``remote_url``) into the DCP state dict ``into``, in place as ``dcp.load`` does
        (then call ``set_state_dict``); returns the step. A collective; waits for an in-flight save
        first; decides the lineage (loading an older step than a visible current one starts a new
        attempt); restores the step from the bucket when it is missing locally. Another world size
        than the save's is resharded by DCP. Raises ``NoCheckpointError`` (nothing to load),
        ``MissingShardError``, ``UploadError``, ``LineageError``, restore's errors and
        :func:`tiered_ckpt.dcp.load`'s, on every rank alike."""
        self.wait()
        step, self._lineage = self._decider.at_load(step, known=self._lineage, resharding=True)
        pg = self._coord.policy_group if self._coord is not None else None
        return api.load(
            into,
            self.root,
            step,
            process_group=pg,
            remote_url=self.remote_url,
            s3_client=self._remote_s3_client,
        )

    @property
    def run_id(self) -> str | None:
        """The run every save records (``None`` until :meth:`load` or the first save)."""
        return self._lineage.run_id if self._lineage else None

    @property
    def attempt(self) -> int | None:
        """The attempt of the run every save records (``None`` until :meth:`load` or the first
        save)."""
        return self._lineage.attempt if self._lineage else None

    # --- lifecycle

    def close(self) -> None:
        """Wait for the last save (raising its failure), release the stager's buffers. Idempotent.
        DCP's checkpoint process (``"process"`` mode) is DCP's: it ends with this process."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._stager is not None:
                self._stager.close()
            if self._coord is not None:
                self._coord.close()

    def __enter__(self) -> DCPCheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError as close_exc:  # do not mask the exception already propagating
            log.error(
                "rank %d: closing after an error, the last save failed too: %s",
                self.rank,
                close_exc,
            )


__all__ = ["DCPCheckpointManager"]
