"""Issue 10 on the remote tier, through the real CheckpointManager, the real sidecar (Uploader) and moto's
S3 server over HTTP: Why case 1 when the local disk is lost too (the rollback's new step, not the abandoned
branch's 700, is what a restart restores), the run record the manager publishes, and Why case 4 (a step
re-saved with ``replace=True`` is pending for the sidecar again and uploaded again)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from s3_infra import S3Location
from tiered_ckpt.layout import UPLOADED_MARKER_NAME, step_dir_name
from tiered_ckpt.local import committed_steps, save_sharded
from tiered_ckpt.remote.upload import Uploader
from tiered_ckpt.training.manager import CheckpointManager


def state(step: int) -> dict:
    return {"w": np.full(8, float(step), dtype=np.float32), "step": step}


def upload(root: Path, loc: S3Location, *steps: int) -> None:
    with Uploader(root, loc.url, s3_client=loc.client) as up:
        for s in steps:
            up.upload_step(s)


def manager(root: Path, loc: S3Location) -> CheckpointManager:
    return CheckpointManager(root, keep_last=3, async_save=False, remote_url=loc.url, remote_s3_client=loc.client)


def remote_run_record(loc: S3Location) -> dict | None:
    try:
        body = loc.client.get_object(Bucket=loc.bucket, Key=f"{loc.prefix}/run.json")["Body"].read()
    except loc.client.exceptions.NoSuchKey:
        return None
    return json.loads(body)


def test_rollback_then_cluster_loss_restores_the_new_lineage(s3_bucket: S3Location, tmp_path: Path) -> None:
    root = tmp_path / "run"
    with manager(root, s3_bucket) as mgr:
        for s in (500, 600, 700):
            mgr.save(s, state(s))
    upload(root, s3_bucket, 500, 600, 700)
    # Rollback: resume from 500 and train on; 510 is saved and uploaded.
    with manager(root, s3_bucket) as mgr:
        assert mgr.load(500)["step"] == 500
        mgr.save(510, state(510))
    upload(root, s3_bucket, 510)
    shutil.rmtree(root)  # then the whole cluster is lost
    with manager(root, s3_bucket) as mgr:
        got = mgr.load()
        assert got["step"] == 510  # before issue 10: 700, a step of the abandoned branch
        assert mgr.attempt == 2
    rec = remote_run_record(s3_bucket)
    assert rec is not None and [(a["attempt"], a["supersedes_from"], a["resumed_from"]) for a in rec["attempts"]] == [
        (1, None, None), (2, 501, 500)]
    assert json.loads((root / "run.json").read_text()) == rec  # the restored root continues the same run


def test_the_first_save_claims_the_prefix_for_the_run(s3_bucket: S3Location, tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert remote_run_record(s3_bucket) is None
    with manager(root, s3_bucket) as mgr:
        mgr.save(1, state(1))
        run_id = mgr.run_id
    rec = remote_run_record(s3_bucket)
    assert rec is not None and rec["run_id"] == run_id and len(rec["attempts"]) == 1


def test_replace_makes_the_step_pending_again_for_the_sidecar(s3_bucket: S3Location, tmp_path: Path) -> None:
    """Why case 4, library level: save_sharded(replace=True) of an uploaded step."""
    root = tmp_path / "run"
    save_sharded([state(5)], root, 5)
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client) as up:
        up.upload_step(5)
        assert up.pending_steps() == []
    assert (root / step_dir_name(5) / UPLOADED_MARKER_NAME).exists()
    new = {"w": np.full(8, -1.0, dtype=np.float32), "step": 5}
    save_sharded([new], root, 5, replace=True)
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client) as up:
        assert up.pending_steps() == [5]  # before issue 10: [] (the old marker still counted)
        up.upload_step(5)
        assert up.pending_steps() == []
    shutil.rmtree(root)
    with manager(root, s3_bucket) as mgr:
        assert mgr.load()["w"].tolist() == [-1.0] * 8  # the restore brings the new bytes back
    assert committed_steps(root) == [5]
