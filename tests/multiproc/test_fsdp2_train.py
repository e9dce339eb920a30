"""The FSDP2 example (:mod:`tiered_ckpt.examples.train_fsdp2`) on real gloo ranks, checkpointing
through DCP into the local tier with ``tiered_ckpt.dcp`` (slow: one process per rank).

1. SIGKILL drill: 4 ranks (torchrun) killed, the whole process tree at once, at a random step after
   at least two committed async saves; restarted (the tests' own launcher: one process per rank):
   the loss of every step after the resume point equals the uninterrupted run's exactly (max |diff|
   == 0.0); then ``--resume-step`` rolls back to the oldest committed step: the same curve again,
   saved as a new attempt.
2. Resharding: the uninterrupted run's final 4-rank checkpoint loaded at 2 and at 3 ranks (same
   global batch): every global tensor (parameters, exp_avg, exp_avg_sq, reassembled with
   ``full_tensor()``) byte-equal to the 4-rank run's own at that step; training continues and
   commits at the new world size.

Bytes read per rank while resharding (4 -> 3, within 5% of what each rank needs) are checked in
tests/dcp/test_dcp_reshard_bytes.py, on a model with 4 MiB tensors and no training: this example's
tensors would need a model too wide to train here quickly.

Set ``DRILL_SEED`` to replay a kill step; run with ``-s`` to see the figures.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from spawn import child_env, free_port, python_cmd, start_ranks, wait_ranks  # noqa: E402
from test_resume_drill import alive, finish, kill_tree, losses  # noqa: E402

import tiered_ckpt.examples  # noqa: E402
from tiered_ckpt.local.catalogue import committed_steps, read_manifest  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = Path(tiered_ckpt.examples.__file__).parent / "train_fsdp2.py"
STEPS, EVERY, GLOBAL_BATCH = 16, 3, 12  # 12 splits over 4, 3 and 2 ranks
COMMON = ("--ckpt-every", str(EVERY), "--seed", "5")


def args(world: int, root: Path, log: Path, steps: int = STEPS) -> list[str]:
    return [
        "--steps",
        str(steps),
        "--root",
        str(root),
        "--loss-log",
        str(log),
        "--batch-per-rank",
        str(GLOBAL_BATCH // world),
        *COMMON,
    ]


def torchrun(root: Path, log: Path, *extra: str) -> subprocess.Popen:
    """4 ranks under torchrun (``-m tiered_ckpt.examples.train_fsdp2``), in a session of their
    own."""
    cmd = python_cmd(
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        f"--master_port={free_port()}",
        "-m",
        "tiered_ckpt.examples.train_fsdp2",
        *args(4, root, log),
        *extra,
    )
    out = open(log.with_suffix(".out"), "wb")
    return subprocess.Popen(
        cmd,
        env=child_env(OMP_NUM_THREADS="1"),
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def run_ranks(world: int, root: Path, log: Path, *extra: str, steps: int = STEPS) -> str:
    """``world`` rank processes of the example's script (the tests' launcher); rank 0's output."""
    logs = wait_ranks(
        start_ranks(SCRIPT, *args(world, root, log, steps), *extra, world=world), timeout=240
    )
    return logs[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict[int, float], Path, Path]:
    """The uninterrupted 4-rank run: ``(losses, root, global tensors at STEPS)``."""
    d = tmp_path_factory.mktemp("fsdp2_reference")
    p = torchrun(d / "ckpt", d / "loss.jsonl", "--dump-final", str(d / "final.safetensors"))
    finish(p)
    ref = losses(d / "loss.jsonl")
    assert sorted(ref) == list(range(1, STEPS + 1)), (d / "loss.out").read_text()[-3000:]
    assert ref[STEPS] < ref[1] - 0.5  # it learns
    assert committed_steps(d / "ckpt")[-1] == STEPS and read_manifest(d / "ckpt").world_size == 4
    return ref, d / "ckpt", d / "final.safetensors"


def test_sigkill_at_random_step_then_resume_and_roll_back_match_uninterrupted(reference, tmp_path):
    ref, _, _ = reference
    seed = int(os.environ.get("DRILL_SEED", time.time_ns() % 100000))
    kill_at = random.Random(seed).randint(2 * EVERY + 2, STEPS - 3)
    root, log1, log2 = tmp_path / "ckpt", tmp_path / "killed.jsonl", tmp_path / "resumed.jsonl"
    p = torchrun(root, log1, "--sleep-per-step", "0.15")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and p.poll() is None:
        if max(losses(log1), default=0) >= kill_at and len(committed_steps(root)) >= 2:
            break
        time.sleep(0.01)
    assert p.poll() is None, (
        "the run ended before it could be killed: " + log1.with_suffix(".out").read_text()[-3000:]
    )
    pids = kill_tree(p.pid)  # torchrun and its four ranks at once
    p.wait()
    assert len(pids) >= 5, pids
    for _ in range(100):
        if not alive(pids):
            break
        time.sleep(0.05)
    assert not alive(pids)
    killed, committed = losses(log1), committed_steps(root)
    resume_from = committed[-1]
    print(
        f"\n[fsdp2 drill seed {seed}] killed after step {max(killed)} (target {kill_at}); committed {committed}"
    )
    assert len(committed) >= 2 and resume_from >= 2 * EVERY
    assert all(killed[s] == ref[s] for s in killed)  # same seed, same code: the same curve

    out = run_ranks(4, root, log2)
    assert f"resumed from step {resume_from}" in out, out[-3000:]
    resumed = losses(log2)
    assert sorted(resumed) == list(range(resume_from + 1, STEPS + 1)), sorted(resumed)
    diff = max(abs(resumed[s] - ref[s]) for s in resumed)
    print(
        f"[fsdp2 drill] resumed at {resume_from}: steps {resume_from + 1}..{STEPS}, max |loss diff| = {diff!r}"
    )
    assert diff == 0.0
    assert committed_steps(root)[-1] == STEPS

    # --resume-step: a rollback to the oldest committed step trains the same curve again; its saves
    # are a new attempt (the newer steps set aside, then rotated out)
    committed, newest = committed_steps(root), read_manifest(root)
    back_to = committed[0]
    assert back_to < STEPS - EVERY, committed
    out = run_ranks(4, root, tmp_path / "rolled_back.jsonl", "--resume-step", str(back_to))
    assert f"resumed from step {back_to}\n" in out, out[-3000:]
    again = losses(tmp_path / "rolled_back.jsonl")
    assert sorted(again) == list(range(back_to + 1, STEPS + 1)), sorted(again)
    assert all(again[s] == ref[s] for s in again)
    m = read_manifest(root)
    assert (m.step, m.attempt) == (STEPS, newest.attempt + 1) and m.save_id != newest.save_id
    # the first attempt's newer steps were set aside, then removed by rotation once keep_last
    # steps of the new attempt were committed
    assert list((root / "superseded").iterdir()) == []
    assert committed_steps(root) == committed


@pytest.mark.parametrize("world", [2, 3])
def test_reshard_4_ranks_to_fewer_byte_equal_and_training_continues(reference, tmp_path, world):
    ref, ref_root, ref_final = reference
    root = tmp_path / "ckpt"
    shutil.copytree(ref_root, root)
    loaded = tmp_path / "loaded.safetensors"
    out = run_ranks(
        world, root, tmp_path / "loss.jsonl", "--dump-loaded", str(loaded), steps=STEPS + 2
    )
    assert f"resumed from step {STEPS}" in out, out[-3000:]
    want, got = safetensors_numpy.load_file(ref_final), safetensors_numpy.load_file(loaded)
    assert sorted(got) == sorted(want)
    assert {k.split("/")[0] for k in want} == {"param", "exp_avg", "exp_avg_sq", "adam_step"}
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert got[key].tobytes() == want[key].tobytes(), key
    cont = losses(tmp_path / "loss.jsonl")
    assert sorted(cont) == [STEPS + 1, STEPS + 2]
    assert all(math.isfinite(v) and v < ref[1] for v in cont.values())
    m = read_manifest(root)
    assert (m.step, m.world_size) == (STEPS + 2, world)
