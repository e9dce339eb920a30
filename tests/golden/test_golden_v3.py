"""Golden schema-v3 checkpoints whose manifest lists every tensor (tests/golden/v3, made by
tests/golden/make_golden_v3.py with the code of commit 6ed0115, before the tensor index moved
into the shard headers) load with the current code to exactly the recorded values, verify and
reshard; the per-tensor manifest records are cross-checked against the (format 1) shard headers."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jsonschema import Draft202012Validator
from spawn import python_cmd
from test_golden_v2 import RESHARD_RULES, _crc_hex, assert_rank_state, dumps, golden_files, lookup

import tiered_ckpt as tc
from tiered_ckpt import ShardCorruptedError
from tiered_ckpt.local.scan import scan

GOLDEN = Path(__file__).resolve().parent
V3 = GOLDEN / "v3"
NAMES = ["zero2", "dtypes", "extras"]


def expected(name: str) -> dict[str, Any]:
    return json.loads((V3 / f"{name}.expected.json").read_text())


def step_dir(name: str) -> Path:
    return V3 / name / f"step_{expected(name)['step']:010d}"


@pytest.mark.parametrize("verify", ["sha256", "crc32c"])
@pytest.mark.parametrize("name", NAMES)
def test_golden_v3_loads_exactly(name: str, verify: str) -> None:
    exp = expected(name)
    root, sdir = V3 / name, step_dir(name)
    assert sorted(p.name for p in sdir.iterdir() if not p.name.startswith(".")) == sorted(
        exp["files"]
    )
    for fname, sha in exp["files"].items():  # frozen bytes
        assert hashlib.sha256((sdir / fname).read_bytes()).hexdigest() == sha, fname
    raw = json.loads((sdir / "manifest.json").read_text())
    assert raw["schema_version"] == 3 and all(isinstance(s["tensors"], list) for s in raw["shards"])
    m = tc.read_manifest(root)
    assert (m.step, m.world_size, m.save_id, m.run_id, m.attempt) == (
        exp["step"],
        exp["world_size"],
        exp["save_id"],
        exp["run_id"],
        exp["attempt"],
    )
    assert dumps(m.extra) == dumps(exp["extra"]) and m.created_at == exp["created_at"]
    loaded = tc.load_sharded(root, exp["world_size"], verify=verify)
    for r, want in enumerate(exp["ranks"]):
        assert_rank_state(loaded[r], want)
        assert_rank_state(
            tc.load_shard(root, r, exp["world_size"], exp["step"], verify=verify), want
        )


@pytest.mark.parametrize("name", NAMES)
def test_golden_v3_checksum_fields(name: str) -> None:
    """Every checksum of the manifest recomputed independently from the files (crc32c package)."""
    sdir = step_dir(name)
    obj = json.loads((sdir / "manifest.json").read_text())
    assert [
        {k: s[k] for k in ("rank", "crc32c", "header_sha256", "crc32c_chunk_bytes")}
        for s in obj["shards"]
    ] == expected(name)["checksums"]
    for s in obj["shards"]:
        data = (sdir / s["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == s["sha256"] and _crc_hex(data) == s["crc32c"]
        (hlen,) = struct.unpack("<Q", data[:8])
        assert hashlib.sha256(data[: 8 + hlen]).hexdigest() == s["header_sha256"]
        header, body, chunk = (
            json.loads(data[8 : 8 + hlen]),
            data[8 + hlen :],
            s["crc32c_chunk_bytes"],
        )
        assert json.loads(header["__metadata__"]["tiered_ckpt"])["format"] == 1
        assert len(s["tensors"]) == len(header) - 1
        for t in s["tensors"]:
            h = header[t["name"]]
            assert (h["dtype"], h["shape"], h["data_offsets"]) == (
                t["dtype"],
                t["shape"],
                t["data_offsets"],
            )
            b, e = t["data_offsets"]
            assert t["crc32c"] == [
                _crc_hex(body[i : min(i + chunk, e)]) for i in range(b, e, chunk)
            ], t["name"]


@pytest.mark.parametrize("verify", ["sha256", "crc32c"])
@pytest.mark.parametrize("new_world", [1, 3])
def test_golden_v3_zero2_reshards(new_world: int, verify: str) -> None:
    exp = expected("zero2")
    states = tc.load_sharded(
        V3 / "zero2", new_world, reshard=True, rules=RESHARD_RULES, verify=verify
    )
    for g in exp["globals"]:
        parts = [lookup(st, g["path"]) for st in states]
        whole = np.concatenate(parts, axis=0)
        assert whole.dtype.name == g["dtype"] and list(whole.shape) == g["global_shape"], g["path"]
        assert hashlib.sha256(whole.tobytes()).hexdigest() == g["sha256"], g["path"]
    for st in states:
        for v in exp["ranks"][0]["values"]:
            assert dumps(lookup(st, v["path"])) == dumps(v["value"])


def test_golden_v3_reshard_rewrite(tmp_path: Path) -> None:
    """Rewriting the old-format step 2 -> 3 ranks writes today's format; it loads back to the
    globals."""
    res = tc.reshard(V3 / "zero2", None, 3, tmp_path / "out", rules=RESHARD_RULES)
    assert res.manifest.world_size == 3
    states = tc.load_sharded(tmp_path / "out", 3)
    for g in expected("zero2")["globals"]:
        whole = np.concatenate([lookup(st, g["path"]) for st in states], axis=0)
        assert hashlib.sha256(whole.tobytes()).hexdigest() == g["sha256"], g["path"]


@pytest.mark.parametrize("fast", [False, True])
def test_golden_v3_verify(fast: bool) -> None:
    for name in NAMES:
        exp = expected(name)
        rows = scan(V3 / name, verify=True, fast=fast)
        assert [(r.step, r.state, r.world_size, r.save_id) for r in rows] == [
            (exp["step"], "committed", exp["world_size"], exp["save_id"])
        ], rows
    bad = scan(V3 / "corrupt_zero2", verify=True, fast=fast)
    assert [r.state for r in bad] == ["corrupt"] and "rank 1" in bad[0].reason


@pytest.mark.parametrize("verify", ["sha256", "crc32c"])
def test_golden_v3_corrupt_is_refused(verify: str) -> None:
    with pytest.raises(ShardCorruptedError, match="rank 1"):
        tc.load_sharded(V3 / "corrupt_zero2", 2, verify=verify)
    with pytest.raises(ShardCorruptedError):
        tc.load_sharded(V3 / "corrupt_zero2", 1, reshard=True, rules=RESHARD_RULES, verify=verify)


@pytest.mark.parametrize("name", NAMES)
def test_golden_v3_manifest_validates_against_schema(name: str) -> None:
    from importlib import resources

    schema = json.loads(
        resources.files("tiered_ckpt").joinpath("schemas/manifest.v3.schema.json").read_text()
    )
    errors = list(
        Draft202012Validator(schema).iter_errors(
            json.loads((step_dir(name) / "manifest.json").read_text())
        )
    )
    assert not errors, errors[:3]


@pytest.mark.slow  # about 3 s (two runs of the generator)
def test_make_golden_v3_is_deterministic(tmp_path: Path) -> None:
    """The generator runs on today's code and is deterministic; the committed files are frozen
    artefacts."""
    outs = []
    for name in ("a", "b"):
        proc = subprocess.run(
            python_cmd(GOLDEN / "make_golden_v3.py", tmp_path / name),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        outs.append(tmp_path / name)
    files = golden_files(outs[0])
    assert files == golden_files(outs[1]) == golden_files(V3)
    for rel in files:
        assert (outs[0] / rel).read_bytes() == (outs[1] / rel).read_bytes(), rel
