"""Advisory step locks shared by readers, the uploader sidecar and rotation.

Protocol (one file per holder, no flock so that it works the same on NFS-like shared filesystems):

1. A holder (a loader reading a step, the sidecar uploading it) creates
   ``<step_dir>/.lock.<kind>.<host>.<pid>.<starttime>.<rand>`` with ``O_CREAT|O_EXCL`` and removes it
   when done (:func:`hold_step_lock`).
2. Rotation and gc (:func:`live_locks`) treat a step as locked while any such file names a live owner;
   files of dead owners on this host are stale and ignored (and removed by gc).
3. To delete a step, rotation first renames the step directory to a trash name (atomic), then checks the
   locks again inside it: a holder that raced in is seen and the directory is renamed back.

``kind`` is a short word: ``read`` or ``upload``.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Iterator

from tiered_ckpt.fs import owner_alive, owner_token
from tiered_ckpt.layout import LOCK_PREFIX


def _parse(name: str) -> tuple[str, str] | None:
    if not name.startswith(LOCK_PREFIX):
        return None
    parts = name[len(LOCK_PREFIX) :].split(".")
    # kind, host, pid, start, rand
    if len(parts) != 5:
        return None
    return parts[0], ".".join(parts[1:4])


@contextlib.contextmanager
def hold_step_lock(step_dir: str | os.PathLike[str], kind: str) -> Iterator[Path]:
    """Hold an advisory ``kind`` lock on ``step_dir`` for the duration of the ``with`` block.

    Raises ``FileNotFoundError`` if the step directory does not exist.
    """
    if not kind.isalnum():
        raise ValueError(f"lock kind must be alphanumeric, got {kind!r}")
    path = Path(step_dir) / f"{LOCK_PREFIX}{kind}.{owner_token()}.{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    os.close(fd)
    try:
        yield path
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _lock_files(step_dir: str | os.PathLike[str]) -> list[tuple[str, str, str]]:
    """``(file name, kind, owner)`` of every lock file on ``step_dir``."""
    try:
        names = os.listdir(step_dir)
    except FileNotFoundError:
        return []
    return [(name, *parsed) for name in names if (parsed := _parse(name))]


def live_locks(step_dir: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """``(kind, owner)`` of every lock on ``step_dir`` whose owner may be alive."""
    return [(kind, owner) for _, kind, owner in _lock_files(step_dir) if owner_alive(owner)]


def stale_lock_files(step_dir: str | os.PathLike[str]) -> list[Path]:
    """Lock files on ``step_dir`` whose owner is dead (safe to remove)."""
    return [Path(step_dir) / name for name, _, owner in _lock_files(step_dir) if not owner_alive(owner)]
