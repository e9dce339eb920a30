"""Schema migration v1 -> v2: the named migration, v1 checkpoints (golden and made here)
still load and reshard with sha256 fallback, newer manifests are refused, both JSON Schemas are
shipped."""

from __future__ import annotations

import copy
import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jsonschema import Draft202012Validator

import tiered_ckpt as tc
from tiered_ckpt import GlobalSlice, ManifestError
from tiered_ckpt.errors import ReshardError
from tiered_ckpt.format import manifest as mf
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord, TensorRecord
from tiered_ckpt.local.reshard import even_split
from tiered_ckpt.local.verified_read import manifest_with_tensors

GOLDEN_V1 = Path(__file__).resolve().parents[1] / "golden" / "v1"
V2_KEYS = ("crc32c", "header_sha256", "crc32c_chunk_bytes")
V3_KEYS = ("run_id", "attempt")


def schema(version: int) -> Draft202012Validator:
    text = (
        resources.files("tiered_ckpt")
        .joinpath(f"schemas/manifest.v{version}.schema.json")
        .read_text()
    )
    s = json.loads(text)
    Draft202012Validator.check_schema(s)
    return Draft202012Validator(s)


def to_v1(d: dict[str, Any]) -> dict[str, Any]:
    """What the v1 code wrote for the same step."""
    d = copy.deepcopy(d)
    d["schema_version"] = 1
    for k in V3_KEYS:
        del d[k]
    for s in d["shards"]:
        for k in V2_KEYS:
            del s[k]
        for t in s["tensors"]:
            t.pop("crc32c", None)
    return d


def write_v1_step(root: Path, world: int = 4, n: int = 1001) -> np.ndarray:
    flat = np.arange(n, dtype=np.float32)
    states = [
        {"p": GlobalSlice(flat[o : o + c], (n,), (o,)), "lr": 0.5} for o, c in even_split(n, world)
    ]
    m = manifest_with_tensors(
        root / "step_0000000009", tc.save_sharded(states, root, 9)
    )  # v1 lists tensors
    (root / "step_0000000009" / "manifest.json").write_text(
        json.dumps(to_v1(m.to_dict()), indent=1)
    )
    return flat


def to_v2(d: dict[str, Any]) -> dict[str, Any]:
    """What the v2 code wrote for the same step (no lineage keys)."""
    d = copy.deepcopy(d)
    d["schema_version"] = 2
    for k in V3_KEYS:
        del d[k]
    return d


def test_migration_is_named_and_registered() -> None:
    assert mf.SCHEMA_VERSION == 3
    assert mf.MIGRATIONS[1] is mf.migrate_v1_to_v2
    assert mf.MIGRATIONS[2] is mf.migrate_v2_to_v3
    assert mf.migrate_v1_to_v2.__name__ == "migrate_v1_to_v2"
    assert mf.migrate_v2_to_v3.__name__ == "migrate_v2_to_v3"


def test_v2_manifest_upgrades_to_attempt_1_of_no_run(tmp_path: Path) -> None:
    m = manifest_with_tensors(
        tmp_path / "step_0000000005",
        tc.save_sharded([{"a": np.arange(3.0)}, {"a": np.arange(2.0)}], tmp_path, 5),
    )
    raw = to_v2(m.to_dict())
    assert not list(schema(2).iter_errors(raw))
    before = copy.deepcopy(raw)
    up = mf.migrate_v2_to_v3(raw)
    assert raw == before  # pure
    assert (up["schema_version"], up["run_id"], up["attempt"]) == (3, None, 1)
    assert not list(schema(3).iter_errors(up))
    (tmp_path / "step_0000000005" / "manifest.json").write_text(json.dumps(raw, indent=1))
    m2 = tc.read_manifest(tmp_path)
    assert (m2.schema_version, m2.run_id, m2.attempt, m2.save_id) == (3, None, 1, m.save_id)
    assert m2.shards == m.shards
    assert not list(schema(3).iter_errors(json.loads(m2.to_json())))


def test_v2_with_v3_fields_is_refused() -> None:
    m = ShardManifest(
        world_size=1,
        step=1,
        save_id="s",
        shards=(
            ShardRecord(rank=0, path="rank_00000.safetensors", sha256="ab" * 32, size_bytes=8),
        ),
    )
    for key, value in (("run_id", "r"), ("attempt", 2)):
        bad = to_v2(m.to_dict())
        bad[key] = value
        with pytest.raises(
            ManifestError, match=r"unknown keys \['%s'\] \(schema_version 2\)" % key
        ):
            mf.ShardManifest.from_dict(bad)


def test_v3_lineage_fields_are_validated() -> None:
    m = ShardManifest(
        world_size=1,
        step=1,
        save_id="s",
        run_id="run-1",
        attempt=4,
        shards=(
            ShardRecord(rank=0, path="rank_00000.safetensors", sha256="ab" * 32, size_bytes=8),
        ),
    )
    assert mf.ShardManifest.from_json(m.to_json()) == m
    for key, value in (
        ("run_id", "../x"),
        ("run_id", ""),
        ("attempt", 0),
        ("attempt", True),
        ("attempt", "2"),
    ):
        bad = m.to_dict()
        bad[key] = value
        with pytest.raises(ManifestError, match=key):
            mf.ShardManifest.from_dict(bad)
    bad = m.to_dict()
    del bad["attempt"]
    with pytest.raises(ManifestError, match="attempt"):
        mf.ShardManifest.from_dict(bad)


def test_v1_manifest_upgrades_with_null_checksums(tmp_path: Path) -> None:
    write_v1_step(tmp_path)
    raw = json.loads((tmp_path / "step_0000000009" / "manifest.json").read_text())
    assert raw["schema_version"] == 1
    assert not list(schema(1).iter_errors(raw))
    before = copy.deepcopy(raw)
    up = mf.migrate_v1_to_v2(raw)
    assert raw == before  # pure
    assert up["schema_version"] == 2 and not list(schema(2).iter_errors(up))
    m = tc.read_manifest(tmp_path)
    assert (m.schema_version, m.run_id, m.attempt) == (3, None, 1)
    assert all(
        s.crc32c is None and s.header_sha256 is None and s.crc32c_chunk_bytes is None
        for s in m.shards
    )
    assert all(t.crc32c is None for s in m.shards for t in s.tensors)
    # re-serialised, it is a valid v3 manifest
    assert not list(schema(3).iter_errors(json.loads(m.to_json())))


def test_v1_with_v2_fields_is_refused(tmp_path: Path) -> None:
    write_v1_step(tmp_path)
    raw = json.loads((tmp_path / "step_0000000009" / "manifest.json").read_text())
    bad = copy.deepcopy(raw)
    bad["shards"][0]["crc32c"] = "00000000"
    with pytest.raises(ManifestError, match="unknown keys"):
        mf.ShardManifest.from_dict(bad)
    bad = copy.deepcopy(raw)
    bad["shards"][1]["tensors"][0]["crc32c"] = []
    with pytest.raises(ManifestError, match="unknown keys"):
        mf.ShardManifest.from_dict(bad)


def test_newer_manifest_is_refused_clearly(tmp_path: Path) -> None:
    m = tc.save_sharded([{"a": np.zeros(2)}], tmp_path, 1)
    d = m.to_dict()
    d["schema_version"] = mf.SCHEMA_VERSION + 1
    (tmp_path / "step_0000000001" / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(
        ManifestError, match=r"schema_version 4 is newer .* understands \(3\); upgrade"
    ):
        tc.load_sharded(tmp_path, 1)


def test_v2_cross_field_rules() -> None:
    base = ShardRecord(
        rank=0,
        path="rank_00000.safetensors",
        sha256="ab" * 32,
        size_bytes=100,
        tensors=(TensorRecord("t", "U8", (5000,), (0, 5000)),),
    ).to_dict()
    base["size_bytes"] = 6000
    ok = dict(base, crc32c="0badf00d", header_sha256="cd" * 32, crc32c_chunk_bytes=4096)
    ok["tensors"] = [dict(base["tensors"][0], crc32c=["00000000", "11111111"])]
    ShardRecord.from_dict(ok)
    ShardRecord.from_dict(dict(ok, tensors=base["tensors"]))  # tensor checksums are optional
    for change, msg in [
        ({"crc32c": None}, "all set or all null"),
        ({"crc32c_chunk_bytes": 5000}, "power of two"),
        ({"crc32c_chunk_bytes": 1024}, "out of range"),
        ({"crc32c": "XYZ"}, "malformed"),
        ({"tensors": [dict(base["tensors"][0], crc32c=["00000000"])]}, "must list 2"),
        ({"crc32c": None, "header_sha256": None, "crc32c_chunk_bytes": None}, "is set but"),
    ]:
        with pytest.raises(ManifestError, match=msg):
            ShardRecord.from_dict(dict(ok, **change))


def test_v1_step_loads_fast_path_falls_back_and_reshards(tmp_path: Path) -> None:
    flat = write_v1_step(tmp_path / "v1")
    for verify in ("sha256", "crc32c"):  # crc32c falls back to sha256: v1 has no CRC
        out = tc.load_sharded(tmp_path / "v1", 4, verify=verify)
        assert np.concatenate([o["p"] for o in out]).tobytes() == flat.tobytes()
    from tiered_ckpt.local.scan import inspect_step

    assert inspect_step(tmp_path / "v1", 9, fast=True).ok
    # resharding a v1 step: whole shards verified against sha256, then the ranges read
    got = tc.load_sharded(tmp_path / "v1", 3, reshard=True, rules={"lr": "take_rank0"})
    assert np.concatenate([o["p"] for o in got]).tobytes() == flat.tobytes()
    res = tc.reshard(tmp_path / "v1", 9, 2, tmp_path / "v2", rules={"lr": "take_rank0"})
    assert res.manifest.schema_version == 3 and res.manifest.shards[0].crc32c is not None
    # a corrupted v1 shard is caught by that sha256 even where the needed range is intact
    p = tmp_path / "v1" / "step_0000000009" / "rank_00003.safetensors"
    b = bytearray(p.read_bytes())
    b[-1] ^= 1
    p.write_bytes(bytes(b))
    with pytest.raises(tc.ShardCorruptedError, match="sha256"):
        tc.load_shard(tmp_path / "v1", 1, 2, reshard=True, rules={"lr": "take_rank0"})


@pytest.mark.skipif(not GOLDEN_V1.is_dir(), reason="tests/golden/v1 not present")
def test_golden_v1_steps_load_verify_and_reshard(tmp_path: Path) -> None:
    from tiered_ckpt.local.scan import inspect_step

    names = sorted(
        p.name for p in GOLDEN_V1.iterdir() if p.is_dir() and not p.name.startswith("corrupt")
    )
    assert names
    for name in names:
        root = GOLDEN_V1 / name
        m = tc.read_manifest(root)
        assert (
            json.loads((root / f"step_{m.step:010d}" / "manifest.json").read_text())[
                "schema_version"
            ]
            == 1
        )
        for fast in (False, True):
            assert inspect_step(root, m.step, fast=fast).ok
        a = tc.load_sharded(root, m.world_size)
        b = tc.load_sharded(root, m.world_size, verify="crc32c")
        assert len(a) == len(b) == m.world_size
    zero2 = GOLDEN_V1 / "zero2"
    if (
        zero2.is_dir()
    ):  # the golden ZeRO checkpoint re-split for 3 ranks: partitions reassemble exactly
        m = tc.read_manifest(zero2)
        shutil.copytree(zero2, tmp_path / "z")
        try:
            out = tc.load_sharded(tmp_path / "z", 3, reshard=True)
        except ReshardError as e:  # per-rank values in the golden state: named, as documented
            assert "without a rule" in str(e)
        else:
            assert len(out) == 3
    assert (
        inspect_step(
            GOLDEN_V1 / "corrupt_zero2",
            tc.read_manifest(GOLDEN_V1 / "corrupt_zero2").step,
            fast=True,
        ).state
        == "corrupt"
    )


def test_both_schemas_shipped() -> None:
    v1, v2 = schema(1), schema(2)
    assert v1.schema["properties"]["schema_version"]["const"] == 1
    assert v2.schema["properties"]["schema_version"]["const"] == 2
    assert set(V2_KEYS) <= set(v2.schema["$defs"]["shard"]["required"])
