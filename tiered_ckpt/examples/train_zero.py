"""A tiny byte-level GPT trained with a flat-partition ZeRO-1 AdamW and checkpointed by tiered_ckpt.

Run (4 ranks, gloo on CPU)::

    python -m torch.distributed.run --nproc_per_node=4 examples/train_zero.py \
        --steps 60 --ckpt-every 10 --root /tmp/ckpt --seed 0 --loss-log /tmp/loss.jsonl

Run it again with the same arguments after a crash and it resumes from the newest step committed in
every rank's root; the loss curve continues exactly as if it had never stopped. ``--resume-step N``
rolls back: it resumes from committed step ``N`` instead (failing with ``NoCheckpointError`` when
``N`` is not committed and current), and its first save starts a new attempt of the run's lineage
that supersedes the steps after ``N`` (SPEC §11), as in ``train_fsdp2``.

Data: the Python standard library's own ``.py`` sources (sorted file list, the first
``--data-bytes`` bytes), cut into windows of ``seq_len + 1`` bytes; the order of windows is
:class:`tiered_ckpt.data.ShuffledBatchSampler` (seeded per epoch), so the data position is two
integers.

ZeRO-1: all parameters live as views in one flat fp32 buffer of ``N`` elements (padded to a multiple
of the world size). Rank ``r`` owns ``[r*c, min((r+1)*c, N))`` with ``c = ceil(N / world)``: it
keeps the fp32 master copy and the AdamW moments of that slice only. Per step: backward, flat
gradient, a reduce-scatter (gloo supports it in torch 2.13: no all-reduce fallback needed) divided
by the world size, global-norm clipping (one all-reduce), AdamW on the local slice, an all-gather of
the parameters. The checkpoint stores master and moments as :class:`tiered_ckpt.GlobalSlice` of the
global ``(N,)`` vectors, so ``param_shard_offset/numel`` in the manifest are the real partition;
the manifest's ``extra.param_layout`` names the parameters in that vector (their names and shapes,
in order), so ``tiered-ckpt export --hf`` writes any step as a Hugging Face checkpoint.
What every rank holds alike (the Adam step, the step counter, the data position, the loss history)
is claimed :class:`tiered_ckpt.Replicated` for the data-parallel group (here the whole job; the save
checks the claim), and the RNG streams stay per rank: ``tiered-ckpt reshard --preset training``
rewrites a checkpoint for another world size.

Determinism: one intra-op thread per rank, fixed collective algorithms, dropout from the per-rank
torch CPU RNG (checkpointed), data order a function of ``(seed, epoch)``; a resumed run takes
exactly the same floating-point path as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tiered_ckpt import GlobalSlice, NoCheckpointError, Replicated
from tiered_ckpt.data import DataPosition, ShuffledBatchSampler
from tiered_ckpt.export.step_tensors import PARAM_LAYOUT_KEY
from tiered_ckpt.torch import (
    capture_training_state,
    numpy_to_tensor,
    restore_rng_state,
    tensor_to_numpy,
)
from tiered_ckpt.training import CheckpointManager, JobEventLog

log = logging.getLogger("train_zero")

# torch 2.13 renamed the flat collectives (the old names warn); older releases only have the old
# names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --- model


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 64
    dropout: float = 0.1


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.n_heads = c.n_heads
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, D) float32
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(a))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    """Byte-level GPT: ``forward(idx int64 (B, T)) -> logits float32 (B, T, 256)``."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


# --- data


def load_corpus(n_bytes: int) -> np.ndarray:
    """The first ``n_bytes`` of the stdlib's top-level ``.py`` files, sorted by name (uint8)."""
    d = os.path.dirname(os.__file__)
    out = bytearray()
    for name in sorted(f for f in os.listdir(d) if f.endswith(".py")):
        with open(os.path.join(d, name), "rb") as f:
            out += f.read()
        if len(out) >= n_bytes:
            break
    return np.frombuffer(bytes(out[:n_bytes]), dtype=np.uint8)


# --- ZeRO


class FlatZero1:
    """Flat-partition ZeRO-1 AdamW over ``model``'s parameters (see the module docstring).

    Tensors: ``flat`` float32 ``(padded,)`` holding every parameter (params are views into it);
    ``master``, ``exp_avg``, ``exp_avg_sq``, ``decay`` float32 ``(chunk,)`` for this rank's slice.
    """

    def __init__(
        self,
        model: nn.Module,
        rank: int,
        world: int,
        *,
        lr: float,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        clip=1.0,
    ) -> None:
        self.rank, self.world = rank, world
        self.params = [p for p in model.parameters()]
        self.numel = sum(p.numel() for p in self.params)
        self.chunk = -(-self.numel // world)
        self.flat = torch.zeros(self.chunk * world)
        decay_full = torch.zeros(self.chunk * world)
        off = 0
        for p in self.params:
            n = p.numel()
            self.flat[off : off + n].copy_(p.detach().reshape(-1))
            p.data = self.flat[off : off + n].view_as(p)
            if p.dim() >= 2:
                decay_full[off : off + n] = 1.0
            off += n
        self.lo = rank * self.chunk
        self.valid = max(
            0, min(self.numel, self.lo + self.chunk) - self.lo
        )  # unpadded part of the slice
        self.master = self.flat[self.lo : self.lo + self.chunk].clone()
        self.decay = decay_full[self.lo : self.lo + self.chunk].clone()
        self.exp_avg = torch.zeros(self.chunk)
        self.exp_avg_sq = torch.zeros(self.chunk)
        self.t = 0
        self.lr, self.betas, self.eps, self.wd, self.clip = lr, betas, eps, weight_decay, clip
        self._gflat = torch.zeros(self.chunk * world)
        self._gslice = torch.zeros(self.chunk)

    def step(self, lr: float) -> float:
        """Reduce-scatter gradients, clip, AdamW on the local slice, all-gather. Returns the grad
        norm."""
        off = 0
        for p in self.params:
            n = p.numel()
            self._gflat[off : off + n].copy_(p.grad.reshape(-1))
            p.grad = None
            off += n
        _reduce_scatter(self._gslice, self._gflat, op=dist.ReduceOp.SUM)
        g = self._gslice.div_(self.world)
        sq = (g * g).sum().reshape(1)
        dist.all_reduce(sq)
        norm = float(sq.sqrt())
        if norm > self.clip:
            g.mul_(self.clip / (norm + 1e-6))
        self.t += 1
        b1, b2 = self.betas
        self.master.mul_(1.0 - lr * self.wd * self.decay)
        self.exp_avg.mul_(b1).add_(g, alpha=1.0 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(1.0 - b2**self.t)).add_(self.eps)
        self.master.addcdiv_(self.exp_avg, denom, value=-lr / (1.0 - b1**self.t))
        _all_gather(self.flat, self.master)
        return norm

    def state(self) -> dict:
        """This rank's optimizer state as GlobalSlices of the global ``(numel,)`` vectors
        (aliasing); the Adam step, the same on every rank, Replicated."""

        def gs(t: torch.Tensor) -> GlobalSlice:
            return GlobalSlice(
                tensor_to_numpy(t[: self.valid]), (self.numel,), (self.lo if self.valid else 0,)
            )

        return {
            "master": gs(self.master),
            "exp_avg": gs(self.exp_avg),
            "exp_avg_sq": gs(self.exp_avg_sq),
            "adam_step": Replicated(self.t),
        }

    def params_sha256(self) -> str:
        """sha256 (hex) of the model's parameters: the flat float32 vector's first ``numel``
        elements."""
        return hashlib.sha256(tensor_to_numpy(self.flat[: self.numel]).tobytes()).hexdigest()

    def load(self, st: dict) -> None:
        """Inverse of :meth:`state`, then all-gather so every rank's parameters are rebuilt."""
        for name in ("master", "exp_avg", "exp_avg_sq"):
            a = numpy_to_tensor(np.asarray(st[name]))
            if a.numel() != self.valid:
                raise ValueError(
                    f"{name}: checkpoint slice has {a.numel()} elements, expected {self.valid}"
                )
            getattr(self, name)[: self.valid].copy_(a)
        self.t = int(st["adam_step"])
        _all_gather(self.flat, self.master)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10% of ``peak`` at ``total``."""
    if step <= warmup:
        return peak * step / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


# --- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--steps", type=int, default=60, help="total training steps (the LR schedule's length)"
    )
    p.add_argument(
        "--stop-at", type=int, default=None, help="stop cleanly after this step (final save)"
    )
    p.add_argument("--ckpt-every", type=int, default=10, help="save every N steps")
    p.add_argument("--root", default="ckpt_train_zero", help="checkpoint directory (this node's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--loss-log", default=None, help="rank 0 appends {step, loss, lr} JSON lines here"
    )
    p.add_argument(
        "--events-log",
        default=None,
        help="rank 0 appends JSON-line events here: each save's outcome (step, seconds, error) and "
        "the step it resumed from (tiered_ckpt.training.events)",
    )
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--sync-save", action="store_true", help="save synchronously (default: async)")
    p.add_argument(
        "--sleep-per-step", type=float, default=0.0, help="seconds to sleep per step (tests)"
    )
    p.add_argument("--data-bytes", type=int, default=65536)
    p.add_argument("--batch-per-rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--handle-sigterm", action="store_true", help="final save on SIGTERM, then exit")
    p.add_argument(
        "--no-resume", action="store_true", help="start fresh even if a checkpoint exists"
    )
    p.add_argument(
        "--resume-step",
        type=int,
        default=None,
        help="resume from this committed step instead of the newest (a rollback: the saves after "
        "it start a new attempt that supersedes the newer steps)",
    )
    p.add_argument(
        "--remote-url",
        default=None,
        help="s3://bucket/prefix the upload sidecar writes to: a resume restores from it what this "
        "node's root lacks (a replaced node, a lost cluster); S3 settings from boto3's chain "
        "(AWS_ENDPOINT_URL, ...)",
    )
    p.add_argument(
        "--upload-gated",
        action="store_true",
        help="rotation deletes a local step only once the sidecar has uploaded it",
    )
    args = p.parse_args(argv)
    if args.resume_step is not None and (args.no_resume or args.resume_step < 1):
        p.error("--resume-step takes a step >= 1 and excludes --no-resume")
    return args


def _init_dist() -> tuple[int, int]:
    if "RANK" not in os.environ:  # plain `python train_zero.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _resume(
    mgr: CheckpointManager, opt: FlatZero1, sampler: ShuffledBatchSampler, step: int | None = None
) -> tuple[int, list[float]]:
    """Load ``step`` (``None``: the newest step committed in every rank's root) into ``opt``,
    ``sampler`` and the RNGs (a rank that a reshard to more ranks added has none: its streams stay
    seeded as at a fresh start). Returns ``(step, loss_history)``; ``(0, [])`` when nothing is
    committed (a fresh start). A ``step`` asked for that is not committed raises
    ``NoCheckpointError``."""
    try:
        st = mgr.load(step)
    except NoCheckpointError:
        if step is not None:  # a rollback to a step that is not there is no fresh start
            raise
        return 0, []
    opt.load(st["zero"])
    prog = st["progress"]
    sampler.seek(DataPosition.from_json(prog["data"]))
    if "rng" in st:
        restore_rng_state(st["rng"])
    return int(prog["step"]), list(prog["loss_history"])


def main(argv: list[str] | None = None) -> int:
    """Train (resuming from the newest checkpoint under ``--root``, or ``--resume-step``, unless
    ``--no-resume``). Returns 0."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = _init_dist()
    cfg = ModelConfig()
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = TinyGPT(cfg)
    opt = FlatZero1(model, rank, world, lr=args.lr)
    # the parameters' names in the flat vector, for `tiered-ckpt export --hf` of any step
    layout = {
        "tensor": "zero.master",
        "params": [[name, list(p.shape)] for name, p in model.named_parameters()],
    }
    # Per-rank streams (dropout): seeded apart, checkpointed per rank.
    torch.manual_seed(args.seed * 1000 + 1 + rank)
    random.seed(args.seed * 1000 + 1 + rank)
    np.random.seed(args.seed * 1000 + 1 + rank)

    data = load_corpus(args.data_bytes)
    window = cfg.seq_len + 1
    windows = torch.from_numpy(
        data[: len(data) // window * window].astype(np.int64).reshape(-1, window)
    )
    sampler = ShuffledBatchSampler(len(windows), args.batch_per_rank * world, seed=args.seed)

    events = JobEventLog(args.events_log) if (args.events_log and rank == 0) else None
    mgr = CheckpointManager(
        args.root,
        rank=rank,
        world_size=world,
        save_every_steps=args.ckpt_every,
        keep_last=args.keep_last,
        async_save=not args.sync_save,
        remote_url=args.remote_url,
        upload_gated=args.upload_gated or None,  # None: gated when a remote is set
        collective_timeout_s=120.0,
        handle_sigterm=args.handle_sigterm,
        on_save_outcome=events.save if events is not None else None,
    )
    step, history = (0, []) if args.no_resume else _resume(mgr, opt, sampler, args.resume_step)
    if step and rank == 0:
        print(f"resumed from step {step} (parameters sha256 {opt.params_sha256()})", flush=True)
        if events is not None:
            events.resumed(step)
    stop_at = min(args.stop_at or args.steps, args.steps)
    log_f = open(args.loss_log, "a") if (args.loss_log and rank == 0) else None
    try:
        model.train()
        while step < stop_at:
            step += 1
            ids = ShuffledBatchSampler.rank_slice(sampler.next_batch(), rank, world)
            batch = windows[ids]
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), batch[:, 1:].reshape(-1))
            loss.backward()
            lr = lr_at(step, args.steps, args.lr, args.warmup)
            opt.step(lr)
            mean = loss.detach().reshape(1).clone()
            dist.all_reduce(mean)
            value = float(mean.item()) / world
            history.append(value)
            if log_f is not None:
                log_f.write(json.dumps({"step": step, "loss": value, "lr": lr}) + "\n")
                log_f.flush()
            due = mgr.should_save(step) or step == stop_at
            if due:  # the whole job is the data-parallel group: what every rank holds alike is Replicated
                state = {
                    "zero": opt.state(),
                    **capture_training_state(
                        progress={
                            "step": step,
                            "data": sampler.position.to_json(),
                            "loss_history": history,
                        },
                        replicated_group=dist.group.WORLD,
                    ),
                }
                mgr.save(step, state, extra={"loss": value, "lr": lr, PARAM_LAYOUT_KEY: layout})
            if mgr.preempted:
                break
            if args.sleep_per_step:
                time.sleep(args.sleep_per_step)
        mgr.close()
    finally:
        if log_f is not None:
            log_f.close()
        if events is not None:
            events.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if (
    __name__ == "__main__"
):  # a script configures logging; main() may be called from a program that does
    logging.basicConfig(
        level=os.environ.get("TRAIN_ZERO_LOG", "WARNING"),
        format=f"%(asctime)s r{os.environ.get('RANK', '0')} %(name)s %(levelname)s %(message)s",
    )
    sys.exit(main())
