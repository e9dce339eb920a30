"""How long does a save block the training loop? One run, four ways, medians of ``--reps`` saves.

- ``copy``: ``np.copyto`` of the same bytes into preallocated buffers (the floor of any async save
  that must snapshot host memory);
- ``tiered async``: ``CheckpointManager(async_save=True).save()`` (staging into reused buffers; the
  write, hash and commit run in the background and are timed separately, not counted as stall);
- ``tiered sync``: ``CheckpointManager(async_save=False).save()`` (write + fsync + sha256 + commit);
- ``dcp async_save``: ``torch.distributed.checkpoint.async_save(..., no_dist=True)`` with its
  default stager, until it returns (its upload is awaited outside the timing).

Before each timed save the previous one is awaited (outside the timing), so the stall measures the
snapshot alone, not a wait for the previous save. Floor asserted: tiered async stall <= 1.2 x copy
(issue 12; 1.5 x in issue 3).

Usage: ``python bench/async_stall.py --size-mib 512 --reps 5 --dir /tmp/stall`` (exit 1 if the floor
fails). Memory: about 4 x the state size. ``--smoke``: 4 MiB in 2 tensors, 5 reps, floor not
enforced (a check that the script works, run by tests/bench).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tiered_ckpt.training.manager import CheckpointManager


def make_state(size_mib: int, n_tensors: int) -> dict:
    per = size_mib * (1 << 20) // 4 // n_tensors
    rng = np.random.default_rng(0)
    return {
        "params": {
            f"layer{i}": rng.standard_normal(per, dtype=np.float32) for i in range(n_tensors)
        },
        "progress": {"step": 0, "loss_history": [1.0] * 100},
    }


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def bench_copy(state: dict, reps: int) -> list[float]:
    bufs = {k: np.empty_like(v) for k, v in state["params"].items()}
    for k, v in state["params"].items():  # warm the buffers (first-touch page faults)
        np.copyto(bufs[k], v)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for k, v in state["params"].items():
            np.copyto(bufs[k], v)
        out.append(time.perf_counter() - t0)
    return out


def bench_tiered(
    state: dict, reps: int, root: Path, async_save: bool
) -> tuple[list[float], list[float]]:
    stall, background = [], []
    with CheckpointManager(root, async_save=async_save, keep_last=1) as mgr:
        mgr.save(0, state)  # warm-up: allocates the staging buffers
        mgr.wait()
        for step in range(1, reps + 1):
            state["params"]["layer0"][0] = step  # the live state changes between saves
            t0 = time.perf_counter()
            mgr.save(step, state)
            t1 = time.perf_counter()
            mgr.wait()
            stall.append(t1 - t0)
            background.append(time.perf_counter() - t1)
    return stall, background


def bench_dcp(state: dict, reps: int, root: Path) -> tuple[list[float], list[float]] | None:
    try:
        import torch
        import torch.distributed.checkpoint as dcp
    except ImportError:
        return None
    sd = {k: torch.from_numpy(v) for k, v in state["params"].items()}
    stall, background = [], []
    for i in range(reps + 1):
        d = root / f"dcp_{i}"
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=str(d), no_dist=True)
        t1 = time.perf_counter()
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        t2 = time.perf_counter()
        shutil.rmtree(d, ignore_errors=True)
        if i:  # the first is a warm-up, as for the others
            stall.append(t1 - t0)
            background.append(t2 - t1)
    return stall, background


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--dir", default=None, help="where to write (default: a temp dir, removed after)"
    )
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run that only checks the script works (tests/bench): 4 MiB in 2 tensors, 5 reps; "
        "floor not enforced",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.size_mib, args.tensors, args.reps = 4, 2, 5
    if args.reps < 5:
        p.error("--reps must be >= 5")
    work = Path(args.dir or tempfile.mkdtemp(prefix="async_stall_"))
    work.mkdir(parents=True, exist_ok=True)
    state = make_state(args.size_mib, args.tensors)
    try:
        copy = bench_copy(state, args.reps)
        a_stall, a_bg = bench_tiered(state, args.reps, work / "tiered_async", True)
        s_stall, _ = bench_tiered(state, args.reps, work / "tiered_sync", False)
        dcp = bench_dcp(state, args.reps, work)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    res = {
        "size_mib": args.size_mib,
        "reps": args.reps,
        "copy_ms": median_ms(copy),
        "tiered_async_stall_ms": median_ms(a_stall),
        "tiered_async_background_ms": median_ms(a_bg),
        "tiered_sync_ms": median_ms(s_stall),
    }
    if dcp is not None:
        res["dcp_async_stall_ms"] = median_ms(dcp[0])
        res["dcp_async_background_ms"] = median_ms(dcp[1])
    c = res["copy_ms"]
    print(
        f"state {args.size_mib} MiB in {args.tensors} float32 tensors, median of {args.reps} saves each"
    )
    print(f"{'method':28s} {'blocked ms':>11s} {'x copy':>8s} {'background ms':>14s}")
    print(f"{'np.copyto (floor)':28s} {c:11.1f} {1.0:8.2f} {'':>14s}")
    print(
        f"{'tiered async save()':28s} {res['tiered_async_stall_ms']:11.1f} {res['tiered_async_stall_ms'] / c:8.2f} "
        f"{res['tiered_async_background_ms']:14.1f}"
    )
    print(
        f"{'tiered sync save()':28s} {res['tiered_sync_ms']:11.1f} {res['tiered_sync_ms'] / c:8.2f} {'':>14s}"
    )
    if dcp is not None:
        print(
            f"{'dcp.async_save()':28s} {res['dcp_async_stall_ms']:11.1f} {res['dcp_async_stall_ms'] / c:8.2f} "
            f"{res['dcp_async_background_ms']:14.1f}"
        )
    ok = res["tiered_async_stall_ms"] <= 1.2 * c
    res["floor_ok"] = ok
    print(
        f"floor: tiered async stall <= 1.2 x copy: {'OK' if ok else 'FAILED'} "
        f"({res['tiered_async_stall_ms'] / c:.2f} x)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
