"""Issue 12 (items 1 and 4): the manifest is O(ranks), not O(tensors), and many small tensors are written
as a few large I/Os."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tiered_ckpt as tc

#: Per-shard values that change from save to save (hashes, sizes, ids, times), replaced before comparing.
_VARYING = ("sha256", "crc32c", "header_sha256", "size_bytes", "header_size_bytes", "save_id")


def _state(rank: int, n: int) -> dict[str, Any]:
    return {"w": {f"t{i:05d}": np.full(3, rank * n + i, np.float32) for i in range(n)},
            "slice": tc.GlobalSlice(np.arange(4, dtype=np.float32) + 4 * rank, (8,), (4 * rank,))}


def _normalised(text: str) -> str:
    obj = json.loads(text)
    for k in ("save_id", "created_at", "wall_clock_seconds"):
        obj[k] = None
    for s in obj["shards"]:
        for k in _VARYING:
            s[k] = None if k in s else "absent"
    return json.dumps(obj, sort_keys=True)


def test_manifest_size_does_not_grow_with_tensors_per_rank(tmp_path: Path) -> None:
    """2 ranks with 10, 1,000 and 10,000 tensors each: manifest.json is the same but for the digits of
    sizes, hashes and ids (a few bytes), i.e. its size does not depend on the number of tensors."""
    texts = []
    for n in (10, 1000, 10_000):
        root = tmp_path / f"n{n}"
        tc.save_sharded([_state(r, n) for r in range(2)], root, 1, wall_clock_seconds=1.0)
        texts.append((root / "step_0000000001" / "manifest.json").read_text())
    sizes = [len(t.encode()) for t in texts]
    assert max(sizes) - min(sizes) <= 16, sizes  # 2 ranks x (size_bytes, header_size_bytes): a few digits each
    assert _normalised(texts[0]) == _normalised(texts[1]) == _normalised(texts[2])
    assert sizes[2] < 2048
    states = tc.load_sharded(tmp_path / "n10000", 2)  # and the tensors are all there
    assert states[1]["w"]["t09999"].tolist() == [19_999.0] * 3


def test_ten_thousand_small_tensors_are_few_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """10,000 tensors of 4 KiB (40 MiB) reach the file in at most 64 write calls (1 MiB staging buffers),
    not one or more per tensor."""
    state = {"p": {f"t{i:05d}": np.full(1024, i, np.float32) for i in range(10_000)}}
    calls = {"n": 0}
    for fn in ("write", "writev", "pwrite", "pwritev"):
        real = getattr(os, fn)

        def counted(*a: Any, _real: Any = real) -> Any:
            calls["n"] += 1
            return _real(*a)

        monkeypatch.setattr(os, fn, counted)
    rec = tc.write_shard(tmp_path, 1, 0, state, save_id="s")
    writes = calls["n"]
    monkeypatch.undo()
    assert 40 <= writes <= 64, writes
    assert rec.size_bytes > 40 * 1024 * 1024
    tc.commit_step(tmp_path, 1, 1, [rec], save_id="s")
    got = tc.load_shard(tmp_path, 0, 1)["p"]
    assert len(got) == 10_000 and got["t04321"].tobytes() == np.full(1024, 4321, np.float32).tobytes()
