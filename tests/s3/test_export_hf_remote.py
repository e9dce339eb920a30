"""Hugging Face export straight from a bucket: a native step of two ranks and a DCP step, uploaded by
the real Uploader, exported from ``s3://bucket/prefix`` (API and command line) with no local copy,
file for file byte-equal to the export of the local step; a step the bucket lacks is a typed
error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from export_util import native_step
from s3_infra import S3Location
from s3_servers import both_servers
from test_client_compatibility import upload_with, user_client

from tiered_ckpt import Uploader
from tiered_ckpt.cli import main
from tiered_ckpt.errors import NoCheckpointError
from tiered_ckpt.export import export_hf
from tiered_ckpt.retry import RetryPolicy

FAST_RETRY = RetryPolicy(max_attempts=2, initial_wait_s=0.05, max_wait_s=0.1)


def _same_files(a: Path, b: Path) -> None:
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in os.listdir(a):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_export_from_bucket_equals_local(
    tmp_path: Path, s3_bucket: S3Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    import tiered_ckpt.dcp as tdcp

    root = native_step(tmp_path / "run", step=3)
    g = torch.Generator().manual_seed(1)
    model = {"enc.weight": torch.randn(6, 4, generator=g), "enc.bias": torch.randn(6, generator=g)}
    tdcp.save({"model": model, "optim": {"m": torch.zeros(3)}}, root, 5)
    with Uploader(root, s3_bucket.url, s3_client=s3_bucket.client, retry=FAST_RETRY) as up:
        up.upload_step(3)
        up.upload_step(5)

    for step in (3, 5):
        export_hf(root, tmp_path / f"local{step}", step=step, max_shard_size=100)
        res = export_hf(
            s3_bucket.url,
            tmp_path / f"remote{step}",
            step=step,
            s3_client=s3_bucket.client,
            max_shard_size=100,
        )
        assert res.step == step and res.source == s3_bucket.url
        _same_files(tmp_path / f"local{step}", tmp_path / f"remote{step}")

    # the command line, default step (the bucket's newest current one: the DCP step 5)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_bucket.endpoint_url)
    argv = ["export", "--hf", s3_bucket.url, str(tmp_path / "cli"), "--path-style"]
    assert main(argv + ["--max-shard-size", "100"]) == 0
    _same_files(tmp_path / "local5", tmp_path / "cli")

    with pytest.raises(NoCheckpointError):
        export_hf(s3_bucket.url, tmp_path / "x", step=4, s3_client=s3_bucket.client)
    assert not (tmp_path / "x").exists()


@both_servers
def test_export_with_a_default_boto3_client_equals_local(
    tmp_path: Path, s3_bucket: S3Location
) -> None:
    """The caller's own client with botocore's default checksum settings (every GetObject asks
    for ChecksumMode=ENABLED): the export's ranged reads still equal the local export, on moto
    and on SeaweedFS."""
    root = native_step(tmp_path / "run", step=3)
    client = user_client("default", s3_bucket)
    upload_with(client, root, s3_bucket, 3)
    export_hf(root, tmp_path / "local", step=3, max_shard_size=100)
    res = export_hf(s3_bucket.url, tmp_path / "remote", s3_client=client, max_shard_size=100)
    assert res.step == 3
    _same_files(tmp_path / "local", tmp_path / "remote")
