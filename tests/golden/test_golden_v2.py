"""Golden schema-v2 checkpoints (tests/golden/v2, made by tests/golden/make_golden_v2.py with the
code of commit b0b9ce5) load with the current code to exactly the recorded values, verify, and
reshard. The checksum fields v2 added are checked against an independent CRC32C (the ``crc32c``
package) and sha256 of the files. Every later schema version must keep these tests green. The frozen
remote prefix under v2/remote is checked here without a server (its bytes);
tests/s3/test_golden_remote_v2.py restores it."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import crc32c as crc32c_lib
import numpy as np
import pytest
from jsonschema import Draft202012Validator
from spawn import python_cmd

import tiered_ckpt as tc
from tiered_ckpt import ShardCorruptedError
from tiered_ckpt.format.manifest import SCHEMA_VERSION
from tiered_ckpt.local.scan import scan

GOLDEN = Path(__file__).resolve().parent
V2 = GOLDEN / "v2"
NAMES = ["zero2", "dtypes", "extras"]
#: The remote part of v2/ (tests/s3/test_golden_remote_v2.py); the rest is what make_golden_v2.py
#: writes.
REMOTE_PARTS = ("remote", "remote.expected.json")
#: zero2 holds per-rank JSON (rng): a reshard needs a rule for it.
RESHARD_RULES = {"rng": "take_rank0"}


def expected(name: str) -> dict[str, Any]:
    return json.loads((V2 / f"{name}.expected.json").read_text())


def golden_files(base: Path) -> list[Path]:
    """Files of a golden tree, minus the transient read locks concurrent loads create (.lock.*)."""
    return sorted(
        p.relative_to(base) for p in base.rglob("*") if p.is_file() and not p.name.startswith(".")
    )


def local_files(base: Path) -> list[Path]:
    return [p for p in golden_files(base) if p.parts[0] not in REMOTE_PARTS]


def step_dir(name: str) -> Path:
    return V2 / name / f"step_{expected(name)['step']:010d}"


def lookup(state: dict[str, Any], path: list[str]) -> Any:
    for k in path:
        state = state[k]
    return state


def leaf_paths(
    d: dict[str, Any], stop: set[tuple[str, ...]], path: tuple[str, ...] = ()
) -> list[tuple[str, ...]]:
    """Paths of the leaves of a nested state; a dict at a path in ``stop`` (a JSON value) is one
    leaf."""
    out: list[tuple[str, ...]] = []
    for k, v in d.items():
        p = path + (k,)
        out += leaf_paths(v, stop, p) if isinstance(v, dict) and p not in stop else [p]
    return out


def dumps(v: Any) -> str:
    return json.dumps(v, allow_nan=True, sort_keys=True)


def assert_rank_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    """``got`` holds exactly ``want``'s arrays (dtype, shape, sha256 of the bytes) and JSON
    values."""
    for a in want["arrays"]:
        arr = lookup(got, a["path"])
        assert isinstance(arr, np.ndarray), a["path"]
        assert arr.dtype.name == a["dtype"] and list(arr.shape) == a["shape"], a["path"]
        assert hashlib.sha256(arr.tobytes()).hexdigest() == a["sha256"], a["path"]
    for v in want["values"]:
        assert dumps(lookup(got, v["path"])) == dumps(v["value"]), v["path"]
    values = {tuple(v["path"]) for v in want["values"]}
    # nothing more, nothing less
    assert sorted(leaf_paths(got, values)) == sorted(
        {tuple(a["path"]) for a in want["arrays"]} | values
    )


def test_golden_v2_is_small_and_present() -> None:
    total = sum((V2 / p).stat().st_size for p in golden_files(V2))
    assert total < 300 * 1024
    for name in NAMES + ["corrupt_zero2", "remote"]:
        assert (V2 / name).is_dir()


@pytest.mark.parametrize("verify", ["sha256", "crc32c"])
@pytest.mark.parametrize("name", NAMES)
def test_golden_v2_loads_exactly(name: str, verify: str) -> None:
    exp = expected(name)
    root = V2 / name
    sdir = step_dir(name)
    # frozen bytes (if this fails, someone rewrote a golden file)
    assert sorted(p.name for p in sdir.iterdir() if not p.name.startswith(".")) == sorted(
        exp["files"]
    )
    for fname, sha in exp["files"].items():
        assert hashlib.sha256((sdir / fname).read_bytes()).hexdigest() == sha, fname
    assert tc.committed_steps(root) == [exp["step"]]
    assert (
        json.loads((sdir / "manifest.json").read_text())["schema_version"] == 2
    )  # frozen v2 files
    m = tc.read_manifest(root)
    assert (m.schema_version, m.step, m.world_size, m.save_id) == (
        SCHEMA_VERSION,
        exp["step"],
        exp["world_size"],
        exp["save_id"],
    )
    assert m.created_at == exp["created_at"] and m.wall_clock_seconds == exp["wall_clock_seconds"]
    assert dumps(m.extra) == dumps(exp["extra"])
    assert [(s.rank, s.host, s.save_id) for s in m.shards] == [
        (r, exp["host"], exp["save_id"]) for r in range(exp["world_size"])
    ]
    loaded = tc.load_sharded(root, exp["world_size"], verify=verify)
    assert len(loaded) == len(exp["ranks"])
    for r, want in enumerate(exp["ranks"]):
        assert_rank_state(loaded[r], want)
        alone = tc.load_shard(
            root, r, exp["world_size"], exp["step"], verify=verify
        )  # one rank by itself
        assert_rank_state(alone, want)


def _crc_hex(data: bytes) -> str:
    return f"{crc32c_lib.crc32c(data):08x}"


@pytest.mark.parametrize("name", NAMES)
def test_golden_v2_checksum_fields(name: str) -> None:
    """The v2 fields of each shard, recomputed independently from the file: whole-file CRC32C,
    sha256 of the length prefix plus JSON header, per-tensor CRC32C of each crc32c_chunk_bytes
    chunk; the tensor records agree with the safetensors header."""
    exp = expected(name)
    sdir = step_dir(name)
    obj = json.loads((sdir / "manifest.json").read_text())
    assert [
        {k: s[k] for k in ("rank", "crc32c", "header_sha256", "crc32c_chunk_bytes")}
        for s in obj["shards"]
    ] == exp["v2"]
    for s in obj["shards"]:
        data = (sdir / s["path"]).read_bytes()
        assert len(data) == s["size_bytes"] and hashlib.sha256(data).hexdigest() == s["sha256"]
        assert s["crc32c"] is not None and _crc_hex(data) == s["crc32c"]
        (hlen,) = struct.unpack("<Q", data[:8])
        assert hashlib.sha256(data[: 8 + hlen]).hexdigest() == s["header_sha256"]
        header = json.loads(data[8 : 8 + hlen])
        body = data[8 + hlen :]
        chunk = s["crc32c_chunk_bytes"]
        assert chunk >= 4096 and chunk & (chunk - 1) == 0
        assert len(s["tensors"]) == len([k for k in header if k != "__metadata__"])
        for t in s["tensors"]:
            h = header[t["name"]]
            assert (h["dtype"], h["shape"], h["data_offsets"]) == (
                t["dtype"],
                t["shape"],
                t["data_offsets"],
            )
            b, e = t["data_offsets"]
            want = [_crc_hex(body[i : min(i + chunk, e)]) for i in range(b, e, chunk)]
            assert t["crc32c"] == want, t["name"]


def test_golden_v2_zero2_layout() -> None:
    m = tc.read_manifest(V2 / "zero2")
    assert [(s.param_shard_offset, s.param_shard_numel) for s in m.shards] == [(0, 6), (6, 6)]
    for s in m.shards:
        t = {t.name: t for t in s.tensors}
        assert t["optim/exp_avg_sq"].global_shape == (12,)
        assert t["optim/exp_avg_sq"].global_offset == (s.param_shard_offset,)
        assert t["model/tp/w"].global_shape == (4, 6) and t["model/tp/w"].global_offset == (
            0,
            3 * s.rank,
        )
        assert t["model/tp/w"].dtype == "BF16"
    # Replicated arrays live in rank 0's shard only; rank 1 gets them at load time.
    names = [{t.name for t in s.tensors} for s in m.shards]
    assert {"model/embed", "model/head/w", "optim/step"} <= names[0]
    assert not {"model/embed", "model/head/w", "optim/step"} & names[1]


@pytest.mark.parametrize("verify", ["sha256", "crc32c"])
@pytest.mark.parametrize("new_world", [1, 3])
def test_golden_v2_zero2_reshards(new_world: int, verify: str) -> None:
    """Resharding reads byte ranges (verified with the per-tensor CRC32Cs in crc32c mode): the
    slices of the new ranks, joined along dim 0, are the global tensors; Replicated values reach
    every new rank."""
    exp = expected("zero2")
    states = tc.load_sharded(
        V2 / "zero2", new_world, reshard=True, rules=RESHARD_RULES, verify=verify
    )
    assert len(states) == new_world
    for g in exp["globals"]:
        parts = [lookup(st, g["path"]) for st in states]
        whole = np.concatenate(parts, axis=0) if new_world > 1 else parts[0]
        assert whole.dtype.name == g["dtype"] and list(whole.shape) == g["global_shape"], g["path"]
        assert hashlib.sha256(whole.tobytes()).hexdigest() == g["sha256"], g["path"]
    rank0 = exp["ranks"][0]
    sliced = {tuple(g["path"]) for g in exp["globals"]}
    for st in states:
        for a in rank0["arrays"]:
            if tuple(a["path"]) not in sliced:  # replicated arrays: identical on every new rank
                assert hashlib.sha256(lookup(st, a["path"]).tobytes()).hexdigest() == a["sha256"], (
                    a["path"]
                )
        for v in rank0["values"]:  # config (replicated) and rng (take_rank0)
            assert dumps(lookup(st, v["path"])) == dumps(v["value"])
    if new_world == 3:
        one = tc.load_shard(V2 / "zero2", 2, 3, reshard=True, rules=RESHARD_RULES, verify=verify)
        assert one["optim"]["exp_avg"].tobytes() == states[2]["optim"]["exp_avg"].tobytes()


@pytest.mark.parametrize("fast", [False, True])
def test_golden_v2_verify_passes(fast: bool) -> None:
    for name in NAMES:
        rows = scan(V2 / name, verify=True, fast=fast)
        assert [(r.step, r.state, r.world_size, r.save_id) for r in rows] == [
            (
                expected(name)["step"],
                "committed",
                expected(name)["world_size"],
                expected(name)["save_id"],
            )
        ], rows
    bad = scan(V2 / "corrupt_zero2", verify=True, fast=fast)
    assert [r.state for r in bad] == ["corrupt"] and "rank 1" in bad[0].reason


@pytest.mark.slow  # about 2 s (quick-tier budget)
def test_golden_v2_cli_verify() -> None:
    for name in NAMES:
        for extra in ([], ["--fast"]):
            proc = subprocess.run(
                python_cmd("-m", "tiered_ckpt.cli", "verify", V2 / name, *extra),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert proc.stdout.strip() == f"step {expected(name)['step']}: committed"
    proc = subprocess.run(
        python_cmd("-m", "tiered_ckpt.cli", "verify", V2 / "corrupt_zero2", "--fast"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stdout.startswith("step 100: corrupt"), (
        proc.stdout + proc.stderr
    )


@pytest.mark.parametrize("name", NAMES)
def test_golden_v2_manifest_validates_against_schema(name: str) -> None:
    from importlib import resources

    schema = json.loads(
        resources.files("tiered_ckpt").joinpath("schemas/manifest.v2.schema.json").read_text()
    )
    obj = json.loads((step_dir(name) / "manifest.json").read_text())
    errors = list(Draft202012Validator(schema).iter_errors(obj))
    assert not errors, errors[:3]


@pytest.mark.parametrize("verify", ["sha256", "crc32c"])
def test_golden_v2_corrupt_is_refused(verify: str) -> None:
    with pytest.raises(ShardCorruptedError, match="rank 1"):
        tc.load_sharded(V2 / "corrupt_zero2", 2, verify=verify)
    with pytest.raises(ShardCorruptedError):
        tc.load_sharded(V2 / "corrupt_zero2", 1, reshard=True, rules=RESHARD_RULES, verify=verify)
    assert_rank_state(
        tc.load_shard(V2 / "corrupt_zero2", 0, 2, verify=verify), expected("zero2")["ranks"][0]
    )


def test_golden_v2_remote_files_are_the_zero2_step() -> None:
    """The frozen remote prefix (no server here): every object hashes as recorded, the shards and
    the mirrored manifest are the local zero2 step's bytes, and the upload manifest and latest
    pointer name them."""
    rexp = json.loads((V2 / "remote.expected.json").read_text())
    base = V2 / "remote"
    assert sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file()) == sorted(
        rexp["objects"]
    )
    for rel, o in rexp["objects"].items():
        data = (base / rel).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (o["size_bytes"], o["sha256"]), rel
    sname = f"step_{rexp['step']:010d}"
    local = step_dir(rexp["local"])
    for fname in expected(rexp["local"])["files"]:
        assert (base / sname / fname).read_bytes() == (local / fname).read_bytes(), fname
    um_raw = (base / sname / "upload_manifest.json").read_bytes()
    um = json.loads(um_raw)
    assert (um["step"], um["world_size"], um["save_id"], um["prefix"]) == (
        rexp["step"],
        rexp["world_size"],
        rexp["save_id"],
        rexp["prefix"],
    )
    assert (
        um["manifest_sha256"] == hashlib.sha256((local / "manifest.json").read_bytes()).hexdigest()
    )
    latest = json.loads((base / "latest").read_text())
    assert latest == {
        "step": rexp["latest_step"],
        "upload_manifest_sha256": hashlib.sha256(um_raw).hexdigest(),
    }
    for s in um["shards"]:
        conf = json.loads((base / sname / ".confirm" / f"rank_{s['rank']:05d}.json").read_text())
        assert (conf["sha256"], conf["size_bytes"], conf["save_id"], conf["key"]) == (
            s["sha256"],
            s["size_bytes"],
            rexp["save_id"],
            s["key"],
        )


def test_make_golden_v2_is_deterministic(tmp_path: Path) -> None:
    """The generator's local part is deterministic (two runs, identical bytes, the committed file
    list). The committed v2 files themselves are frozen artefacts of schema v2: later code must load
    them, not reproduce them."""
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        proc = subprocess.run(
            python_cmd(GOLDEN / "make_golden_v2.py", out),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        outs.append(out)
    files = golden_files(outs[0])
    assert files == golden_files(outs[1]) and files == local_files(V2)
    for rel in files:
        assert (outs[0] / rel).read_bytes() == (outs[1] / rel).read_bytes(), rel


def test_golden_v2_loads_from_a_copy_elsewhere(tmp_path: Path) -> None:
    """Loading does not depend on the checkout's location (read-only copy, step directory as
    root)."""
    dst = tmp_path / "g"
    shutil.copytree(V2 / "zero2", dst)
    for p in dst.rglob("*"):
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        states = tc.load_sharded(dst / "step_0000000100", 2, verify="crc32c")
        for got, want in zip(states, expected("zero2")["ranks"]):
            assert_rank_state(got, want)
    finally:
        for p in dst.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
