"""Capture and restore of a PyTorch training state as arrays + JSON (extra ``tiered-ckpt[torch]``).

The core package never imports torch; this module does. It turns a model, an optimizer (a plain
``torch.optim.Optimizer`` or the local partition of ``torch.distributed.optim.ZeroRedundancyOptimizer``),
an LR scheduler, a ``GradScaler`` and the RNG streams into a *state* (nested ``dict`` of ``str`` ->
``numpy.ndarray`` / JSON value) that :class:`tiered_ckpt.CheckpointManager` or ``write_shard`` stores,
and back. Nothing here pickles or unpickles.

Layout of :func:`capture_training_state`'s result (absent parts are omitted)::

    {"model":     {param_or_buffer_name: ndarray},              # model.state_dict() order
     "optimizer": {"state": {param_name: {key: ndarray | JSON}},
                   "param_groups": [{"params": [param_name, ...], "lr": ..., ...}],   # JSON
                   "kind": "plain" | "zero_local"},
     "scheduler": {...JSON...},                                  # scheduler.state_dict()
     "scaler":    {...JSON...},                                  # GradScaler.state_dict()
     "rng":       capture_rng_state(...)}

Tensors are converted bit-exactly: float16/float32/float64/int*/bool map to the numpy dtype;
bfloat16 and float8 tensors are *viewed* as integers of the same width and then as the matching
``ml_dtypes`` type (no float round trip). For CPU tensors the arrays **alias the live tensors** (no
copy): store them before the tensors change (``CheckpointManager.save`` copies them into its staging
buffers before returning). CUDA tensors are copied into pinned host buffers (``torch.empty(...,
pin_memory=True)``, ``copy_(non_blocking=True)``, one ``torch.cuda.synchronize()``), cached per name in
a :class:`PinnedBufferPool` (``pool=``, default :data:`DEFAULT_PINNED_POOL`) and reused between
captures, so the arrays of one capture stay valid until the next capture (save before capturing again);
that path is simple on purpose and is not exercised by the CPU-only tests.

Optimizer state is keyed by parameter *name* (from ``model.named_parameters()``), not by the
optimizer's local index, so that a checkpoint survives a change of parameter order or partition.
Restoring loads state and ``param_groups`` (lr, betas, weight decay, ...) through
``Optimizer.load_state_dict``; it never calls ``step()`` on the optimizer or the scaler.
"""

from __future__ import annotations

import random
from typing import Any, Mapping, MutableMapping

import ml_dtypes
import numpy as np
import torch

from tiered_ckpt.errors import CheckpointError, UnsupportedStateError

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

# torch dtype -> (integer view dtype for torch, numpy dtype of the stored array). None = direct.
_VIEW_DTYPES: dict[torch.dtype, tuple[torch.dtype, Any]] = {
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
    """Pinned host buffers for CUDA tensors, reused between captures (keyed by name, shape, dtype)."""

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


def tensor_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array with the same bytes (a view when ``t`` is contiguous).

    bfloat16/float8 become ``ml_dtypes`` arrays through an integer view. Raises
    ``UnsupportedStateError`` for dtypes without a numpy counterpart (complex32, quantized, ...) and
    ``ValueError`` for non-CPU tensors (copy them to host first).
    """
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
    a = a if a.flags.c_contiguous else a.copy(order="C")  # (np.ascontiguousarray makes 0-d arrays 1-d)
    view = _NUMPY_TO_TORCH_VIEW.get(a.dtype)
    if view is not None:
        return torch.from_numpy(a.view(_TORCH_INT_TO_NUMPY[view[0]]).copy()).view(view[1])
    return torch.from_numpy(np.array(a, copy=True))


#: The pool used when a capture is given none: pinned buffers reused from one capture to the next.
DEFAULT_PINNED_POOL = PinnedBufferPool()


def _host_array(name: str, t: torch.Tensor, pool: PinnedBufferPool | None) -> tuple[Any, bool]:
    """``(array_or_pinned_tensor, needs_sync)`` for one tensor."""
    if t.device.type == "cpu":
        return tensor_to_numpy(t), False
    return (pool or DEFAULT_PINNED_POOL).host_copy(name, t.detach()), True


def _finish(out: MutableMapping[str, Any], pending: bool) -> None:
    """Synchronize pending device copies and turn pinned tensors into numpy views, in place."""
    if pending and torch.cuda.is_available():
        torch.cuda.synchronize()
    for k, v in list(out.items()):
        if isinstance(v, torch.Tensor):
            out[k] = tensor_to_numpy(v)
        elif isinstance(v, dict):
            _finish(v, False)


# ----------------------------------------------------------------------------------------------- JSON


def _jsonable(value: Any, where: str) -> Any:
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
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnsupportedStateError(f"{where}: non-string key {k!r} cannot be stored as JSON")
            out[k] = _jsonable(v, f"{where}.{k}")
        return out
    raise UnsupportedStateError(f"{where}: value of type {type(value).__name__} is not JSON-able")


# ---------------------------------------------------------------------------------------------- model


def capture_model(model: torch.nn.Module, *, pool: PinnedBufferPool | None = None) -> dict[str, np.ndarray]:
    """``model.state_dict()`` (parameters and persistent buffers) as ``{name: ndarray}``.

    CPU arrays alias the live tensors; see the module docstring.
    """
    out: dict[str, Any] = {}
    pending = False
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor):
            raise UnsupportedStateError(f"model state {name!r} is not a tensor")
        out[name], sync = _host_array(f"model/{name}", t, pool)
        pending |= sync
    _finish(out, pending)
    return out


def restore_model(model: torch.nn.Module, arrays: Mapping[str, np.ndarray], *, strict: bool = True) -> None:
    """Copy ``arrays`` into ``model`` bit-exactly (``load_state_dict``; dtype must match).

    Raises ``CheckpointError`` on a missing/unexpected key (with ``strict``) or a dtype/shape mismatch.
    """
    current = model.state_dict()
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


# ------------------------------------------------------------------------------------------ optimizer


def _is_zero(optimizer: Any) -> bool:
    return hasattr(optimizer, "consolidate_state_dict") and hasattr(optimizer, "optim")


def _param_names(model: torch.nn.Module | Mapping[str, torch.nn.Parameter]) -> dict[int, str]:
    named = model.items() if isinstance(model, Mapping) else model.named_parameters(remove_duplicate=True)
    return {id(p): n for n, p in named}


def capture_optimizer(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module | Mapping[str, torch.nn.Parameter],
    *,
    pool: PinnedBufferPool | None = None,
) -> dict[str, Any]:
    """Optimizer state keyed by parameter name, plus ``param_groups`` as JSON.

    For a ``ZeroRedundancyOptimizer`` only this rank's partition (its local optimizer) is captured,
    with no consolidation; ``kind`` is then ``"zero_local"``. Tensor state (``exp_avg``, ...) becomes
    arrays (aliasing CPU tensors); non-tensor state becomes JSON. Raises ``UnsupportedStateError`` if
    the optimizer holds a parameter that ``model`` does not name.
    """
    local = optimizer.optim if _is_zero(optimizer) else optimizer
    # ZeRO keeps the hyper-parameters users and schedulers change in its global groups (copied into
    # the local ones only at step()): take them from there, in the same order as the local groups.
    hyper_groups = optimizer.param_groups
    names = _param_names(model)
    groups = []
    state: dict[str, Any] = {}
    pending = False
    for gi, group in enumerate(local.param_groups):
        gnames = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise UnsupportedStateError(f"optimizer param group {gi} holds a parameter the model does not name")
            gnames.append(name)
            pstate = local.state.get(p)
            if not pstate:
                continue
            entry: dict[str, Any] = {}
            for key, v in pstate.items():
                if not isinstance(key, str):
                    raise UnsupportedStateError(f"optimizer state key {key!r} of {name!r} is not a string")
                if isinstance(v, torch.Tensor):
                    entry[key], sync = _host_array(f"optim/{name}/{key}", v, pool)
                    pending |= sync
                else:
                    entry[key] = _jsonable(v, f"optimizer.state.{name}.{key}")
            state[name] = entry
        hyper = {k: _jsonable(v, f"optimizer.param_groups[{gi}].{k}")
                 for k, v in hyper_groups[gi].items() if k != "params"}
        hyper["params"] = gnames
        groups.append(hyper)
    _finish(state, pending)
    return {"state": state, "param_groups": groups, "kind": "zero_local" if local is not optimizer else "plain"}


def _group_kinds(groups: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The live values of each group that are not plain JSON (tuples, tensors), before a load."""
    return [{k: v for k, v in g.items() if k != "params" and isinstance(v, (tuple, torch.Tensor))} for g in groups]


def _apply_group_values(group: MutableMapping[str, Any], saved: Mapping[str, Any], kinds: Mapping[str, Any]) -> None:
    """Set hyper-parameters of a live param group from JSON, keeping the live tuple/tensor types."""
    for k, v in saved.items():
        if k == "params":
            continue
        cur = kinds.get(k)
        if isinstance(cur, torch.Tensor):
            cur.fill_(v)
            group[k] = cur
        elif isinstance(cur, tuple) and isinstance(v, list):
            group[k] = tuple(v)
        else:
            group[k] = v


def restore_optimizer(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module | Mapping[str, torch.nn.Parameter],
    saved: Mapping[str, Any],
) -> None:
    """Load a :func:`capture_optimizer` result into ``optimizer`` (no ``step()`` is taken).

    Parameters are matched by name, group by group (their order inside a group may differ); raises
    ``CheckpointError`` if the groups or their sets of parameter names differ (e.g. a ZeRO partition of another world size: reshard first).
    """
    zero = _is_zero(optimizer)
    local = optimizer.optim if zero else optimizer
    if saved.get("kind", "plain") != ("zero_local" if zero else "plain"):
        raise CheckpointError(f"optimizer checkpoint kind {saved.get('kind')!r} does not fit {type(optimizer).__name__}")
    names = _param_names(model)
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(local.param_groups):
        raise CheckpointError(
            f"optimizer has {len(local.param_groups)} param groups, checkpoint {len(saved_groups)}"
        )
    sd_groups = []
    sd_state: dict[int, dict[str, Any]] = {}
    index = 0
    for gi, (group, sgroup) in enumerate(zip(local.param_groups, saved_groups)):
        live_names = [names.get(id(p)) for p in group["params"]]
        if sorted(map(str, live_names)) != sorted(sgroup["params"]):  # order may differ: matched by name
            raise CheckpointError(
                f"optimizer param group {gi}: live params {live_names} != saved {list(sgroup['params'])}"
            )
        ids = []
        for name in live_names:
            pstate = saved["state"].get(name)
            if pstate:
                sd_state[index] = {
                    k: numpy_to_tensor(np.asarray(v)) if isinstance(v, np.ndarray) else v for k, v in pstate.items()
                }
            ids.append(index)
            index += 1
        g = {k: v for k, v in sgroup.items() if k != "params"}
        g["params"] = ids
        sd_groups.append(g)
    local_kinds = _group_kinds(local.param_groups)
    global_kinds = _group_kinds(optimizer.param_groups) if zero else []
    try:
        local.load_state_dict({"state": sd_state, "param_groups": sd_groups})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"optimizer state does not fit the optimizer: {exc}") from exc
    for group, sgroup, kinds in zip(local.param_groups, saved_groups, local_kinds):
        _apply_group_values(group, sgroup, kinds)
    if zero:
        # ZeRO copies hyper-parameters from its global groups into the local ones at every step():
        # the global groups must carry the restored values too (same order as the local ones).
        for group, sgroup, kinds in zip(optimizer.param_groups, saved_groups, global_kinds):
            _apply_group_values(group, sgroup, kinds)


# ------------------------------------------------------------------------------------------------ RNG


def _np_state_to_tree(state: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, np.ndarray):
            out[k] = v.copy()
        elif isinstance(v, Mapping):
            out[k] = _np_state_to_tree(v)
        else:
            # PCG64 states are 128-bit integers: stored as decimal strings to stay portable JSON.
            out[k] = {"__int__": str(v)} if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 2**53 else _jsonable(v, k)
    return out


def _tree_to_np_state(tree: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping) and set(v) == {"__int__"}:
            out[k] = int(v["__int__"])
        elif isinstance(v, Mapping):
            out[k] = _tree_to_np_state(v)
        elif isinstance(v, np.ndarray):
            out[k] = np.array(v, copy=True)
        else:
            out[k] = v
    return out


def capture_rng_state(generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """RNG state of Python ``random``, NumPy's global RNG, torch CPU (and every CUDA device when
    available), and each registered generator (``numpy.random.Generator``, ``numpy.random.RandomState``
    or ``torch.Generator``), as arrays + JSON. Captured values are copies.

    Raises ``UnsupportedStateError`` for a registered object of another type.
    """
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "python": {"version": version, "state": np.asarray(internal, dtype=np.uint32), "gauss_next": gauss},
        "numpy": {"name": np_name, "keys": np.array(np_keys, dtype=np.uint32), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_cached)},
        "torch_cpu": tensor_to_numpy(torch.get_rng_state()).copy(),
    }
    if torch.cuda.is_available():
        out["torch_cuda"] = {str(i): tensor_to_numpy(s).copy() for i, s in enumerate(torch.cuda.get_rng_state_all())}
    gens: dict[str, Any] = {}
    for name, g in (generators or {}).items():
        if isinstance(g, np.random.Generator):
            gens[name] = {"kind": "numpy_generator", "state": _np_state_to_tree(g.bit_generator.state)}
        elif isinstance(g, np.random.RandomState):
            gens[name] = {"kind": "numpy_randomstate", "state": _np_state_to_tree(g.get_state(legacy=False))}
        elif isinstance(g, torch.Generator):
            gens[name] = {"kind": "torch_generator", "device": str(g.device), "state": tensor_to_numpy(g.get_state()).copy()}
        else:
            raise UnsupportedStateError(f"generator {name!r}: unsupported type {type(g).__name__}")
    if gens:
        out["generators"] = gens
    return out


def restore_rng_state(state: Mapping[str, Any], generators: Mapping[str, Any] | None = None) -> None:
    """Inverse of :func:`capture_rng_state`: set every stream captured there.

    ``generators`` are the live objects to restore, by the same names; raises ``CheckpointError`` if one
    is missing from ``state`` or of another kind. CUDA states are restored when CUDA is available and
    the device count matches (otherwise they are skipped with no error: a CPU restore of a GPU run).
    """
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in np.asarray(py["state"]).tolist()), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state((n["name"], np.asarray(n["keys"], dtype=np.uint32), int(n["pos"]), int(n["has_gauss"]),
                         float(n["cached_gaussian"])))
    torch.set_rng_state(numpy_to_tensor(np.asarray(state["torch_cpu"])))
    cuda = state.get("torch_cuda")
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all([numpy_to_tensor(np.asarray(cuda[str(i)])) for i in range(len(cuda))])
    saved = state.get("generators", {})
    for name, g in (generators or {}).items():
        entry = saved.get(name)
        if entry is None:
            raise CheckpointError(f"generator {name!r} is not in the checkpoint")
        kind = entry["kind"]
        if kind == "numpy_generator" and isinstance(g, np.random.Generator):
            g.bit_generator.state = _tree_to_np_state(entry["state"])
        elif kind == "numpy_randomstate" and isinstance(g, np.random.RandomState):
            g.set_state(_tree_to_np_state(entry["state"]))
        elif kind == "torch_generator" and isinstance(g, torch.Generator):
            g.set_state(numpy_to_tensor(np.asarray(entry["state"])))
        else:
            raise CheckpointError(f"generator {name!r}: checkpoint holds a {kind}, live object is {type(g).__name__}")


# ------------------------------------------------------------------------------------------ all of it


def capture_training_state(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    scaler: Any | None = None,
    *,
    rng: bool = True,
    generators: Mapping[str, Any] | None = None,
    pool: PinnedBufferPool | None = None,
) -> dict[str, Any]:
    """Everything above in one state dict (layout in the module docstring).

    Add your own counters (``step``, ``epoch``, ``batch_in_epoch``, loss history) as extra keys of the
    returned dict before saving. ``optimizer`` needs ``model`` (for parameter names).
    """
    out: dict[str, Any] = {}
    if model is not None:
        out["model"] = capture_model(model, pool=pool)
    if optimizer is not None:
        if model is None:
            raise ValueError("capture_training_state: an optimizer needs the model (parameter names)")
        out["optimizer"] = capture_optimizer(optimizer, model, pool=pool)
    if scheduler is not None:
        out["scheduler"] = _jsonable(scheduler.state_dict(), "scheduler")
    if scaler is not None:
        out["scaler"] = _jsonable(scaler.state_dict(), "scaler")
    if rng:
        out["rng"] = capture_rng_state(generators)
    return out


def restore_training_state(
    state: Mapping[str, Any],
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    scaler: Any | None = None,
    *,
    rng: bool = True,
    generators: Mapping[str, Any] | None = None,
) -> None:
    """Restore what :func:`capture_training_state` captured into the live objects passed.

    Order: model, optimizer, scheduler, scaler, RNG (last, so that nothing consumes random numbers
    after it). Raises ``CheckpointError`` when a requested part is missing or does not fit.
    """
    def part(key: str) -> Any:
        if key not in state:
            raise CheckpointError(f"checkpoint has no {key!r} state")
        return state[key]

    if model is not None:
        restore_model(model, part("model"))
    if optimizer is not None:
        if model is None:
            raise ValueError("restore_training_state: an optimizer needs the model (parameter names)")
        restore_optimizer(optimizer, model, part("optimizer"))
    if scheduler is not None:
        scheduler.load_state_dict(dict(part("scheduler")))
    if scaler is not None:
        scaler.load_state_dict(dict(part("scaler")))
    if rng:
        restore_rng_state(part("rng"), generators)

