"""A rollback (it once deleted the new checkpoint, and the next restart loads the abandoned
branch) on the local tier, through the real CheckpointManager, and the local lineage record
underneath it: ``<root>/run.json``, catalogue filtering of superseded steps, set-aside under
``superseded/``, and the lineage recorded by the low-level save functions.

New names are imported inside the tests, after the assertions that reproduce the failure, so that
each test fails on code without lineage records at the reproduction, not at an import."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from tiered_ckpt import NoCheckpointError, read_manifest
from tiered_ckpt.errors import LineageError
from tiered_ckpt.layout import MANIFEST_NAME, UPLOADED_MARKER_NAME, step_dir_name
from tiered_ckpt.local.catalogue import committed_steps, latest_step
from tiered_ckpt.local.load_committed import load_sharded
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.training.manager import CheckpointManager


def state(step: int) -> dict:
    return {"w": np.full(8, float(step), dtype=np.float32), "step": step}


def tree_digest(path: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file()
    }


def old_branch(root: Path) -> dict[int, dict[str, str]]:
    """The rollback's root: steps 500, 600, 700 saved by an earlier run of the job."""
    with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
        for s in (500, 600, 700):
            mgr.save(s, state(s))
    assert committed_steps(root) == [500, 600, 700]
    return {s: tree_digest(root / step_dir_name(s)) for s in (500, 600, 700)}


# --- the rollback, as written


def test_rollback_save_survives_and_the_next_restart_loads_it(tmp_path: Path) -> None:
    root = tmp_path / "run"
    before = old_branch(root)
    # The job is restarted from scratch (a rollback): it saves step 100 without loading.
    with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
        mgr.save(100, state(100))
        assert committed_steps(root) == [
            100
        ]  # without lineage: [500, 600, 700] (100 rotated out at once)
        assert mgr.attempt == 2
    # The next restart loads the new lineage's step, not 700.
    with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
        got = mgr.load()
        assert got["step"] == 100 and got["w"].tolist() == [100.0] * 8
        assert mgr.attempt == 2 and mgr.latest_step() == 100
    assert latest_step(root) == 100

    from tiered_ckpt.local.catalogue import read_run_record
    from tiered_ckpt.local.lineage import superseded_local_steps

    rec = read_run_record(root)
    assert rec is not None and rec.attempt == 2
    assert (rec.attempts[1].supersedes_from, rec.attempts[1].resumed_from) == (100, None)
    listed = superseded_local_steps(root)
    assert [
        (e.step, e.attempt, e.superseded.attempt, e.superseded.from_step, e.set_aside)
        for e in listed
    ] == [(500, 1, 2, 100, True), (600, 1, 2, 100, True), (700, 1, 2, 100, True)]
    for e in listed:  # set aside, not deleted: byte for byte what was committed
        assert e.path == root / "superseded" / f"{step_dir_name(e.step)}.{e.save_id}"
        assert tree_digest(e.path) == before[e.step]
        assert e.run_id == rec.run_id
    assert read_manifest(root, 100).run_id == rec.run_id and read_manifest(root, 100).attempt == 2


def test_rollback_by_loading_an_older_step(tmp_path: Path) -> None:
    """Restart from 500 (a loss spike after it): 600 and 700 are superseded; 500 stays current. They
    are kept until keep_last current steps exist (SPEC §11), then rotation removes them."""
    root = tmp_path / "run"
    old_branch(root)
    with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
        got = mgr.load(500)
        assert got["step"] == 500
        mgr.save(
            600, state(600)
        )  # the second pass through 600 commits (before: CheckpointExistsError)
        assert committed_steps(root) == [500, 600]

        from tiered_ckpt.local.catalogue import read_run_record
        from tiered_ckpt.local.lineage import superseded_local_steps

        a2 = read_run_record(root).attempts[1]
        assert (a2.attempt, a2.supersedes_from, a2.resumed_from) == (2, 501, 500)
        assert [
            (e.step, e.attempt, e.superseded.from_step) for e in superseded_local_steps(root)
        ] == [(600, 1, 501), (700, 1, 501)]
        mgr.save(650, state(650))  # three current steps: the superseded ones may go now
        assert committed_steps(root) == [500, 600, 650]
        assert superseded_local_steps(root) == []
    with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
        assert mgr.load()["step"] == 650
        assert mgr.attempt == 2
    assert read_manifest(root, 600).attempt == 2


def test_no_new_attempt_without_newer_steps(tmp_path: Path) -> None:
    root = tmp_path / "run"
    old_branch(root)
    for _ in range(3):  # restarts that resume from the newest step never start a new attempt
        with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
            assert mgr.load()["step"] == 700
            assert mgr.attempt == 1
    from tiered_ckpt.local.catalogue import read_run_record
    from tiered_ckpt.local.lineage import superseded_local_steps

    assert read_run_record(root).attempt == 1 and superseded_local_steps(root) == []
    with CheckpointManager(root, keep_last=3, async_save=False) as mgr:
        mgr.save(800, state(800))  # a first save above every step: the run goes on
        assert mgr.attempt == 1
    assert committed_steps(root) == [600, 700, 800]


def test_run_id_is_created_once_and_recorded_in_every_manifest(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, async_save=False) as mgr:
        assert mgr.run_id is None and mgr.attempt is None
        mgr.save(1, state(1))
        run = mgr.run_id
    assert isinstance(run, str) and len(run) == 32 and int(run, 16) >= 0
    with CheckpointManager(root, async_save=True) as mgr:
        mgr.load()
        mgr.save(2, state(2))
        assert mgr.run_id == run
    assert [(read_manifest(root, s).run_id, read_manifest(root, s).attempt) for s in (1, 2)] == [
        (run, 1),
        (run, 1),
    ]
    assert json.loads((root / "run.json").read_text())["run_id"] == run


def attempts(root: Path) -> list[tuple]:
    """``(attempt, supersedes_from, resumed_from)`` of every attempt in ``root``'s run.json."""
    rec = json.loads((root / "run.json").read_text())
    return [(a["attempt"], a["supersedes_from"], a["resumed_from"]) for a in rec["attempts"]]


def set_aside(root: Path) -> list[tuple]:
    """``(step, attempt saved in, superseding attempt, from step, set aside)`` of the superseded
    steps."""
    from tiered_ckpt.local.lineage import superseded_local_steps

    return sorted(
        (
            e.step,
            e.attempt,
            e.superseded.attempt if e.superseded else None,
            e.superseded.from_step if e.superseded else None,
            e.set_aside,
        )
        for e in superseded_local_steps(root)
    )


def test_in_process_rollback_starts_a_new_attempt_at_every_load(tmp_path: Path) -> None:
    """A load of an older step in a manager that already saved (or loaded) is a rollback too: before
    the fix only the manager's first load or save decided, so load(500) kept attempt 1, the next
    save of 600 raised CheckpointExistsError, 510 was committed as attempt 1 and the next restart
    loaded 700, the abandoned branch."""
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=5, async_save=False) as mgr:
        for s in (500, 600, 700):
            mgr.save(s, state(s))
        assert mgr.attempt == 1
        assert mgr.load(500)["step"] == 500
        assert mgr.attempt == 2  # before the fix: 1
        assert attempts(root) == [(1, None, None)]  # decided; the next save records it
        assert set_aside(root) == []
        mgr.save(600, state(600))  # before the fix: CheckpointExistsError
        assert attempts(root) == [(1, None, None), (2, 501, 500)]
        assert set_aside(root) == [(600, 1, 2, 501, True), (700, 1, 2, 501, True)]
        mgr.save(510, state(510))
        assert [(read_manifest(root, s).attempt) for s in (500, 510, 600)] == [1, 2, 2]
        assert (
            mgr.load()["step"] == 600 and mgr.attempt == 2
        )  # the newest current step again: no attempt
        assert mgr.load(600)["step"] == 600 and mgr.attempt == 2
        # Rollback twice in one manager.
        assert mgr.load(510)["step"] == 510 and mgr.attempt == 3
        mgr.save(520, state(520))
        assert attempts(root) == [(1, None, None), (2, 501, 500), (3, 511, 510)]
        assert committed_steps(root) == [500, 510, 520]
        assert set_aside(root) == [
            (600, 1, 2, 501, True),
            (600, 2, 3, 511, True),
            (700, 1, 2, 501, True),
        ]
    with CheckpointManager(root, keep_last=5, async_save=False) as mgr:
        got = mgr.load()
        assert got["step"] == 520 and got["w"].tolist() == [520.0] * 8  # before the fix: 700
        assert mgr.attempt == 3
    assert read_manifest(root, 520).attempt == 3


def test_in_process_load_of_an_older_newest_common_step(tmp_path: Path) -> None:
    """load() in a running manager whose newest step lost its shard (a node loss): the newest step
    it can load is older than a current committed step, so the load starts a new attempt from
    there."""
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=5, async_save=False) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, state(s))
        (root / step_dir_name(30) / "rank_00000.safetensors").unlink()
        assert mgr.load()["step"] == 20
        assert (
            mgr.attempt == 2
        )  # before the fix: 1 (and the next save of 30 raised CheckpointExistsError)
        mgr.save(30, state(30))
        assert attempts(root) == [(1, None, None), (2, 21, 20)]
        assert set_aside(root) == [(30, 1, 2, 21, True)]
        assert committed_steps(root) == [10, 20, 30] and read_manifest(root, 30).attempt == 2
    with CheckpointManager(root, keep_last=5, async_save=False) as mgr:
        assert mgr.load()["step"] == 30 and mgr.attempt == 2


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_lost_shard_is_never_a_fresh_start(tmp_path: Path) -> None:
    """The only step lost this rank's shard: load() raises MissingShardError (a committed step
    exists), never NoCheckpointError (a caller's 'start fresh'), and nothing is recorded."""
    from tiered_ckpt.errors import MissingShardError

    root = tmp_path / "run"
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.save(10, state(10))
    (root / step_dir_name(10) / "rank_00000.safetensors").unlink()
    before = tree(root)
    with CheckpointManager(root, async_save=False) as mgr:
        with pytest.raises(
            MissingShardError, match=r"no current step \(the newest: 10\) is loadable by every rank"
        ):
            mgr.load()
        with pytest.raises(
            MissingShardError, match=r"step 10 is not loadable by every rank: rank\(s\) \[0\]"
        ):
            mgr.load(10)
        with pytest.raises(NoCheckpointError, match="step 20 is not a current committed step"):
            mgr.load(20)
    assert tree(root) == before


@pytest.mark.parametrize("step", [None, 10])
def test_world_size_mismatch_is_checked_before_anything_is_recorded(
    tmp_path: Path, step: int | None
) -> None:
    """A 1-rank load of a 2-rank step raises WorldSizeMismatchError with the root untouched: before
    the fix load(10) first started attempt 2 (run.json written, step 20 set aside), then failed."""
    from tiered_ckpt.errors import WorldSizeMismatchError

    root = tmp_path / "run"
    save_sharded([state(10), state(10)], root, 10)  # saved by 2 ranks
    if step == 10:
        save_sharded([state(20)], root, 20)
    before = tree(root)
    with CheckpointManager(root, keep_last=5, async_save=False) as mgr:
        with pytest.raises(WorldSizeMismatchError, match="step 10 was saved by 2 ranks, but 1"):
            mgr.load(step)
        assert mgr.attempt is None
    assert tree(root) == before
    assert committed_steps(root) == ([10, 20] if step == 10 else [10])


# --- the local tier underneath


def test_catalogue_filters_superseded_steps_still_in_place(tmp_path: Path) -> None:
    from tiered_ckpt.format.lineage import RunLineage
    from tiered_ckpt.local.lineage import superseded_local_steps, write_run_record

    root = tmp_path / "run"
    rec = RunLineage.first("r1", "2026-01-01T00:00:00Z")
    assert write_run_record(root, rec) is True and write_run_record(root, rec) is False
    for s in (10, 20, 30):
        save_sharded([state(s)], root, s)
    assert [read_manifest(root, s).attempt for s in (10, 20, 30)] == [1, 1, 1]
    write_run_record(
        root,
        rec.new_attempt(supersedes_from=20, resumed_from=10, started_at="2026-01-02T00:00:00Z"),
    )
    assert (
        committed_steps(root) == [10] and latest_step(root) == 10
    )  # filtered before any set-aside
    with pytest.raises(NoCheckpointError, match="superseded by attempt 2"):
        load_sharded(root, 1, 20)
    assert load_sharded(root, 1)[0]["step"] == 10
    assert [(e.step, e.set_aside) for e in superseded_local_steps(root)] == [
        (20, False),
        (30, False),
    ]
    # The low-level save records the root's current attempt and never supersedes.
    m = save_sharded([state(25)], root, 25)
    assert (m.run_id, m.attempt) == ("r1", 2)
    assert committed_steps(root) == [10, 25]


def test_set_aside_is_idempotent_and_remove_goes_through_trash(tmp_path: Path) -> None:
    from tiered_ckpt.format.lineage import RunLineage
    from tiered_ckpt.local.lineage import (
        remove_superseded,
        set_aside_superseded,
        superseded_local_steps,
        write_run_record,
    )

    root = tmp_path / "run"
    rec = RunLineage.first("r1", "t0")
    write_run_record(root, rec)
    for s in (10, 20, 30):
        save_sharded([state(s)], root, s)
    rec2 = rec.new_attempt(supersedes_from=11, resumed_from=10, started_at="t1")
    with pytest.raises(LineageError):
        set_aside_superseded(
            root, rec2
        )  # the record must be in the root first (a crash repeats the decision)
    assert committed_steps(root) == [10, 20, 30]
    write_run_record(root, rec2)
    moved = set_aside_superseded(root)
    assert [(e.step, e.set_aside) for e in moved] == [(20, True), (30, True)]
    assert set_aside_superseded(root) == []  # again: nothing left to move
    assert sorted(os.listdir(root)) == ["run.json", step_dir_name(10), "superseded"]
    # The step numbers are free for the new attempt.
    save_sharded([state(20)], root, 20)
    assert committed_steps(root) == [10, 20] and read_manifest(root, 20).attempt == 2
    listed = superseded_local_steps(root)
    assert [(e.step, e.attempt, e.set_aside) for e in listed] == [(20, 1, True), (30, 1, True)]
    assert (
        remove_superseded(root, listed[0]) is True and remove_superseded(root, listed[0]) is False
    )
    assert [e.step for e in superseded_local_steps(root)] == [30]
    assert os.listdir(root / "superseded") == [listed[1].path.name]


def test_remove_superseded_in_place_refuses_a_reused_step_number(tmp_path: Path) -> None:
    """An entry listed in place whose directory was set aside and whose number the new attempt
    reused is put back, never deleted."""
    from tiered_ckpt.format.lineage import RunLineage
    from tiered_ckpt.local.lineage import (
        remove_superseded,
        set_aside_superseded,
        superseded_local_steps,
        write_run_record,
    )

    root = tmp_path / "run"
    rec = RunLineage.first("r1", "t0")
    write_run_record(root, rec)
    save_sharded([state(20)], root, 20)
    write_run_record(root, rec.new_attempt(supersedes_from=20, resumed_from=None, started_at="t1"))
    (stale,) = superseded_local_steps(root)
    assert not stale.set_aside
    set_aside_superseded(root)
    save_sharded([state(20)], root, 20)  # attempt 2's step 20, same directory name
    assert remove_superseded(root, stale) is False
    assert committed_steps(root) == [20] and read_manifest(root, 20).attempt == 2


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory", "oversized", "malformed"])
def test_run_record_reads_are_bounded(tmp_path: Path, kind: str) -> None:
    from tiered_ckpt.errors import ManifestError
    from tiered_ckpt.local.catalogue import MAX_RUN_RECORD_BYTES, read_run_record

    root = tmp_path / "run"
    save_sharded([state(1)], root, 1)
    path = root / "run.json"
    if kind == "fifo":
        os.mkfifo(path)  # opening it blocking would hang with no writer
    elif kind == "symlink":
        (tmp_path / "elsewhere.json").write_text('{"schema_version": 1}')
        path.symlink_to(tmp_path / "elsewhere.json")
    elif kind == "directory":
        path.mkdir()
    elif kind == "oversized":
        with open(path, "wb") as f:
            f.truncate(MAX_RUN_RECORD_BYTES + 1)
    else:
        path.write_text('{"schema_version": 1, "run_id": "r", "attempts": []}')
    with pytest.raises(ManifestError):
        read_run_record(root)
    with pytest.raises(ManifestError):
        committed_steps(root)  # never guessed around: a superseded step would count as current


def test_commit_step_records_the_lineage_it_is_given(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert (save_sharded([state(1)], root, 1).run_id, read_manifest(root, 1).attempt) == (None, 1)
    m = save_sharded([state(2)], root, 2, run_id="given", attempt=7)
    assert (m.run_id, m.attempt) == ("given", 7)
    with pytest.raises(ValueError):
        save_sharded([state(3)], root, 3, run_id="not a run id!", attempt=1)
    assert committed_steps(root) == [1, 2]


def test_replace_removes_the_stale_uploaded_marker_first(tmp_path: Path) -> None:
    """The re-save (library level): a step re-saved with replace=True must not keep its
    uploaded.json."""
    root = tmp_path / "run"
    save_sharded([state(5)], root, 5)
    sdir = root / step_dir_name(5)
    old_manifest = (sdir / MANIFEST_NAME).read_bytes()
    (sdir / UPLOADED_MARKER_NAME).write_text(json.dumps({"step": 5, "remote": "s3://b/p"}))
    save_sharded([{"w": np.zeros(8, dtype=np.float32), "step": 5}], root, 5, replace=True)
    assert (sdir / MANIFEST_NAME).read_bytes() != old_manifest
    assert not (sdir / UPLOADED_MARKER_NAME).exists()  # without lineage: the old marker stayed
    assert load_sharded(root, 1, 5)[0]["w"].tolist() == [0.0] * 8


def test_manager_pin_and_keep_every_steps(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=1, keep_every_steps=100, async_save=True) as mgr:
        mgr.save(1, state(1))
        mgr.pin(1)  # waits for the in-flight save of 1 first
        for s in (2, 3, 100, 101, 102):
            mgr.save(s, state(s))
        mgr.wait()
        assert committed_steps(root) == [1, 100, 102]  # pinned, every 100th, the newest
        with pytest.raises(NoCheckpointError):
            mgr.pin(3)  # rotated out: not committed here any more
    assert (root / step_dir_name(1) / "pinned.json").is_file()


def test_a_run_record_only_grows(tmp_path: Path) -> None:
    from tiered_ckpt.format.lineage import RunLineage
    from tiered_ckpt.local.catalogue import read_run_record
    from tiered_ckpt.local.lineage import write_run_record

    root = tmp_path / "run"
    one = RunLineage.first("r1", "t0")
    two = one.new_attempt(supersedes_from=5, resumed_from=4, started_at="t1")
    assert write_run_record(root, two) is True
    with pytest.raises(LineageError):
        write_run_record(root, one)  # would forget attempt 2
    with pytest.raises(LineageError):
        write_run_record(root, RunLineage.first("other", "t2"))  # another run
    assert read_run_record(root) == two
    assert write_run_record(root, RunLineage.first("other", "t2"), force=True) is True
    assert read_run_record(root).run_id == "other"
