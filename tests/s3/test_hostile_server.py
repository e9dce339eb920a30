"""Every remote read is bounded in size and time: a hostile S3 server
(tests/hostile_http.py, a real HTTP server in a thread) streams an endless ``latest``, sends more
than HEAD announced, or trickles one byte at a time. The store must refuse each within its cap /
deadline, never grow without bound.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from hostile_http import LIST_KEY, Behaviour, HostileS3, run_bounded
from spawn import child_env, cli_cmd

from tiered_ckpt.errors import ManifestError, UploadError
from tiered_ckpt.remote.catalogue import read_latest_pointer
from tiered_ckpt.remote.limits import MAX_POINTER_BYTES
from tiered_ckpt.retry import RetryPolicy
from tiered_ckpt.store.deadline import RequestDeadlineError
from tiered_ckpt.store.s3 import S3Store, make_s3_client
from tiered_ckpt.store.settings import DeadlineSettings

MiB = 1024 * 1024
BUCKET = "hostile"
PREFIX = "p"


@pytest.fixture
def srv() -> Any:
    with HostileS3() as s:
        yield s


def _store(srv: HostileS3, **kwargs: Any) -> S3Store:
    client = make_s3_client(endpoint_url=srv.endpoint_url, path_style=True, botocore_max_attempts=1)
    return S3Store(client, BUCKET, PREFIX, **kwargs)


def _status_kib(field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert m is not None
    return int(m.group(1))


def test_endless_latest_is_refused_with_bounded_memory(srv: HostileS3) -> None:
    srv.set(f"{PREFIX}/latest", Behaviour("endless", limit_bytes=300 * MiB))
    with _store(srv) as store:
        Path("/proc/self/clear_refs").write_text(
            "5"
        )  # reset the peak RSS (VmHWM) to the current RSS
        before = _status_kib("VmRSS")
        result = run_bounded(lambda: read_latest_pointer(store), 30)
        growth_kib = _status_kib("VmHWM") - before
    assert type(result) is ManifestError, result
    assert f"s3://{BUCKET}/{PREFIX}/latest" in str(result) and str(MAX_POINTER_BYTES) in str(result)
    assert growth_kib < 64 * 1024, f"RSS grew {growth_kib} KiB"
    assert srv.requests[("GET", f"{PREFIX}/latest")] == 1  # not retried
    assert srv.sent[f"{PREFIX}/latest"] < 64 * MiB


def _peak_rss_kib(proc: subprocess.Popen[bytes], *, timeout_s: float) -> int:
    """The child's peak RSS since its exec (``VmHWM`` of /proc/<pid>/status, sampled every 20 ms
    until it exits; ``wait4``'s ``ru_maxrss`` would count the parent's RSS at fork: Linux keeps it
    across exec). SIGKILLs the child after ``timeout_s``."""
    peak, deadline = 0, time.monotonic() + timeout_s
    while proc.poll() is None:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]))
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            proc.kill()
        time.sleep(0.02)
    return peak


@pytest.mark.parametrize("command", ["ls", "restore"])
def test_cli_refuses_an_endless_latest(srv: HostileS3, tmp_path: Path, command: str) -> None:
    srv.set(f"{PREFIX}/latest", Behaviour("endless", limit_bytes=300 * MiB))
    local = ["--local", str(tmp_path / "run")] if command == "restore" else []
    cmd = [
        *cli_cmd(),
        command,
        "--remote",
        f"s3://{BUCKET}/{PREFIX}",
        *local,
        "--endpoint-url",
        srv.endpoint_url,
        "--path-style",
    ]
    err_path = tmp_path / "stderr"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=child_env())
        peak_kib = _peak_rss_kib(proc, timeout_s=60)
    text = err_path.read_text(errors="replace")
    assert proc.returncode == 1, text
    assert f"error: s3://{BUCKET}/{PREFIX}/latest is larger than the " in text, text
    assert peak_kib < 200 * 1024, f"peak RSS {peak_kib} KiB"  # the body was 300 MiB
    assert srv.sent[f"{PREFIX}/latest"] < 64 * MiB


@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_trickling_body_fails_within_the_stall_timeout(srv: HostileS3) -> None:
    srv.set(f"{PREFIX}/latest", Behaviour("trickle", size=1000, interval_s=0.3))
    settings = DeadlineSettings(stall_timeout_s=1.0, deadline_base_s=30.0)
    with _store(
        srv,
        deadlines=settings,
        retry=RetryPolicy(max_attempts=2, initial_wait_s=0.0, max_wait_s=0.0),
    ) as st:
        t0 = time.monotonic()
        result = run_bounded(lambda: st.get_bytes("latest", max_bytes=MAX_POINTER_BYTES), 15)
        elapsed = time.monotonic() - t0
    assert type(result) is UploadError, result
    assert isinstance(result.last_exception, RequestDeadlineError)
    assert "failed after 2 attempt(s)" in str(result) and "stalled: no bytes for 1.0 s" in str(
        result
    ), result
    assert elapsed < 4.0
    assert srv.requests[("GET", f"{PREFIX}/latest")] == 2  # retried: a deadline hit is retryable


@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_trickling_headers_fail_within_the_deadline(srv: HostileS3) -> None:
    srv.set(f"{PREFIX}/slow", Behaviour("trickle_headers", interval_s=0.05))
    settings = DeadlineSettings(stall_timeout_s=30.0, deadline_base_s=1.5)
    with _store(srv, deadlines=settings, retry=RetryPolicy(max_attempts=1)) as st:
        t0 = time.monotonic()
        result = run_bounded(lambda: st.head("slow"), 15)
        elapsed = time.monotonic() - t0
    assert type(result) is UploadError, result
    assert isinstance(result.last_exception, RequestDeadlineError)
    assert "deadline of 1.5 s passed" in str(result), result
    assert elapsed < 3.5


@pytest.mark.parametrize("kind", ["endless", "announced"])
def test_endless_list_answer_is_refused_with_bounded_memory(srv: HostileS3, kind: str) -> None:
    """A LIST page is read by botocore inside the call (no stream): its body is capped too.
    ``endless``: no Content-Length, zeros for ever; ``announced``: a 300 MiB Content-Length, refused
    before the body."""
    behaviour = (
        Behaviour("endless", limit_bytes=300 * MiB)
        if kind == "endless"
        else Behaviour("bigger", size=300 * MiB, big_size=300 * MiB)
    )
    srv.set(LIST_KEY, behaviour)
    with _store(
        srv, retry=RetryPolicy(max_attempts=2, initial_wait_s=0.05, max_wait_s=0.1)
    ) as store:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
        result = run_bounded(lambda: list(store.list_keys("step_")), 30)
        growth_kib = _status_kib("VmHWM") - before
    assert isinstance(result, UploadError), result
    assert "list_objects_v2" in str(result) and "16777216" in str(result), result
    assert growth_kib < 64 * 1024, f"RSS grew {growth_kib} KiB"
    attempts = 2  # each attempt is refused past the cap
    assert srv.requests[("GET", "")] <= attempts
    assert srv.sent[LIST_KEY] < attempts * (
        16 * MiB + 8 * MiB
    )  # the cap, plus what socket buffers took
