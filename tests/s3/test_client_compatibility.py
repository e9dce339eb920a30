"""The product with the caller's own boto3 client: every remote read and write works whatever the
client's checksum settings.

``default``: a client as ``boto3.client("s3", endpoint_url=...)`` builds it, botocore's
defaults (``request_checksum_calculation`` and ``response_checksum_validation`` both
``when_supported`` since botocore 1.36: every GetObject asks for ``ChecksumMode=ENABLED`` and
botocore wraps the body to validate it). ``when_required``: the settings the product's own client
uses. On moto and on SeaweedFS, through upload, restore, verify (full and ``--fast``), status,
ls, both managers' load of a rank missing locally and the DCP reader. The shards are sent as one
PUT each (under the multipart threshold), the case the default client broke: the product reads GET
bodies itself, past botocore's checksum wrapper, which then validated zero bytes and failed.

The caller's client is not changed for the caller's other uses: after all of it, a GetObject the
caller sends itself is still validated by botocore (``ChecksumMode`` asked for, the wrapper in
place).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
import torch
from botocore.config import Config
from s3_infra import S3Location
from s3_servers import both_servers

from tiered_ckpt import CheckpointManager, DCPCheckpointManager, Uploader, restore
from tiered_ckpt import dcp as tdcp
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.remote.catalogue import list_remote_steps, remote_committed_steps
from tiered_ckpt.remote.handle import StoreHandle
from tiered_ckpt.remote.inspect.run_status import read_status
from tiered_ckpt.remote.inspect.verify import scan_remote
from tiered_ckpt.retry import RetryPolicy

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FAST_RETRY = RetryPolicy(max_attempts=2, initial_wait_s=0.05, max_wait_s=0.1)
#: Each rank's shard: 3 MiB of float32, one PUT (the multipart threshold is 64 MiB).
NUMEL = 3 * 1024 * 1024 // 4

CLIENTS = ("default", "when_required")


def user_client(kind: str, loc: S3Location) -> Any:
    """The caller's client: botocore's defaults, or ``when_required`` for both checksum settings.
    Path-style addressing as the test servers need; nothing else set. A new boto3 session reads
    the environment now (boto3's default session keeps what it read first: a session token the
    SeaweedFS tests remove)."""
    if kind == "default":
        return boto3.session.Session().client(
            "s3", endpoint_url=loc.endpoint_url, config=Config(s3={"addressing_style": "path"})
        )
    return boto3.session.Session().client(
        "s3",
        endpoint_url=loc.endpoint_url,
        config=Config(
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def states(world: int, step: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(step)
    return [{"w": rng.standard_normal(NUMEL, dtype=np.float32)} for _ in range(world)]


def upload_with(client: Any, root: Path, loc: S3Location, *steps: int) -> None:
    with Uploader(root, loc.url, s3_client=client, retry=FAST_RETRY) as up:
        for s in steps:
            up.upload_step(s)


def assert_caller_client_unchanged(client: Any, loc: S3Location, kind: str) -> None:
    """A GetObject the caller sends itself behaves as the caller's settings say: the default client
    still asks for the checksum and validates the body (the wrapper reads it whole and matches)."""
    key = next(
        o["Key"]
        for o in client.list_objects_v2(Bucket=loc.bucket, Prefix=loc.prefix)["Contents"]
        if o["Key"].endswith(".safetensors")
    )
    resp = client.get_object(Bucket=loc.bucket, Key=key)
    body = resp["Body"].read()
    assert len(body) == resp["ContentLength"] > 0
    validated = "StreamingChecksumBody" in type(resp["Body"]).__name__
    assert validated == (kind == "default")


@both_servers
@pytest.mark.parametrize("kind", CLIENTS)
def test_upload_restore_verify_status_ls(tmp_path: Path, s3_bucket: S3Location, kind: str) -> None:
    client = user_client(kind, s3_bucket)
    node = tmp_path / "node"
    want = states(2, 4)
    save_sharded(want, node, 4)
    upload_with(client, node, s3_bucket, 4)

    back = tmp_path / "back"
    m = restore(s3_bucket.url, back, s3_client=client)
    assert m.step == 4
    for r in range(2):
        src = node / step_dir_name(4) / f"rank_{r:05d}.safetensors"
        got = back / step_dir_name(4) / f"rank_{r:05d}.safetensors"
        assert got.read_bytes() == src.read_bytes()

    for fast in (False, True):
        (status,) = scan_remote(s3_bucket.url, fast=fast, s3_client=client)
        assert (status.step, status.ok) == (4, True), status.details

    assert remote_committed_steps(s3_bucket.url, s3_client=client) == [4]
    assert [s.step for s in list_remote_steps(s3_bucket.url, s3_client=client)] == [4]
    with StoreHandle(s3_bucket.url, s3_client=client) as store:
        (run,) = read_status(node, store)
    assert (run.newest_local_step, run.newest_remote_step) == (4, 4), run.to_dict()
    assert_caller_client_unchanged(client, s3_bucket, kind)


@both_servers
@pytest.mark.parametrize("kind", CLIENTS)
def test_native_manager_restores_a_missing_rank(
    tmp_path: Path, s3_bucket: S3Location, kind: str
) -> None:
    client = user_client(kind, s3_bucket)
    root = tmp_path / "run"
    want = states(1, 6)[0]
    with CheckpointManager(
        root, remote_url=s3_bucket.url, s3_client=client, async_save=False
    ) as mgr:
        mgr.save(6, want)
    upload_with(client, root, s3_bucket, 6)
    shard = root / step_dir_name(6) / "rank_00000.safetensors"
    shard.unlink()
    with CheckpointManager(
        root, remote_url=s3_bucket.url, s3_client=client, async_save=False
    ) as mgr:
        got = mgr.load()
    assert mgr.loaded_step == 6
    np.testing.assert_array_equal(got["w"], want["w"])
    assert read_manifest(root, 6).step == 6
    assert_caller_client_unchanged(client, s3_bucket, kind)


@both_servers
@pytest.mark.parametrize("kind", CLIENTS)
def test_dcp_manager_and_reader_read_a_missing_shard_from_the_bucket(
    tmp_path: Path, s3_bucket: S3Location, kind: str
) -> None:
    client = user_client(kind, s3_bucket)
    root = tmp_path / "run"
    g = torch.Generator().manual_seed(8)
    want = {"w": torch.randn(NUMEL, generator=g), "b": torch.randn(16, generator=g)}
    with DCPCheckpointManager(
        root, remote_url=s3_bucket.url, s3_client=client, async_save=False
    ) as mgr:
        mgr.save(8, want)
    upload_with(client, root, s3_bucket, 8)
    kept = tmp_path / "kept"
    shutil.copytree(root, kept)

    (root / step_dir_name(8) / "rank_00000.safetensors").unlink()
    into = {k: torch.zeros_like(v) for k, v in want.items()}
    assert tdcp.load(into, root, remote_url=s3_bucket.url, s3_client=client) == 8
    for k in want:
        assert torch.equal(into[k], want[k]), k

    shutil.rmtree(root)
    shutil.copytree(kept, root)
    (root / step_dir_name(8) / "rank_00000.safetensors").unlink()
    into = {k: torch.zeros_like(v) for k, v in want.items()}
    with DCPCheckpointManager(
        root, remote_url=s3_bucket.url, s3_client=client, async_save=False
    ) as mgr:
        mgr.load(into=into)
    assert mgr.loaded_step == 8
    for k in want:
        assert torch.equal(into[k], want[k]), k
    assert_caller_client_unchanged(client, s3_bucket, kind)
