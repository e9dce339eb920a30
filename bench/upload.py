"""Benchmark: the uploader vs ``s5cmd cp`` and ``aws s3 cp --recursive`` on one 2 GiB step (4
ranks), same server (the tests' moto, or a real SeaweedFS ``weed mini``).

    python bench/upload.py --server seaweedfs [--gib 2] [--reps 3] [--part-mib 16] [--concurrency
    10] python bench/upload.py --server moto --baselines aws
    python bench/upload.py --smoke --out /tmp/upload.json   # 4 MiB, 1 rep, moto, s5cmd only if installed

``s5cmd``: ``s5cmd cp 'DIR/*' s3://bucket/prefix/`` with its defaults (50 MiB parts, 5 per file);
floor on SeaweedFS: ``ours-no-readback`` >= 1.1x s5cmd (SeaweedFS validates checksums, so no
read-back is needed there; ``ours-readback`` is what moto needs).

Per repetition, interleaved (the order rotates and reverses between repetitions, so no case always
runs first or after the same neighbour), each into an emptied prefix (moto keeps objects in memory):

* ``aws``: ``aws s3 cp --recursive`` of the step directory (installs the ``awscli`` PyPI package if
  the ``aws`` command is missing);
* ``ours-no-readback``: ``Uploader.upload_step`` with every confirmation that needs no read-back:
  hashing while sending (whole-file SHA-256), CRC32C part checksums, HEAD + composite checksum
  comparison, confirmation records, upload manifest, latest pointer. (moto does not validate
  checksums, so the bench tells the uploader to treat it as a validating server, which is what S3
  and MinIO are; moto's reported composite matches.)
* ``ours-readback``: the same with the read-back that a non-validating server (moto) needs.

Reports medians and ratios (aws time / ours time: >= 1 means we are faster). Floor: >= 0.9 for
``ours-no-readback``. The read-back's extra time is reported separately.

Besides wall time, every run records the CPU seconds of the client (the ``aws`` child process, or
this process for ours) and of the moto server process, and the 1-minute load average: on a shared,
loaded machine wall times swing by 2x between runs while CPU seconds stay put, so they tell whether
a slow run did more work or merely waited for a core.

What ``aws s3 cp`` (awscli 1.x, botocore >= 1.36, ``request_checksum_calculation=when_supported``)
sends: ``CreateMultipartUpload(ChecksumAlgorithm=CRC32)``, 8 MiB parts, 10 in flight, each part with
an ``x-amz-checksum-crc32`` header and, over plain HTTP, a SHA-256 of the body for SigV4. The
uploader sends 16 MiB parts with ``ChecksumCRC32C``, unsigned payload, plus the whole-file SHA-256
it compares with the manifest (see ``tiered_ckpt/_shard_transfer.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import numpy as np  # noqa: E402
import s3_infra  # noqa: E402

sys.path.insert(0, str(HERE))
import _s3bench as sb  # noqa: E402

from tiered_ckpt.layout import step_dir_name  # noqa: E402
from tiered_ckpt.local.single_process_save import save_sharded  # noqa: E402

MiB = 1024 * 1024


def ensure_aws() -> str:
    aws = shutil.which("aws")
    if aws is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "awscli"], check=True)
        aws = shutil.which("aws") or str(Path(sys.executable).parent / "aws")
    return aws


def empty_prefix(loc: s3_infra.S3Location, prefix: str) -> None:
    c = loc.client
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix):
        objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objs:
            c.delete_objects(Bucket=loc.bucket, Delete={"Objects": objs, "Quiet": True})


def _cpu_s(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def run_aws(aws: str, loc: s3_infra.S3Location, src: Path, prefix: str) -> float:
    t = time.monotonic()
    subprocess.run(
        [
            aws,
            "--endpoint-url",
            loc.endpoint_url,
            "s3",
            "cp",
            "--recursive",
            "--only-show-errors",
            str(src),
            f"s3://{loc.bucket}/{prefix}/",
        ],
        check=True,
    )
    return time.monotonic() - t


def run_ours(
    loc: s3_infra.S3Location,
    root: Path,
    prefix: str,
    step: int,
    readback: bool,
    part_mib: int,
    concurrency: int,
) -> tuple[float, float]:
    from tiered_ckpt.layout import UPLOADED_MARKER_NAME
    from tiered_ckpt.remote.upload.uploader import Uploader

    (root / step_dir_name(step) / UPLOADED_MARKER_NAME).unlink(missing_ok=True)
    client = s3_infra.make_test_client(loc.endpoint_url, read_timeout_s=300)
    with Uploader(
        root,
        f"s3://{loc.bucket}/{prefix}",
        s3_client=client,
        part_size_bytes=part_mib * MiB,
        max_concurrency=concurrency,
    ) as up:
        up.server_validates_checksums()  # probe outside the timing
        up.session.checksum_validation = (
            not readback
        )  # read-back forced on a validating server too (SeaweedFS): the A/B
        t = time.monotonic()
        um = up.upload_step(step)
        total = time.monotonic() - t
        assert {s.confirmed_by for s in um.shards} == {
            "read-back" if readback else "server-checksum"
        }
        return total, up.last_timing.read_back_s if up.last_timing else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--part-mib", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--server", choices=sb.SERVERS, default="seaweedfs")
    ap.add_argument("--baselines", default="s5cmd,aws", help="comma list of s5cmd, aws (or empty)")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "upload.json")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run that only checks the script works (tests/bench): 4 MiB, 1 rep, 5 MiB parts, "
        "no aws baseline (it may need a pip install); floor not enforced",
    )
    args = ap.parse_args()
    if args.smoke:
        args.gib, args.reps, args.part_mib, args.concurrency = 4 / 1024, 1, 5, 4
        args.server, args.baselines = "moto", "s5cmd"
    tools = {b: sb.tool("aws" if b == "aws" else "s5cmd") for b in args.baselines.split(",") if b}
    if not args.smoke and "aws" in tools and tools["aws"] is None:
        tools["aws"] = ensure_aws()
    tools = {b: p for b, p in tools.items() if p is not None}
    work = Path(tempfile.mkdtemp(prefix="tc-bench-upload-"))
    try:
        step = 1
        per_rank = int(args.gib * 1024 * MiB) // args.ranks
        rng = np.random.default_rng(0)
        states = [
            {"w": rng.integers(0, 256, size=per_rank, dtype=np.uint8)} for _ in range(args.ranks)
        ]
        m = save_sharded(states, work, step)
        del states
        total_bytes = m.total_bytes
        src = work / step_dir_name(step)
        print(
            f"step of {total_bytes / 2**30:.2f} GiB in {args.ranks} shards; {args.reps} interleaved reps",
            flush=True,
        )
        cases = tuple(tools) + ("ours-no-readback", "ours-readback")
        res: dict[str, list[float]] = {c: [] for c in cases}
        res["readback-s"] = []
        cpu: dict[str, list[dict[str, float]]] = {c: [] for c in cases}
        with sb.run_server(args.server) as url:
            server = sb.server_pid(url)
            loc = s3_infra.new_bucket(url, prefix="bench")
            for rep in range(args.reps):
                order = list(cases[rep % len(cases) :] + cases[: rep % len(cases)])
                if rep % 2:
                    order.reverse()
                for name in order:
                    prefix = f"bench/{name}/{rep}"
                    c0 = (
                        _cpu_s(resource.RUSAGE_SELF) + _cpu_s(resource.RUSAGE_CHILDREN),
                        sb.proc_cpu_s(server),
                    )
                    if name == "aws":
                        dt = run_aws(tools["aws"], loc, src, prefix)
                    elif name == "s5cmd":
                        dt = sb.s5cmd_upload(
                            tools["s5cmd"], loc.endpoint_url, src, f"s3://{loc.bucket}/{prefix}"
                        )
                    else:
                        dt, rb = run_ours(
                            loc,
                            work,
                            prefix,
                            step,
                            name == "ours-readback",
                            args.part_mib,
                            args.concurrency,
                        )
                        if name == "ours-readback":
                            res["readback-s"].append(rb)
                    c1 = (
                        _cpu_s(resource.RUSAGE_SELF) + _cpu_s(resource.RUSAGE_CHILDREN),
                        sb.proc_cpu_s(server),
                    )
                    load1 = os.getloadavg()[0]
                    res[name].append(dt)
                    cpu[name].append(
                        {
                            "client_cpu_s": round(c1[0] - c0[0], 2),
                            "server_cpu_s": round(c1[1] - c0[1], 2),
                            "load1": round(load1, 2),
                        }
                    )
                    print(
                        f"rep {rep} {name:17s} {dt:7.2f} s  {total_bytes / dt / MiB:7.1f} MiB/s  cpu client "
                        f"{c1[0] - c0[0]:5.2f} s server {c1[1] - c0[1]:5.2f} s  load1 {load1:5.2f}",
                        flush=True,
                    )
                    empty_prefix(loc, prefix)
        med = {k: statistics.median(v) for k, v in res.items() if v}
        med_cpu = {
            k: {
                f: statistics.median(r[f] for r in v)
                for f in ("client_cpu_s", "server_cpu_s", "load1")
            }
            for k, v in cpu.items()
        }
        vs = {b: {c: med[b] / med[c] for c in ("ours-no-readback", "ours-readback")} for b in tools}
        report = {
            "server": args.server,
            "bytes": total_bytes,
            "ranks": args.ranks,
            "reps": args.reps,
            "part_mib": args.part_mib,
            "concurrency": args.concurrency,
            "runs_s": res,
            "median_s": med,
            "cpu": cpu,
            "median_cpu": med_cpu,
            "speedup": vs,  # baseline time / ours: >= 1 means we are faster
            "readback_extra_s": med["ours-readback"] - med["ours-no-readback"],
            "smoke": args.smoke,
        }
        print(
            json.dumps(
                {k: report[k] for k in ("median_s", "median_cpu", "speedup", "readback_extra_s")},
                indent=1,
            )
        )
        floors = {"s5cmd": 1.1, "aws": 0.9}
        floor_ok = True
        for b in tools:
            r = vs[b]["ours-no-readback"]
            floor_ok &= r >= floors[b]
            print(
                f"floor ours-no-readback >= {floors[b]}x {b} on {args.server}: {r:.2f}x "
                f"{'PASS' if r >= floors[b] else 'FAIL'}"
            )
        if not tools:
            print("floor ours-no-readback vs s5cmd: not measured (no baseline tool)")
        floor_ok = floor_ok and bool(tools)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        return 0 if floor_ok or args.smoke else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
