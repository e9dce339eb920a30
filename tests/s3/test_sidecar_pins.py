"""The sidecar loop mirrors a pin made after its step was uploaded (SPEC §11: a pin made through the
manager holds in the bucket too), through Uploader.mirror_pins, once."""

from __future__ import annotations

from pathlib import Path

import s3_infra
from _upload_util import list_keys, make_step

from tiered_ckpt import Uploader
from tiered_ckpt.layout import PINNED_MARKER_NAME, save_entry_name
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.local.pins import pin_step
from tiered_ckpt.remote.upload.daemon import UploadLoop


def test_a_pin_made_after_the_upload_reaches_the_bucket(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    root = tmp_path / "node"
    make_step(root, 1, world_size=2, shard_bytes=16 * 1024)
    key = f"{s3_bucket.prefix}/{save_entry_name(1, read_manifest(root, 1).save_id)}/{PINNED_MARKER_NAME}"
    with Uploader(root, s3_bucket.url, s3_client=s3_infra.make_test_client(fault_proxy.url)) as up:
        assert UploadLoop(up, poll_interval_s=0.01).run(once=True) == [1]
        assert key not in list_keys(s3_bucket)
        pin_step(root, 1)
        assert UploadLoop(up, poll_interval_s=0.01).run(once=True) == []
        assert key in list_keys(s3_bucket)
        n = len(fault_proxy.requests)
        UploadLoop(up, poll_interval_s=0.01).run(once=True)
        # Later passes: no pin request (remembered); only the start's sweep of abandoned uploads.
        assert [r.method for r in fault_proxy.requests[n:] if PINNED_MARKER_NAME in r.target] == []


def test_a_fifo_or_symlink_pin_is_mirrored_without_opening_it(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    """A pinned.json that is a FIFO (or a symlink out of the root) counts as pinned; mirroring it
    must not block on the FIFO nor upload the symlink's target: a placeholder pin goes to the
    bucket."""
    import json
    import os

    root = tmp_path / "node"
    make_step(root, 1, world_size=1, shard_bytes=4096)
    make_step(root, 2, world_size=1, shard_bytes=4096)
    secret = tmp_path / "secret"
    secret.write_text("do not upload me")
    os.mkfifo(root / "step_0000000001" / PINNED_MARKER_NAME)
    os.symlink(secret, root / "step_0000000002" / PINNED_MARKER_NAME)
    with Uploader(
        root, s3_bucket.url, s3_client=s3_infra.make_test_client(s3_bucket.endpoint_url)
    ) as up:
        assert sorted(UploadLoop(up, poll_interval_s=0.01).run(once=True)) == [1, 2]
    client = s3_infra.make_test_client(s3_bucket.endpoint_url)
    for step in (1, 2):
        key = f"{s3_bucket.prefix}/{save_entry_name(step, read_manifest(root, step).save_id)}/{PINNED_MARKER_NAME}"
        body = client.get_object(Bucket=s3_bucket.bucket, Key=key)["Body"].read()
        assert json.loads(body) == {"pinned_at": None, "step": step}
