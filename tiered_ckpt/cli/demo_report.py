"""The demo's report: what the story measured (:class:`DemoReport`), as text
(:func:`format_report`), as JSON (:meth:`DemoReport.to_dict`) and as a PNG of both loss curves
(:func:`plot_curves`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_ckpt.redact import redact_url

MiB = 1024 * 1024
#: ``DemoConfig.model`` -> how the report names it.
MODEL_LABELS = {"zero": "ZeRO-1", "fsdp2": "FSDP2"}
_CHECKPOINTED_BY = {
    "zero": "CheckpointManager",
    "fsdp2": "torch.distributed.checkpoint + DCPCheckpointManager",
}

__all__ = ["DemoReport", "format_report", "plot_curves", "MiB", "MODEL_LABELS"]


@dataclass
class DemoReport:
    """The story's figures. Steps are training steps (1-based); ``baseline``/``resumed``: step ->
    mean loss over the ranks; ``phase_of_step``: step -> the run (1, 2, 3) whose value ``resumed``
    holds. ``bytes_*``: bytes; ``save_s``: seconds of each committed save's background write + hash
    + commit on rank 0 (from the jobs' :class:`~tiered_ckpt.training.SaveOutcome` records);
    ``saves_unlogged``: the committed steps of ``steps_saved`` without such a record (a job
    SIGKILLed between a commit and its record: the save happened, its time is unknown);
    ``upload_latency_s``: seconds from a step's local commit to the sidecar's uploaded marker;
    ``restore_s``: seconds of the restore (download + verify + local commit); ``stage_s``: stage
    name -> seconds. ``model``: the training job (``"zero"`` or ``"fsdp2"``,
    :data:`MODEL_LABELS`)."""

    steps: int
    remote_url: str
    endpoint: str
    baseline: dict[int, float]
    resumed: dict[
        int, float
    ]  # the story's curve: each step's value from the phase that last ran it
    phase_of_step: dict[int, int]
    crash_at: int = 0
    resumed_from_local: int = 0
    loss_at: int = 0
    restored_step: int = 0
    bytes_written: int = 0
    bytes_uploaded: int = 0
    steps_saved: int = 0
    steps_uploaded: int = 0
    save_s: list[float] = field(default_factory=list)
    saves_unlogged: list[int] = field(default_factory=list)
    upload_latency_s: list[float] = field(default_factory=list)
    restore_s: float = 0.0
    restore_bytes: int = 0
    max_abs_diff: float = float("nan")
    max_abs_diff_all_runs: float = float("nan")
    plot_path: Path | None = None
    wall_s: float = 0.0
    stage_s: dict[str, float] = field(default_factory=dict)
    model: str = "zero"

    def to_dict(self) -> dict[str, Any]:
        d = {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("baseline", "resumed", "phase_of_step")
        }
        d["plot_path"] = str(self.plot_path) if self.plot_path else None
        d["endpoint"] = redact_url(self.endpoint)
        d["curves"] = [
            {
                "step": s,
                "baseline": self.baseline.get(s),
                "resumed": self.resumed.get(s),
                "phase": self.phase_of_step.get(s),
            }
            for s in sorted(self.baseline)
        ]
        return d


def plot_curves(report: DemoReport, path: Path) -> Path:
    """Both loss curves (PNG, matplotlib's Agg backend), with the crash, resume and restore
    marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(report.baseline)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(
        steps,
        [report.baseline[s] for s in steps],
        color="black",
        lw=2.5,
        alpha=0.35,
        label="uninterrupted baseline",
    )
    colors = {1: "tab:blue", 2: "tab:orange", 3: "tab:green"}
    names = {
        1: "run 1 (SIGKILLed)",
        2: "run 2 (resumed from local disk)",
        3: "run 3 (restored from bucket)",
    }
    for ph in (1, 2, 3):
        xs = [s for s in steps if report.phase_of_step.get(s) == ph]
        ax.plot(xs, [report.resumed[s] for s in xs], "o", ms=3.5, color=colors[ph], label=names[ph])
    for x, text in ((report.crash_at, "SIGKILL"), (report.loss_at, "cluster loss")):
        ax.axvline(x + 0.5, color="red", ls="--", lw=1)
        ax.text(x + 0.7, ax.get_ylim()[1], text, color="red", va="top", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(
        f"tiered-ckpt demo ({MODEL_LABELS.get(report.model, report.model)}): "
        f"max |loss difference| = {report.max_abs_diff:.3g}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _unlogged(r: DemoReport) -> str:
    """What the save times' ``n`` leaves out, e.g. `` of 12 checkpoints; step 10: save time not
    logged, its job was SIGKILLed between the commit and the record``; nothing when every
    checkpoint's time is there. (Only the jobs before the cluster loss, steps up to ``loss_at``, are
    SIGKILLed.)"""
    if not r.saves_unlogged:
        return ""
    steps = ", ".join(map(str, r.saves_unlogged))
    killed = all(s <= r.loss_at for s in r.saves_unlogged)
    why = f", {'its job was' if len(r.saves_unlogged) == 1 else 'their jobs were'} SIGKILLed between the commit and the record"
    return (
        f" of {r.steps_saved} checkpoints; step{'' if len(r.saves_unlogged) == 1 else 's'} {steps}: "
        f"save time not logged{why if killed else ''}"
    )


def format_report(r: DemoReport) -> str:
    """The report as text: the figures, then one row per step of both curves."""

    def stats(xs: list[float], what: str = "") -> str:
        return (
            f"mean {sum(xs) / len(xs):.3f} s, max {max(xs):.3f} s (n={len(xs)}{what})"
            if xs
            else "n/a"
        )

    lines = [
        "",
        "tiered-ckpt demo report",
        f"  model                  {r.model}: 4-rank {MODEL_LABELS.get(r.model, r.model)} job, gloo, "
        f"checkpointed by {_CHECKPOINTED_BY.get(r.model, '?')}",
        f"  steps                  {r.steps}; crash at step {r.crash_at}, resumed from "
        f"local step {r.resumed_from_local}; cluster loss at step {r.loss_at}, restored step {r.restored_step}",
        f"  bucket                 {r.remote_url} ({redact_url(r.endpoint)})",
        f"  bytes written locally  {r.bytes_written / MiB:.1f} MiB in {r.steps_saved} checkpoints",
        f"  bytes uploaded         {r.bytes_uploaded / MiB:.1f} MiB in {r.steps_uploaded} remotely committed steps",
        f"  save time (background write+hash+commit)  {stats(r.save_s, _unlogged(r))}",
        f"  upload time (local commit -> remote commit)  {stats(r.upload_latency_s)}",
        f"  restore time           {r.restore_s:.2f} s for {r.restore_bytes / MiB:.1f} MiB (download + sha256 "
        f"verify + local commit)",
        f"  max |loss diff|        {r.max_abs_diff!r} vs the uninterrupted baseline "
        f"(every logged value, incl. steps re-run after a crash: {r.max_abs_diff_all_runs!r})",
        f"  plot                   {r.plot_path}"
        if r.plot_path
        else "  plot                   (not written)",
        f"  wall time              {r.wall_s:.1f} s ({', '.join(f'{k} {v:.1f}s' for k, v in r.stage_s.items())})",
        "",
        "  step  baseline     story        |diff|    run",
    ]
    for s in sorted(r.baseline):
        b, v = r.baseline[s], r.resumed[s]
        lines.append(f"  {s:4d}  {b:.8f}  {v:.8f}  {abs(v - b):.1e}   {r.phase_of_step[s]}")
    return "\n".join(lines)
