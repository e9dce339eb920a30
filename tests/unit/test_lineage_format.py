"""The schema-3 lineage records (format/lineage.py, the per-save remote key scheme in layout.py,
the lineage fields of the upload manifest, latest pointer, confirmation record and uploaded
marker)."""

from __future__ import annotations

import json

import pytest

from tiered_ckpt.errors import LineageError, ManifestError
from tiered_ckpt.format.lineage import Attempt, RunLineage, Superseded
from tiered_ckpt.format.records import ConfirmationRecord, UploadedMarker
from tiered_ckpt.format.upload_manifest import LatestPointer, RemoteShard, UploadManifest
from tiered_ckpt.layout import (
    parse_remote_step_entry,
    remote_run_key,
    remote_save_key,
    remote_save_prefix,
    save_entry_name,
)

SHA = "ab" * 32


def rolled_back() -> RunLineage:
    """500, 600, 700 saved in attempt 1; attempt 2 resumed from 500; attempt 3 saved 100 without
    loading."""
    return (
        RunLineage.first("run-a", "t1")
        .new_attempt(supersedes_from=501, resumed_from=500, started_at="t2")
        .new_attempt(supersedes_from=100, resumed_from=None, started_at="t3")
    )


def test_current_and_superseded_steps() -> None:
    lin = rolled_back()
    assert lin.attempt == 3
    assert lin.superseded_by(1, 600) == Superseded(
        2, 501
    )  # the earliest attempt that supersedes it
    assert lin.superseded_by(1, 500) == Superseded(3, 100)
    assert lin.superseded_by(2, 550) == Superseded(3, 100)
    assert lin.is_current(1, 99) and lin.is_current(2, 99) and lin.is_current(3, 700)
    assert lin.is_current(4, 0)  # an attempt newer than the record knows is never judged superseded


def test_round_trip_is_canonical_and_validated() -> None:
    lin = rolled_back()
    assert RunLineage.from_json(lin.to_json()) == lin
    assert lin.to_json() == RunLineage.from_json(lin.to_json().encode()).to_json()
    d = lin.to_dict()
    for change, msg in [
        ({"run_id": "../x"}, "run_id"),
        ({"schema_version": 2}, "not supported"),
        ({"attempts": []}, "non-empty"),
        ({"attempts": d["attempts"][1:]}, "expected 1"),
        ({"attempts": [dict(d["attempts"][0], supersedes_from=3)]}, "attempt 1 and only"),
        (
            {"attempts": [d["attempts"][0], dict(d["attempts"][1], supersedes_from=None)]},
            "attempt 1 and only",
        ),
        ({"extra": 1}, "unknown"),
    ]:
        with pytest.raises(ManifestError, match=msg):
            RunLineage.from_dict(dict(d, **change))


def test_merge_takes_the_newer_record_and_refuses_divergence() -> None:
    a1 = RunLineage.first("run-a", "t1")
    a2 = a1.new_attempt(supersedes_from=31, resumed_from=30, started_at="t2")
    assert a1.merge(a2) == a2 and a2.merge(a1) == a2 and a2.extends(a1) and not a1.extends(a2)
    other = a1.new_attempt(supersedes_from=21, resumed_from=20, started_at="t2")
    with pytest.raises(LineageError, match="diverged"):
        a2.merge(other)
    with pytest.raises(LineageError, match="different runs"):
        a2.merge(RunLineage.first("run-b", "t1"))


def test_per_save_remote_keys() -> None:
    assert remote_save_prefix("runs/a/", 40, "s1") == "runs/a/step_0000000040.s1"
    assert remote_save_key("", 40, None, "manifest.json") == "step_0000000040/manifest.json"
    assert remote_run_key("runs/a") == "runs/a/run.json" and remote_run_key("") == "run.json"
    assert parse_remote_step_entry(save_entry_name(40, "s-1_x")) == (40, "s-1_x")
    assert parse_remote_step_entry("step_0000000040") == (40, None)
    for bad in (
        "step_0000000040.",
        "step_0000000040.a.b",
        "step_40.x",
        "step_0000000040.x/",
        "step_0000000040.é",
    ):
        assert parse_remote_step_entry(bad) is None
    with pytest.raises(ValueError):
        save_entry_name(40, "a.b")


def upload_manifest(version: int, sid: str = "s1") -> UploadManifest:
    key_sid = sid if version >= 2 else None
    shards = tuple(
        RemoteShard(
            r,
            remote_save_key("p", 7, key_sid, f"rank_{r:05d}.safetensors"),
            100,
            SHA,
            "read-back",
            '"e%d"' % r if version >= 2 else None,
        )
        for r in range(2)
    )
    extra = dict(run_id="run-a", attempt=2, created_at="t") if version >= 2 else {}
    return UploadManifest(
        step=7,
        world_size=2,
        save_id=sid,
        prefix="p",
        manifest_key=remote_save_key("p", 7, key_sid, "manifest.json"),
        manifest_sha256=SHA,
        shards=shards,
        schema_version=version,
        **extra,
    )


def test_upload_manifest_schema_2_and_round_1() -> None:
    um = upload_manifest(2)
    assert UploadManifest.from_json(um.to_json()) == um
    assert (um.key_save_id, um.run_id, um.attempt) == ("s1", "run-a", 2)
    old = upload_manifest(1)
    d = json.loads(old.to_json())
    assert "run_id" not in d and "etag" not in d["shards"][0]  # exactly the round-1 bytes
    back = UploadManifest.from_json(old.to_json())
    assert (back.key_save_id, back.run_id, back.attempt, back.schema_version) == (None, None, 1, 1)
    # a schema-2 manifest must name keys of its own save, and every shard's re-checked ETag
    bad = json.loads(um.to_json())
    bad["shards"][0]["key"] = remote_save_key("p", 7, "other", "rank_00000.safetensors")
    with pytest.raises(ManifestError, match="outside step"):
        UploadManifest.from_dict(bad)
    bad = json.loads(um.to_json())
    del bad["shards"][1]["etag"]
    with pytest.raises(ManifestError, match="etag is required"):
        UploadManifest.from_dict(bad)
    with pytest.raises(ManifestError, match="not supported"):
        UploadManifest.from_dict(dict(json.loads(um.to_json()), schema_version=3))


def test_latest_pointer_orders_by_attempt_then_step() -> None:
    old = LatestPointer.from_json(json.dumps({"step": 900, "upload_manifest_sha256": SHA}))
    assert (old.attempt, old.save_id, old.order) == (1, None, (1, 900))
    new = LatestPointer(40, SHA, attempt=2, save_id="s2")
    assert LatestPointer.from_json(new.to_json()) == new and new.order > old.order
    with pytest.raises(ManifestError, match="go together"):
        LatestPointer.from_json(
            json.dumps({"step": 1, "upload_manifest_sha256": SHA, "attempt": 2})
        )


def test_confirmation_etag_and_marker_manifest_sha_are_optional() -> None:
    c = ConfirmationRecord(0, "k", 10, SHA, "read-back", None, None, "s1", etag='"abc"')
    assert ConfirmationRecord.from_json(c.to_json()) == c
    old = ConfirmationRecord(0, "k", 10, SHA, "read-back", None, None, "s1")
    assert "etag" not in json.loads(old.to_json())
    m = UploadedMarker(3, "s3://b/p", SHA, manifest_sha256="cd" * 32)
    assert UploadedMarker.from_json(m.to_json()) == m
    assert m.matches_manifest("cd" * 32) and not m.matches_manifest(SHA)
    assert UploadedMarker(3, "s3://b/p", SHA).matches_manifest(SHA)  # a round-1 marker matches any


def test_attempt_dataclass_direct() -> None:
    assert Attempt.from_dict(Attempt(2, 5, 4, "t").to_dict(), "a") == Attempt(2, 5, 4, "t")
