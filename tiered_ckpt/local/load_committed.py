"""Fail-loud loading of committed steps (SPEC §2 "Loading"): world size, every rank's presence,
size, sha256 (or CRC32C) and header of every shard are checked before anything is returned. Readers
see committed steps only (I3) and hold a ``read`` lock so that rotation leaves the step alone
meanwhile.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiered_ckpt.errors import MissingShardError, ShardCorruptedError, WorldSizeMismatchError
from tiered_ckpt.format import shard_file as fmt
from tiered_ckpt.format.crc32c import Crc32c
from tiered_ckpt.format.manifest import (
    ShardManifest,
    ShardRecord,
    TensorRecord,
    check_global_slices,
)
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local import verified_read as sr
from tiered_ckpt.local.catalogue import pick_step, read_manifest
from tiered_ckpt.local.held_ranks import read_node_ranks
from tiered_ckpt.local.reshard import Rule, reshard_states
from tiered_ckpt.local.shard_io import Digest, read_verified

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class VerifiedShard:
    """A shard read whole and verified: ``buffer`` holds the file, ``header`` its parsed header."""

    record: ShardRecord
    buffer: np.ndarray  # uint8, the whole file
    header: fmt.ParsedHeader


def read_shard_verified(
    sdir: Path, manifest: ShardManifest, rank: int, verify: str = "sha256"
) -> VerifiedShard:
    """Open rank ``rank`` 's shard without following symlinks, check size, hash, header against the
    manifest's record. ``verify``: ``"sha256"`` (default) or ``"crc32c"`` (the fast path; sha256
    when the manifest has no CRC32C, as for a step saved by schema version 1).
    Raises MissingShardError, ShardCorruptedError, ManifestError; ``ValueError`` for another
    ``verify``."""
    sr.check_verify_mode(verify)
    rec = manifest.shards[rank]
    where = f"step {manifest.step} rank {rank} ({rec.path})"
    fd = sr.open_shard(sdir, rec, where)  # no symlinks, a regular file of the recorded size
    try:
        algo = "crc32c" if verify == "crc32c" and rec.crc32c is not None else "sha256"
        sha: Digest = Crc32c() if algo == "crc32c" else fmt.new_sha256()
        expected = rec.crc32c if algo == "crc32c" else rec.sha256
        try:
            buf = read_verified(fd, rec.size_bytes, [sha], where)
        except OSError as e:
            raise ShardCorruptedError(f"{where}: read failed: {e.strerror or e}") from e
    finally:
        os.close(fd)
    digest = sha.hexdigest()
    if digest != expected:
        raise ShardCorruptedError(
            f"{where}: {algo} {digest[:16]}... differs from the manifest's "
            f"{str(expected)[:16]}... (corrupt or partial write)"
        )
    n = fmt.parse_header_length(bytes(buf[:8]), len(buf), where)
    hdr = sr.check_header_bytes(bytes(buf[: 8 + n]), rec, manifest, where)  # the tensor records
    return VerifiedShard(rec, buf, hdr)


class _NodeCopies:
    """Resolves a rank's replicated references from a copy in this root: the lowest other rank whose
    shard is here (``node_ranks.json`` says which, else every rank's file is tried) and holds the
    value (each node's first rank stores one, rank 0 always). Opens those shards lazily, reads only
    what is needed."""

    def __init__(self, sdir: Path, manifest: ShardManifest, rank: int) -> None:
        self.sdir, self.m, self.rank = sdir, manifest, rank
        self.candidates: list[int] | None = (
            None  # read at the first reference (most shards hold none)
        )
        self.readers: dict[int, sr.ShardReader | None] = {}

    def _reader(self, r: int) -> sr.ShardReader | None:
        if r not in self.readers:
            try:
                self.readers[r] = sr.ShardReader(self.sdir, self.m, r)
            except MissingShardError:  # another node's shard: not on this disk
                self.readers[r] = None
        return self.readers[r]

    def __call__(self, path: tuple[str, ...]) -> Any:
        if self.candidates is None:
            here = read_node_ranks(self.sdir, self.m.world_size)
            self.candidates = [
                r
                for r in sorted(here if here is not None else range(self.m.world_size))
                if r != self.rank
            ]
        for r in self.candidates:
            rd = self._reader(r)
            node = sr.find_node(rd.header().metadata["tree"], path) if rd is not None else None
            if isinstance(node, dict) and set(node) == {"r"} and node["r"] is not None:
                return rd.materialize(node["r"], "/".join(path), len(path) + 1)  # type: ignore[union-attr]
        raise ShardCorruptedError(
            f"step {self.m.step} rank {self.rank}: the replicated value at "
            f"{'/'.join(path)[:80]!r} is in none of the shards under {self.sdir} (each "
            "node's first rank holds a copy: restore that rank's shard too)"
        )

    def close(self) -> None:
        for rd in self.readers.values():
            if rd is not None:
                rd.close()


def _load_rank(
    sdir: Path,
    manifest: ShardManifest,
    rank: int,
    verify: str = "sha256",
    resolve_ref: Callable[[tuple[str, ...]], Any] | None = None,
    indexes: dict[int, tuple[TensorRecord, ...]] | None = None,
) -> dict[str, Any]:
    """Rank ``rank`` 's state. Replicated values its shard refers to come from ``resolve_ref``
    (default: :class:`_NodeCopies`, a copy in another shard of this root, only the parts needed,
    verified by the per-tensor checksums). ``indexes``: gets the rank's verified tensor records (for
    the checks across ranks)."""
    shard = read_shard_verified(sdir, manifest, rank, verify)
    if indexes is not None:
        indexes[rank] = shard.header.tensors
    where = f"step {manifest.step} rank {rank}"
    if resolve_ref is None:
        copies = _NodeCopies(sdir, manifest, rank)
        try:
            return fmt.decode_state(shard.buffer, shard.header, where, copies)
        finally:
            copies.close()
    return fmt.decode_state(shard.buffer, shard.header, where, resolve_ref)


def _get_path(state: Mapping[str, Any], path: tuple[str, ...], where: str) -> Any:
    v: Any = state
    for k in path:
        if not isinstance(v, Mapping) or k not in v:
            raise ShardCorruptedError(
                f"{where}: holds no replicated value at {'/'.join(path)[:80]!r}"
            )
        v = v[k]
    return v


def _check_world(manifest: ShardManifest, expected_world_size: int) -> None:
    if manifest.world_size != expected_world_size:
        raise WorldSizeMismatchError(
            f"step {manifest.step} was saved by {manifest.world_size} ranks, but {expected_world_size} "
            "are loading it (resharding was not asked for)"
        )


def load_shard(
    root: PathLike,
    rank: int,
    expected_world_size: int,
    step: int | None = None,
    *,
    verify: str = "sha256",
    reshard: bool = False,
    rules: Mapping[str, Rule] | None = None,
    preset: str | Mapping[str, Rule] | None = None,
) -> dict[str, Any]:
    """Load and verify rank ``rank`` 's state of ``step`` (newest committed when ``None``).

    Returns the nested state as saved; arrays are byte-identical (little-endian, writable);
    :class:`~tiered_ckpt.state.Replicated` values come back plain. ``verify``: ``"sha256"``
    (default, whole file) or ``"crc32c"`` (fast path; sha256 for steps without CRC32C).
    ``reshard=True`` with an ``expected_world_size`` other than the saved one returns this rank's
    share of a re-split checkpoint, reading only the byte ranges it needs (see
    :func:`tiered_ckpt.local.reshard.reshard_states` for the split rule, ``rules``, ``preset``
    (``"training"``) and what ``verify`` means there). Raises :class:`NoCheckpointError`,
    :class:`WorldSizeMismatchError`, :class:`MissingShardError`, :class:`ShardCorruptedError`,
    :class:`ManifestError`, :class:`ReshardError`; ``ValueError`` for a rank outside the world. Only
    this rank's shard is read: its slices are checked against their own global shapes, not against
    other ranks' (``load_sharded``, a reshard and ``verify`` check those).
    """
    sr.check_verify_mode(verify)
    r, step = pick_step(root, step)
    m = read_manifest(r, step)
    if reshard and m.world_size != expected_world_size:
        if not 0 <= rank < expected_world_size:
            raise ValueError(f"rank {rank} is outside world_size {expected_world_size}")
        return reshard_states(
            r, step, expected_world_size, ranks=[rank], rules=rules, preset=preset, manifest=m
        )[0]
    _check_world(m, expected_world_size)
    if not 0 <= rank < m.world_size:
        raise ValueError(f"rank {rank} is outside world_size {m.world_size}")
    sdir = r / step_dir_name(step)
    with sr.ReadLock(sdir):
        return _load_rank(sdir, m, rank, verify)


def load_sharded(
    root: PathLike,
    expected_world_size: int,
    step: int | None = None,
    *,
    verify: str = "sha256",
    reshard: bool = False,
    rules: Mapping[str, Rule] | None = None,
    preset: str | Mapping[str, Rule] | None = None,
) -> list[dict[str, Any]]:
    """Load and verify every rank's state of ``step``; element ``i`` is rank ``i`` 's state.

    ``verify``, ``reshard``, ``rules`` and ``preset`` as in :func:`load_shard` (with
    ``reshard=True`` the list has ``expected_world_size`` entries). Errors as :func:`load_shard`;
    every shard is verified before anything is returned, and the slices of each global tensor across
    the ranks agree on its shape and dtype and do not overlap (else :class:`ManifestError`).
    """
    sr.check_verify_mode(verify)
    r, step = pick_step(root, step)
    m = read_manifest(r, step)
    if reshard and m.world_size != expected_world_size:
        return reshard_states(r, step, expected_world_size, rules=rules, preset=preset, manifest=m)
    _check_world(m, expected_world_size)
    sdir = r / step_dir_name(step)
    with sr.ReadLock(sdir), ThreadPoolExecutor(max_workers=min(4, m.world_size)) as pool:
        indexes: dict[int, tuple[TensorRecord, ...]] = {}
        # Every rank's shard is read at once; a rank that refers to a replicated value waits for
        # rank 0's state (rank 0 holds every replicated value) only when it decodes (rank 0 is
        # submitted first, so it always has a thread).
        first_f = pool.submit(_load_rank, sdir, m, 0, verify, indexes=indexes)

        def resolve(path: tuple[str, ...]) -> Any:
            return sr.copy_value(_get_path(first_f.result(), path, f"step {m.step} rank 0"))

        rest_f = [
            pool.submit(_load_rank, sdir, m, k, verify, resolve, indexes)
            for k in range(1, m.world_size)
        ]
        first, rest = first_f.result(), [f.result() for f in rest_f]
    # Slices of one global tensor agree and do not overlap across ranks (the manifest reader checked
    # this when manifests listed tensors; now the indexes are in the headers). load_shard reads one
    # rank only.
    check_global_slices(m.step, sorted(indexes.items()))
    return [first] + rest


__all__ = ["VerifiedShard", "load_shard", "load_sharded", "read_shard_verified"]
