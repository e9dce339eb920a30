#!/usr/bin/env python3
"""Benchmark of the local tier: save and load of a large state against raw writes,
torch.save and torch.distributed.checkpoint (DCP), on the same filesystem, in one run with
interleaved repetitions.

    python bench/local_save.py                      # 2 GiB, 5 repetitions, under /tmp
    python bench/local_save.py --size-gib 0.1 --reps 2 --dir /work/scratch
    python bench/local_save.py --cases ours_1,raw_1,dcp_1 --reps 3
    python bench/local_save.py --smoke --dir /tmp/x       # every case at 4 MiB, once: checks the script works

Cases (every save runs in a fresh interpreter started with ``subprocess`` that builds its own state,
so its peak RSS is its own; page cache dropped before each save where permitted):

  ours_1      save_sharded([state]) : 1 rank, sha256 included, commit included
  ours_4t     save_sharded(4 states): 4 ranks in parallel threads of one process
  ours_4p     4 fresh processes, each write_shard() its 512 MiB, then one commit_step()
  dd          dd if=/dev/zero of=F bs=16M iflag=count_bytes count=<bytes> conv=fsync  (zeros!)
  dd_4        4 such dd processes in parallel, <bytes>/4 each (one file per rank)
  ddr/ddr_4   the same dd, but copying random bytes from a file on /dev/shm (tmpfs, in RAM: reading
  it is a
              memcpy) instead of /dev/zero: a disk or host that treats zero blocks specially (thin
              provisioning, zero detection) writes zeros several times faster than checkpoint data
  raw_1       Python loop of 16 MiB os.write() of the same array bytes, fsync at the end
  raw_4t      the same, 4 threads, one file per rank
  torch_1/4t  torch.save(torch.from_numpy state) + flush + fsync (4t: one file per rank, 4 threads)
  dcp_1/4     torch.distributed.checkpoint.save(FileSystemWriter, no_dist=True) of the same tensors
              (dcp_4: the 4 ranks' states in one dict, thread_count=4)
  small_ours  10,000 tensors of 4 KiB (40 MiB), save_sharded, 1 rank
  small_dcp   the same with DCP
  small_mgr   the same through CheckpointManager(async_save=False): save(step, state), load()
  small_tc    the same with Meta's torch_checkpointing (PyPI torch-checkpointing): its
              CheckpointManager with the sync saver and buffered I/O
              (LocalFileSystemStorageConfig(use_direct_io=False): its default O_DIRECT writer fails
              on this filesystem), loaded into preallocated tensors (``load(id, into=...)``)

Each case's files are loaded right after its save (warm: still in the page cache) and again after
dropping the page cache (cold), then deleted: our load_sharded (sha256 verified) vs torch.load vs
DCP load (into preallocated tensors) vs a raw read of the raw files into one buffer.

Floors: save throughput >= 0.8 x the faster raw write and >= 1.0 x DCP; peak RSS growth
during our save <= 10% of the state.

Floor rows (``--floor-rows`` runs only their cases): cold-cache verified load >= 1.0 x dcp.load at 1
rank (ours_1 vs dcp_1) and at 4 ranks (load_sharded of ours_4t's 4-rank step vs dcp.load of the same
2 GiB, dcp_1); save at 4 ranks >= 0.9 x 4 parallel dd (ours_4p and ours_4t vs dd_4 and ddr_4), 1
rank >= 1.0 x dd (and ddr); the small tensors' save + warm load >= 10 x DCP's. Each save row is
reported against dd of zeros and dd of random bytes: where the two differ, the disk treats zeros
specially, and dd of random bytes is the baseline that writes what a checkpoint writes.

    python bench/local_save.py --floor-rows --reps 3    # 2 GiB: the floor rows only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as C  # bench/ is sys.path[0] when a script of it runs

CHUNK = 16 * C.MiB
STEP = 1

#: case -> (kind, ranks)
CASES: dict[str, tuple[str, int]] = {
    "ours_1": ("ours", 1),
    "ours_4t": ("ours", 4),
    "ours_4p": ("ours_proc", 4),
    "dd": ("dd", 1),
    "dd_4": ("dd", 4),
    "ddr": ("ddr", 1),
    "ddr_4": ("ddr", 4),
    "raw_1": ("raw", 1),
    "raw_4t": ("raw", 4),
    "torch_1": ("torch", 1),
    "torch_4t": ("torch", 4),
    "dcp_1": ("dcp", 1),
    "dcp_4": ("dcp", 4),
    "small_ours": ("ours", 1),
    "small_dcp": ("dcp", 1),
    "small_mgr": ("mgr", 1),
    "small_tc": ("tc", 1),
}
NO_LOAD = {
    "dd",
    "dd_4",
    "ddr",
    "ddr_4",
    "ours_4p",
}  # dd wrote zeros or a copy; ours_4p's files are read exactly like ours_4t's
#: The cases of the floor rows (``--floor-rows``): cold verified load vs dcp.load at 1 and 4 ranks,
#: save vs 1 and 4 parallel dd, 10,000 small tensors vs DCP.
FLOOR_CASES = "ours_1,ours_4t,ours_4p,dd,dd_4,ddr,ddr_4,dcp_1,small_ours,small_dcp"
#: The small-tensor rows (``--small``): save + load through save_sharded/load_sharded and through
#: the manager, against DCP and torch_checkpointing.
SMALL = "small_ours,small_mgr,small_dcp,small_tc"


def _tc_manager() -> Any:
    """torch_checkpointing's manager with its sync saver and buffered writes."""
    from torch_checkpointing.checkpoint_manager import CheckpointManager as TcManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    cfg = TcManager.Config.with_sync_save()
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return TcManager(cfg)


# ============================================================================================ state


def state_spec(rank_bytes: int) -> list[tuple[tuple[str, ...], str, tuple[int, ...]]]:
    """One rank's tensors, ``rank_bytes`` in all: fp16 params in 8 layers plus the ZeRO fp32 master,
    exp_avg and exp_avg_sq partitions (2 + 4 + 4 + 4 bytes per parameter), the remainder as
    uint8."""
    e = (rank_bytes // 14) // 8192 * 8192
    spec: list[tuple[tuple[str, ...], str, tuple[int, ...]]] = []
    if e:
        per = e // 8
        for i in range(8):
            spec.append((("model", f"layers.{i}.weight"), "float16", (per // 1024, 1024)))
        for k in ("master", "exp_avg", "exp_avg_sq"):
            spec.append((("optim", k), "float32", (e,)))
    rest = rank_bytes - 14 * e
    if rest:
        spec.append((("misc", "buffer"), "uint8", (rest,)))
    return spec


def small_spec(count: int, nbytes: int) -> list[tuple[tuple[str, ...], str, tuple[int, ...]]]:
    return [((f"t{i:05d}",), "float32", (nbytes // 4,)) for i in range(count)]


def build_state(spec: list, seed: int, fill: bool = True) -> dict[str, Any]:
    """Nested dict of numpy arrays for ``spec``, every page written (random bytes tiled from a 16
    MiB block: never the shared zero page, never compressible runs)."""
    import numpy as np

    block = np.random.default_rng(seed).integers(0, 256, CHUNK, dtype=np.uint8)
    out: dict[str, Any] = {}
    for path, dt, shape in spec:
        a = np.empty(shape, dtype=dt)
        if fill:
            flat = a.reshape(-1).view(np.uint8)
            for i in range(0, flat.nbytes, CHUNK):
                n = min(CHUNK, flat.nbytes - i)
                flat[i : i + n] = block[:n]
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = a
    return out


def iter_arrays(state: Any):
    if isinstance(state, dict):
        for v in state.values():
            yield from iter_arrays(v)
    elif hasattr(state, "nbytes") and hasattr(state, "dtype"):
        yield state


def to_torch(state: Any) -> Any:
    import torch

    if isinstance(state, dict):
        return {k: to_torch(v) for k, v in state.items()}
    return torch.from_numpy(state)


def empty_torch(spec: list) -> dict[str, Any]:
    import torch

    dt = {"float16": torch.float16, "float32": torch.float32, "uint8": torch.uint8}
    out: dict[str, Any] = {}
    for path, d, shape in spec:
        cur = out
        for k in path[:-1]:
            cur = cur.setdefault(k, {})
        cur[path[-1]] = torch.empty(shape, dtype=dt[d])
    return out


def in_threads(fns: list[Callable[[], Any]]) -> list[Any]:
    """Run ``fns`` in parallel threads (one each; inline when there is one); re-raise the first
    error."""
    if len(fns) == 1:
        return [fns[0]()]
    res: list[Any] = [None] * len(fns)
    errs: list[BaseException] = []

    def run(i: int) -> None:
        try:
            res[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]
    return res


# ============================================================================================
# children


def _specs(task: dict[str, Any]) -> list[list]:
    kind, ranks = CASES[task["case"]]
    if task["case"].startswith("small_"):
        return [small_spec(task["small_count"], task["small_bytes"])]
    return [state_spec(task["total_bytes"] // ranks) for _ in range(ranks)]


def _write_raw(fname: str, state: dict[str, Any]) -> None:
    fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        for a in iter_arrays(state):
            flat = memoryview(a.reshape(-1).view("uint8"))
            for i in range(0, flat.nbytes, CHUNK):
                _write_all(fd, flat[i : i + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    """write(2) until done (the same short-write loop as the package's)."""
    while view.nbytes:
        view = view[os.write(fd, view) :]


def _read_raw(fname: str) -> int:
    fd = os.open(fname, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        buf = bytearray(size)
        view = memoryview(buf)
        pos = 0
        while pos < size:
            n = os.preadv(fd, [view[pos : pos + CHUNK]], pos)
            if n == 0:
                raise OSError("short read")
            pos += n
        return pos
    finally:
        os.close(fd)


def _torch_save(fname: str, tstate: Any) -> None:
    import torch

    with open(fname, "wb") as f:
        torch.save(tstate, f)
        f.flush()
        os.fsync(f.fileno())


def child_save(task: dict[str, Any]) -> dict[str, Any]:
    case, path = task["case"], task["path"]
    kind, ranks = CASES[case]
    os.makedirs(path, exist_ok=True)
    if kind in (
        "dd",
        "ddr",
    ):  # dd_4/ddr_4: 4 dd processes in parallel, one file of total/4 bytes each
        nbytes = task["total_bytes"] // ranks
        src = "/dev/zero"
        if kind == "ddr":  # random bytes from RAM (tmpfs), written before the clock starts
            src = f"/dev/shm/tiered-ckpt-bench-{os.getpid()}"
            with open(src, "wb") as f:
                for off in range(0, nbytes, CHUNK):
                    f.write(os.urandom(min(CHUNK, nbytes - off)))
        cmds = [
            [
                "dd",
                f"if={src}",
                f"of={path}/dd_{r}",
                "bs=16M",
                "iflag=count_bytes",
                f"count={nbytes}",
                "conv=fsync",
                "status=none",
            ]
            for r in range(ranks)
        ]
        try:
            with C.CpuTimer() as t:
                procs = [subprocess.Popen(c) for c in cmds]
                if any(p.wait() != 0 for p in procs):
                    raise RuntimeError(f"dd failed: {[p.returncode for p in procs]}")
        finally:
            if src != "/dev/zero":
                os.unlink(src)
        return {**t.as_dict()}
    if kind == "ours_proc":
        return _save_multiprocess(task)
    specs = _specs(task)
    states = [build_state(s, seed=r) for r, s in enumerate(specs)]
    op: Callable[[], Any]
    if kind == "ours":
        import tiered_ckpt
        import tiered_ckpt.local.single_process_save  # noqa: F401 - imported before the timing, as DCP's

        op = lambda: tiered_ckpt.save_sharded(states, path, STEP)  # noqa: E731
    elif kind == "raw":
        op = lambda: in_threads(
            [
                lambda r=r: _write_raw(f"{path}/raw_{r}", states[r])  # noqa: E731
                for r in range(ranks)
            ]
        )
    elif kind == "torch":
        import torch  # noqa: F401

        tstates = [to_torch(s) for s in states]
        op = lambda: in_threads(
            [
                lambda r=r: _torch_save(f"{path}/rank_{r}.pt", tstates[r])  # noqa: E731
                for r in range(ranks)
            ]
        )
    elif kind == "mgr":
        from tiered_ckpt.training.manager import CheckpointManager

        mgr = CheckpointManager(path, async_save=False)  # built outside the timing, as tc's
        op = lambda: mgr.save(STEP, states[0])  # noqa: E731

    elif kind == "tc":
        tstate = to_torch(states[0])
        mgr = _tc_manager()
        op = lambda: mgr.save(f"{path}/tc", {"model": tstate})  # noqa: E731

    elif kind == "dcp":
        import torch.distributed.checkpoint as dcp

        tstates = [to_torch(s) for s in states]
        sd = tstates[0] if ranks == 1 else {f"rank{r}": s for r, s in enumerate(tstates)}
        op = lambda: dcp.save(
            sd,
            storage_writer=dcp.FileSystemWriter(path, thread_count=ranks),  # noqa: E731
            no_dist=True,
        )
    else:
        raise ValueError(kind)
    with C.PeakRss() as m, C.CpuTimer() as t:
        op()
    if kind in ("mgr", "tc"):
        mgr.close()
    return {**t.as_dict(), **m.as_dict(), "file_bytes": C.dir_bytes(path)}


def _save_multiprocess(task: dict[str, Any]) -> dict[str, Any]:
    """Coordinator: 4 fresh rank processes build their states and wait; the clock starts when they
    are told the save id and stops when commit_step has returned."""
    from tiered_ckpt.format.manifest import ShardRecord
    from tiered_ckpt.fs import new_save_id
    from tiered_ckpt.local.commit import commit_step

    ranks = CASES[task["case"]][1]
    procs = []
    try:
        for r in range(ranks):
            sub = {**task, "rank": r, "rank_bytes": task["total_bytes"] // ranks}
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--rank-worker", json.dumps(sub)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs:
            line = p.stdout.readline()
            if line.strip() != "READY":
                raise RuntimeError(f"rank worker failed to start: {line!r}")
        sid = new_save_id()
        with C.CpuTimer() as t:
            for p in procs:
                p.stdin.write(sid + "\n")
                p.stdin.flush()
            outs = []
            for p in procs:
                line = p.stdout.readline()
                if not line.startswith(C.RESULT_PREFIX):
                    raise RuntimeError(f"rank worker failed: {line!r}")
                outs.append(json.loads(line[len(C.RESULT_PREFIX) :]))
            recs = [ShardRecord.from_dict(o["record"]) for o in outs]
            commit_step(task["path"], STEP, ranks, recs, save_id=sid)
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    growths = [o["rss_growth"] for o in outs]
    return {
        "wall": t.wall,
        "cpu": sum(o["cpu"] for o in outs),
        "rss_growth": sum(growths),
        "rss_growth_per_rank": growths,
        "rss_before": sum(o["rss_before"] for o in outs),
        "hwm_reset": all(o["hwm_reset"] for o in outs),
        "file_bytes": C.dir_bytes(task["path"]),
    }


def rank_worker(task: dict[str, Any]) -> None:
    from tiered_ckpt.local.writer import write_shard

    state = build_state(state_spec(task["rank_bytes"]), seed=task["rank"])
    print("READY", flush=True)
    sid = sys.stdin.readline().strip()
    with C.PeakRss() as m, C.CpuTimer() as t:
        rec = write_shard(task["path"], STEP, task["rank"], state, save_id=sid)
    C.emit_result({"record": rec.to_dict(), **t.as_dict(), **m.as_dict()})


def child_load(task: dict[str, Any]) -> dict[str, Any]:
    """Warm load, then (if asked and permitted) drop the page cache and load cold."""
    import gc

    case, path = task["case"], task["path"]
    kind, ranks = CASES[case]
    specs = _specs(task)
    want = sum(int(_nbytes(s)) for s in specs)
    op: Callable[[], Any]
    check: Callable[[Any], int]
    if kind == "ours":
        import tiered_ckpt
        import tiered_ckpt.local.load_committed  # noqa: F401 - imported before the timing, as DCP's

        op = lambda: tiered_ckpt.load_sharded(path, ranks)  # noqa: E731
        check = lambda res: sum(a.nbytes for st in res for a in iter_arrays(st))  # noqa: E731
    elif kind == "mgr":
        from tiered_ckpt.training.manager import CheckpointManager

        mgr = CheckpointManager(path, async_save=False)  # built outside the timing, as tc's
        op = lambda: [mgr.load()]  # noqa: E731

        check = lambda res: sum(a.nbytes for st in res for a in iter_arrays(st))  # noqa: E731
    elif kind == "tc":
        mgr = _tc_manager()

        def op() -> Any:
            into = {"model": empty_torch(specs[0])}  # as DCP's: allocated inside the timing
            mgr.load(f"{path}/tc", into=into)
            return [into["model"]]

        check = lambda res: sum(t.nbytes for st in res for t in _iter_tensors(st))  # noqa: E731
    elif kind == "raw":
        op = lambda: in_threads([lambda r=r: _read_raw(f"{path}/raw_{r}") for r in range(ranks)])  # noqa: E731
        check = sum
    elif kind == "torch":
        import torch

        op = lambda: in_threads(
            [
                lambda r=r: torch.load(f"{path}/rank_{r}.pt", weights_only=True)  # noqa: E731
                for r in range(ranks)
            ]
        )
        check = lambda res: sum(t.nbytes for st in res for t in _iter_tensors(st))  # noqa: E731
    elif kind == "dcp":
        import torch.distributed.checkpoint as dcp

        def op() -> Any:
            sk = [
                empty_torch(s) for s in specs
            ]  # allocation is lazy: the pages fault in during load
            sd = sk[0] if ranks == 1 else {f"rank{r}": s for r, s in enumerate(sk)}
            dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
            return sk

        check = lambda res: sum(t.nbytes for st in res for t in _iter_tensors(st))  # noqa: E731
    else:
        raise ValueError(kind)
    out: dict[str, Any] = {}
    for phase in ("warm", "cold"):
        if phase == "cold":
            if not task["cold"] or not C.drop_caches():
                break
        with C.PeakRss() as m, C.CpuTimer() as t:
            res = op()
        got = check(res)
        if got != want:
            raise RuntimeError(f"{case} {phase} load returned {got} bytes, expected {want}")
        del res
        gc.collect()
        out[phase] = {**t.as_dict(), "rss_growth": m.growth}
    if kind in ("mgr", "tc"):
        mgr.close()
    return out


def _nbytes(spec: list) -> int:
    import numpy as np

    return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for _, dt, shape in spec)


def _iter_tensors(state: Any):
    if isinstance(state, dict):
        for v in state.values():
            yield from _iter_tensors(v)
    elif hasattr(state, "nbytes"):
        yield state


# ============================================================================================ main


def payload_bytes(case: str, args: argparse.Namespace) -> int:
    if case.startswith("small_"):
        return args.small_count * args.small_bytes
    return int(args.size_gib * C.GiB)


def run(args: argparse.Namespace) -> dict[str, Any]:
    cases = [c for c in (args.cases.split(",") if args.cases else CASES)]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; known: {', '.join(CASES)}")
    if "small_tc" in cases and (
        args.smoke or importlib.util.find_spec("torch_checkpointing") is None
    ):  # the smoke run (tests/bench) must not need it
        cases.remove("small_tc")
        print("small_tc skipped (--smoke, or torch_checkpointing not installed)", file=sys.stderr)
    work = Path(args.dir).absolute() / f"tiered_ckpt_bench_{os.getpid()}"
    work.mkdir(parents=True, exist_ok=False)
    cold = not args.warm_only
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    drop_ok = None
    t_start = time.time()
    sched = C.interleaved(cases, args.reps)
    loads = []
    try:
        for n, (rep, case) in enumerate(sched):
            path = str(work / case)
            task = {
                "case": case,
                "path": path,
                "total_bytes": payload_bytes(case, args),
                "small_count": args.small_count,
                "small_bytes": args.small_bytes,
                "cold": cold,
            }
            if cold:
                drop_ok = C.drop_caches()
                cold = drop_ok
                task["cold"] = cold
            la0 = os.getloadavg()[0]
            try:
                save = C.run_child([__file__, "--child-save", json.dumps(task)])
                load = (
                    None
                    if case in NO_LOAD
                    else C.run_child([__file__, "--child-load", json.dumps(task)])
                )
            finally:
                C.remove_path(path)
            loads.append(la0)
            results[case].append({"rep": rep, "save": save, "load": load, "loadavg": la0})
            print(
                f"[{time.time() - t_start:6.0f}s] {n + 1}/{len(sched)} rep {rep} {case:10s} save "
                f"{save['wall']:.3f}s"
                + (
                    f" load warm {load['warm']['wall']:.3f}s"
                    + (f" cold {load['cold']['wall']:.3f}s" if "cold" in load else "")
                    if load
                    else ""
                )
                + f"  (load avg {la0:.2f})",
                file=sys.stderr,
                flush=True,
            )
    finally:
        C.remove_path(work)
    return {
        "results": results,
        "drop_ok": bool(drop_ok),
        "cold": cold,
        "elapsed": time.time() - t_start,
        "loadavg_median": C.median(loads),
        "loadavg_max": max(loads) if loads else float("nan"),
    }


def report(args: argparse.Namespace, out: dict[str, Any]) -> tuple[str, bool]:
    res = out["results"]
    T = int(args.size_gib * C.GiB)
    lines = []
    lines.append(
        f"tiered_ckpt local tier benchmark: state {T / C.GiB:.2f} GiB, {args.reps} interleaved "
        f"repetitions, {args.small_count} x {args.small_bytes} B small tensors"
    )
    lines.append(f"dir: {args.dir} ({C.fs_note(args.dir)})")
    lines.append(
        f"machine: {C.machine_note()}; run took {out['elapsed']:.0f}s; load avg at trial start: "
        f"median {out['loadavg_median']:.2f}, max {out['loadavg_max']:.2f}"
    )
    if out["cold"]:
        lines.append(
            "page cache: DROPPED (sync; echo 3 > /proc/sys/vm/drop_caches) before every save and "
            "before every cold load; warm loads read files just written (still cached)"
        )
    else:
        lines.append(
            "page cache: WARM (dropping caches not permitted or --warm-only); saves start with "
            "whatever is cached, loads read files just written"
        )

    def thr(case: str, key: str = "save", phase: str | None = None) -> float:
        ts = times(case, key, phase)
        return C.ratio(payload_bytes(case, args), C.median(ts)) / C.GiB if ts else float("nan")

    def times(case: str, key: str = "save", phase: str | None = None) -> list[float]:
        out_ = []
        for r in res.get(case, []):
            v = r[key]
            if v is None:
                continue
            if phase is not None:
                v = v.get(phase)
                if v is None:
                    continue
            out_.append(v["wall"])
        return out_

    rows = []
    for case in res:
        ts = times(case)
        if not ts:
            continue
        lo, hi = C.spread(ts)
        rss = [r["save"].get("rss_growth") for r in res[case] if "rss_growth" in r["save"]]
        cpu = C.median(r["save"]["cpu"] for r in res[case])
        pb = payload_bytes(case, args)
        rows.append(
            [
                case,
                C.fmt_num(C.median(ts), ".3f"),
                C.fmt_num(lo, ".3f"),
                C.fmt_num(hi, ".3f"),
                C.fmt_num(thr(case), ".3f"),
                C.fmt_num(cpu, ".2f"),
                C.fmt_num(C.median(rss) / C.MiB if rss else None, ".1f"),
                C.fmt_num(max(rss) / C.MiB if rss else None, ".1f"),
                C.fmt_num(100 * max(rss) / pb if rss else None, ".2f"),
            ]
        )
    lines.append("")
    lines.append(
        "SAVE (wall seconds over repetitions; GiB/s = payload / median; cpu = user+sys of the "
        "saving process(es), median)"
    )
    lines.append(
        C.table(
            [
                "case",
                "median s",
                "min s",
                "max s",
                "GiB/s",
                "cpu s",
                "RSS+ med MiB",
                "RSS+ max MiB",
                "RSS+ max %",
            ],
            rows,
        )
    )

    rows = []
    for case in res:
        if case in NO_LOAD or not times(case, "load", "warm"):
            continue
        w, c = times(case, "load", "warm"), times(case, "load", "cold")
        rows.append(
            [
                case,
                C.fmt_num(C.median(w), ".3f"),
                C.fmt_num(thr(case, "load", "warm"), ".3f"),
                C.fmt_num(C.median(c), ".3f") if c else "-",
                C.fmt_num(thr(case, "load", "cold"), ".3f") if c else "-",
            ]
        )
    lines.append("")
    lines.append(
        "LOAD (ours: every shard read whole and sha256-verified; raw: read into one buffer, no "
        "hash; torch.load weights_only; DCP into preallocated tensors)"
    )
    lines.append(C.table(["case", "warm med s", "warm GiB/s", "cold med s", "cold GiB/s"], rows))

    # --- ratios and floors
    lines.append("")
    lines.append("RATIOS (throughput of ours / other, medians; > 1 means ours is faster)")
    rrows = []
    checks: list[tuple[str, bool]] = []
    raw1 = [c for c in ("dd", "ddr", "raw_1") if c in res]
    raw4 = [c for c in ("dd", "dd_4", "ddr", "ddr_4", "raw_1", "raw_4t") if c in res]
    for ours, raws, dcp_case in (
        ("ours_1", raw1, "dcp_1"),
        ("ours_4t", raw4, "dcp_4"),
        ("ours_4p", raw4, "dcp_4"),
        ("small_ours", [], "small_dcp"),
    ):
        if ours not in res:
            continue
        fast = max(raws, key=lambda c: thr(c)) if raws else None
        r_raw = C.ratio(thr(ours), thr(fast)) if fast else float("nan")
        r_dcp = C.ratio(thr(ours), thr(dcp_case)) if dcp_case in res else float("nan")
        tc = (
            "torch_1"
            if ours == "ours_1"
            else ("torch_4t" if ours in ("ours_4t", "ours_4p") else None)
        )
        r_torch = C.ratio(thr(ours), thr(tc)) if tc in res else float("nan")
        rrows.append(
            [
                f"save {ours}",
                f"{fast or '-'}",
                C.fmt_num(r_raw, ".3f"),
                C.fmt_num(r_torch, ".3f"),
                C.fmt_num(r_dcp, ".3f"),
            ]
        )
        if fast:
            checks.append(C.floor_check(f"save {ours} / faster raw write ({fast})", r_raw, 0.8))
        if dcp_case in res:
            checks.append(C.floor_check(f"save {ours} / DCP ({dcp_case})", r_dcp, 1.0))
    for ours, rawc, tc, dc in (
        ("ours_1", "raw_1", "torch_1", "dcp_1"),
        ("ours_4t", "raw_4t", "torch_4t", "dcp_4"),
        ("small_ours", None, None, "small_dcp"),
    ):
        if ours not in res or not times(ours, "load", "warm"):
            continue
        for phase in ("warm", "cold"):
            if not times(ours, "load", phase):
                continue
            me = thr(ours, "load", phase)
            f = lambda c: C.fmt_num(C.ratio(me, thr(c, "load", phase)), ".3f") if c in res else "-"  # noqa: E731
            rrows.append([f"load {ours} ({phase})", rawc or "-", f(rawc), f(tc), f(dc)])
    lines.append(
        C.table(["what", "raw ref", "ours/raw", "ours/torch.save|load", "ours/DCP"], rrows)
    )

    for ours in ("ours_1", "ours_4t", "ours_4p"):
        if ours not in res:
            continue
        rss = [r["save"]["rss_growth"] for r in res[ours]]
        frac = max(rss) / payload_bytes(ours, args)
        checks.append(
            C.floor_check(
                f"peak RSS growth during save {ours} / state (max over reps, "
                f"{max(rss) / C.MiB:.1f} MiB)",
                frac,
                0.10,
                higher_is_better=False,
            )
        )
    frows, fchecks = floor_rows(args, res, times)
    if frows:
        lines.append("")
        lines.append("FLOOR ROWS (medians; ratio = baseline time / ours, > 1 means ours is faster)")
        lines.append(
            C.table(
                ["row", "ours s", "baseline", "baseline s", "ratio", "floor", ""],
                frows,
                align="lrlrrrl",
            )
        )
        checks += fchecks
    resets = [r["save"].get("hwm_reset") for c in res for r in res[c] if "hwm_reset" in r["save"]]
    lines.append("")
    lines.append(
        "FLOORS"
        + (
            ""
            if all(resets)
            else "  (VmHWM reset unsupported: RSS growth measured from the post-build baseline)"
        )
    )
    lines.extend(line for line, _ in checks)
    ok = all(o for _, o in checks)
    lines.append(f"overall: {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines), ok


def floor_rows(
    args: argparse.Namespace, res: dict[str, Any], times: Callable[..., list[float]]
) -> tuple[list[list[str]], list[tuple[str, bool]]]:
    """The floor rows: (ours, baseline, floor) as table rows and floor checks. A time is the median
    wall time of a case's save, or of its warm or cold load; a ``+`` sums two medians (save +
    load)."""

    def med(spec: str) -> float:
        total = 0.0
        for part in spec.split("+"):
            case, _, phase = part.partition(":")
            ts = times(case) if not phase else times(case, "load", phase)
            if not ts:
                return float("nan")
            total += C.median(ts)
        return total

    specs = [  # label, ours, baseline, baseline label, floor
        ("load 1 rank, verified, cold cache", "ours_1:cold", "dcp_1:cold", "dcp.load", 1.0),
        (
            "load 4 ranks, verified, cold cache",
            "ours_4t:cold",
            "dcp_1:cold",
            "dcp.load (same state)",
            1.0,
        ),
        ("save 4 ranks (processes)", "ours_4p", "dd_4", "4 x dd conv=fsync, zeros", 0.9),
        ("save 4 ranks (threads)", "ours_4t", "dd_4", "4 x dd conv=fsync, zeros", 0.9),
        ("save 1 rank", "ours_1", "dd", "dd conv=fsync, zeros", 1.0),
        ("save 4 ranks (processes)", "ours_4p", "ddr_4", "4 x dd conv=fsync, random bytes", 0.9),
        ("save 4 ranks (threads)", "ours_4t", "ddr_4", "4 x dd conv=fsync, random bytes", 0.9),
        ("save 1 rank", "ours_1", "ddr", "dd conv=fsync, random bytes", 1.0),
        (
            f"{args.small_count} x {args.small_bytes} B save + load",
            "small_ours+small_ours:warm",
            "small_dcp+small_dcp:warm",
            "DCP save + load",
            15.0,
        ),
        (
            f"{args.small_count} x {args.small_bytes} B save + load",
            "small_ours+small_ours:warm",
            "small_tc+small_tc:warm",
            "torch_checkpointing save + load",
            2.0,
        ),
        (
            f"{args.small_count} x {args.small_bytes} B, manager save + load",
            "small_mgr+small_mgr:warm",
            "small_dcp+small_dcp:warm",
            "DCP save + load",
            15.0,
        ),
        (
            f"{args.small_count} x {args.small_bytes} B, manager save + load",
            "small_mgr+small_mgr:warm",
            "small_tc+small_tc:warm",
            "torch_checkpointing save + load",
            2.0,
        ),
    ]
    rows, checks = [], []
    for label, ours, base, base_label, floor in specs:
        if (
            ours.split(":")[0].split("+")[0] not in res
            or base.split(":")[0].split("+")[0] not in res
        ):
            continue
        a, b = med(ours), med(base)
        if a != a or b != b:  # NaN: a cold load was not possible
            continue
        r = C.ratio(b, a)
        line, ok = C.floor_check(f"{label}: {base_label} / ours", r, floor)
        checks.append((line, ok))
        rows.append(
            [
                label,
                C.fmt_num(a, ".3f"),
                base_label,
                C.fmt_num(b, ".3f"),
                C.fmt_num(r, ".2f") + "x",
                f">= {floor:g}x",
                "PASS" if ok else "FAIL",
            ]
        )
    return rows, checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-gib", type=float, default=2.0, help="state size in GiB (default 2)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (default 5)")
    p.add_argument(
        "--dir", default="/tmp", help="directory (filesystem) to benchmark (default /tmp)"
    )
    p.add_argument("--cases", default="", help=f"comma-separated subset of: {', '.join(CASES)}")
    p.add_argument(
        "--floor-rows", action="store_true", help=f"only the floor rows' cases ({FLOOR_CASES})"
    )
    p.add_argument("--small", action="store_true", help=f"only the small-tensor cases ({SMALL})")
    p.add_argument("--small-count", type=int, default=10_000)
    p.add_argument("--small-bytes", type=int, default=4096)
    p.add_argument("--warm-only", action="store_true", help="never drop the page cache")
    p.add_argument("--json", help="also write raw results to this file")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run that only checks the script works (tests/bench): 4 MiB, 1 rep, 10 small "
        "tensors of 64 bytes, warm cache; floors reported, not enforced",
    )
    p.add_argument("--child-save", help=argparse.SUPPRESS)
    p.add_argument("--child-load", help=argparse.SUPPRESS)
    p.add_argument("--rank-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.size_gib, args.reps, args.small_count, args.small_bytes, args.warm_only = (
            4 / 1024,
            1,
            10,
            64,
            True,
        )
    if args.child_save:
        C.emit_result(child_save(json.loads(args.child_save)))
        return 0
    if args.child_load:
        C.emit_result(child_load(json.loads(args.child_load)))
        return 0
    if args.rank_worker:
        rank_worker(json.loads(args.rank_worker))
        return 0
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.floor_rows and not args.cases:
        args.cases = FLOOR_CASES
    if args.small and not args.cases:
        args.cases = SMALL
    out = run(args)
    text, ok = report(args, out)
    print(text)
    if args.smoke:
        print(
            "(--smoke: 4 MiB, warm cache, one repetition: the figures mean nothing; floors not enforced)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **out}, f, indent=1)
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
