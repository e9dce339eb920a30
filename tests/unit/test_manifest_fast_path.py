"""The manifest reader's fast path for shard records (``format.manifest._fast_record``) accepts
exactly what the full validation accepts: the same record for valid input, and for every invalid
field value it steps aside so that the full validation raises its ManifestError."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format import manifest as mf

VALID: dict[str, Any] = {
    "rank": 3,
    "path": "rank_00003.safetensors",
    "sha256": "a" * 64,
    "size_bytes": 4096,
    "param_shard_offset": 10,
    "param_shard_numel": 20,
    "host": "node-1.example",
    "save_id": "abc_123",
    "crc32c": "0123abcd",
    "header_sha256": "b" * 64,
    "crc32c_chunk_bytes": 1 << 20,
    "header_size_bytes": 512,
}


def _slow(obj: Any, monkeypatch: pytest.MonkeyPatch) -> mf.ShardRecord:
    with monkeypatch.context() as m:
        m.setattr(mf, "_fast_record", lambda cls, o: None)
        return mf.ShardRecord.from_dict(obj)


@pytest.mark.parametrize("drop", [None, "host", "save_id", "header_size_bytes"])
def test_fast_path_gives_the_record_the_full_validation_gives(
    drop: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    obj = {k: v for k, v in VALID.items() if k != drop}
    assert mf._fast_record(mf.ShardRecord, obj) is not None
    assert mf.ShardRecord.from_dict(obj) == _slow(obj, monkeypatch)


BAD = [
    ("rank", -1),
    ("rank", True),
    ("rank", 3.0),
    ("rank", 4),
    ("rank", 10**5),
    ("path", "../x"),
    ("path", "rank_3.safetensors"),
    ("sha256", "A" * 64),
    ("sha256", "a" * 63),
    ("sha256", "a" * 64 + "\n"),
    ("size_bytes", 7),
    ("size_bytes", True),
    ("size_bytes", 2**49),
    ("param_shard_offset", -1),
    ("param_shard_numel", "1"),
    ("host", "a b"),
    ("host", "x" * 256),
    ("save_id", "a/b"),
    ("save_id", "x" * 65),
    ("crc32c", "0123abcz"),
    ("crc32c", None),
    ("header_sha256", None),
    ("crc32c_chunk_bytes", 3000),
    ("crc32c_chunk_bytes", 1024),
    ("crc32c_chunk_bytes", 2**31),
    ("crc32c_chunk_bytes", None),
    ("header_size_bytes", 7),
    ("header_size_bytes", 4097),
    ("header_size_bytes", True),
    ("unknown_key", 1),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}"[:40] for f, v in BAD])
def test_fast_path_never_accepts_what_the_full_validation_refuses(field: str, value: Any) -> None:
    obj = copy.deepcopy(VALID)
    obj[field] = value
    assert mf._fast_record(mf.ShardRecord, obj) is None
    with pytest.raises(ManifestError):
        mf.ShardRecord.from_dict(obj)
