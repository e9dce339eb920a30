#!/usr/bin/env python3
"""Benchmark of the cold load of a large state, in the two disk conditions a restart meets: right
after the save that wrote it, and with the disk idle. Ours against ``dcp.load`` and Meta's
torch_checkpointing, at 1 and 4 ranks, interleaved repetitions.

    python bench/cold_load.py                         # 2 GiB, 1 and 4 ranks, 3 reps, under /tmp
    python bench/cold_load.py --ranks 1 --reps 5 --cases ours,dcp
    python bench/cold_load.py --smoke --dir /tmp/x    # 4 MiB, 1 rank, ours + ours_prev, once

A trial is one library at one rank count:

1. ``ranks`` fresh saver processes (each builds its own ``size / ranks`` share of the state, the
   float32/float16 arrays of ``local_save.py``'s state) and ``ranks`` fresh loader processes (torch
   and the library imported) are started and wait until told to go;
2. the savers save (the library's own save of the same state), then immediately ``sync`` + drop the
   page cache and the loaders load: condition **after save**;
3. new loaders start; ``sync``, wait until the kernel has no dirty or writeback pages left, sleep
   ``--idle-s`` seconds (default 10: the host under the VM's disk gets to finish its writeback too),
   drop the page cache, sleep 1 s, load: condition **idle**.

The time of a load is from "go" to the last rank done (each rank loads its own shard in its own
process, as restarted ranks do). What each case runs:

  ours       1 rank: ``load_sharded(root, 1)``; n ranks: rank r ``load_shard(root, r, n)`` (what
             ``CheckpointManager.load`` calls), sha256 of every shard byte checked. Saved with
             ``save_sharded`` (1 rank) or ``write_shard`` per rank process + ``commit_step``.
  ours_prev  the same files and calls, with the shard reader of before (4 threads of 16 MiB
             buffered ``preadv`` into ``np.empty``; now a file mostly not in the page cache is
             read through O_DIRECT into a page-aligned buffer): a before/after in one run.
  dcp        ``dcp.load(FileSystemReader(dir_r), no_dist=True)`` into tensors allocated inside the
             timing; saved with ``dcp.save(FileSystemWriter(dir_r), no_dist=True)`` (one directory
             per rank: DCP has no process group here).
  tc         torch_checkpointing 0.1.1 ``CheckpointManager.load(id, into=...)`` into tensors
             allocated inside the timing; saved with its sync saver and
             ``LocalFileSystemStorageConfig(use_direct_io=False)`` (buffered writes: its default
             O_DIRECT writer fails with EINVAL at close on this filesystem); its loads use its
             default configuration (O_DIRECT reads where the filesystem takes them, else buffered).

No floor is enforced (the exit code is 0 whenever every case ran); the report prints ours / each
baseline per condition and rank count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as C  # bench/ is sys.path[0] when a script of it runs

STEP = 1
CASES = ("ours", "ours_prev", "dcp", "tc")
CONDITIONS = ("after_save", "idle")


def _state_tools() -> Any:
    import local_save  # the same state (layers, ZeRO partitions, random bytes) as local_save.py

    return local_save


# ============================================================================= children (ranks)


def _wait_go(proc_kind: str) -> str:
    print("READY", flush=True)
    line = sys.stdin.readline().strip()
    if not line:
        raise SystemExit(f"{proc_kind}: no go")
    return line


def child_save(task: dict[str, Any]) -> None:
    """One rank's save: build the state, report READY, save on the go line (the save id for ours
    at several ranks)."""
    L = _state_tools()
    case, r, n, path = task["case"], task["rank"], task["ranks"], task["path"]
    spec = L.state_spec(task["total_bytes"] // n)
    state = L.build_state(spec, seed=r)
    if case in ("ours", "ours_prev"):
        import tiered_ckpt
        from tiered_ckpt.local.writer import write_shard

        sid = _wait_go("saver")
        with C.CpuTimer() as t:
            if n == 1:
                tiered_ckpt.save_sharded([state], path, STEP)
                rec = None
            else:
                rec = write_shard(path, STEP, r, state, save_id=sid).to_dict()
        C.emit_result({"record": rec, **t.as_dict()})
        return
    tstate = L.to_torch(state)
    if case == "dcp":
        import torch.distributed.checkpoint as dcp

        _wait_go("saver")
        with C.CpuTimer() as t:
            dcp.save(tstate, storage_writer=dcp.FileSystemWriter(f"{path}/rank_{r}"), no_dist=True)
    elif case == "tc":
        mgr = _tc_manager(buffered=True)
        _wait_go("saver")
        with C.CpuTimer() as t:
            mgr.save(f"{path}/tc_{r}", {"model": tstate})
        mgr.close()
    else:
        raise ValueError(case)
    C.emit_result(t.as_dict())


def _tc_manager(buffered: bool) -> Any:
    from torch_checkpointing.checkpoint_manager import CheckpointManager as TcManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    cfg = TcManager.Config.with_sync_save()
    if buffered:
        cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return TcManager(cfg)


def _prev_reader() -> None:
    """Put the shard reader of before back in place: 4 threads of 16 MiB buffered ``preadv`` into
    ``np.empty`` (numpy's huge-page advice included), whatever the page cache holds."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from tiered_ckpt.fs import advise_sequential
    from tiered_ckpt.local import load_committed, shard_io

    def read_block(fd, view, start, end, size, where):
        pos = start
        while pos < end:
            n = os.preadv(fd, [view[pos:end]], pos)
            if n == 0:
                raise RuntimeError(f"{where}: file ended after {pos} of {size} bytes")
            pos += n

    def read_verified(fd, size, hashers, where, *, read_bytes=16 << 20, readers=4):
        buf = np.empty(size, dtype=np.uint8)
        view = memoryview(buf)
        advise_sequential(fd, 0, size)
        blocks = [(p, min(p + read_bytes, size)) for p in range(0, size, read_bytes)]
        with ThreadPoolExecutor(max_workers=min(readers, max(len(blocks), 1))) as pool:
            futs = [pool.submit(read_block, fd, view, a, b, size, where) for a, b in blocks]
            for (a, b), f in zip(blocks, futs):
                f.result()
                shard_io._update_all(hashers, [view[a:b]])
        return buf

    load_committed.read_verified = read_verified


def child_load(task: dict[str, Any]) -> None:
    """One rank's load, on the go line; reports wall-clock start/end and the bytes loaded."""
    import gc

    L = _state_tools()
    case, r, n, path = task["case"], task["rank"], task["ranks"], task["path"]
    spec = L.state_spec(task["total_bytes"] // n)
    want = sum(int(L._nbytes(s)) for s in [spec])
    if case in ("ours", "ours_prev"):
        import tiered_ckpt
        import tiered_ckpt.local.load_committed  # noqa: F401 - imported before the timing

        if case == "ours_prev":
            _prev_reader()

        def op() -> int:
            if n == 1:
                st = tiered_ckpt.load_sharded(path, 1)[0]
            else:
                st = tiered_ckpt.load_shard(path, r, n)
            return sum(a.nbytes for a in L.iter_arrays(st))

    elif case == "dcp":
        import torch.distributed.checkpoint as dcp

        def op() -> int:
            sd = L.empty_torch(spec)
            dcp.load(sd, storage_reader=dcp.FileSystemReader(f"{path}/rank_{r}"), no_dist=True)
            return sum(t.nbytes for t in L._iter_tensors(sd))

    elif case == "tc":
        mgr = _tc_manager(buffered=False)

        def op() -> int:
            into = {"model": L.empty_torch(spec)}
            mgr.load(f"{path}/tc_{r}", into=into)
            return sum(t.nbytes for t in L._iter_tensors(into["model"]))

    else:
        raise ValueError(case)
    gc.collect()
    _wait_go("loader")
    t0 = time.time()
    with C.CpuTimer() as t:
        got = op()
    t1 = time.time()
    if got != want:
        raise RuntimeError(f"{case} rank {r} loaded {got} bytes, expected {want}")
    C.emit_result({"start": t0, "end": t1, **t.as_dict()})


# ============================================================================= orchestrator


class Ranks:
    """``n`` fresh child processes of one role, started at once, each waiting for its go line."""

    def __init__(self, role: str, task: dict[str, Any], n: int) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, f"--child-{role}", json.dumps({**task, "rank": r})],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            for r in range(n)
        ]
        for p in self.procs:
            line = p.stdout.readline()
            if line.strip() != "READY":
                self.kill()
                raise RuntimeError(
                    f"{role} child failed to start: {line!r} {p.stderr.read()[-2000:]}"
                )

    def go(self, line: str = "go") -> list[dict[str, Any]]:
        for p in self.procs:
            p.stdin.write(line + "\n")
            p.stdin.flush()
        outs = []
        for p in self.procs:
            out, err = p.communicate(timeout=900)
            res = [x for x in out.splitlines() if x.startswith(C.RESULT_PREFIX)]
            if p.returncode != 0 or not res:
                raise RuntimeError(f"child exited {p.returncode}: {err[-3000:]}")
            outs.append(json.loads(res[-1][len(C.RESULT_PREFIX) :]))
        return outs

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def meminfo_dirty() -> int:
    """Dirty + Writeback bytes of /proc/meminfo."""
    out = 0
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("Dirty", "Writeback"):
                out += int(v.split()[0]) * 1024
    return out


def wait_idle(idle_s: float) -> float:
    """``sync``, wait (at most 60 s) until Dirty + Writeback is under 4 MiB, sleep ``idle_s``.
    Returns the seconds waited for the writeback."""
    t0 = time.perf_counter()
    os.sync()
    while meminfo_dirty() > 4 * C.MiB and time.perf_counter() - t0 < 60:
        time.sleep(0.2)
    waited = time.perf_counter() - t0
    time.sleep(idle_s)
    return waited


def others() -> list[str]:
    """Command names of the other processes using CPU now (sampled over 0.5 s from /proc)."""

    def ticks() -> dict[int, tuple[str, int]]:
        out = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    s = f.read()
                name = s[s.index("(") + 1 : s.rindex(")")]
                fields = s[s.rindex(")") + 2 :].split()
                out[int(d)] = (name, int(fields[11]) + int(fields[12]))
            except (OSError, ValueError, IndexError):
                pass
        return out

    a = ticks()
    time.sleep(0.5)
    b = ticks()
    busy = []
    for pid, (name, t) in b.items():
        if pid in a and t - a[pid][1] >= 5 and pid != os.getpid():  # >= 10 % of a core
            busy.append(f"{name}:{(t - a[pid][1]) * 2}%")
    return sorted(busy)


def trial(args: argparse.Namespace, case: str, n: int, base: Path) -> dict[str, Any]:
    path = base / f"{case}_{n}"
    C.remove_path(path)
    path.mkdir(parents=True)
    task = {"case": case, "ranks": n, "path": str(path), "total_bytes": args.total_bytes}
    out: dict[str, Any] = {"loadavg": os.getloadavg()[0], "others": [] if args.smoke else others()}
    savers = Ranks("save", task, n)
    loaders = Ranks("load", task, n)
    try:
        sid = "go"
        if case in ("ours", "ours_prev") and n > 1:
            from tiered_ckpt.fs import new_save_id

            sid = new_save_id()
        t0 = time.perf_counter()
        saved = savers.go(sid)
        if case in ("ours", "ours_prev") and n > 1:
            from tiered_ckpt.format.manifest import ShardRecord
            from tiered_ckpt.local.commit import commit_step

            recs = [ShardRecord.from_dict(s["record"]) for s in saved]
            commit_step(str(path), STEP, n, recs, save_id=sid)
        out["save"] = time.perf_counter() - t0
        # condition (a): right after the save
        out["dropped"] = C.drop_caches()
        t_go = time.time()
        res = loaders.go()
        out["after_save"] = max(x["end"] for x in res) - t_go
        out["after_save_cpu"] = sum(x["cpu"] for x in res)
        # condition (b): the disk idle
        loaders = Ranks("load", task, n)
        out["writeback_wait"] = wait_idle(args.idle_s)
        C.drop_caches()
        time.sleep(0 if args.smoke else 1)
        t_go = time.time()
        res = loaders.go()
        out["idle"] = max(x["end"] for x in res) - t_go
        out["idle_cpu"] = sum(x["cpu"] for x in res)
    finally:
        savers.kill()
        loaders.kill()
        C.remove_path(path)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-gib", type=float, default=2.0, help="state size in GiB (default 2)")
    p.add_argument("--ranks", default="1,4", help="rank counts (default 1,4)")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    p.add_argument("--cases", default=",".join(CASES), help=f"subset of {','.join(CASES)}")
    p.add_argument("--idle-s", type=float, default=10.0, help="idle wait before (b) (default 10)")
    p.add_argument("--dir", default="/tmp", help="directory (filesystem) to use (default /tmp)")
    p.add_argument("--json", help="also write raw results here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="4 MiB, 1 rep, no idle wait, 1 rank, ours and ours_prev only: checks the script works",
    )
    p.add_argument("--child-save", help=argparse.SUPPRESS)
    p.add_argument("--child-load", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_save:
        child_save(json.loads(args.child_save))
        return 0
    if args.child_load:
        child_load(json.loads(args.child_load))
        return 0
    if args.smoke:  # no torch in the children: the fast tier of tests/bench runs it
        args.size_gib, args.reps, args.idle_s = 4 / 1024, 1, 0.0
        args.ranks, args.cases = "1", "ours,ours_prev"
    args.total_bytes = int(args.size_gib * C.GiB)
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            p.error(f"unknown case {c!r}")
    if "tc" in cases:
        import importlib.util

        if importlib.util.find_spec("torch_checkpointing") is None:
            print("tc skipped: torch_checkpointing not installed", file=sys.stderr)
            cases.remove("tc")
    ranks = [int(x) for x in args.ranks.split(",")]
    base = Path(args.dir) / f"tiered-ckpt-cold-load-{os.getpid()}"
    keys = [f"{c}@{n}" for n in ranks for c in cases]
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
    t_run = time.perf_counter()
    la_start = os.getloadavg()
    try:
        for rep, key in C.interleaved(keys, args.reps):
            c, n = key.split("@")
            r = C.retry(lambda c=c, n=n: trial(args, c, int(n), base), tries=2)
            results[key].append(r)
            print(
                f"rep {rep} {key:14s} save {r['save']:.2f}s  after_save {r['after_save']:.3f}s  "
                f"idle {r['idle']:.3f}s  (load avg {r['loadavg']:.2f}; busy: "
                f"{' '.join(r['others']) or '-'})",
                file=sys.stderr,
                flush=True,
            )
    finally:
        C.remove_path(base)
    text = report(args, cases, ranks, results, time.perf_counter() - t_run, la_start)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


def report(
    args: argparse.Namespace,
    cases: list[str],
    ranks: list[int],
    results: dict[str, list[dict[str, Any]]],
    elapsed: float,
    la_start: tuple[float, float, float],
) -> str:
    las = [r["loadavg"] for rs in results.values() for r in rs]
    busy = sorted({o.split(":")[0] for rs in results.values() for r in rs for o in r["others"]})
    dropped = all(r["dropped"] for rs in results.values() for r in rs)
    lines = [
        f"cold load benchmark: state {args.size_gib:.2f} GiB, {args.reps} interleaved repetitions, "
        f"idle wait {args.idle_s:g} s",
        f"dir: {args.dir} ({C.fs_note(args.dir)})",
        f"machine: {C.machine_note()}; run took {elapsed:.0f}s; load avg at start "
        f"{la_start[0]:.2f}, at trial start: median {C.median(las):.2f}, max {max(las):.2f}",
        f"other processes busy (>= 10% of a core) at trial starts: {', '.join(busy) or 'none'}",
        "page cache: "
        + ("DROPPED (sync; echo 3 > /proc/sys/vm/drop_caches)" if dropped else "NOT dropped")
        + " before every load",
        "",
    ]
    rows = []
    for n in ranks:
        for c in cases:
            rs = results[f"{c}@{n}"]
            row = [f"{c}, {n} rank{'s' if n > 1 else ''}"]
            for cond in ("save", *CONDITIONS):
                xs = [r[cond] for r in rs]
                lo, hi = C.spread(xs)
                row.append(f"{C.fmt_num(C.median(xs), '.3f')} ({lo:.2f}-{hi:.2f})")
            rows.append(row)
    lines.append("wall seconds, median (min-max)")
    lines.append(C.table(["case", "save", "load after save", "load, disk idle"], rows))
    lines.append("")
    rrows = []
    for n in ranks:
        if "ours" not in cases:
            break
        for base in [c for c in cases if c != "ours"]:
            row = [f"{n} rank{'s' if n > 1 else ''}: {base} / ours"]
            for cond in CONDITIONS:
                me = C.median(r[cond] for r in results[f"ours@{n}"])
                other = C.median(r[cond] for r in results[f"{base}@{n}"])
                row.append(C.fmt_num(C.ratio(other, me), ".2f") + "x")
            rrows.append(row)
    if rrows:
        lines.append("ratio = baseline median / ours (> 1: ours faster)")
        lines.append(C.table(["ratio", "after save", "disk idle"], rrows))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
