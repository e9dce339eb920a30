"""``tiered-ckpt status --json --watch``, polled during a real run: a writer
process saving 64 MiB steps with the CheckpointManager, the real sidecar (``tiered-ckpt upload
--watch``) against moto. A step goes from local-only to uploading to committed; the time at risk
drops, when a step is committed remotely, to at most its upload latency plus the poll interval; it
is the sidecar's gauge; Ctrl-C ends the watch with exit 0."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import s3_infra
from spawn import free_port, python_cmd

MIB_PER_STEP = 64
PAUSE_S = (
    3.0  # between the writer's saves: longer than one upload, so the sidecar takes them in order
)
WATCH_S = 0.1  # status --watch interval
STEPS = (1, 2, 3)

WRITER = f"""
import sys, time
import numpy as np
from tiered_ckpt.training import CheckpointManager
w = np.random.default_rng(0).integers(0, 2**31, size={MIB_PER_STEP} * 2**20 // 4, dtype=np.int32)
mgr = CheckpointManager(sys.argv[1], async_save=False, keep_last=10)
for i, step in enumerate({STEPS!r}):
    if i:
        time.sleep({PAUSE_S})
    w[0] = step
    mgr.save(step, {{"w": w, "step": step}})
mgr.close()
"""


class _Lines:
    """The JSON lines of a ``status --json --watch`` process, read by a thread as they come."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.docs: list[dict] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._cv:
                self.docs.append(json.loads(line))
                self._cv.notify_all()

    def wait_for(self, pred, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            seen = 0
            while True:
                for d in self.docs[seen:]:
                    if pred(d):
                        return d
                seen = len(self.docs)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"not seen within {timeout_s} s; last: {self.docs[-1:]}")
                self._cv.wait(left)


def _row(doc: dict, step: int) -> tuple[str | None, str | None]:
    for s in doc["runs"][0]["steps"]:
        if s["step"] == step:
            return s["local"], s["remote"]
    return None, None


def _gauges(port: int) -> dict[str, float]:
    """The sidecar's gauges of the newest remote step and of the time at risk."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    names = (
        "tiered_ckpt_upload_newest_remote_step",
        "tiered_ckpt_upload_seconds_since_newest_remote",
    )
    return {
        ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.split(" ")[0] in names
    }


def _stop(proc: subprocess.Popen[bytes], sig: int) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_status_follows_a_run_with_its_sidecar(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, default_sigint: None
) -> None:
    root = tmp_path / "run"
    s3 = ["--remote", s3_bucket.url, "--endpoint-url", s3_bucket.endpoint_url, "--path-style"]
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    with (
        open(tmp_path / "writer.log", "wb") as wlog,
        open(tmp_path / "sidecar.log", "wb") as slog,
        open(tmp_path / "status.log", "wb") as stlog,
    ):
        try:
            root.mkdir()  # the job's directory, before its first save: the watch starts on it (--allow-empty)
            watch = subprocess.Popen(
                python_cmd(
                    "-m",
                    "tiered_ckpt.cli",
                    "status",
                    root,
                    *s3,
                    "--json",
                    "--watch",
                    str(WATCH_S),
                    "--allow-empty",
                ),
                stdout=subprocess.PIPE,
                stderr=stlog,
            )
            procs.append(watch)
            lines = _Lines(watch)
            lines.wait_for(lambda d: True, 20)
            writer = subprocess.Popen(python_cmd("-c", WRITER, root), stdout=wlog, stderr=wlog)
            procs.append(writer)
            lines.wait_for(
                lambda d: _row(d, 1) == ("committed", "absent"), 30
            )  # local only: no sidecar yet
            sidecar = subprocess.Popen(
                python_cmd(
                    "-m",
                    "tiered_ckpt.cli",
                    "upload",
                    "--local",
                    root,
                    *s3,
                    "--watch",
                    "--poll-interval-s",
                    "0.2",
                    "--part-size-mib",
                    "5",
                    "--multipart-threshold-mib",
                    "6",
                    "--max-concurrency",
                    "4",
                    "--metrics-port",
                    str(port),
                ),
                stdout=subprocess.DEVNULL,
                stderr=slog,
            )
            procs.append(sidecar)
            lines.wait_for(lambda d: _row(d, 1) == ("committed", "uploading"), 30)
            lines.wait_for(lambda d: _row(d, 1) == ("committed", "committed"), 30)
            lines.wait_for(lambda d: d["runs"][0]["newest_remote_step"] == STEPS[-1], 60)
            deadline = (
                time.monotonic() + 10
            )  # the sidecar sets its gauges just after its remote commit
            while (g := _gauges(port))["tiered_ckpt_upload_newest_remote_step"] != STEPS[-1]:
                assert time.monotonic() < deadline, g
                time.sleep(0.05)
            last, t_scrape = lines.docs[-1], time.time()
            gauge = _gauges(port)["tiered_ckpt_upload_seconds_since_newest_remote"]
            assert writer.wait(timeout=30) == 0
            assert _stop(watch, signal.SIGINT) == 0  # Ctrl-C ends the watch cleanly
        finally:
            for p in procs:
                _stop(p, signal.SIGTERM)
    assert sidecar.returncode == 0, (tmp_path / "sidecar.log").read_text()[-2000:]
    assert "Traceback" not in (tmp_path / "status.log").read_text()

    docs = lines.docs
    run = last["runs"][0]
    # the sidecar's gauge is status's at_risk_s, read a moment later
    assert abs(gauge - (run["at_risk_s"] + (t_scrape - last["time"]))) < 0.5
    newest = [
        step for step in STEPS if any(d["runs"][0]["newest_remote_step"] == step for d in docs)
    ]
    assert (
        newest and newest[-1] == STEPS[-1]
    )  # (a step saved before the sidecar started may go second)
    for step in newest:
        i = next(i for i, d in enumerate(docs) if d["runs"][0]["newest_remote_step"] == step)
        j = next(j for j, d in enumerate(docs) if _row(d, step)[0] == "committed")
        assert 0 < j < i
        risk = docs[i]["runs"][0]["at_risk_s"]
        # The local commit happened between readings j-1 and j, the remote one between i-1 and i: at
        # risk is at most the upload latency plus one poll (0.2 s: the manifest's created_at
        # precedes its rename).
        assert risk <= docs[i]["time"] - docs[j - 1]["time"] + 0.2, (step, risk)
        assert risk >= docs[i]["time"] - docs[j + 1]["time"], (
            step,
            risk,
        )  # and it is that step's figure
        before = docs[i - 1]["runs"][0]["at_risk_s"]
        if before is not None:  # dropped: the previous newest step's figure had grown past it
            assert risk < before, (step, risk, before)
