"""Resharding a real training state from the command line (slow: real processes).

- The ZeRO-1 example's own 4-rank checkpoint: ``tiered-ckpt reshard`` without rules fails naming the
  per-rank keys grouped (RNG streams only: the example claims what every rank holds alike as
  Replicated); with ``--preset training`` it reshards 4 -> 2, and the example resumes at world size
  2 (same global batch) with parameters byte-equal to the 4-rank checkpoint's, and trains on with
  finite losses.
- A value wrongly claimed replicated (a model that differs between ranks) is refused at save by real
  gloo ranks, nothing written; a right claim is stored once per node, and each node-local root loads
  it.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
from spawn import child_env, free_port, python_cmd, start_ranks, wait_ranks

import tiered_ckpt as tc
from tiered_ckpt.cli import main

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parent / "replicated_claim_worker.py"
STEPS, STOP, EVERY = 8, 4, 2


def train(world: int, root: Path, log: Path, *extra: str) -> str:
    cmd = python_cmd(
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world}",
        f"--master_port={free_port()}",
        "-m",
        "tiered_ckpt.examples.train_zero",
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(EVERY),
        "--root",
        root,
        "--seed",
        "3",
        "--sync-save",
        "--loss-log",
        log,
        "--data-bytes",
        "16384",
        *extra,
    )
    p = subprocess.run(
        cmd, env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def test_demo_checkpoint_reshards_with_the_training_preset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    train(4, a, tmp_path / "a.jsonl", "--stop-at", str(STOP), "--batch-per-rank", "2")
    assert (tc.read_manifest(a).step, tc.read_manifest(a).world_size) == (STOP, 4)

    argv = ["reshard", str(a), "--world-size", "2", "--out", str(b)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(
        f"cannot reshard step {STOP} from 4 ranks: per-rank state without a rule at rng/numpy/* (5 keys), "
        "rng/python/* (3 keys), rng/torch_cpu; pass --preset training or --rule KEY=RULE (RULE: take_rank0, "
        "same, by_rank, drop; a KEY ending in / rules every per-rank value under it, e.g. --rule rng/=by_rank)"
    )
    assert main(argv + ["--preset", "training"]) == 0
    assert f"step {STOP}: 4 -> 2 ranks committed under {b}" in capsys.readouterr().out

    old = tc.load_sharded(a, 4)
    params = np.concatenate(
        [s["zero"]["master"] for s in old]
    )  # the model's parameters, flat float32
    assert params.dtype == np.float32
    out = train(
        2, b, tmp_path / "b.jsonl", "--stop-at", str(STOP + 2), "--batch-per-rank", "4"
    )  # same global batch
    assert (
        f"resumed from step {STOP} (parameters sha256 {hashlib.sha256(params.tobytes()).hexdigest()})"
        in out
    )
    rows = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [STOP + 1, STOP + 2] and all(
        math.isfinite(r["loss"]) for r in rows
    )
    m = tc.read_manifest(b)
    assert (m.step, m.world_size) == (STOP + 2, 2)


def test_wrong_replicated_claim_refused_at_save_right_one_stored_per_node(tmp_path: Path) -> None:
    logs = wait_ranks(start_ranks(WORKER, tmp_path, world=2), timeout=120)
    res = []
    for r in range(2):
        path = tmp_path / f"result_{r}.json"
        assert path.exists(), logs[r][-3000:]
        res.append(json.loads(path.read_text()))
    for r, got in enumerate(res):
        refused = got["refused"]
        assert refused is not None, logs[r][-3000:]
        assert refused["key"] == "model/0.bias" and refused["groups"] == [[0], [1]]
        assert refused["keys"] == [
            "model/0.bias",
            "model/0.weight",
            "model/2.bias",
            "model/2.weight",
        ]
        assert refused["msg"].startswith(
            "step 1: 'model/0.bias' is saved as Replicated but differs between ranks "
            "(ranks holding equal values: [0] vs [1]) (and 3 more key(s): "
        )
        assert got["step1_dir"] is False  # nothing written
        # the right claim: committed in both node-local roots, each holding only its own rank's
        # shard, which (each node's first rank) holds the replicated values
        assert [f for f in got["files"] if f.startswith("rank_")] == [f"rank_{r:05d}.safetensors"]
        assert got["same_params"] is True and got["lr"] == 0.1 and got["progress"] == {"step": 2}
        assert got["latest"] == 2
    assert tc.committed_steps(tmp_path / "node1") == [2]
