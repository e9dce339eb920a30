"""Sending one shard file and confirming it remotely, end to end (the transfer half of
``upload.py``).

Every byte is hashed as it is read for sending, on one thread, in file order (a second read for
hashing would miss a shard that rots between the two reads):

1. :func:`tiered_ckpt.safe_read.open_file` (``O_NOFOLLOW`` on every component, non-blocking, a
   regular file only); its size must equal the local manifest's (else :class:`LocalShardError`).
2. A file below the multipart threshold is read whole (bounded by the threshold), hashed, compared
   with the manifest's sha256 *before* anything is sent, then written with one ``PutObject``
   carrying its ``ChecksumSHA256`` (``S3Store.put_bytes``).
3. Otherwise a multipart upload (:class:`~tiered_ckpt.store.base.ObjectStore` lifecycle step 2b):
   ``store.create_multipart_upload(checksum_algorithm="CRC32C")``; the reader thread ``pread`` s
   part after part (part sizes from ``store.plan_parts``, S3's multipart limits), feeds the
   whole-file SHA-256, and hands each part to a worker that computes the part's CRC32C (sent as
   ``ChecksumCRC32C``, so a validating server rejects bytes damaged in transit; hardware CRC32C
   through ctypes releases the GIL) and calls ``store.upload_part``. A semaphore shared by every
   shard bounds the parts in memory: at most ``part_slots + readers`` parts of ``part_size_bytes``.
   Why CRC32C and not SHA-256 per part: the whole-file SHA-256 above already proves that the bytes
   read equal the manifest's; the part checksum only has to catch damage in transit, which a CRC
   does (S3 and MinIO validate CRC32C like SHA-256). A per-part SHA-256 was a second SHA-256 pass
   over every byte on the client, and another one on servers that compute the composite themselves
   (moto), for nothing. After the last part the whole-file digest is compared with the manifest; a
   mismatch (local rot) aborts the upload before ``CompleteMultipartUpload``, so damaged bytes never
   become an object.
4. ``store.complete_multipart_upload`` with every part's CRC32C. A retried Complete whose first
   attempt succeeded answers ``NoSuchUploadError``: then HEAD decides (size, and the confirmation
   below). A part whose upload vanished (``NoSuchUploadError``: aborted by a cleanup) is a
   :class:`TransitCorruptionError`: the caller sends the shard again.
5. Confirmation (:func:`confirm_shard`): ``store.head`` (``ChecksumMode=ENABLED``); the size must
   match, and its ETag is what the confirmation record keeps (the commit's fence compares it, SPEC
   §11). Where the server validates checksums (probed once per bucket), the checksum it reports for
   the algorithm sent (``ChecksumSHA256`` of a single PUT, ``ChecksumCRC32C`` of a multipart upload)
   must equal the locally computed one (composite ``base64(crc32c(c1..cn))-n`` for multipart) ->
   ``server-checksum``. Elsewhere (moto) or when the server reports none, the object is streamed
   back and hashed (``store.read_sha256``) -> ``read-back``. A mismatch is a
   :class:`TransitCorruptionError`: the caller uploads again.

Any failure after ``CreateMultipartUpload`` aborts that upload (best effort, logged); an abort that
fails too (expired credentials, a server without AbortMultipartUpload) is handed to
``on_abort_failed`` (the uploader records it for a later sweep:
:mod:`tiered_ckpt.remote.upload.pending_aborts`); a crash leaves it for the next sidecar start
(``Uploader.abort_abandoned_uploads``). Retries stack as ``tiered_ckpt.retry`` describes: botocore's
per HTTP request (503 SlowDown, resets), the store's per call (each create, part, complete, HEAD and
read-back is one retried store operation), and the caller's per shard (a fresh upload after a
:class:`TransitCorruptionError` or a vanished upload). Everything goes through the
:class:`~tiered_ckpt.store.base.ObjectStore` interface; this module never sees a boto3 client.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from tiered_ckpt.errors import ShardCorruptedError
from tiered_ckpt.format.crc32c import crc32c_extend
from tiered_ckpt.retry import OperationInterruptedError
from tiered_ckpt.safe_read import open_file
from tiered_ckpt.store import NoSuchUploadError, ObjectStore, UploadedPart, checksums_match
from tiered_ckpt.store.checksums import composite_crc32c_b64

log = logging.getLogger(__name__)

#: The additional checksum every part of a multipart shard upload carries.
PART_CHECKSUM_ALGORITHM = "CRC32C"


class LocalShardError(ShardCorruptedError):
    """The local shard file differs from its manifest entry (size or sha256 of the bytes read for
    sending): local rot or a concurrent rewrite. Never retried; the step fails."""


class TransitCorruptionError(ShardCorruptedError):
    """The remote object differs from what was sent (size, server checksum or read-back hash).
    Retried by uploading the shard again."""


@dataclass(frozen=True)
class SentShard:
    """What was sent: ``size_bytes``, ``sha256_hex`` of the bytes read for sending, and the S3
    additional checksum as S3 reports it: ``checksum_algorithm`` ``"SHA256"`` (single PUT:
    ``checksum_b64`` is ``base64(sha256(body))``) or ``"CRC32C"`` (multipart: composite
    ``base64(crc32c(c1..cn))-n``)."""

    size_bytes: int
    sha256_hex: str
    checksum_algorithm: str
    checksum_b64: str
    parts: int


def _pread_exact(fd: int, size: int, offset: int, what: str) -> bytes:
    chunks = []
    got = 0
    while got < size:
        b = os.pread(fd, size - got, offset + got)
        if not b:
            raise LocalShardError(f"{what}: file shrank while being read (at byte {offset + got})")
        chunks.append(b)
        got += len(b)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def send_shard(
    store: ObjectStore,
    key: str,
    path: str | os.PathLike[str],
    *,
    expected_size: int,
    expected_sha256: str,
    part_executor: ThreadPoolExecutor,
    part_slots: threading.Semaphore,
    stop_event: threading.Event | None = None,
    on_progress: Callable[[int], None] | None = None,
    on_abort_failed: Callable[[str, str, BaseException], None] | None = None,
) -> SentShard:
    """Send ``path`` to ``key`` (relative to the store prefix) hashing it as it is read; see the
    module docstring. The store applies its own write settings (SSE, storage class) to the objects
    it creates. Raises
    :class:`LocalShardError` (file differs from the manifest; nothing committed),
    ``FileNotFoundError`` (file gone), :class:`OperationInterruptedError` (stop event; upload
    aborted), :class:`TransitCorruptionError` (the multipart upload vanished), ``UploadError`` (the
    store's retries ran out; the caller's retry decides). ``on_abort_failed(key, upload_id, exc)``:
    called when a failed multipart upload cannot be aborted either (recorded for a later sweep,
    ``remote/upload/pending_aborts.py``)."""
    what = f"{store.url}/{key}"
    try:  # no symlink followed below the root, never blocking on a FIFO, regular files only
        fd = open_file(path, error=LocalShardError)
    except LocalShardError as e:
        raise LocalShardError(f"{what}: {e}") from e.__cause__
    try:
        size = os.fstat(fd).st_size
        if size != expected_size:
            raise LocalShardError(
                f"{what}: local file is {size} bytes, the manifest says {expected_size}"
            )
        plan = store.plan_parts(size)
        if plan is None:
            return _send_single(
                store, key, fd, size, expected_sha256, what, stop_event, on_progress
            )
        upload = _MultipartSend(store, key, what, part_slots, on_progress, on_abort_failed)
        return upload.run(fd, plan, expected_sha256, part_executor, stop_event)
    finally:
        os.close(fd)


def _send_single(
    store: ObjectStore,
    key: str,
    fd: int,
    size: int,
    expected_sha256: str,
    what: str,
    stop_event: threading.Event | None,
    on_progress: Callable[[int], None] | None,
) -> SentShard:
    data = _pread_exact(fd, size, 0, what)
    digest = hashlib.sha256(data).digest()
    if digest.hex() != expected_sha256:
        raise LocalShardError(
            f"{what}: sha256 of the local file is {digest.hex()}, the manifest says "
            f"{expected_sha256}"
        )
    if stop_event is not None and stop_event.is_set():
        raise OperationInterruptedError(f"{what}: stopped before sending")
    b64 = base64.b64encode(digest).decode("ascii")
    store.put_bytes(key, data, checksum_sha256_b64=b64)
    if on_progress is not None:
        on_progress(size)
    return SentShard(size, digest.hex(), "SHA256", b64, 1)


class _MultipartSend:
    """One multipart upload of one shard: the reader (the calling shard thread) hands parts to
    workers of the shared part executor; ``part_slots`` (shared by every shard) bounds the parts in
    memory. Any exit before the completion is confirmed cancels the queued parts, takes back their
    progress and aborts."""

    def __init__(
        self,
        store: ObjectStore,
        key: str,
        what: str,
        part_slots: threading.Semaphore,
        on_progress: Callable[[int], None] | None,
        on_abort_failed: Callable[[str, str, BaseException], None] | None = None,
    ) -> None:
        self.store, self.key, self.what = store, key, what
        self.part_slots, self.on_progress, self.on_abort_failed = (
            part_slots,
            on_progress,
            on_abort_failed,
        )
        self.upload_id = ""
        self.futures: list[Future[tuple[UploadedPart, bytes]]] = []
        self._sent = 0
        self._sent_lock = threading.Lock()

    def send_part(self, number: int, data: bytes) -> tuple[UploadedPart, bytes]:
        """Worker: CRC32C of ``data``, ``store.upload_part``; returns the part and its raw 4-byte
        CRC."""
        try:
            digest = crc32c_extend(0, data).to_bytes(4, "big")
            b64 = base64.b64encode(digest).decode("ascii")
            try:
                part = self.store.upload_part(
                    self.key,
                    self.upload_id,
                    number,
                    data,
                    checksum_algorithm=PART_CHECKSUM_ALGORITHM,
                    checksum_b64=b64,
                )
            except NoSuchUploadError as e:
                raise TransitCorruptionError(
                    f"{self.what}: multipart upload vanished while sending part {number}"
                ) from e
            if self.on_progress is not None:
                self.on_progress(len(data))
            with self._sent_lock:
                self._sent += len(data)
            return part, digest
        finally:
            self.part_slots.release()

    def run(
        self,
        fd: int,
        plan: list[int],
        expected_sha256: str,
        part_executor: ThreadPoolExecutor,
        stop_event: threading.Event | None,
    ) -> SentShard:
        """Read, hash and send every part of ``plan``, then complete; see the module docstring
        (3-4)."""
        self.upload_id = self.store.create_multipart_upload(
            self.key, checksum_algorithm=PART_CHECKSUM_ALGORITHM
        )
        log.debug(
            "%s: multipart upload %s started (%d parts)", self.what, self.upload_id, len(plan)
        )
        completed = False
        try:
            whole = hashlib.sha256()
            offset = 0
            for number, psize in enumerate(plan, start=1):
                while not self.part_slots.acquire(timeout=0.1):
                    _check(self.futures, stop_event, self.what)
                try:
                    _check(self.futures, stop_event, self.what)
                    data = _pread_exact(fd, psize, offset, self.what)
                except BaseException:
                    self.part_slots.release()
                    raise
                whole.update(data)
                offset += psize
                self.futures.append(part_executor.submit(self.send_part, number, data))
                del data
            if os.pread(fd, 1, offset):
                raise LocalShardError(f"{self.what}: file grew while being read")
            sha_hex = whole.hexdigest()
            results = [f.result() for f in self.futures]  # re-raises a part's failure
            if sha_hex != expected_sha256:
                raise LocalShardError(
                    f"{self.what}: sha256 of the bytes read for sending is {sha_hex}, the "
                    f"manifest says {expected_sha256} (local rot?); upload aborted"
                )
            if stop_event is not None and stop_event.is_set():
                raise OperationInterruptedError(
                    f"{self.what}: stopped before completing the upload"
                )
            self._complete([part for part, _ in results], offset)
            completed = True
            return SentShard(
                offset,
                sha_hex,
                PART_CHECKSUM_ALGORITHM,
                composite_crc32c_b64([digest for _, digest in results]),
                len(plan),
            )
        finally:
            if not completed:
                self._clean_up()

    def _complete(self, parts: list[UploadedPart], size: int) -> None:
        try:
            self.store.complete_multipart_upload(self.key, self.upload_id, parts)
        except NoSuchUploadError as e:
            # A retried Complete whose first attempt won (or an abort by someone else): HEAD decides.
            log.warning(
                "%s: CompleteMultipartUpload answered NoSuchUpload; checking the object", self.what
            )
            info = self.store.head(self.key)
            if info is None or info.size_bytes != size:
                raise TransitCorruptionError(
                    f"{self.what}: multipart upload vanished before completion"
                ) from e

    def _clean_up(self) -> None:
        for f in self.futures:
            f.cancel()
        for f in self.futures:
            try:
                f.exception()
            except BaseException:  # noqa: BLE001 - cancelled futures; the original error propagates
                pass
        if self.on_progress is not None and self._sent:
            self.on_progress(-self._sent)
        try:
            self.store.abort_multipart_upload(self.key, self.upload_id)
            log.info("%s: aborted multipart upload %s", self.what, self.upload_id)
        except Exception as e:  # noqa: BLE001 - already failing: recorded for a later sweep
            log.warning(
                "%s: could not abort multipart upload %s (%s)", self.what, self.upload_id, e
            )
            if self.on_abort_failed is not None:
                self.on_abort_failed(self.key, self.upload_id, e)


def _check(
    futures: list[Future[tuple[UploadedPart, bytes]]], stop_event: threading.Event | None, what: str
) -> None:
    if stop_event is not None and stop_event.is_set():
        raise OperationInterruptedError(f"{what}: stopped; multipart upload aborted")
    for f in futures:
        if f.done():
            exc = f.exception()
            if exc is not None:
                raise exc


def read_back_sha256(
    store: ObjectStore,
    key: str,
    stop_event: threading.Event | None = None,
    max_bytes: int | None = None,
) -> tuple[int, str]:
    """Stream the object back (bounded memory, the store's retries) and return ``(size, sha256_hex)``;
    with ``max_bytes`` it stops past that many bytes (see :meth:`ObjectStore.read_sha256`)."""
    return store.read_sha256(key, stop_event=stop_event, max_bytes=max_bytes)


@dataclass(frozen=True)
class ShardConfirmation:
    """How a sent shard was confirmed: ``confirmed_by`` (``server-checksum`` or ``read-back``) and the
    object's ``etag`` as the confirming HEAD reported it (the commit re-checks it, SPEC §11)."""

    confirmed_by: str
    etag: str


def confirm_shard(
    store: ObjectStore,
    key: str,
    sent: SentShard,
    *,
    server_validates: bool,
    expected_sha256: str,
    force_read_back: bool = False,
    stop_event: threading.Event | None = None,
) -> ShardConfirmation:
    """Confirm the object at ``key`` holds the bytes of ``sent``; returns the method and the ETag of the
    object confirmed. Raises :class:`TransitCorruptionError` when it does not."""
    what = f"{store.url}/{key}"
    info = store.head(key)
    if info is None:
        raise TransitCorruptionError(f"{what}: missing right after its upload")
    if info.size_bytes != sent.size_bytes:
        raise TransitCorruptionError(
            f"{what}: server has {info.size_bytes} bytes, sent {sent.size_bytes}"
        )
    reported = info.reported_checksum(sent.checksum_algorithm)
    if server_validates and not force_read_back and reported is not None:
        if not checksums_match(reported, sent.checksum_b64):
            raise TransitCorruptionError(
                f"{what}: server reports Checksum{sent.checksum_algorithm} {reported}, "
                f"sent {sent.checksum_b64}"
            )
        return ShardConfirmation("server-checksum", info.etag)
    size, sha = read_back_sha256(store, key, stop_event, max_bytes=sent.size_bytes)
    if size != sent.size_bytes or sha != expected_sha256:
        raise TransitCorruptionError(
            f"{what}: read back {size} bytes with sha256 {sha}, expected "
            f"{sent.size_bytes} bytes with {expected_sha256}"
        )
    return ShardConfirmation("read-back", info.etag)


__all__ = [
    "LocalShardError",
    "TransitCorruptionError",
    "SentShard",
    "ShardConfirmation",
    "send_shard",
    "confirm_shard",
    "read_back_sha256",
    "PART_CHECKSUM_ALGORITHM",
]
