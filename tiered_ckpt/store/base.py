"""The object-store interface everything above ``store/`` speaks, its value types and errors. Pure.

Keys are always relative to the store's prefix (``step_0000001234/rank_00000.safetensors``); the
store maps them to ``<prefix>/<key>`` in its bucket. Implementations:
:class:`tiered_ckpt.store.s3.S3Store`.

Lifecycle of one store (who calls what):

1. The driver (sidecar daemon / ``Uploader``, ``restore``, the CLI) builds ONE client and ONE store
   per remote URL and shares it between threads; every method is thread-safe.
2. The uploader's step thread calls :meth:`ObjectStore.server_validates_checksums` once (cached per
   bucket), then per shard, on a shard thread (``tiered_ckpt.remote.upload.transfer``):

   a. below :meth:`~ObjectStore.plan_parts`' threshold (``None``): one
   :meth:`~ObjectStore.put_bytes`
      with the body's ``checksum_sha256_b64``;
   b. otherwise a multipart upload: the shard thread calls
      :meth:`~ObjectStore.create_multipart_upload` (returns the upload id), part worker threads call
      :meth:`~ObjectStore.upload_part` once per part (each with its own checksum; returns an
      :class:`UploadedPart`), then the shard thread calls
      :meth:`~ObjectStore.complete_multipart_upload` with every part in order, or
      :meth:`~ObjectStore.abort_multipart_upload` on any failure in between (a crash leaves the
      upload for step 5);
   c. confirmation: :meth:`~ObjectStore.head` (size, and the checksum the server reports for the
      algorithm sent), or :meth:`~ObjectStore.read_sha256` (stream the object back and hash it)
      where the server does not validate checksums.

   Small JSON objects (confirmations, the upload manifest, the ``latest`` pointer) go through
   :meth:`~ObjectStore.put_bytes` (``if_none_match`` for the commit mark, ``if_match`` for
   ``latest``).
3. Restore reads the pointer with :meth:`~ObjectStore.get_bytes`, confirms objects with
   :meth:`~ObjectStore.head`, and on its download threads fetches every shard's parts with
   :meth:`~ObjectStore.read_range_into` into buffers it hashes and writes to a temp name it
   chose; restore (the local commit protocol) fsyncs and renames the file, never the store.
4. Cleanup (retention, the upload of one shard before it starts) uses
   :meth:`~ObjectStore.list_keys`, :meth:`~ObjectStore.delete`,
   :meth:`~ObjectStore.list_multipart_uploads` and :meth:`~ObjectStore.abort_multipart_upload`.
5. A restarted sidecar lists multipart uploads older than its cutoff
   (:meth:`~ObjectStore.list_multipart_uploads`) and aborts them.
6. The driver calls :meth:`~ObjectStore.close` at shutdown.

Every failure that outlasts the store's retries is an :class:`~tiered_ckpt.errors.UploadError`; the
typed ones below (:class:`PreconditionFailedError`, :class:`RemoteNotFoundError`,
:class:`NoSuchUploadError`) are never retried by the store. Local I/O errors stay ``OSError``.
"""

from __future__ import annotations

import datetime as _dt
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from tiered_ckpt.errors import ShardCorruptedError, UploadError
from tiered_ckpt.store.settings import TransferSettings

#: ``on_progress(delta_bytes)``: called from transfer threads (must be thread-safe); ``delta_bytes``
#: may be negative when a failed attempt's bytes are taken back before a retry.
ProgressCallback = Callable[[int], None]


class PreconditionFailedError(UploadError):
    """A conditional write lost: ``If-None-Match: *`` found an object, or ``If-Match`` saw another
    ETag (or no object). S3 answers 412 ``PreconditionFailed`` (404 ``NoSuchKey`` for ``If-Match``
    on a missing key); never retried."""


class RemoteNotFoundError(UploadError, FileNotFoundError):
    """The object (or bucket) does not exist: S3 404 / ``NoSuchKey`` / ``NoSuchBucket``."""

    def __init__(self, message: str, *, last_exception: BaseException | None = None) -> None:
        UploadError.__init__(self, message, last_exception=last_exception)

    def __str__(self) -> str:  # FileNotFoundError.__str__ would format errno/strerror
        return str(self.args[0]) if self.args else ""


class ObjectSizeError(ShardCorruptedError):
    """An object is not the size the caller planned (its HEAD says another, or its body runs past
    it: replaced after the HEAD, or a lying server). Never retried by the store."""


class NoSuchUploadError(UploadError):
    """The multipart upload no longer exists (S3 404 ``NoSuchUpload``): aborted by a cleanup, or
    completed by an earlier attempt of the same ``CompleteMultipartUpload`` whose response was lost.
    Never retried by the store; the caller decides (HEAD the object, or upload again from
    scratch)."""


#: S3 additional-checksum algorithms (``x-amz-checksum-<alg>``; response field ``Checksum<ALG>``).
CHECKSUM_ALGORITHMS = frozenset({"CRC32", "CRC32C", "CRC64NVME", "SHA1", "SHA256"})


def check_checksum_algorithm(algorithm: str) -> str:
    """Return ``algorithm`` if it is one of :data:`CHECKSUM_ALGORITHMS`; raise ``ValueError``
    otherwise."""
    if algorithm not in CHECKSUM_ALGORITHMS:
        raise ValueError(
            f"checksum algorithm must be one of {sorted(CHECKSUM_ALGORITHMS)}, got {algorithm!r}"
        )
    return algorithm


@dataclass(frozen=True)
class ObjectInfo:
    """What the server says about one object (S3 ``HeadObject`` / ``PutObject`` responses).

    ``key`` is relative to the store prefix. ``etag`` is opaque (quotes kept; never assume it is an
    MD5). ``checksum_sha256`` is the base64 ``ChecksumSHA256`` exactly as the server reports it,
    including the ``-N`` composite form of multipart uploads, or ``None`` when the server reports
    none. ``last_modified`` is ``None`` when the response does not carry it (``PutObject``).
    ``checksum_crc32c`` likewise (``ChecksumCRC32C``, composite ``-N`` form for multipart uploads
    sent with CRC32C part checksums), ``None`` when not reported.
    """

    key: str
    size_bytes: int
    etag: str
    checksum_sha256: str | None
    last_modified: _dt.datetime | None
    checksum_crc32c: str | None = None

    def reported_checksum(self, algorithm: str) -> str | None:
        """The checksum the server reported for ``algorithm`` (``"SHA256"`` or ``"CRC32C"``), or
        ``None``."""
        if algorithm == "SHA256":
            return self.checksum_sha256
        if algorithm == "CRC32C":
            return self.checksum_crc32c
        return None


@dataclass(frozen=True)
class MultipartUploadInfo:
    """One in-progress multipart upload (S3 ``ListMultipartUploads``); ``key`` relative to the
    prefix."""

    key: str
    upload_id: str
    initiated: _dt.datetime | None


@dataclass(frozen=True)
class UploadedPart:
    """One part of a multipart upload as the server accepted it (S3 ``UploadPart`` response), as
    :meth:`ObjectStore.complete_multipart_upload` must list it: ``part_number`` (1-based), the
    ``etag`` the server returned (opaque), and the additional checksum sent with the part
    (``checksum_algorithm`` from :data:`CHECKSUM_ALGORITHMS`, ``checksum_b64`` its base64 value)."""

    part_number: int
    etag: str
    checksum_algorithm: str
    checksum_b64: str


@runtime_checkable
class ObjectStore(Protocol):
    """A bucket prefix holding objects (lifecycle: module docstring). All methods are thread-safe;
    keys are relative to the prefix. Every method is retried by the store itself (see
    ``tiered_ckpt.retry``); what outlasts the retries is an
    :class:`~tiered_ckpt.errors.UploadError`."""

    @property
    def url(self) -> str:
        """``s3://bucket/prefix`` (no credentials), for logs and messages."""
        ...

    @property
    def prefix(self) -> str:
        """The key prefix every key is relative to (``""`` for a whole bucket), as in
        :attr:`url`."""
        ...

    @property
    def transfer_settings(self) -> TransferSettings:
        """Part sizes and concurrency of this store's multipart uploads and ranged downloads."""
        ...

    # --- small objects

    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
        checksum_sha256_b64: str | None = None,
    ) -> ObjectInfo:
        """Write a small object in one request; raises ``PreconditionFailedError`` on a lost
        condition."""
        ...

    def get_bytes(self, key: str, *, max_bytes: int = ...) -> bytes:
        """The object's bytes, at most ``max_bytes`` (the cap of the object's kind,
        ``tiered_ckpt.remote.limits``): a longer body is refused as it passes the cap
        (:class:`~tiered_ckpt.errors.ManifestError` naming the object and the cap, not retried).
        Raises ``RemoteNotFoundError``."""
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """The object's metadata with the checksums the server reports, or ``None`` if it does not
        exist."""
        ...

    def read_sha256(
        self, key: str, *, stop_event: threading.Event | None = None, max_bytes: int | None = None
    ) -> tuple[int, str]:
        """Stream the object once (bounded memory): ``(size_bytes, sha256_hex)`` of the bytes
        received; with ``max_bytes`` (bytes, the planned size) it reads no further than one chunk
        past it and the request's deadline follows it (a hostile server's endless body or huge
        announced length). A retried attempt restarts the hash. Raises ``RemoteNotFoundError``;
        ``OperationInterruptedError`` between chunks once ``stop_event`` (or the store's own stop
        event) is set."""
        ...

    def server_validates_checksums(self) -> bool:
        """Whether the server rejects bytes that do not match the checksum sent (learnt once per
        bucket)."""
        ...

    def read_range_into(self, key: str, offset: int, out: memoryview, *, object_size: int) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of the object (one ranged GET per attempt,
        read straight into ``out``; a truncated body or a stall retried). ``object_size`` (bytes, the planned
        size): an answer for another size or range raises :class:`ObjectSizeError` before any byte is read
        (never retried); never more than ``len(out)`` bytes are read. Raises ``RemoteNotFoundError``,
        ``UploadError``, ``OperationInterruptedError``, ``ValueError`` (a range outside ``object_size``)."""
        ...

    # --- multipart uploads

    def plan_parts(self, size_bytes: int) -> list[int] | None:
        """Part sizes (bytes, in order) of a multipart upload of ``size_bytes`` with this store's transfer
        settings, or ``None`` when the object goes as one PUT (below the multipart threshold)."""
        ...

    def create_multipart_upload(self, key: str, *, checksum_algorithm: str) -> str:
        """Start a multipart upload whose parts carry ``checksum_algorithm`` checksums (S3
        ``CreateMultipartUpload``, the store's write settings applied); returns the upload id. Every
        started upload must end in :meth:`complete_multipart_upload` or :meth:`abort_multipart_upload`."""
        ...

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
        """Send part ``part_number`` (1-based) with its additional checksum (a validating server rejects
        damaged bytes); thread-safe, parts may be sent concurrently and in any order. Raises
        :class:`NoSuchUploadError` when the upload is gone."""
        ...

    def complete_multipart_upload(
        self, key: str, upload_id: str, parts: Sequence[UploadedPart]
    ) -> None:
        """Assemble the object from ``parts`` (every part, ascending ``part_number``). Raises
        :class:`NoSuchUploadError` when the upload is gone (also when an earlier attempt of this call
        succeeded but its response was lost: HEAD the object to tell)."""
        ...

    def list_multipart_uploads(self, prefix: str = "") -> Iterator[MultipartUploadInfo]:
        """In-progress multipart uploads whose key starts with ``prefix``."""
        ...

    def abort_multipart_upload(self, key: str, upload_id: str) -> bool:
        """Abort one multipart upload; ``False`` if it was already gone."""
        ...

    # --- listing, cleanup

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        """Keys (relative to the store prefix) starting with ``prefix``, in S3's (lexical) order."""
        ...

    def delete(self, keys: Iterable[str]) -> None:
        """Delete objects (missing ones are fine)."""
        ...

    def close(self) -> None:
        """Release transfer threads; the store must not be used afterwards."""
        ...


_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def validate_key(key: str) -> str:
    """Return ``key`` if it is a usable relative key; raise ``ValueError`` otherwise.

    Rejected: empty keys, a leading ``/``, empty, ``.`` or ``..`` segments, control characters.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, got {key!r}")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in key):
        raise ValueError(f"object key contains a control character: {key!r}")
    segments = key.split("/")
    if any(seg in ("", ".", "..") for seg in segments[:-1]) or segments[-1] in ("", ".", ".."):
        raise ValueError(
            f"object key must be a relative path without empty, '.' or '..' parts: {key!r}"
        )
    return key


def _unsafe(ch: str) -> bool:
    """C0 controls, DEL, C1 controls (U+0080-U+009F), lone surrogates (not encodable as UTF-8) and
    the noncharacters U+FFFE/U+FFFF: what AWS's object key guidelines say to avoid and what no
    prefix of a checkpoint needs."""
    o = ord(ch)
    return o < 32 or 127 <= o <= 159 or 0xD800 <= o <= 0xDFFF or o in (0xFFFE, 0xFFFF)


def check_url_characters(url: str) -> None:
    """Refuse the first character of ``url`` that an S3 key cannot carry safely (see
    :func:`_unsafe`). Raises ``ValueError`` naming it (``U+000A``, escaped) and its 0-based
    position."""
    for i, ch in enumerate(url):
        if _unsafe(ch):
            raise ValueError(
                f"S3 URL has the character U+{ord(ch):04X} ({ch!r}) at position {i}, which an "
                f"object key cannot carry safely: {url!r}"
            )


def parse_s3_url(url: str) -> tuple[str, str]:
    """``"s3://bucket/some/prefix"`` -> ``("bucket", "some/prefix")``; ``"s3://bucket"`` -> ``("bucket", "")``.

    A trailing ``/`` is dropped. Raises ``ValueError`` for another scheme, a missing or invalid bucket
    name (S3 rules: 3-63 characters of ``a-z0-9.-``, starting and ending with a letter or digit, not an IP
    address), credentials, a port, a query or fragment, empty / ``.`` / ``..`` prefix segments, or a
    character an S3 key cannot carry safely (:func:`check_url_characters`), checked before parsing:
    :func:`urllib.parse.urlsplit` silently drops tab, CR and LF (WHATWG URL rules), which would name
    another prefix than the one typed.
    """
    if not isinstance(url, str):
        raise ValueError(f"S3 URL must be a string, got {type(url).__name__}")
    check_url_characters(url)
    parts = urlsplit(url)
    if parts.scheme != "s3":
        raise ValueError(f"not an s3:// URL: {url!r}")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise ValueError(f"S3 URL must not have a query or fragment: {url!r}")
    netloc = parts.netloc
    if "@" in netloc or ":" in netloc:
        raise ValueError(f"S3 URL must be s3://bucket/prefix (no credentials or port): {url!r}")
    bucket = netloc
    if not bucket:
        raise ValueError(f"S3 URL has no bucket: {url!r}")
    if (
        not _BUCKET_RE.match(bucket)
        or ".." in bucket
        or re.fullmatch(r"\d+\.\d+\.\d+\.\d+", bucket)
    ):
        raise ValueError(f"invalid S3 bucket name {bucket!r} in {url!r}")
    prefix = parts.path
    if prefix.startswith("/"):
        prefix = prefix[1:]
    if prefix.endswith("/"):
        prefix = prefix[:-1]
    if prefix:
        try:
            validate_key(prefix)
        except ValueError as exc:
            raise ValueError(f"invalid prefix in S3 URL {url!r}: {exc}") from None
    return bucket, prefix


def format_s3_url(bucket: str, prefix: str) -> str:
    """Inverse of :func:`parse_s3_url`."""
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


__all__ = [
    "CHECKSUM_ALGORITHMS",
    "MultipartUploadInfo",
    "NoSuchUploadError",
    "ObjectInfo",
    "ObjectSizeError",
    "ObjectStore",
    "PreconditionFailedError",
    "ProgressCallback",
    "RemoteNotFoundError",
    "UploadedPart",
    "check_checksum_algorithm",
    "format_s3_url",
    "parse_s3_url",
    "validate_key",
]
