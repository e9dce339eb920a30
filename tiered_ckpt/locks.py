"""Advisory step locks shared by readers, the uploader sidecar and rotation; and node tokens.

1. A holder (a loader reading a step, the sidecar uploading it) creates
   ``<step_dir>/.lock.<kind>.<host>.<pid>.<starttime>.<rand>`` with ``O_CREAT|O_EXCL`` and removes
   it when done (:func:`hold_step_lock`). ``kind``: ``read``, ``upload`` or ``stalled``.
2. Rotation and gc (:func:`live_locks`) treat a step as locked while any such file names a live
   owner; files of dead owners on this host are stale (gc removes them).
3. To delete a step, rotation renames it to a trash name, then checks the locks again inside it and
   renames it back if a holder raced in.

Node tokens (the end of this module) are presence files of another kind: which ranks share a root.
Why files and not flock: docs/design.md, "Step locks".
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from tiered_ckpt.fs import owner_alive, owner_token
from tiered_ckpt.layout import LOCK_PREFIX, NODE_TOKEN_PREFIX


def _parse(name: str) -> tuple[str, str] | None:
    if not name.startswith(LOCK_PREFIX):
        return None
    parts = name[len(LOCK_PREFIX) :].split(".")
    # kind, host, pid, start, rand
    if len(parts) != 5:
        return None
    return parts[0], ".".join(parts[1:4])


def acquire_step_lock(step_dir: str | os.PathLike[str], kind: str) -> Path:
    """Create an advisory ``kind`` lock file on ``step_dir`` and return its path; the caller removes
    it with :func:`release_step_lock` (a lock held across calls, e.g. the sidecar's ``stalled``
    lock). Raises ``ValueError`` (``kind`` not alphanumeric), ``FileNotFoundError`` (no step
    directory)."""
    if not kind.isalnum():
        raise ValueError(f"lock kind must be alphanumeric, got {kind!r}")
    path = Path(step_dir) / f"{LOCK_PREFIX}{kind}.{owner_token()}.{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    os.close(fd)
    return path


def release_step_lock(path: str | os.PathLike[str]) -> None:
    """Remove a lock file made by :func:`acquire_step_lock` (gone already, with its step: fine)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@contextlib.contextmanager
def hold_step_lock(step_dir: str | os.PathLike[str], kind: str) -> Iterator[Path]:
    """Hold an advisory ``kind`` lock on ``step_dir`` for the duration of the ``with`` block.

    Raises ``FileNotFoundError`` if the step directory does not exist.
    """
    path = acquire_step_lock(step_dir, kind)
    try:
        yield path
    finally:
        release_step_lock(path)


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
    return [
        Path(step_dir) / name for name, _, owner in _lock_files(step_dir) if not owner_alive(owner)
    ]


# --- node tokens
# Which ranks share a local root (SPEC §11 "Nodes"): each rank creates
# ``<root>/.node.<owner>.<rand>`` and looks up the names the other ranks created; a name it finds is
# on its disk. Read by tiered_ckpt.training.dist; the files carry no data and need no durability
# (rewritten by every job).


def _node_token_owner(name: str) -> str | None:
    """The owner token inside a node token file name, or ``None`` when ``name`` is not one."""
    if not name.startswith(NODE_TOKEN_PREFIX) or "/" in name:
        return None
    owner, _, rand = name[len(NODE_TOKEN_PREFIX) :].rpartition(".")
    return owner if rand and len(owner.split(".")) == 3 else None


def write_node_token(root: str | os.PathLike[str]) -> str:
    """Create a fresh node token file in ``root`` (made if missing) and return its name; node tokens
    of dead owners there are removed first (:func:`sweep_stale_node_tokens`). Unique per call (owner
    token plus 48 random bits; ``O_EXCL``). Raises ``OSError`` (unwritable root)."""
    r = Path(root)
    r.mkdir(parents=True, exist_ok=True)
    sweep_stale_node_tokens(r)
    name = f"{NODE_TOKEN_PREFIX}{owner_token()}.{uuid.uuid4().hex[:12]}"
    fd = os.open(r / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    os.close(fd)
    return name


def node_token_present(root: str | os.PathLike[str], name: str) -> bool:
    """Whether the node token file ``name`` (another rank's, from :func:`write_node_token`) is in
    ``root``: looked up by name (a fresh name is never in a client's negative cache, so on NFS the
    lookup asks the server), never through a directory listing. A malformed name is ``False``."""
    if _node_token_owner(name) is None:
        return False
    try:
        os.lstat(Path(root) / name)
        return True
    except OSError:
        return False


def remove_node_token(root: str | os.PathLike[str], name: str) -> None:
    """Remove the node token file ``name`` from ``root`` (gone already: fine)."""
    if _node_token_owner(name) is not None:
        try:
            os.unlink(Path(root) / name)
        except OSError:
            pass


def sweep_stale_node_tokens(root: str | os.PathLike[str]) -> int:
    """Remove node token files in ``root`` whose owner is dead (:func:`~tiered_ckpt.fs.owner_alive`:
    only owners of this host, boot and pid namespace can be judged). Returns how many."""
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    n = 0
    for name in names:
        owner = _node_token_owner(name)
        if owner is not None and not owner_alive(owner):
            try:
                os.unlink(Path(root) / name)
                n += 1
            except OSError:
                pass
    return n
