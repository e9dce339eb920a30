"""Two CLI faults (in-process ``cli.main`` against moto's S3 server):

- ``ls --remote`` marked the save the ``latest`` pointer names with ``*`` even when the bucket's run
  record supersedes it (a rollback published, its first step not uploaded yet): only the current
  save is marked (table and JSON);
- ``restore --local <a regular file>`` reported "cannot claim the writer lock ... File exists": it
  now says that --local is not a directory (exit 1, one line) and touches nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from s3_infra import S3Location

from tiered_ckpt.cli import main
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.layout import RUN_RECORD_NAME
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.remote.upload.uploader import Uploader

T0 = "2026-01-01T00:00:00.000000Z"
RUN = "a" * 32


def _s3(loc: S3Location) -> list[str]:
    return ["--endpoint-url", loc.endpoint_url, "--path-style"]


@pytest.fixture
def rolled_back(tmp_path: Path, s3_bucket: S3Location) -> S3Location:
    """Attempt 1 uploaded 500/600/700 (``latest`` names 700); attempt 2 (from 501) is published to
    the bucket, as the manager does before its first save, and nothing of it is uploaded yet."""
    root = tmp_path / "run"
    root.mkdir()
    lin = RunLineage.first(RUN, T0)
    (root / RUN_RECORD_NAME).write_text(lin.to_json())
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client) as up:
        for s in (500, 600, 700):
            save_sharded([{"w": np.full(4, float(s), np.float32)}], root, s)
            up.upload_step(s)
    lin2 = lin.new_attempt(supersedes_from=501, resumed_from=500, started_at=T0)
    s3_bucket.client.put_object(
        Bucket=s3_bucket.bucket,
        Key=f"{s3_bucket.prefix}/{RUN_RECORD_NAME}",
        Body=lin2.to_json().encode(),
    )
    return s3_bucket


def test_ls_remote_marks_only_a_current_save_latest(
    rolled_back: S3Location, capsys: pytest.CaptureFixture
) -> None:
    loc = rolled_back
    assert main(["ls", "--remote", loc.url, *_s3(loc), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"].split(" ")[0], r["latest"]) for r in rows] == [
        (500, "current", False),
        (600, "superseded", False),
        (700, "superseded", False),
    ]  # before: 700 True
    assert main(["ls", "--remote", loc.url, *_s3(loc)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any("*" in line for line in lines[1:]), lines  # before: '*' on superseded 700
    # the state column says superseded, as the local ls does (before: "committed" with a note)
    assert [line.split()[:2] for line in lines[1:]] == [
        ["500", "committed"],
        ["600", "superseded"],
        ["700", "superseded"],
    ]
    assert [r["shown_state"] for r in rows] == ["committed", "superseded", "superseded"]


def test_ls_remote_still_marks_the_current_latest(
    tmp_path: Path, s3_bucket: S3Location, capsys: pytest.CaptureFixture
) -> None:
    root = tmp_path / "run"
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client) as up:
        for s in (1, 2):
            save_sharded([{"w": np.full(4, float(s), np.float32)}], root, s)
            up.upload_step(s)
    assert main(["ls", "--remote", s3_bucket.url, *_s3(s3_bucket), "--json"]) == 0
    assert [(r["step"], r["latest"]) for r in json.loads(capsys.readouterr().out)] == [
        (1, False),
        (2, True),
    ]
    assert main(["ls", "--remote", s3_bucket.url, *_s3(s3_bucket)]) == 0
    rows = {int(line.split()[0]): line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "*" in rows[2] and "*" not in rows[1]


@pytest.mark.parametrize("dry_run", [False, True])
def test_restore_into_a_regular_file_says_not_a_directory(
    rolled_back: S3Location, tmp_path: Path, capsys: pytest.CaptureFixture, dry_run: bool
) -> None:
    loc = rolled_back
    target = tmp_path / "a-file"
    target.write_bytes(b"keep me")
    argv = ["restore", "--remote", loc.url, "--local", str(target), *_s3(loc), "--no-progress"]
    assert main(argv + (["--dry-run"] if dry_run else [])) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert (
        err[0] == f"tiered-ckpt: error: --local {target} is not a directory"
    )  # before: writer lock, File exists
    assert target.read_bytes() == b"keep me"
    below = target / "sub"  # a path below a regular file: the same answer
    assert (
        main(["restore", "--remote", loc.url, "--local", str(below), *_s3(loc), "--no-progress"])
        == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tiered-ckpt: error: --local {below} is not a directory ({target} is not one)"]


def test_restore_api_into_a_regular_file_is_a_typed_error(
    rolled_back: S3Location, tmp_path: Path
) -> None:
    from tiered_ckpt import restore
    from tiered_ckpt.errors import CheckpointWriteError

    target = tmp_path / "a-file"
    target.write_bytes(b"keep me")
    with pytest.raises(CheckpointWriteError, match="is not a directory"):
        restore(rolled_back.url, target, s3_client=rolled_back.client)
    assert target.read_bytes() == b"keep me"
