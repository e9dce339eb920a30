"""Resharding reads: bytes read per rank when DCP reshards a 4-rank FSDP2 checkpoint
(tensors of 4 MiB) onto 3 ranks, and a 2-rank one onto 4 (byte-equal reassembled): every rank reads
at most 5% more than the bytes it needs (its DTensor local shards, the replicated plain tensors and
byte items), metadata and headers included, and what it reads is the right slice
(tests/dcp/dcp_reshard_bytes_worker.py: real gloo, one process per rank, no training). Run with
``-s`` to see the figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spawn import start_ranks, wait_ranks

WORKER = Path(__file__).resolve().parent / "dcp_reshard_bytes_worker.py"


@pytest.mark.slow
def test_reshard_4_to_3_and_2_to_4_read_within_5_percent_of_what_each_rank_needs(
    tmp_path: Path,
) -> None:
    logs = wait_ranks(start_ranks(WORKER, tmp_path, world=4), timeout=120)
    files = [tmp_path / f"result_{r}.json" for r in range(3)]
    assert all(f.exists() for f in files), "\n".join(log[-3000:] for log in logs)
    for r, f in enumerate(files):
        res = json.loads(f.read_text())
        read, needed = res["bytes_read"], res["bytes_needed"]
        print(
            f"\n[reshard 4->3] rank {r}: read {read} B, needs {needed} B ({read / needed - 1:+.2%}), "
            f"{res['keys']} keys"
        )
        assert res["bad"] == [], (r, res["bad"])
        assert (
            needed > 6 * 340 * 4096
        )  # >= 340 of 1024 rows (4 KiB each) of two weights and their two moments
        assert needed <= read <= 1.05 * needed, (r, read, needed)
    grown = [json.loads((tmp_path / f"grow_{r}.json").read_text()) for r in range(4)]
    assert grown[0]["bad"] == [] and grown[0]["keys"] == res["keys"]
    for r, res in enumerate(grown):
        read, needed = res["bytes_read"], res["bytes_needed"]
        print(
            f"[reshard 2->4] rank {r}: read {read} B, needs {needed} B ({read / needed - 1:+.2%})"
        )
        assert needed > 6 * 256 * 4096  # 256 of 1024 rows of two weights and their two moments
        assert needed <= read <= 1.05 * needed, (r, read, needed)
