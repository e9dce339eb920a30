"""Probe: the least CPU a Python client can spend fetching one 2 GiB step (4 shards) from SeaweedFS,
for comparison with ``bench/restore.py`` (whose ``restore`` also signs every request with botocore,
checks sizes and headers, fsyncs and commits) and with ``s5cmd cp``.

    python bench/restore_floor_probe.py [--modes recv:16:16,sha:16:16,shawrite:16:16] [--reps 2]
    python bench/restore_floor_probe.py --smoke      # 4 MiB on moto, 1 rep: only checks the script runs

A mode is ``NAME:PART_MIB:THREADS``: ``THREADS`` threads, each with one ``http.client`` connection and
one reused page-aligned buffer of ``PART_MIB`` MiB, run presigned ranged GETs of ``PART_MIB`` MiB
(``readinto`` in 1 MiB pieces). ``recv`` only receives; ``sha`` also feeds each piece to a sha256 of
its part (not the shard's: a lower bound of the hashing's cost, not a verification); ``shawrite``
also writes each part with ``O_DIRECT``. Prints wall seconds, this process's user and system CPU
seconds, and the server's CPU seconds per trial. Nothing is verified: a measuring tool, not a
client.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _s3bench as sb  # noqa: E402
import restore as rb  # noqa: E402

MiB = 1024 * 1024
CHUNK = MiB


def run_mode(
    ep: str, client, bucket: str, keys, dest: Path, mode: str
) -> tuple[float, float, float]:
    name, part_mib, conc_s = mode.split(":")
    part, conc = int(part_mib) * MiB, int(conc_s)
    jobs = iter(
        [(k, off, min(part, size - off)) for k, size in keys for off in range(0, size, part)]
    )
    urls = {
        k: urllib.parse.urlparse(
            client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": k})
        )
        for k, _ in keys
    }
    host = urllib.parse.urlparse(ep)
    lock = threading.Lock()
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fds = {k: os.open(dest / k.replace("/", "_"), flags, 0o644) for k, _ in keys}

    def worker() -> None:
        conn = http.client.HTTPConnection(host.hostname, host.port)
        buf = mmap.mmap(-1, part)
        mv = memoryview(buf)
        while True:
            with lock:
                job = next(jobs, None)
            if job is None:
                conn.close()
                return
            key, off, n = job
            u = urls[key]
            conn.request(
                "GET", f"{u.path}?{u.query}", headers={"Range": f"bytes={off}-{off + n - 1}"}
            )
            resp = conn.getresponse()
            h = hashlib.sha256() if name.startswith("sha") else None
            got = 0
            while got < n:
                k = resp.readinto(mv[got : min(n, got + CHUNK)])
                if not k:
                    raise ConnectionError(f"{key}: body ended after {got} of {n} bytes")
                if h is not None:
                    h.update(mv[got : got + k])
                got += k
            resp.read()
            if name == "shawrite" and n % 4096 == 0:
                os.pwrite(fds[key], mv[:n], off)

    t0, w0 = os.times(), time.monotonic()
    try:
        with ThreadPoolExecutor(conc) as ex:
            for f in [ex.submit(worker) for _ in range(conc)]:
                f.result()
    finally:
        for fd in fds.values():
            os.close(fd)
    t1 = os.times()
    return time.monotonic() - w0, t1.user - t0.user, t1.system - t0.system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="recv:16:16,sha:16:16,shawrite:16:16")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--server", choices=sb.SERVERS, default="seaweedfs")
    ap.add_argument(
        "--smoke", action="store_true", help="4 MiB, 1 rep, moto: only checks that the script runs"
    )
    args = ap.parse_args()
    if args.smoke:
        args.gib, args.reps, args.server = 4 / 1024, 1, "moto"
    least: dict[str, float] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-floor-", dir="/var/tmp"))
    try:
        with sb.run_server(args.server) as ep:
            import s3_infra

            from tiered_ckpt.remote.upload.uploader import Uploader

            server = sb.server_pid(ep)
            loc = s3_infra.new_bucket(ep, prefix="bench")
            src = work / "src"
            rb.make_step(src, args.gib, 100)
            with Uploader(src, loc.url, s3_client=s3_infra.make_test_client(ep)) as up:
                up.upload_step(100)
            shutil.rmtree(src)
            client = s3_infra.make_test_client(ep)
            keys = [
                (o["Key"], o["Size"])
                for o in client.list_objects_v2(Bucket=loc.bucket)["Contents"]
                if o["Key"].endswith(".safetensors")
            ]
            for rep in range(args.reps):
                for mode in args.modes.split(","):
                    dest = work / "dest"
                    shutil.rmtree(dest, ignore_errors=True)
                    dest.mkdir()
                    c0 = sb.proc_cpu_s(server)
                    wall, user, system = run_mode(ep, client, loc.bucket, keys, dest, mode)
                    least[mode] = min(least.get(mode, float("inf")), user + system)
                    print(
                        f"rep {rep} {mode}: {wall:.2f} s, client user {user:.2f} s sys "
                        f"{system:.2f} s, server {sb.proc_cpu_s(server) - c0:.2f} s, load1 "
                        f"{os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("least client CPU s per mode: " + ", ".join(f"{m} {c:.2f}" for m, c in least.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
