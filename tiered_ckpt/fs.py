"""POSIX primitives below the commit protocols: this node's and process's identity (host name,
kernel boot id, pid namespace; owner tokens that survive pid reuse and tell machines with one host
name apart; liveness of an owner), unique temp names that name their owner, save ids
and timestamps, raw write helpers (``write(2)`` until done, writeback hints) and read helpers
(read-ahead advice, how much of a file is in the page cache, an ``O_DIRECT`` descriptor of an open
file). Nothing here makes a file durable: that is :mod:`tiered_ckpt.local.commit`'s job (fsync,
rename, directory fsync).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from tiered_ckpt.layout import TMP_SUFFIX

_HOST = None

#: Separator of the identity fields inside the first field of an owner token. :func:`hostname` never
#: yields it, so a token whose first field has none is of the old ``<host>.<pid>.<start>`` format.
_ID_SEP = "_"
_BOOT_ID_CHARS = 16  # of the kernel's 128-bit random boot id: 64 bits tell two boots apart
_UNKNOWN = "x"
_IDENTITY: tuple[int, str, str] | None = None  # (pid it was read in, boot id, pid namespace)


def hostname() -> str:
    """This node's host name, made safe for file names (``[A-Za-z0-9-]``)."""
    global _HOST
    if _HOST is None:
        raw = socket.gethostname() or "localhost"
        _HOST = "".join(c if c.isalnum() or c == "-" else "-" for c in raw)[:64] or "localhost"
    return _HOST


def _read_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            raw = f.read(64).decode("ascii", "replace")
    except OSError:
        return _UNKNOWN
    digits = "".join(c for c in raw.lower() if c in "0123456789abcdef")
    return digits[:_BOOT_ID_CHARS] or _UNKNOWN


def _read_pid_namespace() -> str:
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return _UNKNOWN
    digits = "".join(c for c in link if c.isdigit())
    return digits or _UNKNOWN


def _identity() -> tuple[str, str]:
    """``(boot id, pid namespace)`` of this process, read once per process (a forked child reads its
    own: it may live in another pid namespace than its parent)."""
    global _IDENTITY
    pid = os.getpid()
    if _IDENTITY is None or _IDENTITY[0] != pid:
        _IDENTITY = (pid, _read_boot_id(), _read_pid_namespace())
    return _IDENTITY[1], _IDENTITY[2]


def boot_id() -> str:
    """The first 16 hex digits of this machine's kernel boot id
    (``/proc/sys/kernel/random/boot_id``, random per boot, so two machines with one host name
    differ), or ``"x"`` where it cannot be read."""
    return _identity()[0]


def pid_namespace() -> str:
    """The inode number of this process's pid namespace (``readlink /proc/self/ns/pid``, see
    namespaces(7)), as decimal digits, or ``"x"`` where it cannot be read. Two processes with one
    pid number in different containers differ here."""
    return _identity()[1]


def node_identity() -> str:
    """``<host>_<boot id>_<pid namespace>``: the first field of this process's :func:`owner_token`,
    the scope within which its pid means one process."""
    boot, ns = _identity()
    return f"{hostname()}{_ID_SEP}{boot}{_ID_SEP}{ns}"


def _proc_is_ours() -> bool:
    """Whether ``/proc`` is mounted for this process's pid namespace (``/proc/self`` names our own
    pid): only then does ``/proc/<pid>`` describe the process a token of this namespace names."""
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return False


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or ``None``.

    Together with the pid it identifies a process even after pid reuse.
    """
    return _start_time_from(f"/proc/{pid}/stat")


def _start_time_from(stat_path: str) -> int | None:
    try:
        with open(stat_path, "rb") as f:
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
    """``<host>_<boot id>_<pid namespace>.<pid>.<starttime>`` of the calling process: who owns a
    temp file or lock (SPEC §11 "Nodes").

    Three dot-separated fields, as the old ``<host>.<pid>.<starttime>`` format had (the names of
    temp files, lock files and trash directories embed it and are parsed by field count). The start
    time is read from ``/proc/self/stat`` (right even where ``/proc`` belongs to another pid
    namespace), ``0`` where it cannot be read.
    """
    return f"{node_identity()}.{os.getpid()}.{_start_time_from('/proc/self/stat') or 0}"


def owner_alive(token: str) -> bool:
    """Whether the process named by an :func:`owner_token` may still be running.

    Only a process of this very host name, kernel boot and pid namespace can be checked; for any
    other (another machine, even one with our host name; another container on this machine; a
    namespace whose ``/proc`` is not mounted here) the answer is ``True``: we cannot tell, and a
    live writer must never be judged dead (its leftovers are never swept automatically; ``gc
    --force`` exists for that). Checkable tokens: the pid exists, is not a zombie, and has the same
    start time (``0``: any). Old-format tokens (``<host>.<pid>.<starttime>``, written before boot id
    and namespace were part of the identity) keep their old meaning: another host name -> ``True``,
    this one -> the pid check. A malformed token is ``False`` (no process can own it).
    """
    parts = token.rsplit(".", 2)
    if len(parts) != 3:
        return False
    node, pid_s, start_s = parts
    if _ID_SEP in node:
        fields = node.split(_ID_SEP)
        if len(fields) != 3 or not all(fields):
            return False
        if node != node_identity() or not _proc_is_ours():
            return True
    elif node != hostname():
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

    A large file written in chunks is then mostly on disk by the time the final ``fsync`` runs,
    instead of the whole file being flushed after the last write: the flush overlaps hashing and
    writing. It is only a hint: durability still comes from ``fsync``, which also reports any I/O
    error, so errors here are ignored.
    """
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def advise_sequential(fd: int, offset: int, nbytes: int) -> None:
    """Tell the kernel ``[offset, offset + nbytes)`` of ``fd`` will be read once, in order
    (``posix_fadvise(POSIX_FADV_SEQUENTIAL)``, POSIX; Linux doubles the readahead window). Only a
    hint: where it is unsupported (not Linux, a pipe) nothing happens and no error is raised."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None or nbytes <= 0:
        return
    try:
        advise(fd, offset, nbytes, os.POSIX_FADV_SEQUENTIAL)
    except OSError:
        pass


#: Alignment of ``O_DIRECT`` reads (offset, length and buffer address): 4 KiB covers the logical
#: block size of the disks and filesystems that take ``O_DIRECT`` (512 B or 4 KiB).
DIRECT_ALIGN = 4096


def _load_syscall() -> Callable[..., int] | None:
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).syscall
        fn.restype = ctypes.c_long
        return fn  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_SYSCALL = _load_syscall()
#: ``cachestat(2)`` (Linux >= 6.5): the same number on every architecture (the generic table).
_NR_CACHESTAT = 451


def cached_fraction(fd: int, nbytes: int) -> float | None:
    """The fraction of the first ``nbytes`` of ``fd`` that sits in the page cache now, from
    ``cachestat(2)`` (Linux >= 6.5), else from ``mincore(2)`` over a read-only mapping (Linux,
    nothing is faulted in); ``None`` where neither answers (not Linux, a file that cannot be
    mapped). Only a hint (the cache changes under it)."""
    if nbytes <= 0:
        return 1.0
    if _SYSCALL is None or os.uname().sysname != "Linux":
        return None
    import ctypes
    import mmap

    rng = (ctypes.c_uint64 * 2)(0, nbytes)
    st = (ctypes.c_uint64 * 5)()  # nr_cache, nr_dirty, nr_writeback, nr_evicted, ...
    if _SYSCALL(_NR_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) == 0:
        return min(1.0, st[0] / -(-nbytes // mmap.PAGESIZE))
    return _mincore_fraction(fd, nbytes)  # an older kernel (ENOSYS)


def _mincore_fraction(fd: int, nbytes: int) -> float | None:
    try:
        import ctypes
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        n = -(-nbytes // page)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        addr = libc.mmap(None, n * page, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(ctypes.c_void_p(addr), n * page, vec) != 0:
                return None
            return sum(b & 1 for b in bytes(vec)) / n
        finally:
            libc.munmap(ctypes.c_void_p(addr), n * page)
    except (OSError, AttributeError, ValueError):
        return None


def open_direct(fd: int) -> int | None:
    """A second read-only descriptor of the file open as ``fd``, with ``O_DIRECT`` (reads go from
    the disk straight into the caller's buffer: no page cache pages to allocate, fill and copy
    from). Reopened through ``/proc/self/fd`` (the same inode, whatever its path now; checked);
    ``None`` where the platform, the filesystem or ``/proc`` does not allow it. The caller closes
    it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | flag | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        a, b = os.fstat(fd), os.fstat(dfd)
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) and stat.S_ISREG(b.st_mode):
            return dfd
    except OSError:
        pass
    os.close(dfd)
    return None


def write_all(fd: int, data: memoryview | bytes) -> None:
    """``write(2)`` until every byte is written (short writes happen on large buffers and
    signals)."""
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
