"""The crash loop after a node replacement, on 4 real gloo ranks (two
simulated nodes x two ranks, node-local roots) and a real S3 server (moto, over HTTP).

Both nodes commit step 40 locally; node 1's upload of 40 is still running when the job dies; node 1
is replaced (its disk is gone). The newest step every rank can get is 30 (from the bucket). Without
lineage the job resumed from 30, reached 40 again and died with ``CheckpointExistsError: step 40 is
already committed under .../node0`` inside ``DistributedSaveError``, on every restart. Now the
resume starts attempt 2, node 0's step 40 is set aside, the second pass through 40 commits, and the
job trains to the end with exactly the loss curve of an uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from s3_infra import S3Location
from spawn import TESTS_DIR, start_ranks, wait_ranks

WORKERS = TESTS_DIR / "lineage_workers.py"
WORLD = 4


def run_mode(mode: str, out: Path, s3: S3Location) -> list[dict]:
    procs = start_ranks(WORKERS, mode, out, s3.url, s3.endpoint_url, world=WORLD)
    logs = wait_ranks(procs, timeout=120)
    results = []
    for r in range(WORLD):
        f = out / f"result_{mode}_{r}.json"
        assert f.exists(), f"{mode}: rank {r} wrote no result:\n" + "\n".join(logs)[-6000:]
        results.append(json.loads(f.read_text()))
    return results


@pytest.mark.slow
def test_node_replacement_resumes_past_the_lost_step(s3_bucket: S3Location, tmp_path: Path) -> None:
    straight = run_mode("straight", tmp_path, s3_bucket)
    first = run_mode("first", tmp_path, s3_bucket)
    run_id = first[0]["run_id"]
    assert [r["committed"] for r in first] == [[20, 30, 40]] * WORLD and {
        r["attempt"] for r in first
    } == {1}
    shutil.rmtree(tmp_path / "node1")  # node 1 is replaced: its disk is gone

    resumed = run_mode(
        "resume", tmp_path, s3_bucket
    )  # without lineage: DistributedSaveError at step 40
    for rank, res in enumerate(resumed):
        assert res["loaded"] == 30, rank
        assert (res["run_id"], res["attempt"]) == (run_id, 2)
        assert res["committed"] == [30, 40, 50]
    # The load decided attempt 2 (from step 31) and changed no lineage: node 0's old step 40 was
    # still in place and current until the save of 40 recorded the decision and set it aside (not
    # deleted, never loaded); node 1's new disk never had it (its shard of 30 restored). Rotation
    # removed it once keep_last=3 current steps existed (30, 40, 50).
    assert [r["superseded_after_load"] for r in resumed] == [[]] * WORLD
    assert [r["committed_after_load"] for r in resumed] == [[20, 30, 40]] * 2 + [[30]] * 2
    assert [r["superseded"] for r in resumed] == [[]] * WORLD
    # The loss curve is the uninterrupted one, bit for bit.
    ref = {int(k): v for k, v in straight[0]["losses"].items()}
    assert sorted(ref) == list(range(1, 51))
    for res in first:
        assert {int(k): v for k, v in res["losses"].items()} == {s: ref[s] for s in range(1, 41)}
    for res in resumed:
        got = {int(k): v for k, v in res["losses"].items()}
        assert sorted(got) == list(range(31, 51))
        assert max(abs(got[s] - ref[s]) for s in got) == 0.0
    # The bucket: the record names attempt 2; the current saves of 40 and 50 are attempt 2's.
    assert resumed[0]["remote_attempts"] == 2
    current = dict(map(tuple, resumed[0]["remote_current"]))
    assert current[40] == 2 and current[50] == 2 and current[30] == 1
