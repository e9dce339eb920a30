"""``restore --local DIR`` restores into DIR whatever its name looks like:
a directory named like a step directory (``/x/step_0000000003``) is the run root, never step 3
of ``/x``. Before the fix the step landed in ``/x/step_0000000005`` (and ``run.json`` in ``/x``):
outside the directory the user named."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from restore_util import files_under, publish
from s3_infra import S3Location

from tiered_ckpt import save_sharded
from tiered_ckpt.cli import main
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.layout import RUN_RECORD_NAME, step_dir_name

RUN = "c" * 32
STEP = 5


@pytest.mark.parametrize("exists", [False, True], ids=["new-dir", "existing-dir"])
def test_restore_into_a_dir_named_like_a_step(
    tmp_path: Path, s3_bucket: S3Location, exists: bool, capsys: pytest.CaptureFixture
) -> None:
    loc = s3_bucket
    src = tmp_path / "src"
    save_sharded(
        [{"w": np.arange(1000 + r, dtype=np.float32)} for r in range(2)],
        src,
        STEP,
        run_id=RUN,
        attempt=1,
    )
    publish(loc.client, loc.bucket, loc.prefix, src, STEP, schema=2)
    record = RunLineage.first(RUN, "2026-01-01T00:00:00.000000Z").to_json().encode()
    loc.client.put_object(Bucket=loc.bucket, Key=f"{loc.prefix}/{RUN_RECORD_NAME}", Body=record)
    x = tmp_path / "x"
    x.mkdir()
    target = x / step_dir_name(3)
    if exists:
        target.mkdir()
    rc = main(
        [
            "restore",
            "--remote",
            loc.url,
            "--local",
            str(target),
            "--endpoint-url",
            loc.endpoint_url,
            "--path-style",
            "--no-progress",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert os.listdir(x) == [step_dir_name(3)], files_under(x)  # nothing beside the directory named
    got = target / step_dir_name(STEP)
    assert f"into {got} " in out.out
    assert sorted(os.listdir(target)) == [RUN_RECORD_NAME, step_dir_name(STEP)]
    assert (target / RUN_RECORD_NAME).read_bytes() == record
    names = sorted(os.listdir(got))
    assert names == [
        "manifest.json",
        "rank_00000.safetensors",
        "rank_00001.safetensors",
        "uploaded.json",
    ], names
    for n in names[:3]:
        assert (got / n).read_bytes() == (src / step_dir_name(STEP) / n).read_bytes(), n
