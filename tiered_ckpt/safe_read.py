"""The one way the product opens a file inside a checkpoint directory for reading.

1. The root is opened with ``O_DIRECTORY``, following symlinks (resolved once per read).
2. Every component below it is reached with ``openat(2)`` relative to its parent's fd and
   ``O_NOFOLLOW``; a file must be a regular file by ``fstatat(AT_SYMLINK_NOFOLLOW)`` before it is
   opened (non-blocking) and by ``fstat`` after.
3. Reads into memory are capped (:func:`read_in_root`).

A symlink, FIFO, socket, device or directory where a file should be (or a symlink or non-directory
where a directory should be) raises the caller's ``error`` (default
:class:`~tiered_ckpt.errors.ManifestError`); an ``OSError`` of the open or read raises ``io_error``
(default: ``error``) from it. An absent file raises ``FileNotFoundError`` from :func:`open_in_root`
and returns ``None`` from :func:`read_in_root`; error classes passed in must therefore not derive
from ``FileNotFoundError``. :func:`locate` turns a path into ``(root, relpath)`` by names alone.

Why: docs/design.md, "Safe reads".
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import CheckpointError, ManifestError
from tiered_ckpt.layout import SUPERSEDED_DIR, TRASH_PREFIX, parse_remote_step_entry

PathLike = str | os.PathLike[str]
ErrorType = type[Exception]  #: the caller's error class: called with one message

#: Flags of the final open of a file (POSIX ``open(2)``; ``O_NOCTTY``: a terminal never becomes
#: ours).
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
#: Flags of every directory opened below the root.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: Flags of the root itself (symlinks followed: the root may be one).
ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC
#: Default cap of a small record read whole (a writer lock, a marker): bytes.
MAX_RECORD_BYTES = 64 * 1024


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words: ``"a symlink"``, ``"a FIFO"``, ``"a directory"``,
    ..."""
    for test, word in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return word
    return "not a regular file"


def _parts(relpath: PathLike) -> list[str]:
    parts = [p for p in os.fspath(relpath).split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ValueError(f"{os.fspath(relpath)!r} is not a path inside a checkpoint directory")
    return parts


def _open_root(root: PathLike, io_error: ErrorType) -> int:
    try:
        return os.open(root, ROOT_FLAGS)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise FileNotFoundError(
            errno.ENOENT, f"{os.fspath(root)} is not a directory", os.fspath(root)
        ) from e
    except OSError as e:
        raise io_error(f"{os.fspath(root)} cannot be opened: {e.strerror or e}") from e


def open_dir_in_root(
    root: PathLike,
    relpath: PathLike | None,
    *,
    error: ErrorType = ManifestError,
    io_error: ErrorType | None = None,
) -> int:
    """An fd (``O_DIRECTORY``, caller closes) of the directory ``<root>/<relpath>`` (``None``: the
    root), every component below ``root`` opened ``O_NOFOLLOW``. Raises ``FileNotFoundError``
    (absent), ``error`` (a component is a symlink or not a directory), ``io_error`` (another
    ``OSError``)."""
    fd = _open_root(root, io_error or error)
    where = Path(root)
    try:
        for name in [] if relpath is None else _parts(relpath):
            where = where / name
            try:
                nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                raise
            except OSError as e:
                _raise_for(e, where, fd, name, error, io_error or error, "a directory")
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _raise_for(
    e: OSError, where: Path, dfd: int, name: str, error: ErrorType, io_error: ErrorType, wanted: str
) -> None:
    """Raise the typed error for a failed ``openat(dfd, name)``: the entry's kind when it is the
    wrong kind (looked at without following it), else the ``OSError`` in words."""
    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO, errno.EMLINK):
        try:
            mode = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
        except OSError:
            mode = None
        if mode is not None:
            raise error(
                f"{where} is {kind_of(mode)}, not {wanted}; refusing to "
                f"{'follow' if stat.S_ISLNK(mode) else 'open'} it"
            ) from None
    raise io_error(f"{where} cannot be opened: {e.strerror or e}") from e


def open_in_root(
    root: PathLike,
    relpath: PathLike,
    *,
    error: ErrorType = ManifestError,
    io_error: ErrorType | None = None,
) -> int:
    """An fd (read-only, caller closes) of the regular file ``<root>/<relpath>``: see the module
    docstring for how. Raises ``FileNotFoundError`` (absent), ``error`` (a symlink, FIFO, device,
    socket or directory where the file or a directory on the way should be; never followed, never
    blocking), ``io_error`` (default ``error``: another ``OSError``, kept as ``__cause__``),
    ``ValueError`` (``relpath`` empty or with ``..``)."""
    parts = _parts(relpath)
    io_error = io_error or error
    dfd = (
        open_dir_in_root(root, "/".join(parts[:-1]) or None, error=error, io_error=io_error)
        if len(parts) > 1
        else _open_root(root, io_error)
    )
    name, where = parts[-1], Path(root, *parts)
    try:
        try:
            mode = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            raise
        except OSError as e:
            raise io_error(f"{where} cannot be looked at: {e.strerror or e}") from e
        if not stat.S_ISREG(mode):
            raise error(
                f"{where} is {kind_of(mode)}, not a regular file; refusing to "
                f"{'follow' if stat.S_ISLNK(mode) else 'open'} it"
            )
        try:
            fd = os.open(name, FILE_FLAGS, dir_fd=dfd)
        except FileNotFoundError:
            raise
        except OSError as e:
            _raise_for(e, where, dfd, name, error, io_error, "a regular file")
    finally:
        os.close(dfd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped in after the fstatat
            raise error(f"{where} is {kind_of(mode)}, not a regular file; refusing to read it")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd_capped(
    fd: int,
    cap: int,
    where: PathLike,
    *,
    error: ErrorType = ManifestError,
    io_error: ErrorType | None = None,
) -> bytes:
    """All bytes of the regular file open as ``fd`` from offset 0, at most ``cap``. Raises ``error``
    over the cap (by ``fstat`` or by what the reads return), ``io_error`` (default ``error``) on a
    read error."""
    try:
        size = os.fstat(fd).st_size
        if size > cap:
            raise error(f"{os.fspath(where)} is {size} bytes, over the {cap}-byte cap")
        chunks, got = [], 0
        while got <= size:  # one byte more than fstat said: a file that grows is seen
            b = os.pread(fd, size + 1 - got, got)
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got > cap:
            raise error(f"{os.fspath(where)} grew over the {cap}-byte cap while being read")
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    except OSError as e:
        raise (io_error or error)(f"cannot read {os.fspath(where)}: {e.strerror or e}") from e


def read_in_root(
    root: PathLike,
    relpath: PathLike,
    cap: int,
    *,
    error: ErrorType = ManifestError,
    io_error: ErrorType | None = None,
) -> bytes | None:
    """The bytes (at most ``cap``) of the regular file ``<root>/<relpath>``, or ``None`` when it (or
    a directory on the way) does not exist. Errors as :func:`open_in_root` and
    :func:`read_fd_capped`."""
    try:
        fd = open_in_root(root, relpath, error=error, io_error=io_error)
    except FileNotFoundError:
        return None
    try:
        return read_fd_capped(fd, cap, Path(root, relpath), error=error, io_error=io_error)
    finally:
        os.close(fd)


def locate(path: PathLike) -> tuple[Path, str]:
    """``(root, relpath)`` of a file path inside a checkpoint directory (no I/O): the file's
    directory and its parent are the step-level directory and the root, except that a directory
    under ``<root>/superseded/`` has ``<root>`` as its root. A path of one component below its root
    (``run.json``) is ``(its directory, its name)``. Only names are looked at: the path is made
    absolute and normalised first (``os.path.abspath``: a root given as ``../ckpt`` is the directory
    that names), so no ``..`` is left below the root."""
    p = Path(os.path.abspath(os.fspath(path)))
    d = p.parent
    if d.parent.name == SUPERSEDED_DIR and d.parent.parent != d.parent:
        return d.parent.parent, f"{SUPERSEDED_DIR}/{d.name}/{p.name}"
    if _is_step_level(d.name):
        return d.parent, f"{d.name}/{p.name}"
    return d, p.name


def _is_step_level(name: str) -> bool:
    """A directory name of the step level of a root: a step directory (``step_XXXXXXXXXX``, or with
    a save id as in ``superseded/``), a trash directory (``.trash.``)."""
    return parse_remote_step_entry(name) is not None or name.startswith(TRASH_PREFIX)


def open_file(
    path: PathLike, *, error: ErrorType = ManifestError, io_error: ErrorType | None = None
) -> int:
    """:func:`open_in_root` of :func:`locate` ``(path)``."""
    root, rel = locate(path)
    return open_in_root(root, rel, error=error, io_error=io_error)


def read_file(
    path: PathLike, cap: int, *, error: ErrorType = ManifestError, io_error: ErrorType | None = None
) -> bytes | None:
    """:func:`read_in_root` of :func:`locate` ``(path)``: the bytes, or ``None`` when absent."""
    root, rel = locate(path)
    return read_in_root(root, rel, cap, error=error, io_error=io_error)


def read_existing(
    path: PathLike, cap: int = MAX_RECORD_BYTES, *, error: ErrorType = ManifestError
) -> bytes:
    """:func:`read_file`, but an absent file raises ``FileNotFoundError`` (a drop-in for
    ``Path.read_bytes`` that never follows, never blocks and is capped)."""
    data = read_file(path, cap, error=error)
    if data is None:
        raise FileNotFoundError(errno.ENOENT, "no such file", os.fspath(path))
    return data


def read_json_record(path: PathLike, cap: int = MAX_RECORD_BYTES) -> dict[str, Any] | None:
    """The JSON object in the small record ``path`` (a writer lock), read as :func:`read_file`
    reads; ``None`` when absent, not a regular file, over ``cap`` bytes, unreadable, not JSON or not
    an object. Never raises."""
    try:
        data = read_file(path, cap)
        obj = json.loads(data) if data is not None else None
    except (OSError, CheckpointError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


@contextlib.contextmanager
def opened(
    path: PathLike, *, error: ErrorType = ManifestError, io_error: ErrorType | None = None
) -> Iterator[int]:
    """:func:`open_file` as a ``with`` block yielding the fd (closed at the end)."""
    fd = open_file(path, error=error, io_error=io_error)
    try:
        yield fd
    finally:
        os.close(fd)


def lstat_in_dir(dir_path: PathLike, name: str) -> os.stat_result | None:
    """``lstat`` of ``<dir_path>/<name>`` with ``dir_path`` reached as :func:`open_dir_in_root` does
    (components below its root not followed); ``None`` when absent or not reachable that way. Never
    raises."""
    try:
        root, rel = locate(Path(dir_path, name))
        parent = rel.rpartition("/")[0] or None
        fd = open_dir_in_root(root, parent)
    except (OSError, CheckpointError, ValueError):
        return None
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(fd)


def is_regular_file(path: PathLike) -> bool:
    """Whether ``path`` inside a checkpoint directory is a regular file, reached without following
    any symlink below its root (:func:`locate`). Never raises."""
    p = Path(path)
    st = lstat_in_dir(p.parent, p.name)
    return st is not None and stat.S_ISREG(st.st_mode)


def list_in_root(root: PathLike, relpath: PathLike | None) -> list[str]:
    """Names in the directory ``<root>/<relpath>`` (``None``: the root), reached as
    :func:`open_dir_in_root` does: never through a symlink below the root. ``[]`` when absent, a
    symlink, not a directory or unreadable. Never raises."""
    try:
        fd = open_dir_in_root(root, relpath)
    except (OSError, CheckpointError, ValueError):
        return []
    try:
        return os.listdir(fd)
    except OSError:
        return []
    finally:
        os.close(fd)


def regular_files_in_root(
    root: PathLike, relpath: PathLike | None, suffix: str = ""
) -> dict[str, int]:
    """``{name: size in bytes}`` of the regular files (``lstat``: symlinks are not files here) whose
    name ends with ``suffix`` in the directory ``<root>/<relpath>``, reached as :func:`list_in_root`
    does. ``{}`` when it cannot be read. Never raises."""
    try:
        fd = open_dir_in_root(root, relpath)
    except (OSError, CheckpointError, ValueError):
        return {}
    out = {}
    try:
        for name in os.listdir(fd):
            if name.endswith(suffix):
                with contextlib.suppress(OSError):
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        out[name] = st.st_size
    except OSError:
        return {}
    finally:
        os.close(fd)
    return out


def list_dir(dir_path: PathLike) -> list[str]:
    """:func:`list_in_root` of a directory inside a checkpoint directory given by path (a step
    directory, a superseded entry: its root as :func:`locate` finds it)."""
    root, rel = locate(Path(os.path.abspath(os.fspath(dir_path)), "x"))
    return list_in_root(root, rel.rpartition("/")[0] or None)


def regular_files(dir_path: PathLike, suffix: str = "") -> dict[str, int]:
    """:func:`regular_files_in_root` of a directory given by path (its root as :func:`locate` finds
    it)."""
    root, rel = locate(Path(os.path.abspath(os.fspath(dir_path)), "x"))
    return regular_files_in_root(root, rel.rpartition("/")[0] or None, suffix)


__all__ = [
    "DIR_FLAGS",
    "FILE_FLAGS",
    "MAX_RECORD_BYTES",
    "ROOT_FLAGS",
    "is_regular_file",
    "kind_of",
    "list_dir",
    "list_in_root",
    "locate",
    "lstat_in_dir",
    "open_dir_in_root",
    "open_file",
    "open_in_root",
    "opened",
    "read_existing",
    "read_fd_capped",
    "read_json_record",
    "regular_files",
    "regular_files_in_root",
    "read_file",
    "read_in_root",
]
