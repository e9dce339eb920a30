"""Temp-file leftovers of dead writers in a step directory or a run root (SPEC §2 I3).

Every temp file the product writes is named by :func:`tiered_ckpt.fs.temp_name_for`,
``.<final>.<owner>.<rand>.tmp``, whatever writes it: a rank's shard, a manifest, a lock,
``run.json``, a restore's download (:meth:`~tiered_ckpt.local.commit.LocalStepCommit.stage`). A name
derived from such a temp name by appending suffixes (a download tool that writes
``<temp>.<uuid>.download`` next to its target, as s3transfer does for file names) is the same
writer's leftover: it carries the same owner token. The owner token tells whether the writer may
still be running (:func:`tiered_ckpt.fs.owner_alive`: a process of another host or container counts
as alive, so only ``gc --force`` removes its files).

Used by ``gc`` and ``ls`` (:mod:`tiered_ckpt.local.scan`) and by a restore that starts over in a
step directory a dead restore left (:mod:`tiered_ckpt.remote.restore.restorer`). ``lstat``/``unlink`` only:
nothing is followed, nothing renamed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tiered_ckpt.fs import owner_alive, temp_owner
from tiered_ckpt.layout import TMP_SUFFIX
from tiered_ckpt.safe_read import regular_files


def leftover_owner(name: str) -> str | None:
    """The owner token inside a temp name (:func:`~tiered_ckpt.fs.temp_name_for`) or inside a name
    derived from one by appending ``.``-separated suffixes
    (``.<final>.<owner>.<rand>.tmp.<uuid>.download``); ``None`` for any other name."""
    if not name.startswith("."):
        return None
    if name.endswith(TMP_SUFFIX):
        return temp_owner(name)
    mark = TMP_SUFFIX + "."
    i = name.rfind(mark)
    while i > 0:
        owner = temp_owner(name[: i + len(TMP_SUFFIX)])
        if owner is not None:
            return owner
        i = name.rfind(mark, 0, i)
    return None


def is_temp_name(name: str) -> bool:
    """A temp file of some writer: a name ending in ``.tmp`` (the old sweep's rule, kept) or a name
    derived from an owner-named temp name (:func:`leftover_owner`)."""
    return name.endswith(TMP_SUFFIX) or leftover_owner(name) is not None


@dataclass(frozen=True)
class TempFile:
    """One temp entry of a directory: ``path``, ``size_bytes`` (``lstat``), ``owner`` token
    (``None``: the name carries none) and whether that owner is ``dead`` (``owner_alive`` says no,
    or no owner)."""

    path: Path
    size_bytes: int
    owner: str | None
    dead: bool


def temp_files(directory: Path, sizes: Mapping[str, int] | None = None) -> list[TempFile]:
    """The temp entries (regular files, not followed) directly in ``directory``, by name; ``[]``
    when it cannot be listed. The directory is reached through :mod:`tiered_ckpt.safe_read`
    (``O_NOFOLLOW`` below the root: a symlinked step directory is never listed). ``sizes``: its
    :func:`~tiered_ckpt.safe_read. regular_files` when already listed."""
    sizes = regular_files(directory) if sizes is None else sizes
    out: list[TempFile] = []
    for name in sorted(sizes):
        if not is_temp_name(name):
            continue
        owner = leftover_owner(name)
        out.append(
            TempFile(
                Path(directory, name), sizes[name], owner, owner is None or not owner_alive(owner)
            )
        )
    return out


def leftover_bytes(directory: Path, sizes: Mapping[str, int] | None = None) -> int:
    """Bytes of the temp files of dead writers in ``directory`` (what ``gc`` removes there without
    ``--force``); 0 for a symlink or a directory that cannot be listed. ``sizes`` as
    :func:`temp_files`."""
    if os.path.islink(directory):
        return 0
    return sum(t.size_bytes for t in temp_files(directory, sizes) if t.dead)


def remove_dead_temps(
    directory: Path, *, force: bool = False, owned_only: bool = False
) -> list[Path]:
    """Remove the temp files of dead writers in ``directory`` (``force``: of every writer) and
    return them. ``owned_only``: only names that carry an owner token (a restore cleaning up before
    it starts leaves other names to ``gc``). Errors of single removals are skipped (best effort, as
    gc's)."""
    removed: list[Path] = []
    if os.path.islink(directory):
        return removed
    for t in temp_files(directory):
        if owned_only and t.owner is None:
            continue
        if force or t.dead:
            try:
                os.unlink(t.path)
            except OSError:
                continue
            removed.append(t.path)
    return removed


def placed_identity(path: Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``path`` (not followed), or ``None``: what a writer records of a file
    before renaming it into place, so that it later removes only the file it placed (a rename keeps
    the inode)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def remove_placed(directory: Path, placed: dict[str, tuple[int, int]]) -> list[str]:
    """Remove each ``directory/<name>`` of ``placed`` that is still the very file recorded
    (:func:`placed_identity`; a file another writer renamed over it since is left alone). Returns
    the names removed. Raises ``OSError`` from an ``unlink`` other than ENOENT."""
    removed: list[str] = []
    for name, ident in sorted(placed.items()):
        if placed_identity(directory / name) != ident:
            continue
        try:
            os.unlink(directory / name)
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed


__all__ = [
    "TempFile",
    "is_temp_name",
    "leftover_bytes",
    "leftover_owner",
    "placed_identity",
    "remove_dead_temps",
    "remove_placed",
    "temp_files",
]
