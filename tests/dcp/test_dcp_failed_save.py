"""A failed DCP save nobody aborts (a plain ``dcp.save``, a thread-mode ``dcp.async_save``) leaves
files naming a live process, which ``gc`` leaves alone; the process's next save through the writer,
of any step, removes them first; a committed step is never touched. ``ls`` never shows the failed
step as committed. The same with 2 real gloo ranks in sync, thread and process mode
(tests/dcp/dcp_failed_save_worker.py). Killed saves: tests/dcp/test_dcp_killed_save.py."""

from __future__ import annotations

import gc as pygc
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from spawn import start_ranks, wait_ranks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tiered_ckpt import dcp as tdcp
from tiered_ckpt.dcp.storage_writer import UnfinishedSaves
from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.local.scan import COMMITTED, gc_report, scan
from tiered_ckpt.local.sweep import LIVE_WRITER

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WORKER = Path(__file__).resolve().parent / "dcp_failed_save_worker.py"


class LatePlanner(DefaultSavePlanner):
    """Changes the global metadata after the coordinator's shard was written with it: ``finish``
    refuses to commit (a save that fails after every shard is durable)."""

    def resolve_data(self, write_item: Any) -> Any:
        self.metadata.planner_data = {**(self.metadata.planner_data or {}), "late": ("late",)}
        return super().resolve_data(write_item)


def failed_save(root: Path, step: int, mode: str) -> None:
    writer = tdcp.TieredStorageWriter(root, step)
    state = {"w": torch.ones(64), "n": 1}
    if mode == "sync":
        with pytest.raises(CheckpointException):
            dcp.save(state, storage_writer=writer, planner=LatePlanner())
    else:
        fut = dcp.async_save(
            state,
            storage_writer=writer,
            planner=LatePlanner(),
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
        )
        with pytest.raises(CheckpointException):
            fut.result(timeout=60)


def wait_for_ended_threads(step: int, timeout_s: float = 10.0) -> None:
    """DCP's thread-mode executor, once dropped, ends its worker thread: wait for that (the next
    save sweeps only saves whose thread has ended)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pygc.collect()
        entries = UnfinishedSaves._entries  # noqa: SLF001
        if not any(e.thread.is_alive() for e in entries if e.step == step):
            return
        time.sleep(0.05)
    raise AssertionError("DCP's executor thread is still alive")


@pytest.mark.parametrize("mode", ["sync", "thread"])
def test_next_save_removes_what_a_failed_save_left(tmp_path: Path, mode: str) -> None:
    UnfinishedSaves.sweep()
    dcp.save({"w": torch.ones(3)}, storage_writer=tdcp.TieredStorageWriter(tmp_path, 1))
    failed_save(tmp_path, 5, mode)
    sdir = tmp_path / "step_0000000005"
    left = sorted(p.name for p in sdir.iterdir())
    assert "rank_00000.safetensors" in left and ".save.lock" in left, left
    assert [s.step for s in scan(tmp_path, verify=True) if s.state == COMMITTED] == [1]
    rep = gc_report(tmp_path, min_age_s=0)  # the writer's process is alive: left alone
    assert (sdir, LIVE_WRITER) in rep.skipped_others and sdir.exists()
    if mode == "thread":
        wait_for_ended_threads(5)
    dcp.save({"w": torch.ones(3)}, storage_writer=tdcp.TieredStorageWriter(tmp_path, 6))
    assert not sdir.exists()
    assert committed_steps(tmp_path) == [1, 6]
    assert gc_report(tmp_path, min_age_s=0).removed == ()


def test_the_same_step_saves_again_after_a_failed_save(tmp_path: Path) -> None:
    UnfinishedSaves.sweep()
    failed_save(tmp_path, 5, "sync")
    dcp.save({"w": torch.ones(3)}, storage_writer=tdcp.TieredStorageWriter(tmp_path, 5))
    assert committed_steps(tmp_path) == [5]
    assert sorted(p.name for p in (tmp_path / "step_0000000005").iterdir()) == [
        "manifest.json",
        "rank_00000.safetensors",
    ]


def test_a_committed_step_is_never_swept(tmp_path: Path) -> None:
    UnfinishedSaves.sweep()
    for step in (1, 2, 3):
        dcp.save(
            {"w": torch.full((4,), float(step))},
            storage_writer=tdcp.TieredStorageWriter(tmp_path, step),
        )
    assert committed_steps(tmp_path) == [1, 2, 3]
    back = {"w": torch.zeros(4)}
    dcp.load(back, storage_reader=tdcp.TieredStorageReader(tmp_path, 1))
    assert torch.equal(back["w"], torch.full((4,), 1.0))


@pytest.mark.slow
def test_two_ranks_failed_save_in_each_mode_is_removed_by_the_next(tmp_path: Path) -> None:
    """2 real gloo ranks; in process mode the writer that failed is DCP's copy in its checkpoint
    process: that process's next save removes what it left."""
    logs = wait_ranks(start_ranks(WORKER, tmp_path, world=2), timeout=240)
    files = [tmp_path / f"result_{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), "\n".join(log[-3000:] for log in logs)
    res = json.loads(files[0].read_text())
    assert res["committed"] == [11, 21, 31], res
    for mode in ("sync", "thread", "process"):
        r = res[mode]
        assert r["refused"] and "rank_00000.safetensors" in (r["left"] or []), (mode, r)
        assert r["after"] is None, (mode, r)
