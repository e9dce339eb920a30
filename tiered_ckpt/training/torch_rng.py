"""Capture and restore of RNG streams (Python ``random``, NumPy's global RNG, torch CPU and CUDA,
registered generators) as arrays + JSON; see :mod:`tiered_ckpt.training.torch_state`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Union

import numpy as np
import torch

from tiered_ckpt.errors import CheckpointError, UnsupportedStateError
from tiered_ckpt.training.torch_tensors import numpy_to_tensor, tensor_to_numpy, to_json_value

__all__ = ["capture_rng_state", "restore_rng_state", "RandomGenerator"]

#: A generator :func:`capture_rng_state` can register by name.
RandomGenerator = Union[np.random.Generator, np.random.RandomState, torch.Generator]


def _np_state_to_tree(state: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, np.ndarray):
            out[k] = v.copy()
        elif isinstance(v, Mapping):
            out[k] = _np_state_to_tree(v)
        else:
            # PCG64 states are 128-bit integers: stored as decimal strings to stay portable JSON.
            out[k] = (
                {"__int__": str(v)}
                if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 2**53
                else to_json_value(v, k)
            )
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


def capture_rng_state(generators: Mapping[str, RandomGenerator] | None = None) -> dict[str, Any]:
    """RNG state of Python ``random``, NumPy's global RNG, torch CPU (and every CUDA device when
    available), and each registered generator (``numpy.random.Generator``,
    ``numpy.random.RandomState`` or ``torch.Generator``), as arrays + JSON. Captured values are
    copies.

    Raises ``UnsupportedStateError`` for a registered object of another type.
    """
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "python": {
            "version": version,
            "state": np.asarray(internal, dtype=np.uint32),
            "gauss_next": gauss,
        },
        "numpy": {
            "name": np_name,
            "keys": np.array(np_keys, dtype=np.uint32),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch_cpu": tensor_to_numpy(torch.get_rng_state()).copy(),
    }
    if torch.cuda.is_available():
        out["torch_cuda"] = {
            str(i): tensor_to_numpy(s).copy() for i, s in enumerate(torch.cuda.get_rng_state_all())
        }
    gens: dict[str, Any] = {}
    for name, g in (generators or {}).items():
        if isinstance(g, np.random.Generator):
            gens[name] = {
                "kind": "numpy_generator",
                "state": _np_state_to_tree(g.bit_generator.state),
            }
        elif isinstance(g, np.random.RandomState):
            gens[name] = {
                "kind": "numpy_randomstate",
                "state": _np_state_to_tree(g.get_state(legacy=False)),
            }
        elif isinstance(g, torch.Generator):
            gens[name] = {
                "kind": "torch_generator",
                "device": str(g.device),
                "state": tensor_to_numpy(g.get_state()).copy(),
            }
        else:
            raise UnsupportedStateError(f"generator {name!r}: unsupported type {type(g).__name__}")
    if gens:
        out["generators"] = gens
    return out


def restore_rng_state(
    state: Mapping[str, Any], generators: Mapping[str, RandomGenerator] | None = None
) -> None:
    """Inverse of :func:`capture_rng_state`: set every stream captured there.

    ``generators`` are the live objects to restore, by the same names; raises ``CheckpointError`` if
    one is missing from ``state`` or of another kind. CUDA states are restored when CUDA is
    available and the device count matches (otherwise they are skipped with no error: a CPU restore
    of a GPU run).
    """
    py = state["python"]
    random.setstate(
        (
            int(py["version"]),
            tuple(int(x) for x in np.asarray(py["state"]).tolist()),
            py["gauss_next"],
        )
    )
    n = state["numpy"]
    np.random.set_state(
        (
            n["name"],
            np.asarray(n["keys"], dtype=np.uint32),
            int(n["pos"]),
            int(n["has_gauss"]),
            float(n["cached_gaussian"]),
        )
    )
    torch.set_rng_state(numpy_to_tensor(np.asarray(state["torch_cpu"])))
    cuda = state.get("torch_cuda")
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(
            [numpy_to_tensor(np.asarray(cuda[str(i)])) for i in range(len(cuda))]
        )
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
            raise CheckpointError(
                f"generator {name!r}: checkpoint holds a {kind}, live object is {type(g).__name__}"
            )
