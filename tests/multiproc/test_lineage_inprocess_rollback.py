"""Rollback inside a running manager, on 2 real gloo ranks with node-local roots: a load of an older step in a
manager that already saved (and a load() whose newest common step is older after one node lost its
copy) decides a new attempt; the next save records it in every root and sets the newer steps aside
before it writes anything (the load itself changes no root). Before the fix only the manager's first load or save decided: ``load(500)`` kept attempt 1
and the next save of 600 failed with ``CheckpointExistsError`` inside ``DistributedSaveError``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spawn import TESTS_DIR, start_ranks, wait_ranks

WORKERS = TESTS_DIR / "_lineage_inprocess_workers.py"


@pytest.mark.slow
def test_two_ranks_roll_back_twice_in_one_manager(tmp_path: Path) -> None:
    logs = wait_ranks(start_ranks(WORKERS, tmp_path, world=2), timeout=120)
    results = []
    for r in range(2):
        f = tmp_path / f"result_{r}.json"
        assert f.exists(), f"rank {r} wrote no result:\n" + "\n".join(logs)[-6000:]
        results.append(json.loads(f.read_text()))
    a2, a3 = [600, 1, 2, 501], [700, 1, 2, 501]
    common = [
        ["saved", None, 1, [500, 600, 700], []],
        # decided (attempt 2), recorded by the next save: the load sets nothing aside
        ["load 500", 500, 2, [500, 600, 700], []],
        ["saved 510 600", None, 2, [500, 510, 600], [a2, a3]],
        [
            "load newest",
            600,
            2,
            [500, 510, 600],
            [a2, a3],
        ],  # the newest current step: no new attempt
    ]
    # Rank 0 still holds attempt 2's 600; rank 1 lost it. Both load 510 and decide attempt 3 from
    # 511; the save of 520 records it: rank 0 sets its 600 aside, rank 1 has nothing newer.
    after_loss = [
        [
            ["load after loss", 510, 3, [500, 510, 600], [a2, a3]],
            ["saved 520 600", None, 3, [500, 510, 520, 600], [a2, [600, 2, 3, 511], a3]],
            ["restart", 600, 3, [500, 510, 520, 600], [a2, [600, 2, 3, 511], a3]],
        ],
        [
            ["load after loss", 510, 3, [500, 510], [a2, a3]],
            ["saved 520 600", None, 3, [500, 510, 520, 600], [a2, a3]],
            ["restart", 600, 3, [500, 510, 520, 600], [a2, a3]],
        ],
    ]
    for rank, res in enumerate(results):
        assert res == common + after_loss[rank], rank
    for r in range(2):
        rec = json.loads((tmp_path / f"node{r}" / "run.json").read_text())
        assert [
            (a["attempt"], a["supersedes_from"], a["resumed_from"]) for a in rec["attempts"]
        ] == [(1, None, None), (2, 501, 500), (3, 511, 510)]
