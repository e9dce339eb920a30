"""The ``hashed`` key layout: pure key functions of layout.py and the upload
manifest's ``key_layout`` (recorded, validated: a shard key must be the one its layout gives)."""

from __future__ import annotations

import hashlib
import json

import pytest

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.upload_manifest import RemoteShard, UploadManifest
from tiered_ckpt.layout import (
    KEY_LAYOUTS,
    MANIFEST_NAME,
    parse_spread_shard_key,
    remote_save_key,
    remote_shard_key,
    save_shard_key,
    spread_prefix,
)

SID = "20240101T000000Z-abc123"


def test_hashed_key_scheme_is_stable_and_spreads_ranks() -> None:
    flat = f"step_0000000012.{SID}/rank_00003.safetensors"
    hh = hashlib.sha256(flat.encode()).hexdigest()[:2]
    assert spread_prefix(12, SID, 3) == hh
    assert save_shard_key(12, SID, 3, "hashed") == f"shards/{hh}/{flat}"
    assert remote_shard_key("/run1/", 12, SID, 3, "hashed") == f"run1/shards/{hh}/{flat}"
    # flat is exactly the key every earlier version wrote
    assert remote_shard_key("run1", 12, SID, 3) == remote_save_key(
        "run1", 12, SID, "rank_00003.safetensors"
    )
    assert remote_shard_key("", 12, None, 3) == "step_0000000012/rank_00003.safetensors"
    # a fixed value: the scheme must never change under existing buckets
    assert (
        spread_prefix(0, "s", 0)
        == hashlib.sha256(b"step_0000000000.s/rank_00000.safetensors").hexdigest()[:2]
    )
    # 512 ranks of one step fall on many prefixes, not one
    assert len({spread_prefix(7, SID, r) for r in range(512)}) > 180
    assert KEY_LAYOUTS == ("flat", "hashed")


def test_spread_key_parse_round_trip_and_refusals() -> None:
    key = save_shard_key(12, SID, 3, "hashed")
    assert parse_spread_shard_key(key) == (12, SID, 3)
    hh = spread_prefix(12, SID, 3)
    wrong = "00" if hh != "00" else "01"
    assert parse_spread_shard_key(key.replace(f"/{hh}/", f"/{wrong}/")) is None  # not its hash
    assert parse_spread_shard_key("x/" + key) is None
    assert parse_spread_shard_key(save_shard_key(12, SID, 3)) is None
    with pytest.raises(ValueError, match="save id"):
        save_shard_key(12, None, 3, "hashed")  # round-1 saves are flat
    with pytest.raises(ValueError, match="key_layout"):
        save_shard_key(12, SID, 3, "sharded")


def _um(layout: str, prefix: str = "run1") -> UploadManifest:
    shards = tuple(
        RemoteShard(
            rank=r,
            key=remote_shard_key(prefix, 5, SID, r, layout),
            size_bytes=100,
            sha256="ab" * 32,
            confirmed_by="read-back",
            etag='"e"',
        )
        for r in range(3)
    )
    return UploadManifest(
        step=5,
        world_size=3,
        save_id=SID,
        prefix=prefix,
        manifest_key=remote_save_key(prefix, 5, SID, MANIFEST_NAME),
        manifest_sha256="cd" * 32,
        shards=shards,
        run_id=None,
        attempt=1,
        created_at="2024-01-01T00:00:00Z",
        key_layout=layout,
    )


def test_upload_manifest_records_the_layout_and_flat_bytes_are_unchanged() -> None:
    flat, hashed = _um("flat"), _um("hashed")
    assert "key_layout" not in json.loads(
        flat.to_json()
    )  # what earlier versions wrote, byte for byte
    assert json.loads(hashed.to_json())["key_layout"] == "hashed"
    assert json.loads(hashed.to_json())["schema_version"] == 2  # no bump
    back = UploadManifest.from_json(hashed.to_json())
    assert back == hashed and back.key_layout == "hashed"
    assert UploadManifest.from_json(flat.to_json()).key_layout == "flat"
    assert (
        back.shards[1].key
        == f"run1/shards/{spread_prefix(5, SID, 1)}/step_0000000005.{SID}/rank_00001.safetensors"
    )


@pytest.mark.parametrize(
    "where", ["flat key", "other hash", "other prefix", "other step", "layout says flat"]
)
def test_tampered_shard_key_is_refused(where: str) -> None:
    d = json.loads(_um("hashed").to_json())
    good = d["shards"][1]["key"]
    hh = spread_prefix(5, SID, 1)
    bad = {
        "flat key": remote_shard_key("run1", 5, SID, 1),
        "other hash": good.replace(f"/{hh}/", "/00/" if hh != "00" else "/01/"),
        "other prefix": good.replace("run1/", "elsewhere/", 1),
        "other step": remote_shard_key("run1", 6, SID, 1, "hashed"),
        "layout says flat": good,
    }[where]
    d["shards"][1]["key"] = bad
    if where == "layout says flat":
        d["key_layout"] = "flat"
    with pytest.raises(ManifestError, match="outside step 5"):
        UploadManifest.from_json(json.dumps(d))


def test_unknown_layout_and_layout_in_schema_1_are_refused() -> None:
    d = json.loads(_um("hashed").to_json())
    d["key_layout"] = "sharded"
    with pytest.raises(ManifestError, match="key_layout"):
        UploadManifest.from_json(json.dumps(d))
    d1 = json.loads(_um("flat").to_json())
    d1 = {k: v for k, v in d1.items() if k not in ("run_id", "attempt", "created_at")}
    d1["schema_version"] = 1
    d1["manifest_key"] = "run1/step_0000000005/manifest.json"
    for s in d1["shards"]:
        s["key"] = remote_shard_key("run1", 5, None, s["rank"])
        del s["etag"]
    assert UploadManifest.from_json(json.dumps(d1)).key_layout == "flat"
    d1["key_layout"] = "flat"
    with pytest.raises(ManifestError, match="unknown keys"):
        UploadManifest.from_json(json.dumps(d1))
