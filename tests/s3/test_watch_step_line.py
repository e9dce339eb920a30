"""``tiered-ckpt upload --watch`` says what it uploads at its default log level:
one INFO line per step committed remotely, naming the step, its shards and MiB, how they were
confirmed and the seconds it took; nothing else about that step. The sidecar as a real process
against moto (which does not validate checksums: read-back)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import s3_infra
from _upload_util import make_step
from spawn import python_cmd

from tiered_ckpt.layout import UPLOADED_MARKER_NAME, step_dir_name

pytestmark = pytest.mark.slow  # a real sidecar process: ~2-3 s with its start and clean stop


def test_watch_logs_one_line_per_step_at_the_default_level(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    root = tmp_path / "root"
    make_step(root, 3, world_size=2, shard_bytes=512 * 1024)
    marker = root / step_dir_name(3) / UPLOADED_MARKER_NAME
    proc = subprocess.Popen(
        python_cmd(
            "-m",
            "tiered_ckpt.cli",
            "upload",
            "--watch",
            "--local",
            root,
            "--remote",
            s3_bucket.url,
            "--endpoint-url",
            s3_bucket.endpoint_url,
            "--path-style",
            "--poll-interval-s",
            "0.1",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), "step 3 was not uploaded"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out == ""
    step_lines = [ln for ln in err.splitlines() if "step 3" in ln]
    assert len(step_lines) == 1, err  # one line for the step, not one per shard
    assert re.fullmatch(
        r"\S+ \S+ INFO tiered_ckpt\.remote\.upload\.daemon: step 3: committed remotely: 2 shard\(s\), "
        r"1\.0 MiB, confirmed by read-back in \d+\.\d\d s \(1\.0 MiB sent by this node\)",
        step_lines[0],
    ), step_lines[0]
