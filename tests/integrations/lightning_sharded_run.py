"""Lightning runs with a sharded strategy over 2 gloo CPU ranks, one process per rank with the
torchrun environment, several ``fit`` calls in one process:
``python lightning_sharded_run.py '<json list of run args>'``. ``"strategy"``: ``"model_parallel"``
(``ModelParallelStrategy``, FSDP2 ``fully_shard`` applied in ``configure_model``) or ``"fsdp1"``
(``FSDPStrategy``, ``FullyShardedDataParallel`` wrapping each ``Linear``, sharded state dicts).

The model and data are :mod:`lightning_run`'s (the MLP starts from ``seed``'s values, each rank
reads its own sequential half of 32 fixed samples, batch 8: 2 steps an epoch) plus a buffer counting
the batches (a plain tensor in the sharded state dict: a resume that lost it counts from 0); each
rank appends ``{"step", "loss", "batches"}`` lines to ``<losses>.rank<r>``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning_run import LossLog, Tiny, data
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from tiered_ckpt.integrations.lightning_sharded import (
    TieredFSDPStrategy,
    TieredModelParallelStrategy,
)

WORLD = 2


class CountingTiny(Tiny):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.register_buffer("batches", torch.zeros((), dtype=torch.int64))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batches += 1
        return super().training_step(batch, batch_idx)


class CountingLog(LossLog):
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int):
        with open(f"{self.path}.batches{trainer.global_rank}", "a") as f:
            f.write(json.dumps([trainer.global_step, int(pl_module.batches)]) + "\n")
        super().on_train_batch_end(trainer, pl_module, outputs, batch, i)


class ShardedTiny(CountingTiny):
    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if layer.__class__.__name__ == "Linear":
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def run(args: dict[str, Any]) -> pl.Trainer:
    """One ``fit``: ``strategy``, ``losses``, ``max_steps``, ``seed``; with ``root`` and ``ckdir``
    through the tiered strategy and ``ModelCheckpoint`` (every ``every`` steps, top 2, last),
    without them no checkpoints (Lightning's ``ModelParallelStrategy``; for FSDP1 the tiered one,
    which never saves then: Lightning's ``FSDPStrategy`` refuses the CPU); optional
    ``ckpt_path``, ``hang_at`` (sleep there until killed), ``report``."""
    if args.get("hang_at") is not None:
        os.environ["LIGHTNING_RUN_HANG_AT"] = str(args["hang_at"])
    else:
        os.environ.pop("LIGHTNING_RUN_HANG_AT", None)
    callbacks: list[Any] = [CountingLog(args["losses"])]
    strategy: Strategy
    if args["strategy"] == "fsdp1":
        model: CountingTiny = CountingTiny(args["seed"])
        policy = ModuleWrapPolicy({nn.Linear})
        strategy = TieredFSDPStrategy(args.get("root") or "-", auto_wrap_policy=policy)
    else:
        model = ShardedTiny(args["seed"])
        kw = {"data_parallel_size": WORLD, "tensor_parallel_size": 1}
        if args.get("root"):
            strategy = TieredModelParallelStrategy(args["root"], **kw)
        else:
            strategy = ModelParallelStrategy(**kw)
    if args.get("root"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=args["ckdir"],
                every_n_train_steps=args.get("every", 2),
                save_top_k=2,
                monitor="step",
                mode="max",
                save_last=True,
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=args["max_steps"],
        callbacks=callbacks,
        enable_checkpointing=bool(args.get("root")),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
        use_distributed_sampler=False,
    )
    trainer.fit(
        model,
        train_dataloaders=data(batch_size=8, world=WORLD),
        ckpt_path=args.get("ckpt_path"),
    )
    if trainer.global_rank == 0 and args.get("report"):
        Path(args["report"]).write_text(json.dumps({"ckpt_path": trainer.ckpt_path}))
    return trainer


if __name__ == "__main__":
    for one in json.loads(sys.argv[1]):
        run(one)
