"""Preemption of the FSDP2 example (:mod:`tiered_ckpt.examples.train_fsdp2`, one gloo rank on CPU)
with ``--handle-sigterm``: SIGTERM mid-run makes the next step's save synchronous, the run stops
there and exits 0 with that step committed; a resumed run continues on the loss curve of an
uninterrupted run exactly (slow: three training processes)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from spawn import start_ranks, wait_ranks
from test_resume_drill import losses

import tiered_ckpt.examples
from tiered_ckpt.local.catalogue import committed_steps

pytestmark = pytest.mark.slow

SCRIPT = Path(tiered_ckpt.examples.__file__).parent / "train_fsdp2.py"
STEPS = 12


def args(root: Path, log: Path, *extra: str) -> list[str]:
    return [
        "--steps",
        str(STEPS),
        "--ckpt-every",
        "3",
        "--seed",
        "3",
        "--root",
        str(root),
        "--loss-log",
        str(log),
        *extra,
    ]


def test_sigterm_saves_a_final_step_exits_0_and_the_resumed_run_matches(tmp_path: Path) -> None:
    ref_log = tmp_path / "ref.jsonl"
    wait_ranks(start_ranks(SCRIPT, *args(tmp_path / "ref", ref_log), world=1), timeout=240)
    ref = losses(ref_log)
    assert sorted(ref) == list(range(1, STEPS + 1))

    root, log1, log2 = tmp_path / "ckpt", tmp_path / "killed.jsonl", tmp_path / "resumed.jsonl"
    (p,) = start_ranks(
        SCRIPT, *args(root, log1, "--handle-sigterm", "--sleep-per-step", "0.3"), world=1
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and p.poll() is None and max(losses(log1), default=0) < 4:
        time.sleep(0.02)
    assert p.poll() is None, p.communicate()[0].decode(errors="replace")[-3000:]
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=120)[0].decode(errors="replace")
    assert p.returncode == 0, out[-3000:]
    stopped = max(losses(log1))
    assert 4 <= stopped < STEPS, stopped
    assert committed_steps(root)[-1] == stopped  # the final save, synchronous, committed
    assert all(losses(log1)[s] == ref[s] for s in losses(log1))

    (out2,) = wait_ranks(start_ranks(SCRIPT, *args(root, log2), world=1), timeout=240)
    assert f"resumed from step {stopped}" in out2, out2[-3000:]
    resumed = losses(log2)
    assert sorted(resumed) == list(range(stopped + 1, STEPS + 1))
    assert max(abs(resumed[s] - ref[s]) for s in resumed) == 0.0
