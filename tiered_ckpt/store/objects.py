"""Single-attempt S3 object calls for :class:`~tiered_ckpt.store.s3.S3Store`: one request each
(botocore retries inside it), the boto response turned into our value types, S3 error codes into our
typed errors. The store wraps each call in its retries and maps keys; nothing here retries or knows
the prefix.

No boto import: errors are classified with :func:`tiered_ckpt.retry.s3_error_code_and_status`, which
reads botocore's structured ``ClientError.response`` (never the message text) and answers ``(None,
None)`` for anything that is not a ``ClientError`` (those propagate unchanged).

A ranged GET (:func:`read_range_attempt`) reads straight into the caller's buffer; the download
(``tiered_ckpt.remote``) runs every shard's parts through it, hashing as the bytes arrive.

Source: S3 API reference (HeadObject with ``ChecksumMode=ENABLED``, PutObject with
``ChecksumSHA256``, ``If-None-Match: *`` and ``If-Match``, GetObject with ``Range``, ListObjectsV2,
DeleteObjects).
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from tiered_ckpt.errors import ManifestError, RemoteListError, ShardCorruptedError
from tiered_ckpt.retry import (
    OperationInterruptedError,
    is_retryable_s3_error,
    s3_error_code_and_status,
)
from tiered_ckpt.store.base import (
    ObjectInfo,
    ObjectSizeError,
    PreconditionFailedError,
    RemoteNotFoundError,
)
from tiered_ckpt.store.checksums import checksums_match
from tiered_ckpt.store.keys import PrefixKeys

if TYPE_CHECKING:
    from botocore.client import BaseClient

#: The store's retried call: ``call(op_name, attempt) -> attempt()``'s result (one page per call).
#: ``call(op_name, fn, **kwargs)``: the store's retried call (``S3Store._call``; ``error=`` the
#: class of its final failure).
RetriedCall = Callable[..., Any]

_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound", "NoSuchBucket"})
_TRANSIENT_DELETE_CODES = frozenset({"SlowDown", "InternalError", "ServiceUnavailable"})
#: Streamed read-back: bytes per chunk of the GetObject body.
READ_CHUNK_BYTES = 8 * 1024 * 1024
#: Small objects (:func:`get_object`): bytes per chunk; also the stall granularity of those reads.
GET_CHUNK_BYTES = 64 * 1024


def is_not_found(exc: BaseException) -> bool:
    """``exc`` is a botocore ``ClientError`` for a missing object or bucket (404, ``NoSuchKey``,
    ...)."""
    code, status = s3_error_code_and_status(exc)
    return status == 404 or code in _NOT_FOUND_CODES


def object_info(key: str, resp: Mapping[str, Any]) -> ObjectInfo:
    """A HeadObject response as :class:`ObjectInfo` (``key`` relative to the store prefix)."""
    return ObjectInfo(
        key=key,
        size_bytes=int(resp["ContentLength"]),
        etag=str(resp["ETag"]),
        checksum_sha256=resp.get("ChecksumSHA256"),
        last_modified=resp.get("LastModified"),
        checksum_crc32c=resp.get("ChecksumCRC32C"),
    )


def head_object(client: BaseClient, bucket: str, full_key: str, key: str) -> ObjectInfo | None:
    """HeadObject (``ChecksumMode=ENABLED``); ``None`` on 404."""
    try:
        resp = client.head_object(Bucket=bucket, Key=full_key, ChecksumMode="ENABLED")
    except Exception as exc:
        if is_not_found(exc):
            return None
        raise
    return object_info(key, resp)


def put_object(
    client: BaseClient,
    bucket: str,
    full_key: str,
    payload: bytes,
    checksum_sha256_b64: str,
    write_args: Mapping[str, str],
    *,
    key: str,
    what: str,
    if_none_match: bool,
    if_match: str | None,
) -> ObjectInfo:
    """PutObject of ``payload`` with ``ChecksumSHA256=checksum_sha256_b64``, the write settings'
    ``write_args`` and the condition (``If-None-Match: *`` or ``If-Match: <etag>``). A lost
    condition (412 ``PreconditionFailed``; 404 for ``If-Match`` on a missing key) raises
    :class:`PreconditionFailedError`; a reported ``ChecksumSHA256`` that differs from the one sent
    raises :class:`~tiered_ckpt.errors.ShardCorruptedError` (retryable)."""
    request: dict[str, str | bytes] = {
        "Bucket": bucket,
        "Key": full_key,
        "Body": payload,
        "ChecksumAlgorithm": "SHA256",
        "ChecksumSHA256": checksum_sha256_b64,
        **write_args,
    }
    if if_none_match:
        request["IfNoneMatch"] = "*"
    if if_match is not None:
        request["IfMatch"] = if_match
    conditional = if_none_match or if_match is not None
    try:
        resp = client.put_object(**request)
    except Exception as exc:
        code, status = s3_error_code_and_status(exc)
        lost = (
            status == 412
            or code == "PreconditionFailed"
            or (if_match is not None and is_not_found(exc))
        )
        if conditional and lost:
            condition = "If-None-Match: *" if if_none_match else f"If-Match: {if_match}"
            raise PreconditionFailedError(
                f"conditional put of {what} lost ({condition}): {code}", last_exception=exc
            ) from exc
        raise
    reported = resp.get("ChecksumSHA256")
    if reported is not None and not checksums_match(reported, checksum_sha256_b64):
        raise ShardCorruptedError(
            f"{what}: server reports ChecksumSHA256 {reported}, sent {checksum_sha256_b64}"
        )
    return ObjectInfo(
        key=key,
        size_bytes=len(payload),
        etag=str(resp["ETag"]),
        checksum_sha256=reported,
        last_modified=None,
    )


def get_object(client: BaseClient, request: Mapping[str, str], what: str, max_bytes: int) -> bytes:
    """GetObject with the prepared ``request`` (Bucket, Key; no Range: a Range past an object's end
    is refused by strict servers, and the cap is enforced on the answer instead): the body, read in
    :data:`GET_CHUNK_BYTES` chunks and refused with :class:`~tiered_ckpt.errors.ManifestError`
    naming ``what`` and the cap as soon as it announces more than ``max_bytes`` + 1 or passes
    ``max_bytes`` while read, so an endless body costs at most one chunk over the cap in memory.
    Raises :class:`RemoteNotFoundError` on 404."""
    try:
        resp = client.get_object(**request)
    except Exception as exc:
        if is_not_found(exc):
            raise RemoteNotFoundError(f"{what} does not exist", last_exception=exc) from exc
        raise
    return _read_capped(resp, what, max_bytes)


def _too_large(what: str, max_bytes: int, seen: str) -> ManifestError:
    return ManifestError(
        f"{what} is larger than the {max_bytes}-byte cap for this kind of object ({seen}); "
        "refusing to read it"
    )


def _read_capped(resp: Mapping[str, Any], what: str, max_bytes: int) -> bytes:
    body = resp["Body"]
    try:
        announced = resp.get("ContentLength")
        if announced is not None and int(announced) > max_bytes + 1:
            raise _too_large(what, max_bytes, f"Content-Length {int(announced)}")
        buf = bytearray()
        for chunk in body.iter_chunks(GET_CHUNK_BYTES):
            buf += chunk
            if len(buf) > max_bytes:
                raise _too_large(what, max_bytes, f"more than {max_bytes} bytes received")
        return bytes(buf)
    finally:
        body.close()


def read_sha256(
    client: BaseClient,
    bucket: str,
    full_key: str,
    what: str,
    stop_events: tuple[threading.Event, ...],
    max_bytes: int | None = None,
) -> tuple[int, str]:
    """GetObject of the whole object (no Range: one past the planned end is refused by strict
    servers, and an exact one cannot tell a shorter object there either) streamed in
    :data:`READ_CHUNK_BYTES` chunks: ``(size_bytes, sha256_hex)`` of the body. With ``max_bytes``
    (the planned size) an object announced longer (``Content-Length``) is not read: its announced
    size comes back with the hash of nothing; a body that keeps coming past ``max_bytes`` is
    stopped one chunk past it. Either way the size is over ``max_bytes``, never an endless read
    (the caller bounds the request's deadline by ``max_bytes`` too:
    :meth:`~tiered_ckpt.store.deadline.GuardedClient.planned_size`). Raises
    :class:`RemoteNotFoundError` (404), :class:`OperationInterruptedError` once any of
    ``stop_events`` is set (checked after each chunk)."""
    try:
        resp = client.get_object(Bucket=bucket, Key=full_key)
    except Exception as exc:
        if is_not_found(exc):
            raise RemoteNotFoundError(f"{what} does not exist", last_exception=exc) from exc
        raise
    body = resp["Body"]
    h = hashlib.sha256()
    n = 0
    try:
        announced = resp.get("ContentLength")
        if max_bytes is not None and announced is not None and int(announced) > max_bytes:
            return int(announced), h.hexdigest()
        for chunk in body.iter_chunks(READ_CHUNK_BYTES):
            h.update(chunk)
            n += len(chunk)
            if any(e.is_set() for e in stop_events):
                raise OperationInterruptedError(f"{what}: stopped during read-back")
            if max_bytes is not None and n > max_bytes:
                break
    finally:
        body.close()
    return n, h.hexdigest()


def list_objects_page(
    client: BaseClient, bucket: str, full_prefix: str, page_size: int, token: str | None
) -> tuple[list[str], bool, str | None]:
    """One ListObjectsV2 page: ``(full keys, is_truncated, next continuation token)``."""
    kwargs: dict[str, str | int] = {"Bucket": bucket, "Prefix": full_prefix, "MaxKeys": page_size}
    if token is not None:
        kwargs["ContinuationToken"] = token
    resp = client.list_objects_v2(**kwargs)
    keys = [item["Key"] for item in resp.get("Contents", [])]
    return keys, bool(resp.get("IsTruncated")), resp.get("NextContinuationToken")


def iter_keys(
    call: RetriedCall,
    client: BaseClient,
    bucket: str,
    keys: PrefixKeys,
    prefix: str,
    page_size: int,
    url: str,
) -> Iterator[str]:
    """Relative keys under ``prefix``, page after page (a generator; each page one ``call``). Raises
    ``ValueError`` on a ``page_size`` outside [1, 1000],
    :class:`~tiered_ckpt.errors.RemoteListError` when a page fails after the retries, or is
    truncated without a token or with the token it was asked with (a server that ignores it: the
    same page for ever)."""
    if not 1 <= page_size <= 1000:
        raise ValueError(f"page_size must be in [1, 1000], got {page_size}")
    full_prefix = keys.full_prefix(prefix)
    token: str | None = None
    while True:
        sent = token
        page, truncated, token = call(
            f"list {url}/{prefix}",
            lambda t=token: list_objects_page(client, bucket, full_prefix, page_size, t),
            error=RemoteListError,
        )
        for full_key in page:
            yield keys.relative(full_key)
        if not truncated:
            return
        if not token:
            raise RemoteListError(
                f"listing {url}/{prefix} failed: the server sent a truncated page without a "
                "continuation token"
            )
        if token == sent:  # a server ignoring ContinuationToken would answer the same page for ever
            raise RemoteListError(
                f"listing {url}/{prefix} failed: the server sent back the continuation token "
                "it was sent (the same page for ever)"
            )


class PartialDeleteError(Exception):
    """DeleteObjects reported per-key errors; ``retryable`` if all of them are transient (internal
    to the store: it retries the failed keys or raises an ``UploadError`` naming them)."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def is_retryable_delete_error(exc: BaseException) -> bool:
    """Retry predicate of a delete batch: transient per-key errors, or any retryable S3 error."""
    if isinstance(exc, PartialDeleteError):
        return exc.retryable
    return is_retryable_s3_error(exc)


def delete_batch(client: BaseClient, bucket: str, batch: list[str]) -> None:
    """DeleteObjects of ``batch`` (full keys, at most 1000). On per-key errors ``batch`` is narrowed
    IN PLACE to the keys that failed (so a retry sends only those) and :class:`PartialDeleteError`
    raised."""
    resp = client.delete_objects(
        Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
    )
    errors = resp.get("Errors") or []
    if not errors:
        batch.clear()
        return
    failed = {e.get("Key") for e in errors}
    batch[:] = [k for k in batch if k in failed]
    codes = sorted({str(e.get("Code")) for e in errors})
    retryable = all(str(e.get("Code")) in _TRANSIENT_DELETE_CODES for e in errors)
    raise PartialDeleteError(
        f"{len(errors)} key(s) not deleted, codes {codes}, first {sorted(failed)[:3]}",
        retryable=retryable,
    )


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
        code, status = s3_error_code_and_status(exc)
        if status == 416 or code == "InvalidRange" or (status == 400 and code == "InvalidArgument"):
            # a range inside the planned size refused (416; 400 from strict servers): the object
            # is shorter than planned now (replaced)
            raise ObjectSizeError(
                f"{what}: the server refuses bytes {offset}-{offset + n - 1} ({code or 'HTTP'} "
                f"{status}); it is shorter than the planned {object_size} bytes (replaced after "
                "the plan?)"
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
    "GET_CHUNK_BYTES",
    "PartialDeleteError",
    "RANGE_CHUNK_BYTES",
    "READ_CHUNK_BYTES",
    "delete_batch",
    "download_retryable",
    "get_object",
    "head_object",
    "is_not_found",
    "is_retryable_delete_error",
    "iter_keys",
    "list_objects_page",
    "object_info",
    "put_object",
    "read_range_attempt",
    "read_sha256",
]
