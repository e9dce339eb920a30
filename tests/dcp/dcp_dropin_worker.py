"""Rank processes of tests/dcp/test_dropin_planners.py: an FSDP2 model (``fully_shard`` on CPU over
real gloo) and its AdamW state saved with DCP's default planners (``planner=None``, then
``DefaultSavePlanner(enable_plan_caching=True)`` three times: the third with a value only rank 0
has, so that DCP merges a changed plan with a cached one) and loaded back with DCP's default
load planner into zeroed copies, compared byte for byte.

Run as ``python tests/dcp/dcp_dropin_worker.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (``spawn.start_ranks``). Each rank writes ``OUT_DIR/result_<rank>.json``:
``{"bad": [keys that differ], "checked": n, "committed": [steps], "cached_path": [steps whose
coordinator saw plans from DCP's cache]}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.dcp.storage_writer import UnfinishedSaves
from tiered_ckpt.local.catalogue import committed_steps


def build(mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    loss = model(torch.randn(4, 8, generator=g)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def flat(d, prefix: str = "") -> dict:
    out = {}
    items = d.items() if isinstance(d, dict) else enumerate(d)
    for k, v in items:
        if isinstance(v, (dict, list, tuple)):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def as_bytes(v) -> bytes | object:
    if isinstance(v, DTensor):
        v = v.to_local()
    if isinstance(v, torch.Tensor):
        return v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return v


def zeroed(d):
    """A template of ``d`` 's structure to load into: tensors zeroed, other values replaced by
    another value of their type (so that a value not loaded shows)."""
    if isinstance(d, dict):
        return {k: zeroed(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return type(d)(zeroed(v) for v in d)
    if isinstance(d, torch.Tensor):
        return torch.zeros_like(d)
    if isinstance(d, bool):
        return not d
    if isinstance(d, (int, float)):
        return type(d)(-1)
    if isinstance(d, str):
        return ""
    return None


def main() -> None:
    out = Path(sys.argv[1])
    root = out / "ckpt"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, opt = build(mesh)
    bad, checked, cached_path = [], 0, []
    caching = DefaultSavePlanner(enable_plan_caching=True)
    for step in range(1, 5):
        train(model, opt, step, rank)
        msd, osd = get_state_dict(model, opt)
        extra = {"step": step, "tag": f"s{step}"}
        if step == 4 and rank == 0:  # rank 0's plan changes, rank 1's does not: DCP merges
            extra["late"] = [4, "r0"]
        state = {"model": msd, "optim": osd, "extra": extra}
        planner = None if step == 1 else caching
        dcp.save(state, storage_writer=tdcp.TieredStorageWriter(root, step), planner=planner)
        # the coordinator's lock claims for ranks writing cached plans (before the next save
        # sweeps them)
        cached_path += [e.step for e in UnfinishedSaves._entries if e.record is None]  # noqa: SLF001
        want = {k: as_bytes(v) for k, v in flat(state).items()}
        back = {"model": zeroed(msd), "optim": zeroed(osd), "extra": zeroed(extra)}
        dcp.load(
            back,
            storage_reader=tdcp.TieredStorageReader(root, step),
            planner=DefaultLoadPlanner() if step % 2 else None,
        )
        got = {k: as_bytes(v) for k, v in flat(back).items()}
        bad += [f"{step}:{k}" for k in want if got.get(k) != want[k]]
        checked += len(want)
    dist.barrier()
    res = {
        "bad": bad,
        "checked": checked,
        "committed": committed_steps(root),
        "cached_path": sorted(set(cached_path)),
    }
    (out / f"result_{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
