"""Capture and restore of a PyTorch training state as arrays + JSON (extra ``tiered-ckpt[torch]``).

The core package never imports torch; this module does. It turns a model, an optimizer (a plain
``torch.optim.Optimizer`` or the local partition of
``torch.distributed.optim.ZeroRedundancyOptimizer``), an LR scheduler, a ``GradScaler`` and the RNG
streams into a *state* (nested ``dict`` of ``str`` -> ``numpy.ndarray`` / JSON value) that
:class:`tiered_ckpt.CheckpointManager` or ``write_shard`` stores, and back. Nothing here pickles or
unpickles.

Layout of :func:`capture_training_state`'s result (absent parts are omitted)::

    {"model":     {param_or_buffer_name: ndarray},              # model.state_dict() order
     "optimizer": {"state": {param_name: {key: ndarray | JSON}},
                   "param_groups": [{"params": [param_name, ...], "lr": ..., ...}],   # JSON
                   "kind": "plain" | "zero_local"},
     "scheduler": {...JSON...},                                  # scheduler.state_dict()
     "scaler":    {...JSON...},                                  # GradScaler.state_dict()
     "progress":  {...JSON...},                                  # progress= (step, data position, ...)
     "rng":       capture_rng_state(...)}

Replicated only where the caller says so: with ``replicated_group`` (the data-parallel group of a
DDP or ZeRO-1 job, which must span every rank of the checkpoint) ``model``, a plain ``optimizer``,
``scheduler``, ``scaler`` and ``progress`` are wrapped in :class:`~tiered_ckpt.state.Replicated`
(stored once per node, not once per rank; the save checks that they are identical on every rank and
refuses otherwise: :class:`~tiered_ckpt.training.ReplicatedMismatchError`). A
ZeroRedundancyOptimizer's local partition and the RNG streams stay per rank. Nothing is ever
guessed: tensor-, pipeline- and expert-parallel parameters differ per rank, and storing them once
would lose data. Per-rank values that remain reshard with ``tiered-ckpt reshard --preset training``
(:data:`tiered_ckpt.local.reshard.TRAINING_RULES`).

Tensors are converted bit-exactly: float16/float32/float64/int*/bool map to the numpy dtype;
bfloat16 and float8 tensors are *viewed* as integers of the same width and then as the matching
``ml_dtypes`` type (no float round trip). For CPU tensors the arrays **alias the live tensors** (no
copy): store them before the tensors change (``CheckpointManager.save`` copies them into its staging
buffers before returning). CUDA tensors are copied into pinned host buffers (``torch.empty(...,
pin_memory=True)``, ``copy_(non_blocking=True)``, one ``torch.cuda.synchronize()``), cached per name
in a :class:`PinnedBufferPool` (``pool=``, default :data:`DEFAULT_PINNED_POOL`) and reused between
captures, so the arrays of one capture stay valid until the next capture (save before capturing
again); that path is simple on purpose and is not exercised by the CPU-only tests.

Code: this module (model, everything at once), :mod:`~tiered_ckpt.training.torch_optim` (optimizer),
:mod:`~tiered_ckpt.training.torch_rng` (RNG streams), :mod:`~tiered_ckpt.training.torch_tensors`
(tensor <-> array, pinned buffers, JSON values); the public path is :mod:`tiered_ckpt.torch`.

Optimizer state is keyed by parameter *name* (from ``model.named_parameters()``), not by the
optimizer's local index, so that a checkpoint survives a change of parameter order or partition.
Restoring loads state and ``param_groups`` (lr, betas, weight decay, ...) through
``Optimizer.load_state_dict``; it never calls ``step()`` on the optimizer or the scaler.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch

from tiered_ckpt.errors import CheckpointError, UnsupportedStateError
from tiered_ckpt.state import Replicated
from tiered_ckpt.training.torch_optim import capture_optimizer, restore_optimizer
from tiered_ckpt.training.torch_rng import RandomGenerator, capture_rng_state, restore_rng_state
from tiered_ckpt.training.torch_tensors import (
    DEFAULT_PINNED_POOL,  # noqa: F401  (importable here, as before)
    PinnedBufferPool,
    finish_host_copies,
    host_array,
    numpy_to_tensor,
    refuse_dtensor,
    tensor_to_numpy,
    to_json_value,
)

__all__ = [
    "tensor_to_numpy",
    "numpy_to_tensor",
    "PinnedBufferPool",
    "capture_model",
    "restore_model",
    "capture_optimizer",
    "restore_optimizer",
    "capture_rng_state",
    "restore_rng_state",
    "capture_training_state",
    "restore_training_state",
]


class HasStateDict(Protocol):
    """What a scheduler or a ``GradScaler`` offers here: ``state_dict()`` (plain JSON-able values)
    and ``load_state_dict(dict)`` (``torch.optim.lr_scheduler.LRScheduler``,
    ``torch.amp.GradScaler``, ...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


# --- model


def capture_model(
    model: torch.nn.Module, *, pool: PinnedBufferPool | None = None
) -> dict[str, np.ndarray]:
    """``model.state_dict()`` (parameters and persistent buffers) as ``{name: ndarray}``.

    CPU arrays alias the live tensors; see the module docstring. Raises ``UnsupportedStateError``
    naming the key for a DTensor (a model sharded with FSDP2 ``fully_shard`` or tensor parallel):
    such a model is saved through :mod:`tiered_ckpt.dcp` (``get_state_dict`` +
    ``tiered_ckpt.dcp.save``).
    """
    out: dict[str, Any] = {}
    pending = False
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor):
            raise UnsupportedStateError(f"model state {name!r} is not a tensor")
        out[name], sync = host_array(f"model/{name}", t, pool)
        pending |= sync
    finish_host_copies(out, pending)
    return out


def restore_model(
    model: torch.nn.Module, arrays: Mapping[str, np.ndarray], *, strict: bool = True
) -> None:
    """Copy ``arrays`` into ``model`` bit-exactly (``load_state_dict``; dtype must match).

    Raises ``CheckpointError`` on a missing/unexpected key (with ``strict``) or a dtype/shape
    mismatch, ``UnsupportedStateError`` (before anything changes) when the model holds DTensors
    (FSDP2: use ``tiered_ckpt.dcp``).
    """
    current = model.state_dict()
    for name, cur in current.items():
        refuse_dtensor(repr(f"model/{name}"), cur)
    sd = {}
    for name, a in arrays.items():
        t = numpy_to_tensor(np.asarray(a))
        cur = current.get(name)
        if cur is not None and (cur.dtype != t.dtype or tuple(cur.shape) != tuple(t.shape)):
            raise CheckpointError(
                f"model tensor {name!r}: saved {t.dtype}{tuple(t.shape)} != live {cur.dtype}{tuple(cur.shape)}"
            )
        sd[name] = t
    try:
        model.load_state_dict(sd, strict=strict)
    except RuntimeError as exc:
        raise CheckpointError(f"model state does not match the model: {exc}") from exc


# --- all of it


def _check_replicated_group(group: Any) -> None:
    """``group`` (a ``torch.distributed`` process group, ``dist.group.WORLD`` included) spans every
    rank of the job; else ``ValueError`` (a Replicated value is stored once for every rank of a
    checkpoint)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("replicated_group needs torch.distributed initialized")
    n, world = dist.get_world_size(group), dist.get_world_size()
    if n != world:
        raise ValueError(
            f"replicated_group has {n} of the job's {world} ranks: a Replicated value is stored once "
            "for every rank of the checkpoint, so only a data-parallel group spanning the whole job "
            "can be claimed (with tensor, pipeline or expert parallelism, save the state per rank, "
            "or use tiered_ckpt.dcp)"
        )


def capture_training_state(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: HasStateDict | None = None,
    scaler: HasStateDict | None = None,
    *,
    rng: bool = True,
    generators: Mapping[str, RandomGenerator] | None = None,
    pool: PinnedBufferPool | None = None,
    progress: Mapping[str, Any] | None = None,
    replicated_group: Any = None,
) -> dict[str, Any]:
    """Everything above in one state dict (layout in the module docstring).

    ``progress``: the job's counters and data position as JSON (``step``, ``epoch``,
    ``DataPosition.to_json()``, a loss history), stored under ``"progress"``; add other keys of your
    own to the returned dict before saving. ``optimizer`` needs ``model`` (for parameter names).
    ``replicated_group``: the data-parallel process group (``torch.distributed.group.WORLD`` for a
    pure data-parallel job) whose ranks all hold the same model, plain optimizer, scheduler, scaler
    and progress: those are marked Replicated (see the module docstring). ``ValueError`` if it does
    not span the whole job or torch.distributed is not initialized.
    """
    if replicated_group is not None:
        _check_replicated_group(replicated_group)
    rep: Any = Replicated if replicated_group is not None else (lambda v: v)
    out: dict[str, Any] = {}
    if model is not None:
        out["model"] = rep(capture_model(model, pool=pool))
    if optimizer is not None:
        if model is None:
            raise ValueError(
                "capture_training_state: an optimizer needs the model (parameter names)"
            )
        opt = capture_optimizer(optimizer, model, pool=pool)
        out["optimizer"] = (
            rep(opt) if opt.get("kind") == "plain" else opt
        )  # a ZeRO partition is per rank
    if scheduler is not None:
        out["scheduler"] = rep(to_json_value(scheduler.state_dict(), "scheduler"))
    if scaler is not None:
        out["scaler"] = rep(to_json_value(scaler.state_dict(), "scaler"))
    if progress is not None:
        out["progress"] = rep(to_json_value(dict(progress), "progress"))
    if rng:
        out["rng"] = capture_rng_state(generators)
    return out


def restore_training_state(
    state: Mapping[str, Any],
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: HasStateDict | None = None,
    scaler: HasStateDict | None = None,
    *,
    rng: bool = True,
    generators: Mapping[str, RandomGenerator] | None = None,
) -> None:
    """Restore what :func:`capture_training_state` captured into the live objects passed.

    Order: model, optimizer, scheduler, scaler, RNG (last, so that nothing consumes random numbers
    after it). Raises ``CheckpointError`` when a requested part is missing or does not fit. A rank
    added by a reshard with the ``training`` preset has no ``rng``: pass ``rng="rng" in state`` and
    seed it as at a fresh start. ``progress`` is the caller's to read (``state["progress"]``).
    """

    def part(key: str) -> Any:
        if key not in state:
            raise CheckpointError(f"checkpoint has no {key!r} state")
        return state[key]

    if model is not None:
        restore_model(model, part("model"))
    if optimizer is not None:
        if model is None:
            raise ValueError(
                "restore_training_state: an optimizer needs the model (parameter names)"
            )
        restore_optimizer(optimizer, model, part("optimizer"))
    if scheduler is not None:
        scheduler.load_state_dict(dict(part("scheduler")))
    if scaler is not None:
        scaler.load_state_dict(dict(part("scaler")))
    if rng:
        restore_rng_state(part("rng"), generators)
