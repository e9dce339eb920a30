"""``tiered-ckpt restore`` into a redirected stderr: no progress bar, so no
carriage returns in a log file; ``--progress`` forces the bar (in-process ``cli.main``: pytest's
captured stderr is not a terminal)."""

from __future__ import annotations

from pathlib import Path

import pytest
from restore_util import publish, save_step
from s3_infra import S3Location

from tiered_ckpt.cli import main


def test_no_bar_in_redirected_stderr_unless_forced(
    tmp_path: Path, s3_bucket: S3Location, capsys: pytest.CaptureFixture[str]
) -> None:
    save_step(tmp_path / "src", 5, world_size=2)
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, tmp_path / "src", 5)
    base = [
        "restore",
        "--remote",
        s3_bucket.url,
        "--endpoint-url",
        s3_bucket.endpoint_url,
        "--path-style",
    ]
    assert main([*base, "--local", str(tmp_path / "a")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("restored step 5 ")
    assert err == ""  # no bar, no carriage return
    assert main([*base, "--local", str(tmp_path / "b"), "--progress"]) == 0
    err = capsys.readouterr().err
    assert "\r" in err and "restore step 5: 100%" in err
