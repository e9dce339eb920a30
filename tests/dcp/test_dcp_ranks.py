"""The DCP backend with 2 real gloo ranks (tests/dcp/dcp_rank_worker.py): ``save``, ``async_save``
in a thread (dedicated gloo group) and in DCP's checkpoint process, each loaded back byte for byte;
the step is one committed save of world size 2; replicated items are stored once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spawn import start_ranks, wait_ranks

WORKER = Path(__file__).resolve().parent / "dcp_rank_worker.py"


@pytest.mark.slow
def test_two_ranks_save_thread_and_process_async(tmp_path: Path) -> None:
    logs = wait_ranks(start_ranks(WORKER, "sync,thread,process", tmp_path, world=2), timeout=120)
    files = [tmp_path / f"result_{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), "\n".join(log[-3000:] for log in logs)
    results = [json.loads(f.read_text()) for f in files]
    for mode, step in (("sync", 1), ("thread", 2), ("process", 3)):
        for r in range(2):
            assert results[r][mode]["loaded"] == step and results[r][mode]["bad"] == [], (
                mode,
                r,
                results[r][mode],
            )
        r0 = results[0][mode]
        assert r0["world_size"] == 2 and len(r0["save_ids"]) == 1, (mode, r0)
        names = r0["names"][0] + r0["names"][1]
        # the plain tensor (same on both ranks) and the Replicate() DTensor: once; the Shard(0)
        # ones: per rank
        assert [
            sum(n.startswith(p) for n in names)
            for p in ("model.plain@", "model.rep_dt@", "model.w@", "model.emb@")
        ] == [1, 1, 2, 2], (mode, names)
        assert (
            "__tiered_ckpt_dcp_metadata__" in r0["names"][0]
            and names.count("__tiered_ckpt_dcp_metadata__") == 1
        )
