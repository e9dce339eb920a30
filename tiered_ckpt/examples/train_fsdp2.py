"""The byte-level GPT of :mod:`tiered_ckpt.examples.train_zero` under FSDP2, checkpointed through
``torch.distributed.checkpoint`` (DCP) into the local tier by :mod:`tiered_ckpt.dcp`.

Run (4 ranks, gloo on CPU)::

    python -m torch.distributed.run --nproc_per_node=4 -m tiered_ckpt.examples.train_fsdp2 \
        --steps 40 --ckpt-every 5 --root /tmp/ckpt_fsdp2 --seed 0 --loss-log /tmp/loss.jsonl

(or one ``python .../train_fsdp2.py`` process per rank with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set). Run it again with the same arguments after a crash and it resumes from the newest
step committed under ``--root``; the loss curve continues exactly as if it had never stopped. Run it at
another world size (same global batch: ``--batch-per-rank`` times the world size) and DCP reshards the
checkpoint while loading it.

Model, data, schedule: ``TinyGPT``, ``load_corpus`` and ``lr_at`` of ``train_zero`` (imported, not
copied); dropout from each rank's own torch CPU RNG (seeded apart); data order from
:class:`tiered_ckpt.data.ShuffledBatchSampler`. FSDP2: ``fully_shard`` on every block, then on the root
(its parameters become ``DTensor`` s sharded on dim 0); AdamW with weight decay on matrices only, global
gradient-norm clipping at 1.0.

The checkpoint of step ``S`` is a DCP state dict::

    {"model":    get_state_dict(model, optimizer)[0],      # DTensors: each rank writes its shards
     "optim":    get_state_dict(model, optimizer)[1],      # Adam moments (DTensors), steps, param groups
     "progress": {"step": S, "data": {"epoch": e, "batch_in_epoch": b}},   # JSON, the same on every rank
     "rng":      {"rank<r>": {...}}}                       # this rank's RNG streams (JSON + raw bytes)

saved with ``tiered_ckpt.dcp.async_save`` (DCP's thread mode, on a gloo process group of its own, so the
save's collectives never interleave with FSDP's) every ``--ckpt-every`` steps and at the stop step; the
next save first waits for the previous one. The RNG streams are those of
:func:`tiered_ckpt.training.torch_rng.capture_rng_state` (as ``train_zero`` saves them), with arrays
turned into JSON lists and the torch CPU state into raw ``bytes`` (the values our planners store).
On start, rank 0 finds the newest committed step (``tiered_ckpt.latest_step``), every rank loads it
with ``tiered_ckpt.dcp.load`` into a template state and applies it with ``set_state_dict``, the
sampler's position and the RNG streams. A rank with no RNG entry in the checkpoint (a world larger than
the saved one) keeps its fresh seeding.

Determinism: one intra-op thread, gloo's fixed collective algorithms, the RNG streams and data position
restored: a resumed run takes the floating-point path of the uninterrupted one. ``--dump-loaded`` /
``--dump-final`` write every global tensor (``full_tensor()`` of the parameters and both Adam moments)
to a safetensors file on rank 0, after the load and at the end (for tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import tiered_ckpt as tc
from tiered_ckpt import dcp as tdcp
from tiered_ckpt.data import DataPosition, ShuffledBatchSampler
from tiered_ckpt.examples.train_zero import ModelConfig, TinyGPT, _init_dist, load_corpus, lr_at
from tiered_ckpt.torch import capture_rng_state, restore_rng_state

log = logging.getLogger("train_fsdp2")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="total training steps (the LR schedule's length)")
    p.add_argument("--stop-at", type=int, default=None, help="stop cleanly after this step (final save)")
    p.add_argument("--ckpt-every", type=int, default=5, help="save every N steps")
    p.add_argument("--root", default="ckpt_train_fsdp2", help="checkpoint directory (this node's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-log", default=None, help="rank 0 appends {step, loss, lr} JSON lines here")
    p.add_argument("--sleep-per-step", type=float, default=0.0, help="seconds to sleep per step (tests)")
    p.add_argument("--data-bytes", type=int, default=32768)
    p.add_argument("--batch-per-rank", type=int, default=4)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-resume", action="store_true", help="start fresh even if a checkpoint exists")
    p.add_argument("--dump-loaded", default=None, help="rank 0 writes the global tensors after the load here")
    p.add_argument("--dump-final", default=None, help="rank 0 writes the global tensors at the end here")
    return p.parse_args(argv)


def build(cfg: ModelConfig, args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (same initial weights on every rank), sharded by ``fully_shard``, and its AdamW."""
    torch.manual_seed(args.seed)
    model = TinyGPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    return model, opt


# ---------------------------------------------------------------------------------------- the state


def rng_to_dcp(state: dict[str, Any]) -> dict[str, Any]:
    """:func:`capture_rng_state`'s result as values a DCP state of our planners holds: the Python and
    NumPy key arrays as JSON lists of ints, the torch CPU state (uint8) as raw ``bytes``."""
    py, npy = state["python"], state["numpy"]
    return {"python": {**py, "state": py["state"].tolist()}, "numpy": {**npy, "keys": npy["keys"].tolist()},
            "torch_cpu": state["torch_cpu"].tobytes()}


def rng_from_dcp(saved: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`rng_to_dcp` (what :func:`restore_rng_state` takes)."""
    return {"python": dict(saved["python"]), "numpy": dict(saved["numpy"]),
            "torch_cpu": np.frombuffer(saved["torch_cpu"], dtype=np.uint8).copy()}


def dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, position: DataPosition,
              rank: int) -> dict[str, Any]:
    """The DCP state dict of the module docstring (model and optimizer tensors alias the live ones)."""
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "progress": {"step": step, "data": position.to_json()},
            "rng": {f"rank{rank}": rng_to_dcp(capture_rng_state())}}


def resume(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer,
           sampler: ShuffledBatchSampler, rank: int) -> int:
    """Load the newest committed step under ``--root`` into the model, the optimizer, the sampler and the
    RNG streams; returns it (0 when nothing is committed: then nothing is touched)."""
    found = [0, 0]  # (step, its world size), rank 0's decision for every rank
    if rank == 0 and os.path.isdir(args.root):
        newest = tc.latest_step(args.root)
        if newest is not None:
            found = [newest, tc.read_manifest(args.root, newest).world_size]
    decision = torch.tensor(found, dtype=torch.int64)
    dist.broadcast(decision, src=0)
    step, saved_world = (int(x) for x in decision)
    if not step:
        return 0
    # get_state_dict of a fresh optimizer initializes its state (a step with zero grads and lr 0):
    # harmless here, the load overwrites all of it; a fresh start never calls it before step 1.
    state = dcp_state(model, opt, 0, DataPosition(), rank)
    if rank >= saved_world:  # every saved rank stored its own streams; a new rank keeps its seeding
        del state["rng"]
    loaded = tdcp.load(state, args.root, step)
    assert loaded == step, (loaded, step)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if int(state["progress"]["step"]) != step:
        raise tc.CheckpointError(f"step {step}: its progress record says step {state['progress']['step']}")
    sampler.seek(DataPosition.from_json(state["progress"]["data"]))
    if "rng" in state:
        restore_rng_state(rng_from_dcp(state["rng"][f"rank{rank}"]))
    return step


def dump_global(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str | None, rank: int) -> None:
    """Every global tensor (``full_tensor()``: a collective on every rank) into ``path`` on rank 0:
    ``param/<fqn>``, ``exp_avg/<fqn>``, ``exp_avg_sq/<fqn>`` (float32) and ``adam_step/<fqn>``."""
    if path is None:
        return
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = p.detach().full_tensor()
        st = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                out[f"{key}/{name}"] = st[key].full_tensor()
        if "step" in st:
            out[f"adam_step/{name}"] = st["step"].detach().reshape(1).clone()
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in out.items()}, path)


# -------------------------------------------------------------------------------------------- main


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, lr: float,
               world: int) -> float:
    """One optimizer step on this rank's ``batch`` (int64 ``(B, T+1)``); returns the mean loss of all ranks."""
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    mean = loss.detach().reshape(1).clone()
    dist.all_reduce(mean)
    return float(mean.item()) / world


def main(argv: list[str] | None = None) -> int:
    """Train (resuming from the newest checkpoint under ``--root`` unless ``--no-resume``). Returns 0."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = _init_dist()
    save_group = dist.new_group(backend="gloo")  # the async saves' own collectives
    cfg = ModelConfig(d_model=args.d_model, n_layers=args.n_layers, seq_len=args.seq_len)
    model, opt = build(cfg, args)
    torch.manual_seed(args.seed * 1000 + 1 + rank)  # per-rank streams (dropout), checkpointed per rank
    random.seed(args.seed * 1000 + 1 + rank)
    np.random.seed(args.seed * 1000 + 1 + rank)

    data = load_corpus(args.data_bytes)
    window = cfg.seq_len + 1
    windows = torch.from_numpy(data[: len(data) // window * window].astype(np.int64).reshape(-1, window))
    sampler = ShuffledBatchSampler(len(windows), args.batch_per_rank * world, seed=args.seed)
    step = 0 if args.no_resume else resume(args, model, opt, sampler, rank)
    if step:
        dump_global(model, opt, args.dump_loaded, rank)
        if rank == 0:
            print(f"resumed from step {step}", flush=True)
    stop_at = min(args.stop_at or args.steps, args.steps)
    log_f = open(args.loss_log, "a") if (args.loss_log and rank == 0) else None
    pending = None
    try:
        model.train()
        while step < stop_at:
            step += 1
            ids = ShuffledBatchSampler.rank_slice(sampler.next_batch(), rank, world)
            lr = lr_at(step, args.steps, args.lr, args.warmup)
            value = train_step(model, opt, windows[ids], lr, world)
            if log_f is not None:
                log_f.write(json.dumps({"step": step, "loss": value, "lr": lr}) + "\n")
                log_f.flush()
            if step % args.ckpt_every == 0 or step == stop_at:
                if pending is not None:
                    pending.result()  # one save in flight at a time
                pending = tdcp.async_save(dcp_state(model, opt, step, sampler.position, rank), args.root, step,
                                          process_group=save_group, extra={"loss": value, "lr": lr})
            if args.sleep_per_step:
                time.sleep(args.sleep_per_step)
        if pending is not None:
            pending.result()
        dump_global(model, opt, args.dump_final, rank)
    finally:
        if log_f is not None:
            log_f.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # a script configures logging; main() may be called from a program that does
    logging.basicConfig(level=os.environ.get("TRAIN_FSDP2_LOG", "WARNING"),
                        format=f"%(asctime)s r{os.environ.get('RANK', '0')} %(name)s %(levelname)s %(message)s")
    sys.exit(main())
