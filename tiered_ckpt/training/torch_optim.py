"""Capture and restore of a torch optimizer's state, keyed by parameter name (a plain
``torch.optim.Optimizer`` or the local partition of ``ZeroRedundancyOptimizer``); see
:mod:`tiered_ckpt.training.torch_state` for the layout. No pickling, no ``step()``.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from tiered_ckpt.errors import CheckpointError, UnsupportedStateError
from tiered_ckpt.training.torch_tensors import (
    PinnedBufferPool,
    finish_host_copies,
    host_array,
    numpy_to_tensor,
    refuse_dtensor,
    to_json_value,
)

__all__ = ["capture_optimizer", "restore_optimizer"]


def _is_zero(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a ``ZeroRedundancyOptimizer`` (duck-typed: no torch.distributed
    import)."""
    return hasattr(optimizer, "consolidate_state_dict") and hasattr(optimizer, "optim")


def _param_names(model: torch.nn.Module | Mapping[str, torch.nn.Parameter]) -> dict[int, str]:
    named = (
        model.items()
        if isinstance(model, Mapping)
        else model.named_parameters(remove_duplicate=True)
    )
    return {id(p): n for n, p in named}


def capture_optimizer(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module | Mapping[str, torch.nn.Parameter],
    *,
    pool: PinnedBufferPool | None = None,
) -> dict[str, Any]:
    """Optimizer state keyed by parameter name, plus ``param_groups`` as JSON.

    For a ``ZeroRedundancyOptimizer`` only this rank's partition (its local optimizer) is captured,
    with no consolidation; ``kind`` is then ``"zero_local"``. Tensor state (``exp_avg``, ...)
    becomes arrays (aliasing CPU tensors); non-tensor state becomes JSON. Raises
    ``UnsupportedStateError`` if the optimizer holds a parameter that ``model`` does not name, or a
    DTensor state (FSDP2: naming ``optim/<param>/<key>``; save through :mod:`tiered_ckpt.dcp`).
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
                raise UnsupportedStateError(
                    f"optimizer param group {gi} holds a parameter the model does not name"
                )
            gnames.append(name)
            pstate = local.state.get(p)
            if not pstate:
                continue
            entry: dict[str, Any] = {}
            for key, v in pstate.items():
                if not isinstance(key, str):
                    raise UnsupportedStateError(
                        f"optimizer state key {key!r} of {name!r} is not a string"
                    )
                if isinstance(v, torch.Tensor):
                    entry[key], sync = host_array(f"optim/{name}/{key}", v, pool)
                    pending |= sync
                else:
                    entry[key] = to_json_value(v, f"optimizer.state.{name}.{key}")
            state[name] = entry
        hyper = {
            k: to_json_value(v, f"optimizer.param_groups[{gi}].{k}")
            for k, v in hyper_groups[gi].items()
            if k != "params"
        }
        hyper["params"] = gnames
        groups.append(hyper)
    finish_host_copies(state, pending)
    return {
        "state": state,
        "param_groups": groups,
        "kind": "zero_local" if local is not optimizer else "plain",
    }


def _group_kinds(groups: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The live values of each group that are not plain JSON (tuples, tensors), before a load."""
    return [
        {k: v for k, v in g.items() if k != "params" and isinstance(v, (tuple, torch.Tensor))}
        for g in groups
    ]


def _apply_group_values(
    group: MutableMapping[str, Any], saved: Mapping[str, Any], kinds: Mapping[str, Any]
) -> None:
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
    ``CheckpointError`` if the groups or their sets of parameter names differ (e.g. a ZeRO partition
    of another world size: reshard first), ``UnsupportedStateError`` (before anything changes) if a
    parameter is a DTensor (FSDP2: use ``tiered_ckpt.dcp``).
    """
    zero = _is_zero(optimizer)
    local = optimizer.optim if zero else optimizer
    if saved.get("kind", "plain") != ("zero_local" if zero else "plain"):
        raise CheckpointError(
            f"optimizer checkpoint kind {saved.get('kind')!r} does not fit {type(optimizer).__name__}"
        )
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
        for p in group["params"]:
            refuse_dtensor(f"optimizer parameter {names.get(id(p))!r}", p)
        live_names = [names.get(id(p)) for p in group["params"]]
        if sorted(map(str, live_names)) != sorted(
            sgroup["params"]
        ):  # order may differ: matched by name
            raise CheckpointError(
                f"optimizer param group {gi}: live params {live_names} != saved {list(sgroup['params'])}"
            )
        ids = []
        for name in live_names:
            pstate = saved["state"].get(name)
            if pstate:
                sd_state[index] = {
                    k: numpy_to_tensor(np.asarray(v)) if isinstance(v, np.ndarray) else v
                    for k, v in pstate.items()
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
