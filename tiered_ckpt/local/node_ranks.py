"""Which ranks a node-local step directory holds: ``<step_dir>/node_ranks.json`` (SPEC §11).

With node-local disks every node's committer writes the global manifest (all ranks) next to its own
node's shards only; ``restore(ranks=...)`` does the same for a replaced node. From the files alone,
such a root cannot be told from one that *lost* a shard. So the writer records the ranks it holds:

- :func:`tiered_ckpt.local.save.commit_step` with ``local_ranks`` fewer than the world size writes
  the file before the manifest (the manifest's directory fsync makes both durable); with all ranks
  it removes a stale one;
- restore writes it after committing a strict subset of the ranks.

``verify`` (:mod:`tiered_ckpt.local.scan`) then checks exactly these ranks and still reports a
missing one. A step written by schema 3 code without the file holds every rank; only steps of
earlier releases fall back to guessing from the root's other steps. JSON: ``{"ranks": [2, 3],
"world_size": 4}`` (sorted, no duplicates). Bad content raises
:class:`~tiered_ckpt.errors.ManifestError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.validate import check_keys, int_field, loads_json
from tiered_ckpt.layout import MAX_WORLD_SIZE, NODE_RANKS_NAME
from tiered_ckpt.local.catalogue import read_small_regular_file
from tiered_ckpt.local.commit import durable_write_bytes, unlink_durable

#: Largest node_ranks.json read (bytes): MAX_WORLD_SIZE ranks of 6 characters each, and some.
MAX_NODE_RANKS_BYTES = 1024 * 1024


def node_ranks_bytes(ranks: Iterable[int], world_size: int) -> bytes:
    """The file's content for ``ranks`` of ``world_size``. Raises ``ValueError`` for a rank outside
    it."""
    rs = sorted(set(int(r) for r in ranks))
    if not rs or rs[0] < 0 or rs[-1] >= world_size:
        raise ValueError(f"node ranks {rs[:8]} are not ranks of world size {world_size}")
    return (json.dumps({"ranks": rs, "world_size": world_size}, sort_keys=True) + "\n").encode()


def record_node_ranks(
    step_dir: Path, ranks: Iterable[int], world_size: int, *, dir_fsync: bool = True
) -> None:
    """Durably write ``node_ranks.json`` into ``step_dir`` (``dir_fsync=False`` when a later
    directory fsync of the same directory, the manifest's, makes it durable). Raises ``OSError``,
    ``ValueError``."""
    durable_write_bytes(
        step_dir / NODE_RANKS_NAME, node_ranks_bytes(ranks, world_size), dir_fsync=dir_fsync
    )


def clear_node_ranks(step_dir: Path) -> bool:
    """Remove ``node_ranks.json`` (a step re-saved with every rank). Returns whether it existed.
    Looks first (one ``lstat``), so that the common case, no file, costs no ``unlink`` and no
    directory fsync."""
    path = step_dir / NODE_RANKS_NAME
    return os.path.lexists(path) and unlink_durable(path)


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


__all__ = [
    "NODE_RANKS_NAME",
    "MAX_NODE_RANKS_BYTES",
    "node_ranks_bytes",
    "record_node_ranks",
    "clear_node_ranks",
    "read_node_ranks",
]
