"""How long does an async save block the training loop? One run, interleaved cases, medians.

Cases (each repetition runs every case once, order rotated and reversed, ``_common.interleaved``):

- ``copy``: single-threaded ``np.copyto`` of the same bytes into preallocated buffers (the floor's
  reference: what any async save that snapshots host memory with one thread costs);
- ``stager_1`` / ``stager``: ``Stager(threads=1)`` / ``Stager()`` (``os.cpu_count()`` threads)
  ``.stage(state)`` alone, into buffers reused from the previous call;
- ``tiered_async``: ``CheckpointManager(async_save=True).save()`` until it returns (staging into
  reused buffers; the write, hash and commit run in the background, timed separately as
  ``background``, not counted as stall);
- ``tiered_sync``: ``CheckpointManager(async_save=False).save()`` (write + fsync + hashes + commit);
- ``dcp_async``: ``torch.distributed.checkpoint.async_save(..., no_dist=True)`` with its default
  stager, until it returns (its upload awaited outside the timing);
- ``tc_async``: Meta's torch_checkpointing (PyPI ``torch-checkpointing``) ``CheckpointManager`` with
  its async saver, buffered I/O (``LocalFileSystemStorageConfig(use_direct_io=False)``: its default
  O_DIRECT writer fails on this filesystem). Its ``save()`` returns before its staging thread has
  copied the state; a training loop must wrap the next in-place update in its ``manager.lock()``,
  which waits for that copy. Reported: until ``save()`` returns (``tc_async_return``) and until
  ``with manager.lock(): pass`` gets through (``tc_async``, the time the loop is blocked when it
  updates the state right after the save, as ours and DCP's stalls are measured).

Before each timed save the previous one is awaited (outside the timing), so a stall measures the
snapshot alone. Floor (exit 1 when it fails): ``tiered_async`` <= 0.8 x ``copy``; goal:
``tiered_async`` <= ``tc_async``.

Usage: ``python bench/async_stall.py --size-mib 2048 --tensors 32 --reps 5 --dir /tmp/stall``.
Memory: about 5 x the state size. ``--smoke``: 4 MiB in 2 tensors, 3 reps, no torch_checkpointing,
floor not enforced (a check that the script works, run by tests/bench).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _common import interleaved, machine_note, median, spread  # bench/ is sys.path[0]

from tiered_ckpt.training.manager import CheckpointManager
from tiered_ckpt.training.staging import Stager


def make_state(size_mib: int, n_tensors: int) -> dict:
    per = size_mib * (1 << 20) // 4 // n_tensors
    rng = np.random.default_rng(0)
    return {
        "params": {
            f"layer{i}": rng.standard_normal(per, dtype=np.float32) for i in range(n_tensors)
        },
        "progress": {"step": 0, "loss_history": [1.0] * 100},
    }


class Case:
    """One way of saving; ``once(rep)`` returns ``{row: seconds}`` for one timed save."""

    def once(self, rep: int) -> dict[str, float]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class CopyCase(Case):
    def __init__(self, state: dict) -> None:
        self.params = state["params"]
        self.bufs = {k: np.empty_like(v) for k, v in self.params.items()}
        self.once(0)  # first touch of the buffers

    def once(self, rep: int) -> dict[str, float]:
        t0 = time.perf_counter()
        for k, v in self.params.items():
            np.copyto(self.bufs[k], v)
        return {"copy": time.perf_counter() - t0}


class StagerCase(Case):
    """Both stager rows share one ``Stager`` (one set of buffers): ``threads`` set before each."""

    def __init__(self, state: dict) -> None:
        self.state = state
        self.stager = Stager()
        self.cores = self.stager.threads
        self.stager.stage(state)

    def once(self, rep: int) -> dict[str, float]:
        out = {}
        for row, threads in (("stager_1", 1), ("stager", self.cores))[:: 1 if rep % 2 else -1]:
            self.stager.threads = threads
            t0 = time.perf_counter()
            self.stager.stage(self.state)
            out[row] = time.perf_counter() - t0
        return out

    def close(self) -> None:
        self.stager.close()


class TieredCase(Case):
    def __init__(self, state: dict, root: Path, async_save: bool) -> None:
        self.state, self.async_save = state, async_save
        self.row = "tiered_async" if async_save else "tiered_sync"
        self.mgr = CheckpointManager(root, async_save=async_save, keep_last=1)
        self.step = 0
        self.mgr.save(0, state)  # warm-up: allocates the staging buffers
        self.mgr.wait()

    def once(self, rep: int) -> dict[str, float]:
        self.step += 1
        self.state["params"]["layer0"][0] = self.step  # the live state changes between saves
        t0 = time.perf_counter()
        self.mgr.save(self.step, self.state)
        t1 = time.perf_counter()
        self.mgr.wait()
        out = {self.row: t1 - t0}
        if self.async_save:
            out["tiered_async_background"] = time.perf_counter() - t1
        return out

    def close(self) -> None:
        self.mgr.close()


class DcpCase(Case):
    def __init__(self, state: dict, root: Path) -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        self.dcp, self.root = dcp, root
        self.sd = {k: torch.from_numpy(v) for k, v in state["params"].items()}
        self.once(-1)  # warm-up

    def once(self, rep: int) -> dict[str, float]:
        d = self.root / f"dcp_{rep}"
        t0 = time.perf_counter()
        fut = self.dcp.async_save(self.sd, checkpoint_id=str(d), no_dist=True)
        t1 = time.perf_counter()
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        t2 = time.perf_counter()
        shutil.rmtree(d, ignore_errors=True)
        return {"dcp_async": t1 - t0, "dcp_async_background": t2 - t1}


class TorchCheckpointingCase(Case):
    def __init__(self, state: dict, root: Path) -> None:
        import torch
        from torch_checkpointing.checkpoint_manager import CheckpointManager as TcManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        cfg = TcManager.Config.with_async_save()
        cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
        self.mgr = TcManager(cfg)
        self.root = root
        self.sd = {k: torch.from_numpy(v) for k, v in state["params"].items()}
        self.once(-1)  # warm-up: starts its writer process, allocates its staging buffers

    def once(self, rep: int) -> dict[str, float]:
        d = self.root / f"tc_{rep}"
        t0 = time.perf_counter()
        fut = self.mgr.save(str(d), {"model": self.sd})
        t1 = time.perf_counter()
        with self.mgr.lock():  # what an in-place update right after the save waits for
            pass
        t2 = time.perf_counter()
        fut.result()
        t3 = time.perf_counter()
        shutil.rmtree(d, ignore_errors=True)
        return {"tc_async_return": t1 - t0, "tc_async": t2 - t0, "tc_async_background": t3 - t2}

    def close(self) -> None:
        self.mgr.close()


ROWS = [
    ("copy", "np.copyto, 1 thread (floor ref)"),
    ("stager_1", "Stager(threads=1).stage"),
    ("stager", "Stager().stage (cores threads)"),
    ("tiered_async", "tiered async save()"),
    ("tiered_sync", "tiered sync save()"),
    ("dcp_async", "dcp.async_save()"),
    ("tc_async", "torch_checkpointing until lock()"),
    ("tc_async_return", "torch_checkpointing save() returns"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=2048)
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--dir",
        default=None,
        help="where to write (a fresh temp dir inside it, removed after; default: the system's)",
    )
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--no-peer", action="store_true", help="skip torch_checkpointing")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run that only checks the script works (tests/bench): 4 MiB in 2 tensors, "
        "3 reps, no torch_checkpointing; floor not enforced",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.size_mib, args.tensors, args.reps, args.no_peer = 4, 2, 3, True
    if args.reps < 3:
        p.error("--reps must be >= 3")
    if args.dir:  # a fresh directory inside it: a root left by an earlier run is not reused
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="async_stall_", dir=args.dir))
    state = make_state(args.size_mib, args.tensors)
    builders: dict[str, Callable[[], Case]] = {
        "copy": lambda: CopyCase(state),
        "stager": lambda: StagerCase(state),
        "tiered_async": lambda: TieredCase(state, work / "tiered_async", True),
        "tiered_sync": lambda: TieredCase(state, work / "tiered_sync", False),
    }
    try:
        import torch  # noqa: F401

        builders["dcp_async"] = lambda: DcpCase(state, work)
        if not args.no_peer:
            import torch_checkpointing  # noqa: F401

            builders["tc_async"] = lambda: TorchCheckpointingCase(state, work)
    except ImportError as exc:
        print(f"skipped: {exc}")
    samples: dict[str, list[float]] = {}
    cases: dict[str, Case] = {}
    loads = []
    t_start = time.time()
    try:
        for name, build in builders.items():
            cases[name] = build()
        for rep, name in interleaved(list(cases), args.reps):
            loads.append(os.getloadavg()[0])
            for row, s in cases[name].once(rep).items():
                samples.setdefault(row, []).append(s)
    finally:
        for c in cases.values():
            c.close()
        shutil.rmtree(work, ignore_errors=True)
    res: dict = {
        "size_mib": args.size_mib,
        "tensors": args.tensors,
        "reps": args.reps,
        "cpus": os.cpu_count(),
        "load_avg_median": median(loads),
        "load_avg_max": max(loads),
        "seconds": time.time() - t_start,
        "rows": {},
    }
    for row, xs in samples.items():
        lo, hi = spread(xs)
        res["rows"][row] = {"median_ms": median(xs) * 1e3, "min_ms": lo * 1e3, "max_ms": hi * 1e3}
    r = res["rows"]
    res["tiered_async_stall_ms"] = r["tiered_async"]["median_ms"]
    c = r["copy"]["median_ms"]
    print(f"machine: {machine_note()}")
    print(
        f"state {args.size_mib} MiB in {args.tensors} float32 tensors, {args.reps} interleaved "
        f"repetitions, {os.cpu_count()} CPUs, load average during the run: median "
        f"{res['load_avg_median']:.2f}, max {res['load_avg_max']:.2f}"
    )
    print(
        f"{'method':36s} {'blocked ms':>11s} {'min-max ms':>17s} {'x copy':>7s} {'background ms':>14s}"
    )
    for row, label in ROWS:
        if row not in r:
            continue
        m = r[row]
        bg = r.get(f"{row}_background", {}).get("median_ms")
        print(
            f"{label:36s} {m['median_ms']:11.1f} {m['min_ms']:8.1f}-{m['max_ms']:<8.1f} "
            f"{m['median_ms'] / c:7.2f} {'' if bg is None else f'{bg:14.1f}'}"
        )
    ours = r["tiered_async"]["median_ms"]
    ok = ours <= 0.8 * c
    res["floor_ok"] = ok
    print(f"floor: tiered async stall <= 0.8 x copy: {'OK' if ok else 'FAILED'} ({ours / c:.2f} x)")
    if "tc_async" in r:
        peer = r["tc_async"]["median_ms"]
        res["goal_ok"] = ours <= peer
        print(
            f"goal: tiered async stall <= torch_checkpointing's: "
            f"{'OK' if ours <= peer else 'MISSED'} ({ours / peer:.2f} x its time)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
