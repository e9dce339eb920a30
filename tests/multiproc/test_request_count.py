"""Requests a waiting sidecar costs, counted at a proxy (SPEC §10, §11).

A real ``tiered-ckpt upload --watch`` process for one node (2 local ranks) of a step with 4, 16 and
64 simulated ranks, talking to the moto server through :class:`s3_infra.FaultProxy`, which records
every request. The other ranks' node never confirms until the end. The sidecar's own counter of
polls (``tiered_ckpt_upload_waiting_polls_total``, scraped between polls) delimits them, so the
counts are exact:

- the first pass (upload of the local shards, then the first wait),
- each later poll while waiting: must not grow with world size (before per-node polling: ``2 + 2 x local
  ranks + world_size``: 10, 22 and 70),
- the poll that finds every rank confirmed (the other node committed): O(world size) once per step.

The figures are written to ``$TC_REQUEST_COUNT_OUT`` (JSON) when set; README.md and docs/sidecar.md
quote them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import s3_infra
from _upload_util import make_step, split_nodes
from prometheus_client.parser import text_string_to_metric_families
from spawn import free_port, python_cmd

from tiered_ckpt import Uploader
from tiered_ckpt.layout import UPLOADED_MARKER_NAME, step_dir_name

pytestmark = pytest.mark.slow

LOCAL = [0, 1]
POLL_S = 0.5
#: Requests of one poll of a waiting step (one LIST of the save's .confirm/ prefix), at any world
#: size.
PER_POLL = 1


def _polls(port: int) -> float:
    """The sidecar's poll counter; -1 while its endpoint is not up yet."""
    try:
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        )
    except OSError:
        return -1
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}[
        "tiered_ckpt_upload_waiting_polls_total"
    ]


def _snapshot(
    proxy: s3_infra.FaultProxy, port: int, min_polls: int, timeout_s: float = 60.0
) -> tuple[int, int]:
    """``(polls, requests so far)`` taken between two polls: the request count is quiet for 100 ms
    before and after the scrape (polls are at least ``POLL_S / 2`` = 250 ms apart, and a poll's
    counter moves a few ms after its LIST)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n0 = len(proxy.requests)
        time.sleep(0.1)
        if len(proxy.requests) != n0:
            continue
        polls = int(_polls(port))
        time.sleep(0.1)
        if len(proxy.requests) == n0 and polls >= min_polls:
            return polls, n0
    raise AssertionError(f"no quiet moment with >= {min_polls} polls within {timeout_s} s")


def _measure(
    tmp_path: Path, loc: s3_infra.S3Location, proxy: s3_infra.FaultProxy, world: int
) -> dict[str, int]:
    src, a, b = tmp_path / f"src{world}", tmp_path / f"a{world}", tmp_path / f"b{world}"
    make_step(src, 5, world_size=world, shard_bytes=4 * 1024)
    split_nodes(src, a, b, 5, ranks_a=LOCAL)
    url = f"{loc.url}/w{world}"
    port, log = free_port(), tmp_path / f"sidecar{world}.log"
    start = len(proxy.requests)
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            python_cmd(
                "-m",
                "tiered_ckpt.cli",
                "--log-level",
                "INFO",
                "upload",
                "--local",
                a,
                "--remote",
                url,
                "--endpoint-url",
                proxy.url,
                "--path-style",
                "--watch",
                "--poll-interval-s",
                str(POLL_S),
                "--max-poll-interval-s",
                str(POLL_S),
                "--metrics-port",
                str(port),
            ),
            stdout=subprocess.DEVNULL,
            stderr=f,
        )
    try:
        p1, r1 = _snapshot(proxy, port, 1)
        p2, r2 = _snapshot(proxy, port, p1 + 8)
        waiting = proxy.requests[r1:r2]
        # The other node uploads its shards and commits while A is paused (SIGSTOP), so that A's
        # next poll finds the step committed (no race on `latest`: the counts are exact).
        proc.send_signal(signal.SIGSTOP)
        try:
            with s3_infra.FaultProxy(loc.endpoint_url).start() as proxy_b:  # its own counter
                with Uploader(b, url, s3_client=s3_infra.make_test_client(proxy_b.url)) as node_b:
                    node_b.upload_step(5)  # its shards, then the commit (A's are confirmed already)
                committer = proxy_b.requests
        finally:
            proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while not (a / step_dir_name(5) / UPLOADED_MARKER_NAME).is_file():
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        p3, r3 = _snapshot(proxy, port, p2)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0, log.read_text()[-3000:]
    polls = p2 - p1
    assert len(waiting) == polls * PER_POLL, (
        world,
        polls,
        [(r.method, r.target) for r in waiting[:12]],
    )
    assert all(r.method == "GET" and "list-type=2" in r.target for r in waiting)
    final = proxy.requests[r2 + (p3 - p2) * PER_POLL : r3]  # after the polls that still waited
    return {
        "world_size": world,
        "local_ranks": len(LOCAL),
        "first_pass": r1 - start - (p1 - 1) * PER_POLL,
        "polls": polls,
        "per_poll": len(waiting) // polls,
        "final_poll": len(final),
        "committer": len(committer),
    }


def test_requests_per_poll_do_not_grow_with_world_size(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    rows = [_measure(tmp_path, s3_bucket, fault_proxy, w) for w in (4, 16, 64)]
    out = os.environ.get("TC_REQUEST_COUNT_OUT")
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))
    local = len(LOCAL)
    assert [r["per_poll"] for r in rows] == [PER_POLL] * 3, rows
    # The first pass sends the same 2 local shards whatever the world size (docs/sidecar.md): 5 + 6
    # L for the step with single-PUT shards on a server that is read back, plus the sidecar's start
    # (1 LIST of abandoned multipart uploads, 3 requests of the checksum probe).
    assert [r["first_pass"] for r in rows] == [9 + 6 * local] * 3, rows
    # The poll that finds the step committed by the other node reads that node's records once:
    # 1 LIST + (W - L) GET + GET upload manifest + HEAD and GET latest.
    assert [r["final_poll"] for r in rows] == [w - local + 4 for w in (4, 16, 64)], rows
    # The committing node (W - L local ranks, no sidecar start): 2 W + 5 (W - L) + 12.
    assert [r["committer"] for r in rows] == [2 * w + 5 * (w - local) + 12 for w in (4, 16, 64)], (
        rows
    )
