"""Uploading one shard of a step: step 3 of the remote commit protocol
(:mod:`tiered_ckpt.remote.upload.commit`).

Called by :mod:`tiered_ckpt.remote.upload.step_upload` on the shard executor, one call per local shard:

1. Skip the shard if :meth:`RemoteStepCommit.confirmed` finds its record for this save and the
   object with the recorded ETag and size (a restart never re-sends a confirmed shard).
2. Abort leftover multipart uploads of that key (an earlier attempt of this node that crashed). A
   server without ListMultipartUploads or AbortMultipartUpload (501, warned once per store:
   :mod:`tiered_ckpt.store.optional_apis`) skips this step; a leftover that cannot be aborted (403)
   is recorded for a later sweep (:mod:`tiered_ckpt.remote.upload.pending_aborts`); the upload proceeds
   either way. While another live uploader holds an ``upload`` lock on the step (a second sidecar or
   ``upload --once`` on the same root), its open uploads are not leftovers: none is aborted (the
   abandoned-upload sweep finds real leftovers later, by age).
3. Send it hashing the bytes as read, and confirm it (server checksum where the bucket validates,
   else read-back; see :mod:`tiered_ckpt.remote.upload.transfer`). Failures are retried as a whole
   (:mod:`tiered_ckpt.retry`: S3 errors that may pass, ``NoSuchUpload``, transit corruption); local
   rot (:class:`~tiered_ckpt.remote.upload.transfer.LocalShardError`) is not, and keeps its own type.
4. PUT its confirmation record with the confirmed object's ETag
   (:meth:`RemoteStepCommit.record_confirmation`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tiered_ckpt.errors import UploadError
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.locks import live_locks
from tiered_ckpt.remote.errors import LocalStepGoneError
from tiered_ckpt.remote.upload.commit import RemoteStepCommit
from tiered_ckpt.remote.upload.session import StepStats, UploadSession
from tiered_ckpt.remote.upload.transfer import (
    LocalShardError,
    SentShard,
    ShardConfirmation,
    TransitCorruptionError,
    confirm_shard,
    send_shard,
)
from tiered_ckpt.retry import (
    OperationInterruptedError,
    call_with_retries,
    is_retryable_s3_error,
    s3_error_code_and_status,
)
from tiered_ckpt.store.optional_apis import OperationNotSupportedError

log = logging.getLogger(__name__)


def _retryable(e: BaseException) -> bool:
    if isinstance(e, LocalShardError):
        return False
    if isinstance(e, TransitCorruptionError):
        return True
    return s3_error_code_and_status(e)[0] == "NoSuchUpload" or is_retryable_s3_error(e)


def _abort_leftovers(session: UploadSession, key: str, what: str) -> None:
    """Step 2 of the module docstring. Raises ``OperationInterruptedError`` (stop); other remote
    failures are logged (and a leftover that cannot be aborted is recorded), never raised."""
    store = session.store
    try:
        leftovers = [mpu for mpu in store.list_multipart_uploads(key) if mpu.key == key]
    except OperationNotSupportedError:
        return  # warned once per store by the store
    except OperationInterruptedError:
        raise
    except (
        UploadError
    ) as e:  # e.g. 403: a policy without s3:ListBucketMultipartUploads; a cleanup only
        log.warning("%s: could not list leftover multipart uploads, uploading anyway: %s", what, e)
        return
    for mpu in leftovers:
        try:
            store.abort_multipart_upload(mpu.key, mpu.upload_id)
        except OperationNotSupportedError as e:
            session.record_failed_abort(mpu.key, mpu.upload_id, e)
            return
        except OperationInterruptedError:
            raise
        except UploadError as e:
            log.warning(
                "%s: could not abort leftover multipart upload %s: %s", what, mpu.upload_id, e
            )
            session.record_failed_abort(mpu.key, mpu.upload_id, e)
            continue
        log.info("%s: aborted leftover multipart upload %s", what, mpu.upload_id)


def upload_shard(
    session: UploadSession, commit: RemoteStepCommit, sdir: Path, rec: ShardRecord, stats: StepStats
) -> None:
    """Steps 1-4 of the module docstring for ``rec``'s shard in ``sdir``. Raises
    :class:`LocalStepGoneError` (file gone), ``LocalShardError`` (local rot), ``UploadError`` (after
    retries; ``OperationInterruptedError`` on stop)."""
    step, store = commit.step, session.store
    if session.stop_event.is_set():  # a shard taken up after a stop: not a request more
        raise OperationInterruptedError(f"step {step} rank {rec.rank}: stopped before its upload")
    key = commit.shard_key(rec.rank)  # in the commit's key layout (flat or hashed)
    done = commit.confirmed(rec)
    if done is not None:
        log.info(
            "step %d rank %d: already confirmed (%s), not re-sent",
            step,
            rec.rank,
            done.confirmed_by,
        )
        return
    if (
        sum(kind == "upload" for kind, _ in live_locks(sdir)) > 1
    ):  # ours and another live uploader's
        log.info(
            "step %d rank %d: another live uploader holds this step; its multipart uploads are not "
            "leftovers, none aborted",
            step,
            rec.rank,
        )
    else:
        _abort_leftovers(session, key, f"step {step} rank {rec.rank}")
    validates = session.server_validates_checksums()

    def attempt() -> tuple[SentShard, ShardConfirmation]:
        try:
            sent = send_shard(
                store,
                key,
                sdir / rec.path,
                expected_size=rec.size_bytes,
                expected_sha256=rec.sha256,
                part_executor=session.part_executor,
                part_slots=session.part_slots,
                stop_event=session.stop_event,
                on_progress=session.on_progress,
                on_abort_failed=session.record_failed_abort,
            )
        except FileNotFoundError as e:
            raise LocalStepGoneError(
                f"step {step} rank {rec.rank}: {sdir / rec.path} disappeared", last_exception=e
            ) from e
        t = time.monotonic()
        how = confirm_shard(
            store,
            key,
            sent,
            server_validates=validates,
            expected_sha256=rec.sha256,
            force_read_back=session.force_read_back,
            stop_event=session.stop_event,
        )
        if how.confirmed_by == "read-back":
            stats.add(read_back_s=time.monotonic() - t)
        return sent, how

    log.debug(
        "step %d rank %d: uploading %d bytes to %s/%s",
        step,
        rec.rank,
        rec.size_bytes,
        store.url,
        key,
    )
    try:
        sent, how = call_with_retries(
            f"step {step} rank {rec.rank}: upload {store.url}/{key}",
            attempt,
            policy=session.retry,
            stop_event=session.stop_event,
            is_retryable=_retryable,
        )
    except UploadError as e:
        if isinstance(e.last_exception, LocalShardError):  # local rot: keep its own type
            raise e.last_exception from None
        raise
    commit.record_confirmation(
        rec,
        size_bytes=sent.size_bytes,
        sha256=sent.sha256_hex,
        confirmed_by=how.confirmed_by,
        checksum_algorithm=sent.checksum_algorithm,
        checksum=sent.checksum_b64,
        etag=how.etag,
    )
    stats.add(bytes_sent=sent.size_bytes)
    session.count_sent(sent.size_bytes)
    log.debug(
        "step %d rank %d: confirmed (%s, ETag %s)", step, rec.rank, how.confirmed_by, how.etag
    )


__all__ = ["upload_shard"]
