"""Lineage on the remote tier, through the real CheckpointManager, the real sidecar (Uploader) and
moto's S3 server over HTTP: a rollback when the local disk is lost too (the rollback's new step, not
the abandoned branch's 700, is what a restart restores), the run record the manager publishes, and
a re-save (a step re-saved with ``replace=True`` is pending for the sidecar again and uploaded
again)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from s3_infra import S3Location

from tiered_ckpt.layout import UPLOADED_MARKER_NAME, step_dir_name
from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.remote.upload.uploader import Uploader
from tiered_ckpt.training.manager import CheckpointManager


def state(step: int) -> dict:
    return {"w": np.full(8, float(step), dtype=np.float32), "step": step}


def upload(root: Path, loc: S3Location, *steps: int) -> None:
    with Uploader(root, loc.url, s3_client=loc.client) as up:
        for s in steps:
            up.upload_step(s)


def manager(root: Path, loc: S3Location) -> CheckpointManager:
    return CheckpointManager(
        root, keep_last=3, async_save=False, remote_url=loc.url, s3_client=loc.client
    )


def remote_run_record(loc: S3Location) -> dict | None:
    try:
        body = loc.client.get_object(Bucket=loc.bucket, Key=f"{loc.prefix}/run.json")["Body"].read()
    except loc.client.exceptions.NoSuchKey:
        return None
    return json.loads(body)


def test_rollback_then_cluster_loss_restores_the_new_lineage(
    s3_bucket: S3Location, tmp_path: Path
) -> None:
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
        assert got["step"] == 510  # without lineage: 700, a step of the abandoned branch
        assert mgr.attempt == 2
    rec = remote_run_record(s3_bucket)
    assert rec is not None and [
        (a["attempt"], a["supersedes_from"], a["resumed_from"]) for a in rec["attempts"]
    ] == [(1, None, None), (2, 501, 500)]
    assert (
        json.loads((root / "run.json").read_text()) == rec
    )  # the restored root continues the same run


def test_the_first_save_claims_the_prefix_for_the_run(
    s3_bucket: S3Location, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    assert remote_run_record(s3_bucket) is None
    with manager(root, s3_bucket) as mgr:
        mgr.save(1, state(1))
        run_id = mgr.run_id
    rec = remote_run_record(s3_bucket)
    assert rec is not None and rec["run_id"] == run_id and len(rec["attempts"]) == 1


def test_replace_makes_the_step_pending_again_for_the_sidecar(
    s3_bucket: S3Location, tmp_path: Path
) -> None:
    """A re-save, library level: save_sharded(replace=True) of an uploaded step."""
    root = tmp_path / "run"
    save_sharded([state(5)], root, 5)
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client) as up:
        up.upload_step(5)
        assert up.pending_steps() == []
    assert (root / step_dir_name(5) / UPLOADED_MARKER_NAME).exists()
    new = {"w": np.full(8, -1.0, dtype=np.float32), "step": 5}
    save_sharded([new], root, 5, replace=True)
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client) as up:
        assert up.pending_steps() == [5]  # without lineage: [] (the old marker still counted)
        up.upload_step(5)
        assert up.pending_steps() == []
    shutil.rmtree(root)
    with manager(root, s3_bucket) as mgr:
        assert mgr.load()["w"].tolist() == [-1.0] * 8  # the restore brings the new bytes back
    assert committed_steps(root) == [5]


# --- review fixes


def dead_client():
    """A client whose endpoint refuses connections (a bucket outage), with the test client's
    settings."""
    from s3_infra import make_test_client
    from spawn import free_port

    return make_test_client(f"http://127.0.0.1:{free_port()}", botocore_max_attempts=1)


def local_attempts(root: Path) -> list[tuple]:
    rec = json.loads((root / "run.json").read_text())
    return [(a["attempt"], a["supersedes_from"], a["resumed_from"]) for a in rec["attempts"]]


@pytest.mark.slow  # the dead endpoint costs the store's whole retry schedule (about 7 s a load)
def test_outage_at_load_supersedes_what_the_bucket_may_hold(
    s3_bucket: S3Location, tmp_path: Path
) -> None:
    """The bucket cannot be read when the job resumes from the local tier, which lost 600 and 700:
    the load starts a new attempt, so the bucket's 600 and 700 are superseded once the sidecar
    publishes the record. Before the fix the decision silently saw the local tier only: attempt 1,
    600' and 650 were uploaded as attempt 1 and after a cluster loss load() restored 700, the
    abandoned branch."""
    root = tmp_path / "run"
    with manager(root, s3_bucket) as mgr:
        for s in (500, 600, 700):
            mgr.save(s, state(s))
    upload(root, s3_bucket, 500, 600, 700)
    for s in (600, 700):
        shutil.rmtree(root / step_dir_name(s))
    with CheckpointManager(
        root,
        keep_last=3,
        async_save=False,
        remote_url=s3_bucket.url,
        s3_client=dead_client(),
    ) as mgr:
        assert mgr.load()["step"] == 500
        assert mgr.attempt == 2  # before the fix: 1
        mgr.save(600, {"w": np.full(8, -600.0, dtype=np.float32), "step": 600})
        assert local_attempts(root) == [(1, None, None), (2, 501, 500)]  # recorded by the save
        mgr.save(650, state(650))
    assert [a["attempt"] for a in remote_run_record(s3_bucket)["attempts"]] == [
        1
    ]  # not published: unreadable
    upload(
        root, s3_bucket, 600, 650
    )  # the sidecar, once the bucket is back, publishes the record first
    assert remote_run_record(s3_bucket) == json.loads((root / "run.json").read_text())
    shutil.rmtree(root)  # cluster loss
    with manager(root, s3_bucket) as mgr:
        got = mgr.load()
        assert got["step"] == 650 and got["w"].tolist() == [650.0] * 8  # before the fix: 700
        assert mgr.attempt == 2
        assert (
            mgr.load(600)["w"].tolist() == [-600.0] * 8
        )  # the new 600 (a rollback: attempt 3 from 601)
        assert mgr.attempt == 3


@pytest.mark.slow  # the dead endpoint costs the store's whole retry schedule (about 7 s)
def test_outage_at_the_first_save_supersedes_what_the_bucket_may_hold(
    s3_bucket: S3Location, tmp_path: Path
) -> None:
    """The same at a first save without a load (a restart that trains on from 550 of its own):
    before the fix 550 was saved as attempt 1 and after a cluster loss load() restored the bucket's
    700."""
    root = tmp_path / "run"
    with manager(root, s3_bucket) as mgr:
        for s in (500, 600, 700):
            mgr.save(s, state(s))
    upload(root, s3_bucket, 500, 600, 700)
    for s in (600, 700):
        shutil.rmtree(root / step_dir_name(s))
    with CheckpointManager(
        root,
        keep_last=3,
        async_save=False,
        remote_url=s3_bucket.url,
        s3_client=dead_client(),
    ) as mgr:
        mgr.save(550, state(550))
        assert mgr.attempt == 2  # before the fix: 1
    assert local_attempts(root) == [(1, None, None), (2, 550, None)]
    upload(root, s3_bucket, 550)
    shutil.rmtree(root)
    with manager(root, s3_bucket) as mgr:
        assert mgr.load()["step"] == 550 and mgr.attempt == 2  # before the fix: 700


@pytest.mark.slow  # the dead endpoint costs the store's whole retry schedule (about 7 s a load)
def test_outage_at_load_into_an_empty_root_is_not_a_fresh_start(
    s3_bucket: S3Location, tmp_path: Path
) -> None:
    """An empty root and an unreadable bucket: load() raises UploadError naming the bucket and the
    cause, not NoCheckpointError (a caller's 'except NoCheckpointError: start fresh' would train
    from scratch and later claim the prefix over the run's steps); nothing is written. Before the
    fix: NoCheckpointError."""
    from tiered_ckpt.errors import NoCheckpointError, UploadError

    src = tmp_path / "src"
    save_sharded([state(5)], src, 5)
    upload(src, s3_bucket, 5)
    root = tmp_path / "run"
    with CheckpointManager(
        root, async_save=False, remote_url=s3_bucket.url, s3_client=dead_client()
    ) as mgr:
        with pytest.raises(UploadError) as info:
            mgr.load()
        assert not isinstance(info.value, NoCheckpointError)
        assert s3_bucket.url in str(info.value) and "could not be read" in str(info.value)
        with pytest.raises(UploadError):
            mgr.load(5)
        assert mgr.attempt is None
    assert os.listdir(root) == []


@pytest.mark.parametrize("kind", ["malformed", "empty", "oversized"])
def test_an_unreadable_bucket_run_record_is_a_manifest_error(
    s3_bucket: S3Location, tmp_path: Path, kind: str
) -> None:
    """A bad <prefix>/run.json decides nothing: load() raises ManifestError (before the fix the
    bucket was dropped from the decision and an empty root raised NoCheckpointError: a fresh
    start)."""
    from tiered_ckpt.errors import ManifestError
    from tiered_ckpt.local.catalogue import MAX_RUN_RECORD_BYTES

    src = tmp_path / "src"
    save_sharded([state(5)], src, 5)
    upload(src, s3_bucket, 5)
    body = {
        "malformed": b'{"schema_version": 1, "run_id": "r", "attempts": []}',
        "empty": b"",
        "oversized": b" " * (MAX_RUN_RECORD_BYTES + 1),
    }[kind]
    s3_bucket.client.put_object(
        Bucket=s3_bucket.bucket, Key=f"{s3_bucket.prefix}/run.json", Body=body
    )
    root = tmp_path / "run"
    with manager(root, s3_bucket) as mgr:
        with pytest.raises(ManifestError, match="run.json|run record"):
            mgr.load()
        assert mgr.attempt is None
    assert os.listdir(root) == []


def test_world_size_mismatch_is_checked_before_restoring(
    s3_bucket: S3Location, tmp_path: Path
) -> None:
    """A 1-rank load of a 2-rank step in the bucket raises WorldSizeMismatchError with nothing
    downloaded or recorded (before the fix rank 0's shard was restored into the root first)."""
    from tiered_ckpt.errors import WorldSizeMismatchError

    src = tmp_path / "src"
    save_sharded([state(5), state(5)], src, 5)
    upload(src, s3_bucket, 5)
    root = tmp_path / "run"
    with manager(root, s3_bucket) as mgr:
        with pytest.raises(WorldSizeMismatchError, match="step 5 was saved by 2 ranks, but 1"):
            mgr.load()
        assert mgr.attempt is None
    assert os.listdir(root) == []
