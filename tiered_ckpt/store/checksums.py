"""S3-style SHA-256 and CRC32C checksums computed locally, so what the server reports can be
compared with what was sent.

Pure apart from reading a local file; no boto3.

What S3 reports as ``ChecksumSHA256`` (``HeadObject`` with ``ChecksumMode=ENABLED``), when the
object was written with ``ChecksumAlgorithm=SHA256``:

* single ``PutObject``: ``base64(sha256(body))`` (a FULL_OBJECT checksum);
* multipart upload: ``base64(sha256(d_1 || d_2 || ... || d_n)) + "-n"`` where ``d_i`` is the raw
  32-byte SHA-256 of part ``i`` (a COMPOSITE checksum, "checksum of checksums").

The same composite rule holds for the other algorithms; the uploader's multipart uploads use CRC32C
(``ChecksumAlgorithm=CRC32C``): ``base64(crc32c(c_1 || ... || c_n)) + "-n"`` where ``c_i`` is the
4-byte big-endian CRC32C of part ``i`` (:func:`composite_crc32c_b64`).

Observed on moto 5.2.1 (tests/test_store_s3.py pins this): the single-PUT value is whatever the
client put in the ``x-amz-checksum-sha256`` header (moto echoes it, even when it is wrong for the
body), and for multipart uploads moto reports the composite value *without* the ``-n`` suffix.
:func:`checksums_match` therefore compares the base64 part and the part count only when both sides
carry one.

How s3transfer splits a file (``s3transfer.upload``/``utils.ChunksizeAdjuster``, reproduced by
:func:`plan_part_sizes`): a file of ``size >= multipart_threshold`` is uploaded in parts of
``part_size`` bytes (the last one shorter), where ``part_size`` is first doubled until there are at
most 10,000 parts and then clamped to [5 MiB, 5 GiB]; a smaller file goes in one ``PutObject``.

Source: AWS S3 user guide, "Checking object integrity" (composite checksums of multipart uploads).
"""

from __future__ import annotations

import base64
import hashlib
import math
from collections.abc import Sequence

import google_crc32c

MiB = 1024 * 1024
GiB = 1024 * MiB
#: S3 limits on multipart uploads (AWS "Amazon S3 multipart upload limits"), as s3transfer applies
#: them.
MIN_PART_SIZE_BYTES = 5 * MiB
MAX_PART_SIZE_BYTES = 5 * GiB
MAX_PARTS = 10_000


def sha256_b64(data: bytes) -> str:
    """``base64(sha256(data))``, the form S3 uses for ``ChecksumSHA256`` of a single PUT."""
    return base64.b64encode(hashlib.sha256(data).digest()).decode("ascii")


def composite_sha256_b64(part_digests: Sequence[bytes]) -> str:
    """S3's composite checksum of a multipart upload: ``base64(sha256(concat(digests))) + f"-{n}"``.

    ``part_digests`` are the raw 32-byte SHA-256 digests of the parts, in part-number order. Raises
    ``ValueError`` on an empty list or a digest that is not 32 bytes.
    """
    if not part_digests:
        raise ValueError("a multipart upload has at least one part")
    for i, digest in enumerate(part_digests):
        if len(digest) != 32:
            raise ValueError(f"part {i + 1}: a SHA-256 digest is 32 bytes, got {len(digest)}")
    combined = hashlib.sha256(b"".join(part_digests)).digest()
    return f"{base64.b64encode(combined).decode('ascii')}-{len(part_digests)}"


def crc32c_b64(data: bytes) -> str:
    """``base64(crc32c(data))`` (4 bytes, big-endian), the form S3 uses for ``ChecksumCRC32C``."""
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode("ascii")


def composite_crc32c_b64(part_crcs: Sequence[bytes]) -> str:
    """S3's composite CRC32C of a multipart upload: ``base64(crc32c(concat(crcs))) + f"-{n}"``.

    ``part_crcs`` are the 4-byte big-endian CRC32Cs of the parts, in part-number order. Raises
    ``ValueError`` on an empty list or a value that is not 4 bytes.
    """
    if not part_crcs:
        raise ValueError("a multipart upload has at least one part")
    for i, crc in enumerate(part_crcs):
        if len(crc) != 4:
            raise ValueError(f"part {i + 1}: a CRC32C is 4 bytes, got {len(crc)}")
    return f"{crc32c_b64(b''.join(part_crcs))}-{len(part_crcs)}"


def split_checksum(value: str) -> tuple[str, int | None]:
    """``("base64", n)`` for ``"base64-n"``, ``("base64", None)`` for a value without a part
    count."""
    base, sep, count = value.rpartition("-")
    if sep and count.isdigit() and base:
        return base, int(count)
    return value, None


def checksums_match(reported: str, expected: str) -> bool:
    """Whether a server-reported checksum (``ChecksumSHA256``, ``ChecksumCRC32C``, ...) agrees with
    the locally computed ``expected``.

    The base64 digests must be equal; the ``-n`` part counts are compared only when both carry one
    (moto omits it, AWS includes it).
    """
    reported_base, reported_parts = split_checksum(reported)
    expected_base, expected_parts = split_checksum(expected)
    if reported_base != expected_base:
        return False
    return reported_parts is None or expected_parts is None or reported_parts == expected_parts


def plan_part_sizes(
    size_bytes: int, *, multipart_threshold_bytes: int, part_size_bytes: int
) -> list[int] | None:
    """Sizes of the parts s3transfer will send for a file of ``size_bytes``; ``None`` for a single
    PUT.

    Mirrors s3transfer 0.17 (``size >= multipart_threshold`` means multipart;
    ``ChunksizeAdjuster``). Raises ``ValueError`` on negative or non-positive arguments.
    """
    if size_bytes < 0:
        raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
    if part_size_bytes <= 0 or multipart_threshold_bytes < 0:
        raise ValueError("part_size_bytes must be > 0 and multipart_threshold_bytes >= 0")
    if size_bytes < multipart_threshold_bytes:
        return None
    chunk = part_size_bytes
    while math.ceil(size_bytes / chunk) > MAX_PARTS:
        chunk *= 2
    chunk = min(max(chunk, MIN_PART_SIZE_BYTES), MAX_PART_SIZE_BYTES)
    n_parts = max(1, math.ceil(size_bytes / chunk))
    sizes = [chunk] * (n_parts - 1)
    sizes.append(size_bytes - chunk * (n_parts - 1))
    return sizes


__all__ = [
    "MIN_PART_SIZE_BYTES",
    "MAX_PART_SIZE_BYTES",
    "MAX_PARTS",
    "checksums_match",
    "composite_crc32c_b64",
    "composite_sha256_b64",
    "crc32c_b64",
    "plan_part_sizes",
    "sha256_b64",
    "split_checksum",
]
