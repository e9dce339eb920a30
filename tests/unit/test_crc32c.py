"""CRC32C recorded at save time (schema v2) and the fast verification path."""

from __future__ import annotations

import hashlib
from pathlib import Path

import google_crc32c
import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt import GlobalSlice
from tiered_ckpt.format.crc32c import Crc32c, TensorChunkCrcs, chunk_count, crc32c_extend, crc_hex
from tiered_ckpt.format.manifest import TensorRecord
from tiered_ckpt.local.scan import inspect_step
from tiered_ckpt.local.verified_read import manifest_with_tensors


def g(data: bytes) -> int:
    return int(google_crc32c.value(bytes(data)))


def test_crc32c_extend_matches_google_crc32c_on_any_buffer() -> None:
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    assert crc32c_extend(0, b"123456789") == 0xE3069283  # the standard check value
    assert crc32c_extend(0, raw) == g(raw)
    assert crc32c_extend(0, bytearray(raw)) == g(raw)
    assert crc32c_extend(0, memoryview(raw)[17:9000]) == g(raw[17:9000])
    arr = np.frombuffer(raw[:80_000], np.float64).reshape(100, 100)
    assert crc32c_extend(0, arr) == g(arr.tobytes())
    assert crc32c_extend(0, memoryview(arr)[3:7]) == g(arr[3:7].tobytes())
    assert crc32c_extend(crc32c_extend(0, raw[:5000]), raw[5000:]) == g(raw)  # continuation
    assert crc32c_extend(7, b"") == 7
    h = Crc32c()
    for i in range(0, len(raw), 4096):
        h.update(memoryview(raw)[i : i + 4096])
    assert h.hexdigest() == crc_hex(g(raw)) == f"{g(raw):08x}"


@pytest.mark.parametrize("piece", [1, 7, 4096, 10_000, 1 << 20])
def test_tensor_chunk_crcs_any_feeding(piece: int) -> None:
    """Per-tensor chunk CRCs are the same whatever the size of the pieces the stream is fed in."""
    header = b"H" * 24
    sizes = [0, 5000, 4096, 1, 12_289]
    recs, pos = [], 0
    for i, n in enumerate(sizes):
        recs.append(TensorRecord(f"t{i}", "U8", (n,), (pos, pos + n)))
        pos += n
    data = np.random.default_rng(2).integers(0, 256, pos, dtype=np.uint8).tobytes()
    h = TensorChunkCrcs(len(header), recs, 4096)
    stream = header + data
    for i in range(0, len(stream), piece):
        h.update(memoryview(stream)[i : i + piece])
    got = h.result()
    for r in recs:
        b = data[r.data_offsets[0] : r.data_offsets[1]]
        want = tuple(crc_hex(g(b[k : k + 4096])) for k in range(0, len(b), 4096))
        assert got[r.name] == want and len(want) == chunk_count(len(b), 4096)


def test_manifest_records_crc32c_header_sha_and_chunks(tmp_path: Path) -> None:
    n = (1 << 20) + 1000  # float32: 4 MiB + 4000 B, i.e. 5 chunks of 1 MiB
    states = [
        {"w": GlobalSlice(np.full(n, r, np.float32), (2 * n,), (r * n,)), "x": np.arange(3), "j": r}
        for r in range(2)
    ]
    m = tc.save_sharded(states, tmp_path, 1)
    assert all(rec.tensors is None for rec in m.shards)  # the chunk CRCs are in each header
    m = manifest_with_tensors(tmp_path / "step_0000000001", m)
    for rec in m.shards:
        raw = (tmp_path / "step_0000000001" / rec.path).read_bytes()
        assert rec.crc32c == crc_hex(g(raw))
        assert rec.sha256 == hashlib.sha256(raw).hexdigest()
        hlen = int.from_bytes(raw[:8], "little")
        assert rec.header_sha256 == hashlib.sha256(raw[: 8 + hlen]).hexdigest()
        cs = rec.crc32c_chunk_bytes
        assert cs == 1 << 20
        for t in rec.tensors:
            b = raw[8 + hlen + t.data_offsets[0] : 8 + hlen + t.data_offsets[1]]
            assert t.crc32c == tuple(crc_hex(g(b[k : k + cs])) for k in range(0, len(b), cs))
        assert len({t.name: t for t in rec.tensors}["w"].crc32c) == 5


def flip(path: Path, offset_from_end: int) -> None:
    b = bytearray(path.read_bytes())
    b[-offset_from_end] ^= 0x10
    path.write_bytes(bytes(b))


def test_fast_load_and_corruption(tmp_path: Path) -> None:
    states = [{"w": np.arange(1000, dtype=np.float64) + r} for r in range(3)]
    tc.save_sharded(states, tmp_path, 4)
    for verify in ("crc32c", "sha256"):
        out = tc.load_sharded(tmp_path, 3, verify=verify)
        assert [o["w"].tobytes() for o in out] == [s["w"].tobytes() for s in states]
        assert tc.load_shard(tmp_path, 2, 3, verify=verify)["w"][0] == 2.0
    with pytest.raises(ValueError, match="verify"):
        tc.load_sharded(tmp_path, 3, verify="md5")
    flip(tmp_path / "step_0000000004" / "rank_00001.safetensors", 100)
    with pytest.raises(tc.ShardCorruptedError, match="crc32c"):
        tc.load_sharded(tmp_path, 3, verify="crc32c")
    with pytest.raises(tc.ShardCorruptedError, match="sha256"):
        tc.load_shard(tmp_path, 1, 3)
    st = inspect_step(tmp_path, 4, fast=True)
    assert st.state == "corrupt" and "crc32c" in st.reason and "rank 1" in st.reason
    st = inspect_step(tmp_path, 4)
    assert st.state == "corrupt" and "sha256" in st.reason


def test_fast_verify_never_allocates_the_shard(tmp_path: Path) -> None:
    """Streaming verification (verify CLI) holds a 1 MiB buffer, not the shard: the step of 64 MiB
    verifies under a tracemalloc peak far below its size."""
    import tracemalloc

    tc.save_sharded([{"w": np.ones(8 << 20, np.float64)}], tmp_path, 1)
    tracemalloc.start()
    try:
        for fast in (True, False):
            assert inspect_step(tmp_path, 1, fast=fast).ok
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
