"""Golden schema-v1 checkpoints (tests/golden/v1, made by tests/golden/make_golden.py) load with the
current code to exactly the recorded values. Every later schema version must keep these tests
green."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from spawn import python_cmd

import tiered_ckpt as tc
from tiered_ckpt import ShardCorruptedError

GOLDEN = Path(__file__).resolve().parent
V1 = GOLDEN / "v1"
NAMES = ["zero2", "dtypes", "extras"]


def expected(name: str) -> dict[str, Any]:
    return json.loads((V1 / f"{name}.expected.json").read_text())


def golden_files(base: Path) -> list[Path]:
    """Files of a golden tree, minus the transient read locks concurrent loads create (.lock.*)."""
    return sorted(
        p.relative_to(base) for p in base.rglob("*") if p.is_file() and not p.name.startswith(".")
    )


def lookup(state: dict[str, Any], path: list[str]) -> Any:
    for k in path:
        state = state[k]
    return state


def test_golden_is_small_and_present() -> None:
    total = sum((V1 / p).stat().st_size for p in golden_files(V1))
    assert total < 200 * 1024
    for name in NAMES + ["corrupt_zero2"]:
        assert (V1 / name).is_dir()


@pytest.mark.parametrize("name", NAMES)
def test_golden_loads_exactly(name: str) -> None:
    exp = expected(name)
    root = V1 / name
    sdir = root / f"step_{exp['step']:010d}"
    # frozen bytes (if this fails, someone rewrote a golden file)
    for fname, sha in exp["files"].items():
        assert hashlib.sha256((sdir / fname).read_bytes()).hexdigest() == sha, fname
    assert tc.committed_steps(root) == [exp["step"]]
    on_disk = json.loads((sdir / "manifest.json").read_text())
    assert on_disk["schema_version"] == 1  # frozen v1 files; read through the named migration
    m = tc.read_manifest(root)
    assert (m.schema_version, m.step, m.world_size, m.save_id) == (
        tc.SCHEMA_VERSION,
        exp["step"],
        exp["world_size"],
        exp["save_id"],
    )
    assert m.created_at == exp["created_at"] and m.wall_clock_seconds == exp["wall_clock_seconds"]
    assert json.dumps(m.extra, allow_nan=True, sort_keys=True) == json.dumps(
        exp["extra"], allow_nan=True, sort_keys=True
    )
    loaded = tc.load_sharded(root, exp["world_size"])
    for r, want in enumerate(exp["ranks"]):
        got = loaded[r]
        n_arrays = 0
        for a in want["arrays"]:
            arr = lookup(got, a["path"])
            assert arr.dtype.name == a["dtype"] and list(arr.shape) == a["shape"], a["path"]
            assert hashlib.sha256(arr.tobytes()).hexdigest() == a["sha256"], a["path"]
            n_arrays += 1
        for v in want["values"]:
            assert json.dumps(lookup(got, v["path"]), allow_nan=True) == json.dumps(
                v["value"], allow_nan=True
            )

        # nothing more, nothing less
        def count(d: Any) -> int:
            return sum(count(v) if isinstance(v, dict) else 1 for v in d.values())

        assert count(got) == n_arrays + len(want["values"])
        assert tc.load_shard(root, r, exp["world_size"]).keys() == got.keys()


def test_golden_zero2_partitions() -> None:
    m = tc.read_manifest(V1 / "zero2")
    assert [(s.param_shard_offset, s.param_shard_numel) for s in m.shards] == [(0, 6), (6, 6)]
    for s in m.shards:
        t = {t.name: t for t in s.tensors}["optim/exp_avg_sq"]
        assert t.global_shape == (12,) and t.global_offset == (s.param_shard_offset,)


@pytest.mark.parametrize("name", NAMES)
def test_golden_manifest_validates_against_schema(name: str) -> None:
    from importlib import resources

    schema = json.loads(
        resources.files("tiered_ckpt").joinpath("schemas/manifest.v1.schema.json").read_text()
    )
    exp = expected(name)
    obj = json.loads((V1 / name / f"step_{exp['step']:010d}" / "manifest.json").read_text())
    errors = list(Draft202012Validator(schema).iter_errors(obj))
    assert not errors, errors[:3]


def test_golden_corrupt_is_refused() -> None:
    with pytest.raises(ShardCorruptedError, match="rank 1"):
        tc.load_sharded(V1 / "corrupt_zero2", 2)
    assert tc.load_shard(V1 / "corrupt_zero2", 0, 2)["rng"]["seed"] == 1234


def test_make_golden_is_deterministic(tmp_path: Path) -> None:
    """The generator is deterministic (two runs, identical bytes). The committed v1 files themselves
    are frozen artefacts of schema v1: later code must load them, not reproduce them."""
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        proc = subprocess.run(
            python_cmd(GOLDEN / "make_golden.py", out), capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        outs.append(out)
    files = golden_files(outs[0])
    assert files == golden_files(outs[1]) and files == golden_files(V1)
    for rel in files:
        assert (outs[0] / rel).read_bytes() == (outs[1] / rel).read_bytes(), rel


def test_golden_loads_from_a_copy_elsewhere(tmp_path: Path) -> None:
    """Loading does not depend on the checkout's location (read-only copy, relative step path)."""
    dst = tmp_path / "g"
    shutil.copytree(V1 / "extras", dst)
    for p in dst.rglob("*"):
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        st = tc.load_sharded(dst / "step_0000000003", 1)[0]
        assert st["json"]["unicode"] == "naïve ☃ 日本語" and st["json"]["a/b"]["c%d"][1] == 2.5
    finally:
        for p in dst.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
