"""Rank processes of tests/multiproc/test_dcp_cluster_loss.py: a tiny FSDP2 model trained with AdamW
over real gloo (one OS process per rank), checkpointed through DCPCheckpointManager.

Run as ``python dcp_fsdp2_worker.py MODE ROOT OUT REMOTE_URL ENDPOINT`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (``spawn.start_ranks``):

- ``first``: train steps 1..STEPS from scratch (the uninterrupted run), async saves every SAVE_EVERY
  steps up to step LAST_SAVE (keep_last=1, upload-gated), recording every step's loss;
- ``resume``: ``mgr.load(into=state)`` (the step restored from the bucket), ``set_state_dict``,
  train on to STEPS, recording the losses.

Each rank writes ``OUT/<mode>_<rank>.json``: ``{"losses": {step: loss}, "loaded": step or null,
"committed": [...], "attempt": n}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: s3_infra
import s3_infra  # noqa: E402

from tiered_ckpt.dcp import DCPCheckpointManager  # noqa: E402
from tiered_ckpt.local.catalogue import committed_steps  # noqa: E402

STEPS, SAVE_EVERY, LAST_SAVE = 8, 3, 6


def build(mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def dcp_state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"step": step}}


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)  # the data of (step, rank): no hidden RNG
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.item())


def main() -> None:
    mode, root, out, url, endpoint = sys.argv[1:6]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, opt = build(mesh)
    mgr = DCPCheckpointManager(
        root,
        save_every_steps=SAVE_EVERY,
        keep_last=1,
        upload_gated=True,
        remote_url=url,
        s3_client=s3_infra.make_test_client(endpoint),
        async_mode="thread",
    )
    res: dict = {"losses": {}, "loaded": None}
    start = 0
    if mode == "resume":
        state = dcp_state(model, opt, 0)
        mgr.load(into=state)
        res["loaded"] = mgr.loaded_step
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["extra"]["step"]
    for step in range(start + 1, STEPS + 1):
        res["losses"][step] = train_step(model, opt, step, rank)
        if step <= LAST_SAVE and mgr.should_save(step):
            mgr.save(
                step, dcp_state(model, opt, step)
            )  # async: training goes on while it is written
    mgr.close()
    res.update(committed=committed_steps(root), attempt=mgr.attempt)
    (Path(out) / f"{mode}_{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
