"""Trainer.fit through TieredCheckpointIO in one process: ModelCheckpoint's top-k and last, resume
with ckpt_path="last" proven (the resumed model starts from other values), the loss curve equal to
an uninterrupted run's bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning_run import Tiny, read_losses, run

from tiered_ckpt.integrations.lightning import TieredCheckpointIO
from tiered_ckpt.integrations.pointer import read_pointer
from tiered_ckpt.local.catalogue import committed_steps, read_manifest
from tiered_ckpt.local.pins import pinned_steps


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_fit_resume_last_equals_uninterrupted(tmp_path: Path, async_save: bool) -> None:
    ref = tmp_path / "ref"
    run(
        {
            "root": "-",
            "ckdir": "-",
            "losses": str(ref),
            "max_steps": 12,
            "seed": 0,
            "checkpointing": False,
        }
    )
    root, ckdir, losses = tmp_path / "root", tmp_path / "ck", tmp_path / "losses"
    args = {
        "root": str(root),
        "ckdir": str(ckdir),
        "losses": str(losses),
        "seed": 0,
        "async_save": async_save,
    }
    run({**args, "max_steps": 8})
    # every_n_train_steps=2, save_top_k=2 (monitor "step", mode max: the newest two), save_last: steps 6 and 8
    # pinned behind their pointers, 2 and 4 removed through rotation; last.ckpt aliases step 8
    assert sorted(p.name for p in ckdir.iterdir()) == [
        "epoch=0-step=6.ckpt",
        "epoch=0-step=8.ckpt",
        "last.ckpt",
    ]
    assert committed_steps(root) == [6, 8] and pinned_steps(root) == [6, 8]
    assert read_pointer(ckdir / "last.ckpt").step == 8
    extra = read_manifest(root, 8).extra
    assert extra == {
        "integration": "lightning",
        "lightning": {"path": str(ckdir / "epoch=0-step=8.ckpt")},
    }

    # the resumed run's model starts elsewhere: only a loaded checkpoint gives the same curve
    saved = TieredCheckpointIO(root).load_checkpoint(ckdir / "last.ckpt")["state_dict"]
    other = Tiny(seed=1).state_dict()
    assert all(not torch.equal(saved[k], other[k]) for k in saved)
    report = tmp_path / "report.json"
    run({**args, "max_steps": 12, "seed": 1, "ckpt_path": "last", "report": str(report)})
    import json

    assert json.loads(report.read_text())["ckpt_path"] == str(ckdir / "last.ckpt")
    want, got = read_losses(ref), read_losses(losses)
    assert sorted(got) == list(range(1, 13)) and sorted(want) == list(range(1, 13))
    assert max(abs(want[s] - got[s]) for s in range(1, 13)) == 0.0
    assert committed_steps(root) == [10, 12]
