"""Sending one shard file and confirming it remotely, end to end (the transfer half of ``upload.py``).

Why not ``S3Store.upload_file``: s3transfer reads the file itself, so the bytes we hash would come from a
*second* read of the file and a shard that rots between the two reads would go unnoticed. Here every
byte is hashed as it is read for sending, on one thread, in file order:

1. ``open(O_NOFOLLOW)``; its size must equal the local manifest's (else :class:`LocalShardError`).
2. A file below the multipart threshold is read whole (bounded by the threshold), hashed, compared with
   the manifest's sha256 *before* anything is sent, then written with one ``PutObject`` carrying its
   ``ChecksumSHA256`` (``S3Store.put_bytes``).
3. Otherwise a multipart upload: ``CreateMultipartUpload(ChecksumAlgorithm=CRC32C)``; the reader thread
   ``pread`` s part after part (part sizes from :func:`~tiered_ckpt.store.plan_part_sizes`, as s3transfer
   would), feeds the whole-file SHA-256, and hands each part to a worker that computes the part's CRC32C
   (sent as ``ChecksumCRC32C``, so a validating server rejects bytes damaged in transit; hardware CRC32C
   through ctypes releases the GIL) and sends ``UploadPart``. A semaphore shared by every shard bounds
   the parts in memory: at most ``part_slots + readers`` parts of ``part_size_bytes``.
   Why CRC32C and not SHA-256 per part: the whole-file SHA-256 above already proves that the bytes read
   equal the manifest's; the part checksum only has to catch damage in transit, which a CRC does (S3 and
   MinIO validate CRC32C like SHA-256). A per-part SHA-256 was a second SHA-256 pass over every byte on
   the client, and another one on servers that compute the composite themselves (moto), for nothing.
   After the last part the whole-file digest is compared with the manifest; a mismatch (local rot)
   aborts the upload before ``CompleteMultipartUpload``, so damaged bytes never become an object.
4. ``CompleteMultipartUpload`` with every part's CRC32C. A retried Complete whose first attempt
   succeeded answers ``NoSuchUpload``: then HEAD decides (size, and the confirmation below).
5. Confirmation (:func:`confirm_shard`): HEAD with ``ChecksumMode=ENABLED``; the size must match. Where
   the server validates checksums (probed once per bucket), the checksum it reports for the algorithm
   sent (``ChecksumSHA256`` of a single PUT, ``ChecksumCRC32C`` of a multipart upload) must equal the
   locally computed one (composite ``base64(crc32c(c1..cn))-n`` for multipart) -> ``server-checksum``.
   Elsewhere (moto) or when the server reports none, the object is streamed back and hashed ->
   ``read-back``. A mismatch is a :class:`TransitCorruptionError`: the caller uploads again.

Any failure after ``CreateMultipartUpload`` aborts that upload (best effort, logged); a crash leaves it for
the next sidecar start (``Uploader.abort_abandoned_uploads``). Retries of single HTTP calls are botocore's
(503 SlowDown, resets); whole-shard retries are the caller's (``tiered_ckpt.retry``). This module uses
the store's injected client for the multipart calls and a streaming GET; it imports no boto3.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import stat
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from tiered_ckpt.errors import ShardCorruptedError, UploadError
from tiered_ckpt.retry import OperationInterruptedError, s3_error_code_and_status
from tiered_ckpt.format.crc32c import crc32c_extend
from tiered_ckpt.store import plan_part_sizes
from tiered_ckpt.store.checksums import composite_crc32c_b64

log = logging.getLogger(__name__)

_READBACK_CHUNK_BYTES = 8 * 1024 * 1024


class LocalShardError(ShardCorruptedError):
    """The local shard file differs from its manifest entry (size or sha256 of the bytes read for
    sending): local rot or a concurrent rewrite. Never retried; the step fails."""


class TransitCorruptionError(ShardCorruptedError):
    """The remote object differs from what was sent (size, server checksum or read-back hash).
    Retried by uploading the shard again."""


@dataclass(frozen=True)
class SentShard:
    """What was sent: ``size_bytes``, ``sha256_hex`` of the bytes read for sending, and the S3 additional
    checksum as S3 reports it: ``checksum_algorithm`` ``"SHA256"`` (single PUT: ``checksum_b64`` is
    ``base64(sha256(body))``) or ``"CRC32C"`` (multipart: composite ``base64(crc32c(c1..cn))-n``)."""

    size_bytes: int
    sha256_hex: str
    checksum_algorithm: str
    checksum_b64: str
    parts: int


def full_key(store: Any, key: str) -> str:
    return f"{store.prefix}/{key}" if store.prefix else key


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
    store: Any,
    key: str,
    path: str | os.PathLike[str],
    *,
    expected_size: int,
    expected_sha256: str,
    part_executor: ThreadPoolExecutor,
    part_slots: threading.Semaphore,
    extra_args: dict[str, str],
    stop_event: threading.Event | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> SentShard:
    """Send ``path`` to ``key`` (relative to the store prefix) hashing it as it is read; see the module
    docstring. Raises :class:`LocalShardError` (file differs from the manifest; nothing committed),
    ``FileNotFoundError`` (file gone), :class:`OperationInterruptedError` (stop event; upload aborted),
    ``UploadError`` / botocore errors (the caller's retry decides)."""
    what = f"{store.url}/{key}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise LocalShardError(f"{what}: cannot open {os.fspath(path)}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LocalShardError(f"{what}: {os.fspath(path)} is not a regular file")
        size = st.st_size
        if size != expected_size:
            raise LocalShardError(f"{what}: local file is {size} bytes, the manifest says {expected_size}")
        settings = store.transfer_settings
        plan = plan_part_sizes(size, multipart_threshold_bytes=settings.multipart_threshold_bytes,
                               part_size_bytes=settings.part_size_bytes)
        if plan is None:
            return _send_single(store, key, fd, size, expected_sha256, what, stop_event, on_progress)
        return _send_multipart(store, key, fd, plan, expected_sha256, what, part_executor, part_slots,
                               extra_args, stop_event, on_progress)
    finally:
        os.close(fd)


def _send_single(store: Any, key: str, fd: int, size: int, expected_sha256: str, what: str,
                 stop_event: threading.Event | None, on_progress: Callable[[int], None] | None) -> SentShard:
    data = _pread_exact(fd, size, 0, what)
    digest = hashlib.sha256(data).digest()
    if digest.hex() != expected_sha256:
        raise LocalShardError(f"{what}: sha256 of the local file is {digest.hex()}, the manifest says "
                              f"{expected_sha256}")
    if stop_event is not None and stop_event.is_set():
        raise OperationInterruptedError(f"{what}: stopped before sending")
    b64 = base64.b64encode(digest).decode("ascii")
    store.put_bytes(key, data, checksum_sha256_b64=b64)
    if on_progress is not None:
        on_progress(size)
    return SentShard(size, digest.hex(), "SHA256", b64, 1)


def _send_multipart(store: Any, key: str, fd: int, plan: list[int], expected_sha256: str, what: str,
                    part_executor: ThreadPoolExecutor, part_slots: threading.Semaphore,
                    extra_args: dict[str, str], stop_event: threading.Event | None,
                    on_progress: Callable[[int], None] | None) -> SentShard:
    client, bucket, fkey = store.client, store.bucket, full_key(store, key)
    resp = client.create_multipart_upload(Bucket=bucket, Key=fkey, ChecksumAlgorithm="CRC32C", **extra_args)
    upload_id = resp["UploadId"]
    log.debug("%s: multipart upload %s started (%d parts)", what, upload_id, len(plan))
    futures: list[Future[dict[str, Any]]] = []
    completed = False
    sent = [0]
    sent_lock = threading.Lock()

    def send_part(number: int, data: bytes) -> dict[str, Any]:
        try:
            digest = crc32c_extend(0, data).to_bytes(4, "big")
            b64 = base64.b64encode(digest).decode("ascii")
            r = client.upload_part(Bucket=bucket, Key=fkey, UploadId=upload_id, PartNumber=number, Body=data,
                                   ChecksumAlgorithm="CRC32C", ChecksumCRC32C=b64)
            if on_progress is not None:
                on_progress(len(data))
            with sent_lock:
                sent[0] += len(data)
            return {"PartNumber": number, "ETag": r["ETag"], "ChecksumCRC32C": b64, "_digest": digest}
        finally:
            part_slots.release()

    try:
        whole = hashlib.sha256()
        offset = 0
        for number, psize in enumerate(plan, start=1):
            while not part_slots.acquire(timeout=0.1):
                _check(futures, stop_event, what)
            try:
                _check(futures, stop_event, what)
                data = _pread_exact(fd, psize, offset, what)
            except BaseException:
                part_slots.release()
                raise
            whole.update(data)
            offset += psize
            futures.append(part_executor.submit(send_part, number, data))
            del data
        if os.pread(fd, 1, offset):
            raise LocalShardError(f"{what}: file grew while being read")
        sha_hex = whole.hexdigest()
        parts = [f.result() for f in futures]  # re-raises a part's failure
        if sha_hex != expected_sha256:
            raise LocalShardError(f"{what}: sha256 of the bytes read for sending is {sha_hex}, the manifest "
                                  f"says {expected_sha256} (local rot?); upload aborted")
        if stop_event is not None and stop_event.is_set():
            raise OperationInterruptedError(f"{what}: stopped before completing the upload")
        composite = composite_crc32c_b64([p.pop("_digest") for p in parts])
        try:
            client.complete_multipart_upload(Bucket=bucket, Key=fkey, UploadId=upload_id,
                                             MultipartUpload={"Parts": parts})
        except Exception as e:
            code, _ = s3_error_code_and_status(e)
            if code != "NoSuchUpload":
                raise
            # A retried Complete whose first attempt won (or an abort by someone else): HEAD decides.
            log.warning("%s: CompleteMultipartUpload answered NoSuchUpload; checking the object", what)
            info = store.head(key)
            if info is None or info.size_bytes != offset:
                raise TransitCorruptionError(f"{what}: multipart upload vanished before completion") from e
        completed = True
        return SentShard(offset, sha_hex, "CRC32C", composite, len(plan))
    finally:
        if not completed:
            for f in futures:
                f.cancel()
            for f in futures:
                try:
                    f.exception()
                except BaseException:  # noqa: BLE001 - cancelled futures; the original error propagates
                    pass
            if on_progress is not None and sent[0]:
                on_progress(-sent[0])
            _abort_quietly(client, bucket, fkey, upload_id, what)


def _check(futures: list[Future[dict[str, Any]]], stop_event: threading.Event | None, what: str) -> None:
    if stop_event is not None and stop_event.is_set():
        raise OperationInterruptedError(f"{what}: stopped; multipart upload aborted")
    for f in futures:
        if f.done() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]


def _abort_quietly(client: Any, bucket: str, fkey: str, upload_id: str, what: str) -> None:
    try:
        client.abort_multipart_upload(Bucket=bucket, Key=fkey, UploadId=upload_id)
        log.info("%s: aborted multipart upload %s", what, upload_id)
    except Exception as e:  # noqa: BLE001 - already failing; a restart sweeps leftovers
        log.warning("%s: could not abort multipart upload %s (%s); a restart will sweep it", what,
                    upload_id, s3_error_code_and_status(e)[0] or type(e).__name__)


def read_back_sha256(store: Any, key: str, stop_event: threading.Event | None = None) -> tuple[int, str]:
    """Stream the object back (one GET, bounded memory) and return ``(size, sha256_hex)``."""
    resp = store.client.get_object(Bucket=store.bucket, Key=full_key(store, key))
    body = resp["Body"]
    h = hashlib.sha256()
    n = 0
    try:
        for chunk in body.iter_chunks(_READBACK_CHUNK_BYTES):
            h.update(chunk)
            n += len(chunk)
            if stop_event is not None and stop_event.is_set():
                raise OperationInterruptedError(f"{store.url}/{key}: stopped during read-back")
    finally:
        body.close()
    return n, h.hexdigest()


def confirm_shard(store: Any, key: str, sent: SentShard, *, server_validates: bool, expected_sha256: str,
                  force_read_back: bool = False, stop_event: threading.Event | None = None) -> str:
    """Confirm the object at ``key`` holds the bytes of ``sent``; returns the method (``server-checksum``
    or ``read-back``). Raises :class:`TransitCorruptionError` when it does not."""
    from tiered_ckpt.store import checksums_match

    what = f"{store.url}/{key}"
    resp = store.head_response(key)
    if resp is None:
        raise TransitCorruptionError(f"{what}: missing right after its upload")
    size = int(resp["ContentLength"])
    if size != sent.size_bytes:
        raise TransitCorruptionError(f"{what}: server has {size} bytes, sent {sent.size_bytes}")
    field = f"Checksum{sent.checksum_algorithm}"
    reported = resp.get(field)
    if server_validates and not force_read_back and reported is not None:
        if not checksums_match(str(reported), sent.checksum_b64):
            raise TransitCorruptionError(f"{what}: server reports {field} {reported}, sent {sent.checksum_b64}")
        return "server-checksum"
    size, sha = read_back_sha256(store, key, stop_event)
    if size != sent.size_bytes or sha != expected_sha256:
        raise TransitCorruptionError(f"{what}: read back {size} bytes with sha256 {sha}, expected "
                                     f"{sent.size_bytes} bytes with {expected_sha256}")
    return "read-back"


__all__ = ["LocalShardError", "TransitCorruptionError", "SentShard", "send_shard", "confirm_shard",
           "read_back_sha256", "full_key"]
