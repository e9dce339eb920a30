"""Removing a step directory safely (SPEC §2 I3, rotation and gc): rename it to a trash name first
(atomic, POSIX ``rename(2)``), so that no reader or lock holder ever sees a half-deleted step under
its own name, then remove the trash. The one place besides :mod:`tiered_ckpt.local.commit` that
renames or fsyncs.

Trash names: ``.trash.<step dir>.<owner token>.<rand>`` (:func:`move_to_trash`, rotation: a dead
owner's trash is swept by :func:`sweep_trash`) and ``.trash.<step dir>.<rand>`` (gc's: always
removable by gc).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from tiered_ckpt.fs import owner_alive, owner_token
from tiered_ckpt.layout import TRASH_PREFIX
from tiered_ckpt.local.commit import fsync_dir


def move_to_trash(step_dir: Path, *, owned: bool = True) -> Path:
    """Rename ``step_dir`` to a unique trash name beside it and return that path (no fsync yet: the
    caller either puts it back with :func:`put_back` or calls :func:`remove_trash`). ``owned`` names
    the calling process in the trash name, so that :func:`sweep_trash` can tell a dead deleter's
    leftovers.

    Raises ``FileNotFoundError`` if ``step_dir`` is gone, ``OSError`` if the rename fails.
    """
    rand = uuid.uuid4().hex[:8]
    name = (
        f"{TRASH_PREFIX}{step_dir.name}.{owner_token()}.{rand}"
        if owned
        else f"{TRASH_PREFIX}{step_dir.name}.{rand}"
    )
    trash = step_dir.parent / name
    os.rename(step_dir, trash)
    return trash


def put_back(trash: Path, step_dir: Path) -> None:
    """Undo :func:`move_to_trash` (a lock holder raced in) and make the rename durable."""
    os.rename(trash, step_dir)
    fsync_dir(step_dir.parent)


def remove_trash(trash: Path, *, durable: bool = True) -> None:
    """Make the rename into trash durable, remove the trash tree, and fsync the parent again."""
    if durable:
        fsync_dir(trash.parent)
        shutil.rmtree(trash)
        fsync_dir(trash.parent)
    else:
        shutil.rmtree(trash, ignore_errors=True)


def is_trash_name(name: str) -> bool:
    """Whether a directory entry is a trash directory (never a step)."""
    return name.startswith(TRASH_PREFIX)


def trash_owner(name: str) -> str | None:
    """The owner token in a trash name of :func:`move_to_trash` with ``owned`` (rotation's: of a
    step directory, or of a ``superseded/`` entry with its save id), or ``None`` (gc's naming, or no
    trash name)."""
    if not name.startswith(TRASH_PREFIX):
        return None
    parts = name[len(TRASH_PREFIX) :].split(".")
    # step_XXXXXXXXXX[, save id], host, pid, start, rand
    return ".".join(parts[-4:-1]) if len(parts) in (5, 6) else None


def sweep_trash(root: str | os.PathLike[str]) -> int:
    """Remove trash directories left by dead deleters on this host (rotation's naming). Returns how
    many were removed."""
    r = Path(root)
    try:
        names = os.listdir(r)
    except FileNotFoundError:
        return 0
    n = 0
    for name in names:
        if not name.startswith(TRASH_PREFIX):
            continue
        owner = trash_owner(name)
        if owner is None or owner_alive(owner):
            continue  # gc's naming, or a live deleter: not ours to touch
        shutil.rmtree(r / name, ignore_errors=True)
        n += 1
    if n:
        fsync_dir(r)
    return n


__all__ = [
    "TRASH_PREFIX",
    "is_trash_name",
    "move_to_trash",
    "put_back",
    "remove_trash",
    "sweep_trash",
    "trash_owner",
]
