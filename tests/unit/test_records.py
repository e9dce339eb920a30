"""The upload tier's small records (tiered_ckpt.format.records): the exact bytes earlier releases
wrote (existing buckets and run directories stay readable), validation with typed errors, and
tolerance of keys another version may add."""

from __future__ import annotations

import json

import pytest

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.records import ConfirmationRecord, UploadedMarker

SHA = "ab" * 32


def _record(**over: object) -> dict[str, object]:
    d: dict[str, object] = {
        "rank": 3,
        "key": "p/step_0000000010/rank_00003.safetensors",
        "size_bytes": 4096,
        "sha256": SHA,
        "confirmed_by": "server-checksum",
        "checksum_algorithm": "CRC32C",
        "checksum": "AAAAAA==-2",
        "save_id": "sid_1",
    }
    d.update(over)
    return d


def test_confirmation_record_bytes_are_the_ones_written_before() -> None:
    old = json.dumps(_record(), sort_keys=True) + "\n"  # what the round-1 uploader PUT
    rec = ConfirmationRecord.from_json(old)
    assert rec.to_json() == old
    assert rec.confirms(sha256=SHA, size_bytes=4096, save_id="sid_1")
    assert not rec.confirms(sha256=SHA, size_bytes=4096, save_id="sid_2")


def test_uploaded_marker_bytes_are_the_ones_written_before() -> None:
    for old in (
        {"step": 10, "remote": "s3://b/p", "upload_manifest_sha256": SHA},
        {"step": 10, "skipped": True, "remote": "s3://b/p"},
        {"step": 10, "remote": "s3://b/p", "upload_manifest_sha256": SHA, "restored": True},
    ):
        text = json.dumps(old, indent=1, sort_keys=True) + "\n"
        m = UploadedMarker.from_json(text)
        assert m.to_json() == text
        assert m.names_remote("s3://b/p/") and not m.names_remote("s3://b/q")


def test_unknown_keys_are_ignored_and_old_records_lack_checksums() -> None:
    rec = ConfirmationRecord.from_dict(_record(future_field=[1, 2]))
    assert rec.save_id == "sid_1"
    legacy = _record()
    del legacy["checksum_algorithm"], legacy["checksum"]
    assert ConfirmationRecord.from_dict(legacy).checksum is None
    assert UploadedMarker.from_dict({"step": 1, "remote": "s3://b/p", "lineage": "x"}).step == 1


@pytest.mark.parametrize(
    "bad",
    [
        _record(rank="3"),
        _record(rank=-1),
        _record(size_bytes=True),
        _record(sha256="AB" * 32),
        _record(confirmed_by="trust-me"),
        _record(save_id="has space"),
        _record(checksum=7),
        {k: v for k, v in _record().items() if k != "sha256"},
        [1, 2],
        "text",
    ],
)
def test_confirmation_record_validation(bad: object) -> None:
    with pytest.raises(ManifestError):
        ConfirmationRecord.from_dict(bad)


@pytest.mark.parametrize(
    "bad",
    [
        {"step": 1},
        {"remote": "s3://b/p"},
        {"step": -1, "remote": "s3://b/p"},
        {"step": 1, "remote": 5},
        {"step": 1, "remote": "s3://b/p", "skipped": "yes"},
        {"step": 1, "remote": "s3://b/p", "upload_manifest_sha256": "nothex"},
    ],
)
def test_uploaded_marker_validation(bad: object) -> None:
    with pytest.raises(ManifestError):
        UploadedMarker.from_dict(bad)


def test_duplicate_keys_and_bad_json_are_manifest_errors() -> None:
    with pytest.raises(ManifestError):
        UploadedMarker.from_json('{"step": 1, "step": 2, "remote": "s3://b/p"}')
    with pytest.raises(ManifestError):
        ConfirmationRecord.from_json(b"\xff not json")
