"""Uploader against a real S3 server over HTTP (moto; SeaweedFS too where marked ``@both_servers``):
multipart steps, ordering of the commit, two nodes, confirmation by the server's checksum."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import s3_infra
from _upload_util import (
    SMALL,
    list_keys,
    make_step,
    remote_bytes,
    save_entry,
    save_prefix,
    split_nodes,
)
from s3_servers import both_servers, seaweedfs_only

from tiered_ckpt import Uploader
from tiered_ckpt.format.upload_manifest import LatestPointer, UploadManifest
from tiered_ckpt.layout import UPLOADED_MARKER_NAME, step_dir_name
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.remote.upload.daemon import UploadLoop
from tiered_ckpt.remote.upload.uploader import StepIncompleteError, UploadPolicy
from tiered_ckpt.retry import RetryPolicy

MiB = 1024 * 1024
FAST_RETRY = RetryPolicy(max_attempts=6, initial_wait_s=0.05, max_wait_s=0.3)


def _uploader(root: Path, loc: s3_infra.S3Location, client=None, **kw) -> Uploader:
    return Uploader(
        root, loc.url, s3_client=client or loc.client, retry=FAST_RETRY, **{**SMALL, **kw}
    )


@pytest.mark.slow  # about 3 s (quick-tier budget)
@both_servers
def test_three_multipart_steps_commit_last(
    tmp_path: Path,
    s3_bucket: s3_infra.S3Location,
    fault_proxy: s3_infra.FaultProxy,
    s3_server: s3_infra.S3Server,
) -> None:
    """On moto (which validates no checksum) every shard is read back; on SeaweedFS (which does)
    every shard is confirmed by the checksum the server reports, and no shard is read back."""
    root = tmp_path / "node"
    for s in (10, 20, 30):
        make_step(root, s)
    client = s3_infra.make_test_client(fault_proxy.url)
    with _uploader(root, s3_bucket, client) as up:
        assert up.pending_steps() == [30, 20, 10]  # newest first
        done = UploadLoop(up, poll_interval_s=0.05).run(once=True)
        assert done == [30, 20, 10]
        assert up.pending_steps() == []
    reqs = fault_proxy.requests
    for s in (10, 20, 30):
        m = read_manifest(root, s)
        sp = save_prefix(s3_bucket, root, s)
        um = UploadManifest.from_json(remote_bytes(s3_bucket, f"{sp}/upload_manifest.json"))
        assert um.step == s and um.world_size == 4 and um.save_id == m.save_id
        for rec, rs in zip(m.shards, um.shards):
            assert rs.sha256 == rec.sha256 and rs.size_bytes == rec.size_bytes
            assert rs.confirmed_by == (
                "server-checksum" if s3_server.validates_checksums else "read-back"
            )
            assert (
                remote_bytes(s3_bucket, rs.key) == (root / step_dir_name(s) / rec.path).read_bytes()
            )
        assert (
            remote_bytes(s3_bucket, f"{sp}/manifest.json")
            == (root / step_dir_name(s) / "manifest.json").read_bytes()
        )
        # Ordering: the upload manifest's PUT comes after every shard's CompleteMultipartUpload and
        # every confirmation record, and it is PUT exactly once.
        um_puts = [
            i
            for i, r in enumerate(reqs)
            if r.method == "PUT" and r.key == f"{sp}/upload_manifest.json"
        ]
        assert len(um_puts) == 1
        completes = [
            i
            for i, r in enumerate(reqs)
            if r.method == "POST" and "uploadId=" in r.target and r.key.startswith(f"{sp}/rank_")
        ]
        confirms = [
            i
            for i, r in enumerate(reqs)
            if r.method == "PUT" and r.key.startswith(f"{sp}/.confirm/")
        ]
        assert (
            len(completes) == 4 and len(confirms) == 4
        )  # every shard went multipart (12 MiB > 6 MiB)
        assert max(completes + confirms) < um_puts[0]
        # No GET/HEAD of the upload manifest found it before (first access is the existence check).
        marker = json.loads((root / step_dir_name(s) / UPLOADED_MARKER_NAME).read_text())
        assert marker["step"] == s
    shard_gets = [r for r in reqs if r.method == "GET" and r.key.endswith(".safetensors")]
    assert len(shard_gets) == (
        0 if s3_server.validates_checksums else 12
    )  # read-back: one GET per shard
    latest = LatestPointer.from_json(remote_bytes(s3_bucket, f"{s3_bucket.prefix}/latest"))
    assert latest.step == 30  # never moved backwards by the older steps uploaded after it
    assert not list(
        s3_bucket.client.list_multipart_uploads(Bucket=s3_bucket.bucket).get("Uploads", [])
    )


@pytest.mark.slow  # quick-tier budget (under 3 minutes); the full run keeps it
def test_server_checksum_confirmation_compares_composite_crc32c(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    """Where the server validates checksums the shard is confirmed by the composite CRC32C it
    reports (moto computes it from the bytes it stored). moto does not validate, so the test tells
    the uploader it does, as bench/upload.py does: a byte flipped in an UploadPart body then shows
    up as a composite that differs from the one computed locally, and the shard is sent again."""
    import google_crc32c

    from tiered_ckpt.store.checksums import composite_crc32c_b64

    root = tmp_path / "node"
    make_step(root, 1)
    make_step(root, 2)
    client = s3_infra.make_test_client(fault_proxy.url)
    with _uploader(root, s3_bucket, client) as up:
        up.session.checksum_validation = True  # as a validating server (S3, MinIO) would be probed
        um = up.upload_step(1)
        assert {s.confirmed_by for s in um.shards} == {"server-checksum"}
        sp = save_prefix(s3_bucket, root, 1)
        for rec in read_manifest(root, 1).shards:
            data = (root / step_dir_name(1) / rec.path).read_bytes()
            assert remote_bytes(s3_bucket, f"{sp}/{rec.path}") == data
            c = json.loads(remote_bytes(s3_bucket, f"{sp}/.confirm/rank_{rec.rank:05d}.json"))
            crcs = [
                google_crc32c.value(data[i : i + 5 * MiB]).to_bytes(4, "big")
                for i in range(0, len(data), 5 * MiB)
            ]
            assert c["checksum_algorithm"] == "CRC32C" and c["checksum"] == composite_crc32c_b64(
                crcs
            )
            assert c["confirmed_by"] == "server-checksum" and c["sha256"] == rec.sha256
        flip = fault_proxy.flip_byte_first(1, s3_infra.is_upload_part)
        before = fault_proxy.count(lambda r: r.method == "POST" and r.target.endswith("?uploads"))
        um2 = up.upload_step(2)
    assert flip.applied == 1
    assert (
        fault_proxy.count(lambda r: r.method == "POST" and r.target.endswith("?uploads")) - before
        == 5
    )
    assert {s.confirmed_by for s in um2.shards} == {"server-checksum"}
    sp = save_prefix(s3_bucket, root, 2)
    for rec in read_manifest(root, 2).shards:
        assert (
            remote_bytes(s3_bucket, f"{sp}/{rec.path}")
            == (root / step_dir_name(2) / rec.path).read_bytes()
        )


@seaweedfs_only
def test_a_byte_flipped_in_flight_is_refused_by_the_server_and_resent(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    """On a server that validates (SeaweedFS, probed for real: nothing forced) a byte flipped in one
    UploadPart body is refused by the server itself (400 BadDigest): only that part is sent again,
    within the same multipart upload, and every shard is confirmed by the server's composite CRC32C,
    never read back."""
    root = tmp_path / "node"
    make_step(root, 1)
    client = s3_infra.make_test_client(fault_proxy.url)
    flip = fault_proxy.flip_byte_first(1, s3_infra.is_upload_part)
    with _uploader(root, s3_bucket, client) as up:
        assert up.server_validates_checksums() is True
        um = up.upload_step(1)
    assert flip.applied == 1
    assert {s.confirmed_by for s in um.shards} == {"server-checksum"}
    reqs = fault_proxy.requests
    assert (
        sum(1 for r in reqs if r.method == "POST" and r.target.endswith("?uploads")) == 4
    )  # one per shard
    assert (
        sum(1 for r in reqs if r.method == "PUT" and "partNumber=" in r.target) == 4 * 3 + 1
    )  # + the resent part
    assert not [
        r for r in reqs if r.method == "GET" and r.key.endswith(".safetensors")
    ]  # no read-back
    sp = save_prefix(s3_bucket, root, 1)
    for rec in read_manifest(root, 1).shards:
        assert (
            remote_bytes(s3_bucket, f"{sp}/{rec.path}")
            == (root / step_dir_name(1) / rec.path).read_bytes()
        )


@both_servers
def test_restart_does_not_resend_confirmed_shards(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    root = tmp_path / "node"
    make_step(root, 5)
    client = s3_infra.make_test_client(fault_proxy.url)
    with _uploader(root, s3_bucket, client) as up:
        up.upload_step(5)
    sp = save_prefix(s3_bucket, root, 5)
    # Simulate a crash after the shards were confirmed, before the commit: drop the commit and
    # marker.
    s3_bucket.client.delete_object(Bucket=s3_bucket.bucket, Key=f"{sp}/upload_manifest.json")
    (root / step_dir_name(5) / UPLOADED_MARKER_NAME).unlink()
    n_parts = fault_proxy.count(lambda r: r.method == "PUT" and "partNumber=" in r.target)
    with _uploader(root, s3_bucket, client) as up:
        assert up.pending_steps() == [5]
        um = up.upload_step(5)
    assert fault_proxy.count(lambda r: r.method == "PUT" and "partNumber=" in r.target) == n_parts
    assert um.step == 5 and (root / step_dir_name(5) / UPLOADED_MARKER_NAME).is_file()


@both_servers
def test_two_nodes_commit_exactly_when_all_confirmed(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    src = tmp_path / "src"
    make_step(src, 7)
    a, b = tmp_path / "nodeA", tmp_path / "nodeB"
    split_nodes(src, a, b, 7, ranks_a=[0, 1])
    sp = save_prefix(s3_bucket, src, 7)
    with _uploader(a, s3_bucket) as up_a, _uploader(b, s3_bucket) as up_b:
        with pytest.raises(StepIncompleteError) as ei:
            up_a.upload_step(7)
        assert ei.value.missing_ranks == (2, 3)
        keys = list_keys(s3_bucket, sp + "/")
        assert sorted(k for k in keys if "/.confirm/" in k) == [
            f"{sp}/.confirm/rank_00000.json",
            f"{sp}/.confirm/rank_00001.json",
        ]
        assert f"{sp}/upload_manifest.json" not in keys
        assert not (a / step_dir_name(7) / UPLOADED_MARKER_NAME).exists()
        assert up_a.pending_steps() == [7]
        um_b = up_b.upload_step(7)  # confirms the last shards: writes the upload manifest
        assert f"{sp}/upload_manifest.json" in list_keys(s3_bucket, sp + "/")
        um_a = up_a.upload_step(7)  # sees the commit, writes its marker, sends nothing again
        assert um_a == um_b and up_a.pending_steps() == [] and up_b.pending_steps() == []
    m = read_manifest(src, 7)
    for rec in m.shards:
        assert (
            remote_bytes(s3_bucket, f"{sp}/{rec.path}")
            == (src / step_dir_name(7) / rec.path).read_bytes()
        )


@pytest.mark.slow  # about 7 s (quick-tier budget)
@both_servers
def test_two_nodes_racing(tmp_path: Path, s3_bucket: s3_infra.S3Location) -> None:
    """Both sidecars upload at once; whoever confirms the last shard commits; the manifest is
    identical."""
    src = tmp_path / "src"
    for s in (1, 2):
        make_step(src, s, shard_bytes=7 * 1024 * 1024)
    a, b = tmp_path / "nodeA", tmp_path / "nodeB"
    for s in (1, 2):
        split_nodes(src, a, b, s, ranks_a=[0, 1])
    results: dict[str, list[int]] = {}
    ups = [_uploader(a, s3_bucket), _uploader(b, s3_bucket)]

    def go(name: str, up: Uploader) -> None:
        stop = threading.Event()
        results[name] = []
        for _ in range(200):
            results[name] += UploadLoop(up, poll_interval_s=0.05, failure_backoff_s=0).run(
                stop, once=True
            )
            if not up.pending_steps():
                return
            stop.wait(0.05)

    threads = [threading.Thread(target=go, args=(n, u)) for n, u in zip("ab", ups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for u in ups:
        assert u.pending_steps() == []
        u.close()
    for s in (1, 2):
        um = UploadManifest.from_json(
            remote_bytes(s3_bucket, f"{save_prefix(s3_bucket, src, s)}/upload_manifest.json")
        )
        assert [r.rank for r in um.shards] == [0, 1, 2, 3]
    assert LatestPointer.from_json(remote_bytes(s3_bucket, f"{s3_bucket.prefix}/latest")).step == 2


@both_servers
def test_skip_intermediate_and_remote_retention(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    root = tmp_path / "node"
    small = 64 * 1024
    for s in (1, 2, 3):
        make_step(root, s, shard_bytes=small)
    with _uploader(
        root, s3_bucket, policy=UploadPolicy(skip_intermediate=True, keep_remote_last=2)
    ) as up:
        assert UploadLoop(up, poll_interval_s=0.01).run(once=True) == [3]
        for s in (1, 2):  # released for rotation, never uploaded
            assert (
                json.loads((root / step_dir_name(s) / UPLOADED_MARKER_NAME).read_text())["skipped"]
                is True
            )
        for s in (4, 5, 6):
            make_step(root, s, shard_bytes=small)
            assert UploadLoop(up, poll_interval_s=0.01).run(once=True) == [s]
        assert up.remote_committed_steps() == [5, 6]
    keys = list_keys(s3_bucket)
    assert not any(
        step_dir_name(s) in k for k in keys for s in (3, 4)
    )  # every object of deleted steps


@both_servers
def test_upload_manifest_deleted_first_on_retention(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    root = tmp_path / "node"
    for s in (1, 2):
        make_step(root, s, shard_bytes=64 * 1024)
    calls: list[list[str]] = []
    with _uploader(root, s3_bucket, policy=UploadPolicy(keep_remote_last=1)) as up:
        real = up.store.delete
        up.store.delete = lambda keys: (calls.append(list(keys)), real(calls[-1]))[1]  # type: ignore[method-assign]
        UploadLoop(up, poll_interval_s=0.01).run(once=True)
    d1 = save_entry(root, 1)
    calls = [c for c in calls if any(k.startswith("step_") for k in c)]
    assert calls[0] == [f"{d1}/upload_manifest.json"]  # un-committed before anything else goes
    assert any(f"{d1}/rank_00000.safetensors" in c for c in calls[1:])
    assert not [k for k in list_keys(s3_bucket) if d1 in k]


def test_a_symlinked_local_manifest_is_never_uploaded(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    """The sidecar reads manifest.json as the local catalogue does: a symlink to bytes outside the
    step (outside the checkpoint directory) is refused, and nothing of the step reaches the
    bucket."""
    from tiered_ckpt.errors import ManifestError
    from tiered_ckpt.layout import MANIFEST_NAME

    root = tmp_path / "node"
    make_step(root, 10, shard_bytes=1 * MiB)
    mpath = root / step_dir_name(10) / MANIFEST_NAME
    outside = tmp_path / "outside.json"
    outside.write_bytes(mpath.read_bytes())
    mpath.unlink()
    mpath.symlink_to(outside)
    with _uploader(root, s3_bucket) as up:
        with pytest.raises(ManifestError, match="symlink"):
            up.upload_step(10)
    assert list_keys(s3_bucket) == []


@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_runs_with_an_external_stop_event_leave_no_thread_behind(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    """``run(stop_event=E)`` relays E to the store's stop event while it runs; the relay ends with
    the run (it used to wait on E for ever: one thread left per call of a sidecar that never sets
    E)."""
    root = tmp_path / "run"
    make_step(root, 1, world_size=1, shard_bytes=4096)
    external = threading.Event()
    with _uploader(root, s3_bucket) as up:
        UploadLoop(up).run(external, once=True)  # starts the executors' and the watchdog's threads
        threading.Event().wait(0.5)
        before = threading.active_count()
        for _ in range(5):
            UploadLoop(up).run(external, once=True)
        assert not up.stop_event.is_set()
        deadline = threading.Event()
        deadline.wait(0.5)  # a relay notices the end of its run within 0.2 s
        assert threading.active_count() <= before, [t.name for t in threading.enumerate()]
