"""Planning a reshard (SPEC §6): which key paths of a step are slices of a global tensor, replicated
values or per-rank values with a rule, checked over every old rank's state tree before anything is read
or written. Pure: works on the verified headers (trees and tensor indexes) and the manifest only. The
split rule and the rules are described in :mod:`tiered_ckpt.local.reshard`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, Union

from tiered_ckpt.errors import ManifestError, ReshardError, ShardCorruptedError
from tiered_ckpt.format.manifest import ShardManifest, TensorRecord, check_global_slices, numel
from tiered_ckpt.format.shard_file import ParsedHeader
from tiered_ckpt.format.validate import first_overlap

#: Deepest state tree a plan walks (as :func:`tiered_ckpt.format.shard_file.decode_state` refuses deeper).
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
NAMED_RULES = ("take_rank0", "drop")


def even_split(n: int, world_size: int) -> list[tuple[int, int]]:
    """``(offset, count)`` of each of ``world_size`` ranks over ``n`` elements (or rows): ``q, r =
    divmod(n, world_size)``, rank ``i`` starts at ``i*q + min(i, r)`` and holds ``q + (i < r)``
    (``numpy.array_split`` / ``torch.tensor_split``). Zero-size parts when ``n < world_size``."""
    if world_size < 1 or n < 0:
        raise ValueError(f"cannot split {n} over {world_size} ranks")
    q, r = divmod(n, world_size)
    return [(i * q + min(i, r), q + (1 if i < r else 0)) for i in range(world_size)]


# --------------------------------------------------------------------------------------------- planning


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
    node: Any  # rank 0's node of the value


@dataclass(frozen=True)
class RuledNode:
    key: str
    rule: Rule
    nodes: tuple[Any, ...]  # per old rank: its node, or None


@dataclass(frozen=True)
class DictNode:
    children: tuple[tuple[str, Any], ...]


def escape_key(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def node_kind(node: Any, where: str) -> str:
    if not isinstance(node, dict) or len(node) != 1:
        raise ShardCorruptedError(f"{where}: state tree node is malformed")
    return next(iter(node))


class Planner:
    """The plan of a reshard from every old rank's verified header (``headers[r]``: its state tree and
    tensor records, :func:`tiered_ckpt.local.reader.verified_header`). Checks the slices of each global
    tensor across ranks first (agree on shape and dtype, do not overlap: ManifestError), as the manifest
    reader did when manifests listed every tensor."""

    def __init__(self, manifest: ShardManifest, headers: Sequence[ParsedHeader], rules: Mapping[str, Rule]) -> None:
        self.m = manifest
        self.trees = [h.metadata["tree"] for h in headers]
        self.rules = dict(rules)
        self.used_rules: set[str] = set()
        self.per_rank: list[str] = []
        self.problems: list[str] = []
        self.recs = [{t.name: t for t in h.tensors} for h in headers]
        check_global_slices(manifest.step, enumerate(h.tensors for h in headers))

    def plan(self) -> DictNode:
        for key, rule in self.rules.items():
            if not callable(rule) and rule not in NAMED_RULES:
                raise ValueError(f"rule for {key!r} must be a callable or one of {NAMED_RULES}, got {rule!r}")
        root = self._walk((), list(self.trees))
        unused = sorted(set(self.rules) - self.used_rules)
        if unused:
            raise ReshardError(f"rules name key(s) not in step {self.m.step}: {unused[:10]}")
        if self.per_rank:
            keys = sorted(self.per_rank)
            raise ReshardError(
                f"cannot reshard step {self.m.step} from {self.m.world_size} ranks: per-rank state without a "
                f"rule at key(s) {', '.join(keys[:20])}{' ...' if len(keys) > 20 else ''} (pass rules="
                "{key: callable(old_values, new_world_size) | 'take_rank0' | 'drop'}, or save the value as "
                "Replicated or GlobalSlice)")
        if self.problems:
            raise ReshardError(f"cannot reshard step {self.m.step}: " + "; ".join(self.problems[:5]))
        assert isinstance(root, DictNode)
        return root

    def _walk(self, path: tuple[str, ...], nodes: list[Any]) -> Any:
        key = "/".join(escape_key(p) for p in path)
        if len(path) > MAX_TREE_DEPTH:
            raise ShardCorruptedError(f"step {self.m.step}: state tree nested deeper than {MAX_TREE_DEPTH} levels "
                                      f"at {key[:80]!r}")
        if path and key in self.rules:
            self.used_rules.add(key)
            return RuledNode(key, self.rules[key], tuple(nodes))
        present = [(r, n) for r, n in enumerate(nodes) if n is not None]
        kinds = {node_kind(n, f"step {self.m.step} rank {r} key {key!r}") for r, n in present}
        if kinds == {"d"}:
            order: dict[str, None] = {}
            for _, n in present:
                if not isinstance(n["d"], dict):
                    raise ShardCorruptedError(f"step {self.m.step}: state tree dict node {key!r} is malformed")
                order.update(dict.fromkeys(n["d"]))
            return DictNode(tuple((k, self._walk(path + (k,), [n["d"].get(k) if n is not None else None
                                                          for n in nodes])) for k in order))
        if kinds == {"r"}:
            owner = nodes[0]["r"] if nodes[0] is not None else None
            if owner is None:
                raise ShardCorruptedError(f"step {self.m.step}: replicated value {key!r} is missing from rank "
                                          "0's shard")
            return ReplicatedNode(key, path, owner)
        if kinds == {"t"}:
            recs = []
            for r, n in present:
                t = self.recs[r].get(n["t"]) if isinstance(n["t"], str) else None
                if t is None:
                    raise ShardCorruptedError(f"step {self.m.step} rank {r}: state tree names unknown tensor "
                                              f"{str(n['t'])[:80]!r}")
                recs.append((r, t))
            if all(t.global_shape is not None for _, t in recs):
                return self._slice(key, recs)
        self.per_rank.append(key)
        return None

    def _slice(self, key: str, recs: list[tuple[int, TensorRecord]]) -> SliceNode | None:
        """The slices at ``key`` (one per old rank holding it, whatever each file names its tensor: the
        per-name check of :func:`check_global_slices` does not cover tensors named apart) agree on the
        global shape and dtype and do not overlap (ManifestError), and tile the global tensor (else a
        problem: ReshardError)."""
        gs, dt = recs[0][1].global_shape, recs[0][1].dtype
        assert gs is not None
        for r, t in recs:
            if t.global_shape != gs or t.dtype != dt:
                raise ManifestError(f"step {self.m.step}: slices at {key[:80]!r} disagree on global shape/dtype "
                                    f"(rank {r}: {t.dtype} {list(t.global_shape or ())}, rank {recs[0][0]}: "
                                    f"{dt} {list(gs)})")
        nonempty = [(r, t) for r, t in recs if numel(t.shape) > 0]
        pair = first_overlap([(t.global_offset or (), t.shape) for _, t in nonempty])
        if pair is not None:
            raise ManifestError(f"step {self.m.step}: slices at {key[:80]!r} on ranks {nonempty[pair[0]][0]} and "
                                f"{nonempty[pair[1]][0]} overlap")
        if len(gs) == 0:
            self.problems.append(f"{key!r} is a 0-d GlobalSlice (save it as Replicated)")
            return None
        have = sum(numel(t.shape) for _, t in recs)
        if have != numel(gs):
            self.problems.append(f"the slices of {key!r} hold {have} of its {numel(gs)} elements "
                                 f"(global shape {list(gs)}): they do not tile the global tensor")
            return None
        return SliceNode(key, recs[0][1].dtype, gs, tuple(recs))


__all__ = ["ABSENT", "NAMED_RULES", "DictNode", "Partition", "Planner", "ReplicatedNode", "Rule",
           "RuledNode", "SliceNode", "escape_key", "even_split", "node_kind"]
