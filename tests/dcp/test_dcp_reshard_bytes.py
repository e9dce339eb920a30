"""Issue 13, Show "Resharding": bytes read per rank when DCP reshards a 4-rank FSDP2 checkpoint (tensors
of 4 MiB) onto 3 ranks: every rank reads at most 5% more than the bytes it needs (its DTensor local
shards, the replicated plain tensors and byte items), metadata and headers included, and what it reads
is the right slice (tests/dcp/dcp_reshard_bytes_worker.py: real gloo, one process per rank, no
training). Run with ``-s`` to see the figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spawn import start_ranks, wait_ranks

WORKER = Path(__file__).resolve().parent / "dcp_reshard_bytes_worker.py"


@pytest.mark.slow
def test_reshard_4_to_3_reads_within_5_percent_of_what_each_rank_needs(tmp_path: Path) -> None:
    logs = wait_ranks(start_ranks(WORKER, tmp_path, world=4), timeout=120)
    files = [tmp_path / f"result_{r}.json" for r in range(3)]
    assert all(f.exists() for f in files), "\n".join(log[-3000:] for log in logs)
    for r, f in enumerate(files):
        res = json.loads(f.read_text())
        read, needed = res["bytes_read"], res["bytes_needed"]
        print(f"\n[reshard 4->3] rank {r}: read {read} B, needs {needed} B ({read / needed - 1:+.2%}), "
              f"{res['keys']} keys")
        assert res["bad"] == [], (r, res["bad"])
        assert needed > 6 * 340 * 4096  # >= 340 of 1024 rows (4 KiB each) of two weights and their two moments
        assert needed <= read <= 1.05 * needed, (r, read, needed)
