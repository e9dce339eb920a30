"""Downloading planned shards and verifying them (lifecycle step 3 of
:mod:`tiered_ckpt.remote.restore.restorer`; also what ``tiered-ckpt verify --remote`` runs, so a step that
verifies is one that restores).

:func:`fetch_shards` moves every planned shard at once, at the server's speed, reading each byte
once:

* **One window of parts for all shards.** Every shard is cut into parts of ``part_size_bytes``; the
  parts of all shards, shard after shard, go through ONE pool of ``concurrency`` threads, each a
  ranged GET (:meth:`ObjectStore.read_range_into`: under the store's retries, deadlines and size
  checks) into a buffer, then ``pwrite`` at its offset into the shard's temp file. At most
  ``concurrency`` buffers exist (peak memory: ``concurrency x part_size_bytes``): a thread waits for
  a free buffer before it takes the next part, so parts are taken in order and the first part not
  yet hashed is always in flight.
* **Hashing while bytes arrive.** sha256 needs the bytes in order: a finished part waits (in its
  buffer) until every earlier part of its shard is hashed; whichever thread completes the contiguous
  prefix hashes from memory (hashlib releases the GIL) and frees the buffers. The file is never read
  back for hashing (only its small safetensors header, checked against the manifest's record as
  loading checks).
* **fsync overlapped.** A shard whose last part is hashed is verified (size, sha256, header) and
  handed to ``on_verified`` on that thread at once (restore fsyncs it there), while the other
  shards' parts keep flowing: shard after shard, the first shards finish early.

The first failure stops the taking of parts; the lowest rank's error is raised once the threads are
done.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tiered_ckpt.errors import MissingShardError, ShardCorruptedError
from tiered_ckpt.format.shard_file import decode_state
from tiered_ckpt.local.verified_read import check_header_bytes, read_header_bytes
from tiered_ckpt.remote.handle import object_url
from tiered_ckpt.remote.restore.plan import RemoteObject, RestorePlan
from tiered_ckpt.safe_read import opened
from tiered_ckpt.store.base import ObjectStore, RemoteNotFoundError

ProgressCallback = Callable[[int], None]

_HASH_CHUNK = 8 * 1024 * 1024
#: Write whole aligned parts with ``O_DIRECT`` (Linux): the buffer goes to the disk without a copy
#: into the page cache and without dirty pages for the kernel to flush later, so the fsync of a
#: finished shard has almost nothing left to do (here: 0.1 s of CPU instead of 1-3 s per 2 GiB, and
#: the disk's own speed). A part that is not a multiple of :data:`_ALIGN` (a shard's tail), or a
#: file system refusing ``O_DIRECT`` (tmpfs), is written through the page cache with a writeback
#: hint (``posix_fadvise(POSIX_FADV_DONTNEED)``: dirty pages are written back now, only clean ones
#: dropped). The restored files are then not in the page cache: the first load reads them from the
#: disk.
DIRECT_IO = True
_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None) if hasattr(os, "posix_fadvise") else None
_WRITE_FLAGS = os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _check_header(path: Path, plan: RestorePlan, rank: int, where: str) -> None:
    """The downloaded file's safetensors header agrees with the manifest's record, and its state
    tree with the header's tensors (as loading and local ``verify`` check; rank 0 holds the
    replicated values)."""
    rec = plan.manifest.shards[rank]
    with opened(path, error=ShardCorruptedError) as fd:
        raw = read_header_bytes(fd, rec, where)
    decode_state(
        None, check_header_bytes(raw, rec, plan.manifest, where), where, lambda key_path: None
    )


def _where(store: ObjectStore, plan: RestorePlan, obj: RemoteObject) -> str:
    return f"step {plan.step} rank {obj.rank}: {object_url(store, obj.key)}"


def _verify(
    plan: RestorePlan, obj: RemoteObject, dest: Path, sha: str, size: int, where: str
) -> None:
    if size != obj.size_bytes:
        raise ShardCorruptedError(
            f"{where}: downloaded {size} bytes, the manifest says {obj.size_bytes}"
        )
    if sha != obj.sha256:
        raise ShardCorruptedError(
            f"{where}: sha256 of the downloaded bytes {sha[:16]}... differs from the "
            f"manifest's {obj.sha256[:16]}... (the object in the bucket is corrupt)"
        )
    _check_header(dest, plan, obj.rank, where)


class _Shard:
    """One shard in flight: the sha256 of its contiguous prefix and the parts waiting to be
    hashed."""

    def __init__(self, obj: RemoteObject, dest: Path, n_parts: int, where: str) -> None:
        self.obj, self.dest, self.n_parts, self.where = obj, dest, n_parts, where
        self.sha = hashlib.sha256()
        self.lock = threading.Lock()
        self.ready: dict[int, tuple[memoryview, mmap.mmap]] = {}
        self.next = 0  # index of the first part not yet hashed
        self.hashing = False

    def deliver(
        self, index: int, view: memoryview, buf: mmap.mmap, free: Callable[[mmap.mmap], None]
    ) -> bool:
        """Part ``index`` arrived; hash the contiguous prefix if no other thread is at it. Returns
        whether this call hashed the last part (the shard is complete)."""
        with self.lock:
            self.ready[index] = (view, buf)
            if self.hashing:
                return False
            self.hashing = True
        while True:
            with self.lock:
                item = self.ready.pop(self.next, None)
                if item is None:
                    self.hashing = False
                    return False
            self.sha.update(item[0])
            free(item[1])
            with self.lock:
                self.next += 1
                if self.next == self.n_parts:
                    self.hashing = False
                    return True


class _Window:
    """The shared schedule: parts in order, a bounded pool of buffers, the first error per rank."""

    def __init__(
        self, parts: list[tuple[_Shard, int, int, int]], part_size: int, n_buffers: int
    ) -> None:
        self.parts = parts
        self.part_size = part_size
        self.lock = threading.Lock()
        self.pos = 0
        self.stopped = threading.Event()
        self.errors: dict[int, BaseException] = {}
        self.free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._made = 0
        self._limit = n_buffers

    def buffer(self) -> mmap.mmap | None:
        """A free buffer (a new one while fewer than the limit exist), or ``None`` once stopped."""
        while not self.stopped.is_set():
            with self.lock:
                if self._made < self._limit:
                    self._made += 1
                    return mmap.mmap(-1, self.part_size)  # page-aligned, as O_DIRECT wants
            try:
                return self.free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def take(self) -> tuple[_Shard, int, int, int] | None:
        with self.lock:
            if self.stopped.is_set() or self.pos >= len(self.parts):
                return None
            self.pos += 1
            return self.parts[self.pos - 1]

    def fail(self, rank: int, exc: BaseException) -> None:
        with self.lock:
            self.errors.setdefault(rank, exc)
        self.stopped.set()


def _write_part(dest: Path, view: memoryview, off: int) -> None:
    """``pwrite`` the part at ``off``: with ``O_DIRECT`` when aligned (:data:`DIRECT_IO`), else
    buffered with a writeback hint. Raises ``OSError``."""
    n = len(view)
    direct = DIRECT_IO and _O_DIRECT and n % _ALIGN == 0 and off % _ALIGN == 0
    if direct:
        try:
            fd = os.open(dest, _WRITE_FLAGS | _O_DIRECT)
        except OSError as exc:  # EINVAL: this file system has no O_DIRECT
            if exc.errno != errno.EINVAL:
                raise
            direct = False
    if not direct:
        fd = os.open(dest, _WRITE_FLAGS)
    try:
        try:
            k = os.pwrite(fd, view, off)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            os.close(fd)
            fd = -1  # closed: never closed twice (the number may be another thread's file by now)
            fd, direct = os.open(dest, _WRITE_FLAGS), False  # an alignment this device refuses
            k = os.pwrite(fd, view, off)
        if k != n:
            raise OSError(errno.EIO, f"short write of {k} of {n} bytes at offset {off}", str(dest))
        if not direct and _FADV_DONTNEED is not None:
            os.posix_fadvise(fd, off, n, _FADV_DONTNEED)
    finally:
        if fd >= 0:
            os.close(fd)


def _plan_parts(shards: list[_Shard], part_size: int) -> list[tuple[_Shard, int, int, int]]:
    parts = []
    for sh in shards:
        size = sh.obj.size_bytes
        for i in range(sh.n_parts):
            off = i * part_size
            parts.append((sh, i, off, min(part_size, size - off)))
    return parts


def _worker(
    store: ObjectStore,
    plan: RestorePlan,
    w: _Window,
    on_progress: ProgressCallback | None,
    on_verified: Callable[[RemoteObject], None] | None,
) -> None:
    while True:
        buf = w.buffer()
        if buf is None:
            return
        item = w.take()
        if item is None:
            w.free.put(buf)
            return
        sh, index, off, n = item
        try:
            view = memoryview(buf)[:n]
            try:
                store.read_range_into(sh.obj.key, off, view, object_size=sh.obj.size_bytes)
            except RemoteNotFoundError as exc:
                raise MissingShardError(
                    f"{sh.where} disappeared before it could be downloaded"
                ) from exc
            _write_part(sh.dest, view, off)
            if on_progress is not None:
                on_progress(n)
            if sh.deliver(index, view, buf, w.free.put):
                _verify(plan, sh.obj, sh.dest, sh.sha.hexdigest(), sh.obj.size_bytes, sh.where)
                if on_verified is not None:
                    on_verified(sh.obj)
        except BaseException as exc:
            w.fail(sh.obj.rank, exc)
            return


def fetch_shards(
    store: ObjectStore,
    plan: RestorePlan,
    objects: Sequence[RemoteObject],
    targets: dict[int, Path],
    *,
    on_progress: ProgressCallback | None = None,
    on_verified: Callable[[RemoteObject], None] | None = None,
    part_size_bytes: int | None = None,
    concurrency: int | None = None,
    cancel: Callable[[], None] | None = None,
) -> None:
    """Download every object of ``objects`` into ``targets[obj.rank]`` (created or truncated here)
    and verify it against ``plan``'s manifest (module docstring: one window of parts for all shards,
    sha256 as the bytes arrive, no second read). ``on_verified(obj)`` runs on a transfer thread as
    soon as a shard is verified (restore fsyncs it there); ``on_progress(delta_bytes)`` after each
    part. Part size and concurrency default to the store's :class:`TransferSettings`
    (``download_part_size_bytes``, ``download_max_concurrency``). On KeyboardInterrupt no part is
    taken any more and ``cancel()`` (the store's stop event) cuts the GETs in flight short within
    one chunk before it propagates.

    Raises, for the lowest failing rank: ``MissingShardError`` (object gone),
    ``ShardCorruptedError`` (size, sha256 or header differs; a size other than planned answered,
    before that part's bytes), ``UploadError`` (the bucket cannot be read), ``OSError`` (local
    disk). On a failure the files are left for the caller to remove (restore stages them)."""
    t = store.transfer_settings
    part = part_size_bytes or t.download_part_size_bytes
    conc = concurrency or t.download_max_concurrency
    shards = []
    for obj in objects:
        fd = os.open(targets[obj.rank], _WRITE_FLAGS | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, obj.size_bytes)
        finally:
            os.close(fd)
        shards.append(
            _Shard(
                obj, targets[obj.rank], -(-obj.size_bytes // part) or 1, _where(store, plan, obj)
            )
        )
    for sh in shards:  # an empty object is no valid shard; let the verification say so
        if sh.obj.size_bytes == 0:
            _verify(plan, sh.obj, sh.dest, hashlib.sha256().hexdigest(), 0, sh.where)
    biggest = max((o.size_bytes for o in objects), default=0)
    w = _Window(
        _plan_parts([s for s in shards if s.obj.size_bytes], part), max(1, min(part, biggest)), conc
    )
    n_threads = max(1, min(conc, len(w.parts)))
    with ThreadPoolExecutor(
        max_workers=n_threads, thread_name_prefix="tiered-ckpt-download"
    ) as pool:
        try:  # from the first submit: an interrupt between two would leave the started workers uncut
            futs = [
                pool.submit(_worker, store, plan, w, on_progress, on_verified)
                for _ in range(n_threads)
            ]
            for f in futs:
                f.result()
        except (
            BaseException
        ):  # KeyboardInterrupt: stop taking parts; the threads end within one chunk
            w.stopped.set()
            if cancel is not None:
                cancel()
            raise
    if w.errors:
        raise w.errors[min(w.errors)]


def fetch_shard(
    store: ObjectStore,
    plan: RestorePlan,
    obj: RemoteObject,
    dest: Path,
    on_progress: ProgressCallback | None = None,
    cancel: Callable[[], None] | None = None,
) -> None:
    """:func:`fetch_shards` of one object into ``dest`` (verify's download); same errors and
    ``cancel``."""
    fetch_shards(store, plan, [obj], {obj.rank: dest}, on_progress=on_progress, cancel=cancel)


__all__ = ["fetch_shard", "fetch_shards"]
