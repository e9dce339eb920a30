"""TorchTitan's checkpointer on the tiers: a 2-rank gloo job of TorchTitan's pieces
(tests/integrations/torchtitan_worker.py) whose rank 1 is SIGKILLed inside a save leaves that step
uncommitted (no load picks it, no load of it succeeds); the job resumes from the previous committed
step with the loss curve of an uninterrupted run, bit for bit; ``tiered-ckpt verify`` passes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="extra tiered-ckpt[torchtitan] (torchtitan, triton)")

import torch
from spawn import child_env, cli_cmd, start_ranks, wait_ranks
from torchtitan.components.checkpoint import AsyncMode
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import Checkpoint as CheckpointConfig
from torchtitan.config import LRScheduler as LRSchedulerConfig

from tiered_ckpt import CheckpointError, NoCheckpointError, dcp
from tiered_ckpt.integrations.torchtitan import TieredCheckpointManager
from tiered_ckpt.local.catalogue import committed_steps

pytestmark = [
    pytest.mark.slow,
    pytest.mark.multiproc,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

WORKER = Path(__file__).with_name("torchtitan_worker.py")
STEPS, INTERVAL = "6", "2"


def _losses(path: Path) -> list[tuple[int, float]]:
    return [
        (int(s), float.fromhex(h)) for s, h in (ln.split() for ln in path.read_text().splitlines())
    ]


def test_killed_save_then_resume_keeps_the_loss_curve(tmp_path: Path) -> None:
    killed, ref = tmp_path / "killed", tmp_path / "ref"
    # The uninterrupted run, then (in the same processes) the run whose rank 1 dies in step 4's save.
    first = start_ranks(
        WORKER,
        STEPS,
        INTERVAL,
        *(ref, tmp_path / "ref.txt", "async", "none"),
        *(killed, tmp_path / "killed.txt", "disabled", "in-save:4"),
        world=2,
    )
    logs = wait_ranks(first, 120)
    assert first[1].returncode == -9 and first[0].returncode != 0, logs
    assert committed_steps(ref / "checkpoint") == [4, 6]

    root = killed / "checkpoint"
    assert (root / "step_0000000004").is_dir() and not (
        root / "step_0000000004/manifest.json"
    ).exists()
    assert committed_steps(root) == [2]
    with pytest.raises(NoCheckpointError):
        dcp.load({"w": torch.zeros(1)}, root, 4)

    resumed = start_ranks(
        WORKER, STEPS, INTERVAL, killed, tmp_path / "resumed.txt", "async", "none", world=2
    )
    logs = wait_ranks(resumed, 120)
    assert [p.returncode for p in resumed] == [0, 0], logs
    assert all("starts at step 3" in log for log in logs), logs

    reference = dict(_losses(tmp_path / "ref.txt"))
    assert sorted(reference) == list(range(1, 7))
    before, after = _losses(tmp_path / "killed.txt"), _losses(tmp_path / "resumed.txt")
    assert [s for s, _ in before] == [1, 2, 3, 4] and [s for s, _ in after] == [3, 4, 5, 6]
    assert max(abs(loss - reference[s]) for s, loss in before + after) == 0.0

    assert committed_steps(root) == [4, 6]  # keep_latest_k=2: the tiers' rotation
    last: dict = {}
    assert dcp.load(last, root, whole_step=True) == 6
    assert last["train_state"] == {"step": 6} and last["dataloader"]["world_size"] == 2
    for r in (0, 1):  # the dataloader's state as JSON text, not TorchTitan's pickle
        assert json.loads(last["dataloader"][f"dp_rank_{r}"])["dataset_state"] == {"sample_idx": 12}
    verify = subprocess.run(
        [*cli_cmd(), "verify", str(root)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _manager(folder: Path, **config: object) -> TieredCheckpointManager:
    model = torch.nn.Linear(2, 2)
    optimizers = OptimizersContainer([model], torch.optim.AdamW, {"lr": 0.1})
    return TieredCheckpointManager(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=build_lr_schedulers(optimizers, LRSchedulerConfig(warmup_steps=1), 4),
        states={},
        checkpoint_config=CheckpointConfig(enable=True, keep_latest_k=0, **config),
        sd_adapter=None,
        base_folder=str(folder),
    )


def test_latest_step_is_the_newest_committed_and_refusals(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    assert mgr._find_load_step() == -1 and not Path(mgr.folder).exists()
    dcp.save({"w": torch.ones(2)}, mgr.folder, 3)
    (Path(mgr.folder) / "step_0000000005").mkdir()  # a half-written save: never the latest
    assert mgr._find_load_step() == 3
    assert mgr._create_checkpoint_id(3) == str(Path(mgr.folder, "step_0000000003").absolute())
    with pytest.raises(CheckpointError, match="only its own steps"):
        mgr.dcp_save({"w": torch.ones(2)}, str(tmp_path / "elsewhere"), AsyncMode.DISABLED)
    mgr.close()
    with pytest.raises(CheckpointError, match="last_save_in_hf"):
        _manager(tmp_path, last_save_in_hf=True)
