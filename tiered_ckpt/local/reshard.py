"""Load an N-rank checkpoint with M ranks, or rewrite it as an M-rank checkpoint (SPEC §6).

What is resharded, and how
--------------------------
A step's per-rank states (the trees in each shard's header) are merged key path by key path:

- **Slices of a global tensor** (saved as :class:`~tiered_ckpt.state.GlobalSlice`; a ZeRO flat
  partition is the 1-D case): the old slices must tile the global tensor exactly (else
  :class:`ReshardError`). The global tensor is re-split along **dim 0** with :func:`even_split`: of
  ``n`` rows and ``M`` ranks, ``q, r = divmod(n, M)`` and rank ``i`` gets rows ``[i*q + min(i, r),
  +q + (1 if i < r else 0))`` -- the first ``r`` ranks get one row more. This is
  ``numpy.array_split`` / ``torch.tensor_split(x, M)`` (not ``torch.chunk``, which may return fewer
  than ``M`` pieces). Ranks beyond ``n`` get zero-size slices; every new rank holds every global
  tensor (possibly empty). Other dimensions are kept whole. A new shard's
  ``param_shard_offset/numel`` are the same split of the flat parameter vector (the old ZeRO
  partitions must tile ``[0, P)``). A custom ``partition(n, M) -> [(offset, count), ...]`` may be
  passed instead (it must tile ``[0, n)`` in rank order).
- **Replicated values** (:class:`~tiered_ckpt.state.Replicated`, stored once per node: in the shard
  of each node's first rank, rank 0 always among them): given to every new rank, read from the
  lowest old rank holding a copy (the copies are identical: the save checked it), and stored once
  again, in the first new rank of every group of ``ranks_per_node`` (default: new rank 0 alone).
- **Anything else** (a JSON value or a plain array that differs per rank: a data-loader cursor, a
  per-rank RNG) is per-rank state: :class:`ReshardError` names every such key (grouped by prefix),
  unless a rule covers it. Values are never guessed from equal bytes.

Rules
-----
``rules`` maps a key path to a rule. Key paths are the keys joined by ``/`` (a ``/`` or ``%`` inside
a key written ``%2F`` / ``%25``), the shard files' tensor names. A key ending in ``/`` is a **prefix
rule**: it rules every per-rank value at or under that key path, one value at a time, while slices
and Replicated values under it are resharded as usual (``{"rng/": "by_rank"}``); the longest prefix
wins. Any other key rules the value at exactly that path, whole (a dict with everything in it, or a
Replicated value), in place of the above. Every key of ``rules`` must name a key path of the step
(or a prefix of one: a typo must not pass silently). A rule is a name:

- ``"take_rank0"``: every new rank gets a copy of old rank 0's value;
- ``"same"``: every old rank holds an equal value (arrays: dtype, shape and bytes; JSON: equal),
  which every new rank gets; else :class:`ReshardError` naming the key and the ranks that differ
  (counters and the data position of a data-parallel job, which every rank advances in lockstep);
- ``"by_rank"``: new rank ``j`` gets old rank ``j``'s value; new ranks beyond the old world size get
  none (the key is left out there: the job starts that value afresh, e.g. seeds that rank's RNG);
- ``"drop"``: the key is left out on every new rank (dropped because the caller said so);

or a callable ``rule(old_values, new_world_size) -> new_values`` (``old_values[k]`` is old rank
``k``'s value, :data:`ABSENT` where that rank has none; it returns one value per new rank,
:data:`ABSENT` to omit the key there). A dict all of whose keys a rule left out is left out too.

Presets
-------
``preset="training"`` (``tiered-ckpt reshard --preset training``; the mapping is
:data:`TRAINING_RULES`) adds default rules for the per-rank values the torch adapter
(:func:`tiered_ckpt.torch.capture_training_state`) makes; they apply to per-rank values only, yield
to the caller's ``rules``, and are no error where they match nothing:

- ``rng/``: ``by_rank``. Each new rank continues one old rank's streams, so the streams stay
  distinct and the resumed job is deterministic; a rank the old job lacked gets no ``rng`` (seed it
  as at a fresh start; :func:`~tiered_ckpt.torch.restore_training_state` with ``rng="rng" in
  state``). Copying rank 0's streams to every rank would give every rank the same dropout masks.
- ``progress/``, ``scheduler/``, ``scaler/``: ``same``. Every rank of a data-parallel job holds the
  same step, data position (:class:`tiered_ckpt.data.ShuffledBatchSampler` splits one global batch),
  schedule and loss scale; a value that differs per rank (a per-rank data stream) is refused, not
  guessed. Saved with ``capture_training_state(..., replicated_group=...)`` they are Replicated and
  need no rule at all.

Anything else per-rank (model or optimizer state saved per rank without a claim) needs the caller's
rule.

Reads
-----
Only the byte ranges each new rank needs are read: the headers of the old shards (``8 + header``
bytes each), and for a slice the rows of each old slice that overlap the new rank's rows (contiguous
in C order, one ``pread`` each), widened to the per-tensor CRC32C chunk grid (at most ``2 *
crc32c_chunk_bytes`` extra per range; 1 MiB chunks by default) so that exactly the bytes read are
verified. A step saved with manifest schema v1 (no chunk checksums) is verified whole against its
sha256 first. :attr:`ReshardResult.bytes_read` counts every byte read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

from tiered_ckpt.errors import CheckpointExistsError, ReshardError
from tiered_ckpt.format import shard_file as fmt
from tiered_ckpt.format.manifest import ShardManifest, numel
from tiered_ckpt.fs import new_save_id
from tiered_ckpt.layout import MAX_WORLD_SIZE, parse_step_dir_name, step_dir_name
from tiered_ckpt.local.catalogue import is_committed, pick_step, read_manifest, write_root
from tiered_ckpt.local.commit import commit_step
from tiered_ckpt.local.reshard_plan import (
    ABSENT,
    NAMED_RULES,
    PRESETS,
    TRAINING_RULES,
    DictNode,
    Partition,
    Planner,
    ReplicatedNode,
    Rule,
    RuledNode,
    SliceNode,
    apply_named_rule,
    even_split,
)
from tiered_ckpt.local.verified_read import ReadLock, ReadStats, ShardReader, copy_value
from tiered_ckpt.local.writer import write_shard
from tiered_ckpt.state import GlobalSlice, Replicated

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class ReshardResult:
    """What :func:`reshard` did: the new ``manifest``; ``bytes_read`` of the old shard files
    (headers and chunk alignment included); ``bytes_needed``: bytes of the re-split global tensors
    the new ranks hold (Replicated values and rule outputs not counted); ``source_world_size``;
    ``source_bytes``: total size of the old shard files."""

    manifest: ShardManifest
    source_world_size: int
    bytes_read: int
    bytes_needed: int
    source_bytes: int


# --- building


class _Builder:
    """Builds new ranks' states from a plan, reading through one :class:`ShardReader` per old
    rank."""

    def __init__(
        self,
        sdir: Path,
        m: ShardManifest,
        new_world_size: int,
        partition: Partition,
        stats: ReadStats,
        for_write: bool,
    ) -> None:
        self.sdir, self.m, self.M = sdir, m, new_world_size
        self.partition = partition
        self.stats = stats
        self.for_write = for_write
        self.readers: dict[int, ShardReader] = {}
        self.splits: dict[int, list[tuple[int, int]]] = {}
        self.rep_cache: dict[str, Any] = {}
        self.rule_cache: dict[str, list[Any]] = {}
        self.bytes_needed = 0

    def reader(self, rank: int) -> ShardReader:
        rd = self.readers.get(rank)
        if rd is None:
            rd = self.readers[rank] = ShardReader(self.sdir, self.m, rank, self.stats)
        return rd

    def close(self) -> None:
        for rd in self.readers.values():
            rd.close()

    def split(self, n: int) -> list[tuple[int, int]]:
        s = self.splits.get(n)
        if s is None:
            s = [(int(o), int(c)) for o, c in self.partition(n, self.M)]
            pos = 0
            for o, c in s:
                if o != pos or c < 0:
                    raise ReshardError(
                        f"partition({n}, {self.M}) = {s[:8]} does not tile [0, {n}) in rank order"
                    )
                pos += c
            if len(s) != self.M or pos != n:
                raise ReshardError(
                    f"partition({n}, {self.M}) does not give {self.M} parts tiling [0, {n})"
                )
            self.splits[n] = s
        return s

    def build(self, node: Any, j: int, top: bool = True) -> Any:
        if isinstance(node, DictNode):
            out = {}
            for k, child in node.children:
                v = self.build(child, j, False)
                if v is not ABSENT:
                    out[k] = v
            return ABSENT if node.children and not out and not top else out  # every key ruled out
        if isinstance(node, SliceNode):
            return self.slice(node, j)
        if isinstance(node, ReplicatedNode):
            if node.key not in self.rep_cache:
                self.rep_cache[node.key] = self.reader(node.owner).materialize(
                    node.node, node.key, len(node.path) + 1
                )
            v = self.rep_cache[node.key]
            return Replicated(v) if self.for_write else copy_value(v)
        if isinstance(node, RuledNode):
            return self.ruled(node, j)
        raise AssertionError(node)  # pragma: no cover

    def slice(self, sl: SliceNode, j: int) -> Any:
        gs = sl.global_shape
        a, cnt = self.split(gs[0])[j]
        b = a + cnt
        dt = fmt.numpy_dtype(sl.dtype)
        out = np.empty((cnt,) + gs[1:], dtype=dt)
        self.bytes_needed += out.nbytes
        for rank, t in sl.sources:
            assert t.global_offset is not None
            o0, s0 = t.global_offset[0], t.shape[0]
            lo, hi = max(a, o0), min(b, o0 + s0)
            if lo >= hi or numel(t.shape) == 0:
                continue
            row = numel(t.shape[1:]) * dt.itemsize
            mv = self.reader(rank).read_range(t.name, (lo - o0) * row, (hi - o0) * row)
            block = np.frombuffer(mv, dtype=dt).reshape((hi - lo,) + t.shape[1:])
            idx = (slice(lo - a, hi - a),) + tuple(
                slice(o, o + s) for o, s in zip(t.global_offset[1:], t.shape[1:])
            )
            out[idx] = block
        if self.for_write:
            return GlobalSlice(out, gs, (a,) + (0,) * (len(gs) - 1))
        return out

    def ruled(self, node: RuledNode, j: int) -> Any:
        new = self.rule_cache.get(node.key)
        if new is None:
            if (
                node.owner is not None
            ):  # a Replicated value: the one copy, for every rank holding the key
                one = next(n for n in node.nodes if n is not None)
                v = self.reader(node.owner).materialize(one, node.key)
                old = [copy_value(v) if n is not None else ABSENT for n in node.nodes]
            else:
                old = [
                    self.reader(r).materialize(n, node.key) if n is not None else ABSENT
                    for r, n in enumerate(node.nodes)
                ]
            if isinstance(node.rule, str):
                new = apply_named_rule(node.rule, node.key, old, self.M)
                if node.rule == "drop":
                    log.info("reshard step %d: dropping %r as the rule asks", self.m.step, node.key)
            else:
                assert callable(node.rule)
                try:
                    new = list(node.rule(old, self.M))
                except ReshardError:
                    raise
                except Exception as e:
                    raise ReshardError(
                        f"rule for {node.key!r} failed: {type(e).__name__}: {e}"
                    ) from e
                if len(new) != self.M:
                    raise ReshardError(
                        f"rule for {node.key!r} returned {len(new)} values for {self.M} ranks"
                    )
            self.rule_cache[node.key] = new
        return new[j]


def _read_headers(m: ShardManifest, builder: _Builder) -> list[fmt.ParsedHeader]:
    """Every old rank's verified header: its state tree and tensor index (one read of ``8 + header``
    bytes each)."""
    return [builder.reader(r).header() for r in range(m.world_size)]


def reshard_states(
    root: PathLike,
    step: int | None,
    new_world_size: int,
    *,
    ranks: Sequence[int] | None = None,
    rules: Mapping[str, Rule] | None = None,
    preset: str | Mapping[str, Rule] | None = None,
    partition: Partition = even_split,
    manifest: ShardManifest | None = None,
    stats: ReadStats | None = None,
) -> list[dict[str, Any]]:
    """The states of new ranks ``ranks`` (default: all ``new_world_size``) of ``step`` re-split for
    ``new_world_size`` ranks, as a load returns them (plain arrays; Replicated values plain, a copy
    per rank). This is what ``load_shard``/``load_sharded(..., reshard=True)`` call. ``rules`` and
    ``preset``: see the module docstring.

    Raises :class:`ReshardError` (per-rank state without a rule, slices that do not tile, a bad rule
    or partition, values a ``same`` rule finds different), ``ValueError`` (an unknown preset or a
    malformed rule), and the loaders' errors (:class:`ShardCorruptedError` when a byte read fails
    its checksum, :class:`MissingShardError`, :class:`ManifestError`, :class:`NoCheckpointError`).
    """
    if new_world_size < 1:
        raise ValueError(f"new_world_size must be >= 1, got {new_world_size}")
    r, step = pick_step(root, step)
    m = manifest if manifest is not None else read_manifest(r, step)
    want = list(range(new_world_size)) if ranks is None else list(ranks)
    for j in want:
        if not 0 <= j < new_world_size:
            raise ValueError(f"rank {j} is outside world_size {new_world_size}")
    sdir = r / step_dir_name(step)
    stats = stats if stats is not None else ReadStats()
    defaults = preset_rules(preset)
    b = _Builder(sdir, m, new_world_size, partition, stats, for_write=False)
    with ReadLock(sdir):
        try:
            plan = Planner(m, _read_headers(m, b), rules or {}, defaults).plan()
            out = [b.build(plan, j) for j in want]
        finally:
            b.close()
    log.info(
        "step %d: resharded %d -> %d ranks for load (ranks %s): %d bytes read, %d needed",
        step,
        m.world_size,
        new_world_size,
        want[:8],
        stats.bytes_read,
        b.bytes_needed,
    )
    return out


def preset_rules(preset: str | Mapping[str, Rule] | None) -> Mapping[str, Rule]:
    """The default rules of ``preset``: a name of :data:`PRESETS` (``"training"``), a mapping of
    rules (taken as a preset's), or ``None`` (none). Raises ``ValueError`` for an unknown name."""
    if preset is None:
        return {}
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown reshard preset {preset!r}; presets: {', '.join(PRESETS)}")
        return PRESETS[preset]
    return preset


def _new_param_shards(
    m: ShardManifest, split: Callable[[int], list[tuple[int, int]]], M: int
) -> list[tuple[int, int]]:
    spans = sorted(
        (s.param_shard_offset, s.param_shard_numel) for s in m.shards if s.param_shard_numel > 0
    )
    if not spans:
        return [(0, 0)] * M
    pos = 0
    for off, n in spans:
        if off != pos:
            raise ReshardError(
                f"step {m.step}: the ZeRO partitions (param_shard_offset/numel) do not tile "
                f"[0, P): a gap or overlap at element {pos}"
            )
        pos += n
    return split(pos)


def reshard(
    root: PathLike,
    step: int | None,
    new_world_size: int,
    out_root: PathLike,
    *,
    rules: Mapping[str, Rule] | None = None,
    preset: str | Mapping[str, Rule] | None = None,
    partition: Partition = even_split,
    replace: bool = False,
    ranks_per_node: int | None = None,
) -> ReshardResult:
    """Write ``step`` of ``root`` (newest committed when ``None``) as a committed
    ``new_world_size``-rank checkpoint of the same step number under ``out_root`` (another run
    directory, taken as given whatever its name looks like), through
    :func:`~tiered_ckpt.local.writer.write_shard` and :func:`~tiered_ckpt.local.commit.commit_step` (same
    durability and commit protocol). ``extra`` and ``wall_clock_seconds`` are copied. New ranks are
    built and written one at a time (memory: about one new shard). See the module docstring for the
    split rule, ``rules`` and ``preset``. ``ranks_per_node``: Replicated values are stored in new
    ranks ``0, K, 2K, ...`` (the first rank of each node of ``K`` ranks, for a job that will run on
    node-local disks); default: new rank 0 alone (one root holding every rank).

    Raises :class:`ReshardError` before anything is written when the checkpoint cannot be resharded,
    ``ValueError`` if ``new_world_size`` is not in ``[1, MAX_WORLD_SIZE]`` (before anything is
    read), ``out_root`` is ``root`` or one of its step directories, ``ranks_per_node < 1``, an
    unknown ``preset`` or a malformed rule; otherwise the errors of the loaders and of
    :func:`~tiered_ckpt.local.writer.write_shard` / :func:`~tiered_ckpt.local.commit.commit_step` (e.g.
    :class:`CheckpointExistsError` if the step is committed in ``out_root`` and not ``replace``).
    """
    if not 1 <= new_world_size <= MAX_WORLD_SIZE:  # before anything is read or written
        raise ValueError(f"new_world_size must be in [1, {MAX_WORLD_SIZE}], got {new_world_size}")
    if ranks_per_node is not None and ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    defaults = preset_rules(preset)
    r, step = pick_step(root, step)
    out_r = write_root(out_root)  # a writer: the directory as given, whatever its name
    if os.path.realpath(out_r) == os.path.realpath(r) or (
        parse_step_dir_name(out_r.name) is not None
        and os.path.realpath(out_r.parent) == os.path.realpath(r)
    ):
        raise ValueError(
            f"out_root {out_r} is the source run directory or one of its step directories; "
            "reshard into another directory"
        )
    if not replace and is_committed(out_r / step_dir_name(step)):
        raise CheckpointExistsError(
            f"step {step} is already committed under {out_r} (replace it with replace=True)"
        )
    m = read_manifest(r, step)
    sdir = r / step_dir_name(step)
    stats = ReadStats()
    b = _Builder(sdir, m, new_world_size, partition, stats, for_write=True)
    sid = new_save_id()
    with ReadLock(sdir):
        try:
            plan = Planner(m, _read_headers(m, b), rules or {}, defaults).plan()
            pshards = _new_param_shards(m, b.split, new_world_size)
            records = []
            for j in range(new_world_size):
                state = b.build(plan, j)
                records.append(
                    write_shard(
                        out_r,
                        step,
                        j,
                        state,
                        save_id=sid,
                        replace=replace,
                        param_shard=pshards[j],
                        replicated_owner=j % (ranks_per_node or new_world_size) == 0,
                    )
                )
                del state
        finally:
            b.close()
    new_m = commit_step(
        out_r,
        step,
        new_world_size,
        records,
        m.extra,
        save_id=sid,
        replace=replace,
        wall_clock_seconds=m.wall_clock_seconds,
    )
    log.info(
        "step %d: resharded %d -> %d ranks into %s: %d bytes read of %d, %d bytes of tensors",
        step,
        m.world_size,
        new_world_size,
        out_r,
        stats.bytes_read,
        m.total_bytes,
        b.bytes_needed,
    )
    return ReshardResult(new_m, m.world_size, stats.bytes_read, b.bytes_needed, m.total_bytes)


__all__ = [
    "reshard",
    "reshard_states",
    "even_split",
    "preset_rules",
    "ReshardResult",
    "ABSENT",
    "NAMED_RULES",
    "PRESETS",
    "TRAINING_RULES",
    "Rule",
    "Partition",
]
