"""Object storage behind a small interface (STYLE item 5).

``base`` (the :class:`ObjectStore` protocol, value types, errors, ``parse_s3_url``) and ``checksums``
(S3-style SHA-256 computed locally) are pure; ``s3`` is the only module that imports boto3 / botocore /
s3transfer, and is imported lazily here so that importing the interface does not load boto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiered_ckpt.store.base import (
    MultipartUploadInfo,
    ObjectInfo,
    ObjectStore,
    PreconditionFailedError,
    ProgressCallback,
    RemoteNotFoundError,
    format_s3_url,
    parse_s3_url,
    validate_key,
)
from tiered_ckpt.store.checksums import (
    FileDigests,
    checksums_match,
    composite_sha256_b64,
    compute_file_digests,
    plan_part_sizes,
    sha256_b64,
)

if TYPE_CHECKING:
    from tiered_ckpt.store.s3 import (
        S3Store,
        TransferSettings,
        WriteSettings,
        make_s3_client,
        probe_checksum_validation,
    )

_S3_NAMES = frozenset(
    {"S3Store", "TransferSettings", "WriteSettings", "make_s3_client", "probe_checksum_validation"}
)


def __getattr__(name: str) -> Any:
    if name in _S3_NAMES:
        from tiered_ckpt.store import s3

        return getattr(s3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FileDigests",
    "MultipartUploadInfo",
    "ObjectInfo",
    "ObjectStore",
    "PreconditionFailedError",
    "ProgressCallback",
    "RemoteNotFoundError",
    "S3Store",
    "TransferSettings",
    "WriteSettings",
    "checksums_match",
    "composite_sha256_b64",
    "compute_file_digests",
    "format_s3_url",
    "make_s3_client",
    "parse_s3_url",
    "plan_part_sizes",
    "probe_checksum_validation",
    "sha256_b64",
    "validate_key",
]
