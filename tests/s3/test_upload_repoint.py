"""The "uploaded" marker names the remote it was written for: a sidecar pointed at another bucket or
prefix (or a step restored from another bucket) still uploads there (moto server over HTTP)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from _upload_util import SMALL, make_step
from s3_infra import S3Location

from tiered_ckpt import Uploader, restore
from tiered_ckpt.layout import UPLOADED_MARKER_NAME, step_dir_name
from tiered_ckpt.remote.restore.restorer import remote_committed_steps
from tiered_ckpt.remote.upload.daemon import UploadLoop
from tiered_ckpt.retry import RetryPolicy

FAST = RetryPolicy(max_attempts=3, initial_wait_s=0.05, max_wait_s=0.2)


def _uploader(root: Path, url: str, loc: S3Location) -> Uploader:
    return Uploader(root, url, s3_client=loc.client, retry=FAST, **SMALL)


def test_marker_of_another_remote_leaves_the_step_pending(
    tmp_path: Path, s3_bucket: S3Location
) -> None:
    root = tmp_path / "run"
    for s in (1, 2):
        make_step(root, s, world_size=2, shard_bytes=1 << 20)
    url_a = s3_bucket.url
    url_b = f"s3://{s3_bucket.bucket}/{s3_bucket.prefix}-other"
    with _uploader(root, url_a, s3_bucket) as up:
        assert up.pending_steps() == [2, 1]
        UploadLoop(up).run(once=True)
        assert up.pending_steps() == []
    marker = json.loads((root / step_dir_name(2) / UPLOADED_MARKER_NAME).read_bytes())
    assert marker["remote"] == url_a

    # Re-pointed at another prefix: both steps are pending there and get uploaded.
    with _uploader(root, url_b, s3_bucket) as up:
        assert up.pending_steps() == [2, 1]
        UploadLoop(up).run(once=True)
        assert up.pending_steps() == []
    assert remote_committed_steps(url_b, s3_client=s3_bucket.client) == [1, 2]

    # A step restored from A into a fresh root is pending for a sidecar that uploads to B' ...
    fresh = tmp_path / "fresh"
    restore(url_a, fresh, s3_client=s3_bucket.client)
    url_c = f"s3://{s3_bucket.bucket}/{s3_bucket.prefix}-third"
    with _uploader(fresh, url_c, s3_bucket) as up:
        assert up.pending_steps() == [2]
    # ... but not for one that uploads back to A (the restore marked it as already there).
    with _uploader(fresh, url_a, s3_bucket) as up:
        assert up.pending_steps() == []
    shutil.rmtree(fresh)
