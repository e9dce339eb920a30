"""The sidecar as a real process (``tiered-ckpt upload --watch``): SIGKILL at random points,
SIGTERM; on moto and on SeaweedFS."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import s3_infra
from _upload_util import list_keys, make_step, remote_bytes, save_prefix
from s3_servers import both_servers
from spawn import python_cmd

from tiered_ckpt.format.upload_manifest import UploadManifest
from tiered_ckpt.layout import UPLOADED_MARKER_NAME, step_dir_name
from tiered_ckpt.local.catalogue import committed_steps, read_manifest

MiB = 1024 * 1024


def _start(root: Path, loc: s3_infra.S3Location, *extra: str) -> subprocess.Popen[bytes]:
    """Start the sidecar; its log goes to ``<root>.log`` (a pipe nobody reads would block it)."""
    cmd = python_cmd(
        "-m",
        "tiered_ckpt.cli",
        "--log-level",
        "INFO",
        "upload",
        "--local",
        root,
        "--remote",
        loc.url,
        "--endpoint-url",
        loc.endpoint_url,
        "--path-style",
        "--watch",
        "--poll-interval-s",
        "0.1",
        "--part-size-mib",
        "5",
        "--multipart-threshold-mib",
        "6",
        "--max-concurrency",
        "4",
        *extra,
    )
    log = open(f"{root}.log", "ab")
    try:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    finally:
        log.close()


def _uploaded(root: Path) -> set[int]:
    return {
        s
        for s in committed_steps(root)
        if (root / step_dir_name(s) / UPLOADED_MARKER_NAME).is_file()
    }


def _check_no_unconfirmed(loc: s3_infra.S3Location, verify_bytes: bool) -> list[int]:
    """Every upload manifest names shards whose confirmation record and object exist with the right
    size (and, with ``verify_bytes``, the right sha256). Returns the remotely committed steps."""
    steps = []
    for key in list_keys(loc):
        if not key.endswith("/upload_manifest.json"):
            continue
        um = UploadManifest.from_json(remote_bytes(loc, key))
        steps.append(um.step)
        sp = key.rsplit("/", 1)[0]
        for sh in um.shards:
            rec = json.loads(remote_bytes(loc, f"{sp}/.confirm/rank_{sh.rank:05d}.json"))
            assert rec["sha256"] == sh.sha256 and rec["size_bytes"] == sh.size_bytes
            head = loc.client.head_object(Bucket=loc.bucket, Key=sh.key)
            assert head["ContentLength"] == sh.size_bytes
            if verify_bytes:
                assert hashlib.sha256(remote_bytes(loc, sh.key)).hexdigest() == sh.sha256
    return sorted(steps)


@pytest.mark.slow
@both_servers
def test_sigkill_at_random_points_then_restart(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    rng = random.Random(int(os.environ.get("TC_SIGKILL_SEED", "1234")))
    root = tmp_path / "node"
    next_step = 1
    for _ in range(3):
        make_step(root, next_step, shard_bytes=7 * MiB)
        next_step += 1
    kills = 0  # 12 per server (24 kill points over both): the suite's time budget
    deadline = time.monotonic() + 40
    while kills < 12 and time.monotonic() < deadline:
        if _uploaded(root) == set(committed_steps(root)):  # keep work in flight for every kill
            make_step(root, next_step, shard_bytes=7 * MiB)
            next_step += 1
        proc = _start(root, s3_bucket)
        time.sleep(rng.uniform(0.7, 1.8))  # interpreter start is ~0.7 s; kill anywhere after it
        proc.kill()
        proc.wait()
        kills += 1
        _check_no_unconfirmed(s3_bucket, verify_bytes=False)
    assert kills >= 12
    log_path = Path(f"{root}.log")
    started_before = log_path.read_text().count("sidecar: ")
    proc = _start(root, s3_bucket)
    try:
        t_end = time.monotonic() + 60
        while _uploaded(root) != set(committed_steps(root)) and time.monotonic() < t_end:
            time.sleep(0.2)
        assert _uploaded(root) == set(committed_steps(root))
        # The killed sidecars may have finished every step already: then SIGTERM could land before
        # this one has installed its handler (its "sidecar: ..." line is logged right after) and
        # kill it.
        while (
            log_path.read_text().count("sidecar: ") == started_before and time.monotonic() < t_end
        ):
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - t0 < 20
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    remote = _check_no_unconfirmed(s3_bucket, verify_bytes=True)
    assert remote == committed_steps(root)
    for s in remote:
        sp = save_prefix(s3_bucket, root, s)
        assert (
            remote_bytes(s3_bucket, f"{sp}/manifest.json")
            == (root / step_dir_name(s) / "manifest.json").read_bytes()
        )
        assert read_manifest(root, s).step == s
    assert not s3_bucket.client.list_multipart_uploads(Bucket=s3_bucket.bucket).get("Uploads")


@both_servers
def test_sigterm_mid_upload_exits_zero_and_leaves_nothing(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    root = tmp_path / "node"
    make_step(root, 1, shard_bytes=40 * MiB)
    proc = _start(root, s3_bucket)
    try:
        t_end = time.monotonic() + 30
        while time.monotonic() < t_end:
            if s3_bucket.client.list_multipart_uploads(Bucket=s3_bucket.bucket).get("Uploads"):
                break
            time.sleep(0.05)
        else:
            pytest.fail("no multipart upload started")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        err = Path(f"{root}.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, err[-2000:]
    assert elapsed < 15
    assert "secret" not in err.lower() and "testing" not in err  # credentials never logged
    assert not s3_bucket.client.list_multipart_uploads(Bucket=s3_bucket.bucket).get("Uploads")
    keys = list_keys(s3_bucket)
    assert not [k for k in keys if k.endswith("upload_manifest.json")] or _uploaded(root) == {1}


@both_servers
def test_cli_once_json_and_errors(tmp_path: Path, s3_bucket: s3_infra.S3Location, capsys) -> None:
    from tiered_ckpt.cli import main

    root = tmp_path / "node"
    make_step(root, 1, shard_bytes=1 * MiB)
    make_step(root, 2, shard_bytes=1 * MiB)
    base = [
        "upload",
        "--local",
        str(root),
        "--remote",
        s3_bucket.url,
        "--endpoint-url",
        s3_bucket.endpoint_url,
        "--path-style",
    ]
    assert main([*base, "--once", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in out] == [2, 1] and {r["state"] for r in out} == {"committed"}
    assert main([*base, "--json"]) == 0 and json.loads(capsys.readouterr().out) == []
    assert main(["upload", "--local", str(root), "--remote", "http://nope"]) == 2
    assert "s3://" in capsys.readouterr().err
    assert main([*base, "--step", "99"]) == 1
    assert "step 99" in capsys.readouterr().err
