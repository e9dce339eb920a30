"""Inspect a local run directory: the state of every step (``ls``/``verify``) and cleanup of leftovers
of dead writers (``gc``). Builds on the local tier's own readers, so a step that scans as committed is
exactly one that loads.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from tiered_ckpt.fs import owner_alive, temp_owner
from tiered_ckpt.locks import stale_lock_files
from tiered_ckpt.errors import CheckpointError, ManifestError, MissingShardError, NoCheckpointError
from tiered_ckpt.layout import SAVE_LOCK_NAME, TMP_SUFFIX, step_dir_name
from tiered_ckpt.local.reader import verify_shard_stream
from tiered_ckpt.local.catalogue import (all_step_dirs, is_committed, read_manifest, resolve_root,
                                         symlinked_step_entries)
from tiered_ckpt.local.trash import is_trash_name, move_to_trash, remove_trash

log = logging.getLogger(__name__)

COMMITTED, UNCOMMITTED, CORRUPT, INCOMPLETE = "committed", "uncommitted", "corrupt", "incomplete"


@dataclass(frozen=True)
class StepStatus:
    """What :func:`inspect_step` found. ``state``: committed / uncommitted / corrupt / incomplete;
    ``reason``: one line for anything but a good committed step; ``size_bytes``: bytes of shard files
    present on disk."""

    step: int
    state: str
    reason: str = ""
    world_size: int | None = None
    size_bytes: int = 0
    save_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == COMMITTED

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _dir_bytes(sdir: Path) -> int:
    """Bytes of the shard files in ``sdir``; 0 for a symlinked step directory (never followed)."""
    total = 0
    if sdir.is_symlink():
        return 0
    try:
        with os.scandir(sdir) as it:
            for e in it:
                if e.is_file(follow_symlinks=False) and e.name.endswith(".safetensors"):
                    total += e.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def inspect_step(root: str | os.PathLike[str], step: int, *, verify: bool = True, fast: bool = False,
                 ranks: Iterable[int] | None = None) -> StepStatus:
    """State of one step. With ``verify`` every shard is read and hashed (as a load would, streaming
    through a small buffer) and its header and state tree checked, so that a step verifies iff it loads:
    sha256, or CRC32C with ``fast`` (sha256 for shards whose manifest has no CRC32C, i.e. schema v1);
    without it only presence and sizes are checked. Never raises for a bad checkpoint: the fault is the
    reason.

    ``ranks`` (default: all) checks only those ranks' shards, for a node-local root that holds some ranks
    of a step (e.g. after ``restore(ranks=...)``): the global manifest is still read and validated, the
    other ranks' shards are expected elsewhere. A rank outside the step's world size makes the step
    ``incomplete`` (its shard cannot be here)."""
    wanted = None if ranks is None else frozenset(int(x) for x in ranks)
    r, _ = resolve_root(root)
    sdir = r / step_dir_name(step)
    size = _dir_bytes(sdir)
    try:
        m = read_manifest(r, step)
    except NoCheckpointError:
        return StepStatus(step, UNCOMMITTED, "no manifest.json (an interrupted or in-progress save)",
                          size_bytes=size)
    except MissingShardError as e:
        return StepStatus(step, INCOMPLETE, str(e), size_bytes=size)
    except ManifestError as e:
        return StepStatus(step, CORRUPT, str(e), size_bytes=size)
    if wanted is not None:
        outside = sorted(x for x in wanted if not 0 <= x < m.world_size)
        if outside:
            return StepStatus(step, INCOMPLETE, f"step {step} has world size {m.world_size}; no rank(s) "
                              f"{','.join(map(str, outside))}", m.world_size, size, m.save_id)
    try:
        for rec in m.shards:
            if wanted is not None and rec.rank not in wanted:
                continue
            if verify:
                verify_shard_stream(sdir, m, rec.rank, "crc32c" if fast else "sha256")
            else:
                try:
                    st = os.lstat(sdir / rec.path)
                except FileNotFoundError:
                    raise MissingShardError(f"step {step} rank {rec.rank} ({rec.path}): shard file is missing")
                if st.st_size != rec.size_bytes:
                    raise CheckpointError(f"step {step} rank {rec.rank} ({rec.path}): {st.st_size} bytes on "
                                          f"disk, manifest says {rec.size_bytes}")
    except MissingShardError as e:
        return StepStatus(step, INCOMPLETE, str(e), m.world_size, size, m.save_id)
    except CheckpointError as e:
        return StepStatus(step, CORRUPT, str(e), m.world_size, size, m.save_id)
    return StepStatus(step, COMMITTED, "", m.world_size, size, m.save_id)


def scan(root: str | os.PathLike[str], *, verify: bool = True, step: int | None = None,
         fast: bool = False, ranks: Iterable[int] | None = None) -> list[StepStatus]:
    """:func:`inspect_step` for ``step``, or for every step directory under ``root`` (ascending);
    ``ranks`` as for :func:`inspect_step`."""
    r, step = resolve_root(root, step)
    wanted = None if ranks is None else list(ranks)
    if step is not None:
        return [inspect_step(r, step, verify=verify, fast=fast, ranks=wanted)]
    out = [inspect_step(r, s, verify=verify, fast=fast, ranks=wanted) for s in all_step_dirs(r)]
    # Symlinked step directories are not part of the run (loads ignore them, nothing is read through
    # them); report them so that an operator who moved a step elsewhere does not silently lose it.
    out += [StepStatus(s, CORRUPT, f"{step_dir_name(s)} is a symlink; step directories must be real "
                                   "directories of the run (it is ignored by loads)")
            for s in symlinked_step_entries(r)]
    return sorted(out, key=lambda st: st.step)


def _writer_alive(sdir: Path) -> bool:
    """Whether a live process may still be writing into ``sdir``: its save lock or a temp file names a
    live owner."""
    import json

    try:
        owner = json.loads((sdir / SAVE_LOCK_NAME).read_bytes()).get("owner", "")
        if owner and owner_alive(str(owner)):
            return True
    except (OSError, ValueError, AttributeError):
        pass
    try:
        names = os.listdir(sdir)
    except OSError:
        return False
    return any((o := temp_owner(n)) is not None and owner_alive(o) for n in names)


def gc(root: str | os.PathLike[str], *, force: bool = False, min_age_s: float = 60.0) -> list[Path]:
    """Remove leftovers of dead writers under ``root`` and return what was removed (I3):

    - uncommitted step directories whose writer is dead (not touched for ``min_age_s`` seconds, so that
      a writer that has only just made the directory is left alone);
    - temp files and stale lock files of dead owners inside committed steps;
    - trash directories left by an interrupted rotation.

    Committed steps themselves are never removed. ``force`` also removes leftovers whose owner cannot be
    checked (another host) or is alive: only for an operator who knows no job is running.
    """
    r, _ = resolve_root(root)
    removed: list[Path] = []
    now = time.time()
    try:
        names = os.listdir(r)
    except FileNotFoundError:
        return removed
    for name in sorted(names):
        p = r / name
        if is_trash_name(name) and p.is_dir() and not p.is_symlink():
            remove_trash(p, durable=False)
            removed.append(p)
    for step in all_step_dirs(r):
        sdir = r / step_dir_name(step)
        if not is_committed(sdir):  # lexists: a dangling or odd manifest.json still counts (never swept)
            try:
                age = now - os.lstat(sdir).st_mtime
            except OSError:
                continue
            if not force and (age < min_age_s or _writer_alive(sdir)):
                continue
            try:
                trash = move_to_trash(sdir, owned=False)
            except OSError:
                continue
            remove_trash(trash, durable=False)
            removed.append(sdir)
            log.info("gc: removed uncommitted step directory %s", sdir)
            continue
        for n in os.listdir(sdir):
            o = temp_owner(n)
            if n.endswith(TMP_SUFFIX) and (force or o is None or not owner_alive(o)):
                _rm(sdir / n, removed)
        for f in stale_lock_files(sdir):
            _rm(f, removed)
        lock = sdir / SAVE_LOCK_NAME
        if lock.exists() and (force or not _writer_alive(sdir)):
            _rm(lock, removed)
    return removed


def _rm(p: Path, removed: list[Path]) -> None:
    try:
        os.unlink(p)
        removed.append(p)
    except OSError:
        pass
