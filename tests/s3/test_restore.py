"""restore() and list_remote_steps() against moto's S3 server over HTTP (a real process; unique
bucket per test). Remote steps are written in the documented layout by tests/restore_util.publish;
the real uploader's round trip is in test_restore_e2e.py."""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import pytest
from restore_util import assert_states_equal, files_under, publish, save_step
from s3_infra import FaultProxy, S3Location, make_test_client
from s3_servers import both_servers

from tiered_ckpt import (
    NoCheckpointError,
    ShardCorruptedError,
    committed_steps,
    load_shard,
    load_sharded,
    restore,
)
from tiered_ckpt.errors import CheckpointExistsError, MissingShardError
from tiered_ckpt.layout import (
    MANIFEST_NAME,
    UPLOADED_MARKER_NAME,
    remote_key,
    remote_latest_key,
    step_dir_name,
)
from tiered_ckpt.remote.catalogue import list_remote_steps
from tiered_ckpt.remote.restore.restorer import (
    REMOTE_COMMITTED,
    REMOTE_NO_UPLOAD_MANIFEST,
    plan_restore,
    restore_detailed,
)
from tiered_ckpt.training.resume import ensure_local


@pytest.fixture
def run(tmp_path: Path, s3_bucket: S3Location):
    """A 4-rank run with steps 10 and 20 saved locally and published (pointer -> 20)."""
    src = tmp_path / "src"
    states = {s: save_step(src, s) for s in (10, 20)}
    for s in (10, 20):
        publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, src, s)
    return src, states


def _restore(loc: S3Location, root: Path, **kw):
    return restore(loc.url, root, s3_client=loc.client, **kw)


@both_servers
def test_cluster_loss_restores_newest_step_byte_equal(
    run, s3_bucket: S3Location, tmp_path: Path
) -> None:
    src, states = run
    original = (src / step_dir_name(20) / MANIFEST_NAME).read_bytes()
    shutil.rmtree(src)  # cluster loss: the local tier is gone
    m = _restore(s3_bucket, src)
    assert m.step == 20 and committed_steps(src) == [20]
    sdir = src / step_dir_name(20)
    assert (sdir / MANIFEST_NAME).read_bytes() == original  # the exact bytes that were uploaded
    assert (sdir / UPLOADED_MARKER_NAME).is_file()  # the sidecar will not send it back
    for rank, got in enumerate(load_sharded(src, 4, 20)):
        assert_states_equal(got, states[20][rank])
    assert not [
        f for f in files_under(src) if f.endswith(".tmp") or ".lock" in f or "download" in f
    ]


@both_servers
def test_restore_named_step_and_dry_run(run, s3_bucket: S3Location, tmp_path: Path) -> None:
    _, states = run
    dest = tmp_path / "dest"
    plan = plan_restore(s3_bucket.url, s3_client=s3_bucket.client, step=10)
    assert plan.step == 10 and plan.ranks == (0, 1, 2, 3) and len(plan.objects) == 4
    assert plan.total_bytes == plan.manifest.total_bytes
    assert not dest.exists()  # a dry run writes nothing
    res = restore_detailed(
        s3_bucket.url,
        dest,
        s3_client=s3_bucket.client,
        step=10,
        download_part_size_bytes=8 << 20,
        download_max_concurrency=2,
    )
    assert res.manifest.step == 10 and res.bytes_downloaded == plan.total_bytes
    assert_states_equal(load_shard(dest, 3, 4, 10), states[10][3])
    with pytest.raises(NoCheckpointError, match="step 15"):
        _restore(s3_bucket, tmp_path / "other", step=15)


@both_servers
def test_partial_restore_of_a_replaced_nodes_ranks(
    run, s3_bucket: S3Location, tmp_path: Path
) -> None:
    src, states = run
    sdir = src / step_dir_name(20)
    for r in (2, 3):
        (sdir / f"rank_0000{r}.safetensors").unlink()  # the node serving ranks 2-3 lost its disk
    with pytest.raises(MissingShardError):
        load_shard(src, 2, 4, 20)
    m = _restore(s3_bucket, src, step=20, ranks=[2, 3])
    assert m.step == 20
    for rank, got in enumerate(load_sharded(src, 4, 20)):
        assert_states_equal(got, states[20][rank])

    # A brand-new node root: only its own ranks and the global manifest arrive.
    node = tmp_path / "node1"
    _restore(s3_bucket, node, ranks=[2, 3])
    assert sorted(p.name for p in (node / step_dir_name(20)).glob("*.safetensors")) == [
        "rank_00002.safetensors",
        "rank_00003.safetensors",
    ]
    for r in (2, 3):
        assert_states_equal(load_shard(node, r, 4), states[20][r])
    with pytest.raises(MissingShardError):
        load_shard(node, 0, 4)

    # ensure_local makes no remote call when everything is there, and fetches only what is missing.
    (node / step_dir_name(20) / "rank_00003.safetensors").unlink()
    ensure_local(node, s3_bucket.url, 20, [2, 3], s3_client=s3_bucket.client)
    assert_states_equal(load_shard(node, 3, 4, 20), states[20][3])
    with pytest.raises(ValueError, match="outside"):
        _restore(s3_bucket, tmp_path / "x", ranks=[4])


def test_lagging_list_and_missing_upload_manifest_are_never_chosen(
    run, s3_bucket: S3Location, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    src, states = run
    loc = s3_bucket
    # Step 30 reached the bucket without its upload manifest (the sidecar died before the commit
    # mark).
    save_step(src, 30)
    publish(loc.client, loc.bucket, loc.prefix, src, 30, upload_manifest=False)
    # LIST lags: it does not show step 20 (the newest complete step) at all.
    fault_proxy.hide_from_list(f"{loc.prefix}/{step_dir_name(20)}/")
    client = make_test_client(fault_proxy.url)

    steps = {s.step: s for s in list_remote_steps(loc.url, s3_client=client)}
    assert steps[20].state == REMOTE_COMMITTED and steps[20].latest  # known from the pointer (GET)
    assert steps[30].state == REMOTE_NO_UPLOAD_MANIFEST and not steps[30].ok
    assert steps[10].state == REMOTE_COMMITTED and not steps[10].latest

    m = restore(loc.url, tmp_path / "a", s3_client=client)
    assert m.step == 20
    assert_states_equal(load_shard(tmp_path / "a", 1, 4, 20), states[20][1])
    with pytest.raises(NoCheckpointError, match="upload_manifest"):
        restore(loc.url, tmp_path / "b", s3_client=client, step=30)
    assert committed_steps(tmp_path / "b") == []

    # No pointer and LIST still lagging: the newest step LIST can show whose commit point GET
    # confirms.
    loc.client.delete_object(Bucket=loc.bucket, Key=remote_latest_key(loc.prefix))
    assert restore(loc.url, tmp_path / "c", s3_client=client).step == 10
    # Once LIST catches up, step 20 is found without a pointer; step 30 still never is.
    fault_proxy.clear_rules()
    assert restore(loc.url, tmp_path / "d", s3_client=client).step == 20


@both_servers
def test_corrupt_remote_shard_fails_cleanly_then_falls_back(
    run, s3_bucket: S3Location, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src, states = run
    loc = s3_bucket
    key = remote_key(loc.prefix, 20, "rank_00001.safetensors")
    body = bytearray(loc.client.get_object(Bucket=loc.bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x01  # same size, one bit changed in the bucket
    loc.client.put_object(Bucket=loc.bucket, Key=key, Body=bytes(body))
    dest = tmp_path / "dest"
    with pytest.raises(ShardCorruptedError) as ei:
        _restore(loc, dest)
    assert "step 20" in str(ei.value) and "rank_00001.safetensors" in str(ei.value)
    assert (
        committed_steps(dest) == [] and files_under(dest) == []
    )  # nothing committed, no temp files

    with caplog.at_level(logging.WARNING, logger="tiered_ckpt.remote.restore.restorer"):
        res = restore_detailed(loc.url, dest, s3_client=loc.client, fallback=True)
    assert res.manifest.step == 10 and committed_steps(dest) == [10]
    assert [s for s, _ in res.plan.skipped] == [20]
    assert any("falling back" in r.getMessage() for r in caplog.records)
    for rank, got in enumerate(load_sharded(dest, 4, 10)):
        assert_states_equal(got, states[10][rank])


@both_servers
def test_missing_object_and_bad_manifest_mirror(run, s3_bucket: S3Location, tmp_path: Path) -> None:
    loc = s3_bucket
    loc.client.delete_object(
        Bucket=loc.bucket, Key=remote_key(loc.prefix, 20, "rank_00003.safetensors")
    )
    with pytest.raises(MissingShardError) as ei:
        _restore(loc, tmp_path / "a")
    assert "step 20" in str(ei.value) and "rank_00003.safetensors" in str(ei.value)
    assert files_under(tmp_path / "a") == []
    # ranks that do not need the missing object still restore
    assert _restore(loc, tmp_path / "a", ranks=[0, 1]).step == 20

    mkey = remote_key(loc.prefix, 10, MANIFEST_NAME)
    raw = loc.client.get_object(Bucket=loc.bucket, Key=mkey)["Body"].read()
    loc.client.put_object(Bucket=loc.bucket, Key=mkey, Body=raw.replace(b'"extra"', b'"extra" '))
    with pytest.raises(ShardCorruptedError, match="manifest.json"):
        _restore(loc, tmp_path / "b", step=10)
    with pytest.raises(NoCheckpointError, match="no restorable step"):
        _restore(loc, tmp_path / "b", fallback=True)
    assert committed_steps(tmp_path / "b") == []


def test_local_step_of_another_save_is_not_overwritten_without_replace(
    run, s3_bucket: S3Location, tmp_path: Path
) -> None:
    _, states = run
    dest = tmp_path / "dest"
    save_step(dest, 20, world_size=4)  # same step number, different save
    mine = hashlib.sha256((dest / step_dir_name(20) / MANIFEST_NAME).read_bytes()).hexdigest()
    with pytest.raises(CheckpointExistsError):
        _restore(s3_bucket, dest)
    assert (
        hashlib.sha256((dest / step_dir_name(20) / MANIFEST_NAME).read_bytes()).hexdigest() == mine
    )
    _restore(s3_bucket, dest, replace=True)
    for rank, got in enumerate(load_sharded(dest, 4, 20)):
        assert_states_equal(got, states[20][rank])


@both_servers
def test_empty_bucket(s3_bucket: S3Location, tmp_path: Path) -> None:
    with pytest.raises(
        NoCheckpointError, match="is not a checkpoint prefix"
    ):  # no run.json, no step
        _restore(s3_bucket, tmp_path)
    assert list_remote_steps(s3_bucket.url, s3_client=s3_bucket.client) == []


@both_servers
def test_restore_decides_under_the_writer_lock(run, s3_bucket: S3Location, tmp_path: Path) -> None:
    """A live local writer of another save holds the step: restore refuses before reading or writing
    anything (I4); a committed step of another save is refused without replace and keeps no lock of
    ours; a failed replace leaves no lock in it either."""
    import json
    import os

    from tiered_ckpt.errors import ConcurrentSaveError
    from tiered_ckpt.layout import SAVE_LOCK_NAME

    loc = s3_bucket
    dest = tmp_path / "dest"
    sdir = dest / step_dir_name(20)
    sdir.mkdir(parents=True)
    lock = {"save_id": "another_save", "owner": f"otherhost.{os.getpid()}.0", "created_at": ""}
    (sdir / SAVE_LOCK_NAME).write_text(json.dumps(lock))  # another host's writer: counted alive
    with pytest.raises(ConcurrentSaveError, match="another writer"):
        _restore(loc, dest)
    assert (
        sorted(os.listdir(sdir)) == [SAVE_LOCK_NAME]
        and json.loads((sdir / SAVE_LOCK_NAME).read_text()) == lock
    )
    shutil.rmtree(dest)

    save_step(dest, 20)  # committed locally by another save
    before = {n: (sdir / n).read_bytes() for n in os.listdir(sdir)}
    with pytest.raises(CheckpointExistsError):
        _restore(loc, dest)
    assert {
        n: (sdir / n).read_bytes() for n in os.listdir(sdir)
    } == before  # untouched, no lock left

    key = remote_key(loc.prefix, 20, "rank_00002.safetensors")
    body = bytearray(loc.client.get_object(Bucket=loc.bucket, Key=key)["Body"].read())
    body[-1] ^= 0x01
    loc.client.put_object(Bucket=loc.bucket, Key=key, Body=bytes(body))
    with pytest.raises(ShardCorruptedError):
        _restore(loc, dest, replace=True)
    assert {
        n: (sdir / n).read_bytes() for n in os.listdir(sdir)
    } == before  # failed before any change


@both_servers
def test_symlinked_step_directory_is_refused(run, s3_bucket: S3Location, tmp_path: Path) -> None:
    from tiered_ckpt.errors import CheckpointWriteError

    outside = tmp_path / "outside"
    save_step(outside, 20)  # a committed-looking step outside the run directory
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / step_dir_name(20)).symlink_to(outside / step_dir_name(20))
    before = files_under(outside)
    with pytest.raises(CheckpointWriteError, match="exists and is not a directory"):
        _restore(s3_bucket, dest)
    assert files_under(outside) == before
