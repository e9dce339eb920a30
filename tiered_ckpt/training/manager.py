"""CheckpointManager: the training side (save policy, async save, multi-rank commit, rotation,
resume).

Lifecycle (who calls what)::

    mgr = CheckpointManager(root, rank=r, world_size=n, save_every_steps=100)   # 1. every rank
    state = mgr.load()                      # 2. every rank, to resume (NoCheckpointError: fresh start)
    for step in ...:
        train_step()
        if mgr.should_save(step):           # 3. every rank, every step (same answer on every rank)
            mgr.save(step, state)           # 4. every rank; blocks only while the state is copied
        if mgr.preempted:                   #    (opt-in SIGTERM handler: a final save was taken)
            break
    mgr.close()                             # 5. every rank: waits for the last save, raises its error

Threads: ``save`` stages the state (copies arrays into reused host buffers, deep-copies JSON) in the
caller's thread, then hands it to one background thread that writes the shard, hashes it, gathers
the records, commits and rotates (:mod:`tiered_ckpt.training.dist` for several ranks). The next
``save`` waits for the previous one; a failed background save raises
:class:`~tiered_ckpt.errors.CheckpointError` at the next ``save``, ``wait``, ``load`` or ``close``
(that call does nothing else), and is never counted as committed: :meth:`latest_step` reads the
disk, so the manager's view always equals what is on disk.

Lineage (SPEC §11): ``load`` (or the first ``save`` without one) decides the run and attempt every
save records (:mod:`tiered_ckpt.training.lineage_decision`). Outcomes as data: every save yields one
:class:`SaveOutcome` (step, seconds, the error if any), kept in
:attr:`CheckpointManager.save_outcomes` and passed to ``on_save_outcome``. torch is imported only
for several ranks or a given ``process_group``.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from tiered_ckpt.errors import CheckpointError, SaveTimeoutError
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.fs import new_save_id
from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.load_committed import load_shard
from tiered_ckpt.local.pins import pin_step
from tiered_ckpt.local.rotation import RotationPolicy, rotate
from tiered_ckpt.local.writer import write_shard
from tiered_ckpt.training.lineage_decision import LineageDecider
from tiered_ckpt.training.outcomes import SaveOutcome, SavePolicy
from tiered_ckpt.training.staging import Stager, copy_json

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "SavePolicy", "SaveOutcome"]

#: How many outcomes :attr:`CheckpointManager.save_outcomes` keeps (the oldest are dropped first).
OUTCOME_HISTORY = 1024


class CheckpointManager:
    """Periodic, asynchronous, multi-rank checkpointing into ``root`` (see the module docstring).

    ``root``: this node's checkpoint directory (relative paths are resolved once, here).
    ``rank``/``world_size``: within ``process_group`` (default: the whole job). For ``world_size >
    1`` torch.distributed must be initialized, and constructing the manager is a collective call (it
    makes two gloo groups with ``collective_timeout_s``).
    ``shared_filesystem``: ``root`` is the same directory for every node (rank 0 alone commits); by
    default each node's lowest rank commits the global manifest into its own root.
    ``keep_last``, ``upload_gated``, ``max_pending_uploads``, ``keep_every_steps`` (keep every step
    with ``step % N == 0``): rotation (:mod:`tiered_ckpt.local.rotation`; the step just committed is
    never rotated out). :meth:`load` or the first :meth:`save` decides the lineage every save
    records (SPEC §11). ``async_save=False`` writes and commits inside ``save``.
    ``handle_sigterm=True`` installs the preemption handler (:meth:`install_sigterm_handler`).
    ``remote_url`` (``s3://bucket/prefix``, the sidecar's): :meth:`load` restores this rank's shard
    from the bucket when it is missing locally (a replaced node, a whole lost step;
    :mod:`tiered_ckpt.training.resume`). ``remote_s3_client``: an injected botocore client for it
    (default: boto3's chain). ``on_save_outcome``: called with each :class:`SaveOutcome`, in the
    thread that ran the save (the background thread when async), after the commit or failure and
    before the next save starts; it must be quick and must not call the manager. An exception it
    raises is logged (with traceback) and does not change the save's result. ``save_timeout_s``: how
    long any call waits for the in-flight background save (seconds; ``None``: for ever); past it
    :class:`SaveTimeoutError` is raised and the save stays in flight (a hung disk: the next call
    waits for it again, no second save is started).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        rank: int = 0,
        world_size: int = 1,
        process_group: ProcessGroup | None = None,
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        keep_last: int = 3,
        async_save: bool = True,
        upload_gated: bool = False,
        max_pending_uploads: int = 8,
        shared_filesystem: bool = False,
        collective_timeout_s: float = 600.0,
        handle_sigterm: bool = False,
        remote_url: str | None = None,
        remote_s3_client: Any = None,  # a botocore S3 client (no interface type for it above store/)
        on_save_outcome: Callable[[SaveOutcome], None] | None = None,
        keep_every_steps: int | None = None,
        save_timeout_s: float | None = 3600.0,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank ({rank}) < world_size ({world_size})")
        self.root = Path(root).absolute()
        self.rank = rank
        self.world_size = world_size
        self.policy = SavePolicy(save_every_steps, save_every_seconds)
        self.rotation = RotationPolicy(
            keep_last, upload_gated, max_pending_uploads, keep_every_steps=keep_every_steps
        )
        self.async_save = async_save
        if save_timeout_s is not None and not save_timeout_s > 0:
            raise ValueError(f"save_timeout_s must be > 0 or None, got {save_timeout_s!r}")
        self.save_timeout_s = save_timeout_s
        self.remote_url = remote_url
        self.root.mkdir(parents=True, exist_ok=True)
        self._coord = None
        if world_size > 1 or process_group is not None:
            from tiered_ckpt.training.dist import SaveCoordinator  # imports torch

            self._coord = SaveCoordinator(
                rank,
                world_size,
                process_group,
                timeout_s=collective_timeout_s,
                shared_filesystem=shared_filesystem,
            )
        self._lineage: RunLineage | None = None
        self._decider = LineageDecider(
            self.root,
            rank,
            self._coord,
            remote_url=remote_url,
            s3_client=remote_s3_client,
            world_size=world_size,
        )
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tiered-ckpt-save-r{rank}")
            if async_save
            else None
        )
        self._future: Future[None] | None = None
        self._pending_step: int | None = None
        self._stager = Stager()
        self._on_save_outcome = on_save_outcome
        self._outcomes: collections.deque[SaveOutcome] = collections.deque(maxlen=OUTCOME_HISTORY)
        self._outcomes_lock = threading.Lock()
        self._started = time.monotonic()
        self._last_commit = self._started
        self._preempt_requested = threading.Event()
        self._preempt_agreed = False
        self._preempt_handler_installed = False
        self.preempted = False
        self._closed = False
        if handle_sigterm:
            self.install_sigterm_handler()

    # --- policy

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: ``step % save_every_steps == 0``, or ``save_every_seconds``
        passed since the last successful commit (rank 0's clock), or a SIGTERM arrived (preemption).

        With several ranks and a time policy or the preemption handler, this is a collective (a
        one-integer all-reduce on the manager's own group): call it on every rank at every step.
        """
        timed = self.policy.save_every_seconds is not None
        judge = self._coord is None or self.rank == 0  # rank 0's clock decides
        due = self.policy.due(step, time.monotonic() - self._last_commit if judge else None)
        preempt = self._preempt_requested.is_set()
        if self._coord is not None and (timed or self._preempt_handler_installed):
            due, preempt = self._coord.any_true([due, preempt])
        if preempt:
            self._preempt_agreed = True
        return due or preempt

    def install_sigterm_handler(self) -> None:
        """Opt-in preemption: on SIGTERM, the next :meth:`should_save` returns true on every rank;
        that :meth:`save` waits for the in-flight save, saves synchronously, and sets
        :attr:`preempted` so the loop can stop. Must be called from the main thread; chains to no
        other handler.
        """

        def handler(signum: int, frame: FrameType | None) -> None:
            self._preempt_requested.set()

        signal.signal(signal.SIGTERM, handler)
        self._preempt_handler_installed = True

    # --- save

    def save(
        self, step: int, state: Mapping[str, Any], extra: Mapping[str, Any] | None = None
    ) -> None:
        """Save this rank's ``state`` as step ``step`` (call on every rank with the same ``step``).

        ``state``: nested ``dict`` of ``str`` -> numpy array / ``GlobalSlice`` / ``Replicated`` /
        JSON value (or torch tensors, converted bit-exactly). A ``Replicated`` value must be
        identical on every rank (checked by sha256 before anything is written:
        ``ReplicatedMismatchError``, a ``CheckpointError``) and is stored once per node. ``extra``:
        step-level JSON for the manifest (rank 0's is used). Async: returns once the state is copied
        into the staging buffers; the caller may then change every tensor. First waits for the
        previous save and raises its failure (``CheckpointError``) instead of starting this one.
        Raises ``UnsupportedStateError`` for unstorable values (nothing is started then) and, when
        not async, any save error directly.
        """
        if self._closed:
            raise CheckpointError("CheckpointManager is closed")
        self.wait()
        if (
            self._lineage is None
        ):  # the first save without a load decides the lineage (a collective)
            self._lineage = self._decider.at_first_save(step)
        wall = time.monotonic() - self._started
        if self._executor is None or self._preempt_agreed:
            self._persist(step, state, extra, wall, 0.0)
            if self._preempt_agreed:
                self.preempted = True
                log.warning(
                    "rank %d step %d: final checkpoint after SIGTERM committed", self.rank, step
                )
            return
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
        self._pending_step = step
        self._future = self._executor.submit(self._persist, step, staged, extra_copy, wall, stage_s)

    def _persist(
        self,
        step: int,
        state: Mapping[str, Any],
        extra: Mapping[str, Any] | None,
        wall: float,
        stage_s: float,
    ) -> None:
        """Write, commit and rotate (background thread when async); record the :class:`SaveOutcome`.
        Raises ``CheckpointError`` (or the write's own exception, wrapped by :meth:`wait`)."""
        if self._executor is not None and threading.current_thread() is not threading.main_thread():
            # Hand the GIL straight back to the caller of save(): otherwise this thread may hold it
            # for a whole switch interval (5 ms) of Python bookkeeping before save() can return.
            time.sleep(0)
        t0 = time.perf_counter()
        try:
            committed_here = self._write_and_commit(step, state, extra, wall)
        except BaseException as exc:
            self._record(
                SaveOutcome(
                    step,
                    self.rank,
                    time.perf_counter() - t0,
                    stage_s,
                    error=f"{type(exc).__name__}: {exc}",
                )
            )
            raise
        seconds = time.perf_counter() - t0
        self._last_commit = time.monotonic()
        log.info("rank %d step %d: checkpoint committed in %.3f s", self.rank, step, seconds)
        self._record(SaveOutcome(step, self.rank, seconds, stage_s, committed_here=committed_here))
        if committed_here:
            try:
                rotate(self.root, self.rotation, rank=self.rank, just_committed=step)
            except (
                OSError
            ) as exc:  # the save itself succeeded; retention retries after the next one
                log.error("rank %d step %d: rotation failed: %s", self.rank, step, exc)

    def _write_and_commit(
        self, step: int, state: Mapping[str, Any], extra: Mapping[str, Any] | None, wall: float
    ) -> bool:
        """Write this rank's shard and commit the step (all ranks' protocol with several). Returns
        whether this rank committed the manifest into its root."""
        assert self._lineage is not None
        lin = {"run_id": self._lineage.run_id, "attempt": self._lineage.attempt}
        if self._coord is not None:
            return self._coord.save(self.root, step, state, extra, wall, **lin).committed_here
        sid = new_save_id()
        rec = write_shard(self.root, step, self.rank, state, save_id=sid)
        commit_step(self.root, step, 1, [rec], extra, save_id=sid, wall_clock_seconds=wall, **lin)
        return True

    def _record(self, outcome: SaveOutcome) -> None:
        with self._outcomes_lock:
            self._outcomes.append(outcome)
        if self._on_save_outcome is None:
            return
        try:
            self._on_save_outcome(outcome)
        except Exception:  # a reporting hook must not turn a committed save into a failed one
            log.exception(
                "rank %d step %d: on_save_outcome callback failed", self.rank, outcome.step
            )

    @property
    def save_outcomes(self) -> tuple[SaveOutcome, ...]:
        """The outcomes of this rank's saves so far, oldest first (the last
        :data:`OUTCOME_HISTORY`). An in-flight save appears once it has committed or failed (after
        :meth:`wait` at the latest)."""
        with self._outcomes_lock:
            return tuple(self._outcomes)

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; raise its failure as
        ``CheckpointError`` (other exceptions are wrapped, the original kept as ``__cause__``), or
        :class:`SaveTimeoutError` after ``save_timeout_s`` with the save still in flight."""
        fut, step = self._future, self._pending_step
        if fut is None:
            return
        try:
            fut.result(timeout=self.save_timeout_s)
        except TimeoutError as exc:
            if not fut.done():  # still in flight: kept, so that no second save starts beside it
                raise SaveTimeoutError(
                    f"rank {self.rank} step {step}: the background save is still running "
                    f"after {self.save_timeout_s} s (a hung disk?)"
                ) from exc
            self._future = self._pending_step = None
            log.error("rank %d step %d: background save failed: %s", self.rank, step, exc)
            raise CheckpointError(
                f"rank {self.rank} step {step}: background save failed: {exc}"
            ) from exc
        except CheckpointError as exc:
            self._future = self._pending_step = None
            log.error("rank %d step %d: background save failed: %s", self.rank, step, exc)
            raise
        except Exception as exc:
            self._future = self._pending_step = None
            log.error("rank %d step %d: background save failed: %s", self.rank, step, exc)
            raise CheckpointError(
                f"rank {self.rank} step {step}: background save failed: {exc}"
            ) from exc
        self._future = self._pending_step = None

    # --- read

    def latest_step(self) -> int | None:
        """The newest current step committed in this rank's root (read from disk; an in-flight save
        is not counted until its commit). No collective."""
        steps = committed_steps(self.root)
        return steps[-1] if steps else None

    def load(self, step: int | None = None) -> dict[str, Any]:
        """Load and verify this rank's state of ``step`` (``None``: the newest current step every
        rank can load; with ``remote_url`` the bucket's too, restored first). A collective; waits
        for an in-flight save first. Every load decides the lineage (SPEC §11): loading a step older
        than a visible current step (or with an unreadable bucket) starts a new attempt and sets the
        newer steps aside. Raises ``NoCheckpointError`` (nothing, or not that step, available to
        every rank), ``UploadError`` (that, with an unreadable bucket), ``WorldSizeMismatchError``
        (checked first), ``ManifestError``, ``LineageError``,
        :func:`tiered_ckpt.local.load_shard`'s; every rank alike."""
        self.wait()
        step, self._lineage = self._decider.at_load(step, known=self._lineage)
        return load_shard(self.root, self.rank, self.world_size, step)

    @property
    def run_id(self) -> str | None:
        """The run every save of this manager records (``None`` until :meth:`load` or the first
        save)."""
        return self._lineage.run_id if self._lineage else None

    @property
    def attempt(self) -> int | None:
        """The attempt of the run every save records (``None`` until :meth:`load` or the first
        save)."""
        return self._lineage.attempt if self._lineage else None

    def pin(self, step: int) -> None:
        """Pin the committed ``step`` in this rank's root (call on every rank): rotation never removes it,
        whatever ``keep_last`` says; the sidecar mirrors the pin to the bucket. Waits for an in-flight save
        first. Raises ``NoCheckpointError`` if ``step`` is not committed in this root."""
        self.wait()
        pin_step(self.root, step)

    # --- lifecycle

    def close(self) -> None:
        """Wait for the last save (raising its failure), stop the background thread and remove this rank's
        node token file from the root (training/dist.py). Idempotent."""
        if self._closed:
            return
        hung = False
        try:
            self.wait()
        except SaveTimeoutError:
            hung = True
            raise
        finally:
            self._closed = True
            if self._executor is not None:  # a hung save's thread is left behind, not waited for
                self._executor.shutdown(wait=not hung, cancel_futures=hung)
            if self._coord is not None:
                self._coord.close()

    def __enter__(self) -> CheckpointManager:
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
