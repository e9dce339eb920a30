"""Run identity, lineage and fencing on the remote tier (the remote halves of
SPEC §11), against moto's S3 server over HTTP (a real process; unique bucket per test).

- two runs on one prefix: the second run's sidecar is refused (RunMismatchError naming both run ids
  and --adopt-prefix), nothing of its save reaches the bucket and it writes no uploaded.json;
  adopting the prefix replaces the claim;
- a round-1 prefix (no run.json) is adopted with a warning by the first run that uploads to it;
- rollback: attempt 1 uploaded 500/600/700, attempt 2 (resumed from 500) uploads 510: restore picks
  510 and carries the run into the new root; 600/700 are listed as superseded; an old-attempt
  sidecar uploading 800 is refused, and even its commit (had it checked before attempt 2 was
  published) cannot move ``latest`` back;
- fencing: an object overwritten between its confirmation and the commit, or a changed
  manifest.json, stops the commit (no upload manifest, no uploaded.json), and the next pass repairs
  it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import s3_infra
from _upload_util import make_step, remote_bytes, save_entry, save_prefix, split_nodes
from restore_util import publish

from tiered_ckpt import Uploader, committed_steps, restore
from tiered_ckpt.errors import NoCheckpointError, RunMismatchError, UploadError
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.format.upload_manifest import LatestPointer, UploadManifest
from tiered_ckpt.layout import MANIFEST_NAME, RUN_RECORD_NAME, UPLOADED_MARKER_NAME, step_dir_name
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.remote.catalogue import list_remote_steps
from tiered_ckpt.remote.upload.daemon import UploadLoop
from tiered_ckpt.retry import RetryPolicy

KiB = 1024
FAST_RETRY = RetryPolicy(max_attempts=4, initial_wait_s=0.02, max_wait_s=0.1)
T0 = "2026-01-01T00:00:00.000000Z"
RUN_A, RUN_B = "a" * 32, "b" * 32


def new_run(root: Path, run_id: str) -> RunLineage:
    """A root that starts run ``run_id`` (attempt 1): its ``run.json``, as the manager writes it."""
    lin = RunLineage.first(run_id, T0)
    root.mkdir(parents=True, exist_ok=True)
    (root / RUN_RECORD_NAME).write_text(lin.to_json())
    return lin


def step(root: Path, s: int, **kw) -> None:
    make_step(root, s, shard_bytes=kw.pop("shard_bytes", 64 * KiB), **kw)


def uploader(root: Path, loc: s3_infra.S3Location, **kw) -> Uploader:
    return Uploader(root, loc.url, s3_client=loc.client, retry=FAST_RETRY, **kw)


def bucket_keys(loc: s3_infra.S3Location) -> list[str]:
    out = []
    for page in loc.client.get_paginator("list_objects_v2").paginate(
        Bucket=loc.bucket, Prefix=loc.prefix + "/"
    ):
        out += [o["Key"] for o in page.get("Contents", [])]
    return sorted(out)


def remote_record(loc: s3_infra.S3Location) -> RunLineage:
    return RunLineage.from_json(remote_bytes(loc, f"{loc.prefix}/{RUN_RECORD_NAME}"))


def marker(root: Path, s: int) -> dict | None:
    p = root / step_dir_name(s) / UPLOADED_MARKER_NAME
    return json.loads(p.read_text()) if p.exists() else None


# --- two runs, one prefix


def test_second_run_on_a_claimed_prefix_is_refused(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    a, b = tmp_path / "runA", tmp_path / "runB"
    new_run(a, RUN_A)
    new_run(b, RUN_B)
    step(a, 10)
    step(b, 10)  # the same step number, another run's save
    step(b, 20)  # and a newer step, without overlap
    with uploader(a, s3_bucket) as up:
        up.upload_step(10)
    before = bucket_keys(s3_bucket)
    with uploader(b, s3_bucket) as up:
        for s in (20, 10):
            with pytest.raises(RunMismatchError) as ei:
                up.upload_step(s)
            msg = str(ei.value)
            assert RUN_A in msg and RUN_B in msg and "--adopt-prefix" in msg
            assert (ei.value.claimed_by, ei.value.ours) == (RUN_A, RUN_B)
            assert marker(b, s) is None  # the refused sidecar never releases its step for rotation
    assert remote_record(s3_bucket).run_id == RUN_A  # the first upload claimed the prefix
    assert bucket_keys(s3_bucket) == before  # nothing of run B's saves reached the bucket
    assert not [k for k in before if save_entry(b, 10) in k or "step_0000000020" in k]
    # Without overlap, restoring from the prefix still gives run A's step, never run B's.
    m = restore(s3_bucket.url, tmp_path / "restored", s3_client=s3_bucket.client)
    assert (m.run_id, m.save_id) == (RUN_A, read_manifest(a, 10).save_id)


def test_adopt_prefix_replaces_the_claim(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = tmp_path / "runA", tmp_path / "runB"
    new_run(a, RUN_A)
    lin_b = new_run(b, RUN_B)
    step(a, 10)
    step(b, 20)
    with uploader(a, s3_bucket) as up:
        up.upload_step(10)
    with (
        uploader(b, s3_bucket, adopt_prefix=True) as up,
        caplog.at_level(logging.WARNING, logger="tiered_ckpt.remote.lineage"),
    ):
        up.upload_step(20)
    assert any("adopting it for run " + RUN_B in r.getMessage() for r in caplog.records)
    assert remote_record(s3_bucket) == lin_b
    assert marker(b, 20) is not None
    rows = {
        (r.step, r.run_id): r for r in list_remote_steps(s3_bucket.url, s3_client=s3_bucket.client)
    }
    assert rows[(20, RUN_B)].status == "current"
    assert (
        rows[(10, RUN_A)].status == f"run {RUN_A}, not the prefix's run {RUN_B}"
    )  # listed, never chosen
    assert restore(s3_bucket.url, tmp_path / "r", s3_client=s3_bucket.client).step == 20
    with pytest.raises(NoCheckpointError, match="no current save"):
        restore(s3_bucket.url, tmp_path / "r2", step=10, s3_client=s3_bucket.client)


def test_round1_prefix_is_adopted_with_a_warning(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, caplog: pytest.LogCaptureFixture
) -> None:
    old = tmp_path / "round1"
    step(old, 10)  # a root without run.json, published in the round-1 layout (no claim)
    publish(s3_bucket.client, s3_bucket.bucket, s3_bucket.prefix, old, 10)
    root = tmp_path / "run"
    lin = new_run(root, RUN_A)
    step(root, 20)
    with (
        uploader(root, s3_bucket) as up,
        caplog.at_level(logging.WARNING, logger="tiered_ckpt.remote.lineage"),
    ):
        up.upload_step(20)
    assert [r.getMessage() for r in caplog.records if "round-1" in r.getMessage()] == [
        f"{s3_bucket.url} holds steps but no run claim (a round-1 prefix): adopting it for run {RUN_A}"
    ]
    assert remote_record(s3_bucket) == lin
    rows = list_remote_steps(s3_bucket.url, s3_client=s3_bucket.client)
    assert [(r.step, r.state, r.status, r.attempt) for r in rows] == [
        (10, "committed", "current", 1),
        (20, "committed", "current", 1),
    ]
    # The round-1 step is still read as it is and restores (attempt 1 of no run: current).
    m = restore(s3_bucket.url, tmp_path / "r10", step=10, s3_client=s3_bucket.client)
    assert m.save_id == read_manifest(old, 10).save_id and m.run_id is None
    dest = tmp_path / "r20"
    assert restore(s3_bucket.url, dest, s3_client=s3_bucket.client).step == 20
    assert RunLineage.from_json((dest / RUN_RECORD_NAME).read_text()) == lin  # the run is carried


# --- rollback


def _attempt2(root: Path, lin1: RunLineage) -> RunLineage:
    """What the manager records when it resumes from step 500 while 600 and 700 exist."""
    lin2 = lin1.new_attempt(
        supersedes_from=501, resumed_from=500, started_at="2026-01-02T00:00:00.000000Z"
    )
    (root / RUN_RECORD_NAME).write_text(lin2.to_json())
    return lin2


@pytest.mark.slow  # about 3 s (quick-tier budget)
def test_rollback_on_the_remote_tier(tmp_path: Path, s3_bucket: s3_infra.S3Location) -> None:
    root = tmp_path / "node"
    lin1 = new_run(root, RUN_A)
    for s in (500, 600, 700):
        step(root, s)
    with uploader(root, s3_bucket) as up:
        assert UploadLoop(up, poll_interval_s=0.01).run(once=True) == [700, 600, 500]
    old_cluster = tmp_path / "old_cluster"  # the abandoned branch's root, its sidecar still alive
    shutil.copytree(root, old_cluster)
    step(old_cluster, 800)  # attempt 1 keeps going there

    lin2 = _attempt2(root, lin1)
    step(root, 510)  # attempt 2 (the root's current attempt)
    assert read_manifest(root, 510).attempt == 2
    with uploader(root, s3_bucket) as up:
        up.upload_step(510)
    m = restore(s3_bucket.url, tmp_path / "restored_now", s3_client=s3_bucket.client)
    assert (m.step, m.attempt) == (510, 2)  # not 700, the newest step of the abandoned branch
    assert remote_record(s3_bucket) == lin2  # published before any step of attempt 2
    ptr = LatestPointer.from_json(remote_bytes(s3_bucket, f"{s3_bucket.prefix}/latest"))
    assert (ptr.attempt, ptr.step, ptr.save_id) == (2, 510, read_manifest(root, 510).save_id)

    rows = list_remote_steps(s3_bucket.url, s3_client=s3_bucket.client)
    assert [(r.step, r.attempt, r.status) for r in rows] == [
        (500, 1, "current"),
        (510, 2, "current"),
        (600, 1, "superseded by attempt 2 from step 501"),
        (700, 1, "superseded by attempt 2 from step 501"),
    ]
    from tiered_ckpt.remote.catalogue import remote_committed_steps

    assert remote_committed_steps(s3_bucket.url, s3_client=s3_bucket.client) == [500, 510]

    # The old cluster's sidecar: 800 is superseded by the bucket's record; never uploaded, no
    # marker.
    with uploader(old_cluster, s3_bucket) as up:
        with pytest.raises(UploadError, match="step 800 is superseded by attempt 2") as ei:
            up.upload_step(800)
    assert type(ei.value).__name__ == "StepSupersededError"
    assert marker(old_cluster, 800) is None
    assert not [k for k in bucket_keys(s3_bucket) if "step_0000000800" in k]

    # Had it checked before attempt 2 was published, its commit still cannot move latest back.
    _commit_without_lineage_check(old_cluster, s3_bucket, 800)
    assert LatestPointer.from_json(remote_bytes(s3_bucket, f"{s3_bucket.prefix}/latest")) == ptr

    dest = tmp_path / "after_cluster_loss"
    m = restore(s3_bucket.url, dest, s3_client=s3_bucket.client)
    assert (m.step, m.attempt) == (510, 2)
    assert committed_steps(dest) == [510]
    assert (
        RunLineage.from_json((dest / RUN_RECORD_NAME).read_text()) == lin2
    )  # the run goes on there
    with pytest.raises(NoCheckpointError, match="superseded by attempt 2 from step 501"):
        restore(s3_bucket.url, tmp_path / "x", step=700, s3_client=s3_bucket.client)

    from tiered_ckpt.remote.inspect.verify import scan_remote

    got = [
        (r.step, r.state, r.reason) for r in scan_remote(s3_bucket.url, s3_client=s3_bucket.client)
    ]
    assert got == [
        (500, "committed", ""),
        (510, "committed", ""),
        (600, "committed", "superseded by attempt 2 from step 501"),
        (700, "committed", "superseded by attempt 2 from step 501"),
        (800, "committed", "superseded by attempt 2 from step 501"),
    ]


def _commit_without_lineage_check(root: Path, loc: s3_infra.S3Location, s: int) -> None:
    """The remote commit protocol of ``root``'s step ``s`` alone (what a sidecar does after its
    lineage check passed): shards, records, fence, upload manifest, ``latest``."""
    from tiered_ckpt.remote.upload.commit import RemoteStepCommit
    from tiered_ckpt.remote.upload.session import StepStats
    from tiered_ckpt.remote.upload.shard_upload import upload_shard
    from tiered_ckpt.remote.upload.step_upload import read_local_manifest

    sdir = root / step_dir_name(s)
    with uploader(root, loc) as up:
        mbytes, m = read_local_manifest(root, s, sdir)
        commit = RemoteStepCommit(up.store, up.prefix, s, mbytes, m)
        commit.put_manifest()
        for rec in m.shards:
            upload_shard(up.session, commit, sdir, rec, StepStats())
        commit.move_latest(commit.write_upload_manifest(commit.gather()))


def test_latest_moves_only_to_a_greater_attempt_and_step(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    root = tmp_path / "node"
    lin1 = new_run(root, RUN_A)
    step(root, 700)
    old = tmp_path / "old"
    shutil.copytree(root, old)
    step(old, 800)
    _attempt2(root, lin1)
    step(root, 510)
    with uploader(root, s3_bucket) as up:
        up.upload_step(510)
    _commit_without_lineage_check(old, s3_bucket, 800)  # attempt 1, a greater step number
    ptr = LatestPointer.from_json(remote_bytes(s3_bucket, f"{s3_bucket.prefix}/latest"))
    assert ptr.order == (2, 510)
    step(root, 520)
    with uploader(root, s3_bucket) as up:
        up.upload_step(520)
    assert LatestPointer.from_json(remote_bytes(s3_bucket, f"{s3_bucket.prefix}/latest")).order == (
        2,
        520,
    )


# --- fencing


def _two_nodes(tmp_path: Path, s: int) -> tuple[Path, Path, Path]:
    src, a, b = tmp_path / "src", tmp_path / "nodeA", tmp_path / "nodeB"
    lin = new_run(src, RUN_A)
    step(src, s, shard_bytes=256 * KiB)
    split_nodes(src, a, b, s, ranks_a=[0, 1])
    for r in (a, b):
        (r / RUN_RECORD_NAME).write_text(lin.to_json())
    return src, a, b


def test_object_overwritten_after_confirmation_is_never_committed(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    from tiered_ckpt.remote.upload.uploader import StepIncompleteError

    src, a, b = _two_nodes(tmp_path, 7)
    with uploader(a, s3_bucket) as up:
        with pytest.raises(StepIncompleteError):
            up.upload_step(7)  # ranks 0-1 confirmed, waiting for node B
    key = next(k for k in bucket_keys(s3_bucket) if k.endswith("/rank_00000.safetensors"))
    sp = key.rsplit("/", 1)[0]
    body = bytearray(remote_bytes(s3_bucket, key))
    body[-1] ^= 0x01  # another writer overwrites rank 0's object (same size) after its confirmation
    s3_bucket.client.put_object(Bucket=s3_bucket.bucket, Key=key, Body=bytes(body))
    with uploader(b, s3_bucket) as up:
        with pytest.raises(UploadError) as ei:
            up.upload_step(7)
    assert (
        type(ei.value).__name__ == "FencingError"
        and ei.value.key.endswith("rank_00000.safetensors")
        and "rank_00000.safetensors" in str(ei.value)
    )
    assert f"{sp}/upload_manifest.json" not in bucket_keys(s3_bucket)  # nothing committed
    assert marker(b, 7) is None and marker(a, 7) is None
    # Node A's next pass sees its record no longer matches the object and sends rank 0 again; then
    # the commit goes through and every object is the confirmed one.
    with uploader(a, s3_bucket) as up:
        um = up.upload_step(7)
    assert (
        remote_bytes(s3_bucket, key)
        == (src / step_dir_name(7) / "rank_00000.safetensors").read_bytes()
    )
    for rs in um.shards:
        head = s3_bucket.client.head_object(Bucket=s3_bucket.bucket, Key=rs.key)
        assert head["ETag"] == rs.etag and head["ContentLength"] == rs.size_bytes
    assert (
        marker(a, 7)["manifest_sha256"]
        == hashlib.sha256((a / step_dir_name(7) / MANIFEST_NAME).read_bytes()).hexdigest()
    )
    from tiered_ckpt.remote.inspect.verify import scan_remote

    assert [(r.step, r.state) for r in scan_remote(s3_bucket.url, s3_client=s3_bucket.client)] == [
        (7, "committed")
    ]


def test_changed_remote_manifest_is_never_committed(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    """manifest.json changed after this node mirrored it, before its commit: the fence's sha256
    check refuses the commit; the next pass mirrors the manifest again and commits."""
    from tiered_ckpt.remote.upload.commit import RemoteStepCommit
    from tiered_ckpt.remote.upload.session import StepStats
    from tiered_ckpt.remote.upload.shard_upload import upload_shard
    from tiered_ckpt.remote.upload.step_upload import read_local_manifest
    from tiered_ckpt.remote.upload.uploader import StepIncompleteError

    src, a, b = _two_nodes(tmp_path, 8)
    sp = save_prefix(s3_bucket, src, 8)
    with uploader(a, s3_bucket) as up:
        with pytest.raises(StepIncompleteError):
            up.upload_step(8)
    mkey = f"{sp}/{MANIFEST_NAME}"
    sdir = b / step_dir_name(8)
    with uploader(b, s3_bucket) as up:
        mbytes, m = read_local_manifest(b, 8, sdir)
        commit = RemoteStepCommit(up.store, up.prefix, 8, mbytes, m)
        commit.put_manifest()
        for rec in m.shards[2:]:
            upload_shard(up.session, commit, sdir, rec, StepStats())
        um = commit.gather()
        s3_bucket.client.put_object(
            Bucket=s3_bucket.bucket, Key=mkey, Body=mbytes.replace(b'"step"', b'"step" ')
        )
        with pytest.raises(UploadError) as ei:
            commit.write_upload_manifest(um)
        assert type(ei.value).__name__ == "FencingError" and ei.value.key.endswith(MANIFEST_NAME)
        assert mkey in str(ei.value)
        assert f"{sp}/upload_manifest.json" not in bucket_keys(s3_bucket) and marker(b, 8) is None
        um = up.upload_step(8)  # the next pass mirrors the manifest again and commits
    assert remote_bytes(s3_bucket, mkey) == (src / step_dir_name(8) / MANIFEST_NAME).read_bytes()
    assert UploadManifest.from_json(remote_bytes(s3_bucket, f"{sp}/upload_manifest.json")) == um


def test_claim_decisions_on_the_server(s3_bucket: s3_infra.S3Location) -> None:
    """claim_or_check / publish_lineage directly: claim, steady state (one GET), move forward, a
    record that already extends ours, diverged records (LineageError, nothing written), an
    unreadable record (ManifestError unless adopting)."""
    from tiered_ckpt.errors import LineageError, ManifestError
    from tiered_ckpt.remote.lineage import claim_or_check, publish_lineage, read_remote_lineage
    from tiered_ckpt.store import S3Store

    lin1 = RunLineage.first(RUN_A, T0)
    lin2 = lin1.new_attempt(supersedes_from=11, resumed_from=10, started_at=T0)
    other2 = lin1.new_attempt(supersedes_from=21, resumed_from=20, started_at=T0)
    key = f"{s3_bucket.prefix}/{RUN_RECORD_NAME}"
    with S3Store.from_url(s3_bucket.url, client=s3_bucket.client) as st:
        assert read_remote_lineage(st) == (None, None)
        assert claim_or_check(st, None) is None  # a root without a record claims nothing
        assert bucket_keys(s3_bucket) == []
        assert claim_or_check(st, lin1) == lin1 and remote_record(s3_bucket) == lin1
        assert publish_lineage(st, lin2) == lin2 and remote_record(s3_bucket) == lin2
        assert claim_or_check(st, lin1) == lin2  # the bucket's extends the root's: fine, unchanged
        etag = read_remote_lineage(st)[1]
        with pytest.raises(LineageError, match="diverged"):
            claim_or_check(st, other2)
        assert read_remote_lineage(st) == (lin2, etag)  # nothing written
        s3_bucket.client.put_object(Bucket=s3_bucket.bucket, Key=key, Body=b"{not json")
        with pytest.raises(ManifestError, match="run.json"):
            claim_or_check(st, lin1)
        assert claim_or_check(st, lin1, adopt=True) == lin1 and remote_record(s3_bucket) == lin1


def test_an_empty_run_record_is_a_manifest_error(s3_bucket: s3_infra.S3Location) -> None:
    from tiered_ckpt.errors import ManifestError
    from tiered_ckpt.remote.lineage import read_remote_record
    from tiered_ckpt.store import S3Store

    s3_bucket.client.put_object(
        Bucket=s3_bucket.bucket, Key=f"{s3_bucket.prefix}/{RUN_RECORD_NAME}", Body=b""
    )
    with S3Store.from_url(s3_bucket.url, client=s3_bucket.client) as st:
        with pytest.raises(ManifestError, match="run.json"):
            read_remote_record(st)


def test_a_latest_pointer_naming_no_commit_does_not_hold_latest(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    """A hostile or hand-edited ``latest`` far ahead ((attempt 9, step 10**9), naming no save) would
    have stopped ``latest`` from ever moving again; it is replaced by the next real commit."""
    root = tmp_path / "node"
    new_run(root, RUN_A)
    step(root, 10)
    bogus = LatestPointer(10**9, "ab" * 32, attempt=9, save_id="nosuchsave")
    client = s3_infra.make_test_client(s3_bucket.endpoint_url)
    client.put_object(
        Bucket=s3_bucket.bucket, Key=f"{s3_bucket.prefix}/latest", Body=bogus.to_json().encode()
    )
    with uploader(root, s3_bucket) as up:
        up.upload_step(10)
    assert LatestPointer.from_json(remote_bytes(s3_bucket, f"{s3_bucket.prefix}/latest")).order == (
        1,
        10,
    )
