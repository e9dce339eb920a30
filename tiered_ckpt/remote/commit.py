"""THE remote commit protocol of one step (SPEC §4): shards -> per-shard confirmation records -> upload
manifest written with ``If-None-Match: *`` -> ``latest`` pointer moved forward.

An object store has no rename, so the commit point is an object written last: a step exists for restore
only once ``upload_manifest.json`` exists (:mod:`tiered_ckpt.remote.catalogue`). Remote layout (``prefix``
from ``s3://bucket/prefix``)::

    <prefix>/step_XXXXXXXXXX/rank_XXXXX.safetensors        one object per rank
    <prefix>/step_XXXXXXXXXX/manifest.json                 the exact bytes of the local manifest
    <prefix>/step_XXXXXXXXXX/.confirm/rank_XXXXX.json      per-shard ConfirmationRecord
    <prefix>/step_XXXXXXXXXX/upload_manifest.json          remote commit point, written LAST
    <prefix>/latest                                        LatestPointer, moved forward only

Lifecycle of :class:`RemoteStepCommit` for step ``S``. EVERY node's sidecar runs it, for the shards on its
own disk (a node-local root holds that node's ranks plus the global manifest), under the local step's
``upload`` lock (:mod:`tiered_ckpt.remote.step_upload` holds it and calls these in order):

1. :meth:`RemoteStepCommit.committed` - GET the upload manifest. Present with the same local manifest
   (sha256): the step is already committed, go to 6. Present for another save: ``UploadError``.
2. :meth:`RemoteStepCommit.put_manifest` - PUT ``manifest.json`` (identical bytes from every node).
3. Per local shard, concurrently (:mod:`tiered_ckpt.remote.shard_upload`): :meth:`~RemoteStepCommit.confirmed`
   says whether a record for this save and a HEAD of the same size exist (a restart never re-sends a
   confirmed shard); otherwise the shard is sent and confirmed (:mod:`tiered_ckpt.remote.transfer`) and
   :meth:`~RemoteStepCommit.record_confirmation` PUTs its record.
4. :meth:`RemoteStepCommit.gather` - GET every rank's record (GET, never LIST). A rank not confirmed yet
   (another node still uploading) raises :class:`~tiered_ckpt.remote.errors.StepIncompleteError`: the
   sidecar's loop comes back later.
5. The caller re-checks that the local step is still there, then :meth:`RemoteStepCommit.write_upload_manifest`
   PUTs it with ``If-None-Match: *``. Losing that race to another node is fine when its bytes are identical
   (the content is deterministic); different bytes raise ``UploadError``. So the LAST confirmer writes it,
   exactly once, and it never names a shard whose record is missing.
6. :meth:`RemoteStepCommit.move_latest` - ``latest`` moved forward (``If-Match`` its ETag, ``If-None-Match:
   *`` when absent; on 412 re-read and retry; never backwards). Every node that sees the commit calls it.
7. The caller writes the local ``uploaded.json`` marker (:mod:`tiered_ckpt.local.markers`).

Un-commit (remote retention) is the reverse: delete the upload manifest FIRST, then the other objects
(:mod:`tiered_ckpt.remote.retention`). Confirmation records are written and read only here.
"""

from __future__ import annotations

import hashlib
import logging

from tiered_ckpt.errors import ManifestError, UploadError
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.format.records import ConfirmationRecord
from tiered_ckpt.format.upload_manifest import LatestPointer, RemoteShard, UploadManifest
from tiered_ckpt.layout import (CONFIRM_DIR, LATEST_POINTER_NAME, MANIFEST_NAME, UPLOAD_MANIFEST_NAME, remote_key,
                                shard_file_name)
from tiered_ckpt.remote.catalogue import get_or_none, read_latest_pointer_versioned, read_upload_manifest, step_key
from tiered_ckpt.remote.errors import StepIncompleteError
from tiered_ckpt.store.base import ObjectStore, PreconditionFailedError

log = logging.getLogger(__name__)

#: Conditional attempts to move ``latest`` before giving up (each lost one means another node moved it).
LATEST_MOVE_ATTEMPTS = 20


def confirm_key(step: int, rank: int) -> str:
    """Key of ``rank``'s confirmation record of ``step``, relative to the store prefix."""
    return step_key(step, f"{CONFIRM_DIR}/rank_{rank:05d}.json")


class RemoteStepCommit:
    """One node's part in committing ``step`` remotely (see the module docstring for the order of calls).

    ``store``: the bucket prefix; ``prefix``: its key prefix (recorded in the upload manifest);
    ``manifest_bytes``: the exact local ``manifest.json`` bytes, ``manifest`` their parsed form.
    Thread-safe for :meth:`confirmed` and :meth:`record_confirmation` (one call per shard, concurrently).
    """

    def __init__(self, store: ObjectStore, prefix: str, step: int, manifest_bytes: bytes,
                 manifest: ShardManifest) -> None:
        self.store = store
        self.prefix = prefix
        self.step = step
        self.manifest_bytes = manifest_bytes
        self.manifest = manifest
        self.manifest_sha256 = hashlib.sha256(manifest_bytes).hexdigest()
        self.upload_manifest_key = step_key(step, UPLOAD_MANIFEST_NAME)

    # -- 1
    def committed(self) -> tuple[UploadManifest, bytes] | None:
        """The step's upload manifest and its bytes when the step is already committed for this save;
        ``None`` when not committed. Raises ``UploadError`` when it is committed for another save."""
        got = read_upload_manifest(self.store, self.step)
        if got is None:
            return None
        um = got[0]
        if um.manifest_sha256 != self.manifest_sha256:
            raise UploadError(f"step {self.step}: {self.store.url}/{self.upload_manifest_key} mirrors another save "
                              f"of this step (manifest sha256 {um.manifest_sha256[:12]}, local "
                              f"{self.manifest_sha256[:12]}); refusing to overwrite a remotely committed step")
        return got

    # -- 2
    def put_manifest(self) -> None:
        """PUT the mirrored ``manifest.json``."""
        self.store.put_bytes(step_key(self.step, MANIFEST_NAME), self.manifest_bytes)

    # -- 3
    def _read_confirmation(self, rank: int) -> ConfirmationRecord | None:
        raw = get_or_none(self.store, confirm_key(self.step, rank))
        if raw is None:
            return None
        try:
            return ConfirmationRecord.from_json(raw)
        except ManifestError as exc:
            log.warning("step %d rank %d: unreadable confirmation record (%s); the shard counts as unconfirmed",
                        self.step, rank, exc)
            return None

    def _valid_for(self, c: ConfirmationRecord | None, rec: ShardRecord) -> bool:
        return c is not None and c.confirms(sha256=rec.sha256, size_bytes=rec.size_bytes,
                                            save_id=self.manifest.save_id)

    def confirmed(self, rec: ShardRecord) -> ConfirmationRecord | None:
        """``rec``'s confirmation record when it names this save's bytes and the object is there with the
        manifest's size (HEAD); ``None`` when the shard must be sent."""
        c = self._read_confirmation(rec.rank)
        if not self._valid_for(c, rec):
            return None
        info = self.store.head(step_key(self.step, shard_file_name(rec.rank)))
        return c if info is not None and info.size_bytes == rec.size_bytes else None

    def record_confirmation(self, rec: ShardRecord, *, size_bytes: int, sha256: str, confirmed_by: str,
                            checksum_algorithm: str | None, checksum: str | None) -> ConfirmationRecord:
        """PUT the confirmation record of ``rec``'s shard, sent and confirmed (``confirmed_by``)."""
        c = ConfirmationRecord(rank=rec.rank, key=remote_key(self.prefix, self.step, shard_file_name(rec.rank)),
                               size_bytes=size_bytes, sha256=sha256, confirmed_by=confirmed_by,
                               checksum_algorithm=checksum_algorithm, checksum=checksum,
                               save_id=self.manifest.save_id)
        self.store.put_bytes(confirm_key(self.step, rec.rank), c.to_json().encode())
        return c

    # -- 4
    def gather(self) -> UploadManifest:
        """The upload manifest, built from every rank's confirmation record. Raises
        :class:`StepIncompleteError` listing the ranks not confirmed (yet)."""
        m = self.manifest
        shards = []
        missing = []
        for rec in m.shards:
            c = self._read_confirmation(rec.rank)
            if c is None or not self._valid_for(c, rec):
                missing.append(rec.rank)
                continue
            shards.append(RemoteShard(rank=rec.rank, key=remote_key(self.prefix, self.step, shard_file_name(rec.rank)),
                                      size_bytes=rec.size_bytes, sha256=rec.sha256, confirmed_by=c.confirmed_by))
        if missing:
            raise StepIncompleteError(f"step {self.step}: ranks {missing[:8]} not confirmed remotely yet", missing)
        return UploadManifest(step=self.step, world_size=m.world_size, save_id=m.save_id, prefix=self.prefix,
                              manifest_key=remote_key(self.prefix, self.step, MANIFEST_NAME),
                              manifest_sha256=self.manifest_sha256, shards=tuple(shards),
                              schema_version=1)  # round-1 keys until the per-save key scheme lands

    # -- 5
    def write_upload_manifest(self, um: UploadManifest) -> bytes:
        """PUT ``um`` with ``If-None-Match: *``: the commit point. Returns the bytes now committed.
        Raises ``UploadError`` when another writer committed different bytes."""
        body = um.to_json().encode()
        key = self.upload_manifest_key
        try:
            self.store.put_bytes(key, body, if_none_match=True)
            log.info("step %d: committed remotely (%s)", self.step, self.store.url)
        except PreconditionFailedError:
            other = get_or_none(self.store, key)
            if other != body:
                raise UploadError(f"step {self.step}: another writer committed different content to "
                                  f"{self.store.url}/{key}") from None
            log.info("step %d: upload manifest already written by another sidecar (identical)", self.step)
        return body

    # -- 6
    def move_latest(self, upload_manifest_bytes: bytes) -> None:
        """Move ``latest`` to this step unless it already names a newer (or the same) step. Raises
        ``UploadError`` after :data:`LATEST_MOVE_ATTEMPTS` lost conditional writes."""
        body = LatestPointer(self.step, hashlib.sha256(upload_manifest_bytes).hexdigest()).to_json().encode()
        for _ in range(LATEST_MOVE_ATTEMPTS):
            cur, etag = read_latest_pointer_versioned(self.store)
            if cur is not None and cur.step >= self.step:
                return
            try:
                if etag is None:
                    self.store.put_bytes(LATEST_POINTER_NAME, body, if_none_match=True)
                else:
                    self.store.put_bytes(LATEST_POINTER_NAME, body, if_match=etag)
                log.info("step %d: latest pointer moved forward", self.step)
                return
            except PreconditionFailedError:
                continue  # someone moved it meanwhile: look again
        raise UploadError(f"step {self.step}: could not move {self.store.url}/latest after "
                          f"{LATEST_MOVE_ATTEMPTS} conditional attempts")


__all__ = ["CONFIRM_DIR", "LATEST_MOVE_ATTEMPTS", "RemoteStepCommit", "confirm_key"]
