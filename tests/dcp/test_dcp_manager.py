"""DCPCheckpointManager in one process (no process group): policy, async DCP saves, rotation at the
commit, lineage, load, a failed background save; and the lineage decision's ``resharding`` flag."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from tiered_ckpt.dcp import DCPCheckpointManager, TieredStorageWriter
from tiered_ckpt.errors import CheckpointError, CheckpointExistsError, WorldSizeMismatchError
from tiered_ckpt.local.catalogue import committed_steps, read_manifest
from tiered_ckpt.local.rotation import RotationPolicy
from tiered_ckpt.local.single_process_save import save_sharded
from tiered_ckpt.training import SaveOutcome
from tiered_ckpt.training.lineage_decision import LineageDecider


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(16, 4, generator=g),
            "b": torch.arange(3, dtype=torch.int64) + step,
        },
        "optim": {"m": torch.randn(16, 4, generator=g).to(torch.bfloat16)},
        "extra": {"step": step},
    }


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_saves_rotate_record_the_lineage_load_back_and_fail_at_the_next_call(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    outcomes: list[SaveOutcome] = []
    with DCPCheckpointManager(
        root, save_every_steps=1, keep_last=2, on_save_outcome=outcomes.append
    ) as mgr:
        for step in range(1, 6):
            assert mgr.should_save(step)
            mgr.save(step, state(step))
        mgr.wait()
        assert committed_steps(root) == [4, 5] and mgr.latest_step() == 5
        rec = json.loads((root / "run.json").read_text())
        m = read_manifest(root, 5)
        assert (m.run_id, m.attempt) == (rec["run_id"], 1) == (mgr.run_id, mgr.attempt)
        mgr.save(5, state(5))  # step 5 is committed: DCP's background thread fails in planning
        with pytest.raises(CheckpointExistsError):
            mgr.save(6, state(6))  # the failure surfaces here, and nothing else is done
        assert committed_steps(root) == [4, 5]
    assert [(o.step, o.rank, o.committed_here, o.error) for o in outcomes[:5]] == [
        (s, 0, True, None) for s in range(1, 6)
    ]
    assert all(o.seconds > 0 and o.stage_seconds > 0 for o in outcomes)
    (failed,) = outcomes[5:]  # the failed background save is reported too, with its error
    assert (failed.step, failed.committed_here) == (5, False) and failed.error.startswith(
        "CheckpointExistsError: "
    )
    into = {
        "model": {"w": torch.zeros(16, 4), "b": torch.zeros(3, dtype=torch.int64)},
        "optim": {"m": torch.zeros(16, 4, dtype=torch.bfloat16)},
        "extra": {"step": 0},
    }
    with DCPCheckpointManager(root, async_save=False) as mgr:
        assert mgr.load(into=into) is into and (mgr.loaded_step, mgr.attempt) == (5, 1)
    want = state(5)
    for part in ("model", "optim"):
        assert all(raw(into[part][k]) == raw(want[part][k]) for k in want[part])
    assert into["extra"] == {"step": 5}
    # The writer carries rotation and lineage to DCP's checkpoint process (process mode): picklable.
    w = pickle.loads(
        pickle.dumps(
            TieredStorageWriter(root, 9, rotation=RotationPolicy(2), run_id="r", attempt=3)
        )
    )
    assert (w.rotation, w.run_id, w.attempt) == (RotationPolicy(2), "r", 3)
    # A load at another world size is legal for DCP (resharding): the decision skips its check.
    other = tmp_path / "other"
    save_sharded([{"w": np.zeros(2, np.float32)}], other, 7)
    with pytest.raises(WorldSizeMismatchError):
        LineageDecider(other, 0, None, world_size=2).at_load(None)
    assert LineageDecider(other, 0, None, world_size=2).at_load(None, resharding=True)[0] == 7
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(6, state(6))
