"""The frozen round-1 remote prefix of schema v2 (tests/golden/v2/remote: the objects the uploader
of commit b0b9ce5 wrote for the zero2 step, see tests/golden/make_golden_v2.py) is put on the moto
server as it was written, under a fresh prefix and under the prefix it was written for, and must
restore with the current code into an empty root to exactly the recorded values. Every later version
must keep these tests green."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from s3_infra import S3Location, new_bucket

import tiered_ckpt as tc
from tiered_ckpt.remote.catalogue import list_remote_steps
from tiered_ckpt.remote.inspect.verify import scan_remote

V2 = Path(__file__).resolve().parent.parent / "golden" / "v2"
REMOTE = V2 / "remote"
RESHARD_RULES = {"rng": "take_rank0"}


def rexp() -> dict[str, Any]:
    return json.loads((V2 / "remote.expected.json").read_text())


def lookup(state: dict[str, Any], path: list[str]) -> Any:
    for k in path:
        state = state[k]
    return state


def dumps(v: Any) -> str:
    return json.dumps(v, allow_nan=True, sort_keys=True)


def assert_rank_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    for a in want["arrays"]:
        arr = lookup(got, a["path"])
        assert isinstance(arr, np.ndarray), a["path"]
        assert arr.dtype.name == a["dtype"] and list(arr.shape) == a["shape"], a["path"]
        assert hashlib.sha256(arr.tobytes()).hexdigest() == a["sha256"], a["path"]
    for v in want["values"]:
        assert dumps(lookup(got, v["path"])) == dumps(v["value"]), v["path"]
    top = {a["path"][0] for a in want["arrays"]} | {v["path"][0] for v in want["values"]}
    assert set(got) == top


def put_frozen(loc: S3Location) -> dict[str, bytes]:
    """Every frozen object, PUT as it was written under ``loc.prefix``; returns key -> bytes."""
    exp = rexp()
    out = {}
    for rel, o in sorted(exp["objects"].items()):
        body = (REMOTE / rel).read_bytes()
        assert (len(body), hashlib.sha256(body).hexdigest()) == (o["size_bytes"], o["sha256"]), rel
        key = f"{loc.prefix}/{rel}" if loc.prefix else rel
        loc.client.put_object(Bucket=loc.bucket, Key=key, Body=body)
        out[key] = body
    return out


def remote_objects(loc: S3Location) -> dict[str, bytes]:
    keys = []
    for page in loc.client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return {k: loc.client.get_object(Bucket=loc.bucket, Key=k)["Body"].read() for k in keys}


@pytest.fixture(params=["fresh_prefix", "original_prefix"])
def frozen(request: pytest.FixtureRequest, s3_bucket: S3Location, moto_server: str) -> S3Location:
    """The frozen prefix on the server: under the test's own fresh prefix (the upload manifest then
    names another prefix, as in a copied bucket), or in a fresh bucket under the prefix it was
    written for."""
    loc = (
        s3_bucket
        if request.param == "fresh_prefix"
        else new_bucket(moto_server, prefix=rexp()["prefix"])
    )
    put_frozen(loc)
    return loc


def test_frozen_remote_v2_lists_and_verifies(frozen: S3Location) -> None:
    exp = rexp()
    steps = list_remote_steps(frozen.url, s3_client=frozen.client)
    assert [(s.step, s.state) for s in steps] == [(exp["step"], "committed")]
    for fast in (False, True):
        rows = scan_remote(frozen.url, s3_client=frozen.client, fast=fast)
        assert [(r.step, r.state) for r in rows] == [(exp["step"], "committed")], rows


def test_frozen_remote_v2_restores_exactly(frozen: S3Location, tmp_path: Path) -> None:
    exp = rexp()
    before = remote_objects(frozen)
    root = tmp_path / "empty_root"
    m = tc.restore(frozen.url, root, s3_client=frozen.client)
    assert (m.step, m.world_size, m.save_id) == (exp["step"], exp["world_size"], exp["save_id"])
    assert m.created_at == exp["created_at"] and m.wall_clock_seconds == exp["wall_clock_seconds"]
    assert dumps(m.extra) == dumps(exp["extra"])
    assert tc.committed_steps(root) == [exp["step"]]
    sname = f"step_{exp['step']:010d}"
    for fname in ("manifest.json", "rank_00000.safetensors", "rank_00001.safetensors"):
        assert (root / sname / fname).read_bytes() == (REMOTE / sname / fname).read_bytes(), fname
    for verify in ("sha256", "crc32c"):
        states = tc.load_sharded(root, exp["world_size"], verify=verify)
        for got, want in zip(states, exp["ranks"], strict=True):
            assert_rank_state(got, want)
    whole = tc.load_sharded(root, 1, reshard=True, rules=RESHARD_RULES, verify="crc32c")[0]
    for g in exp["globals"]:
        arr = lookup(whole, g["path"])
        assert (
            list(arr.shape) == g["global_shape"]
            and hashlib.sha256(arr.tobytes()).hexdigest() == g["sha256"]
        )
    assert remote_objects(frozen) == before  # restore only reads


def test_frozen_remote_v2_restores_one_node(frozen: S3Location, tmp_path: Path) -> None:
    """A node-local root restoring only rank 0 (which owns the replicated values) gets its shard and
    the global manifest, and loads rank 0 exactly."""
    exp = rexp()
    node = tmp_path / "node0"
    m = tc.restore(frozen.url, node, step=exp["step"], ranks=[0], s3_client=frozen.client)
    assert m.step == exp["step"]
    sdir = node / f"step_{exp['step']:010d}"
    assert (sdir / "rank_00000.safetensors").is_file() and not (
        sdir / "rank_00001.safetensors"
    ).exists()
    assert_rank_state(tc.load_shard(node, 0, exp["world_size"], verify="crc32c"), exp["ranks"][0])
