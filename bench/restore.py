"""Benchmark: ``restore`` of one 2 GiB step (4 ranks) vs ``aws s3 cp --recursive`` of the same prefix from
the same moto server, in the same run.

    python bench/restore.py [--gib 2] [--reps 1] [--out bench/out/restore.json]
    python bench/restore.py --smoke --out /tmp/restore.json   # 4 MiB, no aws: checks the script works

Setup: a 4-rank step of ``--gib`` GiB is saved locally and uploaded by the real ``Uploader``. Then, per
repetition, interleaved, each into an emptied local directory:

* ``aws``: ``aws s3 cp --recursive s3://bucket/prefix/step_X/ DIR`` with the CLI's defaults (8 MiB ranged
  GETs, 10 in flight); installs the ``awscli`` PyPI package if ``aws`` is missing. ``aws+sha256`` adds a
  sha256 of every downloaded shard, i.e. the verification restore always does.
* ``restore[<setting>]``: :func:`tiered_ckpt.restore.restore_detailed` (GET latest pointer, LIST, GET upload
  manifest + manifest, HEAD every shard, parallel ranged download, sha256 + header check of every shard,
  local commit with fsyncs, marker), for each download setting:
  - ``s3``: 16 MiB ranges, 16 in flight: how S3 / MinIO reach their throughput;
  - ``default``: the library default (64 MiB ranges, 8 in flight);
  - ``moto``: ranges larger than a shard (one GET per shard), 4 in flight: moto answers a ranged GET
    in time proportional to the whole object, so ranges only cost there.

Reports medians and ratios (aws time / ours: >= 1 means restore is faster, verification included).
Floor: >= 1.0 for the best setting on this server, stated per setting.
"""

from __future__ import annotations

import argparse
import os
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # s3_infra: the tests' embedded moto server

import numpy as np  # noqa: E402

import s3_infra  # noqa: E402
from _common import interleaved, machine_note, median, table  # noqa: E402
from tiered_ckpt.layout import step_dir_name  # noqa: E402
from tiered_ckpt.local import save_sharded  # noqa: E402

MiB = 1024 * 1024
SETTINGS = {"s3": (16 * MiB, 16), "default": (64 * MiB, 8), "moto": (2048 * MiB, 4)}


def ensure_aws() -> str:
    aws = shutil.which("aws")
    if aws is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "awscli"], check=True)
        aws = shutil.which("aws") or str(Path(sys.executable).parent / "aws")
    return aws


def make_step(root: Path, gib: float, step: int) -> None:
    per_rank = int(gib * 1024 * MiB / 4) // 4  # float32 elements
    block = np.frombuffer(np.random.default_rng(0).bytes(16 * MiB), dtype=np.float32)
    states = []
    for r in range(4):
        arr = np.resize(block, per_rank).copy()
        arr[:1024] = r  # distinct shards
        states.append({"w": arr})
    save_sharded(states, root, step)


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb", buffering=0) as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


def run_aws(aws: str, endpoint: str, url: str, dest: Path, verify: bool) -> tuple[float, float]:
    t = time.monotonic()
    subprocess.run([aws, "--endpoint-url", endpoint, "s3", "cp", "--recursive", "--only-show-errors",
                    f"{url}/", str(dest)], check=True)
    t_cp = time.monotonic() - t
    if verify:
        for p in sorted(dest.glob("*.safetensors")):
            sha256_file(p)
    return t_cp, time.monotonic() - t


def run_restore(endpoint: str, url: str, dest: Path, setting: str) -> float:
    from tiered_ckpt.remote.restore import restore_detailed

    part, conc = SETTINGS[setting]
    client = s3_infra.make_test_client(endpoint, read_timeout_s=600)
    t = time.monotonic()
    res = restore_detailed(url, dest, s3_client=client, download_part_size_bytes=part,
                           download_max_concurrency=conc, max_parallel_shards=4)
    took = time.monotonic() - t
    assert res.bytes_downloaded > 0
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--settings", default="moto,default,s3", help="comma list of " + ",".join(SETTINGS))
    ap.add_argument("--out", type=Path, default=HERE / "out" / "restore.json")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny run that only checks the script works (tests/bench): 4 MiB, 1 rep, no aws "
                         "baseline (it may need a pip install); floor not enforced")
    args = ap.parse_args()
    if args.smoke:
        args.gib, args.reps = 4 / 1024, 1
    settings = [s for s in args.settings.split(",") if s]
    # The embedded moto server takes any credentials; never use (or need) real ones here.
    os.environ.update(s3_infra.TEST_AWS_ENV)
    for k in s3_infra.TEST_AWS_ENV_REMOVE:
        os.environ.pop(k, None)
    aws = None if args.smoke else ensure_aws()
    step = 100
    work = Path(tempfile.mkdtemp(prefix="bench-restore-", dir="/var/tmp"))
    times: dict[str, list[float]] = {}
    try:
        with s3_infra.run_moto_server() as endpoint:
            loc = s3_infra.new_bucket(endpoint, prefix="bench")
            src = work / "src"
            t = time.monotonic()
            make_step(src, args.gib, step)
            size = sum(p.stat().st_size for p in (src / step_dir_name(step)).glob("*.safetensors"))
            print(f"saved step {step}: 4 shards, {size / MiB:.0f} MiB in {time.monotonic() - t:.1f} s", flush=True)
            from tiered_ckpt.remote.upload import Uploader

            t = time.monotonic()
            client = s3_infra.make_test_client(endpoint, read_timeout_s=600)
            with Uploader(src, loc.url, s3_client=client) as up:
                up.upload_step(step)
            print(f"uploaded with the sidecar's Uploader in {time.monotonic() - t:.1f} s", flush=True)
            shutil.rmtree(src)
            step_url = f"{loc.url}/{step_dir_name(step)}"
            cases = (["aws"] if aws is not None else []) + [f"restore[{s}]" for s in settings]
            for rep, case in interleaved(cases, args.reps):
                dest = work / "dest"
                shutil.rmtree(dest, ignore_errors=True)
                dest.mkdir()
                if case == "aws":
                    assert aws is not None
                    t_cp, t_all = run_aws(aws, endpoint, step_url, dest, verify=True)
                    times.setdefault("aws", []).append(t_cp)
                    times.setdefault("aws+sha256", []).append(t_all)
                    print(f"rep {rep} aws: {t_cp:.1f} s (+sha256: {t_all:.1f} s)", flush=True)
                else:
                    took = run_restore(endpoint, loc.url, dest, case[len("restore["):-1])
                    times.setdefault(case, []).append(took)
                    print(f"rep {rep} {case}: {took:.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    aws_med = median(times["aws"]) if "aws" in times else None
    rows = []
    result = {"gib": args.gib, "bytes": size, "reps": args.reps, "machine": machine_note(), "cases": {},
              "smoke": args.smoke}
    for case, xs in times.items():
        med = median(xs)
        r = aws_med / med if aws_med is not None else None
        rows.append([case, f"{med:.1f}", f"{size / MiB / med:.0f}", f"{r:.2f}x" if r is not None else "-"])
        result["cases"][case] = {"seconds": xs, "median_s": med, "MiB_per_s": size / MiB / med,
                                 "speedup_vs_aws": r}
    print()
    print(f"restore of one {size / MiB / 1024:.2f} GiB step (4 shards) from moto over HTTP; "
          f"speedup = aws s3 cp time / this case's time (verification included for restore)")
    print(table(["case", "median s", "MiB/s", "vs aws"], rows))
    best = min((c for c in times if c.startswith("restore")), key=lambda c: median(times[c]))
    ok = aws_med is not None and aws_med / median(times[best]) >= 1.0
    print(f"floor >= 1.0x ({best}): {('PASS' if ok else 'FAIL') if aws_med is not None else 'not measured (no aws)'}")
    result["floor"] = {"case": best, "pass": ok}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
