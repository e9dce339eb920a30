"""POSIX primitives below the commit protocols: this node's and process's identity (host name, owner
tokens that survive pid reuse, liveness of an owner), unique temp names that name their owner, save ids
and timestamps, and raw write helpers (``write(2)`` until done, writeback hints). Nothing here makes a
file durable: that is :mod:`tiered_ckpt.local.commit`'s job (fsync, rename, directory fsync).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import uuid
from datetime import datetime, timezone
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


def new_save_id() -> str:
    """A fresh random save id (32 hex chars)."""
    return uuid.uuid4().hex


def utc_now() -> str:
    """Now in UTC, ISO-8601 with microseconds and a ``Z`` (the manifest's ``created_at``)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def is_real_dir(p: Path) -> bool:
    """``p`` is a directory and not a symlink to one."""
    try:
        return stat.S_ISDIR(os.lstat(p).st_mode)
    except OSError:
        return False



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
