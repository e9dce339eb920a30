"""THE remote commit protocol of one save (SPEC §4, §11): shards -> per-shard confirmation records
-> re-check (fencing) -> upload manifest written with ``If-None-Match: *`` -> ``latest`` moved
forward.

An object store has no rename, so the commit point is an object written last: a save exists for
restore only once ``upload_manifest.json`` exists (:mod:`tiered_ckpt.remote.catalogue`). One key
prefix per
save, so two saves of one step (a rollback, a replace, an old sidecar) never share an object::

    <prefix>/step_XXXXXXXXXX.<save_id>/rank_XXXXX.safetensors     one object per rank
    <prefix>/step_XXXXXXXXXX.<save_id>/manifest.json              the exact bytes of the local manifest
    <prefix>/step_XXXXXXXXXX.<save_id>/.confirm/rank_XXXXX.json   per-shard ConfirmationRecord (with ETag)
    <prefix>/step_XXXXXXXXXX.<save_id>/upload_manifest.json       remote commit point (schema 2), LAST
    <prefix>/latest                                               LatestPointer, ordered by (attempt, step)

With ``key_layout="hashed"`` (:data:`~tiered_ckpt.layout.KEY_LAYOUTS`) the shard objects alone live
at ``<prefix>/shards/<hh>/step_XXXXXXXXXX.<save_id>/rank_XXXXX.safetensors``
(:func:`~tiered_ckpt.layout.save_shard_key`); records, manifests and their LIST stay in the save
prefix, and the upload manifest records the layout. Every node of one save must use the same layout:
a confirmation record naming the other layout's key fails :meth:`~RemoteStepCommit.gather` loudly.

Lifecycle of :class:`RemoteStepCommit` for save ``(S, save_id)``. EVERY node's sidecar runs it, for
the shards on its own disk (a node-local root holds that node's ranks plus the global manifest),
under the local step's ``upload`` lock (:mod:`tiered_ckpt.remote.upload.step_upload` holds it and calls
these in order); one object may serve several polls of the same save (``resume``), remembering what
it has read:

1. :meth:`~RemoteStepCommit.committed` - GET the save's upload manifest. Present: go to 6.
2. :meth:`~RemoteStepCommit.put_manifest` - mirror ``manifest.json`` unless it is already there with
   these bytes (HEAD, at most one GET); once per object.
3. Per local shard, concurrently (:mod:`tiered_ckpt.remote.upload.shard_upload`):
   :meth:`~RemoteStepCommit.confirmed` says whether a record for this save exists and HEAD shows the
   object with the recorded ETag and size (a restart never re-sends a confirmed shard); otherwise
   the shard is sent and confirmed (:mod:`tiered_ckpt.remote.upload.transfer`) and
   :meth:`~RemoteStepCommit.record_confirmation` PUTs its record with the object's ETag.
4. :meth:`~RemoteStepCommit.gather` - one LIST of the save's ``.confirm/`` prefix; the records not
   read yet are GET only once LIST shows every rank (kept for later polls). A rank not confirmed yet
   raises :class:`~tiered_ckpt.remote.errors.StepIncompleteError`: the sidecar's loop comes back
   later.
5. The caller re-checks that the local step is still there, then
   :meth:`~RemoteStepCommit.write_upload_manifest`: first the **fence** (HEAD every shard object:
   ETag and size equal to its record; GET ``manifest.json``: sha256 equal to the local one; any
   difference is a :class:`~tiered_ckpt.remote.errors.FencingError` and nothing is committed), then
   the PUT with ``If-None-Match: *``. Losing that race to another node of the same save is fine (its
   upload manifest mirrors the same local manifest); anything else raises ``UploadError``.
6. :meth:`~RemoteStepCommit.move_latest` - ``latest`` moved only to a greater ``(attempt, step)``
   (``If-Match`` its ETag, ``If-None-Match: *`` when absent; on 412 re-read and retry). A sidecar of
   an older attempt never moves it.
7. The caller writes the local ``uploaded.json`` marker with the manifest's sha256
   (:mod:`tiered_ckpt.local.markers`).

Un-commit (remote retention) is the reverse: delete the upload manifest FIRST, then the other
objects (:mod:`tiered_ckpt.remote.upload.retention`). Confirmation records are written and read only here.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from tiered_ckpt.errors import ManifestError, UploadError
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.format.records import ConfirmationRecord
from tiered_ckpt.format.upload_manifest import LatestPointer, RemoteShard, UploadManifest
from tiered_ckpt.layout import (
    CONFIRM_DIR,
    KEY_LAYOUTS,
    LATEST_POINTER_NAME,
    MANIFEST_NAME,
    UPLOAD_MANIFEST_NAME,
    parse_shard_file_name,
    remote_save_key,
    remote_shard_key,
    save_shard_key,
)
from tiered_ckpt.remote.catalogue import (
    read_latest_pointer_versioned,
    read_upload_manifest,
    save_key,
)
from tiered_ckpt.remote.errors import FencingError, StepIncompleteError
from tiered_ckpt.remote.handle import get_or_none, object_url
from tiered_ckpt.remote.limits import (
    MAX_CONFIRMATION_BYTES,
    MAX_REMOTE_MANIFEST_BYTES,
    MAX_UPLOAD_MANIFEST_BYTES,
)
from tiered_ckpt.store.base import ObjectStore, PreconditionFailedError

log = logging.getLogger(__name__)

#: Conditional attempts to move ``latest`` before giving up (each lost one means another node moved
#: it).
LATEST_MOVE_ATTEMPTS = 20
#: HEADs in flight while fencing a save with many shards.
FENCE_CONCURRENCY = 16


def confirm_key(step: int, rank: int, save_id: str | None = None) -> str:
    """Key of ``rank``'s confirmation record of one save of ``step`` (``save_id=None``: upload schema 1, keys without a save id),
    relative to the store prefix."""
    return save_key(step, save_id, f"{CONFIRM_DIR}/rank_{rank:05d}.json")


class RemoteStepCommit:
    """One node's part in committing one save of ``step`` remotely (module docstring: order of
    calls).

    ``store``: the bucket prefix; ``prefix``: its key prefix (recorded in the upload manifest);
    ``manifest_bytes``: the exact local ``manifest.json`` bytes, ``manifest`` their parsed form (its
    ``save_id`` names the save's keys); ``key_layout``: where the shard objects go (``flat``,
    ``hashed``; module docstring). Thread-safe for :meth:`confirmed` and :meth:`record_confirmation`
    (one call per shard, concurrently); the other methods are called by one thread. Raises
    ``ValueError`` for an unknown layout.
    """

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        step: int,
        manifest_bytes: bytes,
        manifest: ShardManifest,
        key_layout: str = "flat",
    ) -> None:
        if key_layout not in KEY_LAYOUTS:
            raise ValueError(f"key_layout must be one of {KEY_LAYOUTS}, got {key_layout!r}")
        self.key_layout = key_layout
        self.store = store
        self.prefix = prefix
        self.step = step
        self.manifest_bytes = manifest_bytes
        self.manifest = manifest
        self.save_id = manifest.save_id
        self.manifest_sha256 = hashlib.sha256(manifest_bytes).hexdigest()
        self.upload_manifest_key = self.key(UPLOAD_MANIFEST_NAME)
        self._lock = threading.Lock()
        #: Valid confirmation records read or written by this object (kept across polls).
        self._records: dict[int, ConfirmationRecord] = {}
        self._manifest_mirrored = False

    def key(self, name: str) -> str:
        """Key of ``name`` in this save, relative to the store prefix."""
        return save_key(self.step, self.save_id, name)

    def full_key(self, name: str) -> str:
        """Key of ``name`` in this save, prefix included (as recorded in the upload manifest)."""
        return remote_save_key(self.prefix, self.step, self.save_id, name)

    def shard_key(self, rank: int) -> str:
        """Key of ``rank``'s shard object in this save's layout, relative to the store prefix."""
        return save_shard_key(self.step, self.save_id, rank, self.key_layout)

    def full_shard_key(self, rank: int) -> str:
        """:meth:`shard_key`, prefix included (as the records and the upload manifest name it)."""
        return remote_shard_key(self.prefix, self.step, self.save_id, rank, self.key_layout)

    def matches(self, step: int, manifest_bytes: bytes) -> bool:
        """Whether this object is for ``step`` with exactly these local manifest bytes
        (``resume``)."""
        return step == self.step and manifest_bytes == self.manifest_bytes

    # -- 1
    def committed(self) -> tuple[UploadManifest, bytes] | None:
        """The save's upload manifest and its bytes when it is already committed; ``None`` when not.
        Raises ``UploadError`` when it mirrors other local manifest bytes (a node whose copy of the
        global manifest differs), ``ManifestError`` when it is invalid."""
        got = read_upload_manifest(self.store, self.step, self.save_id)
        if got is None:
            return None
        um = got[0]
        if um.manifest_sha256 != self.manifest_sha256:
            raise UploadError(
                f"step {self.step}: {object_url(self.store, self.upload_manifest_key)} mirrors "
                f"other manifest bytes of this save (sha256 {um.manifest_sha256[:12]}, local "
                f"{self.manifest_sha256[:12]}); refusing to overwrite a remotely committed save"
            )
        return got

    # -- 2
    def put_manifest(self) -> None:
        """Mirror ``manifest.json`` unless the object already holds these bytes: HEAD (the server's
        ChecksumSHA256 where it reports one, else one GET to compare); at most once per object."""
        if self._manifest_mirrored:
            return
        key = self.key(MANIFEST_NAME)
        info = self.store.head(key)
        same = False
        if info is not None and info.size_bytes == len(self.manifest_bytes):
            b64 = base64.b64encode(hashlib.sha256(self.manifest_bytes).digest()).decode("ascii")
            if info.checksum_sha256 is not None and "-" not in info.checksum_sha256:
                same = info.checksum_sha256 == b64
            else:
                same = (
                    get_or_none(self.store, key, max_bytes=MAX_REMOTE_MANIFEST_BYTES)
                    == self.manifest_bytes
                )
        if not same:
            self.store.put_bytes(key, self.manifest_bytes)
        self._manifest_mirrored = True

    # -- 3
    def _read_confirmation(self, rank: int) -> ConfirmationRecord | None:
        try:  # over its cap (ManifestError from the store) counts as unreadable too
            raw = get_or_none(
                self.store,
                confirm_key(self.step, rank, self.save_id),
                max_bytes=MAX_CONFIRMATION_BYTES,
            )
            if raw is None:
                return None
            return ConfirmationRecord.from_json(raw)
        except ManifestError as exc:
            log.warning(
                "step %d rank %d: unreadable confirmation record (%s); the shard counts as unconfirmed",
                self.step,
                rank,
                exc,
            )
            return None

    def _valid_for(self, c: ConfirmationRecord | None, rec: ShardRecord) -> bool:
        return (
            c is not None
            and c.etag is not None
            and c.key == self.full_shard_key(rec.rank)
            and c.confirms(sha256=rec.sha256, size_bytes=rec.size_bytes, save_id=self.save_id)
        )

    def confirmed(self, rec: ShardRecord) -> ConfirmationRecord | None:
        """``rec``'s confirmation record when it names this save's bytes and HEAD shows the object
        with the recorded ETag and size; ``None`` when the shard must be sent. A record this object
        already holds costs no request."""
        with self._lock:
            held = self._records.get(rec.rank)
        if held is not None:
            return held
        c = self._read_confirmation(rec.rank)
        if not self._valid_for(c, rec):
            return None
        assert c is not None
        info = self.store.head(self.shard_key(rec.rank))
        if info is None or info.size_bytes != rec.size_bytes or info.etag != c.etag:
            return None
        with self._lock:
            self._records[rec.rank] = c
        return c

    def record_confirmation(
        self,
        rec: ShardRecord,
        *,
        size_bytes: int,
        sha256: str,
        confirmed_by: str,
        checksum_algorithm: str | None,
        checksum: str | None,
        etag: str,
    ) -> ConfirmationRecord:
        """PUT the confirmation record of ``rec``'s shard, sent and confirmed (``confirmed_by``) as
        the object with ``etag`` (the server's, from the confirming HEAD)."""
        c = ConfirmationRecord(
            rank=rec.rank,
            key=self.full_shard_key(rec.rank),
            size_bytes=size_bytes,
            sha256=sha256,
            confirmed_by=confirmed_by,
            checksum_algorithm=checksum_algorithm,
            checksum=checksum,
            save_id=self.save_id,
            etag=etag,
        )
        self.store.put_bytes(confirm_key(self.step, rec.rank, self.save_id), c.to_json().encode())
        with self._lock:
            self._records[rec.rank] = c
        return c

    # -- 4
    def gather(self) -> UploadManifest:
        """The upload manifest, built from every rank's confirmation record: one LIST of
        ``.confirm/`` (none once every record is held), then a GET of each record not held, only
        when LIST shows them all. Raises :class:`StepIncompleteError` listing the ranks not
        confirmed (yet)."""
        m = self.manifest
        with self._lock:
            need = [rec for rec in m.shards if rec.rank not in self._records]
        if need:
            listed = confirmed_ranks(self.store.list_keys(self.key(CONFIRM_DIR) + "/"))
            missing = [rec.rank for rec in need if rec.rank not in listed]
            if not missing:
                for rec in need:
                    c = self._read_confirmation(rec.rank)
                    self._check_layout(c, rec)
                    if self._valid_for(c, rec):
                        assert c is not None
                        with self._lock:
                            self._records[rec.rank] = c
                    else:
                        missing.append(rec.rank)
            if missing:
                raise StepIncompleteError(
                    f"step {self.step}: ranks {missing[:8]} not confirmed remotely yet", missing
                )
        with self._lock:
            recs = dict(self._records)
        shards = tuple(
            RemoteShard(
                rank=rec.rank,
                key=self.full_shard_key(rec.rank),
                size_bytes=rec.size_bytes,
                sha256=rec.sha256,
                confirmed_by=recs[rec.rank].confirmed_by,
                etag=recs[rec.rank].etag,
            )
            for rec in m.shards
        )
        return UploadManifest(
            step=self.step,
            world_size=m.world_size,
            save_id=m.save_id,
            prefix=self.prefix,
            manifest_key=self.full_key(MANIFEST_NAME),
            manifest_sha256=self.manifest_sha256,
            shards=shards,
            run_id=m.run_id,
            attempt=m.attempt,
            created_at=m.created_at,
            key_layout=self.key_layout,
        )

    def _check_layout(self, c: ConfirmationRecord | None, rec: ShardRecord) -> None:
        """Raise ``UploadError`` when ``c`` confirms ``rec``'s bytes at the key another layout gives
        it (a sidecar of this save run with another ``--key-layout``: waiting would never end)."""
        if c is None or c.key == self.full_shard_key(rec.rank) or c.save_id != self.save_id:
            return
        for other in KEY_LAYOUTS:
            if c.key == remote_shard_key(self.prefix, self.step, self.save_id, rec.rank, other):
                raise UploadError(
                    f"step {self.step} rank {rec.rank}: confirmed in the {other} key layout "
                    f"({c.key}), this sidecar uses {self.key_layout}: every sidecar of a job must "
                    "run with the same --key-layout"
                )

    # -- 5
    def _fence_shard(self, s: RemoteShard) -> None:
        key = self.shard_key(s.rank)
        info = self.store.head(key)
        if info is None or info.size_bytes != s.size_bytes or info.etag != s.etag:
            with self._lock:
                self._records.pop(s.rank, None)  # read (or re-sent) afresh next time
            now = "missing" if info is None else f"ETag {info.etag}, {info.size_bytes} bytes"
            raise FencingError(
                f"step {self.step}: {object_url(self.store, key)} is not the object rank {s.rank} "
                f"confirmed (now {now}; confirmed ETag {s.etag}, {s.size_bytes} bytes): it was "
                "overwritten or deleted since; not committing this save",
                key=key,
            )

    def fence(self, um: UploadManifest) -> None:
        """Re-check everything ``um`` names (SPEC §11): HEAD every shard (ETag and size equal to its
        record), GET ``manifest.json`` (sha256 equal to the local manifest's). Raises
        :class:`FencingError` naming the first object that differs; ``UploadError``."""
        shards = list(um.shards)
        if len(shards) > FENCE_CONCURRENCY:
            with ThreadPoolExecutor(FENCE_CONCURRENCY, thread_name_prefix="tc-fence") as pool:
                list(pool.map(self._fence_shard, shards))
        else:
            for s in shards:
                self._fence_shard(s)
        key = self.key(MANIFEST_NAME)
        raw = get_or_none(self.store, key, max_bytes=MAX_REMOTE_MANIFEST_BYTES)
        sha = None if raw is None else hashlib.sha256(raw).hexdigest()
        if sha != self.manifest_sha256:
            self._manifest_mirrored = False  # mirrored again next time
            raise FencingError(
                f"step {self.step}: {object_url(self.store, key)} is "
                f"{'missing' if sha is None else f'sha256 {sha[:16]}...'}, the local manifest "
                f"is {self.manifest_sha256[:16]}...: not committing this save",
                key=key,
            )

    def write_upload_manifest(self, um: UploadManifest) -> bytes:
        """:meth:`fence`, then PUT ``um`` with ``If-None-Match: *``: the commit point. Returns the
        bytes now committed. Raises :class:`FencingError`, ``UploadError`` (another writer committed
        an upload manifest that mirrors other manifest bytes)."""
        self.fence(um)
        body = um.to_json().encode()
        key = self.upload_manifest_key
        try:
            self.store.put_bytes(key, body, if_none_match=True)
            log.debug(
                "step %d: save %s committed remotely (%s)", self.step, self.save_id, self.store.url
            )
            return body
        except PreconditionFailedError:
            pass
        other = get_or_none(self.store, key, max_bytes=MAX_UPLOAD_MANIFEST_BYTES)
        if other == body:
            log.info(
                "step %d: upload manifest already written by another sidecar (identical)", self.step
            )
            return body
        try:
            theirs = UploadManifest.from_json(other) if other is not None else None
        except ManifestError:
            theirs = None
        if (
            theirs is None
            or theirs.manifest_sha256 != self.manifest_sha256
            or theirs.save_id != self.save_id
        ):
            raise UploadError(
                f"step {self.step}: another writer committed different content to "
                f"{object_url(self.store, key)}"
            )
        log.info(
            "step %d: another sidecar committed this save first (its shard ETags differ from ours: a "
            "shard was re-sent); using its upload manifest",
            self.step,
        )
        assert other is not None
        return other

    # -- 6
    def _names_a_commit(self, cur: LatestPointer) -> bool:
        return _pointer_names_a_commit(self.store, cur)

    def move_latest(self, upload_manifest_bytes: bytes) -> None:
        """Move ``latest`` to this save unless it already names a greater or equal ``(attempt,
        step)`` of a save that exists (one GET, only when the pointer is ahead: a pointer naming no
        committed save is replaced). Raises ``UploadError`` after :data:`LATEST_MOVE_ATTEMPTS` lost
        conditional writes."""
        ptr = LatestPointer(
            self.step,
            hashlib.sha256(upload_manifest_bytes).hexdigest(),
            self.manifest.attempt,
            self.save_id,
        )
        body = ptr.to_json().encode()
        for _ in range(LATEST_MOVE_ATTEMPTS):
            cur, etag = read_latest_pointer_versioned(self.store)
            if cur is not None and cur.order > ptr.order and not self._names_a_commit(cur):
                log.warning(
                    "step %d: latest names (attempt, step) %s, but no such committed save exists; "
                    "replacing it",
                    self.step,
                    cur.order,
                )
            elif cur is not None and cur.order >= ptr.order:
                if cur.order > ptr.order:
                    log.info(
                        "step %d: latest names (attempt, step) %s, newer than this save's %s; not moved",
                        self.step,
                        cur.order,
                        ptr.order,
                    )
                return
            try:
                if etag is None:
                    self.store.put_bytes(LATEST_POINTER_NAME, body, if_none_match=True)
                else:
                    self.store.put_bytes(LATEST_POINTER_NAME, body, if_match=etag)
                log.debug(
                    "step %d: latest pointer moved forward to attempt %d", self.step, ptr.attempt
                )
                return
            except PreconditionFailedError:
                continue  # someone moved it meanwhile: look again
        raise UploadError(
            f"step {self.step}: could not move {self.store.url}/latest after "
            f"{LATEST_MOVE_ATTEMPTS} conditional attempts"
        )


def _pointer_names_a_commit(store: ObjectStore, cur: LatestPointer) -> bool:
    """Whether ``cur`` names an existing upload manifest with the sha256 it records (a pointer ahead
    of us that names nothing, e.g. a hostile or hand-edited one, must not hold ``latest``
    forever)."""
    try:
        found = read_upload_manifest(store, cur.step, cur.save_id)
    except (ManifestError, UploadError):
        return True  # cannot tell: keep it (the catalogue, not latest, decides what restore picks)
    return found is not None and hashlib.sha256(found[1]).hexdigest() == cur.upload_manifest_sha256


def confirmed_ranks(keys: Iterable[str]) -> set[int]:
    """Ranks of the confirmation records (``.../.confirm/rank_XXXXX.json``) among ``keys``."""
    out = set()
    for k in keys:
        name = k.rsplit("/", 1)[-1]
        if name.endswith(".json"):
            r = parse_shard_file_name(name[: -len(".json")] + ".safetensors")
            if r is not None:
                out.add(r)
    return out


__all__ = [
    "CONFIRM_DIR",
    "FENCE_CONCURRENCY",
    "LATEST_MOVE_ATTEMPTS",
    "RemoteStepCommit",
    "confirm_key",
    "confirmed_ranks",
]
