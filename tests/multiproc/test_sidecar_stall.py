"""A sidecar waiting on a step whose other nodes never confirm (SPEC §11 "Sidecar at
scale"): a real ``tiered-ckpt upload --watch`` process against the moto server through
the counting proxy.

Before: the sidecar polled such a step forever, every ``poll_interval_s``, with no deadline, and
each poll cost ``2 + 2 x local ranks + world_size`` requests (GET upload manifest, PUT manifest.json
again, GET+HEAD per local shard, GET per rank's record). Now: the step backs off to
``--max-poll-interval-s``, each poll is one LIST of the save's ``.confirm/`` prefix, and after
``--stall-deadline-s`` it is reported once (WARNING + metrics), kept locally under a ``stalled``
lock (upload-gated rotation keeps it and does not count it against ``max_pending_uploads``), never
blocks a newer step, and is committed when the other node finally confirms.
"""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from urllib.parse import unquote

import pytest
import s3_infra
from _upload_util import make_step, split_nodes
from prometheus_client.parser import text_string_to_metric_families
from spawn import free_port, python_cmd

from tiered_ckpt import Uploader
from tiered_ckpt.layout import LOCK_PREFIX, UPLOADED_MARKER_NAME, save_entry_name, step_dir_name
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.local.rotation import RotationPolicy, plan_rotation
from tiered_ckpt.retry import RetryPolicy

pytestmark = pytest.mark.slow

KiB = 1024
STALL_S = 1.5
CAP_S = 0.4


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def _wait_for(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _start(root: Path, url: str, endpoint: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = python_cmd(
        "-m",
        "tiered_ckpt.cli",
        "--log-level",
        "INFO",
        "upload",
        "--local",
        root,
        "--remote",
        url,
        "--endpoint-url",
        endpoint,
        "--path-style",
        "--watch",
        "--poll-interval-s",
        "0.1",
        "--max-poll-interval-s",
        str(CAP_S),
        "--stall-deadline-s",
        str(STALL_S),
        "--metrics-port",
        str(port),
    )
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f)


def _stall_lines(log: Path, step: int) -> list[str]:
    return [
        ln
        for ln in log.read_text().splitlines()
        if " WARNING " in ln and f"step {step}:" in ln and "stall deadline" in ln
    ]


def test_a_step_never_confirmed_by_the_other_node_stalls_once_and_commits_later(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    src, a, b = tmp_path / "src", tmp_path / "nodeA", tmp_path / "nodeB"
    for s in (7, 8):
        make_step(src, s, world_size=4, shard_bytes=64 * KiB)
        split_nodes(src, a, b, s, ranks_a=[0, 1])
    sid7 = read_manifest(src, 7).save_id
    save7 = f"{s3_bucket.prefix}/{save_entry_name(7, sid7)}/"
    port, log = free_port(), tmp_path / "sidecar_a.log"
    proc = _start(a, s3_bucket.url, fault_proxy.url, port, log)
    node_b = Uploader(
        b,
        s3_bucket.url,
        s3_client=s3_bucket.client,
        retry=RetryPolicy(max_attempts=3, initial_wait_s=0.05, max_wait_s=0.2),
    )
    try:
        # Node A's shards of both steps go up; both wait for ranks 2-3.
        _wait_for(
            lambda: (
                fault_proxy.count(
                    lambda r: (
                        r.method == "GET" and "list-type=2" in r.target and "confirm" in r.target
                    )
                )
                >= 2
            ),
            "A's first polls",
        )
        # Node B confirms step 8 only: the newer step commits (on B or on A's next poll) while 7
        # waits.
        node_b.upload_step(8)
        _wait_for(
            lambda: (a / step_dir_name(8) / UPLOADED_MARKER_NAME).is_file(), "A's marker of step 8"
        )
        # Step 7 passes the deadline: one WARNING naming the missing ranks, the metrics, the lock.
        _wait_for(lambda: _stall_lines(log, 7), "the stall report of step 7")
        assert "ranks 2-3 not confirmed" in _stall_lines(log, 7)[0]
        m = _scrape(port)
        assert (
            m["tiered_ckpt_upload_stalled_steps"],
            m["tiered_ckpt_upload_stalls_total"],
            m["tiered_ckpt_upload_waiting_steps"],
        ) == (1, 1, 1)
        locks = [
            n
            for n in (a / step_dir_name(7)).iterdir()
            if n.name.startswith(f"{LOCK_PREFIX}stalled.")
        ]
        assert len(locks) == 1
        plan = plan_rotation(
            a, RotationPolicy(keep_last=1, upload_gated=True, max_pending_uploads=0)
        )
        assert plan.kept_locked == (7,) and plan.delete == () and plan.dropped_pending == ()
        # While stalled: polled at the cap, each poll one LIST of the save's .confirm/ prefix,
        # nothing else.
        before = len(fault_proxy.requests)
        time.sleep(2.0)
        window = [r for r in fault_proxy.requests[before:] if save7 in unquote(r.target)]
        assert window and all(r.method == "GET" and "list-type=2" in r.target for r in window), (
            window
        )
        assert 2 <= len(window) <= 2.0 / (CAP_S / 2) + 1  # at most one poll per CAP_S / 2
        assert len(_stall_lines(log, 7)) == 1  # reported once
        # Node B's sidecar comes back and confirms step 7: A commits it (or sees B's commit) and
        # lets go.
        node_b.upload_step(7)
        _wait_for(
            lambda: (a / step_dir_name(7) / UPLOADED_MARKER_NAME).is_file(), "A's marker of step 7"
        )
        _wait_for(
            lambda: (
                not any(n.name.startswith(LOCK_PREFIX) for n in (a / step_dir_name(7)).iterdir())
            ),
            "the stalled lock released",
        )
        m = _scrape(port)
        assert (
            m["tiered_ckpt_upload_stalled_steps"],
            m["tiered_ckpt_upload_stalls_total"],
            m["tiered_ckpt_upload_waiting_steps"],
        ) == (0, 1, 0)
        key = f"{save7}upload_manifest.json"
        assert s3_bucket.client.head_object(Bucket=s3_bucket.bucket, Key=key)["ContentLength"] > 0
    finally:
        node_b.close()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0, log.read_text()[-3000:]
    assert len(_stall_lines(log, 7)) == 1 and _stall_lines(log, 8) == []
