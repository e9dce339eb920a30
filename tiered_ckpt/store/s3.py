"""S3 implementation of :class:`~tiered_ckpt.store.base.ObjectStore` (STYLE item 5).

:class:`S3Store` maps keys under its prefix and wraps every operation once in
:func:`tiered_ckpt.retry.call_with_retries` (whole-operation retries on top of botocore's
per-request ones; that module says how they stack). The single attempts live beside it:
``objects.py`` (head, put, get, ranged get, list, delete, read-back), ``multipart.py`` (create,
part, complete, abort, list), ``probe.py`` (does the server validate checksums); the client
comes from ``client.py``.

Integrity: every body written carries an additional checksum (``ChecksumSHA256`` for ``put_bytes``,
the caller's algorithm for the multipart uploads it drives), so a validating server (AWS, MinIO)
rejects damaged bytes. A server that does not validate (moto) echoes the header it was sent, so a match proves nothing there:
:func:`probe_checksum_validation` tells the caller whether it must read the object back
(:meth:`S3Store.read_sha256`). Credentials are never logged.

Source: S3 API reference (PutObject, HeadObject, GetObject, ListObjectsV2, DeleteObjects, the
multipart calls, conditional writes with If-None-Match / If-Match).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from tiered_ckpt.errors import ManifestError, UploadError
from tiered_ckpt.retry import RetryPolicy, call_with_retries, is_retryable_s3_error
from tiered_ckpt.store import multipart, objects, optional_apis
from tiered_ckpt.store.base import (
    MultipartUploadInfo,
    ObjectInfo,
    ObjectSizeError,
    UploadedPart,
    format_s3_url,
    parse_s3_url,
)
from tiered_ckpt.store.checksums import (
    plan_part_sizes,
    sha256_b64,
)
from tiered_ckpt.store.client import install_request_hooks, make_s3_client
from tiered_ckpt.store.deadline import GuardedClient, operation_budget
from tiered_ckpt.store.keys import PrefixKeys
from tiered_ckpt.store.probe import PROBE_KEY_PREFIX, probe_checksum_validation, probe_once
from tiered_ckpt.store.settings import DeadlineSettings, TransferSettings, WriteSettings

if TYPE_CHECKING:
    from botocore.client import BaseClient

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DELETE_BATCH = 1000  # DeleteObjects accepts at most 1000 keys per request
#: ``get_bytes`` without ``max_bytes``: callers of a known kind pass their own cap
#: (``remote/limits.py``).
DEFAULT_GET_MAX_BYTES = 16 * 1024 * 1024


class S3Store:
    """A prefix of an S3 bucket, speaking :class:`~tiered_ckpt.store.base.ObjectStore`.

    ``client``: a botocore S3 client (see :func:`make_s3_client`; injected, shared, never created
    per call). ``prefix``: keys are stored as ``<prefix>/<key>`` (no leading or trailing ``/``;
    ``""`` for the bucket root). ``stop_event``: once set, retries stop, waits are cut short and
    in-flight transfers are cancelled (an interrupted multipart upload is aborted by s3transfer),
    raising :class:`~tiered_ckpt.retry.OperationInterruptedError`. ``cancel_event`` (set with
    ``stop_event``): every request in flight is cut, uploads too. ``deadlines``: the stall timeout
    and byte-scaled deadline of every single request (:mod:`tiered_ckpt.store.deadline`; a hit is
    retried like a timeout) and the time budget of each operation, all its attempts together.

    Every method is thread-safe and wrapped once in :func:`~tiered_ckpt.retry.call_with_retries`;
    errors that outlast the retries are :class:`~tiered_ckpt.errors.UploadError` with
    ``last_exception`` set. Local I/O errors (a missing source file, a full disk) propagate as
    ``OSError``.
    """

    def __init__(
        self,
        client: BaseClient,
        bucket: str,
        prefix: str = "",
        *,
        transfer: TransferSettings | None = None,
        retry: RetryPolicy | None = None,
        write: WriteSettings | None = None,
        stop_event: threading.Event | None = None,
        deadlines: DeadlineSettings | None = None,
        cancel_event: threading.Event | None = None,
    ) -> None:
        parse_s3_url(format_s3_url(bucket, prefix))  # validates bucket and prefix
        if prefix != prefix.strip("/"):
            raise ValueError(f"prefix must not start or end with '/': {prefix!r}")
        install_request_hooks(client)
        self._raw_client = client
        self._deadlines = deadlines if deadlines is not None else DeadlineSettings()
        self._client: Any = GuardedClient(
            client, self._deadlines, stop_event, cancel_event
        )  # per-request deadlines
        self._bucket, self._prefix, self._keys = bucket, prefix, PrefixKeys(prefix)
        self._transfer = transfer if transfer is not None else TransferSettings()
        self._retry = retry if retry is not None else RetryPolicy()
        self._write = write if write is not None else WriteSettings()
        self._stop_event = stop_event
        self._closed = False

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        client: BaseClient | None = None,
        transfer: TransferSettings | None = None,
        retry: RetryPolicy | None = None,
        write: WriteSettings | None = None,
        stop_event: threading.Event | None = None,
        deadlines: DeadlineSettings | None = None,
        **client_kwargs: Any,
    ) -> S3Store:
        """Store for ``s3://bucket/prefix``; builds a client with
        ``make_s3_client(**client_kwargs)`` if none is given. Raises ``ValueError`` on a bad URL."""
        bucket, prefix = parse_s3_url(url)
        if client is None:
            client = make_s3_client(**client_kwargs)
        elif client_kwargs:
            raise ValueError("client settings are ignored when a client is given")
        return cls(
            client,
            bucket,
            prefix,
            transfer=transfer,
            retry=retry,
            write=write,
            stop_event=stop_event,
            deadlines=deadlines,
        )

    # --- properties and helpers

    @property
    def client(self) -> BaseClient:  # for tools and tests; code above store/ never calls it
        return self._raw_client

    @property
    def bucket(self) -> str:
        return self._bucket

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def url(self) -> str:
        return format_s3_url(self._bucket, self._prefix)

    @property
    def transfer_settings(self) -> TransferSettings:
        return self._transfer

    @property
    def endpoint_url(self) -> str:
        return str(self._raw_client.meta.endpoint_url)

    def _describe(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _call(
        self,
        op_name: str,
        fn: Callable[[], T],
        *,
        is_retryable: Callable[[BaseException], bool] = is_retryable_s3_error,
        passthrough: tuple[type[BaseException], ...] = (),
        error: type[UploadError] = UploadError,
        planned_bytes: int = 0,
    ) -> T:
        """``fn`` under the store's retries and one time budget for all its attempts
        (:func:`~tiered_ckpt.store.deadline.operation_budget`; ``planned_bytes``: the bytes the
        operation is known to move, 0 when unknown)."""
        if self._closed:
            raise UploadError(f"{op_name}: store is closed")
        with operation_budget(self._deadlines, planned_bytes) as budget:
            return call_with_retries(  # local I/O (source file gone, disk full) stays an OSError
                op_name,
                fn,
                policy=self._retry,
                stop_event=self._stop_event,
                is_retryable=is_retryable,
                passthrough=(OSError, *passthrough),
                target=self.url,
                error=error,
                budget=budget,
            )

    # --- small objects

    def head(self, key: str) -> ObjectInfo | None:
        """HeadObject (``ChecksumMode=ENABLED``: ``ChecksumSHA256`` / ``ChecksumCRC32C`` as
        reported); ``None`` on 404. Raises ``UploadError``."""
        full_key = self._keys.full_key(key)
        return self._call(
            f"head {self._describe(key)}",
            lambda: objects.head_object(self._client, self._bucket, full_key, key),
        )

    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
        checksum_sha256_b64: str | None = None,
    ) -> ObjectInfo:
        """PutObject of ``data`` with ``ChecksumSHA256`` (ours unless ``checksum_sha256_b64`` is
        given).

        ``if_none_match=True`` sends ``If-None-Match: *`` (create only); ``if_match=etag`` sends
        ``If-Match`` (replace only that version, e.g. the ``latest`` pointer). A lost condition
        raises :class:`~tiered_ckpt.store.base.PreconditionFailedError` and is not retried. Caveat
        of retrying conditional writes: if a first attempt succeeded but its response was lost, the
        retry reports ``PreconditionFailedError`` although our own write won; callers of
        ``if_none_match`` with deterministic content should GET and compare before treating it as a
        conflict.

        Returns the PutObject response as ``ObjectInfo`` (``last_modified`` ``None``). Raises
        ``UploadError`` (after retries; a server-reported checksum that differs from the one sent is
        retried as :class:`~tiered_ckpt.errors.ShardCorruptedError`).
        """
        if if_none_match and if_match is not None:
            raise ValueError("if_none_match and if_match are mutually exclusive")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        full_key, what, payload = self._keys.full_key(key), self._describe(key), bytes(data)
        checksum = checksum_sha256_b64 if checksum_sha256_b64 is not None else sha256_b64(payload)
        return self._call(
            f"put {what}",
            lambda: objects.put_object(
                self._client,
                self._bucket,
                full_key,
                payload,
                checksum,
                self._write.extra_args(),
                key=key,
                what=what,
                if_none_match=if_none_match,
                if_match=if_match,
            ),
            planned_bytes=len(payload),
        )

    def get_bytes(self, key: str, *, max_bytes: int = DEFAULT_GET_MAX_BYTES) -> bytes:
        """GetObject of at most ``max_bytes`` bytes (the cap of the object's kind), without a Range
        (none past the end of an object: strict servers refuse one): a body announced over the cap
        is refused before it is read, and one that keeps coming is counted in 64 KiB chunks and
        refused as soon as it passes the cap. Raises :class:`~tiered_ckpt.errors.ManifestError`
        naming the object and the cap (not retried), ``RemoteNotFoundError`` on 404,
        ``UploadError`` otherwise (a deadline or stall after retries)."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        request: dict[str, str] = {"Bucket": self._bucket, "Key": self._keys.full_key(key)}
        what = self._describe(key)
        return self._call(
            f"get {what}",
            lambda: objects.get_object(self._client, request, what, max_bytes),
            passthrough=(ManifestError,),
        )  # no planned bytes: max_bytes is a cap; the budget follows Content-Length

    def read_sha256(
        self, key: str, *, stop_event: threading.Event | None = None, max_bytes: int | None = None
    ) -> tuple[int, str]:
        """Stream the object back (one GetObject of the whole object per attempt, 8 MiB chunks):
        ``(size_bytes, sha256_hex)``; with ``max_bytes`` (the planned size) it stops past it, or
        reads nothing of an object announced longer (a size over ``max_bytes`` returned). Raises
        ``RemoteNotFoundError``, ``OperationInterruptedError`` (a stop event set between chunks),
        ``UploadError``."""
        full_key, what = self._keys.full_key(key), self._describe(key)
        events = tuple(e for e in (stop_event, self._stop_event) if e is not None)
        planned = (
            self._client.planned_size(self._bucket, full_key, max_bytes)
            if max_bytes is not None
            else contextlib.nullcontext()
        )  # the request's deadline follows the planned size, not a length the server announces
        with planned:
            return self._call(
                f"read back {what}",
                lambda: objects.read_sha256(
                    self._client, self._bucket, full_key, what, events, max_bytes
                ),
                planned_bytes=max_bytes or 0,
            )

    # --- ranged reads

    def read_range_into(self, key: str, offset: int, out: memoryview, *, object_size: int) -> None:
        """See :meth:`ObjectStore.read_range_into`: one ranged GET per attempt
        (``objects.read_range_attempt``)."""
        full_key, what, events = (
            self._keys.full_key(key),
            self._describe(key),
            tuple(filter(None, [self._stop_event])),
        )
        self._call(
            f"get {what} bytes {offset}+{len(out)}",
            lambda: objects.read_range_attempt(
                self._client,
                bucket=self._bucket,
                full_key=full_key,
                what=what,
                offset=offset,
                out=out,
                object_size=object_size,
                stop_events=events,
            ),
            passthrough=(ObjectSizeError,),
            is_retryable=objects.download_retryable,
            planned_bytes=len(out),
        )

    # --- multipart uploads

    def plan_parts(self, size_bytes: int) -> list[int] | None:
        """Part sizes for ``size_bytes`` with this store's settings (as s3transfer plans them), or
        ``None`` below the multipart threshold."""
        return plan_part_sizes(
            size_bytes,
            multipart_threshold_bytes=self._transfer.multipart_threshold_bytes,
            part_size_bytes=self._transfer.part_size_bytes,
        )

    def create_multipart_upload(self, key: str, *, checksum_algorithm: str) -> str:
        """CreateMultipartUpload with this store's write settings; returns the upload id. A retried create
        whose first response was lost leaves that upload behind (swept as abandoned)."""
        full_key = self._keys.full_key(key)
        multipart.check_part_args(checksum_algorithm)
        return self._call(
            f"create multipart upload {self._describe(key)}",
            lambda: multipart.create(
                self._client,
                self._bucket,
                full_key,
                checksum_algorithm=checksum_algorithm,
                extra_args=self._write.extra_args(),
            ),
        )

    def upload_part(
        self,
        key: str,
        upload_id: str,
        part_number: int,
        data: bytes,
        *,
        checksum_algorithm: str,
        checksum_b64: str,
    ) -> UploadedPart:
        """UploadPart with its additional checksum; raises ``NoSuchUploadError`` (not retried)."""
        full_key, what = self._keys.full_key(key), self._describe(key)
        multipart.check_part_args(checksum_algorithm, part_number)
        return self._call(
            f"upload part {part_number} of {what}",
            lambda: multipart.upload_part(
                self._client,
                self._bucket,
                full_key,
                upload_id,
                part_number,
                data,
                checksum_algorithm=checksum_algorithm,
                checksum_b64=checksum_b64,
                what=what,
            ),
            planned_bytes=len(data),
        )

    def complete_multipart_upload(
        self, key: str, upload_id: str, parts: Sequence[UploadedPart]
    ) -> None:
        """CompleteMultipartUpload; raises ``NoSuchUploadError`` (not retried: HEAD the object to tell a
        lost response of our own completion from an upload aborted under us)."""
        full_key, what = self._keys.full_key(key), self._describe(key)
        self._call(
            f"complete multipart upload {upload_id} of {what}",
            lambda: multipart.complete(
                self._client, self._bucket, full_key, upload_id, parts, what=what
            ),
        )

    def list_multipart_uploads(self, prefix: str = "") -> Iterator[MultipartUploadInfo]:
        """ListMultipartUploads under ``prefix`` (paginated, one retried call per page); keys relative to
        the store prefix."""
        return multipart.iter_uploads(
            self._call, self._client, self._bucket, self._keys, prefix, self.url
        )

    def abort_multipart_upload(self, key: str, upload_id: str) -> bool:
        """AbortMultipartUpload; ``False`` if the upload no longer exists (``NoSuchUpload``/404)."""
        full_key = self._keys.full_key(key)
        return self._call(
            f"abort multipart upload {upload_id} of {self._describe(key)}",
            lambda: multipart.abort(self._client, self._bucket, full_key, upload_id),
        )

    # --- listing, cleanup

    def list_keys(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[str]:
        """ListObjectsV2, paginated (one retried call per page of up to ``page_size`` keys); yields keys
        relative to the store prefix. LIST may lag behind writes on some servers: confirm presence with
        :meth:`head`."""
        return objects.iter_keys(
            self._call, self._client, self._bucket, self._keys, prefix, page_size, self.url
        )

    def delete(self, keys: Iterable[str]) -> None:
        """DeleteObjects in batches of 1000 (missing keys are not an error). Per-key errors that are
        transient are retried for those keys only; others raise ``UploadError`` naming them. A server
        without DeleteObjects (501/405) gets one DeleteObject per key (``store/optional_apis.py``)."""
        full_keys = [self._keys.full_key(k) for k in keys]
        for start in range(0, len(full_keys), _DELETE_BATCH):
            batch = full_keys[
                start : start + _DELETE_BATCH
            ]  # without DeleteObjects: one DELETE per key
            optional_apis.delete_keys(
                self._call,
                self._client,
                self._bucket,
                batch,
                self.url,
                lambda b: objects.delete_batch(self._client, self._bucket, b),
                objects.is_retryable_delete_error,
            )

    # --- checksum probe, lifetime

    def server_validates_checksums(self) -> bool:
        """See :func:`~tiered_ckpt.store.probe.probe_checksum_validation` (cached per endpoint and bucket)."""
        return probe_checksum_validation(self)

    def run_checksum_probe(self, key_prefix: str = PROBE_KEY_PREFIX) -> bool:
        """Write one probe object under ``key_prefix`` with a wrong ``ChecksumSHA256`` (retried), delete it
        again (best effort, logged), and say whether the server validates; uncached (callers want
        :meth:`server_validates_checksums`). Raises ``UploadError``."""
        probe_key = f"{key_prefix}{uuid.uuid4().hex}"
        data = b"tiered_ckpt checksum probe " + uuid.uuid4().hex.encode("ascii")
        full_key = self._keys.full_key(probe_key)
        try:
            return self._call(
                f"checksum probe {self.url}",
                lambda: probe_once(
                    self._client, self._bucket, full_key, data, self._write.extra_args(), self.url
                ),
            )
        finally:
            try:
                self.delete([probe_key])
            except UploadError as exc:
                logger.warning(
                    "could not delete checksum probe %s/%s: %s", self.url, probe_key, exc
                )

    def close(self) -> None:
        """Mark the store closed (it holds no threads of its own). Idempotent."""
        self._closed = True

    def __enter__(self) -> S3Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint_url!r})"


# Re-exported for callers importing them from here; their homes: settings.py, client.py, probe.py.
__all__ = [
    "DEFAULT_GET_MAX_BYTES",
    "DeadlineSettings",
    "PROBE_KEY_PREFIX",
    "S3Store",
    "TransferSettings",
    "WriteSettings",
    "make_s3_client",
    "probe_checksum_validation",
]
