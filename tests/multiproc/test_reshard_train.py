"""The 4-rank ZeRO-1 training example resumed at world size 2 from a resharded 4-rank checkpoint
(slow: two torchrun launches).

What is byte-equal after ``reshard`` 4 -> 2: the global fp32 master, exp_avg and exp_avg_sq vectors
(reassembled from the new partitions), the Adam step, the step counter, the loss history and the
data position (taken from rank 0 by explicit rules). What cannot be: the per-rank RNG streams (4
dropout streams cannot become 2 equivalent ones; the rule here lets new rank j continue old rank j's
stream), so the continued loss curve is a valid continuation but not the 4-rank run's, bit for bit.
The global batch is kept (``--batch-per-rank`` doubled) so that the data order continues exactly.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from spawn import child_env, free_port, python_cmd

import tiered_ckpt as tc
from tiered_ckpt.errors import ReshardError
from tiered_ckpt.local.reshard import even_split, reshard

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_zero.py"
STEPS, STOP, EVERY = 10, 6, 3


def run(world: int, root: Path, log: Path, *extra: str) -> str:
    cmd = python_cmd(
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world}",
        f"--master_port={free_port()}",
        EXAMPLE,
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(EVERY),
        "--root",
        root,
        "--seed",
        "7",
        "--sync-save",
        "--loss-log",
        log,
        "--data-bytes",
        "32768",
        *extra,
    )
    env = child_env(OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def global_vec(states: list[dict], key: str) -> np.ndarray:
    return np.concatenate([s["zero"][key] for s in states])


@pytest.mark.skipif(not EXAMPLE.exists(), reason="examples/train_zero.py not present")
def test_train_4_ranks_reshard_resume_at_2(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    run(4, a, tmp_path / "a.jsonl", "--stop-at", str(STOP), "--batch-per-rank", "4")
    m4 = tc.read_manifest(a)
    assert (m4.step, m4.world_size) == (STOP, 4)

    # per-rank state needs rules; without them the error names the keys
    with pytest.raises(ReshardError, match="rng/torch_cpu"):
        reshard(a, STOP, 2, b)
    rules = {
        "zero/adam_step": "take_rank0",
        "progress": "take_rank0",
        "rng": lambda old, m: old[:m],
    }  # new rank j continues old rank j's streams (documented choice)
    res = reshard(a, STOP, 2, b, rules=rules)
    m2 = res.manifest
    assert m2.world_size == 2 and res.bytes_read < res.source_bytes * 1.5
    old, new = tc.load_sharded(a, 4), tc.load_sharded(b, 2)
    n = m4.shards[-1].param_shard_offset + m4.shards[-1].param_shard_numel
    assert [(s.param_shard_offset, s.param_shard_numel) for s in m2.shards] == even_split(n, 2)
    for key in ("master", "exp_avg", "exp_avg_sq"):  # byte-equal global optimizer state
        assert global_vec(new, key).tobytes() == global_vec(old, key).tobytes()
    for s in new:
        assert s["zero"]["adam_step"] == STOP and s["progress"] == old[0]["progress"]
    assert new[1]["rng"]["torch_cpu"].tobytes() == old[1]["rng"]["torch_cpu"].tobytes()

    # the example itself resumes at world size 2 (same global batch) and keeps training
    out = run(2, b, tmp_path / "b.jsonl", "--batch-per-rank", "8")
    assert f"resumed from step {STOP}" in out
    rows = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STOP + 1, STEPS + 1))
    assert all(np.isfinite(r["loss"]) for r in rows)
    first = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < first[0]["loss"]  # still learning after the resume
    final = tc.read_manifest(b)
    assert final.step == STEPS and final.world_size == 2
