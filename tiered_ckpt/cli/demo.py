"""``tiered-ckpt demo``: the whole story on one command, on real input, with no server to set up.

Stages (each a real process; the demo only launches, watches and measures):

1. **S3**: an embedded S3 server (moto's ``ThreadedMotoServer``, in this process, on 127.0.0.1), or
   with ``--server seaweedfs`` a SeaweedFS ``weed mini`` process (loopback only, checking signatures
   and checksums: :mod:`tiered_ckpt.cli.demo_seaweed`), or the S3 / MinIO at ``--endpoint-url`` /
   ``AWS_ENDPOINT_URL``; a fresh prefix in the bucket.
2. **Baseline**: the 4-rank torch.distributed example of ``model`` runs uninterrupted, as its own
   job (gloo on CPU, a tiny GPT on the Python standard library's sources): ``"zero"``, the ZeRO-1
   example (:mod:`tiered_ckpt.examples.train_zero`,
   :class:`~tiered_ckpt.training.CheckpointManager`), or ``"fsdp2"``, the FSDP2 one
   (:mod:`tiered_ckpt.examples.train_fsdp2`, checkpointed through ``torch.distributed.checkpoint``
   by :class:`~tiered_ckpt.dcp.DCPCheckpointManager`). Every later stage runs the same example with
   the same flags.
3. **Sidecar**: ``tiered-ckpt upload --watch`` starts as a separate process on the story's local
   tier.
4. **Crash**: the same job checkpoints every few steps; after two committed checkpoints the whole
   job (every rank, its process group) is SIGKILLed.
5. **Resume from local disk**: relaunched, it resumes from its newest committed step.
6. **Cluster loss**: once the sidecar has uploaded a step newer than that, the job and the sidecar
   are SIGKILLed and the local tier is deleted.
7. **Restore** from the bucket (:func:`tiered_ckpt.remote.restore.restorer.restore_detailed`), a new sidecar,
   resume again, run to the end; the sidecar uploads the final step.
8. **Report**: steps, bytes written and uploaded, save / upload / restore times, the max abs loss
   difference against the baseline, both curves, and a PNG plot.

Fails (:class:`DemoError`, one line naming the stage) if any stage fails or the curves differ by
more than ``tolerance``.

Save times come from the jobs' event logs (:class:`tiered_ckpt.training.JobEventLog`: each save's
:class:`~tiered_ckpt.training.SaveOutcome` as a JSON line, and the step a job resumed from), never
from log text. The machinery (S3, processes) is :mod:`tiered_ckpt.cli.demo_procs`; the report,
:mod:`tiered_ckpt.cli.demo_report`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tiered_ckpt.cli.demo_procs import (
    DEMO_SERVERS,
    DemoError,
    DemoS3,
    Job,
    S3Target,
    launcher_argv,
    read_losses,
    sidecar_argv,
    wait_for,
)
from tiered_ckpt.cli.demo_report import MODEL_LABELS, DemoReport, MiB, format_report, plot_curves
from tiered_ckpt.layout import MANIFEST_NAME, step_dir_name
from tiered_ckpt.local.catalogue import committed_steps, read_manifest
from tiered_ckpt.local.markers import has_uploaded_marker, uploaded_marker_time
from tiered_ckpt.training import read_job_events

__all__ = ["DemoConfig", "DemoReport", "DemoError", "run_demo", "format_report", "plot_curves"]

#: The training jobs the story can run (``DemoConfig.model``): the packaged examples (present after
#: ``pip install``; ``fsdp2`` needs torch's ``fully_shard``, torch >= 2.6). Both take the same
#: flags.
TRAINER_MODULES = {
    "zero": "tiered_ckpt.examples.train_zero",
    "fsdp2": "tiered_ckpt.examples.train_fsdp2",
}
N_RANKS = 4


@dataclass(frozen=True)
class DemoConfig:
    """``workdir``: where everything goes (kept). ``steps``/``ckpt_every``/``seed``: the training
    run. ``endpoint_url``: an external S3/MinIO (default: ``AWS_ENDPOINT_URL``, else a local
    server). ``server``: the local server when there is no endpoint: ``"moto"`` (embedded) or
    ``"seaweedfs"`` (``weed mini``, whose data goes under ``workdir``).
    ``sleep_per_step_s``: slows the interrupted job so that kills land between checkpoints.
    ``tolerance``: the largest acceptable abs loss difference. ``model``: the training job, a key of
    :data:`TRAINER_MODULES` (``"zero"``: ZeRO-1, ``"fsdp2"``: FSDP2 through DCP)."""

    workdir: Path
    steps: int = 60
    ckpt_every: int = 5
    seed: int = 0
    endpoint_url: str | None = None
    bucket: str = "tiered-ckpt-demo"
    sleep_per_step_s: float = 0.15
    tolerance: float = 1e-4
    stage_timeout_s: float = 300.0
    plot: bool = True
    server: str = "moto"
    model: str = "zero"

    def __post_init__(self) -> None:
        if self.model not in TRAINER_MODULES:
            raise ValueError(f"model {self.model!r} is not one of {', '.join(TRAINER_MODULES)}")
        if self.server not in DEMO_SERVERS:
            raise ValueError(f"server {self.server!r} is not one of {', '.join(DEMO_SERVERS)}")
        if self.server != "moto" and self.endpoint_url:
            raise ValueError(
                f"--server {self.server} starts its own S3 server: do not give --endpoint-url too"
            )
        if self.steps < 4 * self.ckpt_every:
            raise ValueError(
                f"steps ({self.steps}) must be >= 4 x ckpt_every ({self.ckpt_every}) for the story"
            )
        if self.ckpt_every < 1:
            raise ValueError("ckpt_every must be >= 1")


def _bytes_by_step(root: Path) -> dict[int, int]:
    """step -> bytes of its shards, for every step committed under ``root``."""
    return {s: read_manifest(root, s).total_bytes for s in committed_steps(root)}


def _upload_latencies(root: Path) -> dict[int, float]:
    """step -> seconds from the local commit (manifest.json) to the sidecar's marker after the
    remote commit, for every committed step under ``root`` that has the marker (file mtimes)."""
    out = {}
    for s in committed_steps(root):
        sdir = root / step_dir_name(s)
        uploaded = uploaded_marker_time(sdir)
        try:
            committed = (sdir / MANIFEST_NAME).stat().st_mtime
        except OSError:
            continue
        if uploaded is not None:
            out[s] = uploaded - committed
    return out


class _Demo:
    """One run of the story. Each ``_stage_*`` method is one stage of the module docstring; they run
    in order (:meth:`run`) and hand their results on as attributes."""

    target: S3Target  # set by run() before the first stage

    def __init__(self, cfg: DemoConfig, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.say = say
        self.work = cfg.workdir.absolute()
        self.logs = self.work / "logs"
        self.s3 = DemoS3()
        self.jobs: list[Job] = []
        self.env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            TRAIN_ZERO_LOG="INFO",
            TRAIN_FSDP2_LOG="INFO",
            PYTHONUNBUFFERED="1",
        )
        self.stage_s: dict[str, float] = {}
        self.base_root, self.base_log = (
            self.work / "baseline" / "ckpt",
            self.work / "baseline" / "loss.jsonl",
        )
        self.story_dir = self.work / "story"
        self.story_root = self.story_dir / "ckpt"
        self.loss_logs = [self.story_dir / f"loss_phase{i}.jsonl" for i in (1, 2, 3)]

    # --- processes

    def events_log(self, name: str) -> Path:
        return self.logs / f"{name}.events.jsonl"

    def trainer(self, name: str, root: Path, loss_log: Path, *, sleep: float) -> Job:
        args = [
            "--steps",
            str(self.cfg.steps),
            "--ckpt-every",
            str(self.cfg.ckpt_every),
            "--root",
            str(root),
            "--seed",
            str(self.cfg.seed),
            "--loss-log",
            str(loss_log),
            "--keep-last",
            "1000",
            "--sleep-per-step",
            str(sleep),
            "--events-log",
            str(self.events_log(name)),
        ]
        job = Job(
            launcher_argv(N_RANKS, TRAINER_MODULES[self.cfg.model], args),
            self.logs / f"{name}.log",
            self.env,
        )
        self.jobs.append(job)
        return job

    def sidecar(self, name: str, remote_url: str) -> Job:
        argv = sidecar_argv(self.story_root, remote_url, self.env["AWS_ENDPOINT_URL"])
        job = Job(argv, self.logs / f"{name}.log", self.env)
        self.jobs.append(job)
        return job

    def finish(self, job: Job, what: str) -> None:
        try:
            rc = job.wait(self.cfg.stage_timeout_s)
        except subprocess.TimeoutExpired:
            raise DemoError(
                f"{what}: timed out after {self.cfg.stage_timeout_s:.0f} s; see {job.log_path}"
            ) from None
        if rc != 0:
            last = job.tail(1).strip()
            raise DemoError(f"{what}: exited with code {rc} ({last[:160]}); see {job.log_path}")

    def resumed_from(self, name: str, job: Job) -> int:
        step = read_job_events(self.events_log(name)).resumed_from
        if step is None:
            raise DemoError(f"{name}: the job did not resume from a checkpoint; see {job.log_path}")
        return step

    def close(self) -> None:
        for job in self.jobs:
            job.close()
        self.s3.stop()

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        yield
        self.stage_s[name] = round(time.monotonic() - t0, 2)

    # --- the stages

    def run(self) -> DemoReport:
        t_start = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        with self.timed("s3"):
            self.target = self.s3.start(
                self.cfg.endpoint_url,
                self.cfg.bucket,
                self.env,
                server=self.cfg.server,
                workdir=self.work / "seaweedfs",
            )
            self.say(f"[1/8] S3: {self.target.where}; uploading to {self.target.remote_url}")
        for p in (self.base_root.parent, self.story_dir):
            if p.exists():
                shutil.rmtree(p)
            p.mkdir(parents=True)
        with self.timed("baseline"):
            self._stage_baseline()
        with self.timed("crash"):
            self._stage_sidecar_and_crash()
        with self.timed("resume_local"):
            self._stage_resume_local()
        with self.timed("cluster_loss"):
            self._stage_cluster_loss()
        with self.timed("restore_and_finish"):
            self._stage_restore_and_finish()
        report = self._report()
        if self.cfg.plot:
            report.plot_path = plot_curves(report, self.work / "loss_curves.png")
        report.wall_s = time.monotonic() - t_start
        self.say("[8/8] report")
        return report

    def _stage_baseline(self) -> None:
        cfg = self.cfg
        self.say(
            f"[2/8] baseline: 4-rank {MODEL_LABELS[cfg.model]} run ({TRAINER_MODULES[cfg.model]}), "
            f"{cfg.steps} steps, uninterrupted (its own job)"
        )
        self.finish(
            self.trainer("baseline", self.base_root, self.base_log, sleep=0.0), "baseline run"
        )
        self.baseline = read_losses(self.base_log)
        if sorted(self.baseline) != list(range(1, cfg.steps + 1)):
            raise DemoError(
                f"baseline run: logged {len(self.baseline)} of {cfg.steps} steps; see {self.logs}"
            )

    def _stage_sidecar_and_crash(self) -> None:
        root = self.story_root
        self.side1 = self.sidecar("sidecar1", self.target.remote_url)
        self.say("[3/8] sidecar: `tiered-ckpt upload --watch` started as its own process")
        job1 = self.trainer("phase1", root, self.loss_logs[0], sleep=self.cfg.sleep_per_step_s)
        wait_for(
            lambda: len(committed_steps(root)) >= 2,
            "crash: two checkpoints",
            self.cfg.stage_timeout_s,
            job=job1,
        )
        job1.kill()
        job1.wait(60)
        self.crash_at = max(read_losses(self.loss_logs[0]), default=0)
        self.newest = committed_steps(root)[-1]
        self.say(
            f"[4/8] crash: SIGKILL of the whole job (all ranks) at step {self.crash_at}; committed locally: "
            f"{committed_steps(root)}"
        )

    def _stage_resume_local(self) -> None:
        root, newest = self.story_root, self.newest
        job2 = self.trainer("phase2", root, self.loss_logs[1], sleep=self.cfg.sleep_per_step_s)

        def uploaded_after(step: int) -> bool:
            return any(
                has_uploaded_marker(root / step_dir_name(s))
                for s in committed_steps(root)
                if s > step
            )

        wait_for(
            lambda: uploaded_after(newest),
            "resume from local disk: an upload of a newer step",
            self.cfg.stage_timeout_s,
            job=job2,
        )
        job2.kill()
        self.side1.kill()
        job2.wait(60)
        self.side1.wait(60)
        self.resumed_local = self.resumed_from("phase2", job2)
        if self.resumed_local != newest:
            raise DemoError(
                f"resume from local disk: resumed from step {self.resumed_local}, expected {newest}"
            )
        self.loss_at = max(read_losses(self.loss_logs[1]), default=0)
        self.say(
            f"[5/8] resume from local disk: from step {self.resumed_local}, trained to step {self.loss_at}"
        )

    def _stage_cluster_loss(self) -> None:
        from tiered_ckpt.remote.restore.restorer import list_remote_steps

        self.written = _bytes_by_step(self.story_root)
        self.upload_lat = list(_upload_latencies(self.story_root).values())
        shutil.rmtree(self.story_root)
        self.remote = [
            s for s in list_remote_steps(self.target.remote_url, store=self.target.store) if s.ok
        ]
        self.say(
            f"[6/8] cluster loss: job and sidecar SIGKILLed at step {self.loss_at}, local tier deleted; "
            f"remotely committed: {[s.step for s in self.remote]}"
        )

    def _stage_restore_and_finish(self) -> None:
        from tiered_ckpt.remote.restore.restorer import list_remote_steps, restore_detailed

        cfg, root, target = self.cfg, self.story_root, self.target
        res = restore_detailed(target.remote_url, root, store=target.store)
        if res.plan.step != max(s.step for s in self.remote):
            raise DemoError(
                f"restore: restored step {res.plan.step}, newest remote is {self.remote[-1].step}"
            )
        self.say(
            f"[7/8] restore: step {res.plan.step} ({res.bytes_downloaded / MiB:.1f} MiB, verified) in "
            f"{res.seconds:.2f} s; new sidecar; resuming"
        )
        side2 = self.sidecar("sidecar2", target.remote_url)
        job3 = self.trainer("phase3", root, self.loss_logs[2], sleep=0.0)
        self.finish(job3, "resume after restore")
        resumed_remote = self.resumed_from("phase3", job3)
        if resumed_remote != res.plan.step:
            raise DemoError(
                f"resume after restore: resumed from step {resumed_remote}, restored {res.plan.step}"
            )
        wait_for(
            lambda: has_uploaded_marker(root / step_dir_name(cfg.steps)),
            "final upload",
            cfg.stage_timeout_s,
            job=side2,
        )
        side2.kill(signal.SIGTERM)
        self.finish(side2, "sidecar shutdown (SIGTERM)")
        self.restored = res
        for s, b in _bytes_by_step(root).items():
            if s != res.plan.step:
                self.written[s] = b
        self.upload_lat += [v for s, v in _upload_latencies(root).items() if s != res.plan.step]
        self.remote = [s for s in list_remote_steps(target.remote_url, store=target.store) if s.ok]

    def _report(self) -> DemoReport:
        """Compare the story's curve (each step's loss from the phase that ran it last) with the
        baseline."""
        cfg, baseline = self.cfg, self.baseline
        resumed: dict[int, float] = {}
        phase_of: dict[int, int] = {}
        all_diffs = []
        for i, path in enumerate(self.loss_logs, 1):
            for s, v in read_losses(path).items():
                resumed[s], phase_of[s] = v, i
                if s in baseline:
                    all_diffs.append(abs(v - baseline[s]))
        if sorted(resumed) != list(range(1, cfg.steps + 1)):
            raise DemoError(
                f"compare: the interrupted story logged {len(resumed)} of {cfg.steps} steps"
            )
        diff = max(abs(resumed[s] - baseline[s]) for s in baseline)
        outcomes = [
            o
            for name in ("phase1", "phase2", "phase3")
            for o in read_job_events(self.events_log(name)).saves
            if o.ok
        ]
        saves = [o.seconds for o in outcomes]
        res = self.restored
        return DemoReport(
            steps=cfg.steps,
            model=cfg.model,
            remote_url=self.target.remote_url,
            endpoint=self.target.endpoint,
            baseline=baseline,
            resumed=resumed,
            phase_of_step=phase_of,
            crash_at=self.crash_at,
            resumed_from_local=self.resumed_local,
            loss_at=self.loss_at,
            restored_step=res.plan.step,
            bytes_written=sum(self.written.values()),
            bytes_uploaded=sum(s.size_bytes for s in self.remote),
            steps_saved=len(self.written),
            steps_uploaded=len(self.remote),
            save_s=saves,
            saves_unlogged=sorted(set(self.written) - {o.step for o in outcomes}),
            upload_latency_s=self.upload_lat,
            restore_s=res.seconds,
            restore_bytes=res.bytes_downloaded,
            max_abs_diff=diff,
            max_abs_diff_all_runs=max(all_diffs),
            stage_s=dict(self.stage_s),
        )


def run_demo(cfg: DemoConfig, say: Callable[[str], None] = print) -> DemoReport:
    """Run the story (see the module docstring). Raises :class:`DemoError` if a stage fails or the
    curves differ by more than ``cfg.tolerance``; every process it started is gone when it
    returns."""
    demo = _Demo(cfg, say)
    try:
        report = demo.run()
    except DemoError:
        raise
    except Exception as e:  # a library error mid-story: name it on one line
        raise DemoError(f"{type(e).__name__}: {' '.join(str(e).split())}") from e
    finally:
        demo.close()
    if (
        not report.max_abs_diff <= cfg.tolerance
        or not report.max_abs_diff_all_runs <= cfg.tolerance
    ):
        say(format_report(report))
        raise DemoError(
            f"compare: loss curves differ by {max(report.max_abs_diff, report.max_abs_diff_all_runs)!r}"
            f" > {cfg.tolerance}"
        )
    return report
