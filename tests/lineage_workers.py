"""Rank processes of the node-replacement test: real torch.distributed gloo,
one OS process per rank, two simulated nodes with node-local roots (``OUT/node0`` for ranks 0-1,
``OUT/node1`` for ranks 2-3), a real S3 server.

``python tests/lineage_workers.py MODE OUT_DIR S3_URL ENDPOINT`` with RANK, WORLD_SIZE=4,
MASTER_ADDR and MASTER_PORT set. Each rank trains a small deterministic float64 "model" (its own
slice; the loss is all-reduced, so every rank takes part in every step) and saves every 10 steps.
MODE:

- ``straight``: steps 1-50 without interruption (the reference loss curve), no remote;
- ``first``: steps 1-40; after each save both nodes' sidecars upload it, except step 40, which only
  node 0's sidecar sends (node 1's upload of 40 is "still running" when the job dies); then the job
  exits;
- ``resume`` (after the test deleted ``OUT/node1``: node 1 was replaced):
  ``CheckpointManager.load()`` through the bucket, then steps up to 50 with saves at 40 and 50, both
  sidecars uploading them.

Each rank writes ``OUT/result_<MODE>_<rank>.json``: the losses by step, the loaded step, run id,
attempt, its root's committed steps and superseded steps (right after the load, and at the end), and
(resume, rank 0) the bucket's current saves.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.store import make_s3_client
from tiered_ckpt.training.manager import CheckpointManager

END = 50


def init_state(rank: int) -> dict:
    return {"w": np.linspace(-1.0, 1.0, 6, dtype=np.float64) * (rank + 1), "step": 0}


def train_step(state: dict, step: int, rank: int) -> float:
    """One deterministic step in place; returns the global loss (all-reduced over the ranks)."""
    w = state["w"]
    target = np.full_like(w, 0.25 * rank)
    grad = 2.0 * (w - target) + 0.01 * math.sin(step)
    w -= 0.05 * grad
    state["step"] = step
    loss = torch.tensor([float(np.sum((w - target) ** 2))], dtype=torch.float64)
    dist.all_reduce(loss)
    return float(loss.item())


def upload(root: Path, url: str, client, steps: list[int], nodes: list[int], rank: int) -> None:
    """Each listed node's sidecar (its local rank 0) uploads ``steps``, one node after the other."""
    from tiered_ckpt.remote.upload.uploader import StepIncompleteError, Uploader

    for node in (0, 1):
        if node in nodes and rank == 2 * node:
            with Uploader(root, url, s3_client=client) as up:
                for s in steps:
                    try:
                        up.upload_step(s)
                    except StepIncompleteError:
                        pass  # the other node has not sent its shards yet
        dist.barrier()


def superseded(root: Path) -> list[list]:
    try:
        from tiered_ckpt.local.lineage import superseded_local_steps
    except (
        ImportError
    ):  # code without lineage records (the test reproduces its failure): nothing to list
        return []
    return [
        [
            e.step,
            e.attempt,
            e.superseded.attempt if e.superseded else None,
            e.superseded.from_step if e.superseded else None,
            e.set_aside,
        ]
        for e in superseded_local_steps(root)
    ]


def main() -> None:
    mode, out, url, endpoint = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = out / "straight" if mode == "straight" else out
    root = base / f"node{rank // 2}"
    client = make_s3_client(endpoint_url=endpoint, path_style=True, region_name="us-east-1")
    remote = {} if mode == "straight" else {"remote_url": url, "s3_client": client}
    mgr = CheckpointManager(
        root,
        rank=rank,
        world_size=world,
        async_save=False,
        keep_last=3,
        # rotation by count: the stand-in sidecars above never poll again after a
        # StepIncompleteError, so node 0's steps never get their uploaded.json
        upload_gated=False,
        collective_timeout_s=60,
        **remote,
    )
    result: dict = {"losses": {}}
    state, start = init_state(rank), 1
    if mode == "resume":
        state = mgr.load()
        start = int(state["step"]) + 1
        result["loaded"] = int(state["step"])
        result["superseded_after_load"] = superseded(root)
        result["committed_after_load"] = committed_steps(root)
    last = 40 if mode == "first" else END
    for step in range(start, last + 1):
        result["losses"][step] = train_step(state, step, rank)
        if step % 10 == 0:
            mgr.save(step, state)
            if mode != "straight":
                upload(
                    root,
                    url,
                    client,
                    [step],
                    [0] if (mode, step) == ("first", 40) else [0, 1],
                    rank,
                )
    mgr.close()
    dist.barrier()
    result.update(
        run_id=getattr(mgr, "run_id", None),
        attempt=getattr(mgr, "attempt", 1),
        committed=committed_steps(root),
        superseded=superseded(root),
    )
    if mode == "resume" and rank == 0:
        from tiered_ckpt.remote.catalogue import read_catalogue
        from tiered_ckpt.remote.handle import StoreHandle

        with StoreHandle(url, s3_client=client) as st:
            cat = read_catalogue(st)
        result["remote_current"] = [[s.step, s.attempt] for s in cat.current()]
        result["remote_attempts"] = None if cat.lineage is None else cat.lineage.attempt
    with open(out / f"result_{mode}_{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
