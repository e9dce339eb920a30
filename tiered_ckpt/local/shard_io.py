"""Streaming shard I/O (local tier): write a shard's bytes while a second thread hashes them, and read a
whole shard into one buffer while a second thread verifies it. The bytes' layout is
:mod:`tiered_ckpt.format.shard_file`'s; durability (fsync, rename) is :mod:`tiered_ckpt.local.commit`'s.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Iterator, Protocol

import numpy as np

from tiered_ckpt.fs import start_writeback, write_all
from tiered_ckpt.format.shard_file import CHUNK_BYTES, corrupt


class Hasher(Protocol):
    """What :mod:`hashlib` objects and :class:`~tiered_ckpt.format.crc32c.Crc32c` have in common."""

    def update(self, data: memoryview, /) -> None: ...


class Digest(Hasher, Protocol):
    """A hasher with a final digest (sha256, CRC32C)."""

    def hexdigest(self) -> str: ...


class OverlappedHasher:
    """Feeds chunks to ``hashers`` on a second thread, in order, at most ``depth`` chunks behind.

    hashlib and google_crc32c release the GIL on large buffers, so hashing overlaps the caller's I/O on
    a second core. Chunks must stay unmodified until :meth:`drain` returns (they are views, not copies).
    """

    def __init__(self, hashers: list[Hasher], depth: int = 4) -> None:
        self._hashers = hashers
        self._depth = depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-ckpt-hash")
        self._pending: list[Future[None]] = []

    def feed(self, chunk: memoryview) -> None:
        self._pending.append(self._pool.submit(_update_all, self._hashers, chunk))
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


def write_stream(fd: int, chunks: Iterator[memoryview], hashers: list[Hasher],
                 inline_hashers: Iterable[Hasher] = ()) -> int:
    """Write every chunk to ``fd`` while a second thread feeds the same chunks to ``hashers`` (the
    expensive ones: sha256); ``inline_hashers`` (cheap ones: CRC32C, several GB/s) are fed on the writing
    thread itself, so that the two threads carry about the same CPU load on two cores. Returns bytes
    written. An ``OSError`` from ``write(2)`` propagates after the hashing thread is drained."""
    total = 0
    with OverlappedHasher(hashers) as hasher:
        for chunk in chunks:
            hasher.feed(chunk)
            for h in inline_hashers:
                h.update(chunk)
            write_all(fd, chunk)
            start_writeback(fd, total, chunk.nbytes)  # the final fsync then has little left to flush
            total += chunk.nbytes
    return total


def _update_all(hashers: list[Hasher], chunk: memoryview) -> None:
    for h in hashers:
        h.update(chunk)


def read_verified(fd: int, size: int, hashers: list[Hasher], where: str) -> np.ndarray:
    """Read exactly ``size`` bytes of ``fd`` (from offset 0) into one buffer (a writable uint8 array,
    not zero-filled first), feeding ``hashers`` chunk by chunk on a second thread (see
    :class:`OverlappedHasher`). Raises ShardCorruptedError if the file is shorter; ``OSError`` from
    ``read(2)`` propagates."""
    buf = np.empty(size, dtype=np.uint8)
    view = memoryview(buf)
    pos = 0
    with OverlappedHasher(hashers) as hasher:
        while pos < size:
            n = os.preadv(fd, [view[pos : pos + CHUNK_BYTES]], pos)
            if n == 0:
                raise corrupt(where, f"file ended after {pos} of {size} bytes")
            hasher.feed(view[pos : pos + n])
            pos += n
    return buf



__all__ = ["Digest", "Hasher", "OverlappedHasher", "read_verified", "write_stream"]
