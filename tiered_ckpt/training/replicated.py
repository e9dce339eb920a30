"""The check of a save's replicated claims: a value saved as
:class:`~tiered_ckpt.state.Replicated` is stored once per node and handed to every rank, so it must
be identical on every rank of the save, or the ranks whose value is not stored would get another
rank's value on load (a tensor-, pipeline- or expert-parallel parameter would be lost). No torch:
the collectives are the caller's (:meth:`tiered_ckpt.training.dist.SaveCoordinator.save`).

Protocol: every rank computes :func:`replicated_digests` of its state (the sha256 of each leaf of
each Replicated value: an array's dtype, shape and bytes, a JSON value's text) and
:func:`combined_digest` of them; the ranks all-gather the combined digests (one 64-character string
each). Only when they differ do they all-gather the per-key digests, and :func:`mismatch_error`
names the first key that differs and the ranks holding each value. Cost: one sha256 pass over the
replicated values on every rank, per save (in the background thread when saving asynchronously).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tiered_ckpt.errors import ReplicatedMismatchError
from tiered_ckpt.format import shard_file as fmt
from tiered_ckpt.state import Replicated

__all__ = ["ReplicatedMismatchError", "combined_digest", "mismatch_error", "replicated_digests"]


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def _digest(value: Any, key: str) -> str:
    tree, entries = fmt.flatten_state(
        {"v": value}
    )  # validates as the writer does (no Replicated inside)
    h = hashlib.sha256(json.dumps(tree, sort_keys=True, allow_nan=True).encode())
    for e in entries:  # in the tree's order: the names are in the tree
        h.update(f"\n{e.name}|{e.code}|{list(e.array.shape)}\n".encode())
        h.update(e.array.reshape(-1).view(np.uint8))
    return h.hexdigest()


def _leaves(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            _leaves(f"{prefix}/{_escape(str(k))}", v, out)
    else:
        out[prefix] = value


def replicated_digests(state: Mapping[str, Any]) -> dict[str, str]:
    """``{key path: sha256 hex}`` of every :class:`Replicated` value in ``state``: one for each leaf
    inside it (an array or a JSON value, at its own key path, so that a mismatch names the tensor),
    and one at the value's own key path for its layout (the leaves' paths). Key paths as the shard
    files name them: keys joined by ``/``, ``%`` and ``/`` inside keys escaped. Raises
    :class:`~tiered_ckpt.errors.UnsupportedStateError` for a value the writer would refuse."""
    out: dict[str, str] = {}
    stack: list[tuple[str, Any]] = [("", state)]
    while stack:
        prefix, obj = stack.pop()
        for k, v in obj.items():
            key = f"{prefix}/{_escape(str(k))}" if prefix else _escape(str(k))
            if isinstance(v, Replicated):
                leaves: dict[str, Any] = {}
                _leaves(key, v.value, leaves)
                out[key] = hashlib.sha256(json.dumps(sorted(leaves)).encode()).hexdigest()
                out.update((leaf, _digest(x, leaf)) for leaf, x in leaves.items() if leaf != key)
                if key in leaves:  # the value is a leaf itself: its digest covers its layout
                    out[key] = _digest(leaves[key], key)
            elif isinstance(v, Mapping):
                stack.append((key, v))
    return out


def combined_digest(digests: Mapping[str, str]) -> str:
    """One sha256 over every ``(key, digest)`` pair, sorted: equal on two ranks iff their claims
    agree."""
    return hashlib.sha256(json.dumps(sorted(digests.items())).encode()).hexdigest()


def mismatch_error(step: int, per_rank: Sequence[Mapping[str, str]]) -> ReplicatedMismatchError:
    """The error for the gathered per-key digests ``per_rank[r]`` (rank ``r``'s) that disagree."""
    keys = sorted(set().union(*per_rank))
    bad = [k for k in keys if len({d.get(k) for d in per_rank}) > 1]
    key = bad[0] if bad else "?"
    groups: dict[str | None, list[int]] = {}
    for r, d in enumerate(per_rank):
        groups.setdefault(d.get(key), []).append(r)
    rank_groups = sorted(groups.values())
    shown = " vs ".join(str(g) for g in rank_groups)
    more = ""
    if len(bad) > 1:
        more = f" (and {len(bad) - 1} more key(s): {', '.join(bad[1:4])}{' ...' if len(bad) > 4 else ''})"
    return ReplicatedMismatchError(
        f"step {step}: {key!r} is saved as Replicated but differs between ranks (ranks holding equal values: "
        f"{shown}){more}; nothing was written: save values that differ per rank without the claim (tensor-, "
        "pipeline- and expert-parallel parts are not replicated)",
        key=key,
        rank_groups=rank_groups,
        keys=bad,
    )
