"""Object storage behind a small interface (STYLE item 5): the face of ``store/``.

Everything above ``store/`` speaks :class:`ObjectStore` (``base.py``: the protocol with its numbered
lifecycle, value types, errors, ``parse_s3_url``) and never a boto3 client. Modules:

* pure (no boto3 / botocore import): ``base`` (interface), ``checksums`` (S3-style
  SHA-256 and CRC32C computed locally), ``settings`` (:class:`TransferSettings`,
  :class:`WriteSettings`);
* the S3 implementation: ``s3`` (:class:`S3Store`: key mapping and the store's retries around every
  call), with its single attempts in ``objects`` (head / put / get / ranged get / list / delete / read-back) and
  ``multipart`` (create / part / complete / abort / list), which classify botocore errors by their
  structured response and import no boto module, and ``probe`` (does the server validate checksums);
* the only module importing boto's libraries: ``client`` (boto3 and botocore:
  :func:`make_s3_client`).

The boto-backed names (:class:`S3Store`, :func:`make_s3_client`, :func:`probe_checksum_validation`)
are loaded lazily here, so that importing the interface does not load boto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiered_ckpt.store.base import (
    CHECKSUM_ALGORITHMS,
    MultipartUploadInfo,
    NoSuchUploadError,
    ObjectInfo,
    ObjectStore,
    PreconditionFailedError,
    ProgressCallback,
    RemoteNotFoundError,
    UploadedPart,
    format_s3_url,
    parse_s3_url,
    validate_key,
)
from tiered_ckpt.store.checksums import (
    checksums_match,
    composite_sha256_b64,
    plan_part_sizes,
    sha256_b64,
)
from tiered_ckpt.store.settings import TransferSettings, WriteSettings

if TYPE_CHECKING:
    from tiered_ckpt.store.client import ensure_bucket, make_s3_client
    from tiered_ckpt.store.probe import probe_checksum_validation
    from tiered_ckpt.store.s3 import S3Store

_LAZY = {
    "S3Store": "tiered_ckpt.store.s3",
    "ensure_bucket": "tiered_ckpt.store.client",
    "make_s3_client": "tiered_ckpt.store.client",
    "probe_checksum_validation": "tiered_ckpt.store.probe",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CHECKSUM_ALGORITHMS",
    "MultipartUploadInfo",
    "NoSuchUploadError",
    "ObjectInfo",
    "ObjectStore",
    "PreconditionFailedError",
    "ProgressCallback",
    "RemoteNotFoundError",
    "S3Store",
    "TransferSettings",
    "UploadedPart",
    "WriteSettings",
    "checksums_match",
    "composite_sha256_b64",
    "ensure_bucket",
    "format_s3_url",
    "make_s3_client",
    "parse_s3_url",
    "plan_part_sizes",
    "probe_checksum_validation",
    "sha256_b64",
    "validate_key",
]
