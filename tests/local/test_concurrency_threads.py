"""I4 within one process: two threads saving the same step never produce a committed mixed step.

The on-disk save lock names its owner process, so it cannot tell two threads apart; the in-process
registry in local.py does. Found by a QA run where 15 of 400 races committed a step whose manifest
did not match its shard."""

from __future__ import annotations

import shutil
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt.errors import CheckpointExistsError, ConcurrentSaveError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.writer import write_shard


def _race(
    root: Path, size: int, replace: bool
) -> tuple[dict[float, str], dict[float, ShardManifest]]:
    """Two threads save step 1 of ``root`` (2 ranks, ``size`` float32 of value 1.0 resp. 2.0) at
    once: each save's outcome (``ok``, ``concurrent`` or another error) and the manifest each
    successful one returned."""
    barrier = threading.Barrier(2)
    results: dict[float, str] = {}
    manifests: dict[float, ShardManifest] = {}

    def go(v: float) -> None:
        barrier.wait()
        try:
            manifests[v] = tc.save_sharded(
                [{"w": np.full(size, v, np.float32)}] * 2, root, 1, replace=replace
            )
            results[v] = "ok"
        except ConcurrentSaveError:
            results[v] = "concurrent"
        except CheckpointExistsError:  # the other save committed before this one began (no overlap)
            results[v] = "exists"
        except tc.CheckpointError as e:  # any other outcome is a failure of this test
            results[v] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=go, args=(v,)) for v in (1.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, manifests


def _content_of(root: Path, size: int, candidates: list[float]) -> list[float]:
    """The candidate saves whose content every rank of the committed step 1 equals, byte for
    byte."""
    got = tc.load_sharded(root, 2, 1)  # verified: every shard matches the committed manifest
    return [
        v
        for v in candidates
        if all(st["w"].tobytes() == np.full(size, v, np.float32).tobytes() for st in got)
    ]


def _check_committed(
    root: Path,
    size: int,
    results: dict[float, str],
    manifests: dict[float, ShardManifest],
    replace: bool,
) -> None:
    """Never a mix: the committed step 1 is, byte for byte on every rank, the content of exactly one
    save, and that save is the successful one whose commit finished last (without ``replace``: the
    only successful one). A commit's point is its manifest link, so "last" is read from the commits
    themselves: the committed manifest is that save's (save_id), and its ``created_at`` (taken
    inside the commit, microseconds) is the latest of the successful saves'."""
    winners = sorted(v for v, r in results.items() if r == "ok")
    # a loser that overlapped the winner gets ConcurrentSaveError; one that started after the
    # winner's commit (a loaded machine: the barrier only aligns the starts) gets
    # CheckpointExistsError
    allowed = {"ok", "concurrent"} if replace else {"ok", "concurrent", "exists"}
    assert set(results.values()) <= allowed and winners, results
    if not replace:
        assert len(winners) == 1, results
    matches = _content_of(root, size, [0.0, 1.0, 2.0])
    assert len(matches) == 1, (
        f"the committed step is a mix or none of the saves: {results}, {matches}"
    )
    last = max(winners, key=lambda v: manifests[v].created_at)
    assert matches == [last], (results, {v: m.created_at for v, m in manifests.items()})
    on_disk = tc.read_manifest(root, 1)
    assert (on_disk.save_id, on_disk.created_at) == (
        manifests[last].save_id,
        manifests[last].created_at,
    )


@pytest.mark.parametrize("replace", [False, True])
def test_two_threads_same_step(tmp_path: Path, replace: bool) -> None:
    """Without ``replace`` exactly one of two racing saves wins (the other gets
    ConcurrentSaveError). With ``replace`` they may also both succeed: the second one claims the
    step after the first committed and released it, and replaces it; the committed step is then the
    later commit's."""
    outcomes: Counter[tuple[str, ...]] = Counter()
    for i in range(60):
        root = tmp_path / f"r{i}"
        size = 1000 + i
        if replace:
            tc.save_sharded([{"w": np.zeros(3, np.float32)}] * 2, root, 1)
        results, manifests = _race(root, size, replace)
        outcomes[tuple(sorted(results.values()))] += 1
        _check_committed(root, size, results, manifests, replace)
        shutil.rmtree(root)
    if replace:
        assert set(outcomes) <= {("concurrent", "ok"), ("ok", "ok")}, outcomes
    else:  # on a loaded machine a loser may start after the winner committed ("exists"); the race must
        # still have been run for real at least once
        assert (
            set(outcomes) <= {("concurrent", "ok"), ("exists", "ok")}
            and outcomes[("concurrent", "ok")]
        ), outcomes


def test_two_threads_replacing_one_after_the_other_last_commit_wins(tmp_path: Path) -> None:
    """The both-succeed outcome of the race above, made certain: thread 2.0 starts after thread 1.0
    has returned, so both replaces succeed and 2.0's commit is the later one."""
    tc.save_sharded([{"w": np.zeros(3, np.float32)}] * 2, tmp_path, 1)
    results: dict[float, str] = {}
    manifests: dict[float, ShardManifest] = {}
    for v in (1.0, 2.0):

        def go(v: float = v) -> None:
            manifests[v] = tc.save_sharded(
                [{"w": np.full(500, v, np.float32)}] * 2, tmp_path, 1, replace=True
            )
            results[v] = "ok"

        t = threading.Thread(target=go)
        t.start()
        t.join()
    assert results == {1.0: "ok", 2.0: "ok"}
    assert manifests[1.0].created_at < manifests[2.0].created_at
    _check_committed(tmp_path, 500, results, manifests, replace=True)
    assert _content_of(tmp_path, 500, [1.0, 2.0]) == [2.0]


def test_sequential_write_shard_without_save_id_still_adopts(tmp_path: Path) -> None:
    """The plain single-process use of the rank-side API keeps working: write every rank without a
    save_id, then commit (records share the adopted save)."""
    recs = [write_shard(tmp_path, 7, r, {"x": np.arange(r + 1)}) for r in range(3)]
    assert len({rec.save_id for rec in recs}) == 1
    m = commit_step(tmp_path, 7, 3, recs)
    assert m.save_id == recs[0].save_id
    assert [s["x"].tolist() for s in tc.load_sharded(tmp_path, 3)] == [[0], [0, 1], [0, 1, 2]]
