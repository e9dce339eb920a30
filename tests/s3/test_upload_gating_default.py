"""A manager that names a bucket keeps every local step the sidecar has not uploaded: rotation is
upload-gated by default whenever ``remote_url`` is given, both managers, bounded by
``max_pending_uploads``; ``upload_gated=False`` rotates by count alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests import s3_infra
from tiered_ckpt import CheckpointManager, DCPCheckpointManager, committed_steps
from tiered_ckpt.remote.upload.daemon import UploadLoop
from tiered_ckpt.remote.upload.uploader import Uploader


def _save(mgr, step: int) -> None:
    if isinstance(mgr, DCPCheckpointManager):
        import torch

        mgr.save(step, {"w": torch.full((4,), float(step))})
    else:
        mgr.save(step, {"w": np.full(4, step, dtype=np.float32)})
    mgr.wait()


@pytest.mark.parametrize("kind", ["native", "dcp"])
def test_a_named_bucket_gates_rotation_by_default(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, kind: str
) -> None:
    make = CheckpointManager if kind == "native" else DCPCheckpointManager
    root = tmp_path / "run"
    kw = dict(keep_last=2, max_pending_uploads=2, remote_url=s3_bucket.url, async_save=False)
    with make(root, s3_client=s3_bucket.client, **kw) as mgr:
        for s in (1, 2, 3, 4):  # no sidecar runs: nothing is uploaded
            _save(mgr, s)
        assert committed_steps(root) == [1, 2, 3, 4]  # 2 newest + 2 pending
        _save(mgr, 5)  # a third pending step passes max_pending_uploads: the oldest goes
        assert committed_steps(root) == [2, 3, 4, 5]
        with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client) as up:
            assert UploadLoop(up, poll_interval_s=0.01).run(once=True) == [5, 4, 3, 2]
        _save(mgr, 6)  # uploaded now: rotation by count again
        assert committed_steps(root) == [5, 6]


def test_upload_gated_false_rotates_by_count(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    root = tmp_path / "run"
    with CheckpointManager(
        root,
        keep_last=2,
        remote_url=s3_bucket.url,
        s3_client=s3_bucket.client,
        upload_gated=False,
        async_save=False,
    ) as mgr:
        for s in (1, 2, 3):
            _save(mgr, s)
    assert committed_steps(root) == [2, 3]
