"""Bit-exact conversion between torch tensors and numpy arrays, pinned host buffers for CUDA
tensors, and JSON conversion of the small values a torch state holds. Shared by the torch state
modules (:mod:`tiered_ckpt.training.torch_state`, ``torch_optim``, ``torch_rng``); see torch_state's
docstring for the dtype mapping and aliasing rules.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import ml_dtypes
import numpy as np
import torch
from numpy.typing import DTypeLike

from tiered_ckpt.errors import UnsupportedStateError

__all__ = [
    "tensor_to_numpy",
    "numpy_to_tensor",
    "PinnedBufferPool",
    "DEFAULT_PINNED_POOL",
    "host_array",
    "finish_host_copies",
    "to_json_value",
    "is_dtensor",
    "refuse_dtensor",
]

# torch dtype -> (integer view dtype for torch, numpy dtype of the stored array). None = direct.
_VIEW_DTYPES: dict[torch.dtype, tuple[torch.dtype, DTypeLike]] = {
    torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
}
for _tname, _mname in (
    ("float8_e4m3fn", "float8_e4m3fn"),
    ("float8_e5m2", "float8_e5m2"),
    ("float8_e4m3fnuz", "float8_e4m3fnuz"),
    ("float8_e5m2fnuz", "float8_e5m2fnuz"),
):
    if hasattr(torch, _tname) and hasattr(ml_dtypes, _mname):
        _VIEW_DTYPES[getattr(torch, _tname)] = (torch.uint8, getattr(ml_dtypes, _mname))

_TORCH_INT_TO_NUMPY = {torch.int16: np.int16, torch.uint8: np.uint8}
_NUMPY_TO_TORCH_VIEW = {np.dtype(npdt): (view, tdt) for tdt, (view, npdt) in _VIEW_DTYPES.items()}


class PinnedBufferPool:
    """Pinned host buffers for CUDA tensors, reused between captures (keyed by name, shape,
    dtype)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def host_copy(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Start an async device-to-host copy of ``t`` into the pinned buffer for ``name``.

        The caller must ``torch.cuda.synchronize()`` before reading the result.
        """
        buf = self._buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            self._buffers[name] = buf
        buf.copy_(t, non_blocking=True)
        return buf


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallel). Imports
    nothing: no DTensor can exist before ``torch.distributed.tensor`` is loaded."""
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(t, cls)


def refuse_dtensor(where: str, t: Any) -> None:
    """Raise ``UnsupportedStateError`` naming ``where`` if ``t`` is a DTensor (else nothing).

    The arrays of this module hold one process's whole tensors; a DTensor is a shard of a global
    tensor with placements on a device mesh, which only a DCP state dict describes:
    ``tiered_ckpt.dcp`` saves it.
    """
    if not is_dtensor(t):
        return
    try:
        layout = f" (global shape {tuple(t.shape)}, placements {tuple(t.placements)}, mesh {tuple(t.device_mesh.shape)})"
    except Exception:  # noqa: BLE001 - the message must not fail on an odd DTensor
        layout = ""
    raise UnsupportedStateError(
        f"{where} is a DTensor{layout}: a sharded model (FSDP2 fully_shard, tensor parallel) cannot be "
        "captured as arrays; save it through tiered_ckpt.dcp instead (state = get_state_dict(model, optimizer) "
        "from torch.distributed.checkpoint.state_dict, then tiered_ckpt.dcp.save / async_save; load with "
        "tiered_ckpt.dcp.load and set_state_dict)"
    )


def tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array with the same bytes (a view when ``t`` is contiguous).

    bfloat16/float8 become ``ml_dtypes`` arrays through an integer view. Raises
    ``UnsupportedStateError`` for a DTensor (see :func:`refuse_dtensor`) and for dtypes without a
    numpy counterpart (complex32, quantized, ...), and ``ValueError`` for non-CPU tensors (copy them
    to host first).
    """
    refuse_dtensor("the tensor", t)
    if t.device.type != "cpu":
        raise ValueError(f"tensor_to_numpy needs a CPU tensor, got device {t.device}")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    view = _VIEW_DTYPES.get(t.dtype)
    try:
        if view is not None:
            return t.view(view[0]).numpy().view(view[1])
        return t.numpy()
    except (TypeError, RuntimeError) as exc:
        raise UnsupportedStateError(f"cannot store a tensor of dtype {t.dtype}") from exc


def numpy_to_tensor(a: np.ndarray) -> torch.Tensor:
    """A new CPU tensor (own, writable memory) with exactly the bytes of ``a``."""
    a = (
        a if a.flags.c_contiguous else a.copy(order="C")
    )  # (np.ascontiguousarray makes 0-d arrays 1-d)
    view = _NUMPY_TO_TORCH_VIEW.get(a.dtype)
    if view is not None:
        return torch.from_numpy(a.view(_TORCH_INT_TO_NUMPY[view[0]]).copy()).view(view[1])
    return torch.from_numpy(np.array(a, copy=True))


#: The pool used when a capture is given none: pinned buffers reused from one capture to the next.
DEFAULT_PINNED_POOL = PinnedBufferPool()


def host_array(
    name: str, t: torch.Tensor, pool: PinnedBufferPool | None
) -> tuple[np.ndarray | torch.Tensor, bool]:
    """``(array_or_pinned_tensor, needs_sync)`` for one tensor: a CPU tensor's aliasing array, or
    the pinned host tensor a device-to-host copy is filling (pass to :func:`finish_host_copies`
    after all).

    Raises ``UnsupportedStateError`` naming ``name`` (e.g. ``model/<param>``) for a DTensor."""
    refuse_dtensor(repr(name), t)
    if t.device.type == "cpu":
        return tensor_to_numpy(t), False
    return (pool or DEFAULT_PINNED_POOL).host_copy(name, t.detach()), True


def finish_host_copies(out: MutableMapping[str, Any], pending: bool) -> None:
    """Synchronize pending device copies and turn pinned tensors into numpy views, in place."""
    if pending and torch.cuda.is_available():
        torch.cuda.synchronize()
    for k, v in list(out.items()):
        if isinstance(v, torch.Tensor):
            out[k] = tensor_to_numpy(v)
        elif isinstance(v, dict):
            finish_host_copies(v, False)


# --- JSON


def to_json_value(value: Any, where: str) -> Any:
    """A JSON-able copy of ``value`` (tuples -> lists, 0-d tensors/numpy scalars -> Python numbers).

    Raises ``UnsupportedStateError`` on anything else (functions, objects, non-str keys).
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() == 0:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [to_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnsupportedStateError(
                    f"{where}: non-string key {k!r} cannot be stored as JSON"
                )
            out[k] = to_json_value(v, f"{where}.{k}")
        return out
    raise UnsupportedStateError(f"{where}: value of type {type(value).__name__} is not JSON-able")
