"""A root without ``run.json`` (written by ``save_sharded``, or by a tiered_ckpt before lineage records)
and a prefix claimed by a run (SPEC §11 fencing), seen from ``tiered-ckpt upload --once`` as a real
process against the moto server.

Before the fix the fencing was skipped for such a root (``claim_or_check(store, None)`` checked
nothing): its step went up into run A's prefix, ``latest`` named it, and a restore brought it into
run A. Now the claimed prefix refuses it (RunMismatchError naming the claim and --adopt-prefix; exit
1, one line, nothing uploaded, no uploaded.json) unless --adopt-prefix; an unclaimed prefix takes it
as before.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import s3_infra
from _upload_util import list_keys, make_step
from spawn import python_cmd

from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.layout import (
    LATEST_POINTER_NAME,
    RUN_RECORD_NAME,
    UPLOADED_MARKER_NAME,
    step_dir_name,
)

pytestmark = pytest.mark.slow

T0 = "2026-01-01T00:00:00.000000Z"
RUN_A = "a" * 32


def _upload(root: Path, loc: s3_infra.S3Location, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        python_cmd(
            "-m",
            "tiered_ckpt.cli",
            "upload",
            "--local",
            root,
            "--remote",
            loc.url,
            "--endpoint-url",
            loc.endpoint_url,
            "--path-style",
            "--poll-interval-s",
            "0.1",
            "--no-progress",
            *flags,
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _plain_root(tmp_path: Path) -> Path:
    root = tmp_path / "plain"
    make_step(root, 5, world_size=2, shard_bytes=16 * 1024)  # save_sharded: no run.json
    assert not (root / RUN_RECORD_NAME).exists()
    return root


def _claim(loc: s3_infra.S3Location) -> bytes:
    body = RunLineage.first(RUN_A, T0).to_json().encode()
    loc.client.put_object(Bucket=loc.bucket, Key=f"{loc.prefix}/{RUN_RECORD_NAME}", Body=body)
    return body


def test_root_without_record_is_refused_by_a_claimed_prefix(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    root, loc = _plain_root(tmp_path), s3_bucket
    claim = _claim(loc)
    out = _upload(root, loc, "--once")
    assert out.returncode == 1, (out.stdout, out.stderr)  # before the fix: 0, the step uploaded
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("tiered-ckpt: error: this root has no run.json ")  # no class name
    assert RUN_A in lines[0] and "--adopt-prefix" in lines[0] and RUN_RECORD_NAME in lines[0]
    assert list_keys(loc) == [f"{loc.prefix}/{RUN_RECORD_NAME}"]  # no shard, no latest
    assert not (root / step_dir_name(5) / UPLOADED_MARKER_NAME).exists()
    got = loc.client.get_object(Bucket=loc.bucket, Key=f"{loc.prefix}/{RUN_RECORD_NAME}")[
        "Body"
    ].read()
    assert got == claim  # the claim untouched


def test_root_without_record_adopts_a_claimed_prefix_only_when_told(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    root, loc = _plain_root(tmp_path), s3_bucket
    claim = _claim(loc)
    out = _upload(root, loc, "--once", "--adopt-prefix")
    assert out.returncode == 0, out.stderr
    assert (root / step_dir_name(5) / UPLOADED_MARKER_NAME).is_file()
    assert f"{loc.prefix}/{LATEST_POINTER_NAME}" in list_keys(loc)
    got = loc.client.get_object(Bucket=loc.bucket, Key=f"{loc.prefix}/{RUN_RECORD_NAME}")[
        "Body"
    ].read()
    assert got == claim  # a root without a record has nothing to claim with


def test_root_without_record_on_an_unclaimed_prefix_uploads_as_before(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    root, loc = _plain_root(tmp_path), s3_bucket
    out = _upload(root, loc, "--once")
    assert out.returncode == 0, out.stderr
    assert (root / step_dir_name(5) / UPLOADED_MARKER_NAME).is_file()
    keys = list_keys(loc)
    assert (
        f"{loc.prefix}/{LATEST_POINTER_NAME}" in keys
        and f"{loc.prefix}/{RUN_RECORD_NAME}" not in keys
    )
    assert (
        _upload(root, loc, "--once").returncode == 0
    )  # a second upload on the same (still unclaimed) prefix
