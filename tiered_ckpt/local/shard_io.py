"""Streaming shard I/O (local tier): write a shard's bytes while a second thread hashes them, and
read a whole shard into one buffer while a second thread verifies it. The bytes' layout is
:mod:`tiered_ckpt.format.shard_file`'s; durability (fsync, rename) is
:mod:`tiered_ckpt.local.commit`'s.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np

from tiered_ckpt.format.shard_file import corrupt
from tiered_ckpt.fs import (
    DIRECT_ALIGN,
    advise_sequential,
    cached_fraction,
    open_direct,
    start_writeback,
    write_all,
)


class Hasher(Protocol):
    """What :mod:`hashlib` objects and :class:`~tiered_ckpt.format.crc32c.Crc32c` have in common."""

    def update(self, data: memoryview, /) -> None: ...


class Digest(Hasher, Protocol):
    """A hasher with a final digest (sha256, CRC32C)."""

    def hexdigest(self) -> str: ...


class OverlappedHasher:
    """Feeds chunks to ``hashers`` on a second thread, in order, at most ``depth`` feeds behind.

    hashlib and google_crc32c release the GIL on large buffers, so hashing overlaps the caller's I/O
    on a second core. Chunks must stay unmodified until :meth:`drain` returns (they are views, not
    copies).
    """

    def __init__(self, hashers: list[Hasher], depth: int = 4) -> None:
        self._hashers = hashers
        self._depth = depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-ckpt-hash")
        self._pending: list[Future[None]] = []

    def feed(self, chunk: memoryview) -> None:
        """Queue one chunk (blocks while ``depth`` feeds are still being hashed)."""
        self.feed_many([chunk])

    def feed_many(self, chunks: Sequence[memoryview]) -> None:
        """Queue several chunks as one task of the hashing thread (fewer thread hand-offs)."""
        self._pending.append(self._pool.submit(_update_all, self._hashers, chunks))
        if len(self._pending) > self._depth:
            self._pending.pop(0).result()

    def drain(self) -> None:
        try:
            for p in self._pending:
                p.result()
        finally:
            self._pending.clear()
            self._pool.shutdown(wait=True)

    def __enter__(self) -> OverlappedHasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.drain()


#: Bytes gathered into one ``write(2)`` by :func:`write_stream` (and one hashing task): small
#: tensors go out in few large writes; a 1 MiB chunk of a large tensor is written alone (measured
#: with 4 ranks of 512 MiB in parallel: 8 MiB batches made the save slower, median 6.0 s against 3.7
#: s and 4 x dd 1.7 s, on a loaded machine).
WRITE_BYTES = 1024 * 1024
#: How many batches the hashing thread may lag behind the writes (the chunks are views of the
#: caller's arrays: a deeper queue costs no memory).
HASH_DEPTH = 16
#: Granularity of the writeback hints (bytes): 1 MiB pieces keep 4 ranks' writeback interleaved on
#: one disk better than one 8 MiB hint per batch (measured: 4 x 512 MiB, median 1.3-1.5 s against
#: 2.7 s).
WRITEBACK_BYTES = 1024 * 1024
#: At most this many chunks in one batch.
_MAX_IOV = 512


def write_stream(
    fd: int,
    chunks: Iterable[memoryview],
    hashers: list[Hasher],
    inline_hashers: Iterable[Hasher] = (),
    *,
    write_bytes: int = WRITE_BYTES,
    writeback_bytes: int = WRITEBACK_BYTES,
) -> int:
    """Write every chunk to ``fd`` (from its current offset, which must be 0) while a second thread
    feeds the same chunks to ``hashers`` (the expensive ones: sha256); ``inline_hashers`` (cheap
    ones: CRC32C, several GB/s) are fed on the writing thread itself. Consecutive chunks are
    gathered into batches of about ``write_bytes`` (at most 512 chunks), each written with one
    ``write(2)`` and then handed to the kernel's writeback (:func:`~tiered_ckpt.fs.start_writeback`)
    so that the final ``fsync`` has little left to flush. Returns bytes written. An ``OSError`` from
    ``write(2)`` propagates after the hashing thread is drained."""
    total = 0
    inline = list(inline_hashers)
    with OverlappedHasher(hashers, depth=HASH_DEPTH) as hasher:
        for batch in _batches(chunks, write_bytes):
            hasher.feed_many(batch)
            for h in inline:
                for c in batch:
                    h.update(c)
            # one write(2) per batch: small chunks are joined into one buffer (a copy of at most
            # write_bytes of small tensors; writev would do without it, but one syscall name keeps
            # the crash matrix's strace counters meaningful); a large chunk is written from its view
            data = batch[0] if len(batch) == 1 else b"".join(batch)
            write_all(fd, data)
            n = data.nbytes if isinstance(data, memoryview) else len(data)
            for off in range(0, n, writeback_bytes):
                start_writeback(fd, total + off, min(writeback_bytes, n - off))
            total += n
    return total


def _batches(chunks: Iterable[memoryview], nbytes: int) -> Iterator[list[memoryview]]:
    """Consecutive non-empty chunks, grouped into lists of about ``nbytes`` (a chunk is never
    split)."""
    batch: list[memoryview] = []
    size = 0
    for c in chunks:
        if c.nbytes == 0:
            continue
        batch.append(c)
        size += c.nbytes
        if size >= nbytes or len(batch) >= _MAX_IOV:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _update_all(hashers: list[Hasher], chunks: Sequence[memoryview]) -> None:
    for c in chunks:
        for h in hashers:
            h.update(c)


#: Bytes of one ``preadv`` of :func:`read_verified` (large reads: fewer syscalls, larger block
#: requests). Cold 2 GiB shard here: 1 MiB reads one at a time 4.3-11 s; 16-32 MiB blocks on 3-4
#: readers 1.6-1.9 s (dcp.load 3.0 s); 64 MiB blocks 3.6 s (the hashing waits longer for the first
#: block). On a quiet machine, 2 reps each: 16 MiB x 4 readers 1.55-1.74 s, 32 MiB x 3 1.57-2.18 s,
#: 8 MiB x 6 1.90-2.08 s, one reader 5.8-6.1 s; a plain read without hashing 1.1-1.4 s.
READ_BYTES = 16 * 1024 * 1024
#: Reads of :func:`read_verified` in flight at once (threads, each on its own block, ahead of the
#: hashing).
READERS = 4
#: :func:`read_verified` reads a file through ``O_DIRECT`` when less than this fraction of it is in
#: the page cache. Buffered reads of a cold file cost page cache pages to allocate, fill and copy
#: out of (on a 2-core VM, 2 GiB: 3.6-8.0 CPU-s and 2.3-4.4 s with sha256, against 2.6-2.9 CPU-s
#: and 1.85-2.4 s through O_DIRECT); a file still cached (read right after its save, without the
#: cache dropped) is copied from the cache at memory speed instead.
DIRECT_BELOW_CACHED = 0.5
#: Files smaller than this are always read buffered (the O_DIRECT set-up is not worth it).
DIRECT_MIN_BYTES = 4 * 1024 * 1024


def read_verified(
    fd: int,
    size: int,
    hashers: list[Hasher],
    where: str,
    *,
    read_bytes: int = READ_BYTES,
    readers: int = READERS,
) -> np.ndarray:
    """Read exactly ``size`` bytes of ``fd`` (from offset 0) into one buffer (a writable uint8 array
    of shape ``(size,)``, page-aligned, not zero-filled first), feeding ``hashers`` with the bytes
    in file order.

    The file is cut into blocks of ``read_bytes``; ``readers`` threads ``preadv(2)`` consecutive
    blocks straight into the buffer (no intermediate copies; several reads in flight keep the disk
    queue full), while the calling thread hashes each block as soon as it and all blocks before it
    are in (hashlib and the zero-copy CRC32C release the GIL, so hashing overlaps reading on another
    core). A file mostly not in the page cache (:data:`DIRECT_BELOW_CACHED`) is read through a
    second, ``O_DIRECT`` descriptor (:func:`~tiered_ckpt.fs.open_direct`): the disk writes into
    the buffer itself; where the filesystem refuses it (no ``O_DIRECT``, ``EINVAL``), that block
    and the rest are read buffered. A buffered read tells the kernel the file is read sequentially
    (``posix_fadvise(POSIX_FADV_SEQUENTIAL)``: a larger readahead window). No thread outlives the
    call, and no read writes into the buffer after it returns or raises.

    Raises ShardCorruptedError if the file is shorter than ``size``; ``OSError`` from ``read(2)``
    propagates (the first one in file order).
    """
    buf = _aligned_buffer(size)
    view = memoryview(buf)
    blocks = [(pos, min(pos + read_bytes, size)) for pos in range(0, size, read_bytes)]
    dfd = None
    if size >= DIRECT_MIN_BYTES and read_bytes % DIRECT_ALIGN == 0:
        cached = cached_fraction(fd, size)
        if cached is None or cached < DIRECT_BELOW_CACHED:
            dfd = open_direct(fd)
    if dfd is None:
        advise_sequential(fd, 0, size)
    reader = _BlockReader(fd, dfd, view, size, where)
    try:
        if len(blocks) <= 1 or readers <= 1:
            for start, end in blocks:
                reader.read(start, end)
                _update_all(hashers, [view[start:end]])
            return buf[:size]
        pool = ThreadPoolExecutor(
            max_workers=min(readers, len(blocks)), thread_name_prefix="tiered-ckpt-read"
        )
        try:
            pending = [pool.submit(reader.read, start, end) for start, end in blocks]
            for (start, end), fut in zip(blocks, pending):
                fut.result()
                _update_all(hashers, [view[start:end]])
        finally:  # on an error: drop the reads not started, wait for those running (they write
            # into buf)
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        if dfd is not None:
            os.close(dfd)
    return buf[:size]


def _aligned_buffer(size: int) -> np.ndarray:
    """A writable uint8 array of ``size`` bytes rounded up to :data:`DIRECT_ALIGN` (room for the
    last ``O_DIRECT`` read), page-aligned: an anonymous mapping, without numpy's huge-page advice
    (faulting in and zeroing 2 MiB pages of a fragmented memory cost more than the 4 KiB pages the
    reads then fill: 5.0-5.2 CPU-s against 2.6-2.7 for a 2 GiB read)."""
    n = -(-max(size, 1) // DIRECT_ALIGN) * DIRECT_ALIGN
    return np.frombuffer(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)


class _BlockReader:
    """``preadv(2)`` of blocks into one buffer, through the ``O_DIRECT`` descriptor while it works
    and the buffered one otherwise (after the first ``EINVAL`` of a direct read: for every later
    block too)."""

    def __init__(self, fd: int, dfd: int | None, view: memoryview, size: int, where: str) -> None:
        self.fd, self.dfd, self.view, self.size, self.where = fd, dfd, view, size, where

    def read(self, start: int, end: int) -> None:
        """Bytes ``[start, end)`` of the file into ``view[start:end]``, retrying short reads."""
        pos = start
        while pos < end:
            dfd = self.dfd
            if dfd is not None and pos % DIRECT_ALIGN == 0:
                # the length rounded up too: the file's last block ends at EOF, a short read
                stop = min(-(-end // DIRECT_ALIGN) * DIRECT_ALIGN, self.view.nbytes)
                try:
                    n = os.preadv(dfd, [self.view[pos:stop]], pos)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.dfd = None  # the filesystem takes the O_DIRECT open, not the read
                    continue
                n = min(n, end - pos)  # bytes past this block (only at EOF padding) are not ours
            else:
                n = os.preadv(self.fd, [self.view[pos:end]], pos)
            if n == 0:
                raise corrupt(self.where, f"file ended after {pos} of {self.size} bytes")
            pos += n


__all__ = [
    "Digest",
    "Hasher",
    "OverlappedHasher",
    "READERS",
    "READ_BYTES",
    "WRITE_BYTES",
    "read_verified",
    "write_stream",
]
