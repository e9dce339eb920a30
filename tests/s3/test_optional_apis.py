"""Servers without optional S3 APIs and uploads left open by expired
credentials.

A FaultProxy (tests/s3_infra.py) in front of moto's server answers ``501 NotImplemented`` to every
ListMultipartUploads / AbortMultipartUpload / DeleteObjects request, as several small S3-compatible
servers and gateways do; moto itself (asked directly, behind the proxy's back) shows what really
happened.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest
import s3_infra
from _upload_util import SMALL, MiB, list_keys, save_entry, save_prefix
from spawn import python_cmd

from tiered_ckpt import Uploader, UploadError, restore
from tiered_ckpt.layout import PENDING_ABORTS_NAME, step_dir_name
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.remote.upload.daemon import UploadLoop
from tiered_ckpt.remote.upload.uploader import UploadPolicy
from tiered_ckpt.retry import RetryPolicy
from tiered_ckpt.store import optional_apis

FAST_RETRY = RetryPolicy(max_attempts=3, initial_wait_s=0.01, max_wait_s=0.05)
NOT_IMPLEMENTED = dict(
    status=501,
    code="NotImplemented",
    message="A header you provided implies functionality that is not implemented",
)
EXPIRED = dict(status=403, code="ExpiredToken", message="The provided token has expired.")


@pytest.fixture(autouse=True)
def _fresh_capabilities():
    optional_apis.forget_missing()
    yield
    optional_apis.forget_missing()


def _mixed_step(root: Path, step: int) -> None:
    """Rank 0: a ~4 KiB shard (one PUT); rank 1: a ~12 MiB shard (multipart with ``SMALL``: 3
    parts)."""
    rng = np.random.default_rng(step)
    states = [
        {"w": rng.integers(0, 2**31, size=1024, dtype=np.int32)},
        {"w": rng.integers(0, 2**31, size=3 * MiB, dtype=np.int32)},
    ]
    save_sharded(states, root, step)


def _big_step(root: Path, step: int) -> None:
    rng = np.random.default_rng(step)
    save_sharded([{"w": rng.integers(0, 2**31, size=3 * MiB, dtype=np.int32)}], root, step)


def _open_uploads(loc: s3_infra.S3Location) -> list[tuple[str, str]]:
    uploads = loc.client.list_multipart_uploads(Bucket=loc.bucket).get("Uploads", [])
    return sorted((u["Key"], u["UploadId"]) for u in uploads)


def _warnings(caplog: pytest.LogCaptureFixture, operation: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
        and r.name == "tiered_ckpt.store.optional_apis"
        and operation in r.getMessage()
    ]


def _record(root: Path) -> list[dict]:
    return json.loads((root / PENDING_ABORTS_NAME).read_bytes())["uploads"]


def _local_shards(root: Path, step: int) -> dict[str, bytes]:
    return {
        rec.path: (root / step_dir_name(step) / rec.path).read_bytes()
        for rec in read_manifest(root, step).shards
    }


@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_no_list_multipart_uploads_upload_and_restore_work(
    tmp_path: Path,
    s3_bucket: s3_infra.S3Location,
    fault_proxy: s3_infra.FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tiered_ckpt")
    root = tmp_path / "node"
    _mixed_step(root, 1)
    _mixed_step(root, 2)
    rule = fault_proxy.fail_first(None, s3_infra.is_list_multipart_uploads, **NOT_IMPLEMENTED)
    client = s3_infra.make_test_client(fault_proxy.url)
    with Uploader(root, s3_bucket.url, s3_client=client, retry=FAST_RETRY, **SMALL) as up:
        assert up.abort_abandoned_uploads() == 0  # the sweep proceeds (nothing it can list)
        assert up.upload_step(1).step == 1
        assert up.upload_step(2).step == 2
        assert up.abort_abandoned_uploads() == 0
    # One ListMultipartUploads reached the server (the first); later calls skipped the request.
    assert (rule.seen, rule.applied) == (1, 1)
    assert len(_warnings(caplog, "ListMultipartUploads")) == 1
    shard_puts = fault_proxy.count(
        lambda r: r.method == "PUT" and r.key.endswith("rank_00000.safetensors")
    )
    assert shard_puts == 2  # the 4 KiB shard of each step: one single PUT
    assert _open_uploads(s3_bucket) == []
    for step in (1, 2):
        rank1 = f"{save_prefix(s3_bucket, root, step)}/rank_00001.safetensors"
        assert (
            s3_bucket.client.head_object(Bucket=s3_bucket.bucket, Key=rank1)["ContentLength"]
            > 6 * MiB
        )
    dest = tmp_path / "restored"
    m = restore(s3_bucket.url, dest, s3_client=client, step=1)
    assert m.step == 1
    assert _local_shards(dest, 1) == _local_shards(root, 1)


def test_no_abort_multipart_upload_leftover_recorded_and_upload_proceeds(
    tmp_path: Path,
    s3_bucket: s3_infra.S3Location,
    fault_proxy: s3_infra.FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tiered_ckpt")
    root = tmp_path / "node"
    _mixed_step(root, 1)
    shard_key = f"{save_entry(root, 1)}/rank_00001.safetensors"  # relative to the store prefix
    leftover = s3_bucket.client.create_multipart_upload(
        Bucket=s3_bucket.bucket, Key=f"{s3_bucket.prefix}/{shard_key}"
    )["UploadId"]
    rule = fault_proxy.fail_first(None, s3_infra.is_abort_multipart, **NOT_IMPLEMENTED)
    client = s3_infra.make_test_client(fault_proxy.url)
    with Uploader(root, s3_bucket.url, s3_client=client, retry=FAST_RETRY, **SMALL) as up:
        assert up.upload_step(1).step == 1  # the leftover could not be aborted: the upload proceeds
        assert up.abort_abandoned_uploads() == 0  # the sweep proceeds; no further abort is sent
        assert up.sweep_pending_aborts() == 0
        assert (rule.seen, rule.applied) == (1, 1)
        assert len(_warnings(caplog, "AbortMultipartUpload")) == 1
        assert [(e["key"], e["upload_id"], e["url"]) for e in _record(root)] == [
            (shard_key, leftover, s3_bucket.url)
        ]
        assert _open_uploads(s3_bucket) == [(f"{s3_bucket.prefix}/{shard_key}", leftover)]
        # The server learns AbortMultipartUpload (a new process would probe it again): the sweep
        # settles it.
        fault_proxy.remove_rule(rule)
        optional_apis.forget_missing()
        assert up.sweep_pending_aborts() == 1
    assert _open_uploads(s3_bucket) == []
    assert _record(root) == []
    dest = tmp_path / "restored"
    restore(s3_bucket.url, dest, s3_client=client)
    assert _local_shards(dest, 1) == _local_shards(root, 1)


def test_no_delete_objects_retention_deletes_key_by_key(
    tmp_path: Path,
    s3_bucket: s3_infra.S3Location,
    fault_proxy: s3_infra.FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tiered_ckpt")
    root = tmp_path / "node"
    _mixed_step(root, 1)
    _mixed_step(root, 2)
    rule = fault_proxy.fail_first(None, s3_infra.is_delete_objects, **NOT_IMPLEMENTED)
    client = s3_infra.make_test_client(fault_proxy.url)
    with Uploader(
        root,
        s3_bucket.url,
        s3_client=client,
        retry=FAST_RETRY,
        policy=UploadPolicy(keep_remote_last=1),
        **SMALL,
    ) as up:
        up.upload_step(1)
        up.upload_step(2)
        assert up.apply_remote_retention() == [1]
    assert (rule.seen, rule.applied) == (
        1,
        1,
    )  # the first DeleteObjects (the checksum probe's) taught it
    assert len(_warnings(caplog, "DeleteObjects")) == 1
    assert not [m for m in caplog.messages if "could not delete checksum probe" in m]
    entry1, entry2 = save_entry(root, 1), save_entry(root, 2)
    remaining = list_keys(s3_bucket)
    assert [k for k in remaining if entry1 in k] == []
    assert sorted(
        k.rsplit("/", 1)[-1] for k in remaining if f"/{entry2}/" in k and "/.confirm/" not in k
    ) == [
        "manifest.json",
        "rank_00000.safetensors",
        "rank_00001.safetensors",
        "upload_manifest.json",
    ]
    assert [k for k in remaining if ".tiered_ckpt_probe" in k] == []


def test_expired_credentials_mid_upload_record_the_open_upload_then_the_sidecar_aborts_it(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    root = tmp_path / "node"
    _big_step(root, 1)
    parts = fault_proxy.fail_first(
        None, s3_infra.after_first(1, s3_infra.is_upload_part), **EXPIRED
    )
    aborts = fault_proxy.fail_first(None, s3_infra.is_abort_multipart, **EXPIRED)
    client = s3_infra.make_test_client(fault_proxy.url)
    with Uploader(root, s3_bucket.url, s3_client=client, retry=FAST_RETRY, **SMALL) as up:
        with pytest.raises(UploadError) as ei:
            up.upload_step(1)
        assert "ExpiredToken" in str(ei.value)
        assert parts.applied >= 1 and aborts.applied == 1
        shard_key = f"{save_entry(root, 1)}/rank_00000.safetensors"
        open_now = _open_uploads(s3_bucket)
        assert [k for k, _ in open_now] == [f"{s3_bucket.prefix}/{shard_key}"]
        rec = _record(root)
        assert [(e["url"], e["key"], e["upload_id"], e["error"]) for e in rec] == [
            (s3_bucket.url, shard_key, open_now[0][1], "ExpiredToken (HTTP 403)")
        ]
        # Credentials renewed; the server still lists nothing: only the record can find the upload.
        fault_proxy.clear_rules()
        fault_proxy.fail_first(None, s3_infra.is_list_multipart_uploads, **NOT_IMPLEMENTED)
        assert UploadLoop(up).run(once=True) == [1]  # the sidecar: sweep at start, then the step
    assert _open_uploads(s3_bucket) == []
    assert _record(root) == []


def test_pending_abort_sweep_is_bounded_and_keeps_refused_entries(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    from tiered_ckpt.remote.upload.pending_aborts import record_failed_abort, sweep_pending_aborts

    root = tmp_path / "node"
    root.mkdir()
    ids = []
    for i in range(3):
        key = f"step_0000000001.x/rank_0000{i}.safetensors"
        ids.append(
            (
                key,
                s3_bucket.client.create_multipart_upload(
                    Bucket=s3_bucket.bucket, Key=f"{s3_bucket.prefix}/{key}"
                )["UploadId"],
            )
        )
    record_failed_abort(root, "s3://other-bucket/p", "k", "gone-elsewhere")  # another store's: kept
    for key, uid in ids:
        assert record_failed_abort(root, s3_bucket.url, key, uid)
    client = s3_infra.make_test_client(fault_proxy.url)
    refused = fault_proxy.fail_first(1, s3_infra.is_abort_multipart, **EXPIRED)
    with Uploader(root, s3_bucket.url, s3_client=client, retry=FAST_RETRY, **SMALL) as up:
        assert (
            sweep_pending_aborts(up.store, root, max_aborts=2) == 0
        )  # first refused: the sweep stops
        assert refused.applied == 1
        assert [e["upload_id"] for e in _record(root)] == [
            "gone-elsewhere",
            ids[1][1],
            ids[2][1],
            ids[0][1],
        ]
        assert sweep_pending_aborts(up.store, root, max_aborts=2) == 2  # bounded: two per call
        assert [e["upload_id"] for e in _record(root)] == ["gone-elsewhere", ids[0][1]]
        assert sweep_pending_aborts(up.store, root, max_aborts=2) == 1
    assert [e["upload_id"] for e in _record(root)] == ["gone-elsewhere"]
    assert _open_uploads(s3_bucket) == []


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        python_cmd("-m", "tiered_ckpt.cli", *args), capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # quick-tier budget (under 3 minutes); the full run keeps it
def test_cli_upload_once_and_restore_against_a_server_without_list_multipart_uploads(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    root = tmp_path / "node"
    _mixed_step(root, 1)
    rule = fault_proxy.fail_first(None, s3_infra.is_list_multipart_uploads, **NOT_IMPLEMENTED)
    remote = (
        "--remote",
        s3_bucket.url,
        "--endpoint-url",
        fault_proxy.url,
        "--path-style",
        "--no-progress",
    )
    up = _cli(
        "upload",
        "--once",
        "--local",
        root,
        *remote,
        "--part-size-mib",
        "5",
        "--multipart-threshold-mib",
        "6",
    )
    assert up.returncode == 0, up.stderr
    assert up.stdout.startswith("step 1: committed remotely"), up.stdout
    assert up.stderr.count("does not implement ListMultipartUploads") == 1, up.stderr
    assert rule.applied == 1
    creates = fault_proxy.count(lambda r: r.method == "POST" and r.target.endswith("?uploads"))
    assert creates == 1  # rank 1 went multipart, rank 0 was one PUT
    out = _cli("restore", "--local", tmp_path / "restored", *remote)
    assert out.returncode == 0, out.stderr
    assert _local_shards(tmp_path / "restored", 1) == _local_shards(root, 1)
