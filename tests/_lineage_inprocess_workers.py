"""Rank processes of the in-process rollback test (a rollback inside a running manager): real torch.distributed
gloo, one OS process per rank, node-local roots ``OUT/node<rank>``, no remote.

``python tests/_lineage_inprocess_workers.py OUT_DIR`` with RANK, WORLD_SIZE=2, MASTER_ADDR and
MASTER_PORT set. One manager saves 500, 600, 700, then (without a restart) loads 500, saves 510 and
600, loads the newest step again, loses rank 1's copy of 600 (a node loss inside the run: ``load()``
finds 510 the newest common step), saves 520 and 600; a second manager (a restart) loads the newest
step. Each phase appends ``[phase, loaded step or null, attempt, committed steps, superseded
steps]`` to the rank's record, or ``[phase, "error", "Type: message"]`` and stops; the record is
written to ``OUT/result_<rank>.json`` either way.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.training.manager import CheckpointManager


def state(step: int, rank: int) -> dict:
    return {"w": np.full(4, step + rank / 10, dtype=np.float64), "step": step}


def superseded(root: Path) -> list[list]:
    from tiered_ckpt.local.lineage import superseded_local_steps

    return sorted(
        [
            e.step,
            e.attempt,
            e.superseded.attempt if e.superseded else None,
            e.superseded.from_step if e.superseded else None,
        ]
        for e in superseded_local_steps(root)
    )


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = out / f"node{rank}"
    log: list[list] = []

    def note(phase: str, mgr: CheckpointManager, got: dict | None = None) -> None:
        if got is not None:
            assert got["w"].tolist() == state(int(got["step"]), rank)["w"].tolist(), got
        log.append(
            [
                phase,
                None if got is None else int(got["step"]),
                mgr.attempt,
                committed_steps(root),
                superseded(root),
            ]
        )

    def manager() -> CheckpointManager:
        return CheckpointManager(
            root,
            rank=rank,
            world_size=world,
            async_save=False,
            keep_last=5,
            collective_timeout_s=60,
        )

    try:
        with manager() as mgr:
            for s in (500, 600, 700):
                mgr.save(s, state(s, rank))
            note("saved", mgr)
            note("load 500", mgr, mgr.load(500))
            for s in (510, 600):
                mgr.save(s, state(s, rank))
            note("saved 510 600", mgr)
            note("load newest", mgr, mgr.load())
            dist.barrier()
            if rank == 1:
                shutil.rmtree(root / step_dir_name(600))  # this node lost its copy of 600
            dist.barrier()
            note("load after loss", mgr, mgr.load())
            for s in (520, 600):
                mgr.save(s, state(s, rank))
            note("saved 520 600", mgr)
        with manager() as mgr:
            note("restart", mgr, mgr.load())
    except Exception as exc:
        log.append(
            [log[-1][0] + " +1" if log else "start", "error", f"{type(exc).__name__}: {exc}"[:300]]
        )
    with open(out / f"result_{rank}.json", "w") as f:
        json.dump(log, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
