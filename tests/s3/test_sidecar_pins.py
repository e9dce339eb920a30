"""The sidecar loop mirrors a pin made after its step was uploaded (SPEC §11: a pin made through the
manager holds in the bucket too), through Uploader.mirror_pins, once."""

from __future__ import annotations

from pathlib import Path

import s3_infra
from _upload_util import list_keys, make_step
from tiered_ckpt import Uploader
from tiered_ckpt.layout import PINNED_MARKER_NAME, save_entry_name
from tiered_ckpt.local import read_manifest
from tiered_ckpt.local.pins import pin_step


def test_a_pin_made_after_the_upload_reaches_the_bucket(tmp_path: Path, s3_bucket: s3_infra.S3Location,
                                                         fault_proxy: s3_infra.FaultProxy) -> None:
    root = tmp_path / "node"
    make_step(root, 1, world_size=2, shard_bytes=16 * 1024)
    key = f"{s3_bucket.prefix}/{save_entry_name(1, read_manifest(root, 1).save_id)}/{PINNED_MARKER_NAME}"
    with Uploader(root, s3_bucket.url, s3_client=s3_infra.make_test_client(fault_proxy.url)) as up:
        assert up.run(once=True, poll_interval_s=0.01) == [1]
        assert key not in list_keys(s3_bucket)
        pin_step(root, 1)
        assert up.run(once=True, poll_interval_s=0.01) == []
        assert key in list_keys(s3_bucket)
        n = len(fault_proxy.requests)
        up.run(once=True, poll_interval_s=0.01)
        # Later passes: no pin request (remembered); only the start's sweep of abandoned uploads.
        assert [r.method for r in fault_proxy.requests[n:] if PINNED_MARKER_NAME in r.target] == []
