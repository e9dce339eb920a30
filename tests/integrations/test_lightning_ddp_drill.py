"""The Lightning drill: DDP (strategy="ddp", gloo, CPU, 2 rank processes started the way torchrun
starts them) checkpointing every 2 steps (an epoch: batch 8) through AsyncTieredCheckpointIO, the
sidecar (``tiered-ckpt upload --watch``) uploading to a moto server. SIGKILL of every rank, resume
from the local tier; SIGKILL again, cluster loss (the local root, the checkpoint folder and the
sidecar gone), restore from the bucket, resume. Both ranks' loss curves equal an uninterrupted
run's (run first in the same rank processes as the first attempt): max |diff| == 0.0."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import s3_infra
from lightning_run import read_losses
from spawn import child_env, free_port, python_cmd

from tiered_ckpt.integrations.lightning import TieredCheckpointIO
from tiered_ckpt.integrations.pointer import read_pointer
from tiered_ckpt.layout import UPLOADED_MARKER_NAME, step_dir_name

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.s3]

SCRIPT = Path(__file__).with_name("lightning_run.py")
WORLD = 2


def _ranks(runs: list[dict[str, Any]], log: Path) -> list[subprocess.Popen[bytes]]:
    """One process per rank, running the fits ``runs`` one after the other."""
    port = str(free_port())
    procs = []
    for rank in range(WORLD):
        e = child_env(
            helpers=True,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        with open(f"{log}.log{rank}", "ab") as out:
            procs.append(
                subprocess.Popen(
                    python_cmd(SCRIPT, json.dumps([{**a, "devices": WORLD} for a in runs])),
                    env=e,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def _finish(procs: list[subprocess.Popen[bytes]], log: Path, timeout: float = 120) -> None:
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, Path(f"{log}.log{r}").read_text()[-3000:]


def _wait(cond: Any, what: str, procs: list[subprocess.Popen[bytes]], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert all(p.poll() is None for p in procs), f"a process exited while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _sidecar(root: Path, loc: s3_infra.S3Location) -> subprocess.Popen[bytes]:
    cmd = python_cmd(
        "-m", "tiered_ckpt.cli", "upload", "--local", root, "--remote", loc.url,
        "--endpoint-url", loc.endpoint_url, "--path-style", "--watch", "--poll-interval-s", "0.1",
    )  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    with open(f"{root}.sidecar.log", "ab") as log:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)


def _uploaded(root: Path, step: int) -> bool:
    return (root / step_dir_name(step) / UPLOADED_MARKER_NAME).is_file()


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()
        assert p.returncode == -signal.SIGKILL


def test_ddp_kill_resume_cluster_loss_restore(tmp_path: Path, s3_bucket: s3_infra.S3Location):
    ref = tmp_path / "ref"
    root, ckdir, losses = tmp_path / "root", tmp_path / "ck", tmp_path / "losses"
    args = {"root": str(root), "ckdir": str(ckdir), "losses": str(losses), "max_steps": 8,
            "every": 2, "batch_size": 8, "async_save": True, "remote_url": s3_bucket.url,
            "endpoint_url": s3_bucket.endpoint_url}  # fmt: skip
    hung = Path(f"{losses}.hung")
    sidecar = _sidecar(root, s3_bucket)
    try:
        # 1. the uninterrupted run (no checkpoints), then in the same rank processes the first
        # attempt, killed at step 5: step 4 committed and uploaded; resume from the local tier
        uninterrupted = {"root": "-", "ckdir": "-", "losses": str(ref), "max_steps": 8,
                         "batch_size": 8, "seed": 0, "checkpointing": False}  # fmt: skip
        procs = _ranks([uninterrupted, {**args, "seed": 0, "hang_at": 5}], losses)
        _wait(lambda: hung.exists() and _uploaded(root, 4), "step 4 uploaded", procs)
        _kill(procs)
        hung.unlink()
        assert read_pointer(ckdir / "last.ckpt").step == 4
        assert sorted(read_losses(ref, 0)) == list(range(1, 9))
        # 2. resumed from last (model from other values), killed at step 7 after step 6 is up
        procs = _ranks([{**args, "seed": 1, "ckpt_path": "last", "hang_at": 7}], losses)
        _wait(lambda: hung.exists() and _uploaded(root, 6), "step 6 uploaded", procs)
        _kill(procs)
        # 3. cluster loss: the sidecar, the local root and the checkpoint folder are gone
        sidecar.kill()
        sidecar.wait()
        shutil.rmtree(root)
        shutil.rmtree(ckdir)
        io = TieredCheckpointIO(root, remote_url=s3_bucket.url, s3_client=s3_bucket.client)
        assert io.restore(ckdir) == 6  # one process per node, before the ranks start
        assert read_pointer(ckdir / "last.ckpt").step == 6
        assert (ckdir / "epoch=2-step=6.ckpt").is_file()
        sidecar = _sidecar(root, s3_bucket)
        report = tmp_path / "report.json"
        procs = _ranks([{**args, "seed": 2, "ckpt_path": "last", "report": str(report)}], losses)
        _finish(procs, losses)
        assert json.loads(report.read_text())["ckpt_path"] == str(ckdir / "last.ckpt")
    finally:
        sidecar.kill()
        sidecar.wait()
    for rank in range(WORLD):
        want, got = read_losses(ref, rank), read_losses(losses, rank)
        assert sorted(want) == sorted(got) == list(range(1, 9))
        assert max(abs(want[s] - got[s]) for s in want) == 0.0
