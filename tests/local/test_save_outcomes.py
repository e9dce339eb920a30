"""CheckpointManager's save outcomes as data (SaveOutcome, save_outcomes, on_save_outcome) and the
job event log written from them (tiered_ckpt.training.events), which the demo reads instead of log
text."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tiered_ckpt import CheckpointError
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.training import CheckpointManager, JobEventLog, SaveOutcome, read_job_events


@pytest.mark.parametrize("async_save", [True, False])
def test_outcomes_of_committed_saves(tmp_path, async_save):
    seen: list[SaveOutcome] = []
    with CheckpointManager(tmp_path, async_save=async_save, on_save_outcome=seen.append) as m:
        for step in (1, 2, 3):
            m.save(step, {"x": np.full(1000, step, dtype=np.float32)})
        m.wait()
        outcomes = m.save_outcomes
    assert [o.step for o in outcomes] == [1, 2, 3]
    assert list(outcomes) == seen
    for o in outcomes:
        assert o.ok and o.error is None and o.rank == 0 and o.committed_here
        assert 0.0 < o.seconds < 30.0
        assert o.stage_seconds >= 0.0
        if not async_save:
            assert o.stage_seconds == 0.0


def test_failed_background_save_has_an_error_outcome(tmp_path):
    seen: list[SaveOutcome] = []
    m = CheckpointManager(tmp_path, on_save_outcome=seen.append)
    m.save(1, {"x": np.zeros(10)})
    m.wait()
    (tmp_path / step_dir_name(2)).write_bytes(
        b""
    )  # a file where step 2's directory must go: a real OSError
    m.save(2, {"x": np.ones(10)})
    with pytest.raises(CheckpointError):
        m.wait()
    m.close()
    assert [o.ok for o in seen] == [True, False] and list(m.save_outcomes) == seen
    assert seen[1].step == 2 and seen[1].error and not seen[1].committed_here
    assert m.latest_step() == 1


def test_a_failing_callback_does_not_fail_the_save(tmp_path):
    def boom(outcome: SaveOutcome) -> None:
        raise RuntimeError("reporting hook broke")

    with CheckpointManager(tmp_path, on_save_outcome=boom) as m:
        m.save(1, {"x": np.zeros(10)})
        m.wait()
        assert m.latest_step() == 1 and m.save_outcomes[0].ok


def test_outcome_json_roundtrip():
    o = SaveOutcome(
        step=7, rank=3, seconds=0.25, stage_seconds=0.01, committed_here=True, error=None
    )
    assert SaveOutcome.from_json(json.loads(json.dumps(o.to_json()))) == o
    bad = SaveOutcome(step=8, rank=0, seconds=0.1, error="OSError: disk full")
    assert not bad.ok and SaveOutcome.from_json(bad.to_json()) == bad
    with pytest.raises(TypeError):
        SaveOutcome.from_json({**o.to_json(), "error": 5})


def test_job_event_log_roundtrip_skips_a_cut_line(tmp_path):
    path = tmp_path / "events.jsonl"
    with (
        JobEventLog(path) as ev,
        CheckpointManager(tmp_path / "ckpt", on_save_outcome=ev.save) as m,
    ):
        ev.resumed(5)
        m.save(6, {"x": np.zeros(10)})
        m.save(7, {"x": np.zeros(10)})
        m.wait()
        outcomes = m.save_outcomes
    with open(path, "a") as f:
        f.write('{"event": "save", "step": 8, "ra')  # cut by a SIGKILL
    events = read_job_events(path)
    assert events.resumed_from == 5
    assert events.saves == outcomes
    assert read_job_events(tmp_path / "absent.jsonl").saves == ()
