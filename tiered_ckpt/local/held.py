"""Which ranks a node-local root holds ( used by ``ls``/``verify``,
:mod:`tiered_ckpt.local.scan`): a step's ``node_ranks.json`` when it has one, every rank for a
schema-3 step, and for steps of earlier releases the ranks present in any committed step of the same
world size. Read-only.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path

from tiered_ckpt.errors import CheckpointError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.catalogue import (
    all_step_dirs,
    read_manifest,
    resolve_root,
    stored_schema_version,
)
from tiered_ckpt.local.node_ranks import read_node_ranks


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


__all__ = ["LazyHeld", "format_ranks", "held_ranks", "present_ranks", "ranks_held"]
