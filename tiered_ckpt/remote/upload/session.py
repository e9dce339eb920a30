"""What every step upload of one :class:`~tiered_ckpt.remote.upload.uploader.Uploader` shares.

An :class:`UploadSession` is built once per uploader and passed down the upload path
(:mod:`~tiered_ckpt.remote.upload.step_upload`, :mod:`~tiered_ckpt.remote.upload.shard_upload`): the
store and the local root, the two executors (shards read at once, parts in flight) and the semaphore
that bounds the parts in memory across all shards, the retry policy, the stop and cancel events, how
shards are confirmed, the key layout of new saves and the metrics. It owns them: closing it stops
the executors and closes the store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tiered_ckpt.remote.upload import pending_aborts
from tiered_ckpt.retry import RetryPolicy
from tiered_ckpt.store.base import ObjectStore

if TYPE_CHECKING:
    from tiered_ckpt.remote.upload.metrics import UploadMetrics


@dataclass
class StepStats:
    """Figures of one step's upload on this node, summed over its shards (thread-safe through
    ``lock``): ``read_back_s`` (seconds of read-back confirmation), ``bytes_sent``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    read_back_s: float = 0.0
    bytes_sent: int = 0

    def add(self, *, read_back_s: float = 0.0, bytes_sent: int = 0) -> None:
        with self.lock:
            self.read_back_s += read_back_s
            self.bytes_sent += bytes_sent


class UploadSession:
    """The shared resources of one uploader's step uploads (module docstring).

    ``store``: the bucket prefix (owned: closed by :meth:`close`). ``local_root``: the root whose
    steps are uploaded (markers are written there). ``max_concurrency``: parts in flight, all shards
    together; ``max_concurrent_shards``: shards read at once. ``force_read_back``: confirm every
    shard by reading it back (``UploadPolicy.verify == "read-back"``); otherwise the server's
    checksum where it validates them. ``adopt_prefix``: take over a prefix claimed by another run.
    ``key_layout``: ``"flat"`` or ``"hashed"`` (:mod:`tiered_ckpt.layout`). ``stop_event``: cuts
    retries short and aborts multipart uploads in flight; ``cancel_event`` (set by :meth:`cancel`)
    also cuts the requests in flight. ``on_progress(delta_bytes)``: bytes sent, as they go.
    """

    def __init__(
        self,
        store: ObjectStore,
        local_root: Path,
        *,
        retry: RetryPolicy,
        stop_event: threading.Event,
        cancel_event: threading.Event,
        max_concurrency: int,
        max_concurrent_shards: int,
        force_read_back: bool = False,
        adopt_prefix: bool = False,
        key_layout: str = "flat",
        metrics: UploadMetrics | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.local_root = local_root
        self.retry = retry
        self.stop_event = stop_event
        self.cancel_event = cancel_event
        self.force_read_back = force_read_back
        self.adopt_prefix = adopt_prefix
        self.key_layout = key_layout
        self.metrics = metrics
        self.on_progress = on_progress
        self.part_executor = ThreadPoolExecutor(
            max_concurrency, thread_name_prefix="tc-upload-part"
        )
        self.shard_executor = ThreadPoolExecutor(
            max_concurrent_shards, thread_name_prefix="tc-upload-shard"
        )
        self.part_slots = threading.BoundedSemaphore(max_concurrency)
        #: Whether the server validates SHA-256 checksums: ``None`` until probed (once); tests and
        #: benches set it to act as a server of known behaviour would.
        self.checksum_validation: bool | None = None
        self._probe_lock = threading.Lock()

    def server_validates_checksums(self) -> bool:
        """Whether the bucket's server validates SHA-256 checksums (probed once, cached)."""
        with self._probe_lock:
            if self.checksum_validation is None:
                self.checksum_validation = bool(self.store.server_validates_checksums())
            return self.checksum_validation

    def count_sent(self, nbytes: int) -> None:
        """Bytes confirmed on the server (the ``tiered_ckpt_upload_bytes_total`` counter)."""
        if self.metrics is not None:
            self.metrics.bytes.inc(nbytes)

    def record_failed_abort(self, key: str, upload_id: str, exc: BaseException) -> None:
        """A multipart upload that could not be aborted: kept for a later sweep
        (:mod:`tiered_ckpt.remote.upload.pending_aborts`)."""
        pending_aborts.record_failed_abort(self.local_root, self.store.url, key, upload_id, exc)

    def cancel(self) -> None:
        """Stop now: the stop event, and every request in flight cut (parts too)."""
        self.cancel_event.set()
        self.stop_event.set()

    def close(self) -> None:
        """Stop the executors (queued work dropped), then close the store."""
        self.shard_executor.shutdown(wait=True, cancel_futures=True)
        self.part_executor.shutdown(wait=True, cancel_futures=True)
        self.store.close()


__all__ = ["StepStats", "UploadSession"]
