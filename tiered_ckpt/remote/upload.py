"""The upload tier: push committed local steps to an S3-compatible bucket (SPEC §4, issue 4).

Remote layout (``prefix`` from ``s3://bucket/prefix``)::

    <prefix>/step_XXXXXXXXXX/rank_XXXXX.safetensors        one object per rank
    <prefix>/step_XXXXXXXXXX/manifest.json                 the exact bytes of the local manifest
    <prefix>/step_XXXXXXXXXX/.confirm/rank_XXXXX.json      per-shard confirmation record
    <prefix>/step_XXXXXXXXXX/upload_manifest.json          remote commit point, written LAST
    <prefix>/latest                                        LatestPointer, moved forward only

Lifecycle of :meth:`Uploader.upload_step` for step ``S`` on one node (every node's sidecar runs it for the
shards on its own disk; a node-local root holds that node's ranks plus the global manifest):

1. Hold ``hold_step_lock(step_dir, "upload")`` (rotation skips the step) and read ``manifest.json``.
   A step directory that is gone raises :class:`LocalStepGoneError` (nothing committed remotely).
2. If ``upload_manifest.json`` already exists for the same local manifest (sha256), the step is done:
   move ``latest``, write the local marker, return it.
3. PUT ``manifest.json`` (identical bytes from every node).
4. For each local shard, concurrently: skip it if its confirmation record names the same sha256 and
   ``save_id`` and a HEAD shows the same size (a restart never re-sends a confirmed shard); otherwise
   abort leftover multipart uploads of that key, send it hashing the bytes as read, confirm it
   (server checksum where the bucket validates, else read-back; see :mod:`tiered_ckpt._shard_transfer`),
   then PUT its confirmation record. Failures are retried per shard (``RetryPolicy``); local rot
   (:class:`~tiered_ckpt._shard_transfer.LocalShardError`) is not.
5. GET every rank's confirmation record (GET, never LIST). If some rank is not confirmed yet (another
   node still uploading), raise :class:`StepIncompleteError`; the run loop comes back later.
6. Re-check that the local step is still there, then PUT ``upload_manifest.json`` with
   ``If-None-Match: *``. Losing that race to another node is fine when its bytes are identical (the
   content is deterministic); different bytes raise ``UploadError``. Whoever confirms the last shard
   therefore writes it, exactly once; it never names a shard whose record is missing.
7. Move ``latest`` forward (``If-Match`` its ETag, or ``If-None-Match: *`` when absent; on 412 re-read
   and retry; never backwards).
8. Write ``<step_dir>/uploaded.json`` atomically; rotation with ``upload_gated=True`` relies on it.

Remote retention (:meth:`Uploader.apply_remote_retention`) keeps the newest ``keep_remote_last`` committed
steps (plus every ``keep_remote_every_n_steps``-th) and un-commits the others: ``upload_manifest.json``
is deleted FIRST, then the step's other objects.

Memory stays bounded: no file is buffered whole (single PUTs are below the multipart threshold), at most
``max_concurrency + max_concurrent_shards`` parts are in memory, and the backlog is a sorted list of step
numbers. Logs carry step and shard; credentials are never logged (only ``s3://bucket/prefix``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from tiered_ckpt.fs import atomic_write_json
from tiered_ckpt.locks import hold_step_lock
from tiered_ckpt.remote.transfer import (LocalShardError, SentShard, TransitCorruptionError, confirm_shard, send_shard)
from tiered_ckpt.errors import CheckpointError, ManifestError, NoCheckpointError, UploadError
from tiered_ckpt.layout import (MANIFEST_NAME, UPLOAD_MANIFEST_NAME, UPLOADED_MARKER_NAME, parse_shard_file_name,
                     parse_step_dir_name, remote_key, shard_file_name, step_dir_name)
from tiered_ckpt.local.steps import committed_steps, resolve_root, step_path
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.retry import OperationInterruptedError, RetryPolicy, call_with_retries, is_retryable_s3_error
from tiered_ckpt.store import PreconditionFailedError, parse_s3_url
from tiered_ckpt.format.upload_manifest import LatestPointer, RemoteShard, UploadManifest

log = logging.getLogger(__name__)

MiB = 1024 * 1024
CONFIRM_DIR = ".confirm"
#: Multipart uploads older than this under the prefix are aborted at start whoever started them.
DEFAULT_STALE_MULTIPART_AGE_S = 24 * 3600.0


class LocalStepGoneError(UploadError, FileNotFoundError):
    """The local step directory (or a shard of it) disappeared while the sidecar was uploading it;
    nothing was committed remotely."""

    def __init__(self, message: str, *, last_exception: BaseException | None = None) -> None:
        UploadError.__init__(self, message, last_exception=last_exception)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StepIncompleteError(UploadError):
    """This node's shards of the step are confirmed, but other ranks (uploaded by other nodes' sidecars)
    are not yet: the step is not remotely committed. ``missing_ranks`` lists them."""

    def __init__(self, message: str, missing_ranks: Iterable[int]) -> None:
        super().__init__(message)
        self.missing_ranks = tuple(missing_ranks)


@dataclass(frozen=True)
class UploadPolicy:
    """What to upload and what to keep remotely.

    ``skip_intermediate``: when several steps are pending, upload only the newest; older pending ones are
    released (marker ``uploaded.json`` with ``"skipped": true``, so upload-gated rotation may delete
    them). ``keep_remote_last``: keep this many newest remotely committed steps (``None``: keep all).
    ``keep_remote_every_n_steps``: additionally keep steps with ``step % N == 0``.
    ``verify``: ``"auto"`` (server checksum where the bucket validates, else read-back) or
    ``"read-back"`` (always read back).
    """

    skip_intermediate: bool = False
    keep_remote_last: int | None = None
    keep_remote_every_n_steps: int | None = None
    verify: str = "auto"

    def __post_init__(self) -> None:
        if self.keep_remote_last is not None and self.keep_remote_last < 1:
            raise ValueError(f"keep_remote_last must be >= 1 or None, got {self.keep_remote_last}")
        if self.keep_remote_every_n_steps is not None and self.keep_remote_every_n_steps < 1:
            raise ValueError(f"keep_remote_every_n_steps must be >= 1 or None, got "
                             f"{self.keep_remote_every_n_steps}")
        if self.verify not in ("auto", "read-back"):
            raise ValueError(f"verify must be 'auto' or 'read-back', got {self.verify!r}")


@dataclass(frozen=True)
class StepTiming:
    """Seconds spent on one step by this node: ``transfer_s`` (hash + send + server-side confirmation),
    ``read_back_s`` (read-back only, summed over shards), ``total_s``."""

    step: int
    bytes_sent: int
    transfer_s: float
    read_back_s: float
    total_s: float


@dataclass
class _Stats:
    lock: threading.Lock = field(default_factory=threading.Lock)
    read_back_s: float = 0.0
    bytes_sent: int = 0


def _confirm_key(step: int, rank: int) -> str:
    return f"{step_dir_name(step)}/{CONFIRM_DIR}/rank_{rank:05d}.json"


class Uploader:
    """Uploads committed steps of ``local_root`` to ``remote_url`` (``s3://bucket/prefix``).

    ``s3_client``: an injected botocore S3 client (shared; see ``tiered_ckpt.store.make_s3_client``);
    ``None`` builds one from boto3's chain (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ...). Transfer:
    ``multipart_threshold_bytes``, ``part_size_bytes``, ``max_concurrency`` (parts in flight, all shards
    together), ``max_concurrent_shards`` (shards read at once). Defaults (16 MiB parts, 10 in flight) come
    from ``bench/upload.py``: parts of 32 MiB and more cost moto (and the client) measurably more CPU per
    byte than 8-16 MiB ones (allocations at or above glibc's 32 MiB mmap threshold are fresh, page-faulted
    memory every time), and 10 in flight matches ``aws s3 cp``. ``retry``: whole-operation retries on top
    of botocore's (see ``tiered_ckpt.retry``). ``write``: SSE / storage class
    (``tiered_ckpt.store.WriteSettings``). ``metrics``: a :class:`tiered_ckpt.metrics.UploadMetrics`.
    ``stop_event``: cuts retries short and aborts in-flight multipart uploads.

    Thread-safety: one :meth:`upload_step` at a time per instance (``run`` does that).
    """

    def __init__(
        self,
        local_root: str | os.PathLike[str],
        remote_url: str,
        *,
        s3_client: Any = None,
        max_concurrency: int = 10,
        max_concurrent_shards: int = 4,
        multipart_threshold_bytes: int = 64 * MiB,
        part_size_bytes: int = 16 * MiB,
        policy: UploadPolicy | None = None,
        retry: RetryPolicy | None = None,
        write: Any = None,
        metrics: Any = None,
        stop_event: threading.Event | None = None,
        stale_multipart_age_s: float = DEFAULT_STALE_MULTIPART_AGE_S,
        on_progress: Callable[[int], None] | None = None,
    ) -> None:
        from tiered_ckpt.store import S3Store, TransferSettings, WriteSettings, make_s3_client

        if max_concurrent_shards < 1:
            raise ValueError(f"max_concurrent_shards must be >= 1, got {max_concurrent_shards}")
        self.local_root, _ = resolve_root(local_root)
        self.remote_url = remote_url
        self.bucket, self.prefix = parse_s3_url(remote_url)
        self.policy = policy if policy is not None else UploadPolicy()
        self.retry = retry if retry is not None else RetryPolicy()
        self.write = write if write is not None else WriteSettings()
        self.stop_event = stop_event if stop_event is not None else threading.Event()
        self.metrics = metrics
        self.stale_multipart_age_s = stale_multipart_age_s
        self.on_progress = on_progress
        transfer = TransferSettings(multipart_threshold_bytes=multipart_threshold_bytes,
                                    part_size_bytes=part_size_bytes, max_concurrency=max_concurrency)
        client = s3_client if s3_client is not None else make_s3_client(
            max_pool_connections=max(32, max_concurrency + 2 * max_concurrent_shards + 4))
        self.store = S3Store(client, self.bucket, self.prefix, transfer=transfer, retry=self.retry,
                             write=self.write, stop_event=self.stop_event)
        self._max_concurrent_shards = max_concurrent_shards
        self._part_executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="tc-upload-part")
        self._part_slots = threading.BoundedSemaphore(max_concurrency)
        self._shard_executor = ThreadPoolExecutor(max_concurrent_shards, thread_name_prefix="tc-upload-shard")
        self._server_validates: bool | None = None
        self._probe_lock = threading.Lock()
        self._failed_at: dict[int, float] = {}
        self.last_timing: StepTiming | None = None
        self.newest_remote_commit: tuple[int, float] | None = None  # (step, local commit epoch seconds)

    # ------------------------------------------------------------------------------------ public

    def pending_steps(self) -> list[int]:
        """Committed local steps not yet uploaded to *this* remote, newest first: no ``uploaded.json``
        marker, or one naming another bucket/prefix (a sidecar re-pointed elsewhere, or a step restored
        from another bucket, must still upload it here)."""
        return [s for s in reversed(committed_steps(self.local_root))
                if not self._marked_for_this_remote(step_path(self.local_root, s))]

    def _marked_for_this_remote(self, sdir: Path) -> bool:
        """``sdir`` carries an ``uploaded.json`` marker written for this uploader's remote URL."""
        try:
            marker = json.loads((sdir / UPLOADED_MARKER_NAME).read_bytes())
        except (OSError, ValueError):
            return False  # absent or unreadable: upload (a committed remote step is only re-checked)
        remote = marker.get("remote") if isinstance(marker, dict) else None
        return isinstance(remote, str) and remote.rstrip("/") == self.store.url.rstrip("/")

    def server_validates_checksums(self) -> bool:
        """Whether the bucket's server validates SHA-256 checksums (probed once, cached)."""
        with self._probe_lock:
            if self._server_validates is None:
                self._server_validates = bool(self.store.server_validates_checksums())
            return self._server_validates

    def upload_step(self, step: int) -> UploadManifest:
        """Upload this node's shards of ``step`` and commit it remotely when every shard is confirmed.

        Returns the step's :class:`UploadManifest` once it is remotely committed (by this node or, for a
        step already committed, by anyone). Raises :class:`StepIncompleteError` (other nodes' ranks not
        confirmed yet), :class:`LocalStepGoneError`, :class:`~tiered_ckpt.errors.NoCheckpointError`
        (not committed locally), ``ShardCorruptedError`` (local shard differs from its manifest),
        ``UploadError`` (remote failures after retries; ``OperationInterruptedError`` on stop).
        """
        sdir = step_path(self.local_root, step)
        t0 = time.monotonic()
        stats = _Stats()
        try:
            lock = hold_step_lock(sdir, "upload")
            lock.__enter__()
        except FileNotFoundError as e:
            raise LocalStepGoneError(f"step {step}: {sdir} does not exist", last_exception=e) from None
        try:
            um = self._upload_step_locked(step, sdir, stats)
        except BaseException as e:
            lock.__exit__(type(e), e, e.__traceback__)
            if self.metrics is not None and not isinstance(e, (StepIncompleteError, OperationInterruptedError)):
                self.metrics.failures.inc()
            raise
        lock.__exit__(None, None, None)
        total = time.monotonic() - t0
        self.last_timing = StepTiming(step, stats.bytes_sent, total - stats.read_back_s, stats.read_back_s, total)
        return um

    def run(self, stop_event: threading.Event | None = None, *, poll_interval_s: float = 2.0,
            once: bool = False, failure_backoff_s: float = 10.0) -> list[int]:
        """The sidecar loop: abort abandoned multipart uploads, then repeatedly upload pending steps
        (newest first) until ``stop_event`` is set (or, with ``once``, until nothing is left that can be
        done now). Failed steps are retried after ``failure_backoff_s``. Returns the steps committed."""
        stop = stop_event if stop_event is not None else self.stop_event
        if stop is not self.stop_event:
            # Propagate an external stop event to the store's (which cuts retries and transfers short).
            threading.Thread(target=lambda: (stop.wait(), self.stop_event.set()), daemon=True).start()
        done: list[int] = []
        self._learn_newest_remote()
        try:
            self.abort_abandoned_uploads()
        except UploadError as e:
            log.error("could not sweep abandoned multipart uploads under %s: %s", self.store.url, e)
        while not stop.is_set():
            worked = False
            try:
                pending = self._select_pending()
            except OSError as e:
                log.error("cannot list %s: %s", self.local_root, e)
                pending = []
            for step in pending:
                if stop.is_set():
                    break
                if time.monotonic() - self._failed_at.get(step, -1e18) < failure_backoff_s:
                    continue
                try:
                    self.upload_step(step)
                except StepIncompleteError as e:
                    log.info("step %d: waiting for other nodes (ranks %s)", step, list(e.missing_ranks)[:8])
                    continue
                except OperationInterruptedError:
                    log.info("step %d: upload interrupted by stop", step)
                    break
                except (CheckpointError, OSError) as e:
                    log.error("step %d: upload failed: %s: %s", step, type(e).__name__, e)
                    self._failed_at[step] = time.monotonic()
                    continue
                self._failed_at.pop(step, None)
                done.append(step)
                worked = True
                try:
                    self.apply_remote_retention()
                except UploadError as e:
                    log.error("remote retention failed: %s", e)
                break  # re-scan: a newer step may have been committed meanwhile
            if once and not worked:
                break
            if not worked:
                stop.wait(poll_interval_s)
        return done

    def close(self) -> None:
        self._shard_executor.shutdown(wait=True, cancel_futures=True)
        self._part_executor.shutdown(wait=True, cancel_futures=True)
        self.store.close()

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ cleanup / retention

    def abort_abandoned_uploads(self) -> int:
        """Abort multipart uploads under the prefix left by an earlier (crashed) sidecar of this node:
        those of shard keys whose rank this node holds locally, and any older than
        ``stale_multipart_age_s`` (other nodes' live uploads are left alone). Returns how many."""
        local_ranks: set[int] = set()
        for name in _listdir(self.local_root):
            if parse_step_dir_name(name) is None:
                continue
            for f in _listdir(self.local_root / name):
                r = parse_shard_file_name(f)
                if r is not None:
                    local_ranks.add(r)
        now = time.time()
        n = 0
        for mpu in list(self.store.list_multipart_uploads("step_")):
            rank = parse_shard_file_name(mpu.key.rsplit("/", 1)[-1])
            age = now - mpu.initiated.timestamp() if mpu.initiated is not None else 0.0
            if (rank is not None and rank in local_ranks) or age > self.stale_multipart_age_s:
                if self.store.abort_multipart_upload(mpu.key, mpu.upload_id):
                    n += 1
                    log.info("aborted abandoned multipart upload %s of %s/%s", mpu.upload_id, self.store.url,
                             mpu.key)
        return n

    def remote_committed_steps(self) -> list[int]:
        """Steps under the prefix that have an upload manifest (by LIST; ascending)."""
        steps = set()
        for key in self.store.list_keys("step_"):
            d, _, name = key.partition("/")
            s = parse_step_dir_name(d)
            if s is not None and name == UPLOAD_MANIFEST_NAME:
                steps.add(s)
        return sorted(steps)

    def apply_remote_retention(self) -> list[int]:
        """Delete remotely committed steps beyond the policy (upload manifest first). Returns them."""
        keep_n = self.policy.keep_remote_last
        if keep_n is None:
            return []
        steps = self.remote_committed_steps()
        latest = self._read_latest()[0]
        keep = set(steps[-keep_n:])
        if latest is not None:
            keep.add(latest.step)
        every = self.policy.keep_remote_every_n_steps
        deleted = []
        for s in steps:
            if s in keep or (every is not None and s % every == 0) or s > max(keep, default=-1):
                continue
            self.store.delete([f"{step_dir_name(s)}/{UPLOAD_MANIFEST_NAME}"])  # un-commit first
            rest = [k for k in self.store.list_keys(step_dir_name(s) + "/")]
            self.store.delete(rest)
            deleted.append(s)
            log.info("step %d: deleted remotely (retention keeps the last %d)", s, keep_n)
        return deleted

    # ------------------------------------------------------------------------------ internals

    def _learn_newest_remote(self) -> None:
        """At start: the newest local step carrying the marker feeds the time-at-risk gauge."""
        for s in reversed(committed_steps(self.local_root)):
            sdir = step_path(self.local_root, s)
            if self._marked_for_this_remote(sdir):
                try:
                    _, m = self._read_local_manifest(s, sdir)
                except (CheckpointError, OSError):
                    continue
                self.newest_remote_commit = (s, _parse_time(m.created_at))
                if self.metrics is not None:
                    self.metrics.set_newest_remote(s, self.newest_remote_commit[1])
                return

    def _select_pending(self) -> list[int]:
        pending = self.pending_steps()
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(pending))
        if self.policy.skip_intermediate and len(pending) > 1:
            for s in pending[1:]:
                self._release_skipped(s)
            pending = pending[:1]
        return pending

    def _release_skipped(self, step: int) -> None:
        sdir = step_path(self.local_root, step)
        try:
            atomic_write_json(sdir / UPLOADED_MARKER_NAME, {"step": step, "skipped": True,
                                                            "remote": self.store.url})
            log.info("step %d: skipped (skip_intermediate); released for rotation", step)
        except OSError as e:
            log.warning("step %d: could not write the skip marker: %s", step, e)

    def _read_local_manifest(self, step: int, sdir: Path) -> tuple[bytes, ShardManifest]:
        try:
            data = (sdir / MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            if not sdir.is_dir():
                raise LocalStepGoneError(f"step {step}: {sdir} disappeared") from None
            raise NoCheckpointError(f"step {step} is not committed under {self.local_root}") from None
        m = ShardManifest.from_json(data)
        if m.step != step:
            raise ManifestError(f"{sdir / MANIFEST_NAME} says step {m.step}")
        return data, m

    def _retrying(self, op_name: str, fn: Callable[[], Any], retryable: Callable[[BaseException], bool]
                  = is_retryable_s3_error) -> Any:
        return call_with_retries(op_name, fn, policy=self.retry, stop_event=self.stop_event,
                                 is_retryable=retryable)

    def _get_json(self, key: str) -> bytes | None:
        from tiered_ckpt.store import RemoteNotFoundError
        try:
            return self.store.get_bytes(key)
        except RemoteNotFoundError:
            return None

    def _upload_step_locked(self, step: int, sdir: Path, stats: _Stats) -> UploadManifest:
        mbytes, m = self._read_local_manifest(step, sdir)
        msha = hashlib.sha256(mbytes).hexdigest()
        um_key = f"{step_dir_name(step)}/{UPLOAD_MANIFEST_NAME}"
        existing = self._get_json(um_key)
        if existing is not None:
            um = UploadManifest.from_json(existing)
            if um.manifest_sha256 != msha:
                raise UploadError(f"step {step}: {self.store.url}/{um_key} mirrors another save of this step "
                                  f"(manifest sha256 {um.manifest_sha256[:12]}, local {msha[:12]}); refusing "
                                  f"to overwrite a remotely committed step")
            log.info("step %d: already committed remotely", step)
            return self._after_commit(step, sdir, m, um, existing)

        self.store.put_bytes(f"{step_dir_name(step)}/{MANIFEST_NAME}", mbytes)
        local = [rec for rec in m.shards if (sdir / rec.path).is_file()]
        if not local and not sdir.is_dir():
            raise LocalStepGoneError(f"step {step}: {sdir} disappeared")
        log.info("step %d: %d of %d shard(s) on this node, %d bytes", step, len(local), m.world_size,
                 sum(r.size_bytes for r in local))
        futures = [self._shard_executor.submit(self._upload_shard, step, sdir, m, rec, stats) for rec in local]
        errors = []
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - collected; the first is raised below
                errors.append(e)
        if errors:
            for e in errors[1:]:
                if isinstance(e, OperationInterruptedError):  # a requested stop, not a failure
                    log.debug("step %d: another shard transfer stopped: %s", step, e)
                else:
                    log.error("step %d: another shard failed too: %s: %s", step, type(e).__name__, e)
            raise errors[0]

        shards = []
        missing = []
        for rec in m.shards:
            raw = self._get_json(_confirm_key(step, rec.rank))
            c = _parse_confirm(raw)
            if c is None or c.get("sha256") != rec.sha256 or c.get("save_id") != m.save_id \
                    or c.get("size_bytes") != rec.size_bytes:
                missing.append(rec.rank)
                continue
            shards.append(RemoteShard(rank=rec.rank, key=remote_key(self.prefix, step, shard_file_name(rec.rank)),
                                      size_bytes=rec.size_bytes, sha256=rec.sha256,
                                      confirmed_by=str(c.get("confirmed_by"))))
        if missing:
            raise StepIncompleteError(f"step {step}: ranks {missing[:8]} not confirmed remotely yet", missing)
        um = UploadManifest(step=step, world_size=m.world_size, save_id=m.save_id, prefix=self.prefix,
                            manifest_key=remote_key(self.prefix, step, MANIFEST_NAME), manifest_sha256=msha,
                            shards=tuple(shards))
        body = um.to_json().encode()
        if not (sdir / MANIFEST_NAME).is_file():
            raise LocalStepGoneError(f"step {step}: {sdir} was deleted during the upload; not committing it")
        try:
            self.store.put_bytes(um_key, body, if_none_match=True)
            log.info("step %d: committed remotely (%s)", step, self.store.url)
        except PreconditionFailedError:
            other = self._get_json(um_key)
            if other != body:
                raise UploadError(f"step {step}: another writer committed different content to "
                                  f"{self.store.url}/{um_key}") from None
            log.info("step %d: upload manifest already written by another sidecar (identical)", step)
        return self._after_commit(step, sdir, m, um, body)

    def _after_commit(self, step: int, sdir: Path, m: ShardManifest, um: UploadManifest,
                      body: bytes) -> UploadManifest:
        self._move_latest(step, hashlib.sha256(body).hexdigest())
        try:
            atomic_write_json(sdir / UPLOADED_MARKER_NAME, {"step": step, "remote": self.store.url,
                                                            "upload_manifest_sha256":
                                                                hashlib.sha256(body).hexdigest()})
        except FileNotFoundError:
            log.warning("step %d: local step vanished after the remote commit; no marker written", step)
        if self.metrics is not None:
            self.metrics.steps.inc()
        commit_t = _parse_time(m.created_at)
        if self.newest_remote_commit is None or step >= self.newest_remote_commit[0]:
            self.newest_remote_commit = (step, commit_t)
            if self.metrics is not None:
                self.metrics.set_newest_remote(step, commit_t)
        return um

    def _upload_shard(self, step: int, sdir: Path, m: ShardManifest, rec: Any, stats: _Stats) -> None:
        key = f"{step_dir_name(step)}/{shard_file_name(rec.rank)}"
        ckey = _confirm_key(step, rec.rank)
        c = _parse_confirm(self._get_json(ckey))
        if c is not None and c.get("sha256") == rec.sha256 and c.get("save_id") == m.save_id:
            info = self.store.head(key)
            if info is not None and info.size_bytes == rec.size_bytes:
                log.info("step %d rank %d: already confirmed (%s), not re-sent", step, rec.rank,
                         c.get("confirmed_by"))
                return
        for mpu in list(self.store.list_multipart_uploads(key)):
            if mpu.key == key:
                self.store.abort_multipart_upload(mpu.key, mpu.upload_id)
                log.info("step %d rank %d: aborted leftover multipart upload %s", step, rec.rank, mpu.upload_id)
        validates = self.server_validates_checksums()
        force_rb = self.policy.verify == "read-back"

        def attempt() -> tuple[SentShard, str]:
            try:
                sent = send_shard(self.store, key, sdir / rec.path, expected_size=rec.size_bytes,
                                  expected_sha256=rec.sha256, part_executor=self._part_executor,
                                  part_slots=self._part_slots, extra_args=self.write.extra_args(),
                                  stop_event=self.stop_event, on_progress=self.on_progress)
            except FileNotFoundError as e:
                raise LocalStepGoneError(f"step {step} rank {rec.rank}: {sdir / rec.path} disappeared",
                                         last_exception=e) from e
            t = time.monotonic()
            how = confirm_shard(self.store, key, sent, server_validates=validates, expected_sha256=rec.sha256,
                                force_read_back=force_rb, stop_event=self.stop_event)
            if how == "read-back":
                with stats.lock:
                    stats.read_back_s += time.monotonic() - t
            return sent, how

        def retryable(e: BaseException) -> bool:
            if isinstance(e, LocalShardError):
                return False
            if isinstance(e, TransitCorruptionError):
                return True
            from tiered_ckpt.retry import s3_error_code_and_status
            return s3_error_code_and_status(e)[0] == "NoSuchUpload" or is_retryable_s3_error(e)

        log.info("step %d rank %d: uploading %d bytes to %s/%s", step, rec.rank, rec.size_bytes,
                 self.store.url, key)
        try:
            sent, how = self._retrying(f"step {step} rank {rec.rank}: upload {self.store.url}/{key}", attempt,
                                       retryable)
        except UploadError as e:
            if isinstance(e.last_exception, LocalShardError):  # local rot: keep its own type
                raise e.last_exception from None
            raise
        record = {"rank": rec.rank, "key": remote_key(self.prefix, step, shard_file_name(rec.rank)),
                  "size_bytes": sent.size_bytes, "sha256": sent.sha256_hex, "confirmed_by": how,
                  "checksum_algorithm": sent.checksum_algorithm, "checksum": sent.checksum_b64,
                  "save_id": m.save_id}
        self.store.put_bytes(ckey, (json.dumps(record, sort_keys=True) + "\n").encode())
        with stats.lock:
            stats.bytes_sent += sent.size_bytes
        if self.metrics is not None:
            self.metrics.bytes.inc(sent.size_bytes)
        log.info("step %d rank %d: confirmed (%s)", step, rec.rank, how)

    def _read_latest(self) -> tuple[LatestPointer | None, str | None]:
        from tiered_ckpt.layout import LATEST_POINTER_NAME
        info = self.store.head(LATEST_POINTER_NAME)
        if info is None:
            return None, None
        raw = self._get_json(LATEST_POINTER_NAME)
        if raw is None:
            return None, None
        try:
            return LatestPointer.from_json(raw), info.etag
        except ManifestError:
            log.warning("%s/latest is unreadable; it will be replaced", self.store.url)
            return None, info.etag

    def _move_latest(self, step: int, um_sha256: str) -> None:
        """Move ``latest`` to ``step`` unless it already names a newer (or the same) step."""
        from tiered_ckpt.layout import LATEST_POINTER_NAME
        body = LatestPointer(step, um_sha256).to_json().encode()
        for _ in range(20):
            cur, etag = self._read_latest()
            if cur is not None and cur.step >= step:
                return
            try:
                if etag is None:
                    self.store.put_bytes(LATEST_POINTER_NAME, body, if_none_match=True)
                else:
                    self.store.put_bytes(LATEST_POINTER_NAME, body, if_match=etag)
                log.info("step %d: latest pointer moved forward", step)
                return
            except PreconditionFailedError:
                continue  # someone moved it meanwhile: look again
        raise UploadError(f"step {step}: could not move {self.store.url}/latest after 20 conditional attempts")


def _parse_confirm(raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _parse_time(text: str) -> float:
    from datetime import datetime
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return time.time()


def _listdir(p: Path) -> list[str]:
    try:
        return os.listdir(p)
    except OSError:
        return []


__all__ = ["Uploader", "UploadPolicy", "UploadManifest", "StepTiming", "LocalStepGoneError",
           "StepIncompleteError"]
