"""Rank processes of tests/dcp/test_dcp_failed_save.py's 2-rank test: in each mode (``sync``:
``dcp.save``; ``thread``/``process``: ``dcp.async_save`` in a thread or in DCP's checkpoint process,
whose writer is a copy the caller cannot abort) a save fails after rank 0 wrote its shard (rank 1
holds a value JSON cannot store, refused in its ``write_data``), nobody aborts it, and the next save
of another step in the same mode must have removed what it left.

Run as ``python tests/dcp/dcp_failed_save_worker.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (``spawn.start_ranks``). Each rank writes ``OUT_DIR/result_<rank>.json``:
``{mode: {"left": [names in the failed step after the failure], "after": [...] or null (the step
directory is gone), "refused": bool}, "committed": [steps]}``.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.local.catalogue import committed_steps

STEPS = {"sync": (10, 11), "thread": (20, 21), "process": (30, 31)}


class Opaque:
    pass


def save(state: dict, root: Path, step: int, mode: str, pg) -> None:
    writer = tdcp.TieredStorageWriter(root, step)
    if mode == "sync":
        dcp.save(state, storage_writer=writer)
        return
    kind = AsyncCheckpointerType.THREAD if mode == "thread" else AsyncCheckpointerType.PROCESS
    dcp.async_save(
        state, storage_writer=writer, async_checkpointer_type=kind, process_group=pg
    ).result(timeout=120)


def names(sdir: Path) -> list[str] | None:
    return sorted(p.name for p in sdir.iterdir()) if sdir.exists() else None


def main() -> None:
    out = Path(sys.argv[1])
    root = out / "ckpt"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict = {}
    for mode, (bad_step, good_step) in STEPS.items():
        pg = dist.new_group(backend="gloo") if mode == "thread" else None
        state = {"w": torch.full((64,), float(rank)), "v": Opaque() if rank == 1 else 1}
        refused = False
        try:
            save(state, root, bad_step, mode, pg)
        except BaseException:  # noqa: BLE001 - DCP's CheckpointException on every rank
            refused = True
        dist.barrier()
        left = names(root / f"step_{bad_step:010d}")
        gc.collect()  # a dropped thread-mode executor ends its thread
        time.sleep(0.5)
        save({"w": torch.full((64,), float(rank)), "v": 1}, root, good_step, mode, pg)
        dist.barrier()
        res[mode] = {
            "left": left,
            "after": names(root / f"step_{bad_step:010d}"),
            "refused": refused,
        }
    res["committed"] = committed_steps(root)
    (out / f"result_{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
