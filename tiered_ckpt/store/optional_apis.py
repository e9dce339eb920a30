"""Optional S3 operations a server may not implement: ListMultipartUploads, AbortMultipartUpload and
DeleteObjects (several small S3-compatible servers and some gateways answer ``501 NotImplemented``,
a few ``405 MethodNotAllowed``). None of them is needed to upload or restore a checkpoint; each only
serves a cleanup, so a missing one degrades instead of failing the upload:

- ListMultipartUploads missing: the per-shard leftover abort and the abandoned-upload sweep find
  nothing to list (uploads this process could not abort are still recorded locally:
  :mod:`tiered_ckpt.remote.upload.pending_aborts`).
- AbortMultipartUpload missing: a failed multipart upload stays open on the server (recorded locally
  for a later sweep; a bucket lifecycle rule ``AbortIncompleteMultipartUpload`` is the server-side
  remedy).
- DeleteObjects missing: :meth:`S3Store.delete <tiered_ckpt.store.s3.S3Store.delete>` falls back to
  one DeleteObject request per key (:func:`delete_keys`).

What is missing is learnt from the first ``501``/``405`` answer (never guessed up front), recorded
per (endpoint, bucket) for the life of the process (like the checksum probe's cache,
``store/probe.py``), logged ONCE as a warning, and later calls raise
:class:`OperationNotSupportedError` at once without a request. No boto import (errors classified by
``s3_error_code_and_status``).

Source: S3 API reference (Error responses: ``NotImplemented`` 501 "A header you provided implies
functionality that is not implemented", ``MethodNotAllowed`` 405).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from tiered_ckpt.errors import UploadError
from tiered_ckpt.redact import redact_url
from tiered_ckpt.retry import s3_error_code_and_status

if TYPE_CHECKING:
    from botocore.client import BaseClient

logger = logging.getLogger(__name__)

T = TypeVar("T")

LIST_MULTIPART_UPLOADS = "ListMultipartUploads"
ABORT_MULTIPART_UPLOAD = "AbortMultipartUpload"
DELETE_OBJECTS = "DeleteObjects"
OPTIONAL_OPERATIONS = (LIST_MULTIPART_UPLOADS, ABORT_MULTIPART_UPLOAD, DELETE_OBJECTS)

_NOT_IMPLEMENTED_CODES = frozenset({"NotImplemented", "MethodNotAllowed"})
_NOT_IMPLEMENTED_STATUSES = frozenset({501, 405})

_MISSING: dict[tuple[str, str], set[str]] = {}
_LOCK = threading.Lock()


class OperationNotSupportedError(UploadError):
    """The server does not implement the optional S3 ``operation`` (``501 NotImplemented`` or ``405
    MethodNotAllowed``; or learnt so earlier in this process for the same endpoint and bucket).
    Never retried; callers that can do without the operation catch it (see the module docstring)."""

    def __init__(
        self, message: str, *, operation: str, last_exception: BaseException | None = None
    ) -> None:
        super().__init__(message, last_exception=last_exception)
        self.operation = operation


def is_not_implemented(exc: BaseException) -> bool:
    """``exc`` is a botocore ``ClientError`` saying the server lacks the operation: code
    ``NotImplemented`` / ``MethodNotAllowed`` or HTTP 501 / 405."""
    code, status = s3_error_code_and_status(exc)
    return code in _NOT_IMPLEMENTED_CODES or status in _NOT_IMPLEMENTED_STATUSES


def _store_key(client: BaseClient, bucket: str) -> tuple[str, str]:
    return str(getattr(getattr(client, "meta", None), "endpoint_url", "")), bucket


def is_missing(client: BaseClient, bucket: str, operation: str) -> bool:
    """Whether ``operation`` was found missing on ``client``'s endpoint for ``bucket`` in this
    process."""
    with _LOCK:
        return operation in _MISSING.get(_store_key(client, bucket), ())


def mark_missing(
    client: BaseClient, bucket: str, operation: str, exc: BaseException | None = None
) -> None:
    """Record that the server lacks ``operation``; logs one warning per (endpoint, bucket,
    operation)."""
    key = _store_key(client, bucket)
    with _LOCK:
        ops = _MISSING.setdefault(key, set())
        first = operation not in ops
        ops.add(operation)
    if first:
        code, status = s3_error_code_and_status(exc) if exc is not None else (None, None)
        logger.warning(
            "S3 server %s does not implement %s for bucket %s (%s, HTTP %s); carrying on without it "
            "(see docs/sidecar.md, 'Servers without optional S3 APIs')",
            redact_url(key[0]),
            operation,
            bucket,
            code,
            status,
        )


def forget_missing() -> None:
    """Clear the record (tests; a process that knows the server was upgraded)."""
    with _LOCK:
        _MISSING.clear()


def call_optional(
    client: BaseClient, bucket: str, operation: str, what: str, fn: Callable[[], T]
) -> T:
    """Run ``fn()`` (one request of ``operation``) unless the operation is known missing; a
    ``501``/``405`` answer marks it missing. Raises :class:`OperationNotSupportedError` in both
    cases (before any request in the first); any other error of ``fn`` propagates unchanged."""
    if is_missing(client, bucket, operation):
        raise OperationNotSupportedError(
            f"{what}: the server does not implement {operation} (learnt earlier)",
            operation=operation,
        )
    try:
        return fn()
    except Exception as exc:
        if not is_not_implemented(exc):
            raise
        mark_missing(client, bucket, operation, exc)
        raise OperationNotSupportedError(
            f"{what}: the server does not implement {operation}",
            operation=operation,
            last_exception=exc,
        ) from exc


RetriedCall = Callable[..., object]


def delete_keys(
    call: RetriedCall,
    client: BaseClient,
    bucket: str,
    batch: list[str],
    url: str,
    delete_batch: Callable[[list[str]], None],
    is_retryable_delete_error: Callable[[BaseException], bool],
) -> None:
    """Delete ``batch`` (full keys, at most 1000) with one retried DeleteObjects
    ``delete_batch(batch)``; where the server lacks DeleteObjects (learnt now or before), with one
    retried DeleteObject per key instead (a missing key is not an error there either). ``call`` is
    the store's retried call (``call(what, fn, is_retryable=...)``). Raises ``UploadError``."""
    try:
        call(
            f"delete {len(batch)} key(s) under {url}",
            lambda: call_optional(
                client, bucket, DELETE_OBJECTS, f"delete under {url}", lambda: delete_batch(batch)
            ),
            is_retryable=is_retryable_delete_error,
        )
        return
    except OperationNotSupportedError:
        pass
    for full_key in list(batch):
        call(
            f"delete {url} key {full_key}",
            lambda k=full_key: client.delete_object(Bucket=bucket, Key=k),
        )


__all__ = [
    "ABORT_MULTIPART_UPLOAD",
    "DELETE_OBJECTS",
    "LIST_MULTIPART_UPLOADS",
    "OPTIONAL_OPERATIONS",
    "OperationNotSupportedError",
    "call_optional",
    "delete_keys",
    "forget_missing",
    "is_missing",
    "is_not_implemented",
    "mark_missing",
]
