"""Which ranks a root and its steps hold (SPEC §11): the content of ``<step>/node_ranks.json`` and
how ``ls``/``verify`` (:mod:`tiered_ckpt.local.scan`) and loads decide which shards a step should have.

With node-local disks each node's committer writes the global manifest (all ranks) next to its own
shards only, so the committer records the ranks it holds: ``{"ranks": [2, 3], "world_size": 4}``
(sorted, no duplicates). :func:`~tiered_ckpt.local.commit.commit_step` with fewer ``local_ranks``
than the world size writes it before the manifest (with all ranks it removes a stale one); a
restore of a strict subset of ranks writes it after its commit. Writing is
:mod:`tiered_ckpt.local.commit`'s; this module builds the bytes and reads.

A step's ranks (:func:`ranks_held`): its ``node_ranks.json``; without one, every rank for a step of
schema 3 or later; for older steps, the ranks present in any committed step of the same world size
(:func:`held_ranks`). Bad content raises :class:`~tiered_ckpt.errors.ManifestError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path

from tiered_ckpt.errors import CheckpointError, ManifestError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.validate import check_keys, int_field, loads_json
from tiered_ckpt.layout import MAX_WORLD_SIZE, NODE_RANKS_NAME, step_dir_name
from tiered_ckpt.local.catalogue import (
    all_step_dirs,
    read_manifest,
    read_small_regular_file,
    resolve_root,
    stored_schema_version,
)

#: Largest node_ranks.json read (bytes): MAX_WORLD_SIZE ranks of 6 characters each, and some.
MAX_NODE_RANKS_BYTES = 1024 * 1024


def node_ranks_bytes(ranks: Iterable[int], world_size: int) -> bytes:
    """The file's content for ``ranks`` of ``world_size``. Raises ``ValueError`` for a rank outside
    it."""
    rs = sorted(set(int(r) for r in ranks))
    if not rs or rs[0] < 0 or rs[-1] >= world_size:
        raise ValueError(f"node ranks {rs[:8]} are not ranks of world size {world_size}")
    return (json.dumps({"ranks": rs, "world_size": world_size}, sort_keys=True) + "\n").encode()


def read_node_ranks(step_dir: Path, world_size: int) -> frozenset[int] | None:
    """The ranks ``step_dir`` holds by its ``node_ranks.json``, or ``None`` without one. Never
    follows a symlink; raises :class:`ManifestError` for a bad file or one written for another world
    size."""
    data = read_small_regular_file(step_dir / NODE_RANKS_NAME, MAX_NODE_RANKS_BYTES)
    if data is None:
        return None
    what = str(step_dir / NODE_RANKS_NAME)
    obj = check_keys(loads_json(data, what), what, {"ranks", "world_size"})
    ws = int_field(obj["world_size"], f"{what}.world_size", 1, MAX_WORLD_SIZE)
    raw = obj["ranks"]
    if ws != world_size:
        raise ManifestError(f"{what} was written for world size {ws}, the step's is {world_size}")
    if not isinstance(raw, list) or not 1 <= len(raw) <= ws:
        raise ManifestError(f"{what}.ranks must list 1 to {ws} ranks")
    ranks = [int_field(r, f"{what}.ranks[{i}]", 0, ws - 1) for i, r in enumerate(raw)]
    if len(set(ranks)) != len(ranks):
        raise ManifestError(f"{what}.ranks lists a rank twice")
    return frozenset(ranks)


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 2, 3, 4, 7]`` -> ``"0,2-4,7"`` (the form ``--ranks`` accepts)."""
    out: list[str] = []
    for r in sorted(set(ranks)):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out)


def present_ranks(sdir: Path, m: ShardManifest, names: Collection[str] | None = None) -> set[int]:
    """Ranks of ``m`` whose shard file is an entry of ``sdir`` (not followed, not checked);
    ``names``: the entries of ``sdir`` when already listed (one listing for a step of many ranks,
    not a stat per rank)."""
    if names is not None:
        return {rec.rank for rec in m.shards if rec.path in names}
    return {rec.rank for rec in m.shards if os.path.lexists(sdir / rec.path)}


def held_ranks(root: str | os.PathLike[str]) -> dict[int, frozenset[int]]:
    """World size -> ranks whose shard is present in at least one committed step of that world size
    under ``root``: the ranks this root holds (all of them on a shared root, one node's on a
    node-local root). Steps whose manifest does not read are skipped. Never raises for a bad
    checkpoint."""
    r, _ = resolve_root(root)
    out: dict[int, set[int]] = {}
    for s in all_step_dirs(r):
        try:
            m = read_manifest(r, s)
        except CheckpointError:
            continue
        out.setdefault(m.world_size, set()).update(present_ranks(r / step_dir_name(s), m))
    return {ws: frozenset(v) for ws, v in out.items()}


class LazyHeld(Mapping[int, frozenset[int]]):
    """:func:`held_ranks` of a root, computed on first use (a scan of a shared root never needs
    it)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._value: dict[int, frozenset[int]] | None = None

    def _get(self) -> dict[int, frozenset[int]]:
        if self._value is None:
            self._value = held_ranks(self._root)
        return self._value

    def __getitem__(self, key: int) -> frozenset[int]:
        return self._get()[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def ranks_held(
    r: Path, sdir: Path, m: ShardManifest, held: Mapping[int, frozenset[int]] | None
) -> frozenset[int]:
    """The ranks ``sdir`` should hold: its ``node_ranks.json`` (written by a node-local commit or a
    partial restore); without one, every rank for a step of schema 3 or later (so a lost shard is
    reported), and for older steps the guess from the root's other steps (:func:`held_ranks`).
    Raises ManifestError."""
    declared = read_node_ranks(sdir, m.world_size)
    if declared is not None:
        return declared
    version = stored_schema_version(sdir)
    if version is None or version >= 3:
        return frozenset(range(m.world_size)) if present_ranks(sdir, m) else frozenset()
    return (held_ranks(r) if held is None else held).get(m.world_size, frozenset())


__all__ = [
    "LazyHeld",
    "MAX_NODE_RANKS_BYTES",
    "format_ranks",
    "held_ranks",
    "node_ranks_bytes",
    "present_ranks",
    "ranks_held",
    "read_node_ranks",
]
