"""Rank processes of tests/dcp/test_dcp_reshard_bytes.py: real gloo, one OS process per rank, 4
ranks.

Run as ``python tests/dcp/dcp_reshard_bytes_worker.py OUT_DIR`` with RANK, WORLD_SIZE=4, MASTER_ADDR
and MASTER_PORT set (``spawn.start_ranks``). No training loop:

1. all 4 ranks: an FSDP2 model (``fully_shard`` on two ``Linear(1024, 1024)`` and the root: 4 MiB
   weights) and AdamW after one optimizer step (so both moments hold values); its DCP state
   (``get_state_dict``) saved with ``tiered_ckpt.dcp.save`` as step 1 of ``OUT_DIR/ckpt``; every
   global tensor kept (``full_tensor()``);
2. ranks 0-2 (a 3-rank gloo group and device mesh; rank 3 only joins their creation): the same model
   sharded over 3 ranks, zeroed, loaded with ``dcp.load`` through a :class:`TieredStorageReader`
   (DCP reshards 4 -> 3); each rank writes ``OUT_DIR/result_<rank>.json``: ``bytes_read`` (the
   reader's stats over the whole load: metadata, headers, data), ``bytes_needed`` (the sum over its
   state's leaves of the DTensors' local shards, the plain (replicated) tensors and the byte items'
   stored bytes) and ``bad`` (the keys whose loaded local shard differs from that slice of the
   4-rank global tensor);
3. ranks 0-1 (a 2-rank group and mesh): the model trained one step at 2 ranks, saved as step 2; then
   all 4 ranks load step 2 (DCP reshards 2 -> 4) and write ``OUT_DIR/grow_<rank>.json``
   (``bytes_read``, ``bytes_needed``; rank 0 also ``bad``: the keys whose reassembled
   ``full_tensor()`` differs from the 2-rank original).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.dcp.items import encode_value

WIDTH = 1024  # Linear(WIDTH, WIDTH): a 4 MiB float32 weight


def build(mesh: DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def flat_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def save_four(out: Path) -> dict[str, torch.Tensor]:
    """Step 1 of the module docstring; returns the flattened key -> global tensor (or value)."""
    model, opt = build(init_device_mesh("cpu", (4,)))
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().mean().backward()
    opt.step()
    state = flat_state(model, opt)
    tdcp.save(state, out / "ckpt", 1)
    flat, _ = flatten_state_dict(state)
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in flat.items()}


def zeroed_state(mesh: DeviceMesh) -> dict:
    """The DCP state of a fresh model sharded over ``mesh``, every tensor zeroed: what a load must
    fill."""
    model, opt = build(mesh)
    state = flat_state(model, opt)
    flat, _ = flatten_state_dict(state)
    for v in flat.values():
        if isinstance(v, torch.Tensor):
            (v.to_local() if isinstance(v, DTensor) else v).detach().zero_()
    return state


def load_three(out: Path, mesh: DeviceMesh, pg, full: dict[str, torch.Tensor]) -> dict:
    state = zeroed_state(mesh)
    reader = tdcp.TieredStorageReader(out / "ckpt", 1)
    dcp.load(state, storage_reader=reader, planner=tdcp.TieredLoadPlanner(), process_group=pg)
    flat, _ = flatten_state_dict(state)
    needed, bad = 0, []
    for key, v in flat.items():
        if isinstance(v, DTensor):
            local = v.to_local()
            needed += local.nbytes
            off = v.device_mesh.get_local_rank() * -(
                -v.shape[0] // mesh.size()
            )  # FSDP2: torch.chunk on dim 0
            ok = torch.equal(local, full[key][off : off + local.shape[0]])
        elif isinstance(v, torch.Tensor):
            needed += v.nbytes
            ok = torch.equal(v, full[key])
        else:
            needed += len(encode_value(v, key))
            ok = v == full[key] or (isinstance(full[key], tuple) and v == list(full[key]))
        if not ok:
            bad.append(key)
    return {
        "bytes_read": reader.stats.bytes_read,
        "bytes_needed": needed,
        "bad": bad,
        "keys": len(flat),
    }


def save_two(out: Path, mesh: DeviceMesh, pg) -> dict[str, torch.Tensor]:
    """Ranks 0-1: step 3 of the module docstring's save; the flattened key -> global tensor (or
    value)."""
    model, opt = build(mesh)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(10 + dist.get_rank()))
    model(x).square().mean().backward()
    opt.step()
    state = flat_state(model, opt)
    tdcp.save(state, out / "ckpt", 2, process_group=pg)
    flat, _ = flatten_state_dict(state)
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in flat.items()}


def load_four(out: Path, full: dict[str, torch.Tensor] | None) -> dict:
    """All 4 ranks: step 2 (saved by 2) loaded at 4; bytes read and needed, and (``full`` given) the
    keys whose reassembled value differs from it."""
    state = zeroed_state(init_device_mesh("cpu", (4,)))
    reader = tdcp.TieredStorageReader(out / "ckpt", 2)
    dcp.load(state, storage_reader=reader, planner=tdcp.TieredLoadPlanner())
    flat, _ = flatten_state_dict(state)
    needed = sum(
        v.to_local().nbytes
        if isinstance(v, DTensor)
        else v.nbytes
        if isinstance(v, torch.Tensor)
        else len(encode_value(v, k))
        for k, v in flat.items()
    )
    whole = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in flat.items()
    }  # a collective
    bad = (
        None
        if full is None
        else [
            k
            for k, v in whole.items()
            if not (
                torch.equal(v, full[k])
                if isinstance(v, torch.Tensor)
                else v == full[k] or v == list(full[k])
            )
        ]
    )
    return {
        "bytes_read": reader.stats.bytes_read,
        "bytes_needed": needed,
        "bad": bad,
        "keys": len(flat),
    }


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    full = save_four(out)
    dist.barrier()
    pg = dist.new_group([0, 1, 2])
    mesh = DeviceMesh("cpu", [0, 1, 2])  # every rank of the job joins the creation of its group
    if rank < 3:
        (out / f"result_{rank}.json").write_text(json.dumps(load_three(out, mesh, pg, full)))
    dist.barrier()
    pg2 = dist.new_group([0, 1])
    mesh2 = DeviceMesh("cpu", [0, 1])
    full2 = save_two(out, mesh2, pg2) if rank < 2 else None
    dist.barrier()
    (out / f"grow_{rank}.json").write_text(json.dumps(load_four(out, full2 if rank == 0 else None)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
