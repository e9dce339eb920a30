"""A restore into a step directory that a dead restore left behind starts clean:
the dead owner's temp files and downloads are removed before the download, and the shard
it had already renamed into place is replaced; before the fix the rerun committed around the
leftovers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
from restore_util import publish
from s3_infra import S3Location

from tiered_ckpt import committed_steps, read_manifest, save_sharded
from tiered_ckpt.cli import main
from tiered_ckpt.fs import node_identity
from tiered_ckpt.layout import SAVE_LOCK_NAME, step_dir_name

STEP = 5


def test_restore_clears_a_dead_restores_leftovers(
    tmp_path: Path, s3_bucket: S3Location, capsys
) -> None:
    loc = s3_bucket
    src = tmp_path / "src"
    save_sharded([{"w": np.arange(50_000 + r, dtype=np.float32)} for r in range(2)], src, STEP)
    publish(loc.client, loc.bucket, loc.prefix, src, STEP, schema=2)
    p = subprocess.Popen(["true"])
    p.wait()
    dead = f"{node_identity()}.{p.pid}.12345"
    sdir = tmp_path / "dest" / step_dir_name(STEP)
    sdir.mkdir(parents=True)
    lock = {
        "save_id": read_manifest(src, STEP).save_id,
        "owner": dead,
        "created_at": "2026-01-01T00:00:00Z",
    }
    (sdir / SAVE_LOCK_NAME).write_text(json.dumps(lock))
    (sdir / "rank_00000.safetensors").write_bytes(
        b"\0" * 100_000
    )  # renamed into place, then killed
    (sdir / f".rank_00001.safetensors.{dead}.0123456789ab.tmp").write_bytes(b"\1" * 70_000)
    (sdir / f".rank_00001.safetensors.{dead}.0123456789ac.tmp.5f5f5f5f.download").write_bytes(
        b"\2" * 90_000
    )
    rc = main(
        [
            "restore",
            "--remote",
            loc.url,
            "--local",
            str(tmp_path / "dest"),
            "--endpoint-url",
            loc.endpoint_url,
            "--path-style",
            "--no-progress",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert committed_steps(tmp_path / "dest") == [STEP]
    names = sorted(os.listdir(sdir))
    assert names == [
        "manifest.json",
        "rank_00000.safetensors",
        "rank_00001.safetensors",
        "uploaded.json",
    ], names
    for n in names[:3]:
        assert (sdir / n).read_bytes() == (src / step_dir_name(STEP) / n).read_bytes(), n
