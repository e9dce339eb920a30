"""A server that trickles: a tiny proxy in front of moto forwards every request and hands each
response back one byte at a time, far slower than any object needs and never slow enough for a
read timeout or a stall (a byte comes well within ``stall_timeout_s``).

With the default settings (``DeadlineSettings``: a small request's deadline, the operation's budget
across its retries) ``ls --remote`` and ``restore`` must fail with their usual typed errors within
seconds: before, each request of a few hundred bytes had the same deadline as a big part and each
operation 6 whole attempts of it (``ls --remote`` ran about 6 x 15 s before its first error).
"""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from s3_infra import FaultProxy, Predicate, Request, S3Location, match_all

from tiered_ckpt import restore
from tiered_ckpt.errors import CheckpointError, UploadError
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.remote.upload.uploader import Uploader
from tiered_ckpt.retry import RetryPolicy
from tiered_ckpt.store.s3 import S3Store, make_s3_client
from tiered_ckpt.store.settings import DeadlineSettings

#: What the tests allow a failing command (the bound they check) and the runner's own limit.
BOUND_S = 30.0
#: Seconds between two bytes of a trickled response (far below every stall and read timeout).
INTERVAL_S = 0.5


class TrickleProxy(FaultProxy):
    """A :class:`FaultProxy` whose responses to requests matching ``match`` leave one byte every
    ``interval_s`` seconds (status line and headers included) until the client goes away."""

    def __init__(self, upstream_url: str, *, interval_s: float, match: Predicate = match_all):
        super().__init__(upstream_url)
        self.interval_s, self.match = interval_s, match

    def _respond(  # type: ignore[override]
        self,
        wfile: io.BufferedWriter,
        req: Request,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> None:
        if not self.match(req):
            FaultProxy._respond(wfile, req, status, reason, headers, body)
            return
        whole = io.BytesIO()
        FaultProxy._respond(whole, req, status, reason, headers, body)
        for i in range(len(whole.getvalue())):
            if self._stopped.wait(self.interval_s):
                return
            wfile.write(whole.getvalue()[i : i + 1])  # the client gone: BrokenPipe ends the thread
            wfile.flush()


@pytest.fixture
def uploaded(tmp_path: Path, s3_bucket: S3Location) -> S3Location:
    """One committed step uploaded to moto directly (its ``latest`` pointer: a few hundred
    bytes)."""
    root = tmp_path / "run"
    save_sharded([{"w": np.arange(64, dtype=np.float32)}], root, 3)
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client) as up:
        up.upload_step(3)
    latest = s3_bucket.client.head_object(Bucket=s3_bucket.bucket, Key=f"{s3_bucket.prefix}/latest")
    assert 0 < latest["ContentLength"] < 1000
    return s3_bucket


def _ls_remote_cli(url: str, endpoint_url: str) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "tiered_ckpt.cli", "ls", "--remote", url]
    cmd += ["--endpoint-url", endpoint_url, "--path-style"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BOUND_S + 10)
    except subprocess.TimeoutExpired:
        return -1, "", "timed out", time.monotonic() - t0
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0


def _restore_api(url: str, endpoint_url: str, local: Path) -> tuple[BaseException | None, float]:
    client = make_s3_client(endpoint_url=endpoint_url, path_style=True)  # the product's defaults
    t0 = time.monotonic()
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            restore(url, local, s3_client=client)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box[0] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(BOUND_S + 10)  # the old code would run for minutes: give up, the test fails
    return (box[0] if not worker.is_alive() else TimeoutError("still running")), (
        time.monotonic() - t0
    )


@pytest.mark.slow  # about 16 s: the operation budget with the default settings, spent twice
def test_ls_remote_and_restore_fail_within_seconds_on_a_trickling_server(
    uploaded: S3Location, tmp_path: Path
) -> None:
    with TrickleProxy(uploaded.endpoint_url, interval_s=INTERVAL_S) as proxy:
        with ThreadPoolExecutor(2) as pool:  # side by side: the test takes the longer of the two
            ls_run = pool.submit(_ls_remote_cli, uploaded.url, proxy.url)
            restore_run = pool.submit(_restore_api, uploaded.url, proxy.url, tmp_path / "restored")
            rc, out, err, ls_s = ls_run.result()
            exc, restore_s = restore_run.result()
    print(f"ls --remote: exit {rc} after {ls_s:.1f} s; restore: {exc!r} after {restore_s:.1f} s")
    assert rc == 1 and out == "", (rc, out, err)
    errors = [ln for ln in err.splitlines() if ln.startswith("tiered-ckpt: error: ")]
    assert len(errors) == 1, err  # besides it: the WARNING lines of the deadlines and retries
    assert errors[0].startswith(f"tiered-ckpt: error: get {uploaded.url}/latest failed after "), err
    assert "(its time budget of 15.0 s spent)" in errors[0], errors[0]
    assert ls_s < BOUND_S, ls_s  # before: 6 x 19 s and the waits (122 s measured)
    assert type(exc) is UploadError and isinstance(exc, CheckpointError), repr(exc)
    assert "(its time budget of 15.0 s spent)" in str(exc), str(exc)
    assert restore_s < BOUND_S, restore_s
    assert not (tmp_path / "restored").exists()


def test_a_get_fails_within_its_budget_on_a_trickling_server(uploaded: S3Location) -> None:
    """The same with a budget of 1.5 s (0.5 s base, 3 x): the budget, not the attempt count, ends
    the operation; the typed error names it."""
    settings = DeadlineSettings(deadline_base_s=0.5, operation_budget_factor=3.0)
    with (
        TrickleProxy(uploaded.endpoint_url, interval_s=0.2) as proxy,
        S3Store(
            make_s3_client(endpoint_url=proxy.url, path_style=True),
            uploaded.bucket,
            uploaded.prefix,
            deadlines=settings,
            retry=RetryPolicy(max_attempts=6, initial_wait_s=0.05, max_wait_s=0.1),
        ) as store,
    ):
        t0 = time.monotonic()
        with pytest.raises(UploadError) as info:
            store.get_bytes("latest", max_bytes=1024)
        took = time.monotonic() - t0
    assert type(info.value) is UploadError
    assert str(info.value).startswith(f"get {uploaded.url}/latest failed after "), str(info.value)
    assert "(its time budget of 1.5 s spent)" in str(info.value)
    assert 1.4 < took < 3.0, took  # the budget: 1.5 s and a watchdog tick
