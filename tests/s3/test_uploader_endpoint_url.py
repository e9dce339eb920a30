"""``Uploader(endpoint_url=...)`` builds its own client for that endpoint, as
``restore(endpoint_url=...)`` does (it once raised ``TypeError``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import s3_infra

from tiered_ckpt import Uploader, load_sharded, restore, save_sharded


def test_uploader_endpoint_url_round_trip(tmp_path: Path, s3_bucket: s3_infra.S3Location) -> None:
    states = [{"w": np.arange(6, dtype=np.float32) + r} for r in range(2)]
    save_sharded(states, tmp_path / "a", step=3)
    with Uploader(tmp_path / "a", s3_bucket.url, endpoint_url=s3_bucket.endpoint_url) as up:
        um = up.upload_step(3)
    assert um.step == 3 and um.world_size == 2
    keys = [
        o["Key"]
        for o in s3_bucket.client.list_objects_v2(Bucket=s3_bucket.bucket, Prefix=s3_bucket.prefix)[
            "Contents"
        ]
    ]
    assert any(k.endswith("/upload_manifest.json") for k in keys)
    m = restore(s3_bucket.url, tmp_path / "b", endpoint_url=s3_bucket.endpoint_url)
    assert m.step == 3
    got = load_sharded(tmp_path / "b", expected_world_size=2)
    assert [g["w"].tolist() for g in got] == [s["w"].tolist() for s in states]


def test_uploader_endpoint_url_and_client_conflict(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    with pytest.raises(ValueError, match="^pass s3_client or endpoint_url, not both$"):
        Uploader(
            tmp_path, s3_bucket.url, s3_client=s3_bucket.client, endpoint_url=s3_bucket.endpoint_url
        )
