"""A load changes nothing on disk: ``load(step)`` only decides which lineage the next save
continues. Both managers (native and DCP, in one process), synchronous and asynchronous.

Loading steps one after another on a root holding 1, 2, 3 works in any order and leaves the root
byte for byte as it was; the next save continues the lineage of the last load (a rollback sets the
newer steps aside then, before anything of the save is written); :meth:`record_lineage` does it
without a save; a crash between the record and the save's commit leaves the decision in force
(the set-aside steps are never read as current again, and no third attempt follows)."""

from __future__ import annotations

import hashlib
import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tiered_ckpt.errors import CheckpointError, NoCheckpointError
from tiered_ckpt.local.catalogue import committed_steps, read_manifest
from tiered_ckpt.local.lineage import superseded_local_steps
from tiered_ckpt.training.manager import CheckpointManager

needs_torch = pytest.mark.skipif(find_spec("torch") is None, reason="needs torch")

ENGINES = [
    pytest.param(("native", False), id="native-sync"),
    pytest.param(("native", True), id="native-async"),
    pytest.param(("dcp", False), id="dcp-sync", marks=needs_torch),
    pytest.param(("dcp", True), id="dcp-async", marks=needs_torch),
]

#: The module whose ``write_shard`` each engine's save calls.
WRITE_MODULE = {"native": "tiered_ckpt.training.manager", "dcp": "tiered_ckpt.dcp.storage_writer"}


class Engine:
    def __init__(self, kind: str, async_save: bool) -> None:
        self.kind, self.async_save = kind, async_save

    def make(self, root: Path, **kw: Any) -> Any:
        if self.kind == "dcp":
            from tiered_ckpt.dcp import DCPCheckpointManager

            return DCPCheckpointManager(root, async_save=self.async_save, keep_last=5, **kw)
        return CheckpointManager(root, async_save=self.async_save, keep_last=5, **kw)

    def state(self, step: int, salt: int = 0) -> dict[str, Any]:
        w = np.arange(32, dtype=np.float32) * step + salt
        if self.kind == "dcp":
            import torch

            return {"model": {"w": torch.from_numpy(w)}, "extra": {"step": step, "salt": salt}}
        return {"model": {"w": w}, "extra": {"step": step, "salt": salt}}


def w_bytes(state: dict[str, Any]) -> bytes:
    w = state["model"]["w"]
    return w.tobytes() if isinstance(w, np.ndarray) else w.numpy().tobytes()


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Engine:
    return Engine(*request.param)


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".node.")
    }


def attempts(root: Path) -> list[tuple]:
    rec = json.loads((root / "run.json").read_text())
    return [(a["attempt"], a["supersedes_from"], a["resumed_from"]) for a in rec["attempts"]]


def set_aside(root: Path) -> list[tuple]:
    """``(step, attempt saved in, superseding attempt, from step, set aside)``."""
    return [
        (e.step, e.attempt, e.superseded.attempt, e.superseded.from_step, e.set_aside)
        for e in superseded_local_steps(root)
        if e.superseded is not None
    ]


def three_steps(engine: Engine, root: Path) -> dict[int, bytes]:
    with engine.make(root) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, engine.state(s))
    assert committed_steps(root) == [1, 2, 3]
    return {s: w_bytes(engine.state(s)) for s in (1, 2, 3)}


def test_loading_steps_one_after_another_changes_nothing(tmp_path: Path, engine: Engine) -> None:
    root = tmp_path / "run"
    want = three_steps(engine, root)
    before = tree(root)
    with engine.make(root) as mgr:
        for s in (1, 2, 3, 1):  # before: load(2) raised NoCheckpointError (2 was set aside)
            got = mgr.load(s)
            assert (mgr.loaded_step, got["extra"]["step"], w_bytes(got)) == (s, s, want[s])
            assert committed_steps(root) == [1, 2, 3]
        assert (mgr.attempt, mgr.latest_step()) == (2, 3)  # what the next save would record
        assert mgr.load()["extra"]["step"] == 3 and mgr.attempt == 1
    assert tree(root) == before  # byte for byte, run.json included; nothing under superseded/
    assert not (root / "superseded").exists()


def test_the_next_save_continues_the_lineage_of_the_last_load(
    tmp_path: Path, engine: Engine
) -> None:
    root = tmp_path / "run"
    three_steps(engine, root)
    old2 = read_manifest(root, 2).save_id
    with engine.make(root) as mgr:
        mgr.load(3)
        mgr.load(1)
        assert attempts(root) == [(1, None, None)] and set_aside(root) == []
        mgr.save(2, engine.state(2, salt=7))  # continues from 1: 2 and 3 go aside first
        mgr.wait()
        assert attempts(root) == [(1, None, None), (2, 2, 1)]
        assert committed_steps(root) == [1, 2] and mgr.attempt == 2
        assert set_aside(root) == [(2, 1, 2, 2, True), (3, 1, 2, 2, True)]
        assert superseded_local_steps(root)[0].save_id == old2
        with pytest.raises(NoCheckpointError):
            mgr.load(3)  # superseded now that a save continued from 1
    with engine.make(root) as mgr:
        got = mgr.load()
        assert (got["extra"], mgr.attempt) == ({"step": 2, "salt": 7}, 2)
        assert w_bytes(got) == w_bytes(engine.state(2, salt=7))
    assert (read_manifest(root, 2).attempt, read_manifest(root, 2).save_id != old2) == (2, True)


def test_a_save_after_loading_the_newest_step_starts_no_attempt(
    tmp_path: Path, engine: Engine
) -> None:
    root = tmp_path / "run"
    three_steps(engine, root)
    with engine.make(root) as mgr:
        mgr.load(1)
        mgr.load(2)
        mgr.load(3)  # the last load is the newest step: the run goes on in attempt 1
        mgr.save(4, engine.state(4))
        mgr.wait()
        assert mgr.attempt == 1
    assert attempts(root) == [(1, None, None)] and set_aside(root) == []
    assert committed_steps(root) == [1, 2, 3, 4] and read_manifest(root, 4).attempt == 1


def test_record_lineage_sets_aside_without_a_save(tmp_path: Path, engine: Engine) -> None:
    root = tmp_path / "run"
    three_steps(engine, root)
    with engine.make(root) as mgr:
        assert mgr.record_lineage() is None  # nothing decided yet
        mgr.load(1)
        rec = mgr.record_lineage()
        assert rec is not None and (rec.attempt, mgr.attempt) == (2, 2)
        assert attempts(root) == [(1, None, None), (2, 2, 1)]
        assert committed_steps(root) == [1]
        assert set_aside(root) == [(2, 1, 2, 2, True), (3, 1, 2, 2, True)]
        assert mgr.record_lineage() is None  # recorded once
        mgr.save(2, engine.state(2, salt=1))
        mgr.wait()
    assert attempts(root) == [(1, None, None), (2, 2, 1)]  # no third attempt
    assert committed_steps(root) == [1, 2] and read_manifest(root, 2).attempt == 2


@pytest.mark.parametrize("engine", ENGINES[:1] + ENGINES[2:3], indirect=True)
def test_a_crash_between_the_record_and_the_commit_keeps_the_decision(
    tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save after load(1) records attempt 2 and sets 2 and 3 aside, then dies writing its shard
    (an injected exception standing in for the process's death): the next start sees step 1 as the
    newest current step, never 2 or 3 of attempt 1, and continues attempt 2."""
    root = tmp_path / "run"
    three_steps(engine, root)

    def dies(*a: Any, **k: Any) -> Any:
        raise OSError("injected: the process dies before the commit")

    with engine.make(root) as mgr:
        mgr.load(1)
        monkeypatch.setattr(f"{WRITE_MODULE[engine.kind]}.write_shard", dies)
        with pytest.raises((CheckpointError, OSError)):
            mgr.save(2, engine.state(2, salt=3))
            mgr.wait()
        monkeypatch.undo()
    assert attempts(root) == [(1, None, None), (2, 2, 1)]
    assert committed_steps(root) == [1]
    with engine.make(root) as mgr:
        assert mgr.load()["extra"]["step"] == 1 and mgr.attempt == 2
        mgr.save(2, engine.state(2, salt=3))
        mgr.wait()
    assert attempts(root) == [(1, None, None), (2, 2, 1)]
    assert committed_steps(root) == [1, 2] and read_manifest(root, 2).attempt == 2
    assert set_aside(root) == [(2, 1, 2, 2, True), (3, 1, 2, 2, True)]
