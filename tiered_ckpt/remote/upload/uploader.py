"""The upload tier's driver: push committed local steps to an S3-compatible bucket (SPEC §4).

:class:`Uploader` uploads one step at a time (:meth:`Uploader.upload_step`) and knows the backlog
(which local steps still need this remote), the pins to mirror and the remote retention; the
sidecar loop (:class:`tiered_ckpt.remote.upload.daemon.UploadLoop`) owns one and drives it.
:class:`UploadPolicy` says what to upload, what to keep remotely, how to confirm and when a waiting
step is stalled; :class:`StepTiming` is the seconds spent on one step. What every step upload
shares (store, executors, events, probe, metrics) is its
:class:`~tiered_ckpt.remote.upload.session.UploadSession`.

Memory stays bounded: no file is buffered whole (single PUTs are below the multipart threshold), at
most ``max_concurrency + max_concurrent_shards`` parts are in memory, and the backlog is a sorted
list of step numbers. Logs carry step and shard; credentials are never logged (only
``s3://bucket/prefix``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiered_ckpt.errors import CheckpointError
from tiered_ckpt.format.records import UploadedMarker
from tiered_ckpt.format.upload_manifest import UploadManifest
from tiered_ckpt.layout import KEY_LAYOUTS
from tiered_ckpt.local.catalogue import committed_steps, step_path, write_root
from tiered_ckpt.local.markers import read_uploaded_marker, write_uploaded_marker
from tiered_ckpt.remote.catalogue import committed_step_candidates
from tiered_ckpt.remote.errors import LocalStepGoneError, StepIncompleteError, StepSupersededError
from tiered_ckpt.remote.upload import pending_aborts, retention
from tiered_ckpt.remote.upload.retention import DEFAULT_STALE_MULTIPART_AGE_S
from tiered_ckpt.remote.upload.session import UploadSession
from tiered_ckpt.remote.upload.step_upload import mirror_pins, read_local_manifest, upload_step
from tiered_ckpt.retry import OperationInterruptedError, RetryPolicy
from tiered_ckpt.store.base import ObjectStore, parse_s3_url

if TYPE_CHECKING:
    from tiered_ckpt.remote.upload.commit import RemoteStepCommit
    from tiered_ckpt.remote.upload.metrics import UploadMetrics
    from tiered_ckpt.store import WriteSettings

log = logging.getLogger(__name__)

MiB = 1024 * 1024


#: ``UploadPolicy.stall_deadline_s`` by default (seconds): see there.
DEFAULT_STALL_DEADLINE_S = 1800.0


@dataclass(frozen=True)
class UploadPolicy:
    """What to upload and what to keep remotely.

    ``skip_intermediate``: when several steps are pending, upload only the newest; older pending
    ones are released (marker ``uploaded.json`` with ``"skipped": true``, so upload-gated rotation
    may delete them). ``keep_remote_last``: keep this many newest remotely committed steps
    (``None``: keep all). ``keep_remote_every_n_steps``: additionally keep steps with ``step % N ==
    0``. ``verify``: ``"auto"`` (server checksum where the bucket validates, else read-back) or
    ``"read-back"`` (always read back).
    ``stall_deadline_s``: seconds a step may wait for other nodes' confirmations (counted from this
    sidecar's first wait) before it is reported stalled, kept locally outside
    ``max_pending_uploads`` and polled at the cap (:mod:`tiered_ckpt.remote.upload.daemon`); ``None``:
    never. The default, 30 minutes, is meant as a few save intervals of a typical job (the sidecar
    does not know the interval: set it to 2-4x yours); it must exceed how long the slowest node
    takes to upload one step.
    """

    skip_intermediate: bool = False
    keep_remote_last: int | None = None
    keep_remote_every_n_steps: int | None = None
    verify: str = "auto"
    stall_deadline_s: float | None = DEFAULT_STALL_DEADLINE_S

    def __post_init__(self) -> None:
        if self.keep_remote_last is not None and self.keep_remote_last < 1:
            raise ValueError(f"keep_remote_last must be >= 1 or None, got {self.keep_remote_last}")
        if self.keep_remote_every_n_steps is not None and self.keep_remote_every_n_steps < 1:
            raise ValueError(
                f"keep_remote_every_n_steps must be >= 1 or None, got "
                f"{self.keep_remote_every_n_steps}"
            )
        if self.verify not in ("auto", "read-back"):
            raise ValueError(f"verify must be 'auto' or 'read-back', got {self.verify!r}")
        if self.stall_deadline_s is not None and not self.stall_deadline_s > 0:
            raise ValueError(f"stall_deadline_s must be > 0 or None, got {self.stall_deadline_s}")


@dataclass(frozen=True)
class StepTiming:
    """Seconds spent on one step by this node: ``transfer_s`` (hash + send + server-side
    confirmation), ``read_back_s`` (read-back only, summed over shards), ``total_s``."""

    step: int
    bytes_sent: int
    transfer_s: float
    read_back_s: float
    total_s: float


class Uploader:
    """Uploads committed steps of ``local_root`` to ``remote_url`` (``s3://bucket/prefix``).

    ``s3_client``: an injected botocore S3 client (shared; see
    ``tiered_ckpt.store.make_s3_client``); ``None`` builds one from boto3's chain
    (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ...), for ``endpoint_url`` when given (as
    :func:`~tiered_ckpt.remote.restore.restorer.restore` does; both at once raise ``ValueError``). Transfer:
    ``multipart_threshold_bytes``, ``part_size_bytes``, ``max_concurrency`` (parts in flight, all
    shards together), ``max_concurrent_shards`` (shards read at once). Defaults (16 MiB parts, 10 in
    flight) come from ``bench/upload.py``: parts of 32 MiB and more cost moto (and the client)
    measurably more CPU per byte than 8-16 MiB ones (allocations at or above glibc's 32 MiB mmap
    threshold are fresh, page-faulted memory every time), and 10 in flight matches ``aws s3 cp``.
    ``retry``: whole-operation retries on top of botocore's (see ``tiered_ckpt.retry``). ``write``:
    SSE / storage class (``tiered_ckpt.store.WriteSettings``). ``metrics``: a
    :class:`tiered_ckpt.remote.upload.metrics.UploadMetrics`. ``stop_event``: cuts retries short and aborts
    in-flight multipart uploads (their parts in flight finish; :meth:`cancel` cuts those too).
    ``adopt_prefix``: take over a prefix whose ``run.json`` names another run (``--adopt-prefix``;
    otherwise ``RunMismatchError``, SPEC §11 fencing). ``key_layout``: ``"flat"`` (default) or
    ``"hashed"``: shard objects spread over 256 hashed prefixes for jobs whose request rate one S3
    prefix cannot take (``docs/sidecar.md``, "Key layout"; every sidecar of a job the same). Restore
    and retention read the layout from each save's upload manifest. Raises ``ValueError`` for an
    unknown layout, or for both ``s3_client`` and ``endpoint_url``.

    Thread-safety: one :meth:`upload_step` at a time per instance (``run`` does that).
    """

    def __init__(
        self,
        local_root: str | os.PathLike[str],
        remote_url: str,
        *,
        s3_client: Any = None,
        endpoint_url: str | None = None,
        max_concurrency: int = 10,
        max_concurrent_shards: int = 4,
        multipart_threshold_bytes: int = 64 * MiB,
        part_size_bytes: int = 16 * MiB,
        policy: UploadPolicy | None = None,
        retry: RetryPolicy | None = None,
        write: WriteSettings | None = None,
        metrics: UploadMetrics | None = None,
        stop_event: threading.Event | None = None,
        stale_multipart_age_s: float = DEFAULT_STALE_MULTIPART_AGE_S,
        on_progress: Callable[[int], None] | None = None,
        adopt_prefix: bool = False,
        key_layout: str = "flat",
    ) -> None:
        from tiered_ckpt.store import S3Store, TransferSettings, WriteSettings, make_s3_client

        if s3_client is not None and endpoint_url is not None:
            raise ValueError("pass s3_client or endpoint_url, not both")
        if max_concurrent_shards < 1:
            raise ValueError(f"max_concurrent_shards must be >= 1, got {max_concurrent_shards}")
        if key_layout not in KEY_LAYOUTS:
            raise ValueError(f"key_layout must be one of {KEY_LAYOUTS}, got {key_layout!r}")
        self.local_root = write_root(local_root)  # the sidecar writes markers: the root as given
        self.remote_url = remote_url
        self.bucket, self.prefix = parse_s3_url(remote_url)
        self.policy = policy if policy is not None else UploadPolicy()
        self.retry = retry if retry is not None else RetryPolicy()
        self.write = write if write is not None else WriteSettings()
        self.stop_event = stop_event if stop_event is not None else threading.Event()
        self.cancel_event = threading.Event()  # set by cancel(): every request in flight is cut
        self.metrics = metrics
        self.stale_multipart_age_s = stale_multipart_age_s
        transfer = TransferSettings(
            multipart_threshold_bytes=multipart_threshold_bytes,
            part_size_bytes=part_size_bytes,
            max_concurrency=max_concurrency,
        )
        client = (
            s3_client
            if s3_client is not None
            else make_s3_client(
                endpoint_url=endpoint_url,
                max_pool_connections=max(32, max_concurrency + 2 * max_concurrent_shards + 4),
            )
        )
        self.store: ObjectStore = S3Store(
            client,
            self.bucket,
            self.prefix,
            transfer=transfer,
            retry=self.retry,
            write=self.write,
            stop_event=self.stop_event,
            cancel_event=self.cancel_event,
        )
        self.session = UploadSession(
            self.store,
            self.local_root,
            retry=self.retry,
            stop_event=self.stop_event,
            cancel_event=self.cancel_event,
            max_concurrency=max_concurrency,
            max_concurrent_shards=max_concurrent_shards,
            force_read_back=self.policy.verify == "read-back",
            adopt_prefix=adopt_prefix,
            key_layout=key_layout,
            metrics=metrics,
            on_progress=on_progress,
        )
        #: step -> the commit object of its last StepIncompleteError (the next poll is one LIST).
        self._resume: dict[int, RemoteStepCommit] = {}
        self._pins_mirrored: set[tuple[int, str]] = set()  # (step, save_id) pinned remotely already
        self.last_timing: StepTiming | None = None
        self.newest_remote_commit: tuple[int, float] | None = (
            None  # (step, local commit epoch seconds)
        )

    # --- backlog

    def pending_steps(self) -> list[int]:
        """Committed local steps not yet uploaded to *this* remote, newest first: no
        ``uploaded.json`` marker, or one naming another bucket/prefix (a sidecar re-pointed
        elsewhere, or a step restored from another bucket, must still upload it here)."""
        return [
            s
            for s in reversed(committed_steps(self.local_root))
            if not self._marked_for_this_remote(s)
        ]

    def _marked_for_this_remote(self, step: int) -> bool:
        """The step carries a readable ``uploaded.json`` marker written for this uploader's remote
        (an unreadable one counts as absent: the step is uploaded again, a committed remote step
        only re-checked)."""
        marker = read_uploaded_marker(step_path(self.local_root, step))
        return marker is not None and marker.names_remote(self.store.url)

    def select_pending(self) -> list[int]:
        """:meth:`pending_steps`, after releasing all but the newest under ``skip_intermediate``
        (their marker says ``"skipped": true``); updates the queue-depth gauge."""
        pending = self.pending_steps()
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(pending))
        if self.policy.skip_intermediate and len(pending) > 1:
            for s in pending[1:]:
                self._release_skipped(s)
            pending = pending[:1]
        return pending

    def _release_skipped(self, step: int) -> None:
        try:
            write_uploaded_marker(
                step_path(self.local_root, step),
                UploadedMarker(step=step, remote=self.store.url, skipped=True),
            )
            log.info("step %d: skipped (skip_intermediate); released for rotation", step)
        except OSError as e:
            log.warning("step %d: could not write the skip marker: %s", step, e)

    # --- one step

    def server_validates_checksums(self) -> bool:
        """Whether the bucket's server validates SHA-256 checksums (probed once, cached)."""
        return self.session.server_validates_checksums()

    def upload_step(self, step: int) -> UploadManifest:
        """Upload this node's shards of ``step`` and commit it remotely when every shard is
        confirmed.

        Returns the step's :class:`UploadManifest` once it is remotely committed (by this node or,
        for a step already committed, by anyone). Raises :class:`StepIncompleteError` (other nodes'
        ranks not confirmed yet; the next call for the step costs one LIST), ``RunMismatchError``
        (the prefix belongs to another run and ``adopt_prefix`` is off), ``StepSupersededError``,
        :class:`LocalStepGoneError`, :class:`~tiered_ckpt.errors.NoCheckpointError` (not committed
        locally), ``ShardCorruptedError`` (local shard differs from its manifest), ``UploadError``
        (remote failures after retries; ``OperationInterruptedError`` on stop).
        """
        t0 = time.monotonic()
        try:
            um, m, stats = upload_step(self.session, step, resume=self._resume.pop(step, None))
        except StepIncompleteError as e:
            if e.commit is not None:
                self._resume[step] = e.commit
            raise
        except BaseException as e:
            if self.metrics is not None and not isinstance(
                e, (OperationInterruptedError, StepSupersededError)
            ):
                self.metrics.failures.inc()
            raise
        if self.metrics is not None:
            self.metrics.steps.inc()
        self._note_remote_commit(step, m.created_at)
        total = time.monotonic() - t0
        self.last_timing = StepTiming(
            step, stats.bytes_sent, total - stats.read_back_s, stats.read_back_s, total
        )
        return um

    def mirror_pins(self) -> list[int]:
        """Mirror the pins of local steps uploaded earlier to this remote (``mgr.pin`` after the
        upload; :func:`tiered_ckpt.remote.upload.step_upload.mirror_pins`): local reads, plus one HEAD per
        pinned step not mirrored yet by this uploader. Returns the steps pinned remotely now. Raises
        ``UploadError``."""
        return mirror_pins(self.store, self.local_root, self._pins_mirrored)

    def _note_remote_commit(self, step: int, created_at: str) -> None:
        """Feed the time-at-risk gauge with the newest remotely committed step's local commit
        time."""
        commit_t = _parse_time(created_at)
        if self.newest_remote_commit is None or step >= self.newest_remote_commit[0]:
            self.newest_remote_commit = (step, commit_t)
            if self.metrics is not None:
                self.metrics.set_newest_remote(step, commit_t)

    def learn_newest_remote(self) -> None:
        """At the sidecar's start: the newest local step carrying this remote's marker feeds the
        time-at-risk gauge."""
        for s in reversed(committed_steps(self.local_root)):
            if self._marked_for_this_remote(s):
                try:
                    _, m = read_local_manifest(self.local_root, s, step_path(self.local_root, s))
                except (CheckpointError, OSError):
                    continue
                self._note_remote_commit(s, m.created_at)
                return

    def cancel(self) -> None:
        """Stop now (Ctrl-C or SIGTERM of ``upload --once``): the stop event, and every request in
        flight cut, parts too (a sidecar's stop lets those finish); the multipart uploads started
        are aborted."""
        self.session.cancel()

    def close(self) -> None:
        """Stop the executors and close the store."""
        self.session.close()

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- cleanup / retention

    def abort_abandoned_uploads(self) -> int:
        """Abort the uploads recorded as not abortable (:meth:`sweep_pending_aborts`), then multipart
        uploads under the prefix left by an earlier (crashed) sidecar of this node: those of shard keys
        whose rank this node holds locally, and any older than ``stale_multipart_age_s`` (other nodes'
        live uploads are left alone). Returns how many."""
        return retention.abort_abandoned_uploads(
            self.store, self.local_root, self.stale_multipart_age_s
        )

    def sweep_pending_aborts(self) -> int:
        """Abort (a bounded number of) the uploads this root recorded as not abortable
        (:func:`~tiered_ckpt.remote.upload.pending_aborts.sweep_pending_aborts`); the sidecar calls it on every
        poll. Returns how many were settled. Raises ``OSError`` (the record cannot be rewritten)."""
        return pending_aborts.sweep_pending_aborts(self.store, self.local_root)

    def remote_committed_steps(self) -> list[int]:
        """:func:`~tiered_ckpt.remote.catalogue.committed_step_candidates` of this remote (ascending): the
        ``latest`` pointer's step plus those whose upload manifest LIST shows."""
        return committed_step_candidates(self.store)[0]

    def apply_remote_retention(self) -> list[int]:
        """Delete remotely committed steps beyond the policy (upload manifest first). Returns them."""
        return retention.apply_remote_retention(
            self.store, self.policy.keep_remote_last, self.policy.keep_remote_every_n_steps
        )


def _parse_time(text: str) -> float:
    from datetime import datetime

    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return time.time()


__all__ = [
    "DEFAULT_STALL_DEADLINE_S",
    "LocalStepGoneError",
    "StepIncompleteError",
    "StepTiming",
    "UploadManifest",
    "UploadPolicy",
    "Uploader",
]
