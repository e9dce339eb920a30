"""Filesystem primitives of the commit protocol (POSIX): unique temp names, fsync, atomic rename,
directory fsync, writer liveness. Knows nothing of manifests, S3 or threads.

The durable-replace recipe (SPEC §2, I1): write to a unique temp name in the *same directory*, fsync the
file, ``rename(2)`` it over the final name (atomic on one POSIX filesystem), then fsync the directory so
that the rename itself survives a power loss. torch DCP and orbax skip the directory fsync; we don't.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Callable

from tiered_ckpt.layout import TMP_SUFFIX

_HOST = None


def hostname() -> str:
    """This node's host name, made safe for file names (``[A-Za-z0-9-]``)."""
    global _HOST
    if _HOST is None:
        raw = socket.gethostname() or "localhost"
        _HOST = "".join(c if c.isalnum() or c == "-" else "-" for c in raw)[:64] or "localhost"
    return _HOST


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or ``None``.

    Together with the pid it identifies a process even after pid reuse.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        if fields[0] == b"Z":  # a zombie is dead for our purposes
            return None
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def owner_token() -> str:
    """``<host>.<pid>.<starttime>`` of the calling process: who owns a temp file or lock."""
    pid = os.getpid()
    return f"{hostname()}.{pid}.{process_start_time(pid) or 0}"


def owner_alive(token: str) -> bool:
    """Whether the process named by an :func:`owner_token` may still be running.

    On another host we cannot tell, so the answer is ``True`` (leftovers of other hosts are never swept
    automatically; ``gc --force`` exists for that). On this host: the pid exists, is not a zombie, and has
    the same start time.
    """
    parts = token.rsplit(".", 2)
    if len(parts) != 3:
        return False
    host, pid_s, start_s = parts
    if host != hostname():
        return True
    try:
        pid, start = int(pid_s), int(start_s)
    except ValueError:
        return False
    actual = process_start_time(pid)
    if actual is None:
        return False
    return start == 0 or actual == start


def temp_name_for(final_name: str) -> str:
    """A unique temp name for one write attempt of ``final_name``: ``.<final>.<owner>.<rand>.tmp``.

    Unique per attempt (I4) and parseable by :func:`temp_owner` so that cleanup can tell whether its
    writer is alive (I3).
    """
    return f".{final_name}.{owner_token()}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}"


def temp_owner(name: str) -> str | None:
    """The owner token inside a temp name made by :func:`temp_name_for`, or ``None``."""
    if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
        return None
    parts = name[: -len(TMP_SUFFIX)].split(".")
    # [..., host, pid, start, rand]
    if len(parts) < 5:
        return None
    return ".".join(parts[-4:-1])


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that entries created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not Linux/glibc: fsync alone does the work
        return None


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to disk now, without
    waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; a no-op elsewhere).

    A large file written in chunks is then mostly on disk by the time the final ``fsync`` runs, instead
    of the whole file being flushed after the last write: the flush overlaps hashing and writing. It is
    only a hint: durability still comes from ``fsync``, which also reports any I/O error, so errors
    here are ignored.
    """
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def write_all(fd: int, data: memoryview | bytes) -> None:
    """``write(2)`` until every byte is written (short writes happen on large buffers and signals)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.write(fd, view)
        if n <= 0:  # pragma: no cover - POSIX write never returns 0 for a positive count on files
            raise OSError(errno.EIO, "write returned 0")
        view = view[n:]


def atomic_write(
    path: str | os.PathLike[str],
    writer: Callable[[int], None],
    *,
    exclusive: bool = False,
    dir_fsync: bool = True,
) -> None:
    """Durably create or replace ``path`` with whatever ``writer(fd)`` writes.

    Temp file in the same directory (``O_CREAT|O_EXCL``, mode 0o644), ``writer(fd)``, ``fsync``, then
    ``rename`` over ``path`` (or, with ``exclusive=True``, ``link`` + ``unlink`` so that an existing
    ``path`` makes it fail with ``FileExistsError``), then fsync the directory. On any error the temp
    file is removed and the ``OSError`` propagates; with ``exclusive=True`` an error of the directory
    fsync also removes ``path`` again, so that an error always means "not created".
    """
    path = Path(path)
    tmp = path.with_name(temp_name_for(path.name))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            writer(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            os.link(tmp, path)
        else:
            os.rename(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if exclusive:
        _unlink_quietly(tmp)  # a leftover hard link is harmless: gc removes it once we are gone
    if dir_fsync:
        try:
            fsync_dir(path.parent)
        except BaseException:
            if exclusive:
                # The new entry may not be durable: take it away again so that the caller's error is
                # the whole truth (for a manifest: the step is not committed, the previous stays newest).
                _unlink_quietly(path)
            raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, **kwargs: bool) -> None:
    """:func:`atomic_write` of a bytes object."""
    atomic_write(path, lambda fd: write_all(fd, data), **kwargs)


def atomic_write_json(path: str | os.PathLike[str], obj: object, **kwargs: bool) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), **kwargs)


def _unlink_quietly(path: str | os.PathLike[str]) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass  # best effort: the caller is already failing with the original error


def unlink_quietly(path: str | os.PathLike[str]) -> None:
    """Remove a file, ignoring any error (cleanup on a failure path)."""
    _unlink_quietly(path)


def unlink_durable(path: str | os.PathLike[str]) -> bool:
    """Remove ``path`` and fsync its directory. Returns whether it existed."""
    path = Path(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True
