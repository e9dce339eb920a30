"""The manager core: what both checkpoint managers share, whatever engine writes the step.

Lifecycle (every rank, the same calls in the same order)::

    mgr = CheckpointManager(root, save_every_steps=100)   # or DCPCheckpointManager: 1. a collective
    state = mgr.load()                  # 2. resume (NoCheckpointError: fresh start); mgr.loaded_step
                                        #    (decides the lineage; the first save records it)
    for step in ...:
        train_step()
        if mgr.should_save(step):       # 3. every step (same answer on every rank)
            mgr.save(step, state)       # 4. blocks only while the state is staged
        if mgr.preempted:               #    SIGTERM handler: the final save was synchronous
            break
    mgr.close()                         # 5. waits for the last save, raises its failure

:class:`ManagerCore` owns the save policy (:class:`SavePolicy`), the lineage decision, the one
in-flight save and its deadline (``save_timeout_s``: :class:`SaveTimeoutError`, the save stays in
flight), the outcome of every save (:class:`SaveOutcome`), pins, preemption, the rotation policy,
``close`` and the context manager. An engine subclass supplies :meth:`ManagerCore._save_sync`,
:meth:`ManagerCore._save_async` and :meth:`ManagerCore._load`. A failed background save raises
:class:`~tiered_ckpt.errors.CheckpointError` at the next ``save``, ``wait``, ``load``, ``pin`` or
``close`` (that call does nothing else). No torch import here.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TypeVar

from tiered_ckpt.errors import CheckpointError, SaveTimeoutError
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.local.pins import pin_step, unpin_step
from tiered_ckpt.local.rotation import RotationPolicy
from tiered_ckpt.store.base import parse_s3_url
from tiered_ckpt.training.lineage_decision import Decision, LineageDecider

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound="ManagerCore")

#: How many outcomes :attr:`ManagerCore.save_outcomes` keeps (the oldest are dropped first).
OUTCOME_HISTORY = 1024


@dataclass(frozen=True)
class SaveOutcome:
    """What became of one ``save`` on this rank.

    ``seconds``: wall time of the persisting part (write + hash + commit; the native engine's
    excludes rotation, the DCP engine's is from the end of staging to DCP's future completing); for
    a failed save, the time until it failed. ``stage_seconds``: how long ``save`` blocked to stage
    (0.0 for a synchronous save). ``committed_here``: this rank wrote the step's manifest.
    ``error``: ``None`` when committed, else ``"ExceptionType: message"`` (the exception itself is
    raised by the next call as usual). :meth:`to_json` / :meth:`from_json`: a flat JSON object.
    """

    step: int
    rank: int
    seconds: float
    stage_seconds: float = 0.0
    committed_here: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the step was committed."""
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rank": self.rank,
            "seconds": self.seconds,
            "stage_seconds": self.stage_seconds,
            "committed_here": self.committed_here,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SaveOutcome:
        """Inverse of :meth:`to_json`. Raises ``KeyError``/``TypeError``/``ValueError`` on a bad
        record."""
        error = obj.get("error")
        if error is not None and not isinstance(error, str):
            raise TypeError(
                f"SaveOutcome.error must be a string or null, got {type(error).__name__}"
            )
        return cls(
            step=int(obj["step"]),
            rank=int(obj["rank"]),
            seconds=float(obj["seconds"]),
            stage_seconds=float(obj.get("stage_seconds", 0.0)),
            committed_here=bool(obj.get("committed_here", False)),
            error=error,
        )


@dataclass(frozen=True)
class SavePolicy:
    """When to save: every ``save_every_steps`` steps (``step % N == 0``) or once
    ``save_every_seconds`` have passed since the last successful commit (the first period counts
    from the manager's start). Both ``None``: ``should_save`` is false unless preempted. Raises
    ``ValueError`` for a non-positive value."""

    save_every_steps: int | None = None
    save_every_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.save_every_steps is not None and self.save_every_steps < 1:
            raise ValueError(f"save_every_steps must be >= 1, got {self.save_every_steps}")
        if self.save_every_seconds is not None and self.save_every_seconds <= 0:
            raise ValueError(f"save_every_seconds must be > 0, got {self.save_every_seconds}")

    def due(self, step: int, since_commit_s: float | None) -> bool:
        """Whether ``step`` is due; ``since_commit_s`` ``None``: this rank does not judge time."""
        if self.save_every_steps is not None and step % self.save_every_steps == 0:
            return True
        return (
            self.save_every_seconds is not None
            and since_commit_s is not None
            and since_commit_s >= self.save_every_seconds
        )


class ManagerCore:
    """The shared part of :class:`~tiered_ckpt.training.CheckpointManager` and
    :class:`~tiered_ckpt.dcp.DCPCheckpointManager` (see the module docstring).

    ``coord``: the engine's :class:`~tiered_ckpt.training.dist.SaveCoordinator` (``None``: one
    process). ``keep_last``, ``upload_gated``, ``max_pending_uploads``, ``keep_every_steps``: the
    :class:`RotationPolicy` applied after each commit; ``upload_gated=None`` (the managers' default)
    means gated when ``remote_url`` is given: rotation then keeps every step the sidecar has not
    uploaded yet, at most ``max_pending_uploads`` of them beyond ``keep_last`` (past that the
    oldest is deleted with an ERROR log rather than filling the disk); ``False`` rotates by count
    alone. ``async_save=False`` saves inside ``save``.
    ``save_timeout_s``: how long any call waits for the in-flight save (``None``: for ever).
    ``handle_sigterm``: :meth:`install_sigterm_handler`. ``remote_url``/``s3_client``: the bucket
    a load restores from (default client: boto3's chain). ``on_save_outcome``: called with each
    :class:`SaveOutcome` in the thread that finished the save, before the next save starts; it must
    be quick and must not call the manager; an exception it raises is logged only.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        rank: int,
        world_size: int,
        coord: Any,
        async_save: bool,
        save_timeout_s: float | None,
        handle_sigterm: bool,
        keep_last: int,
        upload_gated: bool | None,
        max_pending_uploads: int,
        keep_every_steps: int | None,
        save_every_steps: int | None,
        save_every_seconds: float | None,
        remote_url: str | None,
        s3_client: Any,
        on_save_outcome: Callable[[SaveOutcome], None] | None,
        resharding: bool = False,
    ) -> None:
        if save_timeout_s is not None and not save_timeout_s > 0:
            raise ValueError(f"save_timeout_s must be > 0 or None, got {save_timeout_s!r}")
        if remote_url is not None:
            parse_s3_url(remote_url)  # a bad URL fails here, not at the first load or upload
        self.root = Path(root).absolute()
        self.rank, self.world_size = rank, world_size
        self.policy = SavePolicy(save_every_steps, save_every_seconds)
        if upload_gated is None:
            upload_gated = remote_url is not None
        self.rotation = RotationPolicy(
            keep_last, upload_gated, max_pending_uploads, keep_every_steps=keep_every_steps
        )
        self.async_save = async_save
        self.save_timeout_s = save_timeout_s
        self.remote_url = remote_url
        self.s3_client = s3_client
        self.root.mkdir(parents=True, exist_ok=True)
        self._coord = coord
        self._resharding = resharding
        self._decider = LineageDecider(
            self.root,
            rank,
            coord,
            remote_url=remote_url,
            s3_client=s3_client,
            world_size=world_size,
        )
        self._lineage: RunLineage | None = None  # recorded in every root
        self._decided: Decision | None = None  # decided by the last load, not recorded yet
        self.loaded_step: int | None = None
        self._future: Future[Any] | None = None
        self._pending_step: int | None = None
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

    # --- the engine's part

    def _save_sync(self, step: int, state: Any, extra: Mapping[str, Any] | None) -> bool:
        """Write and commit ``step`` now; return whether this rank committed the manifest."""
        raise NotImplementedError

    def _save_async(
        self, step: int, state: Any, extra: Mapping[str, Any] | None
    ) -> tuple[Future[Any], float]:
        """Stage ``state`` and start the background save; return a future that completes after
        :meth:`_finish_save` has run for it, and the seconds staging took."""
        raise NotImplementedError

    def _load(self, step: int, into: Any) -> Any:
        """Load the decided ``step`` (into ``into`` in place when given); return the state."""
        raise NotImplementedError

    def _after_commit(self, step: int) -> None:
        """Run after a commit this rank made (the native engine rotates here)."""

    # --- policy

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: the :class:`SavePolicy` (rank 0's clock for time), or a
        SIGTERM arrived. With several ranks and a time policy or the SIGTERM handler, a collective
        (a one-integer all-reduce on the manager's own group): call it on every rank every step."""
        judge = self._coord is None or self.rank == 0
        due = self.policy.due(step, time.monotonic() - self._last_commit if judge else None)
        preempt = self._preempt_requested.is_set()
        timed = self.policy.save_every_seconds is not None
        if self._coord is not None and (timed or self._preempt_handler_installed):
            due, preempt = self._coord.any_true([due, preempt])
        if preempt:
            self._preempt_agreed = True
        return due or preempt

    def install_sigterm_handler(self) -> None:
        """Preemption: on SIGTERM the next :meth:`should_save` is true on every rank, that
        :meth:`save` waits for the in-flight save, saves synchronously and sets :attr:`preempted`.
        Must be called from the main thread; chains to no other handler."""

        def handler(signum: int, frame: FrameType | None) -> None:
            self._preempt_requested.set()

        signal.signal(signal.SIGTERM, handler)
        self._preempt_handler_installed = True

    # --- save

    def save(self, step: int, state: Any, extra: Mapping[str, Any] | None = None) -> None:
        """Save ``state`` as step ``step`` (every rank, same ``step``; ``extra``: step-level JSON
        for the manifest, the coordinator's is used). Async: returns once the state is staged; the
        caller may then change every tensor. First waits for the previous save and raises its
        failure instead of starting this one; then records the lineage the last :meth:`load`
        decided, or decides it if there was none (a collective; ``LineageError``, nothing of
        the save written); a synchronous save raises its own error."""
        if self._closed:
            raise CheckpointError(f"{type(self).__name__} is closed")
        self.wait()
        if self._decided is not None:  # the last load's decision: recorded before any write
            self._record_decided()
        elif self._lineage is None:  # the first save without a load decides (a collective)
            self._lineage = self._decider.at_first_save(step)
        if self.async_save and not self._preempt_agreed:
            self._future, _ = self._save_async(step, state, extra)
            self._pending_step = step
            return
        self._finish_save(
            step, time.perf_counter(), 0.0, lambda: self._save_sync(step, state, extra)
        )
        if self._preempt_agreed:
            self.preempted = True
            log.warning(
                "rank %d step %d: final checkpoint after SIGTERM committed", self.rank, step
            )

    def _finish_save(
        self, step: int, started: float, stage_s: float, persist: Callable[[], bool]
    ) -> None:
        """Run ``persist`` (returns whether this rank committed), record the :class:`SaveOutcome`
        (seconds from ``started``), then :meth:`_after_commit`. Re-raises the save's failure."""
        try:
            committed_here = persist()
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            self._record(
                SaveOutcome(step, self.rank, time.perf_counter() - started, stage_s, error=error)
            )
            raise
        seconds = time.perf_counter() - started
        self._last_commit = time.monotonic()
        log.info("rank %d step %d: checkpoint committed in %.3f s", self.rank, step, seconds)
        self._record(SaveOutcome(step, self.rank, seconds, stage_s, committed_here=committed_here))
        if committed_here:
            self._after_commit(step)

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
        """This rank's save outcomes, oldest first (the last :data:`OUTCOME_HISTORY`); an in-flight
        save appears once it has committed or failed (after :meth:`wait` at the latest)."""
        with self._outcomes_lock:
            return tuple(self._outcomes)

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; raise its failure as
        ``CheckpointError`` (another exception is wrapped, kept as ``__cause__``), or
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
            self._fail(step, exc)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            self._fail(step, exc)
        self._future = self._pending_step = None

    def _fail(self, step: int | None, exc: BaseException) -> None:
        self._future = self._pending_step = None
        log.error("rank %d step %d: background save failed: %s", self.rank, step, exc)
        if isinstance(exc, CheckpointError):
            raise exc
        raise CheckpointError(
            f"rank {self.rank} step {step}: background save failed: {type(exc).__name__}: {exc}"
        ) from exc

    # --- read

    def latest_step(self) -> int | None:
        """The newest current step committed in this rank's root (read from disk; an in-flight save
        counts once committed). No collective."""
        steps = committed_steps(self.root)
        return steps[-1] if steps else None

    def load(self, step: int | None = None, *, into: Any = None) -> Any:
        """Load and verify ``step`` (``None``: the newest current step every rank can load; with
        ``remote_url`` the bucket's too, restored first) and return the state; :attr:`loaded_step`
        is the step loaded. ``into``: load in place into it (tensors and arrays of matching shape
        and dtype are copied into, other values replaced) and return it. A collective; waits for an
        in-flight save first.

        A load changes no lineage: it decides, in memory, which lineage the next :meth:`save`
        continues (loading a step older than a visible current one means a new attempt that
        supersedes the newer ones), and that save records it before it writes anything (every
        root's ``run.json``, the superseded steps set aside under ``superseded/``, the bucket's
        record); :meth:`record_lineage` does it without a save. Until then steps can be loaded one
        after another, in any order, and the last load's decision is the one a save continues;
        :attr:`attempt` and :attr:`run_id` tell what it will record. The one write a load makes:
        a shard missing locally is restored from the bucket (with the run's record, when this root
        lags it). Raises ``NoCheckpointError``, ``UploadError``, ``WorldSizeMismatchError``
        (native), ``ManifestError``, ``LineageError`` and the loaders' errors, on every rank
        alike."""
        self.wait()
        step, decided = self._decider.at_load(
            step, known=self._lineage, resharding=self._resharding
        )
        state = self._load(step, into)
        self._decided = decided
        self.loaded_step = step
        return state

    def record_lineage(self) -> RunLineage | None:
        """Record the last load's decision now instead of at the next save (every rank, a
        collective): ``run.json`` into every root, the steps it supersedes set aside under
        ``<root>/superseded/`` (no longer loadable), the record published to the bucket with
        ``remote_url``. Returns the recorded lineage, ``None`` when no load decided anything since
        the last record. Waits for an in-flight save first (raising its failure). Raises
        :class:`~tiered_ckpt.errors.LineageError` (a root whose record it does not extend, or a
        failed write, on every rank alike), ``CheckpointError`` once closed."""
        if self._closed:
            raise CheckpointError(f"{type(self).__name__} is closed")
        self.wait()
        if self._decided is None:
            return None
        return self._record_decided()

    def _record_decided(self) -> RunLineage:
        assert self._decided is not None
        self._lineage = self._decider.record(self._decided)
        self._decided = None
        return self._lineage

    @property
    def _next_lineage(self) -> RunLineage | None:
        return self._decided.lineage if self._decided is not None else self._lineage

    @property
    def run_id(self) -> str | None:
        """The run the next save records (``None`` until :meth:`load` or the first save)."""
        lin = self._next_lineage
        return lin.run_id if lin else None

    @property
    def attempt(self) -> int | None:
        """The attempt the next save records: after a :meth:`load` the one it decided, recorded or
        not (``None`` until :meth:`load` or the first save)."""
        lin = self._next_lineage
        return lin.attempt if lin else None

    def pin(self, step: int) -> None:
        """Pin the committed ``step`` in this rank's root (every rank): rotation never removes it;
        the sidecar mirrors the pin to the bucket. Waits for an in-flight save first. Raises
        ``NoCheckpointError`` if ``step`` is not committed in this root."""
        self.wait()
        pin_step(self.root, step)

    def unpin(self, step: int) -> bool:
        """Remove the pin of ``step`` (every rank); rotation after the next commit may remove it.
        Returns whether there was one. Waits for an in-flight save first."""
        self.wait()
        return unpin_step(self.root, step)

    # --- lifecycle

    def _release(self, hung: bool) -> None:
        """Free the engine's resources (``hung``: a save is still in flight; do not wait for it)."""
        if self._coord is not None:
            self._coord.close()

    def close(self) -> None:
        """Wait for the last save (raising its failure) and release the engine. Idempotent."""
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
            self._release(hung)

    def __enter__(self: _M) -> _M:
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


__all__ = ["OUTCOME_HISTORY", "ManagerCore", "SaveOutcome", "SavePolicy"]
