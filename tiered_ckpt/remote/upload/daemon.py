"""The sidecar process: signals, metrics endpoint and the upload loop (``tiered-ckpt upload
--watch``).

Lifecycle (one process per training node):

1. The CLI builds ONE S3 client and ONE :class:`~tiered_ckpt.remote.upload.uploader.Uploader` and calls
   :func:`run_sidecar`.
2. :func:`run_sidecar` installs SIGTERM/SIGINT handlers that only set the stop event, optionally
   serves Prometheus metrics, and runs an :class:`UploadLoop` over the uploader in a worker thread
   (the main thread waits on signals).
3. On a signal: the stop event is set; retries stop, backoffs are cut short, and an in-flight
   multipart upload stops reading, lets its in-flight parts finish and is aborted (no object is
   committed, no multipart upload left behind). The loop returns; the process exits 0. If the worker
   has not returned within ``shutdown_timeout_s`` the sidecar logs it and exits 0 anyway (the next
   start sweeps leftovers).
4. A prefix claimed by another run (``RunMismatchError``, SPEC §11 fencing) stops the loop at once:
   the sidecar must not keep uploading there. :func:`run_sidecar` raises it (the CLI prints one
   line, exit 1).

The loop (:class:`UploadLoop`, SPEC §11 "Sidecar at scale"): each pass lists the backlog (local disk
only) every ``poll_interval_s``, mirrors pins made after their step's upload, and uploads the
pending steps newest first. A step waiting for other nodes'
confirmations (``StepIncompleteError``) is polled with its own exponential backoff: its ``n``-th
poll comes ``U(d/2, d)`` seconds after the previous one, ``d = min(max_poll_interval_s,
poll_interval_s * 2**(n-1))`` (jittered so that the nodes of a job do not poll in step), and each
poll costs one LIST (the commit object of the previous poll is passed back: see
:mod:`tiered_ckpt.remote.upload.step_upload`). A step still waiting ``UploadPolicy.stall_deadline_s`` after
its first wait is **stalled**: reported once (one WARNING naming the missing ranks;
``tiered_ckpt_upload_stalled_steps``, ``tiered_ckpt_upload_stalls_total``), kept locally under a
``stalled`` step lock (upload-gated rotation keeps locked steps and does not count them against
``max_pending_uploads``, see :mod:`tiered_ckpt.local.rotation`), polled every
``max_poll_interval_s`` and committed if its confirmations appear later. A waiting or stalled step
never blocks newer steps: the pass goes on to them.

Logs: ``logging`` with step and shard in every record of the upload path; the remote is logged as
``s3://bucket/prefix`` and the endpoint URL only, never credentials.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from tiered_ckpt.errors import CheckpointError, NoCheckpointError, RunMismatchError, UploadError
from tiered_ckpt.local.catalogue import step_path
from tiered_ckpt.locks import acquire_step_lock, release_step_lock
from tiered_ckpt.remote.errors import LocalStepGoneError, StepIncompleteError, StepSupersededError
from tiered_ckpt.remote.upload.uploader import Uploader
from tiered_ckpt.retry import OperationInterruptedError

log = logging.getLogger(__name__)

#: The lock kind that keeps a stalled step on the local disk (see :mod:`tiered_ckpt.locks`).
STALLED_LOCK_KIND = "stalled"


def ranks_text(ranks: Iterable[int]) -> str:
    """``[2, 3, 5, 6, 7]`` -> ``"2-3,5-7"`` (the rank list of a log line, short at any world
    size)."""
    out: list[str] = []
    rs = sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


@dataclass
class WaitingStep:
    """A step whose local shards are confirmed while other nodes' are not: ``since`` (monotonic
    seconds of the first wait), ``polls`` so far, ``next_poll`` (monotonic), the ``missing`` ranks
    of the last poll, and once past the deadline ``stalled`` with the ``lock`` file that keeps it
    locally."""

    since: float
    polls: int = 0
    next_poll: float = 0.0
    missing: tuple[int, ...] = ()
    stalled: bool = False
    lock: Path | None = None


def _log_committed(step: int, um: Any, timing: Any) -> None:
    """The sidecar's one INFO line per step committed remotely (its default level shows it): shards
    and MiB of the upload manifest ``um``, how they were confirmed (``confirmed_by``, see
    :data:`~tiered_ckpt.format.upload_manifest.CONFIRM_METHODS`), and this node's seconds and MiB
    sent (``timing``: the uploader's ``last_timing``; either may be ``None``, then its part is left
    out)."""
    shards = tuple(getattr(um, "shards", ()))
    hows: dict[str, int] = {}
    for sh in shards:
        hows[sh.confirmed_by] = hows.get(sh.confirmed_by, 0) + 1
    how = ", ".join(
        _CONFIRMED_BY.get(k, k) + (f" ({n})" if len(hows) > 1 else "")
        for k, n in sorted(hows.items())
    )
    what = (
        f": {len(shards)} shard(s), {sum(sh.size_bytes for sh in shards) / 2**20:.1f} MiB, confirmed by {how}"
        if shards
        else ""
    )
    mine = (
        ""
        if timing is None
        else f" in {timing.total_s:.2f} s ({timing.bytes_sent / 2**20:.1f} MiB sent by this node)"
    )
    log.info("step %d: committed remotely%s%s", step, what, mine)


#: How the per-step line names :data:`~tiered_ckpt.format.upload_manifest.CONFIRM_METHODS`.
_CONFIRMED_BY = {"server-checksum": "server checksum", "read-back": "read-back"}


class UploadLoop:
    """The sidecar loop; it owns one :class:`~tiered_ckpt.remote.upload.uploader.Uploader`
    (module docstring). State (waiting steps, failure backoffs) lives here across :meth:`run`
    calls; one thread at a time. Timings in seconds (``max_poll_interval_s`` below
    ``poll_interval_s`` is raised to it). Raises ``ValueError`` for a poll interval that is not
    positive."""

    def __init__(
        self,
        uploader: Uploader,
        *,
        poll_interval_s: float = 2.0,
        max_poll_interval_s: float = 60.0,
        failure_backoff_s: float = 10.0,
        rng: random.Random | None = None,
    ) -> None:
        if not poll_interval_s > 0 or not max_poll_interval_s > 0:
            raise ValueError(
                f"poll intervals must be > 0, got {poll_interval_s} and {max_poll_interval_s}"
            )
        self.up = uploader
        self.poll_interval_s = poll_interval_s
        self.max_poll_interval_s = max(max_poll_interval_s, poll_interval_s)
        self.failure_backoff_s = failure_backoff_s
        self.waiting: dict[int, WaitingStep] = {}
        self._failed_at: dict[int, float] = {}
        self._rng = rng if rng is not None else random.Random()

    def run(self, stop_event: threading.Event | None = None, *, once: bool = False) -> list[int]:
        """Abort abandoned multipart uploads, then pass over the backlog (pending steps newest
        first) until ``stop_event`` (default: the uploader's) is set; with ``once``, until a pass
        commits nothing (backoffs are then not waited for: each pass polls every waiting step).
        Returns the steps committed. Raises ``RunMismatchError`` (the prefix belongs to another
        run: the loop stops)."""
        up = self.up
        stop = stop_event if stop_event is not None else up.stop_event
        finished = threading.Event()
        if stop is not up.stop_event:
            # Propagate an external stop event to the uploader's (which cuts retries and transfers
            # short), until this run returns: the relay thread ends with it.
            def relay() -> None:
                while not finished.is_set():
                    if stop.wait(0.2):
                        up.stop_event.set()
                        return

            threading.Thread(target=relay, name="tc-stop-relay", daemon=True).start()
        try:
            up.learn_newest_remote()
            try:
                up.abort_abandoned_uploads()
            except UploadError as e:
                log.error(
                    "could not sweep abandoned multipart uploads under %s: %s", up.store.url, e
                )
            return self._passes(stop, once)
        finally:
            finished.set()

    def _passes(self, stop: threading.Event, once: bool) -> list[int]:
        done: list[int] = []
        while not stop.is_set():
            step = self.pass_once(stop, honour_backoff=not once)
            if step is not None:
                done.append(step)
            elif once:
                break
            else:
                stop.wait(self._idle_s())
        return done

    @property
    def stalled_steps(self) -> list[int]:
        """Steps reported stalled and still kept (ascending)."""
        return sorted(s for s, w in self.waiting.items() if w.stalled)

    def _idle_s(self) -> float:
        """Seconds until the next pass: the poll interval (new local steps), or sooner when a
        waiting step is due."""
        now = time.monotonic()
        due = min((w.next_poll for w in self.waiting.values()), default=now + self.poll_interval_s)
        return max(0.01, min(self.poll_interval_s, due - now))

    def pass_once(self, stop: threading.Event, *, honour_backoff: bool = True) -> int | None:
        """One pass over the backlog: commit the first pending step that can be, then apply
        retention. Returns it, or ``None`` when no step was committed in this pass. Raises
        ``RunMismatchError``."""
        up = self.up
        try:
            pending = up.select_pending()
        except OSError as e:
            log.error("cannot list %s: %s", up.local_root, e)
            pending = []
        for gone in set(self.waiting) - set(pending):  # committed elsewhere, released or deleted
            self._forget(gone)
        try:
            up.mirror_pins()  # pins made after their step was uploaded (no request once mirrored)
        except (CheckpointError, OSError) as e:
            log.error("mirroring pins to %s failed: %s: %s", up.store.url, type(e).__name__, e)
        try:
            up.sweep_pending_aborts()  # uploads recorded as not abortable (no request without a record)
        except (CheckpointError, OSError) as e:
            log.error(
                "sweeping recorded multipart uploads of %s failed: %s: %s",
                up.store.url,
                type(e).__name__,
                e,
            )
        for step in pending:
            if stop.is_set():
                return None
            now = time.monotonic()
            if now - self._failed_at.get(step, -1e18) < self.failure_backoff_s:
                continue
            w = self.waiting.get(step)
            if w is not None and honour_backoff and now < w.next_poll:
                continue
            if self._try(step, w):
                try:
                    up.apply_remote_retention()
                except UploadError as e:
                    log.error("remote retention failed: %s", e)
                return step  # re-scan: a newer step may have been committed meanwhile
        self._update_gauges()
        return None

    def _try(self, step: int, w: WaitingStep | None) -> bool:
        """Upload/poll ``step`` once; returns whether it is now remotely committed."""
        try:
            um = self.up.upload_step(step)
        except StepIncompleteError as e:
            self._on_incomplete(step, e)
            return False
        except OperationInterruptedError:
            log.info("step %d: upload interrupted by stop", step)
            return False
        except RunMismatchError:
            # raised to run_sidecar's caller, whose one line says it (the CLI's: exit 1); not logged
            # twice
            log.debug(
                "step %d: %s is claimed by another run; the sidecar stops", step, self.up.store.url
            )
            raise
        except StepSupersededError as e:
            log.warning("step %d: %s", step, e)
            self._forget(step)
            self._failed_at[step] = time.monotonic() + self.max_poll_interval_s
            return False
        except (CheckpointError, OSError) as e:
            log.error("step %d: upload failed: %s: %s", step, type(e).__name__, e)
            if isinstance(e, (LocalStepGoneError, NoCheckpointError)):
                self._forget(step)  # a transient failure keeps the wait (and its deadline) going
            self._failed_at[step] = time.monotonic()
            return False
        self._failed_at.pop(step, None)
        _log_committed(step, um, self.up.last_timing)
        if w is not None and w.stalled:
            log.info(
                "step %d: committed remotely after %.0f s stalled; released",
                step,
                time.monotonic() - w.since,
            )
        self._forget(step)
        return True

    def _on_incomplete(self, step: int, e: StepIncompleteError) -> None:
        now = time.monotonic()
        w = self.waiting.get(step)
        if w is None:
            w = self.waiting[step] = WaitingStep(since=now)
            log.info(
                "step %d: this node's shards confirmed; waiting for ranks %s",
                step,
                ranks_text(e.missing_ranks),
            )
        elif e.missing_ranks != w.missing:
            log.info("step %d: still waiting for ranks %s", step, ranks_text(e.missing_ranks))
        else:
            log.debug(
                "step %d: poll %d, still waiting for ranks %s",
                step,
                w.polls,
                ranks_text(e.missing_ranks),
            )
        w.polls += 1
        w.missing = e.missing_ranks
        metrics = self.up.metrics
        if metrics is not None:
            metrics.waiting_polls.inc()
        deadline = self.up.policy.stall_deadline_s
        if not w.stalled and deadline is not None and now - w.since >= deadline:
            self._stall(step, w, deadline)
        cap = self.max_poll_interval_s
        d = cap if w.stalled else min(cap, self.poll_interval_s * 2 ** (w.polls - 1))
        w.next_poll = now + self._rng.uniform(d / 2, d)

    def _stall(self, step: int, w: WaitingStep, deadline: float) -> None:
        w.stalled = True
        try:
            w.lock = acquire_step_lock(step_path(self.up.local_root, step), STALLED_LOCK_KIND)
        except OSError as exc:  # the step vanished meanwhile: nothing to keep
            log.debug("step %d: no stalled lock (%s)", step, exc)
        log.warning(
            "step %d: ranks %s not confirmed by the other nodes within %g s (stall deadline); "
            "stalled: kept locally, not counted against max_pending_uploads, newer steps go on; "
            "polled every ~%g s and committed if they confirm",
            step,
            ranks_text(w.missing),
            deadline,
            self.max_poll_interval_s,
        )
        if self.up.metrics is not None:
            self.up.metrics.stalls.inc()

    def _forget(self, step: int) -> None:
        """Drop ``step``'s waiting state and release its stalled lock."""
        w = self.waiting.pop(step, None)
        if w is not None and w.lock is not None:
            release_step_lock(w.lock)

    def _update_gauges(self) -> None:
        metrics = self.up.metrics
        if metrics is not None:
            metrics.waiting_steps.set(len(self.waiting))
            metrics.stalled_steps.set(sum(1 for w in self.waiting.values() if w.stalled))

    def close(self) -> None:
        """Release every stalled lock (the steps count as pending again while no sidecar runs)."""
        for step in list(self.waiting):
            self._forget(step)
        self._update_gauges()


def run_sidecar(
    uploader: Uploader,
    *,
    poll_interval_s: float = 2.0,
    metrics_port: int | None = None,
    shutdown_timeout_s: float = 30.0,
    stop_event: threading.Event | None = None,
    once: bool = False,
    max_poll_interval_s: float = 60.0,
    metrics_host: str = "127.0.0.1",
) -> int:
    """Run the upload loop until SIGTERM/SIGINT (or ``stop_event``). ``metrics_port``: serve
    ``/metrics`` there, bound to ``metrics_host`` (default loopback only). Returns the exit code
    (0). Raises what stopped the loop (``RunMismatchError``: the prefix belongs to another run),
    ``OSError`` when the metrics address cannot be bound."""
    stop = stop_event if stop_event is not None else uploader.stop_event
    previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping the sidecar (in-flight uploads finish or abort)", signum)
        stop.set()
        uploader.stop_event.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    if metrics_port is not None and uploader.metrics is not None:
        try:
            uploader.metrics.serve(metrics_port, addr=metrics_host)
        except BaseException:  # e.g. the address is in use: put the signal handlers back
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            raise
        log.info("metrics on %s", uploader.metrics.url)
    log.info(
        "sidecar: %s -> %s (poll every %.1f s, waiting steps back off to %.1f s)",
        uploader.local_root,
        uploader.store.url,
        poll_interval_s,
        max_poll_interval_s,
    )
    error: list[BaseException] = []
    loop = UploadLoop(
        uploader, poll_interval_s=poll_interval_s, max_poll_interval_s=max_poll_interval_s
    )

    def work() -> None:
        try:
            loop.run(stop, once=once)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            error.append(e)

    worker = threading.Thread(target=work, name="tc-sidecar", daemon=True)
    worker.start()
    try:
        while worker.is_alive() and not stop.is_set():
            worker.join(0.2)
        deadline = time.monotonic() + shutdown_timeout_s
        while worker.is_alive() and time.monotonic() < deadline:
            worker.join(0.2)
        if worker.is_alive():
            log.error(
                "sidecar: upload loop did not stop within %.0f s; exiting anyway",
                shutdown_timeout_s,
            )
            return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if uploader.metrics is not None:
            uploader.metrics.close()
    try:
        loop.close()
        uploader.close()
    except Exception as e:  # noqa: BLE001 - shutting down
        log.warning("sidecar: close failed: %s", e)
    if error:
        raise error[0]
    log.info("sidecar stopped")
    return 0


__all__ = ["STALLED_LOCK_KIND", "UploadLoop", "WaitingStep", "ranks_text", "run_sidecar"]
