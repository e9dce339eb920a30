"""Rank processes for the "nodes by shared disk" tests
(tests/multiproc/test_disk_groups.py).

Run as ``python tests/_node_workers.py ROOT OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (real torch.distributed gloo, one OS process per rank). The test starts each rank
inside its own mount (and UTS) namespace, so ROOT may be one path on every rank backed by different
disks (bind mounts), one directory for all, or a directory per rank, and the host names may be equal
or differ.

Each rank runs a CheckpointManager on ROOT, saves steps 1 and 2, loads the newest step and writes
``OUT_DIR/result_<rank>.json``: its host name, what each save did (committed here, error), the load,
and the node token files in ROOT while the manager is open.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tiered_ckpt import CheckpointError
from tiered_ckpt.layout import NODE_TOKEN_PREFIX
from tiered_ckpt.training.manager import CheckpointManager


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res: dict = {"rank": rank, "host": socket.gethostname(), "root": str(root)}
    try:
        with CheckpointManager(
            root,
            rank=rank,
            world_size=world,
            keep_last=5,
            async_save=False,
            collective_timeout_s=60,
        ) as mgr:
            for step in (1, 2):
                mgr.save(step, {"w": np.full(3, 10 * step + rank, dtype=np.int64), "step": step})
            res["tokens_open"] = sorted(
                n for n in os.listdir(root) if n.startswith(NODE_TOKEN_PREFIX)
            )
            st = mgr.load()
            res["loaded"] = {"step": int(st["step"]), "w": st["w"].tolist()}
            res["outcomes"] = [
                {"step": o.step, "committed_here": o.committed_here, "error": o.error}
                for o in mgr.save_outcomes
            ]
            coord = (
                mgr._coord
            )  # the SaveCoordinator: close() removes this rank's token (idempotent)
            own = set(coord._tokens.values())
            coord.close()
            coord.close()
            res["own_token_left_after_close"] = sorted(own & set(os.listdir(root)))
    except CheckpointError as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        res["failures"] = {
            str(k): str(v)[:500] for k, v in (getattr(exc, "failures", None) or {}).items()
        }
    (out / f"result_{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
