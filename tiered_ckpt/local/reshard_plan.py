"""Planning a reshard (SPEC §6): which key paths of a step are slices of a global tensor, replicated
values or per-rank values with a rule, checked over every old rank's state tree before anything is
read or written. Pure: works on the verified headers (trees and tensor indexes) and the manifest
only. The split rule, the rules and the presets are described in :mod:`tiered_ckpt.local.reshard`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Union

import numpy as np

from tiered_ckpt.errors import ManifestError, ReshardError, ShardCorruptedError
from tiered_ckpt.format.manifest import ShardManifest, TensorRecord, check_global_slices, numel
from tiered_ckpt.format.shard_file import ParsedHeader
from tiered_ckpt.format.validate import first_overlap
from tiered_ckpt.local.verified_read import copy_value

#: Deepest state tree a plan walks (as :func:`tiered_ckpt.format.shard_file.decode_state` refuses
#: deeper).
MAX_TREE_DEPTH = 256


class _Absent:
    _inst: _Absent | None = None

    def __new__(cls) -> _Absent:
        if cls._inst is None:
            cls._inst = super().__new__(cls)
        return cls._inst

    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False


#: Marks "no value at this key" in a rule's input (an old rank without the key) or output (omit it).
ABSENT: Any = _Absent()

Rule = Union[str, Callable[[list[Any], int], Sequence[Any]]]
Partition = Callable[[int, int], Sequence[tuple[int, int]]]
NAMED_RULES = ("take_rank0", "same", "by_rank", "drop")

#: The ``training`` preset: default rules for the per-rank values
#: :func:`tiered_ckpt.torch.capture_training_state` makes (see :mod:`tiered_ckpt.local.reshard`,
#: "Presets"). Keys ending in ``/`` are prefix rules.
TRAINING_RULES: Mapping[str, Rule] = MappingProxyType(
    {"rng/": "by_rank", "progress/": "same", "scheduler/": "same", "scaler/": "same"}
)
PRESETS: Mapping[str, Mapping[str, Rule]] = MappingProxyType({"training": TRAINING_RULES})


def even_split(n: int, world_size: int) -> list[tuple[int, int]]:
    """``(offset, count)`` of each of ``world_size`` ranks over ``n`` elements (or rows): ``q, r =
    divmod(n, world_size)``, rank ``i`` starts at ``i*q + min(i, r)`` and holds ``q + (i < r)``
    (``numpy.array_split`` / ``torch.tensor_split``). Zero-size parts when ``n < world_size``."""
    if world_size < 1 or n < 0:
        raise ValueError(f"cannot split {n} over {world_size} ranks")
    q, r = divmod(n, world_size)
    return [(i * q + min(i, r), q + (1 if i < r else 0)) for i in range(world_size)]


# --- planning


@dataclass(frozen=True)
class SliceNode:
    key: str
    dtype: str
    global_shape: tuple[int, ...]
    sources: tuple[tuple[int, TensorRecord], ...]  # (old rank, record)


@dataclass(frozen=True)
class ReplicatedNode:
    key: str
    path: tuple[str, ...]
    node: (
        Any  # the value's node in the shard of old rank ``owner`` (the lowest rank holding a copy)
    )
    owner: int = 0


@dataclass(frozen=True)
class RuledNode:
    key: str
    rule: Rule
    nodes: tuple[Any, ...]  # per old rank: its node, or None
    owner: int | None = (
        None  # a Replicated value: every present rank's node is the copy in this rank's file
    )


@dataclass(frozen=True)
class DictNode:
    children: tuple[tuple[str, Any], ...]


def rule_matches(rule_key: str, key: str) -> bool:
    """Whether the rule ``rule_key`` covers key path ``key``: a key ending in ``/`` is a prefix rule
    (``key`` is the prefix without its ``/``, or lies under it), any other names one key path."""
    if rule_key.endswith("/"):
        return key == rule_key[:-1] or key.startswith(rule_key)
    return key == rule_key


def _group_items(parts: list[list[str]], depth: int) -> list[str]:
    groups: dict[tuple[str, ...], list[str]] = {}
    for p in parts:
        groups.setdefault(tuple(p[: min(depth, len(p) - 1)]), []).append("/".join(p))
    items: list[tuple[str, str]] = []
    for pre, keys in groups.items():
        if not pre or len(keys) <= 2:
            items += [(k, k) for k in keys]
        else:
            items.append(("/".join(pre), f"{'/'.join(pre)}/* ({len(keys)} keys)"))
    return [text for _, text in sorted(items)]


def group_keys(keys: Sequence[str], limit: int = 8) -> str:
    """``keys`` (key paths) in at most ``limit`` items, each a key or ``PREFIX/* (N keys)``: grouped
    by their parent, and coarser (by grandparent, ...) while there are more than ``limit`` items;
    past that the first ``limit`` items and how many more. Every key lies under one item shown or
    counted."""
    parts = [k.split("/") for k in sorted(set(keys))]
    if not parts:
        return ""
    items: list[str] = []
    for depth in range(max(max(len(p) for p in parts) - 1, 1), 0, -1):
        items = _group_items(parts, depth)
        if len(items) <= limit:
            return ", ".join(items)
    return (
        f"{', '.join(items[:limit])} ... and {len(items) - limit} more ({len(parts)} keys in all)"
    )


def unruled_message(
    step: int, world_size: int, keys: Sequence[str], *, cli: bool = False, preset: bool = False
) -> str:
    """The one-line :class:`ReshardError` message for per-rank ``keys`` without a rule, in the terms
    of the Python API or (``cli``) of ``tiered-ckpt reshard``; ``preset``: a preset's rules were in
    force (they rule only what the torch adapter saves per rank)."""
    head = (
        f"cannot reshard step {step} from {world_size} ranks: per-rank state without a rule at "
        f"{group_keys(keys)}; "
    )
    if preset:
        head += (
            "the training preset rules only what tiered_ckpt.torch.capture_training_state saves per rank "
            "(rng/, progress/, scheduler/, scaler/); a model or optimizer that is the same on every "
            "data-parallel rank is saved Replicated by capture_training_state(..., replicated_group=...); "
        )
        return head + (
            "else pass --rule KEY=RULE for these keys, e.g. --rule model/=take_rank0"
            if cli
            else "else pass rules={KEY: RULE} for these keys"
        )
    if cli:
        return head + (
            f"pass --preset training or --rule KEY=RULE (RULE: {', '.join(NAMED_RULES)}; a KEY ending "
            "in / rules every per-rank value under it, e.g. --rule rng/=by_rank)"
        )
    return head + (
        f"pass preset='training' or rules={{KEY: RULE}} (RULE: {', '.join(NAMED_RULES)} or a callable; "
        "a KEY ending in / rules every per-rank value under it), or save such values as Replicated "
        "or GlobalSlice"
    )


def _equal(a: Any, b: Any) -> bool:
    """Materialized values equal: arrays by dtype, shape and bytes; dicts key by key; JSON by its
    text."""
    if a is ABSENT or b is ABSENT:
        return a is b
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_equal(a[k], b[k]) for k in a)
        )
    return json.dumps(a, allow_nan=True, sort_keys=True) == json.dumps(
        b, allow_nan=True, sort_keys=True
    )


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"


def apply_named_rule(rule: str, key: str, old: list[Any], new_world_size: int) -> list[Any]:
    """The new ranks' values at ``key`` by the named ``rule`` from the old ranks' (``ABSENT`` where
    a rank has none; fresh values, which the result may hold); see :mod:`tiered_ckpt.local.reshard`,
    "Rules". Raises :class:`ReshardError`
    (``take_rank0`` without a rank-0 value, ``same`` over values that differ)."""
    if rule == "drop":
        return [ABSENT] * new_world_size
    if rule == "by_rank":
        return [old[j] if j < len(old) else ABSENT for j in range(new_world_size)]
    if rule == "take_rank0" and old[0] is ABSENT:
        raise ReshardError(f"rule 'take_rank0' for {key!r}: old rank 0 has no value there")
    if rule == "same":
        differ = [r for r, v in enumerate(old) if not _equal(v, old[0])]
        if differ:
            agree = [r for r in range(len(old)) if r not in differ]
            raise ReshardError(
                f"rule 'same' for {key!r}: old ranks hold different values ({_ranks(agree)} "
                f"{'agree' if len(agree) > 1 else 'holds one'}, {_ranks(differ)} "
                f"{'differ' if len(differ) > 1 else 'differs'}); give this key another rule"
            )
        if old[0] is ABSENT:
            return [ABSENT] * new_world_size
    assert rule in ("take_rank0", "same"), rule
    return [old[0]] + [copy_value(old[0]) for _ in range(new_world_size - 1)]


def _holds_ref(node: Any, depth: int = 0) -> bool:
    """Whether a state-tree node holds a Replicated value (``{"r": ...}``) anywhere inside it."""
    if depth > MAX_TREE_DEPTH or not isinstance(node, dict) or len(node) != 1:
        return False
    ((kind, val),) = node.items()
    return kind == "r" or (
        kind == "d"
        and isinstance(val, dict)
        and any(_holds_ref(v, depth + 1) for v in val.values())
    )


def escape_key(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def node_kind(node: Any, where: str) -> str:
    if not isinstance(node, dict) or len(node) != 1:
        raise ShardCorruptedError(f"{where}: state tree node is malformed")
    return next(iter(node))


class Planner:
    """The plan of a reshard from every old rank's verified header (``headers[r]``: its state tree
    and tensor records, :func:`tiered_ckpt.local.verified_read.verified_header`). Checks the slices of each
    global tensor across ranks first (agree on shape and dtype, do not overlap: ManifestError), as
    the manifest reader did when manifests listed every tensor. ``rules``: the caller's (each must
    name a key of the step, or a prefix of one); ``defaults``: a preset's (applied to per-rank
    values only, never an error when they match nothing)."""

    def __init__(
        self,
        manifest: ShardManifest,
        headers: Sequence[ParsedHeader],
        rules: Mapping[str, Rule],
        defaults: Mapping[str, Rule] | None = None,
    ) -> None:
        self.m = manifest
        self.trees = [h.metadata["tree"] for h in headers]
        self.rules = {k: v for k, v in rules.items() if not k.endswith("/")}
        self.prefix_rules = {k: v for k, v in rules.items() if k.endswith("/")}
        self.defaults = dict(defaults or {})
        self.used_rules: set[str] = set()
        self.per_rank: list[str] = []
        self.problems: list[str] = []
        self.recs = [{t.name: t for t in h.tensors} for h in headers]
        check_global_slices(manifest.step, enumerate(h.tensors for h in headers))

    def plan(self) -> DictNode:
        for key, rule in [*self.rules.items(), *self.prefix_rules.items(), *self.defaults.items()]:
            if not isinstance(key, str) or key.strip("/") == "":
                raise ValueError(f"a rule needs a key path, got {key!r}")
            if not callable(rule) and rule not in NAMED_RULES:
                raise ValueError(
                    f"rule for {key!r} must be a callable or one of {NAMED_RULES}, got {rule!r}"
                )
        root = self._walk((), list(self.trees))
        unused = sorted((set(self.rules) | set(self.prefix_rules)) - self.used_rules)
        if unused:
            raise ReshardError(f"rules name key(s) not in step {self.m.step}: {unused[:10]}")
        if self.per_rank:
            preset = bool(self.defaults)
            err = ReshardError(
                unruled_message(self.m.step, self.m.world_size, self.per_rank, preset=preset)
            )
            # the same in tiered-ckpt reshard's terms, for the command line to show
            err.cli_message = unruled_message(  # type: ignore[attr-defined]
                self.m.step, self.m.world_size, self.per_rank, cli=True, preset=preset
            )
            raise err
        if self.problems:
            raise ReshardError(
                f"cannot reshard step {self.m.step}: " + "; ".join(self.problems[:5])
            )
        assert isinstance(root, DictNode)
        return root

    def _walk(self, path: tuple[str, ...], nodes: list[Any]) -> Any:
        key = "/".join(escape_key(p) for p in path)
        if len(path) > MAX_TREE_DEPTH:
            raise ShardCorruptedError(
                f"step {self.m.step}: state tree nested deeper than {MAX_TREE_DEPTH} levels "
                f"at {key[:80]!r}"
            )
        present = [(r, n) for r, n in enumerate(nodes) if n is not None]
        kinds = {node_kind(n, f"step {self.m.step} rank {r} key {key!r}") for r, n in present}
        if path:
            self.used_rules.update(p for p in self.prefix_rules if rule_matches(p, key))
            if key in self.rules:
                self.used_rules.add(key)
                return self._exact_rule(key, nodes, kinds)
        if kinds == {"d"}:
            order: dict[str, None] = {}
            for _, n in present:
                if not isinstance(n["d"], dict):
                    raise ShardCorruptedError(
                        f"step {self.m.step}: state tree dict node {key!r} is malformed"
                    )
                order.update(dict.fromkeys(n["d"]))
            return DictNode(
                tuple(
                    (
                        k,
                        self._walk(
                            path + (k,), [n["d"].get(k) if n is not None else None for n in nodes]
                        ),
                    )
                    for k in order
                )
            )
        if kinds == {"r"}:
            owner, copy = self._copy(key, present)
            return ReplicatedNode(key, path, copy, owner)
        if kinds == {"t"}:
            recs = []
            for r, n in present:
                t = self.recs[r].get(n["t"]) if isinstance(n["t"], str) else None
                if t is None:
                    raise ShardCorruptedError(
                        f"step {self.m.step} rank {r}: state tree names unknown tensor "
                        f"{str(n['t'])[:80]!r}"
                    )
                recs.append((r, t))
            if all(t.global_shape is not None for _, t in recs):
                return self._slice(key, recs)
        rule = self._prefix_rule(key)
        if rule is not None:
            return RuledNode(key, rule, tuple(nodes))
        self.per_rank.append(key)
        return None

    def _copy(self, key: str, present: list[tuple[int, Any]]) -> tuple[int, Any]:
        """``(rank, node)`` of the lowest rank whose shard holds the Replicated value at ``key``
        (each node's first rank stores one; the copies are identical, checked at save)."""
        for r, n in present:
            if n["r"] is not None:
                return r, n["r"]
        raise ShardCorruptedError(
            f"step {self.m.step}: replicated value {key!r} is stored in no rank's shard"
        )

    def _exact_rule(self, key: str, nodes: list[Any], kinds: set[str]) -> RuledNode:
        """The caller's rule at ``key`` itself (it gets the whole value there, whatever it is)."""
        if kinds == {"r"}:
            owner, copy = self._copy(key, [(r, n) for r, n in enumerate(nodes) if n is not None])
            return RuledNode(
                key, self.rules[key], tuple(copy if n is not None else None for n in nodes), owner
            )
        if any(_holds_ref(n) for n in nodes if n is not None):
            raise ReshardError(
                f"rule for {key!r} covers a Replicated value inside it; rule the per-rank keys under "
                "it instead (a KEY ending in / rules every per-rank value under it)"
            )
        return RuledNode(key, self.rules[key], tuple(nodes))

    def _prefix_rule(self, key: str) -> Rule | None:
        """The rule for the per-rank value at ``key``: the caller's longest matching prefix rule,
        else the preset's longest matching rule, else ``None``."""
        for table in (self.prefix_rules, self.defaults):
            hits = [p for p in table if rule_matches(p, key)]
            if hits:
                return table[max(hits, key=len)]
        return None

    def _slice(self, key: str, recs: list[tuple[int, TensorRecord]]) -> SliceNode | None:
        """The slices at ``key`` (one per old rank holding it, whatever each file names its tensor:
        the per-name check of :func:`check_global_slices` does not cover tensors named apart) agree
        on the global shape and dtype and do not overlap (ManifestError), and tile the global tensor
        (else a problem: ReshardError)."""
        gs, dt = recs[0][1].global_shape, recs[0][1].dtype
        assert gs is not None
        for r, t in recs:
            if t.global_shape != gs or t.dtype != dt:
                raise ManifestError(
                    f"step {self.m.step}: slices at {key[:80]!r} disagree on global shape/dtype "
                    f"(rank {r}: {t.dtype} {list(t.global_shape or ())}, rank {recs[0][0]}: "
                    f"{dt} {list(gs)})"
                )
        nonempty = [(r, t) for r, t in recs if numel(t.shape) > 0]
        pair = first_overlap([(t.global_offset or (), t.shape) for _, t in nonempty])
        if pair is not None:
            raise ManifestError(
                f"step {self.m.step}: slices at {key[:80]!r} on ranks {nonempty[pair[0]][0]} and "
                f"{nonempty[pair[1]][0]} overlap"
            )
        if len(gs) == 0:
            self.problems.append(f"{key!r} is a 0-d GlobalSlice (save it as Replicated)")
            return None
        have = sum(numel(t.shape) for _, t in recs)
        if have != numel(gs):
            self.problems.append(
                f"the slices of {key!r} hold {have} of its {numel(gs)} elements "
                f"(global shape {list(gs)}): they do not tile the global tensor"
            )
            return None
        return SliceNode(key, recs[0][1].dtype, gs, tuple(recs))


__all__ = [
    "ABSENT",
    "NAMED_RULES",
    "PRESETS",
    "TRAINING_RULES",
    "DictNode",
    "Partition",
    "Planner",
    "ReplicatedNode",
    "Rule",
    "RuledNode",
    "SliceNode",
    "apply_named_rule",
    "escape_key",
    "even_split",
    "group_keys",
    "node_kind",
    "rule_matches",
    "unruled_message",
]
