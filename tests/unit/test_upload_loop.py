"""The sidecar loop's timing (tiered_ckpt.remote.upload.daemon.UploadLoop; SPEC §11 "Sidecar at scale")
against a stand-in uploader: exponential backoff with jitter per waiting step, the stall deadline
(one WARNING, the metrics, the ``stalled`` lock), newer steps never blocked, RunMismatchError stops
the loop. The same loop against a real sidecar process and S3 server:
tests/multiproc/test_sidecar_stall.py."""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tiered_ckpt.errors import RunMismatchError
from tiered_ckpt.layout import LOCK_PREFIX, step_dir_name
from tiered_ckpt.remote.errors import StepIncompleteError
from tiered_ckpt.remote.upload.daemon import UploadLoop, ranks_text
from tiered_ckpt.remote.upload.metrics import UploadMetrics
from tiered_ckpt.remote.upload.uploader import UploadPolicy


class FakeUploader:
    """Steps in ``incomplete`` wait for ranks 2-3; the others commit."""

    def __init__(
        self, root: Path, pending: list[int], *, deadline_s: float | None = 1800.0
    ) -> None:
        self.local_root = root
        self.store = SimpleNamespace(url="s3://bucket/prefix")
        self.policy = UploadPolicy(stall_deadline_s=deadline_s)
        self.metrics = UploadMetrics()
        self.stop_event = threading.Event()
        self.pending = pending
        self.incomplete = set(pending)
        self.calls: list[int] = []
        self.error: BaseException | None = None
        self.abort_sweeps = 0
        self.sweep_error: BaseException | None = None
        self.last_timing = None
        for s in pending:
            (root / step_dir_name(s)).mkdir(parents=True)

    def select_pending(self) -> list[int]:
        return sorted(self.pending, reverse=True)

    def learn_newest_remote(self) -> None:
        pass

    def abort_abandoned_uploads(self) -> int:
        return 0

    def upload_step(self, step: int) -> None:
        self.calls.append(step)
        if self.error is not None:
            raise self.error
        if step in self.incomplete:
            raise StepIncompleteError(f"step {step}: ranks [2, 3] not confirmed", [2, 3])
        self.pending.remove(step)

    def apply_remote_retention(self) -> list[int]:
        return []

    def mirror_pins(self) -> list[int]:
        return []

    def sweep_pending_aborts(self) -> int:
        self.abort_sweeps += 1
        if self.sweep_error is not None:
            raise self.sweep_error
        return 0


def _loop(up: FakeUploader, poll: float = 0.1, cap: float = 0.8) -> UploadLoop:
    return UploadLoop(
        up,  # type: ignore[arg-type]
        poll_interval_s=poll,
        max_poll_interval_s=cap,
        failure_backoff_s=10.0,
        rng=random.Random(1),
    )


def _stall_locks(up: FakeUploader, step: int) -> list[str]:
    return [
        p.name
        for p in (up.local_root / step_dir_name(step)).iterdir()
        if p.name.startswith(f"{LOCK_PREFIX}stalled.")
    ]


def test_polls_back_off_exponentially_to_the_cap_with_jitter(tmp_path: Path) -> None:
    up = FakeUploader(tmp_path, [7])
    loop = _loop(up)
    stop = threading.Event()
    for n, d in enumerate([0.1, 0.2, 0.4, 0.8, 0.8, 0.8], start=1):
        t0 = time.monotonic()
        assert loop.pass_once(stop, honour_backoff=False) is None
        t1 = time.monotonic()
        w = loop.waiting[7]
        assert w.polls == n and w.missing == (2, 3)
        assert t0 + d / 2 <= w.next_poll <= t1 + d, (n, d, w.next_poll - t0)
    assert up.metrics.waiting_polls._value.get() == 6
    assert up.metrics.waiting_steps._value.get() == 1 and up.metrics.stalled_steps._value.get() == 0


def test_a_waiting_step_is_not_polled_before_its_time_and_never_blocks_a_newer_one(
    tmp_path: Path,
) -> None:
    up = FakeUploader(tmp_path, [7], deadline_s=None)
    loop = _loop(up, poll=5.0, cap=5.0)
    stop = threading.Event()
    assert loop.pass_once(stop) is None and up.calls == [7]
    assert loop.pass_once(stop) is None and up.calls == [7]  # not due for >= 2.5 s
    (tmp_path / step_dir_name(8)).mkdir()
    up.pending.append(8)  # a newer step, which the other nodes confirm
    assert loop.pass_once(stop) == 8 and up.calls == [7, 8]
    assert 0.01 <= loop._idle_s() <= 5.0


def test_a_step_past_the_deadline_is_reported_once_kept_and_committed_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tiered_ckpt.remote.upload.daemon")
    up = FakeUploader(tmp_path, [7], deadline_s=0.05)
    loop = _loop(up, poll=0.01, cap=0.02)
    stop = threading.Event()
    loop.pass_once(stop, honour_backoff=False)
    assert not loop.waiting[7].stalled and _stall_locks(up, 7) == []
    time.sleep(0.06)
    for _ in range(3):
        loop.pass_once(stop, honour_backoff=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(
        "step 7: ranks 2-3 not confirmed by the other nodes within 0.05 s"
    )
    assert loop.waiting[7].stalled and len(_stall_locks(up, 7)) == 1
    assert up.metrics.stalls._value.get() == 1 and up.metrics.stalled_steps._value.get() == 1
    t0 = time.monotonic()
    loop.pass_once(stop, honour_backoff=False)
    assert t0 + 0.01 <= loop.waiting[7].next_poll <= time.monotonic() + 0.02  # polled at the cap
    up.incomplete.clear()  # the other node confirms at last
    assert loop.pass_once(stop, honour_backoff=False) == 7
    assert 7 not in loop.waiting and _stall_locks(up, 7) == []
    loop.pass_once(stop)
    assert up.metrics.stalled_steps._value.get() == 0 and up.metrics.stalls._value.get() == 1
    assert any("committed remotely after" in r.getMessage() for r in caplog.records)


def test_a_stalled_step_that_leaves_the_backlog_releases_its_lock(tmp_path: Path) -> None:
    up = FakeUploader(tmp_path, [7], deadline_s=0.01)
    loop = _loop(up, poll=0.01, cap=0.01)
    stop = threading.Event()
    loop.pass_once(stop, honour_backoff=False)
    time.sleep(0.02)
    loop.pass_once(stop, honour_backoff=False)
    assert len(_stall_locks(up, 7)) == 1
    up.pending.clear()  # e.g. released by skip_intermediate, or committed and marked by another path
    loop.pass_once(stop)
    assert loop.waiting == {} and _stall_locks(up, 7) == []
    up.pending.append(7)
    loop.pass_once(stop, honour_backoff=False)
    time.sleep(0.02)
    loop.pass_once(stop, honour_backoff=False)
    loop.close()  # the sidecar stops: the step counts as pending again
    assert _stall_locks(up, 7) == []


def test_run_mismatch_stops_the_loop(tmp_path: Path) -> None:
    up = FakeUploader(tmp_path, [7])
    up.error = RunMismatchError("s3://bucket/prefix is claimed by run b", claimed_by="b", ours="a")
    loop = _loop(up)
    with pytest.raises(RunMismatchError):
        loop.run(threading.Event())
    assert up.calls == [7]


def test_every_pass_sweeps_the_recorded_aborts_and_a_failing_sweep_blocks_nothing(
    tmp_path: Path,
) -> None:
    up = FakeUploader(tmp_path, [7, 8])
    up.incomplete = set()
    loop = _loop(up)
    stop = threading.Event()
    up.sweep_error = OSError(28, "No space left on device")
    assert loop.pass_once(stop) == 8 and up.abort_sweeps == 1
    up.sweep_error = None
    assert loop.pass_once(stop) == 7 and up.abort_sweeps == 2
    assert loop.pass_once(stop) is None and up.abort_sweeps == 3


def test_ranks_text() -> None:
    assert ranks_text([]) == ""
    assert ranks_text([3, 2, 5, 6, 7, 9]) == "2-3,5-7,9"
    assert ranks_text(range(8, 64)) == "8-63"
