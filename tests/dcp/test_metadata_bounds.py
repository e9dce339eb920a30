"""Hostile DCP metadata costs bounded work and memory: chunks that tile a tensor along two
dimensions at once (the layout that makes a sweep along either dimension keep every box open) are
checked in well under a second at any count the caps allow; a metadata file past a cap is refused
with :class:`DcpMetadataError` before anything proportional to its claims is allocated; and
``tiered-ckpt verify`` applies the load's checks and refuses a step whose metadata names data its
shards do not hold."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.cli import main
from tiered_ckpt.dcp import metadata_json
from tiered_ckpt.dcp.items import METADATA_TENSOR
from tiered_ckpt.errors import DcpMetadataError, UnsupportedStateError
from tiered_ckpt.format import dcp_metadata
from tiered_ckpt.local.catalogue import read_manifest
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.writer import write_shard

STEP = 3
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


#: A whole ``verify`` run: it also reads and hashes every file of the step (17 MB for the
#: million-chunk case), which a busy 2-core CI machine slows; the checks themselves stay under 1 s.
VERIFY_BOUND_S = 3.0


def crossed(n: int) -> tuple[list[int], list[list[int]]]:
    """A 2-D tensor of size ``(2k, 2k)`` tiled without overlap by ``n = 2k + 2`` chunks
    ``[offsets, sizes]``: ``k`` rows of length ``k`` in the top-left block, ``k`` columns of height
    ``k`` in the bottom-right one, and the two other blocks whole. Along either dimension a sweep
    meets ``k`` boxes open at once."""
    k = (n - 2) // 2
    assert 2 * k + 2 == n
    chunks = [[i, 0, 1, k] for i in range(k)]
    chunks += [[k, k + j, k, 1] for j in range(k)]
    chunks += [[0, k, k, k], [k, 0, k, k]]
    return [2 * k, 2 * k], chunks


def metadata(
    tensors: dict[str, tuple[list[int], list[list[int]]]], dtype: str = "uint8", rank: int = 0
) -> bytes:
    """Format-1 metadata JSON of ``{fqn: (size, [offsets + sizes per chunk])}``, every chunk on
    ``rank``."""
    sdm = {
        fqn: {
            "kind": "tensor",
            "dtype": dtype,
            "size": size,
            "requires_grad": False,
            "pin_memory": False,
            "memory_format": "contiguous_format",
            "chunks": [x for c in chunks for x in [rank, *c]],
        }
        for fqn, (size, chunks) in tensors.items()
    }
    obj = {
        "format": 1,
        "version": "1.0.0",
        "state_dict_metadata": sdm,
        "planner_data": {fqn: [fqn] for fqn in tensors},
        "storage_meta": None,
    }
    return json.dumps(obj, separators=(",", ":")).encode()


def timed(f: Any, *a: Any) -> tuple[float, Any]:
    """``(seconds, result or the exception raised)`` of ``f(*a)``."""
    t = time.perf_counter()
    try:
        out: Any = f(*a)
    except Exception as e:  # noqa: BLE001 - returned for the asserts
        out = e
    return time.perf_counter() - t, out


# --- the tiling check


@pytest.mark.parametrize("n", [1_500, 6_000, 50_000])
def test_crossed_tiling_is_checked_in_under_a_second(n: int) -> None:
    size, chunks = crossed(n)
    raw = metadata({"w": (size, chunks)})
    secs, md = timed(metadata_json.decode, raw, 1)
    assert not isinstance(md, Exception), md
    assert len(md.state_dict_metadata["w"].chunks) == n and secs < 1.0, secs
    # one row moved right by one: it overlaps the top-right block and leaves a gap; same volume
    chunks[0] = [0, 1, 1, size[0] // 2]
    secs, err = timed(metadata_json.decode, metadata({"w": (size, chunks)}), 1)
    assert isinstance(err, DcpMetadataError) and "tile" in str(err) and secs < 1.0, (secs, err)


def _check(size: list[int], chunks: list[list[int]]) -> None:
    metadata_json.decode(metadata({"w": (size, chunks)}), 1)


@pytest.mark.parametrize(
    "size,chunks",
    [
        ([4], [[0, 2], [2, 2]]),
        ([4, 6], [[0, 0, 2, 3], [0, 3, 2, 3], [2, 0, 2, 3], [2, 3, 2, 3]]),  # a 2x2 grid
        ([4, 6], [[0, 0, 2, 6], [2, 0, 2, 2], [2, 2, 2, 4]]),  # not a grid
        ([2, 2, 2], [[i, j, k, 1, 1, 1] for i in range(2) for j in range(2) for k in range(2)]),
        ([3, 4], [[0, 0, 3, 4], [1, 1, 0, 2]]),  # an empty chunk beside the whole tensor
        ([0, 5], []),
    ],
)
def test_exact_tilings_are_accepted(size: list[int], chunks: list[list[int]]) -> None:
    _check(size, chunks)


@pytest.mark.parametrize(
    "size,chunks",
    [
        ([4], [[0, 2], [1, 2]]),  # overlap (and a gap at 3)
        ([4], [[0, 2], [3, 1]]),  # gap
        ([4, 6], [[0, 0, 2, 3], [0, 3, 2, 3], [2, 0, 2, 3]]),  # a grid cell missing
        ([4, 6], [[0, 0, 2, 3], [0, 3, 2, 3], [2, 0, 2, 3], [2, 3, 2, 3], [1, 1, 1, 1]]),
        ([4, 6], [[0, 0, 3, 3], [0, 3, 2, 3], [2, 0, 2, 3], [3, 3, 1, 3]]),  # overlap + gap
        ([2, 2, 2], [[i, j, 0, 1, 1, 2] for i in range(2) for j in range(2)][:3]),
        ([2, 2, 2], [[0, 0, 0, 2, 2, 1], [0, 0, 1, 2, 1, 1], [0, 0, 1, 2, 1, 1]]),
    ],
)
def test_gaps_and_overlaps_are_refused(size: list[int], chunks: list[list[int]]) -> None:
    with pytest.raises(DcpMetadataError):
        _check(size, chunks)


def test_the_checks_and_the_backend_agree_on_names() -> None:
    """The torch-free tables of :mod:`tiered_ckpt.format.dcp_metadata` are the DCP backend's."""
    from tiered_ckpt.dcp import storage_writer
    from tiered_ckpt.dcp.items import DTYPE_BY_NAME, STORABLE_DTYPES

    assert {n: STORABLE_DTYPES[dt] for n, dt in DTYPE_BY_NAME.items()} == {
        n: c for n, c in dcp_metadata.DTYPE_CODES.items() if n in DTYPE_BY_NAME
    }
    assert set(dcp_metadata.DTYPE_CODES) - set(DTYPE_BY_NAME) <= {"float8_e8m0fnu"}
    assert (storage_writer.EXTRA_KEY, storage_writer.EXTRA_FORMAT) == (
        dcp_metadata.EXTRA_KEY,
        dcp_metadata.EXTRA_FORMAT,
    )


def _guillotine(rng: np.random.Generator, off: list[int], size: list[int], depth: int) -> list[Any]:
    """A random exact tiling of the box ``off + [0, size)`` by recursive cuts (not a grid)."""
    d = int(rng.integers(len(size)))
    if depth == 0 or size[d] < 2:
        return [[*off, *size]]
    cut = int(rng.integers(1, size[d]))
    a_size, b_off, b_size = list(size), list(off), list(size)
    a_size[d], b_off[d], b_size[d] = cut, off[d] + cut, size[d] - cut
    return _guillotine(rng, off, a_size, depth - 1) + _guillotine(rng, b_off, b_size, depth - 1)


def _tiles(size: list[int], chunks: list[list[int]]) -> bool:
    """Brute force: every element covered exactly once."""
    nd = len(size)
    count = np.zeros(size, np.int64)
    for c in chunks:
        count[tuple(slice(o, o + n) for o, n in zip(c[:nd], c[nd:]))] += 1
    return bool((count == 1).all())


@pytest.mark.parametrize("seed", range(40))
def test_tiling_check_agrees_with_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = [int(x) for x in rng.integers(1, 7, size=int(rng.integers(1, 4)))]
    chunks = _guillotine(rng, [0] * len(size), size, 6)
    _check(size, chunks)
    nd = len(size)
    for _ in range(5):  # one chunk moved or resized by one, kept inside the tensor
        bad = [list(c) for c in chunks]
        c, d = bad[int(rng.integers(len(bad)))], int(rng.integers(nd))
        if rng.integers(2):
            c[d] = min(max(c[d] + int(rng.choice([-1, 1])), 0), size[d] - c[nd + d])
        else:
            c[nd + d] = min(max(c[nd + d] + int(rng.choice([-1, 1])), 1), size[d] - c[d])
        if len({tuple(x[:nd]) for x in bad}) < len(bad):
            continue  # two chunks at the same offsets: refused for that alone
        try:
            _check(size, bad)
            ok = True
        except DcpMetadataError:
            ok = False
        assert ok == _tiles(size, bad), (size, bad)


@pytest.mark.parametrize(
    "edit,ok",
    [
        (
            lambda t: t.replace('"planner_data":{', '"planner_data":{"k[' + "1," * 40 + '1]":[1],'),
            True,
        ),
        (lambda t: t.replace('"version":"1.0.0"', '"version":"' + "[1," * 30 + '"'), True),
        (lambda t: t.replace('"version":"1.0.0"', '"version":"\\u0000"'), False),
        (lambda t: t.replace('"chunks":[', '"chunks":[ \n'), True),
        (lambda t: t.replace('"chunks":[0', '"chunks":[00'), False),
        (lambda t: t.replace('"chunks":[0', '"chunks":[-0'), True),
        (lambda t: t.replace('"chunks":[0', '"chunks":[0,'), False),
        (lambda t: t.replace('"chunks":[0', '"chunks":[' + "9" * 19), False),
        (lambda t: t.replace('"chunks":[0', '"chunks":[0.0'), False),
        (lambda t: t.replace('"size":[', '"size":"\u0000'), False),
        (lambda t: t.replace('"size":[', '"size":[' + "1," * 70), False),
    ],
)
def test_integer_arrays_outside_strings_only_are_cut_out(edit: Any, ok: bool) -> None:
    size, chunks = crossed(40)
    before = metadata({"w": (size, chunks)}).decode()
    text = edit(before)
    assert text != before
    if ok:
        metadata_json.decode(text.encode(), 1)
    else:
        with pytest.raises(DcpMetadataError):
            metadata_json.decode(text.encode(), 1)


# --- caps


def _one_tensor_of(n: int) -> bytes:
    """Metadata of a 1-D tensor of ``n`` elements in ``n`` chunks of one element (12 bytes of JSON
    per chunk)."""
    head = metadata({"v": ([n], [])}).decode()
    cells = ",".join(f"0,{i},1" for i in range(n))
    return head.replace('"chunks":[]', f'"chunks":[{cells}]').encode()


def test_million_chunk_tensor_is_refused_before_allocating() -> None:
    raw = _one_tensor_of(1_500_000)
    assert len(raw) > 10_000_000
    tracemalloc.start()
    try:
        secs, err = timed(metadata_json.decode, raw, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(err, DcpMetadataError) and "chunks" in str(err), err
    assert peak < 3 * len(raw), (peak, len(raw))
    assert secs < 1.0, secs


def test_chunks_in_all_past_the_cap_are_refused_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tensors each under the per-tensor cap, together over the total one: refused on counts."""
    monkeypatch.setattr(dcp_metadata, "MAX_CHUNKS", 100_000)
    one = _one_tensor_of(40_000).decode()
    sdm = one[one.index('"v":{') : one.index("}}") + 1]
    many = {f'"v{i}":{sdm[4:]}' for i in range(3)}
    raw = one.replace(sdm, ",".join(sorted(many))).replace(
        '"planner_data":{"v":["v"]}', '"planner_data":null'
    )
    raw_b = raw.encode()
    tracemalloc.start()
    try:
        secs, err = timed(metadata_json.decode, raw_b, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(err, DcpMetadataError) and "in all" in str(err), err
    assert peak < len(raw_b) // 2, (peak, len(raw_b))


def test_a_long_empty_array_is_empty() -> None:
    """An array of whitespace only, long enough to be parsed apart, holds no number."""
    spaces = '"chunks":[' + " " * 100 + "]"
    raw = metadata({"e": ([0, 5], [])}).replace(b'"chunks":[]', spaces.encode())
    assert metadata_json.decode(raw, 1).state_dict_metadata["e"].chunks == []
    with pytest.raises(DcpMetadataError, match="tile"):
        metadata_json.decode(raw.replace(b"[0,5]", b"[1,5]"), 1)


def test_many_small_json_values_are_refused_before_decoding() -> None:
    """Values outside the chunk arrays (here a planner path of 5M items, 20 MB) are counted before
    ``json.loads`` builds them."""
    raw = metadata({"w": ([4], [[0, 4]])}).replace(
        b'"planner_data":{"w":["w"]}', b'"planner_data":{"w":[' + b'"a",' * 5_000_000 + b'"w"]}'
    )
    tracemalloc.start()
    try:
        secs, err = timed(metadata_json.decode, raw, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(err, DcpMetadataError) and "JSON values" in str(err), err
    assert peak < 3 * len(raw) and secs < 1.0, (peak, secs)


def test_total_chunk_and_entry_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    many = {f"t{i}": ([4], [[0, 2], [2, 2]]) for i in range(50)}
    metadata_json.decode(metadata(many), 1)
    monkeypatch.setattr(dcp_metadata, "MAX_CHUNKS", 99)
    with pytest.raises(DcpMetadataError, match="chunks"):
        metadata_json.decode(metadata(many), 1)
    monkeypatch.setattr(dcp_metadata, "MAX_ENTRIES", 49)
    with pytest.raises(DcpMetadataError, match="entries"):
        metadata_json.decode(metadata(many), 1)


def test_save_past_a_cap_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a load would refuse is not saved: the caps are checked when the metadata is encoded."""
    monkeypatch.setattr(dcp_metadata, "MAX_ENTRIES", 2)
    with pytest.raises(UnsupportedStateError, match="cap"):
        tdcp.save({"a": torch.ones(2), "b": torch.ones(2), "c": torch.ones(2)}, tmp_path, STEP)
    assert list(tmp_path.iterdir()) == []


def test_oversized_metadata_is_refused_unread() -> None:
    with pytest.raises(DcpMetadataError, match="cap"):
        metadata_json.decode(b" " * (dcp_metadata.MAX_METADATA_BYTES + 1), 1)


# --- committed steps: load's read_metadata and verify


def forge(root: Path, raw: bytes, arrays: dict[str, np.ndarray], world_size: int = 1) -> None:
    """Commit step :data:`STEP` of ``root``: rank 0's shard holds ``arrays`` and the metadata
    ``raw``; ranks above 0 hold one small tensor each."""
    recs = [
        write_shard(root, STEP, 0, {**arrays, METADATA_TENSOR: np.frombuffer(raw, np.uint8)}),
        *(write_shard(root, STEP, r, {"pad": np.zeros(1, np.uint8)}) for r in range(1, world_size)),
    ]
    extra = {
        "dcp": {
            "format": 1,
            "metadata_rank": 0,
            "metadata_tensor": METADATA_TENSOR,
            "metadata_bytes": len(raw),
        }
    }
    commit_step(root, STEP, world_size, recs, extra)


def chunk_arrays(fqn: str, chunks: list[list[int]]) -> dict[str, np.ndarray]:
    """The shard tensors the DCP writer stores for ``chunks`` (uint8)."""
    nd = len(chunks[0]) // 2
    return {
        f"{fqn}@{','.join(map(str, c[:nd]))}": np.zeros(c[nd:], np.uint8)
        for c in chunks
        if all(c[nd:])
    }


def verify(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, float]:
    capsys.readouterr()
    t = time.perf_counter()
    code = main(["verify", str(root)])
    return code, capsys.readouterr().out, time.perf_counter() - t


def test_real_dcp_step_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tdcp.save({"w": torch.arange(6.0).reshape(2, 3), "n": 5, "b": b"xy"}, tmp_path, STEP)
    code, out, _ = verify(tmp_path, capsys)
    assert code == 0 and out.strip() == f"step {STEP}: committed", out


def test_crossed_tiling_step_loads_and_verifies_fast(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    size, chunks = crossed(1_500)
    forge(tmp_path, metadata({"w": (size, chunks)}), chunk_arrays("w", chunks))
    reader = tdcp.TieredStorageReader(tmp_path, STEP)
    secs, md = timed(reader.read_metadata)
    assert not isinstance(md, Exception) and secs < 1.0, (secs, md)
    code, out, secs = verify(tmp_path, capsys)
    assert code == 0 and "committed" in out and secs < VERIFY_BOUND_S, (code, out, secs)


@pytest.mark.parametrize("n", [50_000])
def test_step_whose_shards_lack_the_chunks_is_refused_fast(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], n: int
) -> None:
    size, chunks = crossed(n)
    forge(tmp_path, metadata({"w": (size, chunks)}), {})
    secs, md = timed(tdcp.TieredStorageReader(tmp_path, STEP).read_metadata)
    assert not isinstance(md, Exception) and secs < 1.0, (secs, md)  # the shards are not read yet
    code, out, secs = verify(tmp_path, capsys)
    assert code == 1 and f"step {STEP}: corrupt" in out and "w@" in out and secs < VERIFY_BOUND_S, (
        out,
        secs,
    )


def test_million_chunk_step_is_refused_by_load_and_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    forge(tmp_path, _one_tensor_of(1_500_000), {})
    secs, err = timed(tdcp.TieredStorageReader(tmp_path, STEP).read_metadata)
    assert isinstance(err, DcpMetadataError) and secs < 1.0, (secs, err)
    code, out, secs = verify(tmp_path, capsys)
    assert (
        code == 1 and f"step {STEP}: corrupt" in out and "chunks" in out and secs < VERIFY_BOUND_S
    ), out


W = ([4, 6], [[0, 0, 2, 6], [2, 0, 2, 6]])  # two row blocks
HOSTILE_STEPS: dict[str, tuple[bytes, dict[str, np.ndarray], int, str]] = {
    "overlap": (
        metadata({"w": ([4, 6], [[0, 0, 3, 6], [2, 0, 2, 6]])}),
        {"w@0,0": np.zeros((3, 6), np.uint8), "w@2,0": np.zeros((2, 6), np.uint8)},
        1,
        "tile",
    ),
    "chunk-missing-in-shard": (
        metadata({"w": W}),
        {"w@0,0": np.zeros((2, 6), np.uint8)},
        1,
        "w@2,0",
    ),
    "chunk-larger-than-stored": (
        metadata({"w": W}),
        {"w@0,0": np.zeros((2, 6), np.uint8), "w@2,0": np.zeros((1, 6), np.uint8)},
        1,
        "w@2,0",
    ),
    "chunk-of-other-dtype": (
        metadata({"w": W}),
        {"w@0,0": np.zeros((2, 6), np.uint8), "w@2,0": np.zeros((2, 6), np.float32)},
        1,
        "w@2,0",
    ),
    "chunk-on-rank-outside-world": (metadata({"w": W}, rank=2), {}, 2, "rank"),
    "chunk-on-a-rank-holding-nothing": (metadata({"w": W}, rank=1), {}, 2, "w@0,0"),
}


@pytest.mark.parametrize("name", list(HOSTILE_STEPS))
def test_verify_refuses_metadata_its_shards_do_not_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    raw, arrays, world, words = HOSTILE_STEPS[name]
    forge(tmp_path, raw, arrays, world)
    assert read_manifest(tmp_path).world_size == world
    code, out, _ = verify(tmp_path, capsys)
    assert code == 1 and out.startswith(f"step {STEP}: corrupt") and words in out, out


def test_two_rank_dcp_step_verifies_whole_and_per_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A DCP save of two ranks (driven by hand in one process) verifies, and so do its ranks one
    at a time (a node-local check: items of the other rank, or the metadata, not looked at)."""
    from test_dcp_hostile import _save_world

    _save_world(tmp_path, [{"w": torch.arange(4.0), "a": torch.ones(3)}, {"w": torch.arange(4.0)}])
    code, out, _ = verify(tmp_path, capsys)
    assert code == 0 and out.strip() == "step 4: committed", out
    for r in ("0", "1"):
        capsys.readouterr()
        assert main(["verify", str(tmp_path), "--ranks", r]) == 0, capsys.readouterr().out
