"""The sidecar on a prefix claimed by another run (fencing, seen from the CLI and the
daemon; SPEC §11): ``tiered-ckpt upload`` as a real process against the moto server.

Without ``--adopt-prefix`` both modes end with one error line and exit 1 and upload nothing (the
``--watch`` sidecar stops by itself: it must not keep uploading into another run's prefix); with it
the prefix is taken over and the step is committed.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import s3_infra
from _upload_util import list_keys, make_step
from spawn import python_cmd

from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.fs import utc_now
from tiered_ckpt.layout import RUN_RECORD_NAME, UPLOADED_MARKER_NAME, step_dir_name

pytestmark = pytest.mark.slow


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


@pytest.fixture
def claimed(tmp_path: Path, s3_bucket: s3_infra.S3Location) -> tuple[Path, s3_infra.S3Location]:
    """A root of run ``runA`` with step 3, and a prefix claimed by run ``runB``."""
    root = tmp_path / "root"
    root.mkdir()
    (root / RUN_RECORD_NAME).write_text(RunLineage.first("runA", utc_now()).to_json())
    make_step(root, 3, world_size=2, shard_bytes=16 * 1024)
    s3_bucket.client.put_object(
        Bucket=s3_bucket.bucket,
        Key=f"{s3_bucket.prefix}/{RUN_RECORD_NAME}",
        Body=RunLineage.first("runB", utc_now()).to_json().encode(),
    )
    return root, s3_bucket


def _refused(out: subprocess.CompletedProcess[str], root: Path, loc: s3_infra.S3Location) -> None:
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("tiered-ckpt: error: ") and "runB" in last and "runA" in last
    assert "RunMismatchError" not in last  # no class name at the default verbosity
    assert "--adopt-prefix" in last
    assert list_keys(loc) == [f"{loc.prefix}/{RUN_RECORD_NAME}"]  # nothing of the step went up
    assert not (root / step_dir_name(3) / UPLOADED_MARKER_NAME).exists()


def test_once_is_refused_with_one_line(claimed: tuple[Path, s3_infra.S3Location]) -> None:
    root, loc = claimed
    out = _upload(root, loc, "--once")
    _refused(out, root, loc)
    assert out.stderr.strip().count("\n") == 0  # exactly one line


def test_watch_stops_by_itself(claimed: tuple[Path, s3_infra.S3Location]) -> None:
    root, loc = claimed
    out = _upload(root, loc, "--watch")  # returns on its own: subprocess.run's timeout would raise
    _refused(out, root, loc)


def test_adopt_prefix_takes_it_over(claimed: tuple[Path, s3_infra.S3Location]) -> None:
    root, loc = claimed
    out = _upload(root, loc, "--once", "--adopt-prefix", "--json")
    assert out.returncode == 0, out.stderr
    rec = RunLineage.from_json(
        loc.client.get_object(Bucket=loc.bucket, Key=f"{loc.prefix}/{RUN_RECORD_NAME}")[
            "Body"
        ].read()
    )
    assert rec.run_id == "runA"
    assert (root / step_dir_name(3) / UPLOADED_MARKER_NAME).is_file()
    assert any(k.endswith("/upload_manifest.json") for k in list_keys(loc))
