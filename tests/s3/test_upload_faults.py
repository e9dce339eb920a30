"""Uploader under injected faults (tests/s3_infra.py FaultProxy in front of moto's server)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import s3_infra
from _upload_util import SMALL, list_keys, make_step, remote_bytes, save_prefix

from tiered_ckpt import ShardCorruptedError, Uploader, UploadError
from tiered_ckpt.layout import UPLOADED_MARKER_NAME, step_dir_name
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.remote.upload.uploader import LocalStepGoneError
from tiered_ckpt.retry import RetryPolicy

FAST_RETRY = RetryPolicy(max_attempts=6, initial_wait_s=0.05, max_wait_s=0.3)


def _no_mpu(loc: s3_infra.S3Location) -> bool:
    return not loc.client.list_multipart_uploads(Bucket=loc.bucket).get("Uploads")


def _check_remote_equals_local(loc: s3_infra.S3Location, root: Path, step: int) -> None:
    sp = save_prefix(loc, root, step)
    for rec in read_manifest(root, step).shards:
        assert (
            remote_bytes(loc, f"{sp}/{rec.path}")
            == (root / step_dir_name(step) / rec.path).read_bytes()
        )


@pytest.mark.slow  # about 3 s (quick-tier budget)
def test_slowdown_resets_and_flipped_byte_are_retried_and_verified(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    root = tmp_path / "node"
    make_step(root, 1)
    make_step(root, 2)
    slow_parts = fault_proxy.fail_first(3, s3_infra.is_upload_part)
    slow_complete = fault_proxy.fail_first(1, s3_infra.is_complete_multipart)
    resets = fault_proxy.reset_first(2, s3_infra.is_upload_part)
    client = s3_infra.make_test_client(fault_proxy.url, botocore_max_attempts=3)
    with Uploader(root, s3_bucket.url, s3_client=client, retry=FAST_RETRY, **SMALL) as up:
        up.upload_step(1)
        assert slow_parts.applied == 3 and slow_complete.applied == 1 and resets.applied == 2
        fault_proxy.clear_rules()
        # A byte flipped in transit: moto stores the damaged part silently (it validates no
        # checksum); the read-back catches it and the shard is sent again.
        flip = fault_proxy.flip_byte_first(1, s3_infra.is_upload_part)
        before = fault_proxy.count(lambda r: r.method == "POST" and r.target.endswith("?uploads"))
        um = up.upload_step(2)
    assert flip.applied == 1
    creates = (
        fault_proxy.count(lambda r: r.method == "POST" and r.target.endswith("?uploads")) - before
    )
    assert creates == 5  # 4 shards + 1 re-sent
    assert all(s.confirmed_by == "read-back" for s in um.shards)
    for step in (1, 2):
        _check_remote_equals_local(s3_bucket, root, step)
    assert _no_mpu(s3_bucket)


@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_dead_bucket_fails_cleanly_then_recovers(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    from tiered_ckpt.remote.upload.metrics import UploadMetrics

    root = tmp_path / "node"
    make_step(root, 4)
    dead = fault_proxy.fail_all(status=503, code="ServiceUnavailable")
    client = s3_infra.make_test_client(fault_proxy.url)
    metrics = UploadMetrics()
    with Uploader(
        root,
        s3_bucket.url,
        s3_client=client,
        metrics=metrics,
        retry=RetryPolicy(max_attempts=2, initial_wait_s=0.01, max_wait_s=0.02),
        **SMALL,
    ) as up:
        with pytest.raises(UploadError) as ei:
            up.upload_step(4)
        assert ei.value.last_exception is not None and "ServiceUnavailable" in str(ei.value)
        assert metrics.failures._value.get() == 1
        assert list_keys(s3_bucket) == []  # nothing committed (asked of moto directly)
        assert not (root / step_dir_name(4) / UPLOADED_MARKER_NAME).exists()
        assert up.pending_steps() == [4]  # kept locally, retried later
        fault_proxy.remove_rule(dead)
        um = up.upload_step(4)
    assert um.step == 4 and up.pending_steps() == []
    _check_remote_equals_local(s3_bucket, root, 4)


def test_local_rot_fails_the_step_without_commit(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    root = tmp_path / "node"
    make_step(root, 2)
    shard = root / step_dir_name(2) / "rank_00002.safetensors"
    with open(shard, "r+b") as f:  # a flipped byte deep in the data, after the commit
        f.seek(9 * 1024 * 1024)
        b = f.read(1)
        f.seek(9 * 1024 * 1024)
        f.write(bytes([b[0] ^ 0x01]))
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client, retry=FAST_RETRY, **SMALL) as up:
        with pytest.raises(ShardCorruptedError, match="rank_00002"):
            up.upload_step(2)
        assert up.pending_steps() == [2]
    keys = list_keys(s3_bucket)
    assert not [k for k in keys if k.endswith("upload_manifest.json")]
    assert not [
        k for k in keys if k.endswith("rank_00002.safetensors") or k.endswith("rank_00002.json")
    ]
    assert _no_mpu(s3_bucket)


def test_step_deleted_under_the_sidecar(tmp_path: Path, s3_bucket: s3_infra.S3Location) -> None:
    root = tmp_path / "node"
    make_step(root, 3)
    sdir = root / step_dir_name(3)
    fired = []

    def delete_once(_n: int) -> None:
        if not fired:
            fired.append(1)
            shutil.rmtree(sdir)

    with Uploader(
        root,
        s3_bucket.url,
        s3_client=s3_bucket.client,
        retry=FAST_RETRY,
        on_progress=delete_once,
        **SMALL,
    ) as up:
        with pytest.raises(LocalStepGoneError):
            up.upload_step(3)
        with pytest.raises(LocalStepGoneError):
            up.upload_step(3)
        assert up.pending_steps() == []
    assert not [k for k in list_keys(s3_bucket) if k.endswith("upload_manifest.json")]
    assert _no_mpu(s3_bucket)
