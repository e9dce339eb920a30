"""Verified reads of parts of a committed shard file, and streaming whole-file verification.

:class:`ShardReader` reads only what it is asked for (``pread`` of byte ranges, never the whole
file) and verifies exactly the bytes it read (manifest schema v2):

- the length prefix and JSON header (the state tree and, header format 2, the tensor index included)
  against the shard's ``header_sha256``, before parsing (:func:`check_header_bytes`: the one place
  every reader gets a shard's tensor records from);
- a byte range ``[a, b)`` of a tensor by reading the enclosing chunk-aligned range ``[a - a % C,
  min(ceil(b / C) * C, nbytes))`` (``C`` = the shard's ``crc32c_chunk_bytes``) and checking the
  CRC32C of every chunk in it against the tensor's ``crc32c`` list. So a read costs at most ``2 *
  C`` bytes more than asked for per contiguous range.

A shard without those checksums (a step written by schema version 1) is first verified whole,
streaming, against its sha256 (reading the whole file once); ranges are then read exactly.

:func:`verify_shard_stream` checks a whole shard (size, sha256 or CRC32C, header) with a small
reusable buffer: used by ``tiered-ckpt verify`` and :func:`tiered_ckpt.local.scan.inspect_step`, it
needs no memory in proportion to the shard.

Every failure raises :class:`MissingShardError`, :class:`ShardCorruptedError` or
:class:`ManifestError` (a symlink or non-regular file), as the loaders do.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiered_ckpt.errors import (
    CheckpointError,
    ManifestError,
    MissingShardError,
    ShardCorruptedError,
)
from tiered_ckpt.format import shard_file as fmt
from tiered_ckpt.format.crc32c import Crc32c, first_bad_chunk
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord, TensorRecord, numel
from tiered_ckpt.fs import DIRECT_ALIGN, advise_sequential, cached_fraction, open_direct
from tiered_ckpt.locks import hold_step_lock
from tiered_ckpt.safe_read import open_file

#: Buffer size of streaming verification (bytes): fits in L2/L3 so that the hash reads what pread
#: has just written there.
STREAM_BUFFER_BYTES = 1 << 20

VERIFY_MODES = ("sha256", "crc32c")

#: :class:`ShardReader` with ``direct=True`` reads a shard through O_DIRECT when less than this
#: fraction of it is in the page cache (as :func:`tiered_ckpt.local.shard_io.read_verified`).
DIRECT_BELOW_CACHED = 0.5
#: ... and only ranges of at least this many bytes (smaller ones, the header, buffered) and at most
#: this many (the bounce buffer, one per reading thread, stays small).
DIRECT_MIN_READ = 1024 * 1024
DIRECT_MAX_READ = 64 * 1024 * 1024


@dataclass
class ReadStats:
    """Bytes and ``pread`` calls issued on shard files (thread-safe counters)."""

    bytes_read: int = 0
    calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n
            self.calls += 1


def check_verify_mode(verify: str) -> str:
    """``verify`` must be ``"sha256"`` or ``"crc32c"``; raises ``ValueError`` otherwise."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    return verify


def open_shard(sdir: Path, rec: ShardRecord, where: str) -> int:
    """Open a shard read-only through :func:`tiered_ckpt.safe_read.open_file` (no symlink followed
    below the root, never blocking, regular files only); check it is of the recorded size. Returns
    the fd (caller closes). Raises :class:`MissingShardError` (absent), :class:`ManifestError` (a
    symlink, FIFO, device or directory), :class:`ShardCorruptedError` (another open error, or the
    wrong size)."""
    try:
        fd = open_file(sdir / rec.path, error=ManifestError, io_error=ShardCorruptedError)
    except FileNotFoundError:
        raise MissingShardError(f"{where}: shard file is missing") from None
    except (ManifestError, ShardCorruptedError) as e:
        raise type(e)(f"{where}: {e}") from e.__cause__
    try:
        size = os.fstat(fd).st_size
        if size != rec.size_bytes:
            raise ShardCorruptedError(
                f"{where}: {size} bytes on disk, manifest says {rec.size_bytes} "
                "(partial or corrupt write)"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def pread_exact(
    fd: int, buf: memoryview, offset: int, where: str, stats: ReadStats | None = None
) -> None:
    """Fill ``buf`` with the file's bytes from ``offset``. Raises ShardCorruptedError on a short
    file or a read error."""
    pos = 0
    n_all = buf.nbytes
    while pos < n_all:
        try:
            n = os.preadv(fd, [buf[pos:]], offset + pos)
        except OSError as e:
            raise ShardCorruptedError(f"{where}: read failed: {e.strerror or e}") from e
        if stats is not None:
            stats.add(n)
        if n == 0:
            raise ShardCorruptedError(f"{where}: file ended at byte {offset + pos}")
        pos += n


def match_header(
    hdr: fmt.ParsedHeader, rec: ShardRecord, m: ShardManifest, where: str
) -> fmt.ParsedHeader:
    """The shard's header belongs to ``rec`` of manifest ``m`` (rank, step, save id). A record that
    lists tensors (manifests written before header format 2): the header lists exactly those (names,
    dtypes, shapes, byte ranges; and slices and chunk CRCs where both have them); the result carries
    the manifest's records. A record without tensors: the header must hold the tensor index (format
    2) with the record's chunk size; the result carries the header's records. Raises
    ShardCorruptedError."""
    meta = hdr.metadata
    if (
        meta.get("rank") != rec.rank
        or meta.get("step") != m.step
        or meta.get("save_id") != m.save_id
    ):
        raise ShardCorruptedError(
            f"{where}: header belongs to rank {meta.get('rank')} step "
            f"{meta.get('step')} save {meta.get('save_id')}, not this manifest's"
        )
    if rec.tensors is None:
        if hdr.crc32c_chunk_bytes is None or hdr.crc32c_chunk_bytes != rec.crc32c_chunk_bytes:
            raise ShardCorruptedError(
                f"{where}: the manifest lists no tensors but the header holds no tensor "
                "index with the manifest's crc32c_chunk_bytes"
            )
        return hdr
    mine = {t.name: (t.dtype, t.shape, t.data_offsets) for t in rec.tensors}
    theirs = {t.name: (t.dtype, t.shape, t.data_offsets) for t in hdr.tensors}
    if mine != theirs:
        raise ShardCorruptedError(f"{where}: header tensors disagree with the manifest")
    if hdr.crc32c_chunk_bytes is not None:  # a format-2 header under a manifest that lists tensors
        by_name = {t.name: t for t in hdr.tensors}
        for t in rec.tensors:
            h = by_name[t.name]
            if (t.global_shape, t.global_offset) != (h.global_shape, h.global_offset) or (
                t.crc32c is not None
                and (t.crc32c != h.crc32c or rec.crc32c_chunk_bytes != hdr.crc32c_chunk_bytes)
            ):
                raise ShardCorruptedError(
                    f"{where}: header tensor index disagrees with the manifest at {t.name[:80]!r}"
                )
    return dataclasses.replace(hdr, tensors=rec.tensors)


def check_header_bytes(
    raw: bytes, rec: ShardRecord, m: ShardManifest, where: str
) -> fmt.ParsedHeader:
    """Verify and parse a shard's first bytes ``raw`` (the 8-byte length prefix plus the whole JSON
    header, nothing more): their sha256 against ``rec.header_sha256`` *before* parsing (a record
    without one, schema v1, relies on the caller having verified the whole file), their length
    against ``header_size_bytes``, then :func:`match_header`. Returns the header with the tensor
    records every reader uses. Raises ShardCorruptedError."""
    if rec.header_sha256 is not None and hashlib.sha256(raw).hexdigest() != rec.header_sha256:
        raise ShardCorruptedError(
            f"{where}: header sha256 differs from the manifest's (corrupt header)"
        )
    n = fmt.parse_header_length(raw[:8], rec.size_bytes, where)
    if len(raw) != 8 + n or (rec.header_size_bytes is not None and rec.header_size_bytes != 8 + n):
        raise ShardCorruptedError(
            f"{where}: header of {8 + n} bytes, the manifest says "
            f"{rec.header_size_bytes} (corrupt header)"
        )
    return match_header(fmt.parse_header(raw[8:], rec.size_bytes, where), rec, m, where)


def read_header_bytes(
    fd: int, rec: ShardRecord, where: str, stats: ReadStats | None = None
) -> bytes:
    """The length prefix plus JSON header of an open shard: one ``pread`` when the record gives
    ``header_size_bytes``, else two. Not verified (see :func:`check_header_bytes`)."""
    if rec.header_size_bytes is not None:
        buf = bytearray(rec.header_size_bytes)
        pread_exact(fd, memoryview(buf), 0, where, stats)
        return bytes(buf)
    prefix = bytearray(8)
    pread_exact(fd, memoryview(prefix), 0, where, stats)
    n = fmt.parse_header_length(bytes(prefix), rec.size_bytes, where)
    raw = bytearray(8 + n)
    raw[:8] = prefix
    pread_exact(fd, memoryview(raw)[8:], 8, where, stats)
    return bytes(raw)


def verified_header(
    sdir: Path, m: ShardManifest, rank: int, stats: ReadStats | None = None
) -> fmt.ParsedHeader:
    """Rank ``rank`` 's verified header (and so its tensor records), reading only the header (a
    record without ``header_sha256``, schema v1: the whole file is verified first, streaming).
    Raises MissingShardError, ShardCorruptedError, ManifestError."""
    with ShardReader(sdir, m, rank, stats) as rd:
        return rd.header()


def manifest_with_tensors(sdir: Path, m: ShardManifest) -> ShardManifest:
    """``m`` with every shard record listing its tensors (taken from the verified headers, reading
    only those), in the form manifests took before header format 2 (no ``header_size_bytes``): for tools
    and tests that need the old, O(tensors) form. Raises the errors of :func:`verified_header`."""
    shards = tuple(
        s
        if s.tensors is not None
        else dataclasses.replace(
            s, tensors=verified_header(sdir, m, s.rank).tensors, header_size_bytes=None
        )
        for s in m.shards
    )
    return dataclasses.replace(m, shards=shards)


class ShardReader:
    """Verified partial reads of rank ``rank`` 's shard of a committed step (see the module
    docstring).

    ``direct=True`` (a load that reads most of the shard in large ranges, several threads at once):
    when less than :data:`DIRECT_BELOW_CACHED` of the file is in the page cache, ranges of at least
    :data:`DIRECT_MIN_READ` bytes (up to :data:`DIRECT_MAX_READ`) are read through a second, ``O_DIRECT`` descriptor into a
    per-thread bounce buffer and copied out (the page cache pages a buffered cold read allocates,
    fills and copies from cost more than that copy); where the filesystem refuses it, buffered.

    Not thread-safe, except :meth:`read_range` once :meth:`header` has returned (``pread`` only).
    Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        sdir: Path,
        manifest: ShardManifest,
        rank: int,
        stats: ReadStats | None = None,
        *,
        direct: bool = False,
    ) -> None:
        self.manifest = manifest
        self.record = manifest.shards[rank]
        self.where = f"step {manifest.step} rank {rank} ({self.record.path})"
        self.stats = stats
        self._fd = open_shard(sdir, self.record, self.where)
        self._dfd: int | None = None
        if direct and self.record.size_bytes >= DIRECT_MIN_READ:
            cached = cached_fraction(self._fd, self.record.size_bytes)
            if cached is None or cached < DIRECT_BELOW_CACHED:
                self._dfd = open_direct(self._fd)
        self._direct = self._dfd is not None
        self._bounce = threading.local()
        if self._dfd is None:  # a load reads most of it, in file order
            advise_sequential(self._fd, 0, self.record.size_bytes)
        self._header: fmt.ParsedHeader | None = None
        self._trusted = False  # the whole file was verified against its sha256
        self._tensors: dict[str, TensorRecord] = {}

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None
        self._bounce = threading.local()

    def _pread(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` from ``offset``: through the O_DIRECT descriptor (aligned, via this
        thread's bounce buffer) for a large read when there is one, else buffered."""
        dfd = self._dfd
        n = buf.nbytes
        if dfd is not None and self._direct and DIRECT_MIN_READ <= n <= DIRECT_MAX_READ:
            a = offset - offset % DIRECT_ALIGN
            e = -(-(offset + n) // DIRECT_ALIGN) * DIRECT_ALIGN
            bounce = getattr(self._bounce, "buf", None)
            if bounce is None or len(bounce) < e - a:
                bounce = self._bounce.buf = np.frombuffer(
                    mmap.mmap(-1, e - a, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8
                )
            mv = memoryview(bounce)
            pos = a
            try:
                while pos < offset + n:
                    got = os.preadv(dfd, [mv[pos - a : e - a]], pos)
                    if self.stats is not None:
                        self.stats.add(got)
                    if got == 0:
                        raise ShardCorruptedError(f"{self.where}: file ended at byte {pos}")
                    pos += got
                    if pos % DIRECT_ALIGN and pos < offset + n:
                        break  # an unaligned short read: the rest buffered
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise ShardCorruptedError(
                        f"{self.where}: read failed: {exc.strerror or exc}"
                    ) from exc
                # the filesystem takes the O_DIRECT open, not the read: buffered from now on (the
                # descriptor stays open until close(): another thread may be reading through it)
                self._direct = False
                pos = a
            done = max(0, min(pos, offset + n) - offset)
            if done:  # numpy's copy runs without the GIL: the other readers go on meanwhile
                np.copyto(
                    np.frombuffer(buf, np.uint8, count=done),
                    bounce[offset - a : offset - a + done],
                )
            if done == n:
                return
            buf, offset = buf[done:], offset + done
        pread_exact(self._fd, buf, offset, self.where, self.stats)

    @property
    def has_checksums(self) -> bool:
        return self.record.header_sha256 is not None

    def _verify_whole(self) -> None:
        verify_fd_stream(self._fd, self.record, "sha256", self.where, self.stats)
        self._trusted = True

    def header(self) -> fmt.ParsedHeader:
        """The parsed, verified header (read once); its ``tensors`` are the shard's tensor
        records."""
        if self._header is not None:
            return self._header
        if not self.has_checksums and not self._trusted:
            self._verify_whole()
        hdr = check_header_bytes(
            read_header_bytes(self._fd, self.record, self.where, self.stats),
            self.record,
            self.manifest,
            self.where,
        )
        self._tensors = {t.name: t for t in hdr.tensors}
        self._header = hdr
        return hdr

    def tensor_record(self, name: str) -> TensorRecord:
        self.header()
        t = self._tensors.get(name)
        if t is None:
            raise ShardCorruptedError(f"{self.where}: no tensor {name[:80]!r}")
        return t

    def read_range(
        self, name: str, start: int, end: int, out: memoryview | None = None
    ) -> memoryview:
        """Bytes ``[start, end)`` of tensor ``name`` (offsets within it), verified; into ``out``
        (``end - start`` writable bytes, returned) if given: read straight into it when the range is
        chunk-aligned (no copy)."""
        t = self.tensor_record(name)
        if not 0 <= start <= end <= t.nbytes or out is not None and out.nbytes != end - start:
            raise ValueError(
                f"range [{start}, {end}) outside tensor {name!r} of {t.nbytes} bytes, or out of another size"
            )
        if start == end:
            return out if out is not None else memoryview(b"")
        base = self.header().data_start + t.data_offsets[0]
        cs = self.record.crc32c_chunk_bytes
        if (
            self._trusted or cs is None or t.crc32c is None
        ):  # no chunk checksums: verify the whole file once
            if not self._trusted:
                self._verify_whole()
            a = b = k0 = 0
        else:
            k0 = start // cs
            a, b = k0 * cs, min(-(-end // cs) * cs, t.nbytes)
        exact = a == b or (a, b) == (start, end)
        buf = (
            out
            if out is not None and exact
            else memoryview(np.empty(end - start if exact else b - a, np.uint8))
        )
        self._pread(buf, base + (start if a == b else a))
        if a != b:
            bad = first_bad_chunk(buf, cs, t.crc32c[k0 : -(-end // cs)])
            if bad is not None:
                k = k0 + bad
                raise ShardCorruptedError(
                    f"{self.where}: tensor {name[:80]!r} chunk {k} (bytes [{k * cs}, "
                    f"{min((k + 1) * cs, t.nbytes)})) fails its CRC32C (corrupt data)"
                )
        view = buf if exact else buf[start - a : end - a]
        if out is not None and view is not out:
            out[:] = view
            return out
        return view

    def read_tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` whole, verified, as a writable array of its dtype and shape."""
        t = self.tensor_record(name)
        dt = fmt.numpy_dtype(t.dtype)
        if t.nbytes == 0:
            return np.empty(t.shape, dtype=dt)
        arr = np.frombuffer(self.read_range(name, 0, t.nbytes), dtype=dt, count=numel(t.shape))
        return arr.reshape(t.shape)  # writable: a view of a fresh buffer

    def materialize(self, node: Any, where: str, depth: int = 0) -> Any:
        """Rebuild the value of a state-tree node (``d``/``t``/``v``) of this file, reading its
        tensors whole; nested at most 256 deep, as
        :func:`~tiered_ckpt.format.shard_file.decode_state` allows."""
        if depth > 256 or not isinstance(node, dict) or len(node) != 1:
            raise ShardCorruptedError(
                f"{self.where}: state tree node at {where[:80]!r} is malformed"
            )
        ((kind, val),) = node.items()
        if kind == "d" and isinstance(val, dict):
            return {k: self.materialize(v, f"{where}/{k}", depth + 1) for k, v in val.items()}
        if kind == "v":
            return val
        if kind == "t" and isinstance(val, str):
            return self.read_tensor(val)
        raise ShardCorruptedError(f"{self.where}: state tree node at {where!r} is malformed")


def find_node(tree: Any, path: tuple[str, ...]) -> Any:
    """The node at key ``path`` of a state tree (``None`` when absent)."""
    n = tree
    for k in path:
        if not isinstance(n, dict) or not isinstance(n.get("d"), dict) or k not in n["d"]:
            return None
        n = n["d"][k]
    return n


def read_replicated(reader: ShardReader, path: tuple[str, ...]) -> Any:
    """The value of the :class:`~tiered_ckpt.state.Replicated` stored at key ``path`` in ``reader``
    's file (rank 0's). Raises ShardCorruptedError if it holds no such value."""
    node = find_node(reader.header().metadata["tree"], path)
    if not isinstance(node, dict) or set(node) != {"r"} or node["r"] is None:
        raise ShardCorruptedError(
            f"{reader.where}: holds no replicated value at {'/'.join(path)[:80]!r} "
            "that another rank refers to"
        )
    return reader.materialize(
        node["r"], "/".join(path), len(path) + 1
    )  # as deep as decode_state counts it


def verify_fd_stream(
    fd: int, rec: ShardRecord, verify: str, where: str, stats: ReadStats | None = None
) -> str:
    """Hash the whole open file with a reusable buffer and compare with ``rec``. ``verify="crc32c"``
    uses the shard's CRC32C (falls back to sha256 when the manifest has none). Returns the algorithm
    used.
    """
    algo = "crc32c" if verify == "crc32c" and rec.crc32c is not None else "sha256"
    h: Any = Crc32c() if algo == "crc32c" else hashlib.sha256()
    buf = bytearray(min(STREAM_BUFFER_BYTES, max(rec.size_bytes, 1)))
    mv = memoryview(buf)
    pos, size = 0, rec.size_bytes
    while pos < size:
        n = min(len(buf), size - pos)
        pread_exact(fd, mv[:n], pos, where, stats)
        h.update(mv[:n])
        pos += n
    expected = rec.crc32c if algo == "crc32c" else rec.sha256
    if h.hexdigest() != expected:
        raise ShardCorruptedError(
            f"{where}: {algo} {h.hexdigest()[:16]} differs from the manifest's "
            f"{str(expected)[:16]} (corrupt or partial write)"
        )
    return algo


def verify_shard_stream(
    sdir: Path, manifest: ShardManifest, rank: int, verify: str = "sha256"
) -> str:
    """Fully verify rank ``rank`` 's shard (size, whole-file hash, header against the manifest,
    state tree against the header) without holding it in memory: the step verifies iff it loads.
    Returns the algorithm used (``"sha256"`` or ``"crc32c"``)."""
    return stream_verified_header(sdir, manifest, rank, verify)[0]


def stream_verified_header(
    sdir: Path, manifest: ShardManifest, rank: int, verify: str = "sha256"
) -> tuple[str, fmt.ParsedHeader]:
    """:func:`verify_shard_stream`, also returning the verified header (for checks across ranks)."""
    check_verify_mode(verify)
    rec = manifest.shards[rank]
    where = f"step {manifest.step} rank {rank} ({rec.path})"
    fd = open_shard(sdir, rec, where)
    try:
        algo = verify_fd_stream(fd, rec, verify, where)
        hdr = check_header_bytes(read_header_bytes(fd, rec, where), rec, manifest, where)
    finally:
        os.close(fd)
    fmt.decode_state(
        None, hdr, where, lambda path: None
    )  # tree only; rank 0 holds replicated values
    return algo, hdr


def copy_value(v: Any) -> Any:
    """An independent copy of a loaded value (nested dicts, arrays, JSON lists)."""
    if isinstance(v, dict):
        return {k: copy_value(x) for k, x in v.items()}
    if isinstance(v, np.ndarray):
        return v.copy()
    return json.loads(json.dumps(v, allow_nan=True)) if isinstance(v, list) else v


class ReadLock:
    """A ``read`` lock (:mod:`tiered_ckpt.locks`) so that rotation skips the step while it is read;
    a read-only checkpoint directory (where no lock file can be made) is read without one."""

    def __init__(self, sdir: Path) -> None:
        self._cm = hold_step_lock(sdir, "read")
        self._held = False

    def __enter__(self) -> None:
        try:
            self._cm.__enter__()
            self._held = True
        except OSError:
            self._held = False

    def __exit__(self, *exc: object) -> None:
        if self._held:
            self._cm.__exit__(None, None, None)


def read_byte_tensor(
    rd: Any, name: str, nbytes: int, error: type[CheckpointError], where: str
) -> bytes:
    """The ``nbytes`` bytes of the 1-D ``U8`` tensor ``name`` of an open shard reader (a
    :class:`ShardReader` or one of the same interface: ``tensor_record``, ``read_range``), verified
    as read. A tensor of another dtype or shape raises ``error`` naming ``where``, before any byte
    is read."""
    rec = rd.tensor_record(name)
    if rec.dtype != "U8" or rec.shape != (nbytes,):
        raise error(
            f"{where}: the tensor is {rec.dtype} {rec.shape}, the manifest says U8 ({nbytes},)"
        )
    return bytes(rd.read_range(name, 0, nbytes))


__all__ = [
    "check_header_bytes",
    "read_byte_tensor",
    "manifest_with_tensors",
    "read_header_bytes",
    "stream_verified_header",
    "verified_header",
    "ShardReader",
    "ReadStats",
    "ReadLock",
    "copy_value",
    "verify_shard_stream",
    "verify_fd_stream",
    "read_replicated",
    "find_node",
    "open_shard",
    "pread_exact",
    "check_verify_mode",
    "VERIFY_MODES",
]
