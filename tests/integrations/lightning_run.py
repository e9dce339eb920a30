"""A tiny Lightning run through the tiers, shared by the in-process tests and the DDP drill's rank
processes (``python lightning_run.py '<json args, or a list of them: one fit after the other>'``,
one process per rank with the torchrun environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``).

The model (4 -> 8 -> 1 MLP, Adam, a step LR schedule) starts from ``seed``'s values; the data (32
fixed samples, no shuffle) is the same for every run, so two runs from the same state give the same
losses bit for bit. Each rank appends ``{"step": global_step, "loss": float}`` lines to
``<losses>.rank<r>``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tiered_ckpt.integrations.lightning import AsyncTieredCheckpointIO, TieredCheckpointIO


class Tiny(pl.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=1e-2, betas=(0.8, 0.99))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(batch_size: int = 4, world: int = 1) -> DataLoader:
    """32 fixed samples; with ``world`` ranks each reads its own sequential half (a
    ``DistributedSampler`` without shuffling: the order does not depend on the epoch, see the
    README's note on Lightning's epoch counter after a second resume)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(32, 4, generator=g)
    y = (x.sum(dim=1, keepdim=True) * 0.3).tanh()
    ds = TensorDataset(x, y)
    if world == 1:
        return DataLoader(ds, batch_size=batch_size, shuffle=False)
    rank = int(os.environ["RANK"])
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
    return DataLoader(ds, batch_size=batch_size, sampler=sampler)


class LossLog(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int):
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as f:
            f.write(
                json.dumps({"step": trainer.global_step, "loss": outputs["loss"].item()}) + "\n"
            )
        stop_at = os.environ.get("LIGHTNING_RUN_HANG_AT")
        if stop_at and trainer.global_step == int(stop_at):  # the drill SIGKILLs us here
            Path(f"{self.path}.hung").touch()
            import time

            time.sleep(600)


def run(args: dict[str, Any]) -> pl.Trainer:
    """One ``fit``: ``root``, ``ckdir``, ``losses``, ``max_steps``, ``seed``; optional
    ``ckpt_path``, ``async_save``, ``remote_url`` (+ ``endpoint_url``), ``restore``, ``every``,
    ``devices``, ``batch_size`` (4), ``hang_at`` (sleep at that step until killed),
    ``checkpointing`` (false: no plugin, no ModelCheckpoint), ``plugin`` (false: ModelCheckpoint
    with Lightning's own ``torch.save`` files, for comparison)."""
    if args.get("hang_at") is not None:
        os.environ["LIGHTNING_RUN_HANG_AT"] = str(args["hang_at"])
    else:
        os.environ.pop("LIGHTNING_RUN_HANG_AT", None)
    plugins, callbacks = [], [LossLog(args["losses"])]
    if args.get("checkpointing", True):
        s3_client = None
        if args.get("endpoint_url"):
            import s3_infra

            s3_client = s3_infra.make_test_client(args["endpoint_url"])
        cls = AsyncTieredCheckpointIO if args.get("async_save") else TieredCheckpointIO
        io = cls(args["root"], remote_url=args.get("remote_url"), s3_client=s3_client)
        if args.get("restore"):
            io.restore(args["ckdir"])
        if args.get("plugin", True):  # False: Lightning's own torch.save files, for comparison
            plugins.append(io)
        callbacks.append(
            ModelCheckpoint(
                dirpath=args["ckdir"],
                every_n_train_steps=args.get("every", 2),
                save_top_k=2,
                monitor="step",  # the newest two, through the top-k bookkeeping
                mode="max",
                save_last=True,
            )
        )
    devices = args.get("devices", 1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=args["max_steps"],
        plugins=plugins,
        callbacks=callbacks,
        enable_checkpointing=args.get("checkpointing", True),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
        use_distributed_sampler=False,
    )
    trainer.fit(
        Tiny(args["seed"]),
        train_dataloaders=data(batch_size=args.get("batch_size", 4), world=devices),
        ckpt_path=args.get("ckpt_path"),
    )
    if trainer.global_rank == 0 and args.get("report"):
        Path(args["report"]).write_text(json.dumps({"ckpt_path": trainer.ckpt_path}))
    return trainer


def read_losses(path: str | Path, rank: int = 0) -> dict[int, float]:
    """``global_step -> loss`` of the last run that logged each step."""
    out: dict[int, float] = {}
    for line in Path(f"{path}.rank{rank}").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


if __name__ == "__main__":
    runs = json.loads(sys.argv[1])
    for one in runs if isinstance(runs, list) else [runs]:
        run(one)
