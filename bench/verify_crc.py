"""Benchmark: CRC32C (``verify --fast``) against sha256 (``verify``) verification of the same step.

    python bench/verify_crc.py [--size-gib 2] [--ranks 4] [--reps 5] [--dir /tmp] [--core 0]

Writes one step of ``--size-gib`` GiB over ``--ranks`` ranks (float32 ZeRO-style partitions), warms
the page cache with one untimed pass of each, pins this process to one core
(``os.sched_setaffinity``) and times :func:`tiered_ckpt.scan.inspect_step` (what ``tiered-ckpt
verify`` runs: streaming pread through a 1 MiB buffer, every shard hashed, header and state tree
checked) with ``fast=False`` (sha256) and ``fast=True`` (CRC32C), interleaved, ``--reps`` times
each. Prints medians, throughput and the ratio; exits 1 if CRC32C is not at least ``--floor`` (3)
times faster. ``--smoke``: 4 MiB, 1 rep, floor not enforced (a check that the script works, run by
tests/bench).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import tiered_ckpt as tc
from tiered_ckpt.local.reshard import even_split
from tiered_ckpt.local.scan import inspect_step


def make_step(root: Path, size_bytes: int, ranks: int) -> int:
    n = size_bytes // 4
    states = []
    for off, cnt in even_split(n, ranks):
        a = np.arange(off, off + cnt, dtype=np.uint32).view(
            np.float32
        )  # cheap, incompressible enough
        states.append({"opt": {"master": tc.GlobalSlice(a, (n,), (off,))}, "step": 1})
    m = tc.save_sharded(states, root, 1)
    del states
    return m.total_bytes


def timed(root: Path, fast: bool) -> float:
    t0 = time.perf_counter()
    st = inspect_step(root, 1, fast=fast)
    dt = time.perf_counter() - t0
    if not st.ok:
        raise SystemExit(f"step did not verify: {st.reason}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--dir", default=None, help="parent directory of the scratch run (default: $TMPDIR)"
    )
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--floor", type=float, default=3.0)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run that only checks the script works (tests/bench): 4 MiB, 1 rep; floor not enforced",
    )
    args = ap.parse_args()
    if args.smoke:
        args.size_gib, args.reps = 4 / 1024, 1
    tmp = Path(tempfile.mkdtemp(prefix="verify_crc.", dir=args.dir))
    try:
        total = make_step(tmp / "run", int(args.size_gib * 2**30), args.ranks)
        root = tmp / "run"
        os.sched_setaffinity(0, {args.core})
        timed(root, False), timed(root, True)  # warm the page cache (and the code paths)
        sha, crc = [], []
        for i in range(args.reps):
            for fast in (False, True) if i % 2 == 0 else (True, False):
                (crc if fast else sha).append(timed(root, fast))
        ms, mc = statistics.median(sha), statistics.median(crc)
        gib = total / 2**30
        print(
            f"step: {gib:.2f} GiB in {args.ranks} shards; page cache warm; pinned to core {args.core}; "
            f"{args.reps} interleaved reps each"
        )
        print(
            f"sha256 verify : median {ms:.3f} s  ({gib / ms:.2f} GiB/s)  all {[round(x, 3) for x in sha]}"
        )
        print(
            f"crc32c verify : median {mc:.3f} s  ({gib / mc:.2f} GiB/s)  all {[round(x, 3) for x in crc]}"
        )
        ratio = ms / mc
        ok = ratio >= args.floor
        print(
            f"ratio sha256/crc32c: {ratio:.2f}x  (floor {args.floor}x: {'OK' if ok else 'BELOW FLOOR'})"
        )
        return 0 if ok or args.smoke else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
