"""train_zero's byte-level GPT under FSDP2, checkpointed through DCP into the tiers
(tiered_ckpt.dcp).

Run (4 ranks, gloo on CPU)::

    python -m torch.distributed.run --nproc_per_node=4 -m tiered_ckpt.examples.train_fsdp2 \
        --steps 40 --ckpt-every 5 --root /tmp/ckpt_fsdp2 --seed 0 --loss-log /tmp/loss.jsonl

(or one ``python .../train_fsdp2.py`` process per rank with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set). Run it again with the same arguments after a crash and it
resumes from the newest step committed under ``--root`` (with ``--remote-url``, restored from the
bucket first when the local tier lost it); the loss curve continues exactly as if it had never
stopped. Run it at another world size (same global batch: ``--batch-per-rank`` times the world size)
and DCP reshards the checkpoint while loading it. Its checkpointing flags are ``train_zero``'s
(``--ckpt-every``, ``--keep-last``, ``--sync-save``, ``--upload-gated``, ``--remote-url``,
``--events-log``, ``--handle-sigterm``: on SIGTERM the next step's save is synchronous, then the run
ends and exits 0), so ``tiered-ckpt demo --model fsdp2`` drives it as it drives ``train_zero``.
``--root`` may be node-local (each node its own directory): every node's root is committed.
``--resume-step N`` rolls back: it resumes from committed step ``N`` (local, or restored from the
bucket) instead of the newest, and fails (``NoCheckpointError``) when ``N`` is not committed and
current; the first save after it starts a new attempt of the run's lineage that supersedes the steps
after ``N`` (set aside locally under ``superseded/``, superseded in the bucket's ``run.json``), so
the saves of steps after ``N`` that follow are the new attempt's (SPEC §11).

Model, data, schedule: ``TinyGPT``, ``load_corpus`` and ``lr_at`` of ``train_zero`` (imported, not
copied); dropout from each rank's own torch CPU RNG (seeded apart); data order from
:class:`tiered_ckpt.data.ShuffledBatchSampler`. FSDP2: ``fully_shard`` on every block, then on the
root (its parameters become ``DTensor`` s sharded on dim 0); AdamW with weight decay on matrices
only, global gradient-norm clipping at 1.0.

The checkpoint of step ``S`` is a DCP state dict::

    {"model":    get_state_dict(model, optimizer)[0],      # DTensors: each rank writes its shards
     "optim":    get_state_dict(model, optimizer)[1],      # Adam moments (DTensors), steps, param groups
     "progress": {"step": S, "data": {"epoch": e, "batch_in_epoch": b}},   # JSON, the same on every rank
     "rng":      ["<rank 0's streams as JSON>", ...]}      # every rank's RNG streams, one JSON string each

checkpointed through :class:`tiered_ckpt.dcp.DCPCheckpointManager` (the README's pattern): the
manager is made on every rank, ``mgr.load(into=state)`` on start, ``mgr.save(step, state)`` when
``mgr.should_save(step)`` (every ``--ckpt-every`` steps) and at the stop step. The saves are DCP's
``async_save`` (thread mode on the manager's own gloo group, so the save's collectives never
interleave with FSDP's; ``--sync-save``: ``dcp.save``); the next save first waits for the previous
one; rotation (``--keep-last``, ``--upload-gated``) runs at each commit. ``--events-log``: rank 0
appends each save's :class:`~tiered_ckpt.training.SaveOutcome` and the step it resumed from
(:class:`tiered_ckpt.training.JobEventLog`, as ``train_zero`` does). The RNG streams are those of
:func:`tiered_ckpt.training.torch_rng.capture_rng_state` (as ``train_zero`` saves them) as JSON
(arrays as lists, the torch CPU state in base64), gathered from every rank before each save (an
all-gather of bytes, no pickle) into one list, the same on every rank, so DCP stores it once and a
load at any world size reads the same item: rank ``r`` restores entry ``r``; a rank beyond the saved
world (a larger world) keeps its fresh seeding. On load the template state is applied with
``set_state_dict``, the sampler's position and the RNG streams.

Determinism: one intra-op thread, gloo's fixed collective algorithms, the RNG streams and data
position restored: a resumed run takes the floating-point path of the uninterrupted one.
``--dump-loaded`` / ``--dump-final`` write every global tensor (``full_tensor()`` of the parameters
and both Adam moments) to a safetensors file on rank 0, after the load and at the end (for tests).
"""

from __future__ import annotations

import argparse
import base64
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
from tiered_ckpt.data import DataPosition, ShuffledBatchSampler
from tiered_ckpt.dcp import DCPCheckpointManager
from tiered_ckpt.examples.train_zero import ModelConfig, TinyGPT, _init_dist, load_corpus, lr_at
from tiered_ckpt.torch import capture_rng_state, restore_rng_state
from tiered_ckpt.training import JobEventLog

log = logging.getLogger("train_fsdp2")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--steps", type=int, default=40, help="total training steps (the LR schedule's length)"
    )
    p.add_argument(
        "--stop-at", type=int, default=None, help="stop cleanly after this step (final save)"
    )
    p.add_argument("--ckpt-every", type=int, default=5, help="save every N steps")
    p.add_argument("--root", default="ckpt_train_fsdp2", help="checkpoint directory (this node's)")
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
    p.add_argument("--handle-sigterm", action="store_true", help="final save on SIGTERM, then exit")
    p.add_argument(
        "--sync-save", action="store_true", help="save synchronously (dcp.save; default: async)"
    )
    p.add_argument(
        "--sleep-per-step", type=float, default=0.0, help="seconds to sleep per step (tests)"
    )
    p.add_argument("--data-bytes", type=int, default=32768)
    p.add_argument("--batch-per-rank", type=int, default=4)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
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
        help="s3://bucket/prefix the upload sidecar writes to: a resume restores from it a step the "
        "local tier lacks (a lost cluster); S3 settings from boto3's chain (AWS_ENDPOINT_URL, ...)",
    )
    p.add_argument(
        "--upload-gated",
        action="store_true",
        help="rotation deletes a local step only once the sidecar has uploaded it",
    )
    p.add_argument(
        "--dump-loaded", default=None, help="rank 0 writes the global tensors after the load here"
    )
    p.add_argument(
        "--dump-final", default=None, help="rank 0 writes the global tensors at the end here"
    )
    args = p.parse_args(argv)
    if args.resume_step is not None and (args.no_resume or args.resume_step < 1):
        p.error("--resume-step takes a step >= 1 and excludes --no-resume")
    return args


def build(
    cfg: ModelConfig, args: argparse.Namespace
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (same initial weights on every rank), sharded by ``fully_shard``, and its AdamW."""
    torch.manual_seed(args.seed)
    model = TinyGPT(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    return model, opt


# --- the state


def rng_to_json(state: dict[str, Any]) -> str:
    """:func:`capture_rng_state`'s result as one JSON string: the Python and NumPy key arrays as
    lists of ints, the torch CPU state (uint8) in base64."""
    py, npy = state["python"], state["numpy"]
    return json.dumps(
        {
            "python": {**py, "state": py["state"].tolist()},
            "numpy": {**npy, "keys": npy["keys"].tolist()},
            "torch_cpu": base64.b64encode(state["torch_cpu"].tobytes()).decode("ascii"),
        }
    )


def rng_from_json(text: str) -> dict[str, Any]:
    """Inverse of :func:`rng_to_json` (what :func:`restore_rng_state` takes)."""
    saved = json.loads(text)
    return {
        "python": saved["python"],
        "numpy": saved["numpy"],
        "torch_cpu": np.frombuffer(base64.b64decode(saved["torch_cpu"]), dtype=np.uint8).copy(),
    }


def all_gather_text(text: str, world: int) -> list[str]:
    """Every rank's ``text``, in rank order (a collective: two all-gathers of uint8 tensors, no
    pickle)."""
    mine = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    n = torch.tensor([mine.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    buf = torch.zeros(int(max(sizes)), dtype=torch.uint8)
    buf[: mine.numel()] = mine
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [bytes(b[: int(k)].numpy()).decode() for b, k in zip(bufs, sizes)]


def dcp_state(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    position: DataPosition,
    rng: list[str],
) -> dict[str, Any]:
    """The DCP state dict of the module docstring (model and optimizer tensors alias the live
    ones)."""
    msd, osd = get_state_dict(model, opt)
    return {
        "model": msd,
        "optim": osd,
        "progress": {"step": step, "data": position.to_json()},
        "rng": rng,
    }


def resume(
    mgr: DCPCheckpointManager,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sampler: ShuffledBatchSampler,
    rank: int,
    step: int | None = None,
) -> int:
    """``mgr.load(step, into=...)`` of ``step`` (``None``: the newest; restored from the bucket
    first if only it has it) into the model, the optimizer, the sampler and the RNG streams; returns
    the step (0: nothing to load, a fresh start, and nothing is touched). A ``step`` asked for that
    is not committed raises ``NoCheckpointError``."""
    # get_state_dict of a fresh optimizer initializes its state (an AdamW step with zero gradients
    # and lr 0: the parameters stay as they are, the step count becomes 1); the load overwrites all
    # of it, and a fresh start drops it again, so that its first real step is step 1.
    state = dcp_state(model, opt, 0, DataPosition(), [])
    try:
        mgr.load(step, into=state)
    except tc.NoCheckpointError:
        if step is not None:  # a rollback to a step that is not there is no fresh start
            raise
        opt.state.clear()
        return 0
    step = mgr.loaded_step
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if int(state["progress"]["step"]) != step:
        raise tc.CheckpointError(
            f"step {step}: its progress record says step {state['progress']['step']}"
        )
    sampler.seek(DataPosition.from_json(state["progress"]["data"]))
    if rank < len(
        state["rng"]
    ):  # every saved rank stored its own streams; a new rank keeps its seeding
        restore_rng_state(rng_from_json(state["rng"][rank]))
    return step


def dump_global(
    model: torch.nn.Module, opt: torch.optim.Optimizer, path: str | None, rank: int
) -> None:
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


# --- main


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, lr: float, world: int
) -> float:
    """One optimizer step on this rank's ``batch`` (int64 ``(B, T+1)``); returns the mean loss of
    all ranks."""
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
    """Train (resuming from the newest checkpoint under ``--root``, or ``--resume-step``, unless
    ``--no-resume``). Returns 0."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank, world = _init_dist()
    cfg = ModelConfig(d_model=args.d_model, n_layers=args.n_layers, seq_len=args.seq_len)
    model, opt = build(cfg, args)
    torch.manual_seed(
        args.seed * 1000 + 1 + rank
    )  # per-rank streams (dropout), checkpointed per rank
    random.seed(args.seed * 1000 + 1 + rank)
    np.random.seed(args.seed * 1000 + 1 + rank)

    data = load_corpus(args.data_bytes)
    window = cfg.seq_len + 1
    windows = torch.from_numpy(
        data[: len(data) // window * window].astype(np.int64).reshape(-1, window)
    )
    sampler = ShuffledBatchSampler(len(windows), args.batch_per_rank * world, seed=args.seed)
    events = JobEventLog(args.events_log) if (args.events_log and rank == 0) else None
    mgr = DCPCheckpointManager(
        args.root,
        save_every_steps=args.ckpt_every,
        keep_last=args.keep_last,
        upload_gated=args.upload_gated or None,  # None: gated when a remote is set
        remote_url=args.remote_url,
        async_save=not args.sync_save,
        collective_timeout_s=120.0,
        handle_sigterm=args.handle_sigterm,
        on_save_outcome=events.save if events is not None else None,
    )
    step = 0 if args.no_resume else resume(mgr, model, opt, sampler, rank, args.resume_step)
    if step:
        dump_global(model, opt, args.dump_loaded, rank)
        if rank == 0:
            print(f"resumed from step {step}", flush=True)
            if events is not None:
                events.resumed(step)
    stop_at = min(args.stop_at or args.steps, args.steps)
    log_f = open(args.loss_log, "a") if (args.loss_log and rank == 0) else None
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
            if (
                mgr.should_save(step) or step == stop_at
            ):  # async: returns once DCP has staged the state
                rng = all_gather_text(rng_to_json(capture_rng_state()), world)
                mgr.save(
                    step,
                    dcp_state(model, opt, step, sampler.position, rng),
                    extra={"loss": value, "lr": lr},
                )
            if mgr.preempted:  # SIGTERM: that save was synchronous and is committed
                break
            if args.sleep_per_step:
                time.sleep(args.sleep_per_step)
        mgr.close()  # waits for the last save, raises its failure
        dump_global(model, opt, args.dump_final, rank)
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
        level=os.environ.get("TRAIN_FSDP2_LOG", "WARNING"),
        format=f"%(asctime)s r{os.environ.get('RANK', '0')} %(name)s %(levelname)s %(message)s",
    )
    sys.exit(main())
