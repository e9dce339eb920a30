"""Rank processes of the multi-rank restore test (real torch.distributed gloo, one OS process per
rank).

``python tests/restore_workers.py OUT_DIR S3_URL ENDPOINT`` with RANK, WORLD_SIZE=4, MASTER_ADDR and
MASTER_PORT set. Two "nodes" with node-local roots (``OUT_DIR/node0`` for ranks 0-1, ``node1`` for
2-3) save steps 2 and 4, their sidecars upload them, step 6 is saved but never uploaded, then node 1
is replaced (its root deleted) and every rank loads through ``CheckpointManager(remote_url=...)``.
Each rank writes ``OUT_DIR/result_<rank>.json``.

``python tests/restore_workers.py env OUT_DIR``: no process group; each rank writes its
``sys.prefix`` and ``tiered_ckpt.__file__`` (tests/local/test_spawn_env.py). The package is imported
as installed (no ``sys.path`` edits).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

import tiered_ckpt
from tiered_ckpt.store import make_s3_client
from tiered_ckpt.training.manager import CheckpointManager


def state(rank: int, step: int) -> dict:
    return {"w": np.full(5, rank * 100 + step, dtype=np.float32), "step": step}


def main() -> None:
    if sys.argv[1] == "env":
        report = {"prefix": sys.prefix, "tiered_ckpt": tiered_ckpt.__file__}
        (Path(sys.argv[2]) / f"result_{os.environ['RANK']}.json").write_text(json.dumps(report))
        return
    out, url, endpoint = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = rank // 2
    root = out / f"node{node}"
    client = make_s3_client(endpoint_url=endpoint, path_style=True, region_name="us-east-1")
    mgr = CheckpointManager(
        root,
        rank=rank,
        world_size=world,
        async_save=False,
        keep_last=5,
        remote_url=url,
        s3_client=client,
        collective_timeout_s=60,
    )
    for step in (2, 4):
        mgr.save(step, state(rank, step))
    dist.barrier()
    from tiered_ckpt.remote.upload.uploader import StepIncompleteError, Uploader

    for turn in (
        0,
        1,
    ):  # each node's sidecar, one after the other (the second one commits the steps)
        if rank == 2 * turn:
            with Uploader(root, url, s3_client=client) as up:
                for step in (2, 4):
                    try:
                        up.upload_step(step)
                    except StepIncompleteError:
                        pass
        dist.barrier()
    mgr.save(6, state(rank, 6))  # committed locally, never uploaded
    dist.barrier()
    if rank == 2:
        shutil.rmtree(root)  # node 1 is replaced: its disk is gone
    dist.barrier()
    loaded = mgr.load()
    mgr.close()
    dist.barrier()  # both ranks of node 1 have finished restoring into the shared root
    files = sorted(os.listdir(root / "step_0000000004"))
    with open(out / f"result_{rank}.json", "w") as f:
        json.dump(
            {
                "step": loaded["step"],
                "w": loaded["w"].tolist(),
                "files": files,
                "committed": sorted(p.name for p in root.iterdir() if p.name.startswith("step_")),
            },
            f,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
