"""One rank of a tiny TorchTitan job on CPU (gloo) checkpointing through TieredCheckpointManager.

TorchTitan's own pieces, called as its ``Trainer.train`` calls them: its llama3 ``Transformer`` (a
tiny config) under FSDP2, its ``OptimizersContainer`` (AdamW), its LR schedulers (warmup + linear
decay), its ``ParallelAwareDataloader`` over a seeded token stream whose position is its state, a
``train_state`` with the step, and the checkpointer: ``load(step=-1)`` first, then ``save(step,
last_step=...)`` after every step. Rank 0 appends ``<step> <loss as float.hex()>`` per step to the
losses file (fsynced). The ``Trainer`` itself needs a CUDA device (see README, "TorchTitan").

usage: torchtitan_worker.py STEPS INTERVAL (DUMP_FOLDER LOSSES ASYNC_MODE KILL)...
  one job per group, run one after the other in the same processes (each from a fresh model, seeded
  alike: one process start for several jobs). KILL: ``none``; ``after:N`` (every rank SIGKILLs
  itself after step N's save); ``in-save:N`` (rank 1 SIGKILLs itself in step N's save, once its
  shard is written, before the commit).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import Checkpoint as CheckpointConfig
from torchtitan.config import LRScheduler as LRSchedulerConfig
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer

from tiered_ckpt.dcp.storage_writer import TieredStorageWriter
from tiered_ckpt.integrations.torchtitan import TieredCheckpointManager

VOCAB, SEQ = 64, 16


class Tokens(IterableDataset, Stateful):
    """Sample ``i`` of rank ``r``: ``SEQ + 1`` tokens drawn from a generator seeded ``(r, i)``."""

    def __init__(self, rank: int) -> None:
        self.rank, self.sample_idx = rank, 0

    def __iter__(self) -> Any:
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.sample_idx)
            x = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            self.sample_idx += 1
            yield x[:-1], x[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sample_idx = state_dict["sample_idx"]


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]


def kill_in_save(step: int, train_state: TrainState) -> None:
    """Rank 1 dies inside step ``step``'s save: right after its shard is written (the coordinator
    commits only once every rank's write result reached it)."""
    write_data = TieredStorageWriter.write_data

    def dying_write_data(self: TieredStorageWriter, plan: Any, planner: Any) -> Any:
        fut = write_data(self, plan, planner)
        if train_state.step == step:
            fut.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return fut

    TieredStorageWriter.write_data = dying_write_data  # type: ignore[method-assign]


def job(folder: str, steps: int, interval: int, losses: str, async_mode: str, kill: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    args = TransformerModelArgs(
        dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, multiple_of=16, max_seq_len=SEQ
    )
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    optimizers = OptimizersContainer(
        [model], torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    )
    lr_schedulers = build_lr_schedulers(optimizers, LRSchedulerConfig(warmup_steps=2), steps)
    dataloader = ParallelAwareDataloader(
        Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=2
    )
    train_state = TrainState()
    config = CheckpointConfig(
        enable=True,
        folder="checkpoint",
        interval=interval,
        keep_latest_k=2,
        async_mode=async_mode,
        last_save_model_only=False,
    )
    checkpointer = TieredCheckpointManager(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        checkpoint_config=config,
        sd_adapter=None,
        base_folder=folder,
    )
    how, _, at = kill.partition(":")
    if how == "in-save" and rank == 1:
        kill_in_save(int(at), train_state)
    checkpointer.load(step=-1)
    print(f"rank {rank} starts at step {train_state.step + 1}", flush=True)
    batches = iter(dataloader)
    while train_state.step < steps:
        train_state.step += 1
        inputs, labels = next(batches)
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            with open(losses, "a") as f:
                f.write(f"{train_state.step} {(mean.item() / world).hex()}\n")
                f.flush()
                os.fsync(f.fileno())
        checkpointer.save(train_state.step, last_step=train_state.step == steps)
        if how == "after" and train_state.step == int(at):
            checkpointer.maybe_wait_for_staging()
            checkpointer._async_wait()
            os.kill(os.getpid(), signal.SIGKILL)
    checkpointer.close()


if __name__ == "__main__":
    steps, interval, *jobs = sys.argv[1:]
    dist.init_process_group("gloo")
    for i in range(0, len(jobs), 4):
        folder, losses, async_mode, kill = jobs[i : i + 4]
        job(folder, int(steps), int(interval), losses, async_mode, kill)
    dist.destroy_process_group()
