"""Local tier round trip.

A 4-rank ZeRO-style checkpoint (fp16 params, fp32 master/exp_avg/exp_avg_sq flat partitions as 1-D
``GlobalSlice`` s) plus every supported dtype, 0-d, zero-size, non-contiguous and big-endian inputs,
nested dicts and JSON extras: byte-equal after load, readable by plain ``safetensors``. Then the
seed's failure modes, each with its own error, and the API edges (step selection, roots, re-saving,
mixed saves, unsupported state).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt import (
    CheckpointError,
    GlobalSlice,
    ManifestError,
    NoCheckpointError,
    ShardCorruptedError,
)
from tiered_ckpt.errors import (
    CheckpointExistsError,
    ConcurrentSaveError,
    MissingShardError,
    UnsupportedStateError,
    WorldSizeMismatchError,
)
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.verified_read import verified_header
from tiered_ckpt.local.writer import write_shard

WORLD = 4
PART = 5  # elements of the flat parameter vector per rank
FLAT = WORLD * PART

F8 = [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e8m0fnu]
NUMPY_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.uint16,
    np.int16,
    np.uint32,
    np.int32,
    np.uint64,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
]
ALL_DTYPES = NUMPY_DTYPES + [ml_dtypes.bfloat16] + F8


def rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Random bit patterns (NaN payloads, subnormals, negative zeros included); proper 0/1 for
    bool."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def rank_state(rank: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed * 100 + rank)
    sl = lambda a: GlobalSlice(a, (FLAT,), (rank * PART,))  # noqa: E731
    st: dict[str, Any] = {
        "model": {  # fp16 params, replicated as in ZeRO-1/2
            "layer0": {
                "weight": rand(rng, (4, 3), np.float16),
                "bias": rand(rng, (3,), np.float16),
            },
            "layer1": {"weight": rand(rng, (3, 2), np.float16)},
        },
        "optim": {
            "fp32_master": sl(rand(rng, (PART,), np.float32)),
            "exp_avg": sl(rand(rng, (PART,), np.float32)),
            "exp_avg_sq": sl(rand(rng, (PART,), np.float32)),
            "step": np.int64(1000 + rank),
        },
        "dtypes": {},
        "shapes": {
            "zero_d_f32": np.array(rng.standard_normal(), dtype=np.float32),
            "zero_d_bf16": np.array(1.5, dtype=ml_dtypes.bfloat16),
            "scalar_generic": np.float64(-0.0),
            "zero_size": np.zeros((0,), np.float32),
            "zero_size_2d": np.zeros((3, 0), np.float16),
            "zero_size_bf16": np.zeros((0, 7), ml_dtypes.bfloat16),
            "non_contig": rand(rng, (6, 8), np.float32)[::2, 1::3],
            "transposed": rand(rng, (5, 3), np.int32).T,
            "fortran": np.asfortranarray(rand(rng, (4, 5), np.float64)),
            "big_endian_f32": rand(rng, (7,), np.float32).astype(">f4"),
            "big_endian_i64": np.arange(5, dtype=">i8"),
            "big_endian_noncontig": np.arange(12, dtype=">u2")[::3],
            "big_endian_c64": (np.arange(3) + 1j).astype(">c8"),
            "high_dim": rand(rng, (1, 2, 1, 2, 1, 2), np.uint8),
        },
        "extra": {
            "nan": math.nan,
            "inf": math.inf,
            "ninf": -math.inf,
            "unicode": "naïve ☃ 日本語 \u0000 end",
            "key/with/slash": {"and%percent": 1, "%2F": "literal escape text"},
            "list": [1, 2.5, None, True, "x", [], {}],
            "big_int": 2**70,
            "neg": -3,
            "empty": {},
            "bool": False,
            "none": None,
        },
    }
    # every dtype, on ranks 0-2; rank 3 keeps numpy-only dtypes (for safetensors.numpy.load_file)
    dtypes = ALL_DTYPES if rank < 3 else NUMPY_DTYPES
    for dt in dtypes:
        st["dtypes"][np.dtype(dt).name] = rand(rng, (3, 2), dt)
    if rank < 3:
        # a 2-D slice (one global tensor per float8 type, so that slices agree on the dtype)
        st["dtypes"]["f8_slice"] = GlobalSlice(
            rand(rng, (2, 2), F8[0]), (4, 4), (2 * (rank // 2), 2 * (rank % 2))
        )
        st["shapes"]["zero_d_e8m0"] = np.array(rand(rng, (), ml_dtypes.float8_e8m0fnu))
    else:
        for k in ("zero_d_bf16", "zero_size_bf16"):
            del st["shapes"][k]
    return st


def expected_array(a: Any) -> np.ndarray:
    """What a load must return for input ``a``: little-endian, C order, same values and bytes."""
    if isinstance(a, GlobalSlice):
        a = a.array
    a = np.asarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.copy(order="C")  # (np.ascontiguousarray would turn 0-d into 1-d)


def assert_same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict), path
        # same keys; the order comes back sorted (the state tree is stored with sorted keys)
        assert sorted(got) == sorted(want), path
        for k in want:
            assert_same(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (np.ndarray, np.generic, GlobalSlice)):
        exp = expected_array(want)
        assert isinstance(got, np.ndarray), path
        assert got.dtype == exp.dtype and got.dtype.byteorder in "<=|", (path, got.dtype, exp.dtype)
        assert got.shape == exp.shape, (path, got.shape, exp.shape)
        assert got.tobytes() == exp.tobytes(), path
    else:
        assert json.dumps(got, allow_nan=True, sort_keys=True) == json.dumps(
            want, allow_nan=True, sort_keys=True
        ), path


def _escape(k: str) -> str:
    return k.replace("%", "%25").replace("/", "%2F")


def tensor_items(state: dict[str, Any], prefix: tuple[str, ...] = ()):
    for k, v in state.items():
        if isinstance(v, dict):
            yield from tensor_items(v, prefix + (k,))
        elif isinstance(v, (np.ndarray, np.generic, GlobalSlice)):
            yield "/".join(_escape(p) for p in prefix + (k,)), expected_array(v)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict[str, Any]], ShardManifest]:
    root = tmp_path_factory.mktemp("rt") / "run"
    states = [rank_state(r) for r in range(WORLD)]
    m = tc.save_sharded(
        states,
        root,
        42,
        extra={"epoch": 3, "loss": [1.0, math.nan, math.inf], "ünï": "c/o%de"},
        wall_clock_seconds=4521.0,
    )
    return root, states, m


def test_four_rank_roundtrip_byte_equal(saved) -> None:
    root, states, m = saved
    loaded = tc.load_sharded(root, WORLD)
    assert len(loaded) == WORLD
    for r in range(WORLD):
        assert_same(loaded[r], states[r], f"rank{r}")
        one = tc.load_shard(root, r, WORLD)
        assert_same(one, states[r], f"rank{r}")
    # loaded arrays are writable little-endian arrays
    a = loaded[0]["optim"]["fp32_master"]
    a[0] = 1.0


def test_manifest_records_zero_partitions(saved) -> None:
    root, _states, m = saved
    disk = tc.read_manifest(root)
    assert disk.to_json() == m.to_json()
    assert disk.world_size == WORLD and disk.step == 42 and disk.wall_clock_seconds == 4521.0
    assert math.isnan(disk.extra["loss"][1]) and disk.extra["loss"][2] == math.inf
    for r, rec in enumerate(disk.shards):
        assert rec.rank == r and rec.path == f"rank_{r:05d}.safetensors"
        assert (rec.param_shard_offset, rec.param_shard_numel) == (r * PART, PART)
        assert rec.save_id == disk.save_id
        by = {t.name: t for t in verified_header(root / "step_0000000042", disk, r).tensors}
        for name in ("optim/fp32_master", "optim/exp_avg", "optim/exp_avg_sq"):
            t = by[name]
            assert (t.dtype, t.shape, t.global_shape, t.global_offset) == (
                "F32",
                (PART,),
                (FLAT,),
                (r * PART,),
            )
        assert by["model/layer0/weight"].global_shape is None
        assert by["model/layer0/weight"].dtype == "F16"
        assert by["shapes/zero_size"].data_offsets[0] == by["shapes/zero_size"].data_offsets[1]
        assert by["shapes/zero_d_f32"].shape == ()
        if r < 3:
            assert by["dtypes/bfloat16"].dtype == "BF16"
            assert {by[f"dtypes/{np.dtype(d).name}"].dtype for d in F8} == {
                "F8_E4M3",
                "F8_E5M2",
                "F8_E8M0",
            }
            t = by["dtypes/f8_slice"]
            assert t.global_shape == (4, 4) and t.global_offset == (2 * (r // 2), 2 * (r % 2))
        assert os.path.getsize(root / "step_0000000042" / rec.path) == rec.size_bytes
    # ZeRO partitions tile the flat vector exactly
    spans = sorted((s.param_shard_offset, s.param_shard_numel) for s in disk.shards)
    assert sum(n for _, n in spans) == FLAT and spans[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))


def test_shards_open_with_plain_safetensors(saved) -> None:
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.numpy import load_file

    root, states, _m = saved
    sdir = root / "step_0000000042"
    for r in range(WORLD):
        want = dict(tensor_items(states[r]))
        path = str(sdir / f"rank_{r:05d}.safetensors")
        with safe_open(path, "pt") as f:
            assert set(f.keys()) == set(want)
            meta = f.metadata()
            assert json.loads(meta["tiered_ckpt"])["rank"] == r
            for name, exp in want.items():
                t = f.get_tensor(name)
                assert tuple(t.shape) == exp.shape, name
                assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == exp.tobytes(), name
                assert str(t.dtype).split(".")[1] == {"bool_": "bool", "bool": "bool"}.get(
                    exp.dtype.name, exp.dtype.name
                ), name
    # rank 3 holds numpy-native dtypes only: safetensors' own numpy loader reads the whole file
    got = load_file(str(sdir / "rank_00003.safetensors"))
    want = dict(tensor_items(states[3]))
    assert set(got) == set(want)
    for name, exp in want.items():
        assert got[name].dtype == exp.dtype and got[name].shape == exp.shape, name
        assert got[name].tobytes() == exp.tobytes(), name


# --- failure modes


def _copy_step(saved, tmp_path: Path) -> Path:
    root, _states, _m = saved
    dst = tmp_path / "run"
    shutil.copytree(root, dst)
    return dst


def test_world_size_mismatch(saved) -> None:
    root = saved[0]
    with pytest.raises(WorldSizeMismatchError, match="4 ranks.*8"):
        tc.load_sharded(root, 8)
    with pytest.raises(WorldSizeMismatchError):
        tc.load_shard(root, 0, 8)
    with pytest.raises(WorldSizeMismatchError):
        tc.load_sharded(root, 2)


def test_shard_deleted(saved, tmp_path) -> None:
    root = _copy_step(saved, tmp_path)
    os.unlink(root / "step_0000000042" / "rank_00002.safetensors")
    with pytest.raises(MissingShardError, match="rank 2"):
        tc.load_sharded(root, WORLD)
    with pytest.raises(MissingShardError):
        tc.load_shard(root, 2, WORLD)
    tc.load_shard(root, 1, WORLD)  # the other ranks still load
    assert isinstance(MissingShardError("x"), FileNotFoundError)


def test_shard_truncated_by_one_byte(saved, tmp_path) -> None:
    root = _copy_step(saved, tmp_path)
    p = root / "step_0000000042" / "rank_00001.safetensors"
    os.truncate(p, p.stat().st_size - 1)
    with pytest.raises(ShardCorruptedError, match="bytes on disk"):
        tc.load_sharded(root, WORLD)


@pytest.mark.parametrize("where", ["header_len", "header", "data", "last"])
def test_one_byte_flipped(saved, tmp_path, where) -> None:
    root = _copy_step(saved, tmp_path)
    p = root / "step_0000000042" / "rank_00003.safetensors"
    data = bytearray(p.read_bytes())
    hlen = int.from_bytes(data[:8], "little")
    pos = {"header_len": 0, "header": 8 + hlen // 2, "data": 8 + hlen + 3, "last": len(data) - 1}[
        where
    ]
    data[pos] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptedError, match="sha256"):
        tc.load_sharded(root, WORLD)
    with pytest.raises(ShardCorruptedError):
        tc.load_shard(root, 3, WORLD)


# --- API edges


def small(v: float) -> list[dict[str, Any]]:
    return [{"x": np.full(3, v + r, np.float32), "v": v} for r in range(2)]


def test_step_order_is_numeric_not_mtime(tmp_path) -> None:
    root = tmp_path / "run"
    for s in (10, 2, 100, 9):
        tc.save_sharded(small(s), root, s)
    # make the oldest-numbered step the most recently modified one
    now = 2_000_000_000
    os.utime(root / "step_0000000002", (now, now))
    os.utime(root / "step_0000000002" / "manifest.json", (now, now))
    os.utime(root / "step_0000000100", (1, 1))
    (root / "step_0000000500").mkdir()  # uncommitted leftover: ignored
    (root / "step_0000000600").mkdir()
    (root / "step_0000000600" / ".manifest.json.x.tmp").write_bytes(b"{}")
    (root / "not_a_step").mkdir()
    assert tc.committed_steps(root) == [2, 9, 10, 100]
    assert tc.latest_step(root) == 100
    assert tc.read_manifest(root).step == 100
    assert tc.load_sharded(root, 2)[0]["v"] == 100
    assert tc.load_sharded(root, 2, step=9)[1]["x"].tolist() == [10.0] * 3
    with pytest.raises(NoCheckpointError):
        tc.load_sharded(root, 2, step=500)
    with pytest.raises(NoCheckpointError):
        tc.load_sharded(root, 2, step=3)


def test_step_directory_as_root_and_relative_roots(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    tc.save_sharded(small(1), "rel/run", 1)
    tc.save_sharded(small(2), Path("rel/run"), 2)
    assert (tmp_path / "rel/run/step_0000000002/manifest.json").is_file()
    assert tc.committed_steps("rel/run") == [1, 2]
    sdir = "rel/run/step_0000000001"
    assert tc.load_sharded(sdir, 2)[0]["v"] == 1  # step directory path: that step, not the newest
    assert tc.load_shard(Path(sdir), 1, 2)["x"].tolist() == [2.0] * 3
    assert tc.read_manifest(sdir).step == 1
    assert tc.read_manifest(str(tmp_path / sdir)).step == 1
    monkeypatch.chdir(tmp_path / "rel/run")
    assert tc.load_sharded(".", 2)[0]["v"] == 2
    assert tc.load_sharded("step_0000000001", 2)[0]["v"] == 1
    with pytest.raises(ValueError):
        tc.load_sharded("step_0000000001", 2, step=2)


def test_no_checkpoint(tmp_path) -> None:
    for root in (tmp_path / "missing", tmp_path):
        assert tc.committed_steps(root) == []
        assert tc.latest_step(root) is None
        for call in (
            lambda: tc.load_sharded(root, 1),
            lambda: tc.load_shard(root, 0, 1),
            lambda: tc.read_manifest(root),
        ):
            with pytest.raises(NoCheckpointError) as ei:
                call()
            assert isinstance(ei.value, FileNotFoundError) and isinstance(ei.value, CheckpointError)
    (tmp_path / "step_0000000003").mkdir()  # uncommitted only
    with pytest.raises(FileNotFoundError):
        tc.load_sharded(tmp_path, 1)


def test_resave_committed_step_raises_exists(tmp_path) -> None:
    root = tmp_path / "run"
    tc.save_sharded(small(1), root, 5)
    with pytest.raises(CheckpointExistsError) as ei:
        tc.save_sharded(small(2), root, 5)
    assert isinstance(ei.value, FileExistsError)
    with pytest.raises(CheckpointExistsError):
        write_shard(root, 5, 0, small(2)[0])


def test_resave_committed_step_and_replace(tmp_path) -> None:
    root = tmp_path / "run"
    m1 = tc.save_sharded(small(1), root, 5)
    before = {p.name: p.read_bytes() for p in (root / "step_0000000005").iterdir()}
    # refused (today with the wrong type, see the xfail above) and nothing changes
    with pytest.raises(CheckpointError, match="already committed"):
        tc.save_sharded(small(2), root, 5)
    with pytest.raises(CheckpointError, match="already committed"):
        write_shard(root, 5, 0, small(2)[0])
    # commit_step itself raises the right type
    recs = tc.read_manifest(root).shards
    with pytest.raises(CheckpointExistsError):
        commit_step(root, 5, 2, recs)
    after = {
        p.name: p.read_bytes()
        for p in (root / "step_0000000005").iterdir()
        if not p.name.startswith(".")
    }
    assert after == before  # nothing changed
    assert tc.load_sharded(root, 2)[0]["v"] == 1
    m2 = tc.save_sharded(small(3) + small(3)[:1], root, 5, replace=True)
    assert m2.save_id != m1.save_id and m2.world_size == 3
    loaded = tc.load_sharded(root, 3)
    assert loaded[0]["v"] == 3 and loaded[2]["x"].tolist() == [3.0] * 3
    with pytest.raises(WorldSizeMismatchError):
        tc.load_sharded(root, 2)


def test_mixed_save_ids_refused(tmp_path) -> None:
    root = tmp_path / "run"
    st = small(1)
    r0 = write_shard(root, 7, 0, st[0], save_id="saveA")
    r1 = write_shard(root, 7, 1, st[1], save_id="saveB")  # same process: takes the step over
    assert (r0.save_id, r1.save_id) == ("saveA", "saveB")
    with pytest.raises(ConcurrentSaveError):
        commit_step(root, 7, 2, [r0, r1])
    with pytest.raises(ConcurrentSaveError):
        commit_step(root, 7, 2, [r0, r1], save_id="saveA")
    assert tc.committed_steps(root) == []
    # a consistent save of the step still commits, and loads
    r0b = write_shard(root, 7, 0, st[0], save_id="saveB")
    m = commit_step(root, 7, 2, [r0b, r1], extra={"k": 1})
    assert m.save_id == "saveB" and tc.load_sharded(root, 2)[1]["v"] == 1


def test_commit_with_missing_record_or_file(tmp_path) -> None:
    root = tmp_path / "run"
    st = small(1)
    r0 = write_shard(root, 8, 0, st[0], save_id="s8")
    with pytest.raises(MissingShardError):
        commit_step(root, 8, 2, [r0])
    r1 = write_shard(root, 8, 1, st[1], save_id="s8")
    os.unlink(root / "step_0000000008" / "rank_00001.safetensors")
    with pytest.raises(MissingShardError):
        commit_step(root, 8, 2, [r0, r1])
    assert tc.committed_steps(root) == []


class _Obj:
    pass


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({1: np.zeros(2)}, id="int-key"),
        pytest.param({"a": {2: 1}}, id="nested-int-key"),
        pytest.param({"a": np.array([_Obj()], dtype=object)}, id="object-array"),
        pytest.param({"a": np.array(["s"])}, id="unicode-array"),
        pytest.param({"a": np.zeros(2, np.complex128)}, id="complex128"),
        pytest.param({"a": np.zeros(2, np.longdouble)}, id="longdouble")
        if np.dtype(np.longdouble).itemsize > 8
        else pytest.param({"a": np.zeros(2, "V4")}, id="void"),
        pytest.param({"a": np.zeros(2, "datetime64[s]")}, id="datetime64"),
        pytest.param({"a": np.zeros(2, ml_dtypes.float8_e4m3fnuz)}, id="float8-e4m3fnuz"),
        pytest.param({"a": np.zeros(2, ml_dtypes.int4)}, id="int4"),
        pytest.param({"a": {1, 2}}, id="set"),
        pytest.param({"a": _Obj()}, id="object"),
        pytest.param({"a": b"bytes"}, id="bytes"),
    ],
)
def test_unsupported_state(tmp_path, bad) -> None:
    with pytest.raises(UnsupportedStateError) as ei:
        tc.save_sharded([bad], tmp_path / "run", 1)
    assert isinstance(ei.value, TypeError) and isinstance(ei.value, CheckpointError)
    with pytest.raises(UnsupportedStateError):
        write_shard(tmp_path / "run", 2, 0, bad)
    assert tc.committed_steps(tmp_path / "run") == []


def test_manifest_error_is_checkpoint_error(tmp_path) -> None:
    root = tmp_path / "run"
    tc.save_sharded(small(1), root, 1)
    (root / "step_0000000001" / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError):
        tc.load_sharded(root, 2)
