"""Lightning's sharded training over 2 gloo CPU rank processes through the tiered strategies:
TieredModelParallelStrategy (ModelParallelStrategy, FSDP2 DTensor shards) and TieredFSDPStrategy
(FSDPStrategy, FSDP1 sharded state dicts), the model's and optimizer's shards as a DCP step of the
local tier, the rest of the checkpoint dict as typed JSON. SIGKILL mid-run, resume with
ckpt_path="last" from a model that starts elsewhere, the loss curve of both ranks equal to an
uninterrupted run's bit for bit, the model's plain (unsharded) buffer restored. The document codec
and its refusals: test_lightning_sharded_codec.py."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_run import Tiny, read_losses
from spawn import child_env, free_port, python_cmd

from tiered_ckpt import dcp
from tiered_ckpt.integrations.lightning_sharded import (
    DOC_KEY,
    INTEGRATION,
    decode_rest,
)
from tiered_ckpt.integrations.pointer import read_pointer
from tiered_ckpt.local.catalogue import committed_steps, read_manifest
from tiered_ckpt.local.pins import pinned_steps

SCRIPT = Path(__file__).with_name("lightning_sharded_run.py")
WORLD = 2


def _ranks(runs: list[dict[str, Any]], log: Path) -> list[subprocess.Popen[bytes]]:
    port = str(free_port())
    procs = []
    for rank in range(WORLD):
        env = child_env(
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
                    python_cmd(SCRIPT, json.dumps(runs)),
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def _log_tail(log: Path) -> str:
    return "\n".join(Path(f"{log}.log{r}").read_text()[-2000:] for r in range(WORLD))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["model_parallel", "fsdp1"])
def test_sharded_kill_resume_last_equals_uninterrupted(tmp_path: Path, strategy: str) -> None:
    ref, losses = tmp_path / "ref", tmp_path / "losses"
    root, ckdir = tmp_path / "root", tmp_path / "ck"
    # 2 steps an epoch (16 samples a rank, batch 8): saves at epoch ends (a resume in the middle
    # of an epoch restarts a plain DataLoader's epoch, see the README)
    args = {"strategy": strategy, "root": str(root), "ckdir": str(ckdir), "losses": str(losses),
            "max_steps": 8, "every": 2}  # fmt: skip
    hung = Path(f"{losses}.hung")
    # the uninterrupted run (no checkpoints), then in the same two processes a run saving every 2
    # steps, SIGKILLed at step 5 (steps 2 and 4 committed)
    procs = _ranks(
        [
            {"strategy": strategy, "losses": str(ref), "max_steps": 8, "seed": 0},
            {**args, "seed": 0, "hang_at": 5},
        ],
        losses,
    )
    try:
        deadline = time.monotonic() + 120
        while not hung.exists():
            assert all(p.poll() is None for p in procs), _log_tail(losses)
            assert time.monotonic() < deadline, _log_tail(losses)
            time.sleep(0.05)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
    assert all(p.returncode == -signal.SIGKILL for p in procs)
    assert sorted(p.name for p in ckdir.iterdir()) == [
        "epoch=0-step=2.ckpt",
        "epoch=1-step=4.ckpt",
        "last.ckpt",
    ]
    assert committed_steps(root) == [2, 4] and pinned_steps(root) == [2, 4]
    assert read_pointer(ckdir / "last.ckpt").step == 4
    manifest = read_manifest(root, 4)
    assert manifest.world_size == WORLD and len(manifest.shards) == WORLD
    assert manifest.extra is not None and manifest.extra["integration"] == INTEGRATION
    assert manifest.extra[INTEGRATION] == {"path": str(ckdir / "epoch=1-step=4.ckpt")}

    # the step read whole in this one process: the full weights, other than the resumed run's
    # start; the plain buffer (4 batches); the optimizer's state by name (betas: a tuple)
    whole: dict[str, Any] = {}
    assert dcp.load(whole, root, 4, whole_step=True) == 4
    saved, other = whole["state_dict"], Tiny(seed=1).state_dict()
    assert sorted(saved) == sorted([*other, "batches"])
    assert all(
        saved[k].shape == other[k].shape and not torch.equal(saved[k], other[k]) for k in other
    )
    assert saved["batches"].dtype == torch.int64 and int(saved["batches"]) == 4
    opt = whole["optimizer_0"]
    assert sorted(opt["state"]) == sorted(other)
    assert all(float(opt["state"][k]["step"]) == 4.0 for k in other)
    assert opt["param_groups"][0]["betas"] == (0.8, 0.99)
    rest = decode_rest(whole[DOC_KEY])
    assert rest["global_step"] == 4 and rest["epoch"] == 1
    assert "state_dict" not in rest and "optimizer_states" not in rest
    assert set(whole) == {"state_dict", "optimizer_0", DOC_KEY}

    # a second start of both ranks: resumed from last.ckpt with the model built from seed 1
    report = tmp_path / "report.json"
    procs = _ranks([{**args, "seed": 1, "ckpt_path": "last", "report": str(report)}], losses)
    for p in procs:
        p.wait(timeout=120)
    assert [p.returncode for p in procs] == [0, 0], _log_tail(losses)
    assert json.loads(report.read_text())["ckpt_path"] == str(ckdir / "last.ckpt")
    for rank in range(WORLD):
        want, got = read_losses(ref, rank), read_losses(losses, rank)
        assert sorted(want) == sorted(got) == list(range(1, 9))
        assert max(abs(want[s] - got[s]) for s in want) == 0.0
        # the buffer counted on from the checkpoint's 4 (a lost buffer would count from 0 again)
        counts = [json.loads(x) for x in Path(f"{losses}.batches{rank}").read_text().splitlines()]
        assert counts[-4:] == [[5, 5], [6, 6], [7, 7], [8, 8]]
    # steps 6 and 8 saved; 2 and 4 unpinned by the top-2 and deleted by rotation at teardown
    assert committed_steps(root) == [6, 8] and pinned_steps(root) == [6, 8]
    assert read_pointer(ckdir / "last.ckpt").step == 8
    verify = subprocess.run(
        python_cmd("-m", "tiered_ckpt.cli", "verify", root), env=child_env(), capture_output=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
