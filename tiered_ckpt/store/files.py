"""Whole-file transfers of :class:`~tiered_ckpt.store.s3.S3Store` through s3transfer: one attempt of
an upload or a download each (the store retries whole attempts). The only store module importing
s3transfer.

s3transfer's ``TransferManager`` does the multipart upload (concurrent parts, abort on failure) and
the ranged GETs of a download; :class:`FileTransfers` keeps one manager per direction per store, so
concurrency is bounded per store, and cancels a transfer in flight when the store's stop event is
set.

:func:`read_range_attempt` is the other way down: one ranged GET read straight into a caller's
buffer (``tiered_ckpt.remote.download`` runs all shards' parts through it, hashing as the bytes
arrive).

Downloads write into the path the caller names (a temp name it chose) and remove it again on
failure; they never fsync or rename: the caller commits the file (``tiered_ckpt.local.commit``).

Source: s3transfer ``manager.py`` (``TransferConfig``: ``multipart_threshold``,
``multipart_chunksize``, ``max_request_concurrency``), ``upload.py``, ``download.py``,
``subscribers.py``, ``futures.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from s3transfer.exceptions import CancelledError as TransferCancelledError
from s3transfer.futures import TransferFuture
from s3transfer.manager import TransferConfig, TransferManager
from s3transfer.subscribers import BaseSubscriber

from tiered_ckpt.errors import ShardCorruptedError, UploadError
from tiered_ckpt.retry import (
    OperationInterruptedError,
    is_retryable_s3_error,
    s3_error_code_and_status,
)
from tiered_ckpt.store.base import (
    ObjectInfo,
    ObjectSizeError,
    ProgressCallback,
    RemoteNotFoundError,
)
from tiered_ckpt.store.checksums import checksums_match
from tiered_ckpt.store.objects import head_object, is_not_found
from tiered_ckpt.store.settings import TransferSettings

if TYPE_CHECKING:
    from botocore.client import BaseClient

logger = logging.getLogger(__name__)

_WAIT_POLL_S = 0.05


class AttemptProgress(BaseSubscriber):
    """Forwards s3transfer progress to ``on_progress`` and can take back one attempt's bytes."""

    def __init__(self, on_progress: ProgressCallback | None) -> None:
        self._on_progress = on_progress
        self._lock = threading.Lock()
        self._sent = 0

    def on_progress(self, future: TransferFuture, bytes_transferred: int, **kwargs: Any) -> None:
        with self._lock:
            self._sent += bytes_transferred
        if self._on_progress is not None:
            self._on_progress(bytes_transferred)

    def rollback(self) -> None:
        """Report the bytes of this attempt as a negative delta (before a retry or on failure)."""
        with self._lock:
            sent, self._sent = self._sent, 0
        if sent and self._on_progress is not None:
            self._on_progress(-sent)


class FileTransfers:
    """The two s3transfer managers of one store (created on first use) and the wait that honours the
    store's stop event. Thread-safe; :meth:`shutdown` waits for running transfers."""

    def __init__(
        self, client: BaseClient, settings: TransferSettings, stop_event: threading.Event | None
    ) -> None:
        self._client = client
        self._settings = settings
        self._stop_event = stop_event
        self._lock = threading.Lock()
        self._managers: tuple[TransferManager, TransferManager] | None = None
        self._closed = False

    @property
    def client(self) -> BaseClient:
        """The botocore S3 client the managers use."""
        return self._client

    def managers(self, what: str) -> tuple[TransferManager, TransferManager]:
        """``(upload manager, download manager)``; raises ``UploadError`` after :meth:`shutdown`."""
        with self._lock:
            if self._closed:
                raise UploadError(f"{what}: store is closed")
            if self._managers is None:
                t = self._settings
                up = TransferManager(
                    self._client,
                    TransferConfig(
                        multipart_threshold=t.multipart_threshold_bytes,
                        multipart_chunksize=t.part_size_bytes,
                        max_request_concurrency=t.max_concurrency,
                    ),
                )
                down = TransferManager(
                    self._client,
                    TransferConfig(
                        multipart_threshold=t.download_part_size_bytes,
                        multipart_chunksize=t.download_part_size_bytes,
                        max_request_concurrency=t.download_max_concurrency,
                    ),
                )
                self._managers = (up, down)
            return self._managers

    def wait(self, future: TransferFuture, op_name: str) -> None:
        """``future.result()`` (``None`` for uploads and downloads), cancelling the transfer if the
        stop event fires meanwhile (then :class:`OperationInterruptedError`)."""
        if self._stop_event is None:
            future.result()
            return
        while not future.done():
            if self._stop_event.wait(_WAIT_POLL_S):
                future.cancel()
                try:
                    future.result()
                except TransferCancelledError as exc:
                    raise OperationInterruptedError(
                        f"{op_name}: cancelled by stop event", last_exception=exc
                    ) from exc
                except Exception as exc:  # the transfer failed on its own before the cancel took
                    raise OperationInterruptedError(
                        f"{op_name}: stopped after {exc!r}", last_exception=exc
                    ) from exc
                break
        future.result()

    def shutdown(self) -> None:
        """Shut the managers down (waiting for running transfers). Idempotent."""
        with self._lock:
            self._closed = True
            managers, self._managers = self._managers, None
        for manager in managers or ():
            manager.shutdown()


def upload_attempt(
    transfers: FileTransfers,
    source: str,
    *,
    bucket: str,
    full_key: str,
    key: str,
    what: str,
    size: int,
    expected_checksum_b64: str,
    single_put: bool,
    write_args: Mapping[str, str],
    on_progress: ProgressCallback | None,
) -> ObjectInfo:
    """One s3transfer upload of ``source`` (``ChecksumAlgorithm=SHA256``; a ``single_put`` carries
    ``expected_checksum_b64`` itself, multipart parts the SHA-256 botocore computes per part), then
    HEAD: a missing object, another size or a reported ``ChecksumSHA256`` other than
    ``expected_checksum_b64`` raises :class:`ShardCorruptedError` (retryable). A failed attempt's
    progress is taken back."""
    extra_args = {"ChecksumAlgorithm": "SHA256", **write_args}
    if single_put:
        extra_args["ChecksumSHA256"] = expected_checksum_b64
    upload_manager, _ = transfers.managers(what)
    progress = AttemptProgress(on_progress)
    try:
        future = upload_manager.upload(
            source, bucket, full_key, extra_args=extra_args, subscribers=[progress]
        )
        transfers.wait(future, f"upload {source} -> {what}")
        info = head_object(transfers.client, bucket, full_key, key)
        if info is None:
            raise ShardCorruptedError(f"{what}: missing right after its upload completed")
        if info.size_bytes != size:
            raise ShardCorruptedError(
                f"{what}: server reports {info.size_bytes} bytes, sent {size}"
            )
        if info.checksum_sha256 is not None and not checksums_match(
            info.checksum_sha256, expected_checksum_b64
        ):
            raise ShardCorruptedError(
                f"{what}: server reports ChecksumSHA256 {info.checksum_sha256}, expected {expected_checksum_b64}"
            )
    except BaseException:
        progress.rollback()
        raise
    logger.debug(
        "uploaded %s (%d bytes, %s, ChecksumSHA256 %s)",
        what,
        size,
        "single PUT" if single_put else "multipart",
        info.checksum_sha256,
    )
    return info


class BoundedWriter:
    """The file object handed to s3transfer: writes at (seek offset + length) beyond ``limit`` bytes
    raise :class:`ObjectSizeError` before anything is written, which fails the transfer (s3transfer
    stops its GETs at the next chunk). Everything else passes through to the real file."""

    def __init__(self, f: Any, limit: int, what: str) -> None:
        self._f = f
        self._limit = limit
        self._what = what
        self._pos = 0

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._pos = self._f.seek(offset, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data: bytes) -> int:
        if self._pos + len(data) > self._limit:
            raise ObjectSizeError(
                f"{self._what}: the server sent more than the planned {self._limit} bytes "
                f"(a write up to byte {self._pos + len(data)}); stopped"
            )
        n = self._f.write(data)
        self._pos += n
        return int(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def download_attempt(
    transfers: FileTransfers,
    dest: str,
    *,
    bucket: str,
    full_key: str,
    what: str,
    on_progress: ProgressCallback | None,
    expected_size: int | None = None,
) -> int:
    """One s3transfer download into ``dest`` (created or truncated); returns its size in bytes. With
    ``expected_size`` the object is HEADed first (another size: :class:`ObjectSizeError` before any
    byte) and written through a :class:`BoundedWriter` (a body past it: :class:`ObjectSizeError`
    within one part), and the GETs' deadlines count at most ``expected_size`` bytes (not
    s3transfer's whole part). On any failure the attempt's progress is taken back and ``dest``
    removed (if this attempt opened it). Raises :class:`RemoteNotFoundError` (404), ``OSError``
    (local disk)."""
    if expected_size is not None:
        info = head_object(transfers.client, bucket, full_key, full_key)
        if info is None:
            raise RemoteNotFoundError(f"{what} does not exist")
        if info.size_bytes != expected_size:
            raise ObjectSizeError(
                f"{what}: the server reports {info.size_bytes} bytes, planned {expected_size}; "
                "not downloading it"
            )
    _, download_manager = transfers.managers(what)
    progress = AttemptProgress(on_progress)
    opened = False
    planned = getattr(
        transfers.client, "planned_size", None
    )  # the GETs' deadline follows expected_size
    try:
        with contextlib.ExitStack() as stack, open(dest, "wb") as f:
            if planned is not None and expected_size is not None:
                stack.enter_context(planned(bucket, full_key, expected_size))
            opened = True
            target = f if expected_size is None else BoundedWriter(f, expected_size, what)
            future = download_manager.download(bucket, full_key, target, subscribers=[progress])
            try:
                transfers.wait(future, f"download {what} -> {dest}")
            except Exception as exc:
                if is_not_found(exc):
                    raise RemoteNotFoundError(f"{what} does not exist", last_exception=exc) from exc
                raise
            f.flush()
            size = os.fstat(f.fileno()).st_size
    except BaseException:
        progress.rollback()
        if opened:
            try:
                os.unlink(dest)
            except FileNotFoundError:
                pass
        raise
    return size


#: Bytes per ``readinto`` of a ranged GET's body: the stall clock's granularity (64 MiB parts still
#: report progress every 1 MiB, well inside the stall timeout at the slowest rate allowed).
RANGE_CHUNK_BYTES = 1024 * 1024
_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def download_retryable(exc: BaseException) -> bool:
    """Retry predicate of downloads: what :func:`is_retryable_s3_error` retries, but never a size
    refused."""
    return not isinstance(exc, ObjectSizeError) and is_retryable_s3_error(exc)


def _check_range_answer(
    resp: Mapping[str, Any], what: str, offset: int, n: int, object_size: int
) -> None:
    """The GetObject answer is exactly ``[offset, offset + n)`` of an object of ``object_size``
    bytes: its ``Content-Range`` (or, without one, a whole-object 200 that is this one part) and its
    length. Another total size or a longer body: :class:`ObjectSizeError` before any byte is
    read."""
    length = resp.get("ContentLength")
    cr = resp.get("ContentRange")
    m = _CONTENT_RANGE_RE.match(cr) if isinstance(cr, str) else None
    if m is not None:
        start, end, total = int(m.group(1)), int(m.group(2)), m.group(3)
        if total != "*" and int(total) != object_size:
            raise ObjectSizeError(
                f"{what}: the server reports {total} bytes, planned {object_size}; "
                "not reading it (replaced after the plan?)"
            )
        if (start, end) != (offset, offset + n - 1):
            raise ObjectSizeError(
                f"{what}: asked for bytes {offset}-{offset + n - 1}, the server sent {start}-{end}"
            )
    elif not (offset == 0 and n == object_size):
        raise ObjectSizeError(
            f"{what}: the server ignored the Range bytes={offset}-{offset + n - 1} "
            f"(no Content-Range); not reading a whole body of {length} bytes"
        )
    if length is not None and int(length) != n:
        raise ObjectSizeError(
            f"{what}: a body of {int(length)} bytes for a range of {n}; not reading it"
        )


def read_range_attempt(
    client: BaseClient,
    *,
    bucket: str,
    full_key: str,
    what: str,
    offset: int,
    out: memoryview,
    object_size: int,
    stop_events: tuple[threading.Event, ...] = (),
) -> None:
    """One ranged GetObject of ``[offset, offset + len(out))`` of an object planned at
    ``object_size`` bytes, read straight into ``out`` (no intermediate copy where the HTTP body
    allows ``readinto``) in :data:`RANGE_CHUNK_BYTES` pieces, under the request's deadline and stall
    clock (the client is the store's ``GuardedClient``; the deadline counts ``len(out)``). Never
    reads past ``len(out)``.

    Raises :class:`RemoteNotFoundError` (404), :class:`ObjectSizeError` (another total size in
    ``Content-Range``, another range or length, HTTP 416: before any byte is read),
    ``ConnectionError`` (the body ended early; retryable), :class:`OperationInterruptedError` (a
    stop event set between chunks), ``ValueError`` (a range outside the object). Source: S3
    GetObject ``Range`` / ``Content-Range`` (RFC 9110 section 14)."""
    n = len(out)
    if not (0 <= offset and n > 0 and offset + n <= object_size):
        raise ValueError(f"range [{offset}, {offset + n}) outside an object of {object_size} bytes")
    try:
        resp = client.get_object(
            Bucket=bucket, Key=full_key, Range=f"bytes={offset}-{offset + n - 1}"
        )
    except Exception as exc:
        if is_not_found(exc):
            raise RemoteNotFoundError(f"{what} does not exist", last_exception=exc) from exc
        if (
            s3_error_code_and_status(exc)[1] == 416
        ):  # InvalidRange: shorter than planned now (replaced)
            raise ObjectSizeError(
                f"{what}: the server refuses bytes {offset}-{offset + n - 1} (HTTP 416); it is "
                f"shorter than the planned {object_size} bytes (replaced after the plan?)"
            ) from exc
        raise
    body = resp["Body"]
    try:
        _check_range_answer(resp, what, offset, n, object_size)
        got = 0
        while got < n:
            k = body.readinto(out[got : got + RANGE_CHUNK_BYTES])
            if not k:
                raise ConnectionError(
                    f"{what}: the body of bytes {offset}-{offset + n - 1} ended after {got} bytes"
                )
            got += k
            if any(e.is_set() for e in stop_events):
                raise OperationInterruptedError(f"{what}: stopped during a ranged GET")
        if body.read(
            1
        ):  # EOF read through the client's own path: it hands the connection back to the pool
            raise ObjectSizeError(
                f"{what}: the body of bytes {offset}-{offset + n - 1} runs past them"
            )
    finally:
        body.close()


__all__ = [
    "AttemptProgress",
    "BoundedWriter",
    "FileTransfers",
    "RANGE_CHUNK_BYTES",
    "download_attempt",
    "read_range_attempt",
    "download_retryable",
    "upload_attempt",
]
