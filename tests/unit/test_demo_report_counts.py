"""The demo report's save-time count says what it counts: a checkpoint committed
by a job SIGKILLed before it logged the save's outcome is named, not silently left out of ``n``."""

from __future__ import annotations

from tiered_ckpt.cli.demo_report import DemoReport, format_report


def _report(**kw) -> DemoReport:
    return DemoReport(
        steps=60,
        remote_url="s3://b/p",
        endpoint="http://127.0.0.1:1",
        baseline={1: 1.0},
        resumed={1: 1.0},
        phase_of_step={1: 1},
        crash_at=12,
        loss_at=27,
        steps_saved=12,
        **kw,
    )


def _save_line(r: DemoReport) -> str:
    (line,) = [ln for ln in format_report(r).splitlines() if "save time" in ln]
    return line


def test_save_time_count_names_the_checkpoint_without_a_time() -> None:
    r = _report(save_s=[0.1] * 11, saves_unlogged=[10])
    assert _save_line(r).endswith(
        "mean 0.100 s, max 0.100 s (n=11 of 12 checkpoints; step 10: save time not "
        "logged, its job was SIGKILLed between the commit and the record)"
    )
    assert r.to_dict()["saves_unlogged"] == [10]


def test_save_time_count_when_every_checkpoint_has_its_time() -> None:
    assert _save_line(_report(save_s=[0.1] * 12)).endswith("(n=12)")
