"""Single-attempt S3 multipart calls for :class:`~tiered_ckpt.store.s3.S3Store` (the operations of
:class:`~tiered_ckpt.store.base.ObjectStore`'s lifecycle step 2b). One request each; the store wraps
them in its retries and maps keys. ``NoSuchUpload`` becomes
:class:`~tiered_ckpt.store.base.NoSuchUploadError` (never retried: the upload is gone); a server
without ListMultipartUploads or AbortMultipartUpload (501/405) raises
:class:`~tiered_ckpt.store.optional_apis.OperationNotSupportedError`. No boto import (errors
classified as in ``store/objects.py``).

Source: S3 API reference (CreateMultipartUpload with ``ChecksumAlgorithm``, UploadPart with
``Checksum<ALG>``, CompleteMultipartUpload, AbortMultipartUpload, ListMultipartUploads).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from tiered_ckpt.errors import RemoteListError
from tiered_ckpt.retry import is_retryable_s3_error, s3_error_code_and_status
from tiered_ckpt.store.base import (
    MultipartUploadInfo,
    NoSuchUploadError,
    UploadedPart,
    check_checksum_algorithm,
)
from tiered_ckpt.store.keys import PrefixKeys
from tiered_ckpt.store.objects import RetriedCall, is_not_found
from tiered_ckpt.store.optional_apis import (
    ABORT_MULTIPART_UPLOAD,
    LIST_MULTIPART_UPLOADS,
    call_optional,
)

if TYPE_CHECKING:
    from botocore.client import BaseClient

#: S3 numbers parts 1 .. 10,000.
MAX_PARTS = 10_000


def is_no_such_upload(exc: BaseException) -> bool:
    """``exc`` is a botocore ``ClientError`` with code ``NoSuchUpload``."""
    return s3_error_code_and_status(exc)[0] == "NoSuchUpload"


def check_part_args(checksum_algorithm: str, part_number: int = 1) -> None:
    """Raise ``ValueError`` (before any request) for an unknown algorithm or a part number outside
    S3's 1 .. 10,000."""
    check_checksum_algorithm(checksum_algorithm)
    if (
        isinstance(part_number, bool)
        or not isinstance(part_number, int)
        or not 1 <= part_number <= MAX_PARTS
    ):
        raise ValueError(f"part_number must be an int in [1, {MAX_PARTS}], got {part_number!r}")


def _gone(exc: BaseException, what: str, upload_id: str) -> NoSuchUploadError:
    return NoSuchUploadError(
        f"{what}: multipart upload {upload_id} no longer exists", last_exception=exc
    )


def create(
    client: BaseClient,
    bucket: str,
    full_key: str,
    *,
    checksum_algorithm: str,
    extra_args: Mapping[str, str],
) -> str:
    """CreateMultipartUpload; returns the upload id."""
    resp = client.create_multipart_upload(
        Bucket=bucket, Key=full_key, ChecksumAlgorithm=checksum_algorithm, **extra_args
    )
    return str(resp["UploadId"])


def upload_part(
    client: BaseClient,
    bucket: str,
    full_key: str,
    upload_id: str,
    part_number: int,
    data: bytes,
    *,
    checksum_algorithm: str,
    checksum_b64: str,
    what: str,
) -> UploadedPart:
    """UploadPart with ``Checksum<ALG>=checksum_b64``; raises ``NoSuchUploadError`` when the upload
    is gone."""
    try:
        resp = client.upload_part(
            Bucket=bucket,
            Key=full_key,
            UploadId=upload_id,
            PartNumber=part_number,
            Body=data,
            ChecksumAlgorithm=checksum_algorithm,
            **{f"Checksum{checksum_algorithm}": checksum_b64},
        )
    except Exception as exc:
        if is_no_such_upload(exc):
            raise _gone(exc, what, upload_id) from exc
        raise
    return UploadedPart(part_number, str(resp["ETag"]), checksum_algorithm, checksum_b64)


def complete(
    client: BaseClient,
    bucket: str,
    full_key: str,
    upload_id: str,
    parts: Sequence[UploadedPart],
    *,
    what: str,
) -> None:
    """CompleteMultipartUpload listing every part with its checksum; ``NoSuchUploadError`` when
    gone."""
    listed = [
        {
            "PartNumber": p.part_number,
            "ETag": p.etag,
            f"Checksum{p.checksum_algorithm}": p.checksum_b64,
        }
        for p in parts
    ]
    try:
        client.complete_multipart_upload(
            Bucket=bucket, Key=full_key, UploadId=upload_id, MultipartUpload={"Parts": listed}
        )
    except Exception as exc:
        if is_no_such_upload(exc):
            raise _gone(exc, what, upload_id) from exc
        raise


def abort(client: BaseClient, bucket: str, full_key: str, upload_id: str) -> bool:
    """AbortMultipartUpload; ``False`` if the upload no longer exists (``NoSuchUpload``/404). Raises
    :class:`~tiered_ckpt.store.optional_apis.OperationNotSupportedError` where the server lacks the
    operation (501/405, learnt once per endpoint and bucket; no request once known)."""

    def once() -> bool:
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=full_key, UploadId=upload_id)
        except Exception as exc:
            if is_no_such_upload(exc) or is_not_found(exc):
                return False
            raise
        return True

    return call_optional(
        client, bucket, ABORT_MULTIPART_UPLOAD, f"abort multipart upload {upload_id}", once
    )


def list_uploads_page(
    client: BaseClient,
    bucket: str,
    full_prefix: str,
    key_marker: str | None,
    upload_id_marker: str | None,
) -> tuple[list[tuple[str, str, _dt.datetime | None]], bool, str | None, str | None]:
    """One ListMultipartUploads page: ``([(full key, upload id, initiated)], is_truncated, next key
    marker, next upload id marker)``. Raises ``OperationNotSupportedError`` where the server lacks
    the operation (501/405; no request once known)."""
    kwargs: dict[str, str] = {"Bucket": bucket, "Prefix": full_prefix}
    if key_marker is not None:
        kwargs["KeyMarker"] = key_marker
    if upload_id_marker is not None:
        kwargs["UploadIdMarker"] = upload_id_marker
    resp = call_optional(
        client,
        bucket,
        LIST_MULTIPART_UPLOADS,
        f"list multipart uploads under {full_prefix!r}",
        lambda: client.list_multipart_uploads(**kwargs),
    )
    uploads = [
        (item["Key"], item["UploadId"], item.get("Initiated")) for item in resp.get("Uploads", [])
    ]
    return (
        uploads,
        bool(resp.get("IsTruncated")),
        resp.get("NextKeyMarker"),
        resp.get("NextUploadIdMarker"),
    )


def is_retryable_upload_error(exc: BaseException) -> bool:
    """Retry predicate of a whole-file upload: a multipart upload that vanished mid-flight (aborted
    by a cleanup, or completed by a request whose response was lost and then retried by botocore) is
    fixed by uploading again from scratch; otherwise
    :func:`~tiered_ckpt.retry.is_retryable_s3_error`."""
    return is_no_such_upload(exc) or is_retryable_s3_error(exc)


def iter_uploads(
    call: RetriedCall, client: BaseClient, bucket: str, keys: PrefixKeys, prefix: str, url: str
) -> Iterator[MultipartUploadInfo]:
    """In-progress uploads under ``prefix`` (keys relative), page after page (a generator; each page
    one ``call``).
    Raises :class:`~tiered_ckpt.errors.RemoteListError` when a page fails after the retries, or is
    truncated without a marker or with the markers it was asked with,
    :class:`~tiered_ckpt.store.optional_apis.OperationNotSupportedError` (an ``UploadError``) where
    the server does not implement ListMultipartUploads (warned once per endpoint and bucket)."""
    full_prefix = keys.full_prefix(prefix)
    key_marker: str | None = None
    upload_id_marker: str | None = None
    while True:
        sent = (key_marker, upload_id_marker)
        uploads, truncated, key_marker, upload_id_marker = call(
            f"list multipart uploads {url}/{prefix}",
            lambda k=key_marker, u=upload_id_marker: list_uploads_page(
                client, bucket, full_prefix, k, u
            ),
            error=RemoteListError,
        )
        for full_key, upload_id, initiated in uploads:
            yield MultipartUploadInfo(
                key=keys.relative(full_key), upload_id=upload_id, initiated=initiated
            )
        if not truncated:
            return
        if not key_marker:
            raise RemoteListError(
                f"listing the multipart uploads under {url}/{prefix} failed: the server sent a "
                "truncated page without a marker"
            )
        if (
            key_marker,
            upload_id_marker,
        ) == sent:  # a server ignoring the markers: the same page for ever
            raise RemoteListError(
                f"listing the multipart uploads under {url}/{prefix} failed: the server sent back "
                "the markers it was sent (the same page for ever)"
            )


__all__ = [
    "MAX_PARTS",
    "abort",
    "check_part_args",
    "complete",
    "create",
    "is_no_such_upload",
    "is_retryable_upload_error",
    "iter_uploads",
    "list_uploads_page",
    "upload_part",
]
