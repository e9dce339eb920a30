"""Many small tensors: the manifest is O(ranks), not O(tensors), and many small tensors are
written as a few large I/Os."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt.fs import new_save_id
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.writer import write_shard

#: Per-shard values that change from save to save (hashes, sizes, ids, times), replaced before
#: comparing.
_VARYING = ("sha256", "crc32c", "header_sha256", "size_bytes", "header_size_bytes", "save_id")


def _state(rank: int, n: int) -> dict[str, Any]:
    return {
        "w": {f"t{i:05d}": np.full(3, rank * n + i, np.float32) for i in range(n)},
        "slice": tc.GlobalSlice(np.arange(4, dtype=np.float32) + 4 * rank, (8,), (4 * rank,)),
    }


def _normalised(text: str) -> str:
    obj = json.loads(text)
    for k in ("save_id", "created_at", "wall_clock_seconds"):
        obj[k] = None
    for s in obj["shards"]:
        for k in _VARYING:
            s[k] = None if k in s else "absent"
    return json.dumps(obj, sort_keys=True)


def test_manifest_size_does_not_grow_with_tensors_per_rank(tmp_path: Path) -> None:
    """2 ranks with 10, 1,000 and 10,000 tensors each: manifest.json is the same but for the digits
    of sizes, hashes and ids (a few bytes), i.e. its size does not depend on the number of
    tensors."""
    texts = []
    for n in (10, 1000, 10_000):
        root = tmp_path / f"n{n}"
        tc.save_sharded([_state(r, n) for r in range(2)], root, 1, wall_clock_seconds=1.0)
        texts.append((root / "step_0000000001" / "manifest.json").read_text())
    sizes = [len(t.encode()) for t in texts]
    assert max(sizes) - min(sizes) <= 16, (
        sizes
    )  # 2 ranks x (size_bytes, header_size_bytes): a few digits each
    assert _normalised(texts[0]) == _normalised(texts[1]) == _normalised(texts[2])
    assert sizes[2] < 2048


def test_ten_thousand_small_tensors_are_few_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10,000 tensors of 4 KiB (40 MiB) reach the file in at most 64 write calls (1 MiB staging
    buffers), not one or more per tensor."""
    state = {"p": {f"t{i:05d}": np.full(1024, i, np.float32) for i in range(10_000)}}
    calls = {"n": 0}
    for fn in ("write", "writev", "pwrite", "pwritev"):
        real = getattr(os, fn)

        def counted(*a: Any, _real: Any = real) -> Any:
            calls["n"] += 1
            return _real(*a)

        monkeypatch.setattr(os, fn, counted)
    rec = write_shard(tmp_path, 1, 0, state, save_id="s")
    writes = calls["n"]
    monkeypatch.undo()
    assert 1 <= writes <= 64, writes
    assert rec.size_bytes > 40 * 1024 * 1024
    with open(
        tmp_path / "step_0000000001" / "rank_00000.safetensors", "rb"
    ) as f:  # the packing kept every byte
        f.seek(rec.header_size_bytes + 4321 * 4096)
        assert f.read(4096) == np.full(1024, 4321, np.float32).tobytes()


def _flip_in_header(path: Path, marker: bytes, new_digit: bytes) -> None:
    """Replace the digit right after ``marker`` in the file's header (the JSON stays valid)."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    i = raw.index(marker, 8, 8 + n) + len(marker)
    assert raw[i : i + 1] != new_digit and raw[i : i + 1].isalnum()
    raw[i : i + 1] = new_digit
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("where", ["crc-digit", "global-offset"])
def test_corrupt_header_index_is_caught_by_header_sha256(tmp_path: Path, where: str) -> None:
    """A digit changed in rank 1's tensor index (a chunk CRC, a slice's global offset): the
    manifest's whole-file hashes are made to match the bytes, so only header_sha256 can catch it, on
    load (both verify modes), on a resharding load and in verify."""
    import hashlib

    from tiered_ckpt.format.crc32c import Crc32c

    root = tmp_path / "r"
    tc.save_sharded([_state(r, 3) for r in range(2)], root, 1)
    sdir = root / "step_0000000001"
    shard = sdir / "rank_00001.safetensors"
    if where == "crc-digit":
        marker = (
            b'\\"crc32c\\":\\"'  # the chunk CRC string of the index (JSON inside a JSON string)
        )
        raw = shard.read_bytes()
        first = raw[raw.index(marker) + len(marker) :][:1]
        _flip_in_header(shard, marker, b"0" if first != b"0" else b"1")
    else:
        _flip_in_header(
            shard, b'\\"slice\\":[[8],[', b"0"
        )  # rank 1's offset 4 -> 0 (overlaps rank 0)
    data = shard.read_bytes()
    m = json.loads((sdir / "manifest.json").read_text())
    crc = Crc32c()
    crc.update(data)
    m["shards"][1].update(sha256=hashlib.sha256(data).hexdigest(), crc32c=crc.hexdigest())
    os.unlink(sdir / "manifest.json")
    (sdir / "manifest.json").write_text(json.dumps(m))
    for verify in ("sha256", "crc32c"):
        with pytest.raises(tc.ShardCorruptedError, match="rank 1 .*header sha256 differs"):
            tc.load_sharded(root, 2, verify=verify)
        with pytest.raises(tc.ShardCorruptedError, match="rank 1 .*header sha256 differs"):
            tc.load_sharded(root, 1, reshard=True, verify=verify, rules={"w": "drop"})
    assert tc.load_shard(root, 0, 2)["slice"].tolist() == [0.0, 1.0, 2.0, 3.0]  # rank 0 is fine
    from tiered_ckpt.local.scan import scan

    rows = scan(root, verify=True)
    assert [r.state for r in rows] == ["corrupt"] and "header sha256" in rows[0].reason


def test_commit_refuses_a_record_of_another_step_even_with_matching_header_bytes(
    tmp_path: Path,
) -> None:
    """The pre-commit check's fast path (header bytes hash to the record's header_sha256) still
    checks which rank and step the header names: records of step 1 committed for step 2 over hard
    links of step 1's files are refused, and step 2 stays uncommitted."""
    save_id = new_save_id()
    recs = [
        write_shard(tmp_path, 1, r, {"w": np.arange(4, dtype=np.float32) + r}, save_id=save_id)
        for r in range(2)
    ]
    commit_step(tmp_path, 1, 2, recs, save_id=save_id)
    (tmp_path / "step_0000000002").mkdir()
    for r in range(2):
        os.link(
            tmp_path / "step_0000000001" / f"rank_0000{r}.safetensors",
            tmp_path / "step_0000000002" / f"rank_0000{r}.safetensors",
        )
    with pytest.raises(tc.ShardCorruptedError, match="header names rank 0 step 1"):
        commit_step(tmp_path, 2, 2, recs, save_id=save_id)
    assert not (tmp_path / "step_0000000002" / "manifest.json").exists()


def test_record_crc32c_is_the_crc32c_of_the_file_bytes(tmp_path: Path) -> None:
    """The whole-file CRC32C in the shard record is combined from the header's and the pre-pass's
    chunk CRCs (no second pass): it must equal the CRC32C of the file's bytes, computed
    independently, for large multi-chunk tensors (combined), small ones (extended), empty ones, and
    both CRC threads."""
    import google_crc32c

    rng = np.random.default_rng(7)
    states = [
        {
            "big": rng.standard_normal(
                (3 << 20) // 8 + 5
            ),  # > 3 MiB: several chunks, a partial last one
            "mid": rng.integers(0, 255, 300_000, dtype=np.uint8),
            "small": np.arange(7, dtype=np.int16),
            "empty": np.zeros((0, 3), np.float32),
            "more": np.full(8 << 20, 1.5),
        },  # 64 MiB more: 2 CRC threads
        {"only_small": np.ones(3, np.float32)},
    ]
    m = tc.save_sharded(states, tmp_path, 1)
    for rec in m.shards:
        data = (tmp_path / "step_0000000001" / rec.path).read_bytes()
        assert rec.crc32c == f"{google_crc32c.value(data):08x}"
