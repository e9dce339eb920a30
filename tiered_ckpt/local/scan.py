"""Inspect a local run directory: the state of every step (``ls``/``verify``) and cleanup of
leftovers of dead writers (``gc``). Builds on the local tier's own readers, so a step that scans as
committed is exactly one that loads.

Node-local roots: with node-local disks a root holds the global manifest of each
step and only its node's shards. With ``require_all=False`` a step is checked for *the ranks this
root holds*: those its ``node_ranks.json`` names (:mod:`tiered_ckpt.local.held_ranks`: written by a
node-local commit and by a partial restore), so that a lost shard is still found; a schema-3 step
without that file holds every rank; only for steps of earlier releases is the set guessed from the
root's other steps (a shard present in any committed step of that world size). A step of a root that
holds no shard of it at all is ``incomplete``. With ``require_all=True`` (the
API default, ``verify --require-all``) every rank's shard must be here.

A step saved through the DCP backend (``manifest.extra["dcp"]``) is also checked, when verified, for
its DCP metadata (:func:`check_dcp_metadata`): under the rules a load reads it by, and against the
tensors its checked shards hold.

Superseded steps (SPEC §11, :func:`tiered_ckpt.local.lineage.superseded_local_steps`), set aside
under ``superseded/`` or still in place, are listed with state ``superseded`` and the attempt and
step that superseded them; they are not verified and are never a fault. ``gc(superseded=True)``
removes them.

Leftovers: every row counts the bytes of temp files of dead writers in its step directory
(``leftover_bytes``: a killed save's temps, a killed restore's downloads), and ``gc``
(:mod:`tiered_ckpt.local.sweep`, re-exported here) removes those files by the owner token in their
names (:mod:`tiered_ckpt.local.leftovers`), also in the root itself, and reports what it left alone.
The ranks a node-local root holds are worked out in :mod:`tiered_ckpt.local.held_ranks`.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tiered_ckpt.errors import (
    CheckpointError,
    DcpMetadataError,
    ManifestError,
    MissingShardError,
    NoCheckpointError,
)
from tiered_ckpt.format.dcp_metadata import EXTRA_KEY, dcp_step_info, parse
from tiered_ckpt.format.manifest import ShardManifest, TensorRecord, check_global_slices
from tiered_ckpt.fs import is_real_dir
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.catalogue import (
    all_step_dirs,
    read_manifest,
    read_manifest_bytes,
    resolve_root,
    symlinked_step_entries,
)
from tiered_ckpt.local.held_ranks import (
    LazyHeld,
    format_ranks,
    held_ranks,
    present_ranks,
    ranks_held,
)
from tiered_ckpt.local.leftovers import leftover_bytes
from tiered_ckpt.local.lineage import SupersededStep
from tiered_ckpt.local.pins import has_pin
from tiered_ckpt.local.rotation import superseded_entries
from tiered_ckpt.local.sweep import GcReport, gc, gc_report, gc_superseded
from tiered_ckpt.local.verified_read import ShardReader, read_byte_tensor, stream_verified_header
from tiered_ckpt.safe_read import kind_of, list_dir, regular_files

log = logging.getLogger(__name__)

COMMITTED, UNCOMMITTED, CORRUPT, INCOMPLETE = "committed", "uncommitted", "corrupt", "incomplete"
SUPERSEDED = "superseded"


@dataclass(frozen=True)
class StepStatus:
    """What :func:`inspect_step` found. ``state``: committed / uncommitted / corrupt / incomplete /
    superseded; ``reason``: one line for anything but a good committed step; ``size_bytes``: bytes
    of shard files present on disk; ``leftover_bytes``: bytes of temp files of dead writers in the
    step directory (a killed save or restore: what ``gc`` removes there,
    :mod:`tiered_ckpt.local.leftovers`; counted for current steps, 0 for superseded ones).
    ``node_ranks``: the ranks checked when the root holds fewer than the step's world size (a
    node-local root), else ``None``. ``pinned``: a ``pinned.json`` is there. ``superseded_by`` /
    ``superseded_from``: the attempt that superseded the step and the step number it supersedes from
    (state ``superseded`` only); ``attempt``: the step's own attempt (any step whose manifest
    reads); ``path``: its directory (set for superseded steps)."""

    step: int
    state: str
    reason: str = ""
    world_size: int | None = None
    size_bytes: int = 0
    save_id: str | None = None
    node_ranks: tuple[int, ...] | None = None
    pinned: bool = False
    superseded_by: int | None = None
    superseded_from: int | None = None
    attempt: int | None = None
    path: str | None = None
    leftover_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.state == COMMITTED

    @property
    def details(self) -> list[str]:
        """What is worth saying besides the reason: superseded by whom, the node-local ranks,
        pinned."""
        out = []
        if self.state == SUPERSEDED and self.superseded_by is not None:
            out.append(
                f"superseded by attempt {self.superseded_by} (from step {self.superseded_from})"
            )
        elif self.state == SUPERSEDED:
            out.append("set aside as superseded (run.json no longer says by which attempt)")
        if self.node_ranks is not None and self.world_size is not None:
            out.append(f"node-local: ranks {format_ranks(self.node_ranks)} of {self.world_size}")
        if self.pinned:
            out.append("pinned")
        return out

    @property
    def note(self) -> str:
        """One line for people: the reason (whitespace folded) and the :attr:`details`,
        comma-separated; ``""`` for a plain good step."""
        return ", ".join(([" ".join(self.reason.split())] if self.reason else []) + self.details)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["note"] = self.note
        return d


def _dir_bytes(sdir: Path, sizes: Mapping[str, int] | None = None) -> int:
    """Bytes of the shard files in ``sdir`` (``sizes``: its :func:`regular_files`, when already
    listed); 0 for a symlinked step directory (never followed)."""
    if sizes is None:
        sizes = regular_files(sdir, ".safetensors")  # the step directory opened O_NOFOLLOW
    return sum(n for name, n in sizes.items() if name.endswith(".safetensors"))


@dataclass(frozen=True)
class _Listing:
    """One listing of a step directory for a scan: every entry's name, and the regular files' sizes
    (one ``listdir`` and one ``lstat`` per entry, whatever the number of ranks)."""

    names: frozenset[str]
    sizes: Mapping[str, int]

    @classmethod
    def of(cls, sdir: Path) -> _Listing:
        return cls(frozenset(list_dir(sdir)), regular_files(sdir))


def inspect_step(
    root: str | os.PathLike[str],
    step: int,
    *,
    verify: bool = True,
    fast: bool = False,
    ranks: Iterable[int] | None = None,
    require_all: bool = True,
    held: Mapping[int, frozenset[int]] | None = None,
) -> StepStatus:
    """State of one step. With ``verify`` every shard is read and hashed (as a load would, streaming
    through a small buffer) and its header and state tree checked, so that a step verifies iff it
    loads: sha256, or CRC32C with ``fast`` (sha256 for shards whose manifest has no CRC32C, i.e.
    schema v1); without it only presence and sizes are checked. Never raises for a bad checkpoint:
    the fault is the reason.

    ``ranks`` (default: all) checks only those ranks' shards, for a node-local root that holds some
    ranks of a step (e.g. after ``restore(ranks=...)``): the global manifest is still read and
    validated, the other ranks' shards are expected elsewhere. A rank outside the step's world size
    makes the step ``incomplete`` (its shard cannot be here). Without ``ranks`` and with
    ``require_all=False``, the ranks this root holds (:func:`held_ranks`, module docstring; read
    only when some shard of this step is not here) are checked; the result then names them
    in ``node_ranks`` when they are fewer than the world size; ``held``: :func:`held_ranks` of the
    root when already known (a scan of many steps computes it once). ``leftover_bytes`` is counted
    whatever the state."""
    r, _ = resolve_root(root)
    sdir = r / step_dir_name(step)
    listing = _Listing.of(sdir)
    st = _inspect_step(
        r,
        step,
        verify=verify,
        fast=fast,
        ranks=ranks,
        require_all=require_all,
        held=held,
        listing=listing,
    )
    return replace(st, leftover_bytes=leftover_bytes(sdir, listing.sizes))


def _inspect_step(
    r: Path,
    step: int,
    *,
    verify: bool,
    fast: bool,
    ranks: Iterable[int] | None,
    require_all: bool,
    held: Mapping[int, frozenset[int]] | None,
    listing: _Listing,
) -> StepStatus:
    sdir = r / step_dir_name(step)
    size = _dir_bytes(sdir, listing.sizes)
    try:
        m = read_manifest(r, step)
    except NoCheckpointError:
        return StepStatus(
            step,
            UNCOMMITTED,
            "no manifest.json (an interrupted or in-progress save)",
            size_bytes=size,
        )
    except MissingShardError as e:
        return StepStatus(step, INCOMPLETE, str(e), size_bytes=size)
    except ManifestError as e:
        return StepStatus(step, CORRUPT, str(e), size_bytes=size)
    pinned = has_pin(sdir)
    node: tuple[int, ...] | None = None
    if ranks is not None:
        wanted: frozenset[int] | None = frozenset(int(x) for x in ranks)
        outside = sorted(x for x in wanted if not 0 <= x < m.world_size)
        if outside:
            return StepStatus(
                step,
                INCOMPLETE,
                f"step {step} has world size {m.world_size}; no rank(s) {format_ranks(outside)}",
                m.world_size,
                size,
                m.save_id,
                pinned=pinned,
            )
    elif require_all:
        wanted = None
    elif present_ranks(sdir, m, listing.names) == set(range(m.world_size)):
        wanted = None  # every shard is here: nothing outside this step needs reading
    else:
        try:
            mine = ranks_held(r, sdir, m, held)
        except ManifestError as e:
            return StepStatus(step, CORRUPT, str(e), m.world_size, size, m.save_id, pinned=pinned)
        if not mine:
            return StepStatus(
                step,
                INCOMPLETE,
                f"no shard of step {step} (world size {m.world_size}) is in this root",
                m.world_size,
                size,
                m.save_id,
                pinned=pinned,
            )
        wanted = None if len(mine) == m.world_size else mine
        node = None if wanted is None else tuple(sorted(mine))
    state, reason = _check_shards(sdir, m, wanted, verify, fast, listing.sizes)
    return StepStatus(
        step, state, reason, m.world_size, size, m.save_id, node, pinned, attempt=m.attempt
    )


def _check_shards(
    sdir: Path,
    m: ShardManifest,
    wanted: frozenset[int] | None,
    verify: bool,
    fast: bool,
    sizes: Mapping[str, int],
) -> tuple[str, str]:
    """``(state, reason)`` of the shards of ``m`` in ``wanted`` (``None``: all); ``sizes``: the
    regular files of ``sdir`` (a shard not among them is looked at again, to say what it is)."""
    step = m.step
    indexes: list[tuple[int, tuple[TensorRecord, ...]]] = []
    try:
        for rec in m.shards:
            if wanted is not None and rec.rank not in wanted:
                continue
            if verify:
                hdr = stream_verified_header(sdir, m, rec.rank, "crc32c" if fast else "sha256")[1]
                indexes.append((rec.rank, hdr.tensors))
                continue
            if sizes.get(rec.path) == rec.size_bytes:
                continue
            try:
                st = os.lstat(sdir / rec.path)
            except FileNotFoundError:
                raise MissingShardError(
                    f"step {step} rank {rec.rank} ({rec.path}): shard file is missing"
                ) from None
            if not stat.S_ISREG(
                st.st_mode
            ):  # a symlink of the right length is no shard (loads refuse it)
                raise CheckpointError(
                    f"step {step} rank {rec.rank} ({rec.path}): {sdir / rec.path} is "
                    f"{kind_of(st.st_mode)}, not a regular file"
                )
            if st.st_size != rec.size_bytes:
                raise CheckpointError(
                    f"step {step} rank {rec.rank} ({rec.path}): {st.st_size} bytes on "
                    f"disk, manifest says {rec.size_bytes}"
                )
        check_global_slices(step, indexes)  # across the ranks checked: slices of one tensor agree
        if verify and EXTRA_KEY in (m.extra or {}):
            check_dcp_metadata(sdir, m, dict(indexes))
    except MissingShardError as e:
        return INCOMPLETE, str(e)
    except CheckpointError as e:
        return CORRUPT, str(e)
    return COMMITTED, ""


def check_dcp_metadata(
    sdir: Path, m: ShardManifest, headers: Mapping[int, Iterable[TensorRecord]]
) -> None:
    """A DCP step's metadata (:mod:`tiered_ckpt.format.dcp_metadata`) holds under the rules a load
    reads it by (:func:`~tiered_ckpt.format.dcp_metadata.parse`: the same function), and every
    item it places in a shard of ``headers`` (``{rank: tensors of its verified header}``: the
    ranks checked) is a tensor of that shard of the dtype and shape the metadata gives: a load
    would otherwise fail, or read other bytes than the metadata describes. Items placed in ranks
    not checked (a node-local root) are not looked at; nor is the metadata when the rank holding it
    is not checked. Raises :class:`~tiered_ckpt.errors.DcpMetadataError` and the shard reader's
    errors."""
    info = dcp_step_info(m)
    if info.metadata_rank not in headers:
        return
    where = f"step {m.step}: DCP metadata"
    with ShardReader(sdir, m, info.metadata_rank) as rd:
        raw = read_byte_tensor(
            rd, info.metadata_tensor, info.metadata_bytes, DcpMetadataError, where
        )
    table = parse(raw, m.world_size, where)
    by_name: dict[int, dict[str, TensorRecord]] = {}
    for rank, name, code, shape in table.items():
        if rank not in headers:
            continue
        tensors = by_name.get(rank)
        if tensors is None:
            tensors = by_name[rank] = {t.name: t for t in headers[rank]}
        t = tensors.get(name)
        if t is None:
            raise DcpMetadataError(
                f"{where} places {name[:80]!r} in rank {rank}'s shard, which lacks it"
            )
        if t.dtype != code or (t.shape != shape if shape is not None else len(t.shape) != 1):
            raise DcpMetadataError(
                f"{where}: {name[:80]!r} of rank {rank}'s shard is {t.dtype} {list(t.shape)[:8]}, "
                f"the metadata says {code} {list(shape)[:8] if shape is not None else '1-D'}"
            )


def _superseded_status(entry: SupersededStep) -> StepStatus:
    """The row of one superseded entry (not verified: it is never loaded)."""
    path = Path(entry.path)
    ws = None
    try:
        data = read_manifest_bytes(path) if is_real_dir(path) else None
        ws = ShardManifest.from_json(data).world_size if data is not None else None
    except CheckpointError:
        pass
    sup = entry.superseded
    return StepStatus(
        entry.step,
        SUPERSEDED,
        "",
        ws,
        _dir_bytes(path),
        entry.save_id,
        pinned=has_pin(path),
        superseded_by=None if sup is None else sup.attempt,
        superseded_from=None if sup is None else sup.from_step,
        attempt=entry.attempt,
        path=str(path),
    )


def scan(
    root: str | os.PathLike[str],
    *,
    verify: bool = True,
    step: int | None = None,
    fast: bool = False,
    ranks: Iterable[int] | None = None,
    require_all: bool = True,
) -> list[StepStatus]:
    """:func:`inspect_step` for ``step``, or for every step directory under ``root`` (ascending),
    plus a ``superseded`` row for each superseded step (of ``step`` only, when given); ``ranks`` and
    ``require_all`` as for :func:`inspect_step`. Raises :class:`ManifestError` for an unreadable
    ``run.json`` (what is current cannot be told)."""
    r, step = resolve_root(root, step)
    wanted = None if ranks is None else list(ranks)
    sup = [e for e in superseded_entries(r) if step is None or e.step == step]
    in_place = {Path(e.path) for e in sup}
    held = LazyHeld(r) if wanted is None and not require_all else None
    steps = [step] if step is not None else all_step_dirs(r)
    out = [
        inspect_step(
            r, s, verify=verify, fast=fast, ranks=wanted, require_all=require_all, held=held
        )
        for s in steps
        if r / step_dir_name(s) not in in_place
    ]
    out += [_superseded_status(e) for e in sup]
    if step is None:
        # Symlinked step directories are not part of the run (loads ignore them, nothing is read
        # through them); report them so that an operator who moved a step elsewhere does not
        # silently lose it.
        out += [
            StepStatus(
                s,
                CORRUPT,
                f"{step_dir_name(s)} is a symlink; step directories must be real "
                "directories of the run (it is ignored by loads)",
            )
            for s in symlinked_step_entries(r)
        ]
    return sorted(out, key=lambda st: (st.step, st.state == SUPERSEDED, st.path or ""))


__all__ = [
    "COMMITTED",
    "CORRUPT",
    "INCOMPLETE",
    "SUPERSEDED",
    "UNCOMMITTED",
    "GcReport",
    "StepStatus",
    "check_dcp_metadata",
    "format_ranks",
    "gc",
    "gc_report",
    "gc_superseded",
    "held_ranks",
    "inspect_step",
    "scan",
]
