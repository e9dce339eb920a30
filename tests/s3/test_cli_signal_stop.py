"""Ctrl-C (SIGINT) and SIGTERM stop a CLI command within 2 s: transfers in flight cut, multipart
uploads aborted, nothing committed; exit 130 (SIGINT) or 143 (SIGTERM), one line on stderr. ``upload
--watch`` keeps its clean stop (exit 0). Real ``tiered-ckpt`` processes on real servers; each signal
is sent once the transfer is seen under way on the server or the disk, never after a guessed
delay."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
from _upload_util import list_keys, make_step
from restore_util import files_under, publish
from s3_infra import S3Location
from s3_servers import seaweedfs_only
from spawn import child_env, python_cmd

from tiered_ckpt import committed_steps, save_sharded
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.fs import utc_now
from tiered_ckpt.layout import (
    LATEST_POINTER_NAME,
    RUN_RECORD_NAME,
    UPLOAD_MANIFEST_NAME,
    UPLOADED_MARKER_NAME,
    step_dir_name,
)

MiB = 1024 * 1024
#: The bound the issue sets: from the signal to the process gone.
STOP_WITHIN_S = 2.0
LINE = {
    signal.SIGINT: "tiered-ckpt: interrupted (SIGINT)\n",
    signal.SIGTERM: "tiered-ckpt: interrupted (SIGTERM)\n",
}
RC = {signal.SIGINT: 130, signal.SIGTERM: 143}


@pytest.fixture(scope="module")
def big_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One committed local step of 512 MiB in 8 shards, more than the 4 an uploader sends at once
    (cheap bytes: the point is the transfer). No test commits it, so the tests share it."""
    root = tmp_path_factory.mktemp("big") / "node"
    save_sharded([{"w": np.arange(16 * MiB, dtype=np.int32) + r} for r in range(8)], root, 1)
    return root


def _wait(cond, what: str, proc: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if proc.poll() is not None:
            pytest.fail(
                f"the command ended (rc {proc.returncode}) before {what}: {proc.communicate()}"
            )
        if time.monotonic() > end:
            proc.kill()
            pytest.fail(f"no {what} within {timeout_s} s")
        time.sleep(0.01)


def _signal_and_wait(proc: subprocess.Popen[str], sig: int) -> tuple[float, str, str]:
    """Send ``sig``; return the seconds until the process was gone, its stdout and stderr."""
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return time.monotonic() - t0, out, err


def _first_part_landed(loc: S3Location) -> bool:
    for u in loc.client.list_multipart_uploads(Bucket=loc.bucket).get("Uploads", []):
        if loc.client.list_parts(Bucket=loc.bucket, Key=u["Key"], UploadId=u["UploadId"]).get(
            "Parts"
        ):
            return True
    return False


@seaweedfs_only
@pytest.mark.parametrize(
    "mode, sig, level, rc",
    [
        ("--once", signal.SIGINT, "WARNING", 130),
        ("--once", signal.SIGTERM, "INFO", 143),
        ("--watch", signal.SIGINT, "INFO", 0),
    ],
    ids=["once-SIGINT", "once-SIGTERM", "watch-SIGINT"],
)
def test_signal_mid_upload_stops_within_2s(
    big_root: Path,
    s3_bucket: S3Location,
    mode: str,
    sig: int,
    level: str,
    rc: int,
    default_sigint: None,
) -> None:
    """``--once``: parts in flight cut, 130/143 and the one line (all of stderr at the default
    level); ``--watch`` (SIGTERM: tests/multiproc/test_sidecar.py): its clean stop, exit 0. Either
    way no multipart upload is left and nothing is committed; the shards queued behind the first
    four (ranks 4-7) are never started (the INFO log names each shard started)."""
    # 5 MiB parts, 2 in flight: the 512 MiB take many seconds, so the signal lands mid-upload
    proc = subprocess.Popen(
        python_cmd(
            "-m",
            "tiered_ckpt.cli",
            "--log-level",
            level,
            "upload",
            mode,
            "--local",
            big_root,
            "--remote",
            s3_bucket.url,
            "--endpoint-url",
            s3_bucket.endpoint_url,
            "--path-style",
            "--part-size-mib",
            "5",
            "--multipart-threshold-mib",
            "5",
            "--max-concurrency",
            "2",
            "--no-progress",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    _wait(lambda: _first_part_landed(s3_bucket), "multipart part on the server", proc)
    elapsed, out, err = _signal_and_wait(proc, sig)
    assert (proc.returncode, out, elapsed < STOP_WITHIN_S) == (rc, "", True), (elapsed, err)
    assert "Traceback" not in err and " ERROR " not in err, err
    if level == "WARNING":
        assert err == LINE[sig]
    elif rc:
        assert err.endswith(LINE[sig]), err
    assert not re.search(r"rank [4-7]: uploading", err), err
    assert not s3_bucket.client.list_multipart_uploads(Bucket=s3_bucket.bucket).get("Uploads")
    keys = list_keys(s3_bucket)
    assert not [k for k in keys if k.endswith((UPLOAD_MANIFEST_NAME, LATEST_POINTER_NAME))], keys
    assert not (big_root / step_dir_name(1) / UPLOADED_MARKER_NAME).exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_before_the_command_runs_is_one_line(
    tmp_path: Path, sig: int, default_sigint: None
) -> None:
    """A signal while the CLI still imports its subcommands (before any command runs): the one line
    and 130/143, no traceback. Delivered at that point by an audit hook on the execution of a
    module's code."""
    code = (
        "import os, sys\n"
        "sys.addaudithook(lambda ev, a: ev == 'exec' and getattr(a[0], 'co_filename', '').endswith("
        f"'upload_cmd.py') and os.kill(os.getpid(), {int(sig)}))\n"
        "from tiered_ckpt.cli import main\n"
        f"sys.exit(main(['ls', {str(tmp_path)!r}]))\n"
    )
    out = subprocess.run(python_cmd("-c", code), capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (RC[sig], "", LINE[sig])


class _Valve:
    """A TCP relay in front of the S3 server that stops passing the server's answers once a GET of a
    shard (a request line naming ``rank_``) went through: a server that stalls mid-transfer, which
    no deadline short of the 60 s stall timeout would cut. ``stalled`` is set then."""

    def __init__(self, upstream_url: str) -> None:
        u = urlsplit(upstream_url)
        self._upstream = (u.hostname, u.port)
        self.stalled = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(self._upstream)
            threading.Thread(target=self._pipe, args=(conn, up, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, conn, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if (
                    from_client
                    and data.startswith(b"GET ")
                    and b"rank_" in data.split(b"\r\n", 1)[0]
                ):
                    self.stalled.set()
                if not from_client and self.stalled.is_set():
                    continue  # held back: the client waits for bytes that never come
                dst.sendall(data)
        except OSError:
            pass
        if not from_client and self.stalled.is_set():
            return  # the server is done; the client's connection stays open, silent
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def stalling(tmp_path: Path, s3_bucket: S3Location):
    """A committed remote step (2 small shards) behind a :class:`_Valve` that stalls its first shard
    GET."""
    src = tmp_path / "src"
    save_sharded([{"w": np.arange(256 * 1024, dtype=np.int32) + r} for r in range(2)], src, 5)
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, src, 5)
    valve = _Valve(s3_bucket.endpoint_url)
    yield valve, s3_bucket
    valve.close()


@pytest.mark.slow  # a CLI process (~1 s)
def test_sigterm_during_a_stalled_restore_stops_within_2s(stalling, tmp_path: Path) -> None:
    valve, loc = stalling
    dest = tmp_path / "dest"
    proc = subprocess.Popen(
        python_cmd(
            "-m",
            "tiered_ckpt.cli",
            "restore",
            "--remote",
            loc.url,
            "--local",
            dest,
            "--no-progress",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(AWS_ENDPOINT_URL=valve.url),
    )
    _wait(
        lambda: valve.stalled.is_set() and any(p.suffix == ".tmp" for p in dest.rglob("*")),
        "shard download staged",
        proc,
    )
    elapsed, out, err = _signal_and_wait(proc, signal.SIGTERM)
    assert (proc.returncode, out, err, elapsed < STOP_WITHIN_S) == (
        143,
        "",
        LINE[signal.SIGTERM],
        True,
    ), elapsed
    assert committed_steps(dest) == []
    assert not [
        f for f in files_under(dest) if f.endswith((".tmp", ".safetensors", "manifest.json"))
    ]


@pytest.mark.slow  # a CLI process (~1 s)
def test_sigint_during_a_stalled_verify_remote_stops_within_2s(
    stalling, tmp_path: Path, default_sigint: None
) -> None:
    valve, loc = stalling
    proc = subprocess.Popen(
        python_cmd("-m", "tiered_ckpt.cli", "verify", "--remote", loc.url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(AWS_ENDPOINT_URL=valve.url),
    )
    _wait(valve.stalled.is_set, "shard GET", proc)
    elapsed, out, err = _signal_and_wait(proc, signal.SIGINT)
    assert (proc.returncode, out, err, elapsed < STOP_WITHIN_S) == (
        130,
        "",
        LINE[signal.SIGINT],
        True,
    ), elapsed


def _upload_args(root: Path, loc: S3Location, *flags: str) -> list[str]:
    return [
        "upload",
        "--local",
        str(root),
        "--remote",
        loc.url,
        "--endpoint-url",
        loc.endpoint_url,
        "--path-style",
        "--no-progress",
        "--poll-interval-s",
        "0.1",
        *flags,
    ]


def test_upload_once_step_uploads_that_step_only(
    tmp_path: Path, s3_bucket: S3Location, capsys
) -> None:
    """``--once --step N`` (refused as mutually exclusive before): step N alone; a step not
    committed locally is one line and exit 1; ``--watch --step`` is a usage error."""
    from tiered_ckpt.cli import main

    root = tmp_path / "node"
    for step in (2, 3):
        make_step(root, step, world_size=2, shard_bytes=16 * 1024)
    assert main(_upload_args(root, s3_bucket, "--once", "--step", "2")) == 0
    out = capsys.readouterr()
    assert (
        out.out.startswith("step 2: committed remotely (")
        and out.out.count("\n") == 1
        and not out.err
    )
    assert [(root / step_dir_name(s) / UPLOADED_MARKER_NAME).is_file() for s in (2, 3)] == [
        True,
        False,
    ]
    assert len([k for k in list_keys(s3_bucket) if k.endswith(UPLOAD_MANIFEST_NAME)]) == 1
    assert main(_upload_args(root, s3_bucket, "--once", "--step", "9")) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(
        f"tiered-ckpt: error: step 9 is not committed under {root} "
    )
    assert out.err.count("\n") == 1
    assert main(_upload_args(root, s3_bucket, "--watch", "--step", "2")) == 2
    assert "--watch" in capsys.readouterr().err


def test_watch_on_a_prefix_of_another_run_is_one_line(
    tmp_path: Path, s3_bucket: S3Location, capsys
) -> None:
    """The sidecar stops on a prefix claimed by another run with the CLI's one line (it also logged
    an ERROR line before)."""
    from tiered_ckpt.cli import main

    root = tmp_path / "node"
    root.mkdir()
    (root / RUN_RECORD_NAME).write_text(RunLineage.first("runA", utc_now()).to_json())
    make_step(root, 3, world_size=2, shard_bytes=16 * 1024)
    s3_bucket.client.put_object(
        Bucket=s3_bucket.bucket,
        Key=f"{s3_bucket.prefix}/{RUN_RECORD_NAME}",
        Body=RunLineage.first("runB", utc_now()).to_json().encode(),
    )
    assert main(_upload_args(root, s3_bucket, "--watch")) == 1
    # the sidecar's INFO lines (its default level) say where it runs; the failure is one line, no
    # ERROR log
    lines = [ln for ln in capsys.readouterr().err.splitlines() if " INFO tiered_ckpt." not in ln]
    assert len(lines) == 1 and lines[0].startswith("tiered-ckpt: error: ") and "runB" in lines[0], (
        lines
    )
