"""Worker processes for the multi-rank tests (real torch.distributed gloo, one OS process per rank).

Run as ``python tests/_dist_workers.py MODE OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set; each rank writes ``OUT_DIR/result_<rank>.json``. Modes:

- ``zero``: capture a ZeroRedundancyOptimizer's local partition, restore it into a fresh one (no
  consolidation), check state and the next step are identical.
- ``manager``: two-rank CheckpointManager save/load with node-local roots (``OUT_DIR/node<rank>``).
- ``policy``: the time policy (rank 0's clock) and a SIGTERM on one rank give the same answer on
  all.
- ``dead_rank``: rank 1 dies (SIGKILL) right after its async ``save`` returns; rank 0 must get a
  CheckpointError from ``wait`` within the collective timeout instead of hanging.
- ``env``: no process group; each rank reports its ``sys.prefix`` and ``tiered_ckpt.__file__``
  (tests/local/test_spawn_env.py: the launcher starts the test's own environment).

The package is imported as installed in the environment (no ``sys.path`` edits).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import tiered_ckpt
from tiered_ckpt import CheckpointError, GlobalSlice
from tiered_ckpt.training.manager import CheckpointManager


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3), torch.nn.Linear(3, 2)
    )


def _train(model, opt, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(4, 6, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def mode_zero(rank: int, world: int, out: Path) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from tiered_ckpt import load_shard
    from tiered_ckpt.local.commit import commit_step
    from tiered_ckpt.local.writer import write_shard
    from tiered_ckpt.training.torch_state import capture_training_state, restore_training_state

    m1 = _model()
    z1 = ZeroRedundancyOptimizer(m1.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    _train(m1, z1, 3, seed=1)
    z1.param_groups[0]["lr"] = 0.005  # a changed hyper-parameter must come back too
    st = capture_training_state(m1, z1, rng=False)
    root = out / "ckpt"
    rec = write_shard(root, 3, rank, st, save_id="z" * 32)
    recs = [None] * world
    dist.all_gather_object(recs, rec.to_json())  # test-only transport of the records
    if rank == 0:
        from tiered_ckpt.format.manifest import ShardRecord

        commit_step(root, 3, world, [ShardRecord.from_json(r) for r in recs])
    dist.barrier()
    back = load_shard(root, rank, world)
    m2 = _model()
    z2 = ZeroRedundancyOptimizer(m2.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    restore_training_state(back, m2, z2, rng=False)
    same_state = all(
        torch.equal(z1.optim.state[p1][k], z2.optim.state[p2][k])
        for p1, p2 in zip(m1.parameters(), m2.parameters())
        if p1 in z1.optim.state
        for k in z1.optim.state[p1]
    )
    owned = sum(1 for p in m1.parameters() if p in z1.optim.state)
    _train(m1, z1, 2, seed=7)
    _train(m2, z2, 2, seed=7)
    same_next = all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    return {
        "same_state": same_state,
        "owned": owned,
        "same_next": same_next,
        "lr": z2.param_groups[0]["lr"],
        "local_lr": z2.optim.param_groups[0]["lr"],
        "keys": sorted(st["optimizer"]["state"]),
    }


def mode_manager(rank: int, world: int, out: Path) -> dict:
    root = out / f"node{rank}"
    res: dict = {}
    with CheckpointManager(
        root, rank=rank, world_size=world, save_every_steps=2, keep_last=2, collective_timeout_s=30
    ) as mgr:
        w = np.full(5, float(rank), dtype=np.float32)
        for step in range(1, 7):
            w += 1
            if mgr.should_save(step):
                mgr.save(
                    step,
                    {"w": GlobalSlice(w, (5 * world,), (5 * rank,)), "step": step},
                    extra={"note": "ok"},
                )
        mgr.wait()
        res["latest"] = mgr.latest_step()
        st = mgr.load()
        res["w"] = st["w"].tolist()
        res["files"] = sorted(os.listdir(root / "step_0000000006"))
    return res


def mode_dead_rank(rank: int, world: int, out: Path) -> dict:
    mgr = CheckpointManager(out / "ckpt", rank=rank, world_size=world, collective_timeout_s=20)
    big = np.ones(
        2_000_000, dtype=np.float32
    )  # the write takes long enough for rank 1 to die mid-save
    mgr.save(1, {"w": big})
    mgr.wait()
    if rank == 1:
        mgr.save(2, {"w": big})
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        mgr.save(2, {"w": big})
        mgr.wait()
        return {"raised": None}
    except CheckpointError as exc:
        return {
            "raised": type(exc).__name__,
            "seconds": time.monotonic() - t0,
            "msg": str(exc)[:300],
            "latest": mgr.latest_step(),
        }


def mode_policy(rank: int, world: int, out: Path) -> dict:
    """Time policy on rank 0's clock and a SIGTERM seen by rank 1 only: every rank must agree."""
    res: dict = {}
    with CheckpointManager(
        out / f"timed{rank}",
        rank=rank,
        world_size=world,
        save_every_seconds=0.5,
        collective_timeout_s=30,
    ) as mgr:
        due = []
        for step in range(1, 6):
            if rank == 0 and step == 3:
                time.sleep(0.7)  # only rank 0's clock passes the period
            if mgr.should_save(step):
                due.append(step)
                mgr.save(step, {"x": np.full(2, step)})
        res["due"] = due
    old = signal.getsignal(signal.SIGTERM)
    with CheckpointManager(
        out / f"node{rank}",
        rank=rank,
        world_size=world,
        save_every_steps=100,
        handle_sigterm=True,
        collective_timeout_s=30,
    ) as mgr:
        stopped = None
        for step in range(1, 50):
            if rank == 1 and step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            if mgr.should_save(step):
                mgr.save(step, {"x": np.full(2, step)})
            if mgr.preempted:
                stopped = step
                break
        res["stopped"] = stopped
        res["latest"] = mgr.latest_step()
    signal.signal(signal.SIGTERM, old)
    return res


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "env":
        report = {"prefix": sys.prefix, "tiered_ckpt": tiered_ckpt.__file__}
        (out / f"result_{os.environ['RANK']}.json").write_text(json.dumps(report))
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = globals()[f"mode_{mode}"](rank, world, out)
    (out / f"result_{rank}.json").write_text(json.dumps(res))
    if mode != "dead_rank":
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(0)  # the default group lost a member: no barrier/destroy


if __name__ == "__main__":
    main()
