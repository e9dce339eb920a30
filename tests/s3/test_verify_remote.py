"""``tiered-ckpt verify --remote``: every remote step checked against its upload manifest (moto
server over HTTP; steps published in the documented layout by restore_util.publish)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from restore_util import publish, save_step
from s3_infra import S3Location
from s3_servers import both_servers
from spawn import child_env, python_cmd

from tiered_ckpt.layout import remote_key, shard_file_name
from tiered_ckpt.remote.inspect.verify import scan_remote


def _remote_root(tmp_path: Path, loc: S3Location) -> None:
    src = tmp_path / "src"
    for s in (10, 20, 30, 40, 50):
        save_step(src, s)
        publish(loc.client, loc.bucket, loc.prefix, src, s, upload_manifest=(s != 50))
    # 20: one byte of rank 1 changed in the bucket (same size)
    key = remote_key(loc.prefix, 20, shard_file_name(1))
    body = bytearray(loc.client.get_object(Bucket=loc.bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    loc.client.put_object(Bucket=loc.bucket, Key=key, Body=bytes(body))
    # 30: rank 2's object deleted
    loc.client.delete_object(Bucket=loc.bucket, Key=remote_key(loc.prefix, 30, shard_file_name(2)))
    # 40: rank 3 truncated by one byte (size differs: HEAD alone catches it)
    key = remote_key(loc.prefix, 40, shard_file_name(3))
    body = loc.client.get_object(Bucket=loc.bucket, Key=key)["Body"].read()
    loc.client.put_object(Bucket=loc.bucket, Key=key, Body=body[:-1])


@both_servers
def test_scan_remote_states(tmp_path: Path, s3_bucket: S3Location) -> None:
    _remote_root(tmp_path, s3_bucket)
    full = {s.step: s for s in scan_remote(s3_bucket.url, s3_client=s3_bucket.client)}
    assert {k: v.state for k, v in full.items()} == {
        10: "committed",
        20: "corrupt",
        30: "incomplete",
        40: "corrupt",
        50: "uncommitted",
    }
    assert "sha256" in full[20].reason and "rank 1" in full[20].reason
    assert "rank 2" in full[30].reason
    # --fast: these shards were PUT without checksums (none stored) and schema 1 records no ETag, so
    # the same-size flip in step 20 is not seen, and the rows say they were checked by size only;
    # the rest is.
    fast = {s.step: s for s in scan_remote(s3_bucket.url, s3_client=s3_bucket.client, fast=True)}
    assert {k: v.state for k, v in fast.items()} == {
        10: "committed",
        20: "committed",
        30: "incomplete",
        40: "corrupt",
        50: "uncommitted",
    }
    assert (fast[20].checked, fast[20].note) == (
        "size",
        "size only: the server stores no CRC32C or SHA-256 checksum",
    )
    only = scan_remote(s3_bucket.url, s3_client=s3_bucket.client, step=10)
    assert [(s.step, s.state) for s in only] == [(10, "committed")]


@pytest.mark.slow  # about 3 s (quick-tier budget)
@both_servers
def test_cli_verify_remote(tmp_path: Path, s3_bucket: S3Location) -> None:
    _remote_root(tmp_path, s3_bucket)
    env = child_env(AWS_ENDPOINT_URL=s3_bucket.endpoint_url)
    cmd = python_cmd("-m", "tiered_ckpt.cli", "verify", "--remote", s3_bucket.url)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [ln.split(":")[0:2] for ln in lines] == [
        ["step 10", " committed"],
        ["step 20", " corrupt"],
        ["step 30", " incomplete"],
        ["step 40", " corrupt"],
        ["step 50", " uncommitted"],
    ]
    proc = subprocess.run(
        cmd + ["--step", "10", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert [(r["step"], r["state"]) for r in json.loads(proc.stdout)] == [(10, "committed")]


@pytest.mark.parametrize(("fault", "fast"), [("head", False), ("head", True), ("get", False)])
def test_a_bucket_that_cannot_be_read_is_an_error_not_a_corrupt_step(
    tmp_path: Path, s3_bucket: S3Location, fault_proxy, fast: bool, fault: str
) -> None:
    """Shard requests answered 503 until the retries are spent (a throttling or slow server): the
    step is not called corrupt (an operator would delete a good step); the scan raises
    ``UploadError`` as for any bucket it cannot read, as restore does."""
    from s3_infra import all_of, is_get_object, is_head_object, make_test_client

    from tiered_ckpt.errors import UploadError
    from tiered_ckpt.retry import RetryPolicy
    from tiered_ckpt.store.s3 import S3Store

    _remote_root(tmp_path, s3_bucket)
    is_shard = lambda r: r.key.endswith(".safetensors")  # noqa: E731
    match = is_head_object if fault == "head" else is_get_object
    fault_proxy.fail_first(None, all_of(match, is_shard))
    store = S3Store(
        make_test_client(fault_proxy.url, botocore_max_attempts=1),
        s3_bucket.bucket,
        s3_bucket.prefix,
        retry=RetryPolicy(max_attempts=2, initial_wait_s=0.01, max_wait_s=0.02),
    )
    with pytest.raises(UploadError, match="SlowDown|503"):
        scan_remote(s3_bucket.url, fast=fast, store=store)
