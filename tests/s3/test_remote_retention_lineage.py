"""Lineage-aware remote retention, pins mirrored to the bucket, restore carrying the run, and the
cost of a poll while other nodes confirm (SPEC §11), against moto's S3
server over HTTP."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import s3_infra
from _upload_util import make_step, save_entry, split_nodes
from s3_servers import both_servers

from tiered_ckpt import Uploader, restore
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.layout import PINNED_MARKER_NAME, RUN_RECORD_NAME
from tiered_ckpt.local.pins import pin_step
from tiered_ckpt.remote.catalogue import read_catalogue, remote_committed_steps
from tiered_ckpt.remote.upload.uploader import UploadPolicy
from tiered_ckpt.retry import RetryPolicy

KiB = 1024
FAST_RETRY = RetryPolicy(max_attempts=4, initial_wait_s=0.02, max_wait_s=0.1)
T0 = "2026-01-01T00:00:00.000000Z"
RUN_A, RUN_B = "a" * 32, "b" * 32


def new_run(root: Path, run_id: str) -> RunLineage:
    lin = RunLineage.first(run_id, T0)
    root.mkdir(parents=True, exist_ok=True)
    (root / RUN_RECORD_NAME).write_text(lin.to_json())
    return lin


def step(root: Path, s: int) -> None:
    make_step(root, s, shard_bytes=32 * KiB, world_size=2)


def uploader(root: Path, loc: s3_infra.S3Location, client=None, **kw) -> Uploader:
    return Uploader(root, loc.url, s3_client=client or loc.client, retry=FAST_RETRY, **kw)


def saves(loc: s3_infra.S3Location, client=None) -> list[tuple[int, int, str]]:
    """(step, attempt, status) of every committed save."""
    from tiered_ckpt.store import S3Store

    with S3Store.from_url(loc.url, client=client or loc.client) as st:
        cat = read_catalogue(st)
        return [(s.step, s.attempt, cat.status(s)) for s in cat.saves]


def keys(loc: s3_infra.S3Location) -> list[str]:
    out = []
    for page in loc.client.get_paginator("list_objects_v2").paginate(
        Bucket=loc.bucket, Prefix=loc.prefix + "/"
    ):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


@both_servers
@pytest.mark.slow  # over 1 s (quick tier: 3 minutes in all)
def test_superseded_saves_go_only_after_keep_last_current_and_never_pinned(
    tmp_path: Path, s3_bucket: s3_infra.S3Location
) -> None:
    root = tmp_path / "node"
    lin1 = new_run(root, RUN_A)
    for s in (500, 600, 700):
        step(root, s)
    pin_step(root, 600)  # pinned before the upload: mirrored with its commit
    with uploader(root, s3_bucket) as up:
        for s in (500, 600, 700):
            up.upload_step(s)
    pinned = [k for k in keys(s3_bucket) if k.endswith("/" + PINNED_MARKER_NAME)]
    assert pinned == [f"{s3_bucket.prefix}/{save_entry(root, 600)}/{PINNED_MARKER_NAME}"]
    entry_700 = save_entry(root, 700)

    lin2 = lin1.new_attempt(supersedes_from=501, resumed_from=500, started_at=T0)
    (root / RUN_RECORD_NAME).write_text(lin2.to_json())
    policy = UploadPolicy(keep_remote_last=3)
    with uploader(root, s3_bucket, policy=policy) as up:
        step(root, 510)
        up.upload_step(510)
        assert (
            up.apply_remote_retention() == []
        )  # 2 current steps < keep_last: nothing superseded goes
        step(root, 520)
        up.upload_step(520)
        assert up.apply_remote_retention() == [700]  # 3 current: 700 goes, the pinned 600 stays
        assert not [k for k in keys(s3_bucket) if entry_700 in k]  # every object of it
        step(root, 530)
        up.upload_step(530)
        assert up.apply_remote_retention() == [500]  # the oldest current beyond keep_last
    assert saves(s3_bucket) == [
        (510, 2, "current"),
        (520, 2, "current"),
        (530, 2, "current"),
        (600, 1, "superseded by attempt 2 from step 501"),
    ]
    assert remote_committed_steps(s3_bucket.url, s3_client=s3_bucket.client) == [510, 520, 530]


@both_servers
def test_pins_of_steps_uploaded_earlier_are_mirrored(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    from tiered_ckpt.remote.upload.step_upload import mirror_pins

    root = tmp_path / "node"
    new_run(root, RUN_A)
    for s in (1, 2, 3):
        step(root, s)
    client = s3_infra.make_test_client(fault_proxy.url)
    with uploader(root, s3_bucket, client) as up:
        for s in (1, 2, 3):
            up.upload_step(s)
        pin_step(root, 2)
        done: set = set()
        n0 = len(fault_proxy.requests)
        assert mirror_pins(up.store, root, done) == [2]
        reqs = fault_proxy.requests[n0:]
        assert [(r.method, r.key.rsplit("/", 1)[-1]) for r in reqs] == [
            ("HEAD", PINNED_MARKER_NAME),
            ("HEAD", "upload_manifest.json"),
            ("PUT", PINNED_MARKER_NAME),
        ]
        n1 = len(fault_proxy.requests)
        assert mirror_pins(up.store, root, done) == []  # remembered: no request at all
        assert len(fault_proxy.requests) == n1
        assert mirror_pins(up.store, root) == []  # a fresh memory: one HEAD finds it mirrored
        assert [r.method for r in fault_proxy.requests[n1:]] == ["HEAD"]
        up.policy = UploadPolicy(keep_remote_last=1)
        assert up.apply_remote_retention() == [1]  # the pinned 2 survives keep_last=1
    assert [s for s, _, _ in saves(s3_bucket)] == [2, 3]


@both_servers
def test_restore_carries_the_run(tmp_path: Path, s3_bucket: s3_infra.S3Location) -> None:
    root = tmp_path / "node"
    lin1 = new_run(root, RUN_A)
    step(root, 500)
    old = tmp_path / "old_root"
    shutil.copytree(root, old)  # a root of this run that only knows attempt 1
    lin2 = lin1.new_attempt(supersedes_from=501, resumed_from=500, started_at=T0)
    (root / RUN_RECORD_NAME).write_text(lin2.to_json())
    step(root, 510)
    with uploader(root, s3_bucket) as up:
        up.upload_step(500)
        up.upload_step(510)
    # Into a root of another run (fine tuning): allowed, and the root keeps its own record.
    other = tmp_path / "finetune"
    lin_b = new_run(other, RUN_B)
    assert restore(s3_bucket.url, other, s3_client=s3_bucket.client).step == 510
    assert RunLineage.from_json((other / RUN_RECORD_NAME).read_text()) == lin_b
    # Into an older root of the same run: it learns the newer attempt before the step commits.
    assert restore(s3_bucket.url, old, s3_client=s3_bucket.client).step == 510
    assert RunLineage.from_json((old / RUN_RECORD_NAME).read_text()) == lin2
    # A root whose record supersedes what the bucket's does not know yet never gets that step.
    ahead = tmp_path / "ahead"
    lin3 = lin2.new_attempt(supersedes_from=505, resumed_from=500, started_at=T0)
    ahead.mkdir()
    (ahead / RUN_RECORD_NAME).write_text(lin3.to_json())
    assert restore(s3_bucket.url, ahead, s3_client=s3_bucket.client).step == 500
    assert RunLineage.from_json((ahead / RUN_RECORD_NAME).read_text()) == lin3


@both_servers
def test_a_poll_while_other_nodes_confirm_is_one_list(
    tmp_path: Path, s3_bucket: s3_infra.S3Location, fault_proxy: s3_infra.FaultProxy
) -> None:
    """The commit object of a StepIncompleteError, passed back as ``resume``, makes the next poll
    one LIST of the save's .confirm/ prefix: no re-read of the run record, the upload manifest, the
    local shards' records or the mirrored manifest, and no re-PUT of anything. Once the other node's
    records are listed they are GET once, then the fence and the commit."""
    from tiered_ckpt.remote.upload.step_upload import upload_step
    from tiered_ckpt.remote.upload.uploader import StepIncompleteError

    src, a, b = tmp_path / "src", tmp_path / "nodeA", tmp_path / "nodeB"
    lin = new_run(src, RUN_A)
    make_step(src, 9, shard_bytes=32 * KiB, world_size=4)
    split_nodes(src, a, b, 9, ranks_a=[0, 1])
    for r in (a, b):
        (r / RUN_RECORD_NAME).write_text(lin.to_json())
    client = s3_infra.make_test_client(fault_proxy.url)
    with uploader(a, s3_bucket, client) as up:

        def poll(resume):
            return upload_step(
                up.session,
                9,
                resume=resume,
            )

        with pytest.raises(StepIncompleteError) as ei:
            poll(None)
        commit = ei.value.commit
        assert commit is not None and ei.value.missing_ranks == (2, 3)
        for _ in range(3):
            n0 = len(fault_proxy.requests)
            with pytest.raises(StepIncompleteError) as ei:
                poll(commit)
            reqs = fault_proxy.requests[n0:]
            assert [(r.method, "list-type=2" in r.target) for r in reqs] == [("GET", True)], reqs
            assert ei.value.commit is commit
        with uploader(b, s3_bucket) as up_b:  # node B confirms ranks 2-3 (and commits the save)
            up_b.upload_step(9)
        n0 = len(fault_proxy.requests)
        um, _, _ = poll(commit)
        names = [(r.method, r.key.rsplit("/", 1)[-1]) for r in fault_proxy.requests[n0:]]
        assert names[:3] == [("GET", ""), ("GET", "rank_00002.json"), ("GET", "rank_00003.json")]
        assert ("PUT", "upload_manifest.json") not in names  # B committed first: seen by one GET
        assert um.step == 9 and [s.rank for s in um.shards] == [0, 1, 2, 3]
