"""Lightning runs with the sharded strategy (``ModelParallelStrategy``: FSDP2 ``fully_shard`` over
2 gloo CPU ranks), one process per rank with the torchrun environment, several ``fit`` calls in
one process: ``python lightning_sharded_run.py '<json list of run args>'``.

The model and data are :mod:`lightning_run`'s (the MLP starts from ``seed``'s values, each rank
reads its own sequential half of 32 fixed samples), sharded in ``configure_model``; each rank
appends ``{"step", "loss"}`` lines to ``<losses>.rank<r>``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_run import LossLog, Tiny, data
from torch.distributed.fsdp import fully_shard

from tiered_ckpt.integrations.lightning_sharded import TieredModelParallelStrategy

WORLD = 2


class ShardedTiny(Tiny):
    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if layer.__class__.__name__ == "Linear":
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def run(args: dict[str, Any]) -> pl.Trainer:
    """One ``fit``: ``losses``, ``max_steps``, ``seed``; with ``root`` and ``ckdir`` through
    :class:`TieredModelParallelStrategy` and ``ModelCheckpoint`` (every ``every`` steps, top 2,
    last), without them Lightning's ``ModelParallelStrategy`` and no checkpoints; optional
    ``ckpt_path``, ``hang_at`` (sleep there until killed), ``report``."""
    if args.get("hang_at") is not None:
        os.environ["LIGHTNING_RUN_HANG_AT"] = str(args["hang_at"])
    else:
        os.environ.pop("LIGHTNING_RUN_HANG_AT", None)
    kw = {"data_parallel_size": WORLD, "tensor_parallel_size": 1}
    callbacks: list[Any] = [LossLog(args["losses"])]
    if args.get("root"):
        strategy: ModelParallelStrategy = TieredModelParallelStrategy(args["root"], **kw)
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
    else:
        strategy = ModelParallelStrategy(**kw)
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
        ShardedTiny(args["seed"]),
        train_dataloaders=data(world=WORLD),
        ckpt_path=args.get("ckpt_path"),
    )
    if trainer.global_rank == 0 and args.get("report"):
        Path(args["report"]).write_text(json.dumps({"ckpt_path": trainer.ckpt_path}))
    return trainer


if __name__ == "__main__":
    for one in json.loads(sys.argv[1]):
        run(one)
