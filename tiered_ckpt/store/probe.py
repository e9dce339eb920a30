"""Does the server check the additional checksums it is sent? Learnt once per (endpoint, bucket) and
process, by writing a probe object with a deliberately wrong ``ChecksumSHA256``.

Why it matters: AWS S3 and MinIO reject a body whose checksum header does not match (so a match
after an upload proves the bytes arrived intact); moto 5.2.1 stores and echoes the header it was
sent, so a match proves nothing there and the uploader must read the object back. No boto import
(errors classified as in ``store/objects.py``).

Source: S3 API reference ("Checking object integrity": ``x-amz-checksum-sha256``, 400
``BadDigest``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from tiered_ckpt.layout import PROBE_KEY_PREFIX
from tiered_ckpt.retry import s3_error_code_and_status
from tiered_ckpt.store.checksums import checksums_match, sha256_b64

if TYPE_CHECKING:
    from botocore.client import BaseClient

logger = logging.getLogger(__name__)

#: Where :func:`probe_checksum_validation` writes its probe object, under the store prefix.
_DIGEST_REJECTION_CODES = frozenset(
    {
        "BadDigest",
        "InvalidDigest",
        "InvalidRequest",
        "XAmzContentSHA256Mismatch",
        "XAmzContentChecksumMismatch",
    }
)
_PROBE_CACHE: dict[tuple[str, str], bool] = {}
_PROBE_LOCK = threading.Lock()


class ProbedStore(Protocol):
    """What :func:`probe_checksum_validation` needs of a store
    (:class:`~tiered_ckpt.store.s3.S3Store`; a protocol here so that this module does not import
    ``s3.py``, which imports it)."""

    @property
    def endpoint_url(self) -> str: ...

    @property
    def bucket(self) -> str: ...

    def run_checksum_probe(self, key_prefix: str = PROBE_KEY_PREFIX) -> bool: ...


def probe_once(
    client: BaseClient,
    bucket: str,
    full_key: str,
    data: bytes,
    extra_args: Mapping[str, str],
    url: str,
) -> bool:
    """One attempt: PUT ``data`` with a wrong ``ChecksumSHA256``; ``True`` if the server rejects it
    (400 or a digest error code) or accepts it but then reports the digest of the bytes it really
    received."""
    wrong = sha256_b64(data + b" (not these bytes)")
    try:
        client.put_object(
            Bucket=bucket,
            Key=full_key,
            Body=data,
            ChecksumAlgorithm="SHA256",
            ChecksumSHA256=wrong,
            **extra_args,
        )
    except Exception as exc:
        code, status = s3_error_code_and_status(exc)
        if status == 400 or code in _DIGEST_REJECTION_CODES:
            logger.debug("checksum probe rejected by %s (%s): server validates", url, code)
            return True
        raise
    resp = client.head_object(Bucket=bucket, Key=full_key, ChecksumMode="ENABLED")
    reported = resp.get("ChecksumSHA256")
    return reported is not None and checksums_match(reported, sha256_b64(data))


def probe_checksum_validation(store: ProbedStore, *, refresh: bool = False) -> bool:
    """Whether the server behind ``store`` checks the SHA-256 additional checksums it is sent.

    PUTs a small probe object under ``<prefix>/.tiered_ckpt_probe/`` with a deliberately WRONG
    ``ChecksumSHA256``. A server that rejects it (400: ``BadDigest``, ``InvalidRequest``, ...)
    validates -> ``True`` (AWS S3, MinIO). A server that accepts it and then reports the digest of
    the bytes it really received also lets a comparison catch damage -> ``True``. A server that
    accepts it and echoes the wrong value, or reports none, validates nothing -> ``False`` (moto
    5.2.1 echoes). The probe object is deleted either way. The answer is cached per (endpoint,
    bucket) for the process; ``refresh=True`` probes again. Raises ``UploadError`` if the probe
    cannot be written for another reason (e.g. 403).
    """
    cache_key = (store.endpoint_url, store.bucket)
    with _PROBE_LOCK:
        if not refresh and cache_key in _PROBE_CACHE:
            return _PROBE_CACHE[cache_key]
    validates = store.run_checksum_probe(PROBE_KEY_PREFIX)
    logger.info(
        "server at %s %s SHA-256 checksums",
        store.endpoint_url,
        "validates" if validates else "does NOT validate",
    )
    with _PROBE_LOCK:
        _PROBE_CACHE[cache_key] = validates
    return validates


__all__ = ["PROBE_KEY_PREFIX", "ProbedStore", "probe_checksum_validation", "probe_once"]
