"""Manifest schema v1: the dataclasses, their JSON, and the shipped JSON Schema agree.

- real manifests (written by the public API) validate against
  ``schemas/manifest.v{SCHEMA_VERSION}.schema.json`` (v1 manifests are covered by
  tests/test_migration.py and the golden checkpoints);
- every manifest the code accepts validates; mutations the code rejects also fail the schema
  wherever the schema can express the rule (``schema=True`` in the table below), and the cross-field
  rules the schema cannot express are listed with ``schema=False``.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from importlib import resources
from typing import Any

import numpy as np
import pytest
from jsonschema import Draft202012Validator

import tiered_ckpt as tc
from tiered_ckpt.errors import CheckpointError, ManifestError, MissingShardError
from tiered_ckpt.format import manifest as mf
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord, TensorRecord

SHA = "ab" * 32


def load_schema() -> dict[str, Any]:
    text = (
        resources.files("tiered_ckpt")
        .joinpath(f"schemas/manifest.v{mf.SCHEMA_VERSION}.schema.json")
        .read_text()
    )
    return json.loads(text)


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    schema = load_schema()
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def schema_ok(validator: Draft202012Validator, obj: Any) -> bool:
    return not list(validator.iter_errors(obj))


def base_dict() -> dict[str, Any]:
    """A valid 2-rank manifest with a ZeRO partition, a 2-D global slice and a plain tensor."""
    shards = []
    for r in range(2):
        tensors = (
            TensorRecord("opt/master", "F32", (3,), (0, 12), (6,), (3 * r,)),
            TensorRecord("w/emb", "BF16", (2, 2), (12, 20), (2, 4), (0, 2 * r)),
            TensorRecord("flag", "BOOL", (), (20, 21)),
        )
        shards.append(
            ShardRecord(
                rank=r,
                path=f"rank_{r:05d}.safetensors",
                sha256=SHA,
                size_bytes=200,
                param_shard_offset=3 * r,
                param_shard_numel=3,
                host="node-1.example",
                save_id="sid_1",
                tensors=tensors,
            )
        )
    m = ShardManifest(
        world_size=2,
        step=7,
        shards=tuple(shards),
        save_id="sid_1",
        wall_clock_seconds=12.5,
        created_at="2024-01-02T03:04:05.000000Z",
        extra={"lr": 0.1, "nan": math.nan},
    )
    return m.to_dict()


def test_schema_is_valid_2020_12_and_shipped() -> None:
    schema = load_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)
    # every field to_dict writes is documented, and additionalProperties is closed at every level
    d = base_dict()
    assert set(schema["properties"]) == set(d)
    # header_size_bytes is optional: written by saves since then, absent in base_dict()
    assert set(schema["$defs"]["shard"]["properties"]) == set(d["shards"][0]) | {
        "header_size_bytes"
    }
    # a tensor's crc32c (chunk checksums, v2) is optional: written when known, absent in base_dict()
    assert set(schema["$defs"]["tensor"]["properties"]) == set(d["shards"][0]["tensors"][0]) | {
        "crc32c"
    }
    for node in (schema, schema["$defs"]["shard"], schema["$defs"]["tensor"]):
        assert node["additionalProperties"] is False
    assert schema["properties"]["schema_version"]["const"] == mf.SCHEMA_VERSION
    assert sorted(schema["$defs"]["tensor"]["properties"]["dtype"]["enum"]) == sorted(
        mf.DTYPE_SIZES
    )


def test_base_manifest_roundtrips_and_validates(validator: Draft202012Validator) -> None:
    d = base_dict()
    assert schema_ok(validator, d)
    m = ShardManifest.from_dict(d)
    text = m.to_json()
    assert "NaN" in text
    m2 = ShardManifest.from_json(text)
    assert m2.to_json() == text
    assert json.loads(text, parse_constant=lambda c: c) == json.loads(
        m2.to_json(), parse_constant=lambda c: c
    )
    assert m2.shards[1].tensors[1].global_offset == (0, 2)
    assert m2.total_bytes == 400
    rec = m2.shards[0]
    assert ShardRecord.from_json(rec.to_json()) == rec


def test_real_manifests_validate(tmp_path, validator: Draft202012Validator) -> None:
    import ml_dtypes

    states = []
    for r in range(3):
        states.append(
            {
                "model": {
                    "w": np.full((2, 3), r, np.float16),
                    "b": np.zeros((0, 4), ml_dtypes.bfloat16),
                },
                "optim": {
                    "fp32": tc.GlobalSlice(np.arange(4, dtype=np.float32), (12,), (4 * r,)),
                    "exp_avg": tc.GlobalSlice(np.ones(4, np.float32), (12,), (4 * r,)),
                },
                "step": np.int64(5),
                "misc": {"a/b%c": [1, "x", None], "inf": math.inf},
            }
        )
    tc.save_sharded(
        states,
        tmp_path,
        11,
        extra={"loss": [1.0, math.nan], "ü": "ünïcode"},
        wall_clock_seconds=4521,
    )
    text = (tmp_path / "step_0000000011" / "manifest.json").read_text()
    obj = json.loads(text)
    assert schema_ok(validator, obj), list(validator.iter_errors(obj))[:3]
    assert obj["wall_clock_seconds"] == 4521
    assert [s["param_shard_offset"] for s in obj["shards"]] == [0, 4, 8]
    assert [s["param_shard_numel"] for s in obj["shards"]] == [4, 4, 4]
    # keys are sorted and the file parses back to the same manifest
    assert ShardManifest.from_json(text).to_json() == text
    assert tc.read_manifest(tmp_path).to_json() == text


def test_manifest_module_does_no_io() -> None:
    src = resources.files("tiered_ckpt").joinpath("format/manifest.py").read_text()
    for needle in (
        "import os",
        "open(",
        "import pathlib",
        "from pathlib",
        "import socket",
        "import threading",
    ):
        assert needle not in src, needle


def test_dataclass_construction_is_validated() -> None:
    with pytest.raises(ManifestError):
        ShardManifest(world_size=1, step=-1, shards=(), save_id="x")
    d = base_dict()
    with pytest.raises(MissingShardError):
        ShardManifest(
            world_size=3, step=7, shards=ShardManifest.from_dict(d).shards, save_id="sid_1"
        )


# --- code <-> schema agreement

Mut = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mut:
    def f(d: dict[str, Any]) -> None:
        keys = path.split(".")
        node: Any = d
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        last = keys[-1]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return f


def _del(path: str) -> Mut:
    def f(d: dict[str, Any]) -> None:
        keys = path.split(".")
        node: Any = d
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        del node[keys[-1]]

    return f


def _seq(*fs: Mut) -> Mut:
    def f(d: dict[str, Any]) -> None:
        for g in fs:
            g(d)

    return f


T0 = "shards.0.tensors.0"
# (id, mutation, expected error, whether the schema can express the rule)
REJECTED: list[tuple[str, Mut, type[CheckpointError], bool]] = [
    ("version-newer", _set("schema_version", mf.SCHEMA_VERSION + 1), ManifestError, True),
    ("version-zero", _set("schema_version", 0), ManifestError, True),
    ("version-string", _set("schema_version", "1"), ManifestError, True),
    ("version-bool", _set("schema_version", True), ManifestError, True),
    ("version-missing", _del("schema_version"), ManifestError, True),
    ("unknown-top-key", _set("extra_field", 1), ManifestError, True),
    ("world-size-zero", _set("world_size", 0), ManifestError, True),
    ("world-size-bool", _set("world_size", True), ManifestError, True),
    # JSON Schema counts 2.0 as an integer (draft 2020-12 s6.1.1); the code insists on JSON ints
    ("world-size-float", _set("world_size", 2.0), ManifestError, False),
    ("step-negative", _set("step", -1), ManifestError, True),
    ("step-huge", _set("step", 10**10), ManifestError, True),
    ("step-string", _set("step", "7"), ManifestError, True),
    ("save-id-empty", _set("save_id", ""), ManifestError, True),
    ("save-id-slash", _set("save_id", "a/b"), ManifestError, True),
    ("wall-clock-negative", _set("wall_clock_seconds", -1.0), ManifestError, True),
    ("wall-clock-string", _set("wall_clock_seconds", "1"), ManifestError, True),
    ("wall-clock-bool", _set("wall_clock_seconds", False), ManifestError, True),
    ("wall-clock-inf", _set("wall_clock_seconds", math.inf), ManifestError, False),
    ("wall-clock-nan", _set("wall_clock_seconds", math.nan), ManifestError, False),
    ("created-at-int", _set("created_at", 0), ManifestError, True),
    ("created-at-long", _set("created_at", "x" * 65), ManifestError, True),
    ("extra-list", _set("extra", [1]), ManifestError, True),
    ("shards-object", _set("shards", {}), ManifestError, True),
    ("shards-missing", _del("shards"), ManifestError, True),
    ("shard-not-object", _set("shards.1", 1), ManifestError, True),
    ("shard-unknown-key", _set("shards.0.owner", "x"), ManifestError, True),
    ("shard-rank-bool", _set("shards.0.rank", False), ManifestError, True),
    ("shard-rank-negative", _set("shards.0.rank", -1), ManifestError, True),
    ("shard-path-dotdot", _set("shards.0.path", "../rank_00000.safetensors"), ManifestError, True),
    ("shard-path-absolute", _set("shards.0.path", "/etc/passwd"), ManifestError, True),
    (
        "shard-path-other-rank",
        _set("shards.0.path", "rank_00001.safetensors"),
        ManifestError,
        False,
    ),
    ("shard-path-subdir", _set("shards.0.path", "x/rank_00000.safetensors"), ManifestError, True),
    ("sha-upper", _set("shards.0.sha256", SHA.upper()), ManifestError, True),
    ("sha-short", _set("shards.0.sha256", SHA[:-1]), ManifestError, True),
    ("sha-int", _set("shards.0.sha256", 5), ManifestError, True),
    ("size-string", _set("shards.0.size_bytes", "200"), ManifestError, True),
    ("size-tiny", _set("shards.0.size_bytes", 7), ManifestError, True),
    ("size-absurd", _set("shards.0.size_bytes", 2**60), ManifestError, True),
    ("size-too-small-for-data", _set("shards.0.size_bytes", 28), ManifestError, False),
    ("param-offset-negative", _set("shards.0.param_shard_offset", -3), ManifestError, True),
    ("param-numel-float", _set("shards.0.param_shard_numel", 3.0), ManifestError, False),
    ("param-numel-fraction", _set("shards.0.param_shard_numel", 3.5), ManifestError, True),
    ("param-overlap", _set("shards.1.param_shard_offset", 2), ManifestError, False),
    ("host-bad", _set("shards.0.host", "a b"), ManifestError, True),
    ("shard-save-id-bad", _set("shards.0.save_id", "a b"), ManifestError, True),
    ("shard-save-id-mixed", _set("shards.0.save_id", "other"), ManifestError, False),
    (
        "rank-duplicate",
        _seq(_set("shards.1.rank", 0), _set("shards.1.path", "rank_00000.safetensors")),
        MissingShardError,
        False,
    ),
    ("rank-missing", lambda d: d["shards"].pop(), MissingShardError, False),
    (
        "rank-beyond-world",
        _seq(
            _set("shards.1.rank", 2),
            _set("shards.1.path", "rank_00002.safetensors"),
            _set("world_size", 2),
        ),
        MissingShardError,
        False,
    ),
    (
        "extra-shard-beyond-world",
        lambda d: d["shards"].append(
            dict(
                copy.deepcopy(d["shards"][1]),
                rank=2,
                path="rank_00002.safetensors",
                param_shard_numel=0,
                tensors=[],
            )
        ),
        ManifestError,
        False,
    ),
    ("tensors-object", _set("shards.0.tensors", {}), ManifestError, True),
    ("tensor-unknown-key", _set(f"{T0}.x", 1), ManifestError, True),
    ("tensor-name-empty", _set(f"{T0}.name", ""), ManifestError, True),
    ("tensor-name-long", _set(f"{T0}.name", "n" * 4097), ManifestError, True),
    ("tensor-dtype-unknown", _set(f"{T0}.dtype", "F128"), ManifestError, True),
    ("tensor-dtype-lower", _set(f"{T0}.dtype", "f32"), ManifestError, True),
    ("tensor-shape-negative", _set(f"{T0}.shape", [-3]), ManifestError, True),
    ("tensor-shape-bool", _set(f"{T0}.shape", [True]), ManifestError, True),
    (
        "tensor-shape-absurd",
        _seq(
            _set(f"{T0}.shape", [2**20, 2**20, 2**20]),
            _set(f"{T0}.global_shape", [2**20, 2**20, 2**20]),
            _set(f"{T0}.global_offset", [0, 0, 0]),
        ),
        ManifestError,
        False,
    ),
    ("tensor-shape-too-many-dims", _set(f"{T0}.shape", [1] * 65), ManifestError, True),
    ("tensor-offsets-three", _set(f"{T0}.data_offsets", [0, 12, 12]), ManifestError, True),
    ("tensor-offsets-reversed", _set(f"{T0}.data_offsets", [12, 0]), ManifestError, False),
    ("tensor-offsets-span", _set(f"{T0}.data_offsets", [0, 16]), ManifestError, False),
    ("tensor-offsets-gap", _seq(_set(f"{T0}.data_offsets", [4, 16])), ManifestError, False),
    (
        "tensor-offsets-overlap",
        _set("shards.0.tensors.1.data_offsets", [8, 16]),
        ManifestError,
        False,
    ),
    ("tensor-name-duplicate", _set("shards.0.tensors.1.name", "opt/master"), ManifestError, False),
    ("global-shape-alone", _del(f"{T0}.global_offset"), ManifestError, True),
    ("global-offset-alone", _del(f"{T0}.global_shape"), ManifestError, True),
    ("global-rank-differs", _set(f"{T0}.global_offset", [0, 0]), ManifestError, False),
    ("global-slice-outside", _set(f"{T0}.global_offset", [4]), ManifestError, False),
    ("global-offset-negative", _set(f"{T0}.global_offset", [-1]), ManifestError, True),
    ("global-slices-overlap", _set("shards.1.tensors.0.global_offset", [1]), ManifestError, False),
    ("global-shape-disagree", _set("shards.1.tensors.0.global_shape", [7]), ManifestError, False),
    ("global-2d-overlap", _set("shards.1.tensors.1.global_offset", [0, 1]), ManifestError, False),
]


@pytest.mark.parametrize("case_id,mutate,exc,expressible", REJECTED, ids=[c[0] for c in REJECTED])
def test_code_rejects_and_schema_agrees(validator, case_id, mutate, exc, expressible) -> None:
    d = base_dict()
    mutate(d)
    with pytest.raises(exc) as ei:
        ShardManifest.from_dict(d)
    assert type(ei.value) is exc
    # also through the JSON text path
    with pytest.raises(exc):
        ShardManifest.from_json(json.dumps(d, allow_nan=True))
    if expressible:
        assert not schema_ok(validator, d), f"{case_id}: schema accepts what the code rejects"


ACCEPTED: list[tuple[str, Mut]] = [
    ("as-written", lambda d: None),
    ("extra-absent", _del("extra")),
    ("extra-null", _set("extra", None)),
    ("host-absent", _del("shards.0.host")),
    ("shard-save-id-absent", _del("shards.1.save_id")),
    ("shard-save-id-empty", _set("shards.1.save_id", "")),
    ("wall-clock-int", _set("wall_clock_seconds", 3)),
    (
        "no-tensors",
        lambda d: [
            s.update(tensors=[], param_shard_numel=0, param_shard_offset=0) for s in d["shards"]
        ],
    ),
    ("created-at-empty", _set("created_at", "")),
    (
        "zero-size-slices",
        _seq(
            _set(f"{T0}.shape", [0]),
            _set(f"{T0}.data_offsets", [0, 0]),
            _set("shards.0.tensors.1.data_offsets", [0, 8]),
            _set("shards.0.tensors.2.data_offsets", [8, 9]),
        ),
    ),
    ("shards-out-of-order", lambda d: d["shards"].reverse()),
]


@pytest.mark.parametrize("case_id,mutate", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_code_accepts_and_schema_agrees(validator, case_id, mutate) -> None:
    d = base_dict()
    mutate(d)
    m = ShardManifest.from_dict(d)
    assert [s.rank for s in m.shards] == [0, 1]
    assert schema_ok(validator, d), list(validator.iter_errors(d))[:3]
    # what the code writes back validates too
    assert schema_ok(validator, json.loads(m.to_json()))


def test_newer_version_error_names_the_version() -> None:
    d = base_dict()
    d["schema_version"] = 7
    with pytest.raises(ManifestError, match=r"schema_version 7 is newer"):
        ShardManifest.from_dict(d)


def test_duplicate_json_key_rejected() -> None:
    text = ShardManifest.from_dict(base_dict()).to_json()
    bad = text.replace('"step": 7,', '"step": 7, "step": 8,', 1)
    assert bad != text
    with pytest.raises(ManifestError, match="duplicate"):
        ShardManifest.from_json(bad)


@pytest.mark.parametrize(
    "text", [b"", b"{", b"\xff\xfe", b"[1]", b"null", b"1" * 10, b"[" * 100_000]
)
def test_bad_json_is_manifest_error(text: bytes) -> None:
    with pytest.raises(ManifestError):
        ShardManifest.from_json(text)


@pytest.mark.parametrize("field", ["shards.0.sha256", "save_id"])
def test_code_rejects_trailing_newline_in_patterns(field) -> None:
    d = base_dict()
    if field == "save_id":
        d["save_id"] += "\n"
        for s in d["shards"]:
            s["save_id"] = ""
    else:
        d["shards"][0]["sha256"] += "\n"
    with pytest.raises(ManifestError):
        ShardManifest.from_dict(d)
