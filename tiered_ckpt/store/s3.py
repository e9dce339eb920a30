"""S3 implementation of :class:`~tiered_ckpt.store.base.ObjectStore`. The only module importing boto3,
botocore and s3transfer (STYLE item 5).

* :func:`make_s3_client` builds ONE botocore S3 client per remote, configured by boto3's usual chain
  (environment, profiles, ``AWS_ENDPOINT_URL``), with botocore's "standard" retries per HTTP call.
* :class:`S3Store` wraps every operation once in :func:`tiered_ckpt.retry.call_with_retries` (whole
  operation retries on top of botocore's; see that module for how they stack). Transfers go through
  s3transfer's ``TransferManager`` (multipart, concurrent parts, ranged GETs), one manager per direction
  per store, so concurrency is bounded per store.
* Integrity: uploads send SHA-256 additional checksums (``ChecksumAlgorithm=SHA256``; for a single PUT
  the digest we computed ourselves, for multipart uploads per part), so a validating server (AWS, MinIO)
  rejects damaged bytes; after the upload the store HEADs the object with ``ChecksumMode=ENABLED`` and
  raises :class:`~tiered_ckpt.errors.ShardCorruptedError` (retried) if the reported size or
  ``ChecksumSHA256`` differs from what was sent. A server that does not validate (moto) echoes the header
  it was sent, so a match proves nothing there: :func:`probe_checksum_validation` tells the caller
  whether it must read the object back.

Credentials are never logged: logs carry the endpoint, bucket and keys only.

Source: S3 API reference (PutObject, HeadObject, GetObject, ListObjectsV2, DeleteObjects,
ListMultipartUploads, AbortMultipartUpload, conditional writes with If-None-Match / If-Match),
s3transfer ``manager.py`` / ``upload.py`` / ``download.py``, botocore ``config.py``.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

import boto3
import botocore.client
from botocore.config import Config
from botocore.exceptions import ClientError
from s3transfer.exceptions import CancelledError as TransferCancelledError
from s3transfer.manager import TransferConfig, TransferManager
from s3transfer.subscribers import BaseSubscriber

from tiered_ckpt.errors import ShardCorruptedError, UploadError
from tiered_ckpt.retry import (
    OperationInterruptedError,
    RetryPolicy,
    call_with_retries,
    is_retryable_s3_error,
    s3_error_code_and_status,
)
from tiered_ckpt.store.base import (
    MultipartUploadInfo,
    ObjectInfo,
    PreconditionFailedError,
    ProgressCallback,
    RemoteNotFoundError,
    format_s3_url,
    parse_s3_url,
    validate_key,
)
from tiered_ckpt.store.checksums import (
    MAX_PART_SIZE_BYTES,
    MIN_PART_SIZE_BYTES,
    FileDigests,
    checksums_match,
    compute_file_digests,
    plan_part_sizes,
    sha256_b64,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
MiB = 1024 * 1024

_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound", "NoSuchBucket"})
_DIGEST_REJECTION_CODES = frozenset(
    {"BadDigest", "InvalidDigest", "InvalidRequest", "XAmzContentSHA256Mismatch", "XAmzContentChecksumMismatch"}
)
#: Where :func:`probe_checksum_validation` writes its probe object, under the store prefix.
PROBE_KEY_PREFIX = ".tiered_ckpt_probe/"
_DELETE_BATCH = 1000  # DeleteObjects accepts at most 1000 keys per request
_WAIT_POLL_S = 0.05


@dataclass(frozen=True)
class TransferSettings:
    """How s3transfer moves files.

    Uploads: a file of ``size >= multipart_threshold_bytes`` goes as a multipart upload in parts of
    ``part_size_bytes`` (S3: 5 MiB .. 5 GiB, at most 10,000 parts; s3transfer doubles the part size for
    huge files), ``max_concurrency`` parts in flight per store. Downloads: an object of
    ``size >= download_part_size_bytes`` is fetched with ranged GETs of that size,
    ``download_max_concurrency`` in flight. Large ranges suit servers where a ranged GET costs time in
    proportion to the whole object (moto); S3 and MinIO reach their throughput with parallel ranges.
    Raises ``ValueError`` on out-of-range values.
    """

    multipart_threshold_bytes: int = 64 * MiB
    part_size_bytes: int = 64 * MiB
    max_concurrency: int = 8
    download_part_size_bytes: int = 64 * MiB
    download_max_concurrency: int = 8

    def __post_init__(self) -> None:
        for name in (
            "multipart_threshold_bytes",
            "part_size_bytes",
            "max_concurrency",
            "download_part_size_bytes",
            "download_max_concurrency",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not MIN_PART_SIZE_BYTES <= self.part_size_bytes <= MAX_PART_SIZE_BYTES:
            raise ValueError(
                f"part_size_bytes must be in [{MIN_PART_SIZE_BYTES}, {MAX_PART_SIZE_BYTES}] (S3 limits), "
                f"got {self.part_size_bytes}"
            )
        if self.multipart_threshold_bytes > MAX_PART_SIZE_BYTES:
            raise ValueError(
                f"multipart_threshold_bytes must be <= {MAX_PART_SIZE_BYTES} (S3's single PUT limit), "
                f"got {self.multipart_threshold_bytes}"
            )
        if self.download_part_size_bytes < MiB:
            raise ValueError(f"download_part_size_bytes must be >= 1 MiB, got {self.download_part_size_bytes}")


_SSE_VALUES = frozenset({"AES256", "aws:kms", "aws:kms:dsse"})
_STORAGE_CLASS_RE = re.compile(r"^[A-Z][A-Z_]*$")


@dataclass(frozen=True)
class WriteSettings:
    """Optional S3 arguments applied to every object written (PutObject / CreateMultipartUpload).

    ``server_side_encryption``: ``"AES256"``, ``"aws:kms"`` or ``"aws:kms:dsse"``; ``sse_kms_key_id``
    only with a KMS value; ``storage_class``: e.g. ``"STANDARD"``, ``"INTELLIGENT_TIERING"``.
    Raises ``ValueError`` on other values.
    """

    server_side_encryption: str | None = None
    sse_kms_key_id: str | None = None
    storage_class: str | None = None

    def __post_init__(self) -> None:
        if self.server_side_encryption is not None and self.server_side_encryption not in _SSE_VALUES:
            raise ValueError(
                f"server_side_encryption must be one of {sorted(_SSE_VALUES)}, got {self.server_side_encryption!r}"
            )
        if self.sse_kms_key_id is not None:
            if not self.sse_kms_key_id:
                raise ValueError("sse_kms_key_id must not be empty")
            if self.server_side_encryption not in ("aws:kms", "aws:kms:dsse"):
                raise ValueError("sse_kms_key_id requires server_side_encryption='aws:kms' or 'aws:kms:dsse'")
        if self.storage_class is not None and not _STORAGE_CLASS_RE.match(self.storage_class):
            raise ValueError(f"storage_class must look like 'STANDARD', got {self.storage_class!r}")

    def extra_args(self) -> dict[str, str]:
        """The settings as S3 request parameters (``ServerSideEncryption``, ``SSEKMSKeyId``, ``StorageClass``)."""
        args: dict[str, str] = {}
        if self.server_side_encryption is not None:
            args["ServerSideEncryption"] = self.server_side_encryption
        if self.sse_kms_key_id is not None:
            args["SSEKMSKeyId"] = self.sse_kms_key_id
        if self.storage_class is not None:
            args["StorageClass"] = self.storage_class
        return args


def make_s3_client(
    *,
    endpoint_url: str | None = None,
    region_name: str | None = None,
    profile_name: str | None = None,
    path_style: bool = False,
    max_pool_connections: int = 32,
    botocore_max_attempts: int = 5,
    connect_timeout_s: float = 10.0,
    read_timeout_s: float = 60.0,
    request_checksum_calculation: str = "when_required",
    response_checksum_validation: str = "when_required",
    sign_payload: bool | None = False,
) -> botocore.client.BaseClient:
    """Create ONE S3 client; share it (botocore clients are thread-safe).

    Credentials, region and endpoint follow boto3's chain (arguments first, then ``AWS_*`` environment
    variables including ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, then ``AWS_PROFILE`` / config
    files, then instance metadata). ``botocore_max_attempts`` is botocore's per-HTTP-call attempt count in
    "standard" retry mode, the first try included (1 = botocore never retries; passed as botocore's
    ``total_max_attempts``); see ``tiered_ckpt.retry`` for how it stacks with ours. ``path_style=True`` is
    for MinIO and other servers without virtual-host buckets. ``max_pool_connections`` must cover the
    store's transfer concurrency (uploads + downloads).

    Checksums: ``request_checksum_calculation="when_required"`` keeps botocore from adding CRC32s the
    store did not ask for (and from switching to aws-chunked trailers that some S3-compatible servers
    reject); the store asks for SHA-256 explicitly. ``response_checksum_validation="when_required"``
    because callers verify SHA-256 themselves and moto reports multipart composite checksums without the
    ``-N`` suffix, which botocore would then misvalidate as a full-object checksum.

    ``sign_payload=False`` (S3's ``payload_signing_enabled``): requests are signed with
    ``X-Amz-Content-SHA256: UNSIGNED-PAYLOAD`` instead of a SHA-256 of the body. Over HTTPS botocore already
    does that for bodies that carry a checksum; over plain HTTP (MinIO in compose, moto) it would otherwise
    SHA-256 every part once more on the client, a third pass over every byte after the whole-file SHA-256
    and the part checksum. Integrity does not depend on it: every body the store and the uploader send
    carries an additional checksum (``ChecksumSHA256``/``ChecksumCRC32C``; DeleteObjects its required
    checksum), which a validating server checks, and a CompleteMultipartUpload list damaged in transit
    either names parts the server rejects or yields an object whose composite checksum differs from the
    one computed locally. ``None`` keeps botocore's default (sign over HTTP), ``True`` always signs.
    Raises ``ValueError`` on invalid settings (botocore's own validation).
    """
    if max_pool_connections < 1 or botocore_max_attempts < 1:
        raise ValueError("max_pool_connections and botocore_max_attempts must be >= 1")
    session = boto3.session.Session(profile_name=profile_name, region_name=region_name)
    config = Config(
        # total_max_attempts counts the first try; botocore's "max_attempts" key would count retries only.
        retries={"mode": "standard", "total_max_attempts": botocore_max_attempts},
        s3={"addressing_style": "path" if path_style else "auto",
            **({} if sign_payload is None else {"payload_signing_enabled": sign_payload})},
        max_pool_connections=max_pool_connections,
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        request_checksum_calculation=request_checksum_calculation,
        response_checksum_validation=response_checksum_validation,
        user_agent_extra="tiered-ckpt",
    )
    client = session.client("s3", endpoint_url=endpoint_url, config=config)
    logger.debug(
        "created S3 client: endpoint=%s region=%s path_style=%s pool=%d botocore_max_attempts=%d",
        client.meta.endpoint_url,
        client.meta.region_name,
        path_style,
        max_pool_connections,
        botocore_max_attempts,
    )
    return client


class _AttemptProgress(BaseSubscriber):
    """Forwards s3transfer progress to ``on_progress`` and can take back one attempt's bytes."""

    def __init__(self, on_progress: ProgressCallback | None) -> None:
        self._on_progress = on_progress
        self._lock = threading.Lock()
        self._sent = 0

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        with self._lock:
            self._sent += bytes_transferred
        if self._on_progress is not None:
            self._on_progress(bytes_transferred)

    def rollback(self) -> None:
        with self._lock:
            sent, self._sent = self._sent, 0
        if sent and self._on_progress is not None:
            self._on_progress(-sent)


def _code_status(exc: ClientError) -> tuple[str | None, int | None]:
    return s3_error_code_and_status(exc)


def _is_not_found(exc: ClientError) -> bool:
    code, status = _code_status(exc)
    return status == 404 or code in _NOT_FOUND_CODES


class _PartialDeleteError(Exception):
    """Internal: DeleteObjects reported per-key errors; ``retryable`` if all of them are transient."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def _is_retryable_delete_error(exc: BaseException) -> bool:
    if isinstance(exc, _PartialDeleteError):
        return exc.retryable
    return is_retryable_s3_error(exc)


def _is_retryable_upload_error(exc: BaseException) -> bool:
    # A multipart upload that vanished mid-flight (aborted by a cleanup, or completed by a request whose
    # response was lost and then retried by botocore) is fixed by uploading again from scratch.
    if isinstance(exc, ClientError) and _code_status(exc)[0] == "NoSuchUpload":
        return True
    return is_retryable_s3_error(exc)


class S3Store:
    """A prefix of an S3 bucket, speaking :class:`~tiered_ckpt.store.base.ObjectStore`.

    ``client``: a botocore S3 client (see :func:`make_s3_client`; injected, shared, never created per
    call). ``prefix``: keys are stored as ``<prefix>/<key>`` (no leading or trailing ``/``; ``""`` for the
    bucket root). ``stop_event``: once set, retries stop, waits are cut short and in-flight transfers are
    cancelled (an interrupted multipart upload is aborted by s3transfer), raising
    :class:`~tiered_ckpt.retry.OperationInterruptedError`.

    Every method is thread-safe and wrapped once in :func:`~tiered_ckpt.retry.call_with_retries`; errors
    that outlast the retries are :class:`~tiered_ckpt.errors.UploadError` with ``last_exception`` set.
    Local I/O errors (a missing source file, a full disk) propagate as ``OSError``.
    """

    def __init__(
        self,
        client: botocore.client.BaseClient,
        bucket: str,
        prefix: str = "",
        *,
        transfer: TransferSettings | None = None,
        retry: RetryPolicy | None = None,
        write: WriteSettings | None = None,
        stop_event: threading.Event | None = None,
    ) -> None:
        parse_s3_url(format_s3_url(bucket, prefix))  # validates bucket and prefix
        if prefix != prefix.strip("/"):
            raise ValueError(f"prefix must not start or end with '/': {prefix!r}")
        self._client = client
        self._bucket = bucket
        self._prefix = prefix
        self._transfer = transfer if transfer is not None else TransferSettings()
        self._retry = retry if retry is not None else RetryPolicy()
        self._write = write if write is not None else WriteSettings()
        self._stop_event = stop_event
        self._lock = threading.Lock()
        self._upload_manager: TransferManager | None = None
        self._download_manager: TransferManager | None = None
        self._closed = False

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        client: botocore.client.BaseClient | None = None,
        transfer: TransferSettings | None = None,
        retry: RetryPolicy | None = None,
        write: WriteSettings | None = None,
        stop_event: threading.Event | None = None,
        **client_kwargs: Any,
    ) -> S3Store:
        """Store for ``s3://bucket/prefix``; builds a client with ``make_s3_client(**client_kwargs)`` if
        none is given. Raises ``ValueError`` on a bad URL."""
        bucket, prefix = parse_s3_url(url)
        if client is None:
            client = make_s3_client(**client_kwargs)
        elif client_kwargs:
            raise ValueError("client settings are ignored when a client is given")
        return cls(client, bucket, prefix, transfer=transfer, retry=retry, write=write, stop_event=stop_event)

    # ----------------------------------------------------------------- properties and helpers

    @property
    def client(self) -> botocore.client.BaseClient:
        return self._client

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
        return str(self._client.meta.endpoint_url)

    def _full_key(self, key: str) -> str:
        validate_key(key)
        return f"{self._prefix}/{key}" if self._prefix else key

    def _full_prefix(self, prefix: str) -> str:
        if prefix:
            # "step_1/" and "step_" are both fine; validate without the trailing slash.
            validate_key(prefix[:-1] if prefix.endswith("/") else prefix)
        if not self._prefix:
            return prefix
        return f"{self._prefix}/{prefix}"

    def _relative(self, full_key: str) -> str:
        if not self._prefix:
            return full_key
        head = self._prefix + "/"
        if not full_key.startswith(head):
            raise UploadError(f"server returned key {full_key!r} outside prefix {self._prefix!r}")
        return full_key[len(head):]

    def _describe(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _call(
        self,
        op_name: str,
        fn: Callable[[], T],
        *,
        is_retryable: Callable[[BaseException], bool] = is_retryable_s3_error,
    ) -> T:
        if self._closed:
            raise UploadError(f"{op_name}: store is closed")
        return call_with_retries(
            op_name,
            fn,
            policy=self._retry,
            stop_event=self._stop_event,
            is_retryable=is_retryable,
            passthrough=(OSError,),  # local I/O (source file gone, disk full) is not an UploadError
        )

    def _managers(self) -> tuple[TransferManager, TransferManager]:
        with self._lock:
            if self._closed:
                raise UploadError(f"{self.url}: store is closed")
            if self._upload_manager is None:
                t = self._transfer
                self._upload_manager = TransferManager(
                    self._client,
                    TransferConfig(
                        multipart_threshold=t.multipart_threshold_bytes,
                        multipart_chunksize=t.part_size_bytes,
                        max_request_concurrency=t.max_concurrency,
                    ),
                )
                self._download_manager = TransferManager(
                    self._client,
                    TransferConfig(
                        multipart_threshold=t.download_part_size_bytes,
                        multipart_chunksize=t.download_part_size_bytes,
                        max_request_concurrency=t.download_max_concurrency,
                    ),
                )
            assert self._download_manager is not None
            return self._upload_manager, self._download_manager

    def _wait(self, future: Any, op_name: str) -> Any:
        """``future.result()``, cancelling the transfer if the stop event fires meanwhile."""
        if self._stop_event is None:
            return future.result()
        while not future.done():
            if self._stop_event.wait(_WAIT_POLL_S):
                future.cancel()
                try:
                    future.result()
                except TransferCancelledError as exc:
                    raise OperationInterruptedError(f"{op_name}: cancelled by stop event", last_exception=exc) from exc
                except Exception as exc:  # the transfer failed on its own before the cancel took
                    raise OperationInterruptedError(f"{op_name}: stopped after {exc!r}", last_exception=exc) from exc
                break
        return future.result()

    def _object_info(self, key: str, resp: dict[str, Any]) -> ObjectInfo:
        return ObjectInfo(
            key=key,
            size_bytes=int(resp["ContentLength"]),
            etag=str(resp["ETag"]),
            checksum_sha256=resp.get("ChecksumSHA256"),
            last_modified=resp.get("LastModified"),
        )

    def _head_once(self, key: str) -> ObjectInfo | None:
        try:
            resp = self._client.head_object(Bucket=self._bucket, Key=self._full_key(key), ChecksumMode="ENABLED")
        except ClientError as exc:
            if _is_not_found(exc):
                return None
            raise
        return self._object_info(key, resp)

    # ----------------------------------------------------------------- ObjectStore

    def head(self, key: str) -> ObjectInfo | None:
        """HeadObject (``ChecksumMode=ENABLED``); ``None`` on 404. Raises ``UploadError``."""
        return self._call(f"head {self._describe(key)}", lambda: self._head_once(key))

    def head_response(self, key: str) -> dict[str, Any] | None:
        """The raw HeadObject response (``ChecksumMode=ENABLED``), for checksums :class:`ObjectInfo` does
        not carry (``ChecksumCRC32C``, ...); ``None`` on 404. Same retries as :meth:`head`."""

        def op() -> dict[str, Any] | None:
            try:
                return dict(self._client.head_object(Bucket=self._bucket, Key=self._full_key(key),
                                                     ChecksumMode="ENABLED"))
            except ClientError as exc:
                if _is_not_found(exc):
                    return None
                raise

        return self._call(f"head {self._describe(key)}", op)

    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
        checksum_sha256_b64: str | None = None,
    ) -> ObjectInfo:
        """PutObject of ``data`` with ``ChecksumSHA256`` (ours unless ``checksum_sha256_b64`` is given).

        ``if_none_match=True`` sends ``If-None-Match: *`` (create only); ``if_match=etag`` sends
        ``If-Match`` (replace only that version, e.g. the ``latest`` pointer). A lost condition raises
        :class:`PreconditionFailedError` and is not retried. Caveat of retrying conditional writes: if a
        first attempt succeeded but its response was lost, the retry reports ``PreconditionFailedError``
        although our own write won; callers of ``if_none_match`` with deterministic content should GET
        and compare before treating it as a conflict.

        Returns the PutObject response as ``ObjectInfo`` (``last_modified`` ``None``). Raises
        ``UploadError`` (after retries; a server-reported checksum that differs from the one sent is
        retried as :class:`~tiered_ckpt.errors.ShardCorruptedError`).
        """
        if if_none_match and if_match is not None:
            raise ValueError("if_none_match and if_match are mutually exclusive")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        payload = bytes(data)
        full_key = self._full_key(key)
        checksum = checksum_sha256_b64 if checksum_sha256_b64 is not None else sha256_b64(payload)
        kwargs: dict[str, Any] = {
            "Bucket": self._bucket,
            "Key": full_key,
            "Body": payload,
            "ChecksumAlgorithm": "SHA256",
            "ChecksumSHA256": checksum,
            **self._write.extra_args(),
        }
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        conditional = if_none_match or if_match is not None

        def op() -> ObjectInfo:
            try:
                resp = self._client.put_object(**kwargs)
            except ClientError as exc:
                code, status = _code_status(exc)
                if conditional and (
                    status == 412 or code == "PreconditionFailed" or (if_match is not None and _is_not_found(exc))
                ):
                    raise PreconditionFailedError(
                        f"conditional put of {self._describe(key)} lost "
                        f"({'If-None-Match: *' if if_none_match else 'If-Match: ' + str(if_match)}): {code}",
                        last_exception=exc,
                    ) from exc
                raise
            reported = resp.get("ChecksumSHA256")
            if reported is not None and not checksums_match(reported, checksum):
                raise ShardCorruptedError(
                    f"{self._describe(key)}: server reports ChecksumSHA256 {reported}, sent {checksum}"
                )
            return ObjectInfo(
                key=key, size_bytes=len(payload), etag=str(resp["ETag"]), checksum_sha256=reported, last_modified=None
            )

        return self._call(f"put {self._describe(key)}", op)

    def file_digests(
        self, path: str | os.PathLike[str], *, on_progress: ProgressCallback | None = None
    ) -> FileDigests:
        """Read ``path`` once: its SHA-256 and the ``ChecksumSHA256`` :meth:`upload_file` will produce
        with this store's transfer settings. Raises ``OSError``."""
        return compute_file_digests(
            path,
            multipart_threshold_bytes=self._transfer.multipart_threshold_bytes,
            part_size_bytes=self._transfer.part_size_bytes,
            on_bytes=on_progress,
        )

    def upload_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        on_progress: ProgressCallback | None = None,
        expected_checksum_sha256_b64: str | None = None,
    ) -> ObjectInfo:
        """Upload ``path`` with s3transfer (multipart at or above the threshold, parts in parallel).

        Sends SHA-256 additional checksums: for a single PUT ``expected_checksum_sha256_b64`` itself (the
        server validates the body against *our* digest), for multipart uploads per part (botocore
        computes them from the bytes it sends). ``expected_checksum_sha256_b64`` is what
        :meth:`file_digests` returns for the file (computed here, one extra read, when not given). After
        completion the object is HEADed with ``ChecksumMode=ENABLED``; a size or reported checksum that
        differs from what was sent raises :class:`~tiered_ckpt.errors.ShardCorruptedError`, which is
        retried (a whole new upload). The returned ``ObjectInfo.checksum_sha256`` is ``None`` when the
        server reports no checksum: then nothing about the stored bytes was confirmed, read them back.
        On a server that does not validate checksums (see :func:`probe_checksum_validation`) a match is
        only an echo of what was sent, so the caller must read back there too.

        ``on_progress(delta_bytes)`` is called from transfer threads; a failed attempt's bytes are taken
        back with a negative delta before the retry. A failed or cancelled multipart upload is aborted
        by s3transfer. Raises ``UploadError``, ``OperationInterruptedError``, ``OSError`` (local file).
        """
        full_key = self._full_key(key)
        source = os.fspath(path)
        size = os.stat(source).st_size
        if expected_checksum_sha256_b64 is None:
            expected_checksum_sha256_b64 = self.file_digests(source).checksum_sha256_b64
        expected = expected_checksum_sha256_b64
        parts = plan_part_sizes(
            size,
            multipart_threshold_bytes=self._transfer.multipart_threshold_bytes,
            part_size_bytes=self._transfer.part_size_bytes,
        )
        extra_args: dict[str, Any] = {"ChecksumAlgorithm": "SHA256", **self._write.extra_args()}
        if parts is None:
            extra_args["ChecksumSHA256"] = expected
        op_name = f"upload {source} -> {self._describe(key)}"

        def op() -> ObjectInfo:
            upload_manager, _ = self._managers()
            progress = _AttemptProgress(on_progress)
            try:
                future = upload_manager.upload(
                    source, self._bucket, full_key, extra_args=dict(extra_args), subscribers=[progress]
                )
                self._wait(future, op_name)
                info = self._head_once(key)
                if info is None:
                    raise ShardCorruptedError(f"{self._describe(key)}: missing right after its upload completed")
                if info.size_bytes != size:
                    raise ShardCorruptedError(
                        f"{self._describe(key)}: server reports {info.size_bytes} bytes, sent {size}"
                    )
                if info.checksum_sha256 is not None and not checksums_match(info.checksum_sha256, expected):
                    raise ShardCorruptedError(
                        f"{self._describe(key)}: server reports ChecksumSHA256 {info.checksum_sha256}, "
                        f"expected {expected}"
                    )
            except BaseException:
                progress.rollback()
                raise
            logger.debug(
                "uploaded %s (%d bytes, %s, ChecksumSHA256 %s)",
                self._describe(key),
                size,
                f"{len(parts)} parts" if parts else "single PUT",
                info.checksum_sha256,
            )
            return info

        return self._call(op_name, op, is_retryable=_is_retryable_upload_error)

    def get_bytes(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        """GetObject; ``byte_range=(start, stop)`` fetches ``[start, stop)`` (a range running past the end
        is truncated by the server). Raises ``RemoteNotFoundError`` on 404, ``UploadError`` otherwise
        (416 ``InvalidRange`` for a start past the end)."""
        full_key = self._full_key(key)
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": full_key}
        if byte_range is not None:
            start, stop = byte_range
            if not 0 <= start < stop:
                raise ValueError(f"byte_range must be (start, stop) with 0 <= start < stop, got {byte_range!r}")
            kwargs["Range"] = f"bytes={start}-{stop - 1}"

        def op() -> bytes:
            try:
                resp = self._client.get_object(**kwargs)
            except ClientError as exc:
                if _is_not_found(exc):
                    raise RemoteNotFoundError(f"{self._describe(key)} does not exist", last_exception=exc) from exc
                raise
            body = resp["Body"]
            try:
                return bytes(body.read())
            finally:
                body.close()

        return self._call(f"get {self._describe(key)}", op)

    def download_file(
        self, key: str, dest_path: str | os.PathLike[str], *, on_progress: ProgressCallback | None = None
    ) -> int:
        """Download with s3transfer (ranged GETs per :class:`TransferSettings`) into a unique temp file in
        ``dest_path``'s directory, fsync it, ``os.replace`` it onto ``dest_path`` and fsync the directory.
        Nothing is left behind on failure. Returns the size in bytes. The bytes are NOT verified here
        (the caller compares them with its manifest). Raises ``RemoteNotFoundError`` (404),
        ``UploadError``, ``OperationInterruptedError``, ``OSError`` (local disk)."""
        full_key = self._full_key(key)
        dest = os.path.abspath(os.fspath(dest_path))
        directory, name = os.path.split(dest)
        op_name = f"download {self._describe(key)} -> {dest}"

        def op() -> int:
            _, download_manager = self._managers()
            progress = _AttemptProgress(on_progress)
            tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.download")
            try:
                with open(tmp, "wb") as f:
                    future = download_manager.download(self._bucket, full_key, f, subscribers=[progress])
                    try:
                        self._wait(future, op_name)
                    except ClientError as exc:
                        if _is_not_found(exc):
                            raise RemoteNotFoundError(
                                f"{self._describe(key)} does not exist", last_exception=exc
                            ) from exc
                        raise
                    f.flush()
                    os.fsync(f.fileno())
                size = os.stat(tmp).st_size
                os.replace(tmp, dest)
            except BaseException:
                progress.rollback()
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                raise
            _fsync_dir(directory)
            return size

        return self._call(op_name, op)

    def list_keys(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[str]:
        """ListObjectsV2, paginated (one retried call per page of up to ``page_size`` keys); yields keys
        relative to the store prefix. LIST may lag behind writes on some servers: confirm presence with
        :meth:`head`."""
        if not 1 <= page_size <= 1000:
            raise ValueError(f"page_size must be in [1, 1000], got {page_size}")
        full_prefix = self._full_prefix(prefix)
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self._bucket, "Prefix": full_prefix, "MaxKeys": page_size}
            if token is not None:
                kwargs["ContinuationToken"] = token
            resp = self._call(
                f"list {self.url}/{prefix}", lambda kwargs=kwargs: self._client.list_objects_v2(**kwargs)
            )
            for item in resp.get("Contents", []):
                yield self._relative(item["Key"])
            if not resp.get("IsTruncated"):
                return
            token = resp.get("NextContinuationToken")
            if not token:
                raise UploadError(f"list {self.url}/{prefix}: truncated page without a continuation token")

    def delete(self, keys: Iterable[str]) -> None:
        """DeleteObjects in batches of 1000 (missing keys are not an error). Per-key errors that are
        transient are retried for those keys only; others raise ``UploadError`` naming them."""
        full_keys = [self._full_key(k) for k in keys]
        for start in range(0, len(full_keys), _DELETE_BATCH):
            remaining = full_keys[start:start + _DELETE_BATCH]

            def op(batch: list[str] = remaining) -> None:
                resp = self._client.delete_objects(
                    Bucket=self._bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
                errors = resp.get("Errors") or []
                if not errors:
                    batch.clear()
                    return
                failed = {e.get("Key") for e in errors}
                batch[:] = [k for k in batch if k in failed]
                codes = sorted({str(e.get("Code")) for e in errors})
                retryable = all(
                    str(e.get("Code")) in ("SlowDown", "InternalError", "ServiceUnavailable") for e in errors
                )
                raise _PartialDeleteError(
                    f"{len(errors)} key(s) not deleted, codes {codes}, first {sorted(failed)[:3]}",
                    retryable=retryable,
                )

            self._call(
                f"delete {len(remaining)} key(s) under {self.url}", op, is_retryable=_is_retryable_delete_error
            )

    def list_multipart_uploads(self, prefix: str = "") -> Iterator[MultipartUploadInfo]:
        """ListMultipartUploads under ``prefix`` (paginated); keys relative to the store prefix."""
        full_prefix = self._full_prefix(prefix)
        key_marker: str | None = None
        upload_id_marker: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self._bucket, "Prefix": full_prefix}
            if key_marker is not None:
                kwargs["KeyMarker"] = key_marker
            if upload_id_marker is not None:
                kwargs["UploadIdMarker"] = upload_id_marker
            resp = self._call(
                f"list multipart uploads {self.url}/{prefix}",
                lambda kwargs=kwargs: self._client.list_multipart_uploads(**kwargs),
            )
            for item in resp.get("Uploads", []):
                yield MultipartUploadInfo(
                    key=self._relative(item["Key"]), upload_id=item["UploadId"], initiated=item.get("Initiated")
                )
            if not resp.get("IsTruncated"):
                return
            key_marker = resp.get("NextKeyMarker")
            upload_id_marker = resp.get("NextUploadIdMarker")
            if not key_marker:
                raise UploadError(f"list multipart uploads {self.url}/{prefix}: truncated page without a marker")

    def abort_multipart_upload(self, key: str, upload_id: str) -> bool:
        """AbortMultipartUpload; ``False`` if the upload no longer exists (``NoSuchUpload``/404)."""
        full_key = self._full_key(key)

        def op() -> bool:
            try:
                self._client.abort_multipart_upload(Bucket=self._bucket, Key=full_key, UploadId=upload_id)
            except ClientError as exc:
                if _code_status(exc)[0] == "NoSuchUpload" or _is_not_found(exc):
                    return False
                raise
            return True

        return self._call(f"abort multipart upload {upload_id} of {self._describe(key)}", op)

    def server_validates_checksums(self) -> bool:
        """See :func:`probe_checksum_validation` (cached per endpoint and bucket)."""
        return probe_checksum_validation(self)

    def close(self) -> None:
        """Shut down the transfer threads (waiting for running transfers). Idempotent."""
        with self._lock:
            self._closed = True
            managers = [m for m in (self._upload_manager, self._download_manager) if m is not None]
            self._upload_manager = self._download_manager = None
        for manager in managers:
            manager.shutdown()

    def __enter__(self) -> S3Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint_url!r})"


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_PROBE_CACHE: dict[tuple[str, str], bool] = {}
_PROBE_LOCK = threading.Lock()


def probe_checksum_validation(store: S3Store, *, refresh: bool = False) -> bool:
    """Whether the server behind ``store`` checks the SHA-256 additional checksums it is sent.

    PUTs a small probe object under ``<prefix>/.tiered_ckpt_probe/`` with a deliberately WRONG
    ``ChecksumSHA256``. A server that rejects it (400: ``BadDigest``, ``InvalidRequest``, ...) validates
    -> ``True`` (AWS S3, MinIO). A server that accepts it and then reports the digest of the bytes it
    really received also lets a comparison catch damage -> ``True``. A server that accepts it and echoes
    the wrong value, or reports none, validates nothing -> ``False`` (moto 5.2.1 echoes). The probe
    object is deleted either way. The answer is cached per (endpoint, bucket) for the process;
    ``refresh=True`` probes again. Raises ``UploadError`` if the probe cannot be written for another
    reason (e.g. 403).
    """
    cache_key = (store.endpoint_url, store.bucket)
    with _PROBE_LOCK:
        if not refresh and cache_key in _PROBE_CACHE:
            return _PROBE_CACHE[cache_key]
    probe_key = f"{PROBE_KEY_PREFIX}{uuid.uuid4().hex}"
    data = b"tiered_ckpt checksum probe " + uuid.uuid4().hex.encode("ascii")
    wrong = sha256_b64(data + b" (not these bytes)")
    client = store.client
    full_key = store._full_key(probe_key)

    def op() -> bool:
        try:
            client.put_object(
                Bucket=store.bucket,
                Key=full_key,
                Body=data,
                ChecksumAlgorithm="SHA256",
                ChecksumSHA256=wrong,
                **store._write.extra_args(),
            )
        except ClientError as exc:
            code, status = _code_status(exc)
            if status == 400 or code in _DIGEST_REJECTION_CODES:
                logger.debug("checksum probe rejected by %s (%s): server validates", store.url, code)
                return True
            raise
        resp = client.head_object(Bucket=store.bucket, Key=full_key, ChecksumMode="ENABLED")
        reported = resp.get("ChecksumSHA256")
        return reported is not None and checksums_match(reported, sha256_b64(data))

    try:
        validates = store._call(f"checksum probe {store.url}", op)
    finally:
        try:
            store.delete([probe_key])
        except UploadError as exc:
            logger.warning("could not delete checksum probe %s/%s: %s", store.url, probe_key, exc)
    logger.info(
        "server at %s %s SHA-256 checksums", store.endpoint_url, "validates" if validates else "does NOT validate"
    )
    with _PROBE_LOCK:
        _PROBE_CACHE[cache_key] = validates
    return validates


__all__ = [
    "PROBE_KEY_PREFIX",
    "S3Store",
    "TransferSettings",
    "WriteSettings",
    "make_s3_client",
    "probe_checksum_validation",
]
