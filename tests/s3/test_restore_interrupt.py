"""Ctrl-C during `tiered-ckpt restore` stops the transfers in flight instead of waiting them out,
and commits nothing (moto server over HTTP; the CLI as a real subprocess)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from restore_util import files_under, publish
from s3_infra import S3Location
from spawn import child_env, python_cmd

from tiered_ckpt import committed_steps, save_sharded


@pytest.mark.slow  # two full CLI restores of 96 MiB (~10 s): out of the quick tier
def test_sigint_mid_restore_stops_promptly_and_commits_nothing(
    tmp_path: Path, s3_bucket: S3Location, default_sigint: None
) -> None:
    src = tmp_path / "src"
    rng = np.random.default_rng(0)
    save_sharded(
        [{"w": rng.standard_normal(12 * 2**20).astype(np.float32)} for _ in range(2)], src, 5
    )
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, src, 5)
    dest = tmp_path / "dest"
    env = child_env(AWS_ENDPOINT_URL=s3_bucket.endpoint_url)
    cmd = python_cmd(
        "-m",
        "tiered_ckpt.cli",
        "restore",
        "--remote",
        s3_bucket.url,
        "--local",
        dest,
        "--concurrency",
        "1",
        "--part-size-mib",
        "1",
        "--no-progress",
    )
    t0 = time.monotonic()
    full = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    uninterrupted = time.monotonic() - t0
    assert full.returncode == 0, full.stderr
    assert committed_steps(dest) == [5]

    dest2 = tmp_path / "dest2"
    cmd[cmd.index(str(dest))] = str(dest2)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # SIGINT once the download has really started (a staged shard holds bytes), not after a guessed
    # sleep: restores are fast now, and on a loaded machine the first run's time says little.
    deadline = time.monotonic() + 60
    while (
        time.monotonic() < deadline
        and proc.poll() is None
        and not any(p.stat().st_blocks for p in dest2.rglob("*.tmp") if p.is_file())
    ):
        time.sleep(0.005)
    t1 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    stopped_after = time.monotonic() - t1
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in out + err
    assert committed_steps(dest2) == []
    assert not [f for f in files_under(dest2) if f.endswith(".tmp") or f.endswith(".safetensors")]
    # It stops well before the remaining download would have finished.
    print(f"uninterrupted {uninterrupted:.1f} s, stopped {stopped_after:.1f} s after SIGINT")
    assert stopped_after < max(1.0, uninterrupted / 4), (stopped_after, uninterrupted)
