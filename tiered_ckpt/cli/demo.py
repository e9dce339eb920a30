"""``tiered-ckpt demo``: the whole story on one command, on real input, with no server to set up.

Stages (each a real process; the demo only launches, watches and measures):

1. **S3**: an embedded S3 server (moto's ``ThreadedMotoServer``, in this process, on 127.0.0.1), or the
   S3 / MinIO at ``--endpoint-url`` / ``AWS_ENDPOINT_URL``; a fresh prefix in the bucket.
2. **Baseline**: the 4-rank torch.distributed ZeRO-1 example (:mod:`tiered_ckpt.examples.train_zero`,
   gloo on CPU, a tiny GPT on the Python standard library's sources) runs uninterrupted, as its own job.
3. **Sidecar**: ``tiered-ckpt upload --watch`` starts as a separate process on the story's local tier.
4. **Crash**: the same job checkpoints every few steps; after two committed checkpoints the whole job
   (every rank, its process group) is SIGKILLed.
5. **Resume from local disk**: relaunched, it resumes from its newest committed step.
6. **Cluster loss**: once the sidecar has uploaded a step newer than that, the job and the sidecar are
   SIGKILLed and the local tier is deleted.
7. **Restore** from the bucket (:func:`tiered_ckpt.restore.restore_detailed`), a new sidecar, resume
   again, run to the end; the sidecar uploads the final step.
8. **Report**: steps, bytes written and uploaded, save / upload / restore times, the max abs loss
   difference against the baseline, both curves, and a PNG plot.

Fails (:class:`DemoError`, one line naming the stage) if any stage fails or the curves differ by more
than ``tolerance``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tiered_ckpt.layout import MANIFEST_NAME, UPLOADED_MARKER_NAME, step_dir_name
from tiered_ckpt.local.steps import committed_steps, read_manifest

log = logging.getLogger(__name__)

MiB = 1024 * 1024
_DUMMY_AWS = {"AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo", "AWS_DEFAULT_REGION": "us-east-1",
              "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
_SAVE_RE = re.compile(r" r0 tiered_ckpt\.manager INFO rank 0 step (\d+): checkpoint committed in ([\d.]+) s")
_RESUMED_RE = re.compile(r"^resumed from step (\d+)", re.M)
#: Starts ``n`` ranks of ``argv`` with torch.distributed's env:// variables and waits for them. Unlike
#: torchrun (whose workers get sessions of their own), the ranks stay in the launcher's process group, so
#: one ``killpg`` reaches the whole job, as a node failure would.
_LAUNCHER = (
    "import os, subprocess, sys\n"
    "n, port, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]\n"
    "ps = [subprocess.Popen([sys.executable, *argv], env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r),"
    " WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), MASTER_ADDR='127.0.0.1', MASTER_PORT=port))"
    " for r in range(n)]\n"
    "rcs = [p.wait() for p in ps]\n"
    "sys.exit(next((abs(c) for c in rcs if c), 0))\n")


class DemoError(Exception):
    """A stage of the demo failed; the message is one line naming it."""


@dataclass(frozen=True)
class DemoConfig:
    """``workdir``: where everything goes (kept). ``steps``/``ckpt_every``/``seed``: the training run.
    ``endpoint_url``: an external S3/MinIO (default: ``AWS_ENDPOINT_URL``, else an embedded server).
    ``sleep_per_step_s``: slows the interrupted job so that kills land between checkpoints.
    ``tolerance``: the largest acceptable abs loss difference."""

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

    def __post_init__(self) -> None:
        if self.steps < 4 * self.ckpt_every:
            raise ValueError(f"steps ({self.steps}) must be >= 4 x ckpt_every ({self.ckpt_every}) for the story")
        if self.ckpt_every < 1:
            raise ValueError("ckpt_every must be >= 1")


@dataclass
class DemoReport:
    steps: int
    remote_url: str
    endpoint: str
    baseline: dict[int, float]
    resumed: dict[int, float]  # the story's curve: each step's value from the phase that last ran it
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
    upload_latency_s: list[float] = field(default_factory=list)
    restore_s: float = 0.0
    restore_bytes: int = 0
    max_abs_diff: float = float("nan")
    max_abs_diff_all_runs: float = float("nan")
    plot_path: Path | None = None
    wall_s: float = 0.0
    stage_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("baseline", "resumed", "phase_of_step")}
        d["plot_path"] = str(self.plot_path) if self.plot_path else None
        d["curves"] = [{"step": s, "baseline": self.baseline.get(s), "resumed": self.resumed.get(s),
                        "phase": self.phase_of_step.get(s)} for s in sorted(self.baseline)]
        return d


# ------------------------------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _trainer_argv() -> list[str]:
    """How to run the example: the packaged module (present after ``pip install``)."""
    return ["-m", "tiered_ckpt.examples.train_zero"]


class _Job:
    """A process group of our own (so that one SIGKILL reaches every rank), output to a log file."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.log_path = log_path
        self._out = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            raise
        finally:
            self._out.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
            self.proc.wait()
        self.kill()  # no rank outlives its launcher
        self._out.close()

    def tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def _read_losses(path: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            out[int(rec["step"])] = float(rec["loss"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by SIGKILL
    return out


def _wait_for(cond: Callable[[], bool], what: str, timeout_s: float, *, job: _Job | None = None,
              poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if job is not None and job.poll() is not None and not cond():
            raise DemoError(f"{what}: the job exited (code {job.poll()}) first; see {job.log_path}")
        if time.monotonic() > deadline:
            raise DemoError(f"{what}: not reached within {timeout_s:.0f} s")
        time.sleep(poll_s)


# ------------------------------------------------------------------------------------------ the story


class _Demo:
    def __init__(self, cfg: DemoConfig, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.say = say
        self.work = cfg.workdir.absolute()
        self.logs = self.work / "logs"
        self.server: Any = None
        self.jobs: list[_Job] = []
        self.env = dict(os.environ, OMP_NUM_THREADS="1", TRAIN_ZERO_LOG="INFO", PYTHONUNBUFFERED="1")

    # -------------------------------------------------------------------- S3

    def start_s3(self) -> tuple[str, str, Any]:
        from tiered_ckpt.store import make_s3_client

        endpoint = self.cfg.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        if endpoint is None:
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log is not the story
            self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self.server.start()
            host, port = self.server.get_host_and_port()
            endpoint = f"http://{host}:{port}"
            for k, v in _DUMMY_AWS.items():  # moto accepts any credentials; never reach real AWS config
                self.env[k] = v
                os.environ[k] = v
            for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3"):
                self.env.pop(k, None)
                os.environ.pop(k, None)
            where = f"embedded moto S3 server at {endpoint}"
        else:
            where = f"S3 endpoint {endpoint}"
        self.env["AWS_ENDPOINT_URL"] = endpoint
        client = make_s3_client(endpoint_url=endpoint, path_style=True)
        try:
            client.head_bucket(Bucket=self.cfg.bucket)
        except Exception:  # noqa: BLE001 - absent (404) or not ours: try to create it, fail loudly below
            try:
                client.create_bucket(Bucket=self.cfg.bucket)
            except Exception as e:  # noqa: BLE001
                raise DemoError(f"s3: cannot use bucket {self.cfg.bucket!r} at {endpoint}: {e}") from e
        prefix = f"demo/{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        return f"s3://{self.cfg.bucket}/{prefix}", where, client

    def stop_s3(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    # -------------------------------------------------------------------- jobs

    def trainer(self, name: str, root: Path, loss_log: Path, *, sleep: float) -> _Job:
        argv = [sys.executable, "-c", _LAUNCHER, "4", str(_free_port()), *_trainer_argv(),
                "--steps", str(self.cfg.steps), "--ckpt-every", str(self.cfg.ckpt_every), "--root", str(root),
                "--seed", str(self.cfg.seed), "--loss-log", str(loss_log), "--keep-last", "1000",
                "--sleep-per-step", str(sleep)]
        job = _Job(argv, self.logs / f"{name}.log", self.env)
        self.jobs.append(job)
        return job

    def sidecar(self, name: str, root: Path, remote_url: str) -> _Job:
        argv = [sys.executable, "-c", "import sys; from tiered_ckpt.cli import main; sys.exit(main())",
                "--log-level", "INFO", "upload", "--watch", "--local", str(root), "--remote", remote_url,
                "--endpoint-url", self.env["AWS_ENDPOINT_URL"], "--path-style", "--poll-interval-s", "0.2"]
        job = _Job(argv, self.logs / f"{name}.log", self.env)
        self.jobs.append(job)
        return job

    def finish(self, job: _Job, what: str) -> None:
        try:
            rc = job.wait(self.cfg.stage_timeout_s)
        except subprocess.TimeoutExpired:
            raise DemoError(f"{what}: timed out after {self.cfg.stage_timeout_s:.0f} s; see {job.log_path}") from None
        if rc != 0:
            last = job.tail(1).strip()
            raise DemoError(f"{what}: exited with code {rc} ({last[:160]}); see {job.log_path}")

    def close(self) -> None:
        for job in self.jobs:
            job.close()
        self.stop_s3()

    # -------------------------------------------------------------------- run

    def run(self) -> DemoReport:
        from tiered_ckpt.remote.restore import list_remote_steps, restore_detailed

        cfg = self.cfg
        t_start = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        stage_s: dict[str, float] = {}

        def stage(name: str, t0: float) -> None:
            stage_s[name] = round(time.monotonic() - t0, 2)

        t0 = time.monotonic()
        remote_url, where, client = self.start_s3()
        self.say(f"[1/8] S3: {where}; uploading to {remote_url}")
        stage("s3", t0)

        base_root, base_log = self.work / "baseline" / "ckpt", self.work / "baseline" / "loss.jsonl"
        story_root, story_dir = self.work / "story" / "ckpt", self.work / "story"
        for p in (base_root.parent, story_dir):
            if p.exists():
                shutil.rmtree(p)
            p.mkdir(parents=True)
        t0 = time.monotonic()
        self.say(f"[2/8] baseline: 4-rank ZeRO-1 run, {cfg.steps} steps, uninterrupted (its own job)")
        self.finish(self.trainer("baseline", base_root, base_log, sleep=0.0), "baseline run")
        baseline = _read_losses(base_log)
        if sorted(baseline) != list(range(1, cfg.steps + 1)):
            raise DemoError(f"baseline run: logged {len(baseline)} of {cfg.steps} steps; see {self.logs}")
        stage("baseline", t0)

        t0 = time.monotonic()
        side1 = self.sidecar("sidecar1", story_root, remote_url)
        self.say("[3/8] sidecar: `tiered-ckpt upload --watch` started as its own process")
        logs = [story_dir / f"loss_phase{i}.jsonl" for i in (1, 2, 3)]
        job1 = self.trainer("phase1", story_root, logs[0], sleep=cfg.sleep_per_step_s)
        _wait_for(lambda: len(committed_steps(story_root)) >= 2, "crash: two checkpoints", cfg.stage_timeout_s,
                  job=job1)
        job1.kill()
        job1.wait(60)
        crash_at = max(_read_losses(logs[0]), default=0)
        newest = committed_steps(story_root)[-1]
        self.say(f"[4/8] crash: SIGKILL of the whole job (all ranks) at step {crash_at}; committed locally: "
                 f"{committed_steps(story_root)}")
        stage("crash", t0)

        t0 = time.monotonic()
        job2 = self.trainer("phase2", story_root, logs[1], sleep=cfg.sleep_per_step_s)

        def uploaded_after(step: int) -> bool:
            return any((story_root / step_dir_name(s) / UPLOADED_MARKER_NAME).is_file()
                       for s in committed_steps(story_root) if s > step)

        _wait_for(lambda: uploaded_after(newest), "resume from local disk: an upload of a newer step",
                  cfg.stage_timeout_s, job=job2)
        job2.kill()
        side1.kill()
        job2.wait(60)
        side1.wait(60)
        resumed_local = self._resumed_from(job2, "phase2")
        if resumed_local != newest:
            raise DemoError(f"resume from local disk: resumed from step {resumed_local}, expected {newest}")
        loss_at = max(_read_losses(logs[1]), default=0)
        self.say(f"[5/8] resume from local disk: from step {resumed_local}, trained to step {loss_at}")
        stage("resume_local", t0)

        t0 = time.monotonic()
        written = self._bytes_by_step(story_root)
        upload_lat = self._upload_latencies(story_root)
        shutil.rmtree(story_root)
        remote = [s for s in list_remote_steps(remote_url, s3_client=client) if s.ok]
        self.say(f"[6/8] cluster loss: job and sidecar SIGKILLed at step {loss_at}, local tier deleted; "
                 f"remotely committed: {[s.step for s in remote]}")
        stage("cluster_loss", t0)

        t0 = time.monotonic()
        res = restore_detailed(remote_url, story_root, s3_client=client)
        if res.plan.step != max(s.step for s in remote):
            raise DemoError(f"restore: restored step {res.plan.step}, newest remote is {remote[-1].step}")
        self.say(f"[7/8] restore: step {res.plan.step} ({res.bytes_downloaded / MiB:.1f} MiB, verified) in "
                 f"{res.seconds:.2f} s; new sidecar; resuming")
        side2 = self.sidecar("sidecar2", story_root, remote_url)
        job3 = self.trainer("phase3", story_root, logs[2], sleep=0.0)
        self.finish(job3, "resume after restore")
        resumed_remote = self._resumed_from(job3, "phase3")
        if resumed_remote != res.plan.step:
            raise DemoError(f"resume after restore: resumed from step {resumed_remote}, restored {res.plan.step}")
        _wait_for(lambda: (story_root / step_dir_name(cfg.steps) / UPLOADED_MARKER_NAME).is_file(),
                  "final upload", cfg.stage_timeout_s, job=side2)
        side2.kill(signal.SIGTERM)
        self.finish(side2, "sidecar shutdown (SIGTERM)")
        stage("restore_and_finish", t0)

        for s, b in self._bytes_by_step(story_root).items():
            if s != res.plan.step:
                written[s] = b
        upload_lat += [v for s, v in self._upload_latencies(story_root, exclude={res.plan.step}).items()]
        remote = [s for s in list_remote_steps(remote_url, s3_client=client) if s.ok]

        # The story's curve: each step's loss from the phase that ran it last.
        resumed: dict[int, float] = {}
        phase_of: dict[int, int] = {}
        all_diffs = []
        for i, path in enumerate(logs, 1):
            for s, v in _read_losses(path).items():
                resumed[s], phase_of[s] = v, i
                if s in baseline:
                    all_diffs.append(abs(v - baseline[s]))
        if sorted(resumed) != list(range(1, cfg.steps + 1)):
            raise DemoError(f"compare: the interrupted story logged {len(resumed)} of {cfg.steps} steps")
        diff = max(abs(resumed[s] - baseline[s]) for s in baseline)
        saves = []
        for name in ("phase1", "phase2", "phase3"):
            saves += [float(m.group(2)) for m in _SAVE_RE.finditer((self.logs / f"{name}.log").read_text())]
        report = DemoReport(
            steps=cfg.steps, remote_url=remote_url, endpoint=self.env["AWS_ENDPOINT_URL"], baseline=baseline,
            resumed=resumed, phase_of_step=phase_of, crash_at=crash_at, resumed_from_local=resumed_local,
            loss_at=loss_at, restored_step=res.plan.step, bytes_written=sum(written.values()),
            bytes_uploaded=sum(s.size_bytes for s in remote), steps_saved=len(written),
            steps_uploaded=len(remote), save_s=saves, upload_latency_s=upload_lat, restore_s=res.seconds,
            restore_bytes=res.bytes_downloaded, max_abs_diff=diff, max_abs_diff_all_runs=max(all_diffs),
            stage_s=stage_s)
        if cfg.plot:
            report.plot_path = plot_curves(report, self.work / "loss_curves.png")
        report.wall_s = time.monotonic() - t_start
        self.say("[8/8] report")
        return report

    def _resumed_from(self, job: _Job, what: str) -> int:
        m = _RESUMED_RE.search(job.log_path.read_text(errors="replace"))
        if m is None:
            raise DemoError(f"{what}: the job did not resume from a checkpoint; see {job.log_path}")
        return int(m.group(1))

    @staticmethod
    def _bytes_by_step(root: Path) -> dict[int, int]:
        return {s: read_manifest(root, s).total_bytes for s in committed_steps(root)}

    @staticmethod
    def _upload_latencies(root: Path, exclude: set[int] = frozenset()) -> Any:
        """Seconds from the local commit (manifest.json) to the sidecar's marker after the remote commit."""
        out = {}
        for s in committed_steps(root):
            sdir = root / step_dir_name(s)
            try:
                out[s] = (sdir / UPLOADED_MARKER_NAME).stat().st_mtime - (sdir / MANIFEST_NAME).stat().st_mtime
            except OSError:
                continue
        if exclude:
            return {s: v for s, v in out.items() if s not in exclude}
        return list(out.values())


def plot_curves(report: DemoReport, path: Path) -> Path:
    """Both loss curves (PNG, matplotlib's Agg backend), with the crash, resume and restore marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(report.baseline)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(steps, [report.baseline[s] for s in steps], color="black", lw=2.5, alpha=0.35,
            label="uninterrupted baseline")
    colors = {1: "tab:blue", 2: "tab:orange", 3: "tab:green"}
    names = {1: "run 1 (SIGKILLed)", 2: "run 2 (resumed from local disk)", 3: "run 3 (restored from bucket)"}
    for ph in (1, 2, 3):
        xs = [s for s in steps if report.phase_of_step.get(s) == ph]
        ax.plot(xs, [report.resumed[s] for s in xs], "o", ms=3.5, color=colors[ph], label=names[ph])
    for x, text in ((report.crash_at, "SIGKILL"), (report.loss_at, "cluster loss")):
        ax.axvline(x + 0.5, color="red", ls="--", lw=1)
        ax.text(x + 0.7, ax.get_ylim()[1], text, color="red", va="top", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"tiered-ckpt demo: max |loss difference| = {report.max_abs_diff:.3g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def format_report(r: DemoReport) -> str:
    def stats(xs: list[float]) -> str:
        return f"mean {sum(xs) / len(xs):.3f} s, max {max(xs):.3f} s (n={len(xs)})" if xs else "n/a"

    lines = [
        "",
        "tiered-ckpt demo report",
        f"  steps                  {r.steps} (4 ranks, ZeRO-1, gloo); crash at step {r.crash_at}, resumed from "
        f"local step {r.resumed_from_local}; cluster loss at step {r.loss_at}, restored step {r.restored_step}",
        f"  bucket                 {r.remote_url} ({r.endpoint})",
        f"  bytes written locally  {r.bytes_written / MiB:.1f} MiB in {r.steps_saved} checkpoints",
        f"  bytes uploaded         {r.bytes_uploaded / MiB:.1f} MiB in {r.steps_uploaded} remotely committed steps",
        f"  save time (background write+hash+commit)  {stats(r.save_s)}",
        f"  upload time (local commit -> remote commit)  {stats(r.upload_latency_s)}",
        f"  restore time           {r.restore_s:.2f} s for {r.restore_bytes / MiB:.1f} MiB (download + sha256 "
        f"verify + local commit)",
        f"  max |loss diff|        {r.max_abs_diff!r} vs the uninterrupted baseline "
        f"(every logged value, incl. steps re-run after a crash: {r.max_abs_diff_all_runs!r})",
        f"  plot                   {r.plot_path}" if r.plot_path else "  plot                   (not written)",
        f"  wall time              {r.wall_s:.1f} s ({', '.join(f'{k} {v:.1f}s' for k, v in r.stage_s.items())})",
        "",
        "  step  baseline     story        |diff|    run",
    ]
    for s in sorted(r.baseline):
        b, v = r.baseline[s], r.resumed[s]
        lines.append(f"  {s:4d}  {b:.8f}  {v:.8f}  {abs(v - b):.1e}   {r.phase_of_step[s]}")
    return "\n".join(lines)


def run_demo(cfg: DemoConfig, say: Callable[[str], None] = print) -> DemoReport:
    """Run the story (see the module docstring). Raises :class:`DemoError` if a stage fails or the
    curves differ by more than ``cfg.tolerance``; every process it started is gone when it returns."""
    demo = _Demo(cfg, say)
    try:
        report = demo.run()
    except DemoError:
        raise
    except Exception as e:  # a library error mid-story: name it on one line
        raise DemoError(f"{type(e).__name__}: {' '.join(str(e).split())}") from e
    finally:
        demo.close()
    if not report.max_abs_diff <= cfg.tolerance or not report.max_abs_diff_all_runs <= cfg.tolerance:
        say(format_report(report))
        raise DemoError(f"compare: loss curves differ by {max(report.max_abs_diff, report.max_abs_diff_all_runs)!r}"
                        f" > {cfg.tolerance}")
    return report


__all__ = ["DemoConfig", "DemoReport", "DemoError", "run_demo", "format_report", "plot_curves"]
