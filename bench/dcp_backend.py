#!/usr/bin/env python3
"""Benchmark of the torch.distributed.checkpoint backend: the same FSDP2 state saved and
loaded through our ``TieredStorageWriter``/``TieredStorageReader`` and through DCP's own
``FileSystemWriter(sync_files=True)``/``FileSystemReader``, by 4 gloo ranks on CPU, interleaved
repetitions.

    python bench/dcp_backend.py                       # ~1.2 GiB of state (params + 2 AdamW moments), 3 reps
    python bench/dcp_backend.py --layers 2 --dim 1024 --reps 1 --ranks 2    # a smaller run
    python bench/dcp_backend.py --smoke               # 2 ranks, 2 x Linear(256, 256), once: checks it works

Each repetition runs, for each backend in turn (the order alternates between repetitions), one group
of ``--ranks`` fresh processes (``torch.distributed`` gloo, ``fully_shard`` per layer and at the
root, one AdamW step so both moments exist, ``get_state_dict``) that times, between barriers, on
rank 0:

  save        ``dcp.save`` of step 1 (ours: the local tier's commit included: shards fsynced,
              manifest last)
  async       ``dcp.async_save`` (thread mode, a dedicated gloo group) of step 2: the time the
              caller is blocked (staging), then the wait for its completion (not part of the
              ratio); then the same for step 3 with the same stager (its buffers reused): ours a
              ``TieredStager`` given to the writer, DCP's a ``DefaultStager`` given as
              ``async_stager`` (what ``dcp.async_save`` makes when given none)
  load        ``dcp.load`` of step 1 into the state dict (ours: CRC32C of every chunk verified),
              page cache dropped before it where permitted (root), so the load is cold

CPU seconds (``time.process_time``: every thread of a rank, summed over the ranks) are reported
per phase. Case ``ours_dcpstager`` is ours staged by DCP's ``DefaultStager`` (one thread, as
before the writer had its own stager): the async rows' before/after in one run.

Floors: save throughput >= 1.3 x DCP's, async-save blocking time <= 0.5 x DCP's own async
save, load >= 1.5 x DCP's. Case ``ours_buffered`` is ours with the reader's O_DIRECT path off (cold
shards read through the page cache, as before that path existed): a before/after of the load. Ratios are ours/DCP throughput (higher is better), and DCP/ours for the
blocking time, so > 1 is always ours better.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as C  # bench/ is sys.path[0] when a script of it runs

#: ``ours_buffered``: ours with the reader's O_DIRECT path off (shards read through the page cache,
#: as before it existed): the load's before/after in one run.
#: ``ours_dcpstager``: ours staged by DCP's ``DefaultStager`` (one thread, as before the writer
#: had its own stager): the async rows' before/after in one run.
CASES = ("ours", "ours_buffered", "ours_dcpstager", "dcp")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- worker


def _state(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """Every rank: the FSDP2 model, its AdamW after one step, and the DCP state dict of both."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)]
    )
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, args.dim)).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    return model, opt, {"model": model_sd, "optim": optim_sd}


def _state_bytes(sd: Any) -> int:
    import torch
    from torch.distributed.tensor import DTensor

    total = 0

    def walk(v: Any) -> None:
        nonlocal total
        if isinstance(v, DTensor):
            total += v.to_local().numel() * v.element_size()
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(sd)
    return total


def _stager(case: str) -> Any:
    """The stager one rank keeps for its async saves: ours (``TieredStager``, given to the
    writer) or DCP's ``DefaultStager`` (what ``dcp.async_save`` makes when given none)."""
    if case in ("ours", "ours_buffered"):
        from tiered_ckpt.dcp.staging import TieredStager

        return TieredStager()
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(False, False, False, False))


def _backend(
    case: str, root: Path, step: int, *, reader: bool, stager: Any = None
) -> dict[str, Any]:
    """The ``storage_writer``/``storage_reader`` and ``planner`` keyword arguments of one
    backend (and DCP's ``async_stager`` where the stager is DCP's)."""
    import torch.distributed.checkpoint as dcp

    if case.startswith("ours"):
        from tiered_ckpt.dcp import (
            TieredLoadPlanner,
            TieredSavePlanner,
            TieredStorageReader,
            TieredStorageWriter,
        )

        if reader:
            return {
                "storage_reader": TieredStorageReader(root, step),
                "planner": TieredLoadPlanner(),
            }
        if case == "ours_dcpstager" and stager is not None:
            return {
                "storage_writer": TieredStorageWriter(root, step),
                "planner": TieredSavePlanner(),
                "async_stager": stager,
            }
        return {
            "storage_writer": TieredStorageWriter(root, step, stager=stager),
            "planner": TieredSavePlanner(),
        }
    path = root / f"dcp_step_{step}"
    if reader:
        return {"storage_reader": dcp.FileSystemReader(path)}
    kw: dict[str, Any] = {"storage_writer": dcp.FileSystemWriter(path, sync_files=True)}
    if stager is not None:
        kw["async_stager"] = stager
    return kw


def worker(args: argparse.Namespace) -> None:
    """One rank of one backend's group (env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if args.case == "ours_buffered":
        from tiered_ckpt.dcp import storage_reader
        from tiered_ckpt.local.verified_read import ShardReader

        class BufferedShardReader(ShardReader):
            def __init__(self, *a: Any, direct: bool = False, **kw: Any) -> None:
                super().__init__(*a, **kw)

        storage_reader.ShardReader = BufferedShardReader  # type: ignore[misc]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    async_pg = dist.new_group(backend="gloo")
    root = Path(args.dir)
    _, _, sd = _state(args)
    local = _state_bytes(sd)
    sizes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, local)
    out: dict[str, Any] = {"state_bytes": sum(sizes)}

    kw = _backend(args.case, root, 1, reader=False)  # imports done before the clock starts
    cpu: dict[str, float] = {}  # this rank's CPU seconds (every thread) per phase
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    dcp.save(sd, **kw)
    cpu["save_cpu_s"] = time.process_time() - c0
    dist.barrier()
    out["save_s"] = time.perf_counter() - t0

    stager = _stager(args.case)  # kept for both async saves: the second reuses its buffers
    for step, key in ((2, "async"), (3, "async_again")):
        kw = _backend(args.case, root, step, reader=False, stager=stager)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fut = dcp.async_save(sd, process_group=async_pg, **kw)
        out[f"{key}_block_s"] = time.perf_counter() - t0
        cpu[f"{key}_block_cpu_s"] = time.process_time() - c0
        fut.result()
        dist.barrier()
        out[f"{key}_total_s"] = time.perf_counter() - t0
    stager.close()

    if rank == 0:
        out["cold"] = C.drop_caches()
    kw = _backend(args.case, root, 1, reader=True)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    dcp.load(sd, **kw)
    cpu["load_cpu_s"] = time.process_time() - c0
    dist.barrier()
    out["load_s"] = time.perf_counter() - t0
    cpus: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(cpus, cpu)
    for k in cpu:  # summed over the ranks
        out[k] = sum(c[k] for c in cpus)
    if rank == 0:
        out["disk_bytes"] = C.dir_bytes(root)
        C.emit_result(out)
    dist.destroy_process_group()


# --- parent


def run_group(args: argparse.Namespace, case: str, base: Path) -> dict[str, Any]:
    """Start ``--ranks`` worker processes of ``case`` on a fresh directory; rank 0's timings."""
    work = Path(tempfile.mkdtemp(prefix=f"dcp_{case}_", dir=base))
    port = _free_port()
    procs = []
    argv = [
        sys.executable,
        __file__,
        "--worker",
        "--case",
        case,
        "--dir",
        str(work),
        "--layers",
        str(args.layers),
        "--dim",
        str(args.dim),
    ]
    try:
        for r in range(args.ranks):
            env = {
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(args.ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PYTHONWARNINGS": "ignore",
                "OMP_NUM_THREADS": "1",
            }
            procs.append(
                subprocess.Popen(
                    argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        outs = [p.communicate(timeout=1800) for p in procs]
        for p, (_, err) in zip(procs, outs):
            if p.returncode != 0:
                raise RuntimeError(f"{case} rank exited {p.returncode}:\n{err[-3000:]}")
        for line in reversed(outs[0][0].splitlines()):
            if line.startswith(C.RESULT_PREFIX):
                return json.loads(line[len(C.RESULT_PREFIX) :])
        raise RuntimeError(f"{case}: rank 0 printed no result:\n{outs[0][1][-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        C.remove_path(work)


def report(args: argparse.Namespace, res: dict[str, list[dict[str, Any]]]) -> tuple[str, bool]:
    med = {
        c: {
            k: C.median(r[k] for r in res[c])
            for k in (
                "save_s",
                "async_block_s",
                "async_total_s",
                "async_again_block_s",
                "async_again_total_s",
                "load_s",
            )
        }
        for c in CASES
    }
    nbytes = res["ours"][0]["state_bytes"]
    gib = nbytes / C.GiB
    rows = []
    for label, key in (
        ("sync save", "save_s"),
        ("async save, caller blocked", "async_block_s"),
        ("async save, until done", "async_total_s"),
        ("2nd async save (stager reused), caller blocked", "async_again_block_s"),
        ("2nd async save, until done", "async_again_total_s"),
        ("load (cold cache)", "load_s"),
    ):
        o, d = med["ours"][key], med["dcp"][key]
        rows.append([label, f"{o:.3f} s", f"{d:.3f} s", f"{C.ratio(d, o):.2f}x"])
    for label, key in (
        ("async blocked, ours staged by DCP's DefaultStager (before)", "async_block_s"),
        ("2nd async blocked, ours staged by DCP's DefaultStager (before)", "async_again_block_s"),
    ):
        o, d = med["ours_dcpstager"][key], med["dcp"][key]
        rows.append([label, f"{o:.3f} s", f"{d:.3f} s", f"{C.ratio(d, o):.2f}x"])
    ob = med["ours_buffered"]["load_s"]
    rows.append(
        [
            "load, ours with buffered reads (before)",
            f"{ob:.3f} s",
            f"{med['dcp']['load_s']:.3f} s",
            f"{C.ratio(med['dcp']['load_s'], ob):.2f}x",
        ]
    )
    for label, key in (
        ("save", "save_s"),
        ("async blocked", "async_block_s"),
        ("2nd async blocked", "async_again_block_s"),
        ("load", "load_s"),
    ):
        lo, hi = C.spread([r[key] for r in res["ours"]])
        dlo, dhi = C.spread([r[key] for r in res["dcp"]])
        rows.append([f"  {label} min-max", f"{lo:.2f}-{hi:.2f}", f"{dlo:.2f}-{dhi:.2f}", ""])
    lines = [
        f"# DCP backend, {args.ranks} ranks (gloo, CPU), FSDP2 state {gib:.2f} GiB "
        f"({args.layers} x Linear({args.dim}, {args.dim}) + AdamW moments), medians of {args.reps} "
        f"interleaved repetitions",
        C.machine_note(),
        f"page cache dropped before loads: {all(r.get('cold') for c in CASES for r in res[c])}",
        f"bytes on disk per step: ours {res['ours'][0]['disk_bytes'] / 3:.0f}, DCP "
        f"{res['dcp'][0]['disk_bytes'] / 3:.0f}",
        "CPU seconds, all ranks and threads, medians: "
        + "; ".join(
            f"{c}: save {C.median(r['save_cpu_s'] for r in res[c]):.2f}, async blocked "
            f"{C.median(r['async_block_cpu_s'] for r in res[c]):.2f} (2nd "
            f"{C.median(r['async_again_block_cpu_s'] for r in res[c]):.2f}), load "
            f"{C.median(r['load_cpu_s'] for r in res[c]):.2f}"
            for c in CASES
        ),
        "",
        C.table(
            ["", "ours", "DCP FileSystemWriter(sync_files=True)/Reader", "ratio (DCP time / ours)"],
            rows,
        ),
    ]
    ok = True
    for name, key, floor in (
        ("sync save throughput", "save_s", 1.3),
        ("load throughput", "load_s", 1.5),
    ):
        line, passed = C.floor_check(name, C.ratio(med["dcp"][key], med["ours"][key]), floor)
        lines.append(line)
        ok &= passed
    line, passed = C.floor_check(
        "async-save blocking time vs DCP's",
        C.ratio(med["ours"]["async_block_s"], med["dcp"]["async_block_s"]),
        0.5,
        higher_is_better=False,
    )
    lines.append(line)
    ok &= passed
    lines.append(
        "(reported)  2nd async save (stagers reused) blocking time vs DCP's: "
        f"{C.ratio(med['ours']['async_again_block_s'], med['dcp']['async_again_block_s']):.3f}"
    )
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layers", type=int, default=6, help="Linear layers of the model (default 6)")
    p.add_argument(
        "--dim", type=int, default=4096, help="their width (default 4096: 64 MiB per weight)"
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--dir", default=None, help="where the steps are written (default: a temp dir under /tmp)"
    )
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="2 ranks, 2 x Linear(256, 256), one repetition: checks the script works (floors not enforced)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.ranks, args.layers, args.dim, args.reps = 2, 2, 256, 1
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_dcp_"))
    base.mkdir(parents=True, exist_ok=True)
    res: dict[str, list[dict[str, Any]]] = {c: [] for c in CASES}
    for rep, case in C.interleaved(CASES, args.reps):
        r = run_group(args, case, base)
        print(
            f"rep {rep} {case}: save {r['save_s']:.3f} s, async blocked {r['async_block_s']:.3f} s "
            f"(2nd {r['async_again_block_s']:.3f} s), load {r['load_s']:.3f} s, "
            f"load average {os.getloadavg()[0]:.2f}",
            file=sys.stderr,
            flush=True,
        )
        res[case].append(r)
    text, ok = report(args, res)
    print(text)
    if args.smoke:
        print(
            "(--smoke: a tiny state, one repetition: the figures mean nothing; floors not enforced)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.dir is None:
        C.remove_path(base)
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
