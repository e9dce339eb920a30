"""Rank process of tests/multiproc/test_reshard_training_cli.py: replicated claims checked at save.

Run as ``python replicated_claim_worker.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (gloo); each rank has its own root ``OUT_DIR/node<rank>`` (node-local disks) and
writes ``OUT_DIR/result_<rank>.json``:

1. step 1: a model initialised differently on each rank (as a tensor-parallel shard would be)
   claimed replicated through ``capture_training_state(..., replicated_group=WORLD)``: the async
   save must fail with ``ReplicatedMismatchError`` on every rank, writing nothing;
2. step 2: the same model on every rank, claimed replicated: committed, and each rank's root
   (holding only that rank's shard) loads the replicated values from its own node's copy.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tiered_ckpt.torch import capture_training_state, restore_training_state
from tiered_ckpt.training import CheckpointManager, ReplicatedMismatchError


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def run(rank: int, world: int, out: Path) -> dict:
    root = out / f"node{rank}"
    res: dict = {}
    with CheckpointManager(root, rank=rank, world_size=world, collective_timeout_s=30) as mgr:
        wrong = capture_training_state(
            model(seed=rank), progress={"step": 1}, rng=False, replicated_group=dist.group.WORLD
        )
        mgr.save(1, wrong)
        try:
            mgr.wait()
            res["refused"] = None
        except ReplicatedMismatchError as e:
            res["refused"] = {"msg": str(e), "key": e.key, "groups": e.rank_groups, "keys": e.keys}
        res["step1_dir"] = (root / "step_0000000001").exists()
        m = model(seed=0)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(torch.ones(1, 4)).sum().backward()
        opt.step()
        mgr.save(
            2,
            capture_training_state(
                m, opt, progress={"step": 2}, rng=False, replicated_group=dist.group.WORLD
            ),
        )
        mgr.wait()
        res["files"] = sorted(os.listdir(root / "step_0000000002"))
        st = mgr.load()
        fresh = model(seed=5)
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5)
        restore_training_state(st, fresh, fresh_opt, rng=False)
        res["same_params"] = all(
            torch.equal(a, b) for a, b in zip(m.state_dict().values(), fresh.state_dict().values())
        )
        res["lr"] = fresh_opt.param_groups[0]["lr"]
        res["progress"] = st["progress"]
        res["latest"] = mgr.latest_step()
    return res


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = run(rank, world, out)
    (out / f"result_{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
