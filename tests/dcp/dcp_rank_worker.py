"""Rank processes of tests/dcp/test_dcp_ranks.py: real gloo, one OS process per rank.

Run as ``python tests/dcp/dcp_rank_worker.py MODES OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (``spawn.start_ranks``); ``MODES`` is a comma-separated list of ``sync``, ``thread``
(``async_save`` in a thread, with a dedicated gloo group) and ``process`` (``async_save`` in DCP's
checkpoint process: this script has the main guard that needs). Each mode saves the same state as
its own step of ``OUT_DIR/ckpt``, loads it back into a zeroed copy and compares bytes; rank 0 also
reads the committed manifest and the shards' headers (plain safetensors). Each rank writes
``OUT_DIR/result_<rank>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.local.catalogue import read_manifest

STEPS = {"sync": 1, "thread": 2, "process": 3}
BLOB = bytes(range(256)) * 3


def make_state(mesh, fill: bool) -> dict:
    """The state every mode saves: sharded DTensors (float32, bfloat16), a replicated DTensor, a
    plain tensor that is the same on both ranks, and non-tensor values. ``fill=False``: zeros of the
    same layout, to load into."""
    g = torch.Generator().manual_seed(0)

    def val(t: torch.Tensor) -> torch.Tensor:
        return t if fill else torch.zeros_like(t)

    w = val(torch.randn(8, 6, generator=g))
    emb = val(torch.randn(4, 3, generator=g).to(torch.bfloat16))
    rep = val(torch.arange(5, dtype=torch.int64))
    plain = val(torch.linspace(0, 1, 16))
    return {
        "model": {
            "w": distribute_tensor(w, mesh, [Shard(0)]),
            "emb": distribute_tensor(emb, mesh, [Shard(0)]),
            "rep_dt": distribute_tensor(rep, mesh, [Replicate()]),
            "plain": plain,
        },
        "extra": {
            "step": 7 if fill else 0,
            "betas": (0.9, 0.99) if fill else None,
            "blob": BLOB if fill else None,
        },
    }


def local_bytes(t: torch.Tensor) -> bytes:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def compare(a: dict, b: dict) -> list[str]:
    bad = [k for k in a["model"] if local_bytes(a["model"][k]) != local_bytes(b["model"][k])]
    want = {"step": 7, "betas": (0.9, 0.99), "blob": BLOB}
    return bad + [k for k, v in want.items() if b["extra"][k] != v]


def shard_names(root: Path, step: int) -> list[list[str]]:
    from safetensors import safe_open

    sdir = root / f"step_{step:010d}"
    out = []
    for r in range(2):
        with safe_open(str(sdir / f"rank_{r:05d}.safetensors"), "pt") as f:
            out.append(sorted(f.keys()))
    return out


def run_mode(mode: str, mesh, root: Path, rank: int) -> dict:
    step = STEPS[mode]
    state = make_state(mesh, True)
    if mode == "sync":
        tdcp.save(state, root, step)
    elif mode == "thread":
        tdcp.async_save(state, root, step, process_group=dist.new_group(backend="gloo")).result(
            timeout=60
        )
    else:
        tdcp.async_save(
            state, root, step, async_checkpointer_type=AsyncCheckpointerType.PROCESS
        ).result(timeout=90)
    dist.barrier()
    back = make_state(mesh, False)
    loaded = tdcp.load(back, root, step)
    res: dict = {"loaded": loaded, "bad": compare(state, back)}
    if rank == 0:
        m = read_manifest(root, step)
        res.update(
            world_size=m.world_size,
            save_ids=sorted({s.save_id for s in m.shards} | {m.save_id}),
            names=shard_names(root, step),
        )
    return res


def main() -> None:
    modes, out = sys.argv[1].split(","), Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {mode: run_mode(mode, mesh, out / "ckpt", rank) for mode in modes}
    (out / f"result_{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
