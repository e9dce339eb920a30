"""Configuration of the S3 store, as small frozen dataclasses checked in ``__post_init__`` (STYLE
item 8). Pure: no boto3 import, so callers can build settings without loading the client.

* :class:`TransferSettings`: part sizes and concurrency of uploads and downloads.
* :class:`WriteSettings`: server-side encryption and storage class applied to every object written.
* :class:`DeadlineSettings`: the stall timeout and the byte-scaled deadline of every single request,
  and the time budget of one operation across its retries.

Source: S3 API reference (multipart limits: parts of 5 MiB .. 5 GiB, at most 10,000 parts, single
PUT up to 5 GiB; PutObject / CreateMultipartUpload ``ServerSideEncryption``, ``SSEKMSKeyId``,
``StorageClass``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tiered_ckpt.store.checksums import MAX_PART_SIZE_BYTES, MIN_PART_SIZE_BYTES

MiB = 1024 * 1024


@dataclass(frozen=True)
class TransferSettings:
    """How the store moves files.

    Uploads: a file of ``size >= multipart_threshold_bytes`` goes as a multipart upload in parts of
    ``part_size_bytes`` (S3: 5 MiB .. 5 GiB, at most 10,000 parts; s3transfer doubles the part size
    for huge files), ``max_concurrency`` parts in flight per store. Downloads: an object of
    ``size >= download_part_size_bytes`` is fetched with ranged GETs of that size,
    ``download_max_concurrency`` in flight, the parts of all shards of a restore in one window (its
    buffers: at most ``download_max_concurrency x download_part_size_bytes`` bytes, 256 MiB by
    default). The defaults (16 MiB x 16) were tuned on SeaweedFS, a real object store
    (``bench/restore.py``); S3 and MinIO reach their throughput with parallel moderate ranges too.
    **moto** answers a ranged GET in time proportional to the whole object: there use few large
    ranges (e.g. 64 MiB x 4, or a part size above the shard size: one GET per shard, then memory is
    up to 4 shards). Raises ``ValueError`` on out-of-range values.
    """

    multipart_threshold_bytes: int = 64 * MiB
    part_size_bytes: int = 64 * MiB
    max_concurrency: int = 8
    download_part_size_bytes: int = 16 * MiB
    download_max_concurrency: int = 16

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
            raise ValueError(
                f"download_part_size_bytes must be >= 1 MiB, got {self.download_part_size_bytes}"
            )


@dataclass(frozen=True)
class DeadlineSettings:
    """Deadlines of each single S3 request and the time budget of one store operation (enforced by
    :mod:`tiered_ckpt.store.deadline`).

    A request fails (retryably, :class:`~tiered_ckpt.store.deadline.RequestDeadlineError`) when it
    runs past ``deadline_base_s + bytes / min_rate_bytes_per_s`` seconds from its start, where
    ``bytes`` is the request body plus the response body expected (the Range asked for, else the
    ``Content-Length`` announced, or the bytes received when more), or when it *stalls*: no chunk of
    the response body arrived for ``stall_timeout_s`` seconds (for a GET or HEAD, also no response
    headers). A chunk is 64 KiB for small objects, 256 KiB for s3transfer's downloads and 8 MiB for
    a read-back, so the stall timeout must cover one chunk at the slowest rate allowed (8 MiB at 256
    KiB/s: 32 s). CompleteMultipartUpload (which S3 may work on for minutes) gets 30 x
    ``deadline_base_s``.

    One *operation* of the store (a GET, a PUT, one part: every attempt of
    :func:`~tiered_ckpt.retry.call_with_retries` and the waits between them) has a budget of
    ``operation_budget_factor`` x the deadline of its largest request (of its planned bytes, or of
    the bytes its requests were known to move: a body sent, a ``Content-Length`` received, not a
    Range asked for): a request still running when the budget is spent is cut like one past its
    deadline, and no attempt starts that the budget cannot wait for.

    The defaults (stall 60 s, base 5 s, 256 KiB/s, budget 3 x) give a pointer or manifest of a few
    hundred bytes 5 s per request and 15 s per operation, a 64 MiB part 4.4 min per request and 13
    min in all, a 5 GiB one 5.7 h: a safety net against a server that never finishes (an endless or
    trickling body: one byte every 20 s never trips botocore's 60 s per-read timeout), not a
    throughput check. Measured worst cases on a trickling server: docs/sidecar.md, "Timeouts".
    Raises ``ValueError`` on values that are not finite numbers > 0, or a budget factor below 1.
    """

    stall_timeout_s: float = 60.0
    deadline_base_s: float = 5.0
    min_rate_bytes_per_s: float = 256 * 1024
    operation_budget_factor: float = 3.0

    def __post_init__(self) -> None:
        for name in (
            "stall_timeout_s",
            "deadline_base_s",
            "min_rate_bytes_per_s",
            "operation_budget_factor",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 < value < float("inf")
            ):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.operation_budget_factor < 1:
            raise ValueError(
                "operation_budget_factor must be >= 1 (one whole request), "
                f"got {self.operation_budget_factor!r}"
            )

    def deadline_s(self, n_bytes: int) -> float:
        """Seconds a request moving ``n_bytes`` (body sent plus body expected back) may take in
        all."""
        return self.deadline_base_s + max(n_bytes, 0) / self.min_rate_bytes_per_s

    def operation_budget_s(self, n_bytes: int) -> float:
        """Seconds one operation whose largest request moves ``n_bytes`` may take, every attempt
        and wait of its retries together."""
        return self.operation_budget_factor * self.deadline_s(n_bytes)


_SSE_VALUES = frozenset({"AES256", "aws:kms", "aws:kms:dsse"})
_STORAGE_CLASS_RE = re.compile(r"^[A-Z][A-Z_]*$")


@dataclass(frozen=True)
class WriteSettings:
    """Optional S3 arguments applied to every object written (PutObject / CreateMultipartUpload).

    ``server_side_encryption``: ``"AES256"``, ``"aws:kms"`` or ``"aws:kms:dsse"``;
    ``sse_kms_key_id`` only with a KMS value; ``storage_class``: e.g. ``"STANDARD"``,
    ``"INTELLIGENT_TIERING"``. Raises ``ValueError`` on other values.
    """

    server_side_encryption: str | None = None
    sse_kms_key_id: str | None = None
    storage_class: str | None = None

    def __post_init__(self) -> None:
        if (
            self.server_side_encryption is not None
            and self.server_side_encryption not in _SSE_VALUES
        ):
            raise ValueError(
                f"server_side_encryption must be one of {sorted(_SSE_VALUES)}, got {self.server_side_encryption!r}"
            )
        if self.sse_kms_key_id is not None:
            if not self.sse_kms_key_id:
                raise ValueError("sse_kms_key_id must not be empty")
            if self.server_side_encryption not in ("aws:kms", "aws:kms:dsse"):
                raise ValueError(
                    "sse_kms_key_id requires server_side_encryption='aws:kms' or 'aws:kms:dsse'"
                )
        if self.storage_class is not None and not _STORAGE_CLASS_RE.match(self.storage_class):
            raise ValueError(f"storage_class must look like 'STANDARD', got {self.storage_class!r}")

    def extra_args(self) -> dict[str, str]:
        """The settings as S3 request parameters (``ServerSideEncryption``, ``SSEKMSKeyId``,
        ``StorageClass``)."""
        args: dict[str, str] = {}
        if self.server_side_encryption is not None:
            args["ServerSideEncryption"] = self.server_side_encryption
        if self.sse_kms_key_id is not None:
            args["SSEKMSKeyId"] = self.sse_kms_key_id
        if self.storage_class is not None:
            args["StorageClass"] = self.storage_class
        return args


__all__ = ["DeadlineSettings", "TransferSettings", "WriteSettings"]
