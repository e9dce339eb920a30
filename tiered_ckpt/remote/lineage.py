"""The run claim of a bucket prefix: ``<prefix>/run.json`` (SPEC §11, run identity and fencing).

The record is the run's :class:`~tiered_ckpt.format.lineage.RunLineage` (run id + attempts), the
same bytes as ``<root>/run.json``. Its first write (``If-None-Match: *``) is the run's **claim** on
the prefix; later writes (``If-Match`` on the ETag just read) only ever extend it, or, when an
operator passes ``--adopt-prefix``, replace another run's claim.

Lifecycle (who calls what):

1. every sidecar, once per step it uploads (:func:`tiered_ckpt.remote.upload.step_upload.upload_step`):
   :func:`claim_or_check` with the root's record. Steady state: one GET (the record already names
   this run and is at least as new as the root's). No record and no steps: the prefix is claimed. No
   record but steps (a round-1 prefix): adopted with a warning, by the same conditional PUT. The
   root's record extends the bucket's (a newer attempt started): the bucket's is moved forward
   (``If-Match``) before any step of the new attempt is uploaded. Another run, or a root without a
   record on a claimed prefix: :class:`~tiered_ckpt.errors.RunMismatchError`, unless ``adopt=True``.
2. the manager (through the local lineage decision), before the first step of a new attempt commits:
   :func:`publish_lineage` (the same rules, without adoption).
3. restore and the catalogue: :func:`read_remote_record` (one bounded GET) to tell current saves
   from superseded ones.

A lost conditional write (412) means another writer moved the record meanwhile: it is read again and
the decision made again, at most :data:`CLAIM_ATTEMPTS` times.
"""

from __future__ import annotations

import logging

from tiered_ckpt.errors import LineageError, ManifestError, RunMismatchError, UploadError
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.layout import RUN_RECORD_NAME
from tiered_ckpt.local.catalogue import MAX_RUN_RECORD_BYTES
from tiered_ckpt.remote.handle import get_or_none, object_url
from tiered_ckpt.store.base import ObjectStore, PreconditionFailedError

log = logging.getLogger(__name__)

#: Conditional writes of ``run.json`` tried before giving up (each lost one means another writer
#: won).
CLAIM_ATTEMPTS = 10


def _parse(store: ObjectStore, raw: bytes) -> RunLineage:
    if len(raw) > MAX_RUN_RECORD_BYTES:
        raise ManifestError(
            f"{object_url(store, RUN_RECORD_NAME)} is over {MAX_RUN_RECORD_BYTES} bytes"
        )
    try:
        return RunLineage.from_json(raw)
    except ManifestError as exc:
        raise ManifestError(f"{object_url(store, RUN_RECORD_NAME)} is invalid: {exc}") from exc


def read_remote_record(store: ObjectStore) -> RunLineage | None:
    """The prefix's run record, or ``None`` when there is none (an unclaimed or round-1 prefix). One
    GET of at most :data:`~tiered_ckpt.local.catalogue.MAX_RUN_RECORD_BYTES` bytes (a larger one
    is refused naming that cap). Raises
    ``ManifestError`` (too large, malformed) and ``UploadError`` (the bucket cannot be read)."""
    raw = get_or_none(store, RUN_RECORD_NAME, max_bytes=MAX_RUN_RECORD_BYTES)
    return _parse(store, raw) if raw is not None else None


def _read_raw_versioned(store: ObjectStore) -> tuple[bytes | None, str | None]:
    info = store.head(RUN_RECORD_NAME)
    if info is None:
        return None, None
    if info.size_bytes > MAX_RUN_RECORD_BYTES:
        return b"\0" * (
            MAX_RUN_RECORD_BYTES + 1
        ), info.etag  # _parse refuses it; adopt may replace it
    raw = get_or_none(store, RUN_RECORD_NAME, max_bytes=MAX_RUN_RECORD_BYTES)
    return (raw, info.etag) if raw is not None else (None, None)


def read_remote_lineage(store: ObjectStore) -> tuple[RunLineage | None, str | None]:
    """``(record, etag)`` of ``<prefix>/run.json`` for a conditional write: HEAD (ETag, size bound),
    then GET. ``(None, None)`` when there is none. Raises ``ManifestError`` (over
    :data:`~tiered_ckpt.local.catalogue.MAX_RUN_RECORD_BYTES`, malformed) and ``UploadError``."""
    raw, etag = _read_raw_versioned(store)
    return (None, None) if raw is None else (_parse(store, raw), etag)


def _has_steps(store: ObjectStore) -> bool:
    """Whether LIST shows any object of a step under the prefix (a round-1 prefix without a
    claim)."""
    return next(iter(store.list_keys("step_")), None) is not None


def _mismatch(store: ObjectStore, remote: RunLineage, local: RunLineage) -> RunMismatchError:
    return RunMismatchError(
        f"{store.url} is claimed by run {remote.run_id} ({object_url(store, RUN_RECORD_NAME)}), but this "
        f"root belongs to run {local.run_id}: two runs must not upload into one prefix. Point this sidecar "
        f"at another prefix, or pass --adopt-prefix (adopt_prefix=True) to take the prefix over for run "
        f"{local.run_id} (the steps of run {remote.run_id} stay, but are no longer restored from it)",
        claimed_by=remote.run_id,
        ours=local.run_id,
    )


def _unrecorded(store: ObjectStore, remote: RunLineage) -> RunMismatchError:
    return RunMismatchError(
        f"this root has no {RUN_RECORD_NAME} (save_sharded, or an older tiered_ckpt) but {store.url} is claimed "
        f"by run {remote.run_id}: nothing uploaded. Use another prefix, or pass --adopt-prefix "
        f"(adopt_prefix=True) to upload into run {remote.run_id}'s prefix anyway",
        claimed_by=remote.run_id,
        ours="",
    )


def _decide(
    store: ObjectStore,
    remote: RunLineage | None,
    bad: ManifestError | None,
    local: RunLineage,
    adopt: bool,
) -> RunLineage | None:
    """What the record must become: ``None`` when the bucket's (``remote``) already covers
    ``local``; else the record to write. Raises RunMismatchError, LineageError, the ``bad`` record's
    ManifestError."""
    if bad is not None:
        if not adopt:
            raise bad
        log.warning(
            "%s: replacing an unreadable run record with run %s (adopt_prefix): %s",
            store.url,
            local.run_id,
            bad,
        )
        return local
    if remote is None:
        return local
    if remote.run_id != local.run_id:
        if not adopt:
            raise _mismatch(store, remote, local)
        log.warning(
            "%s: the prefix was claimed by run %s; adopting it for run %s (adopt_prefix): steps of "
            "run %s are no longer restored from it",
            store.url,
            remote.run_id,
            local.run_id,
            remote.run_id,
        )
        return local
    if remote.extends(local):
        return None
    if local.extends(remote):
        return local
    raise LineageError(
        f"{object_url(store, RUN_RECORD_NAME)} and the root's run.json disagree about the "
        f"attempts of run {local.run_id} ({len(remote.attempts)} vs {len(local.attempts)}): "
        "diverged lineage; nothing uploaded"
    )


def claim_or_check(
    store: ObjectStore, local: RunLineage | None, *, adopt: bool = False
) -> RunLineage | None:
    """Make the prefix's run record agree with the root's ``local`` record (see the module
    docstring) and return the record in effect for the prefix afterwards (the newer of the two;
    ``None`` only when neither exists). ``local=None`` (a root without a run record:
    ``save_sharded``, an older tiered_ckpt) claims nothing; an unclaimed prefix (none, or upload schema 1)
    takes it as before, a claimed one refuses it (:class:`~tiered_ckpt.errors.RunMismatchError`
    naming the claim and ``--adopt-prefix``) unless ``adopt`` (then the claim stays as it is, with a
    warning).

    Steady state: one GET. Raises :class:`~tiered_ckpt.errors.RunMismatchError` (another run's
    claim, or any claim for ``local=None``; ``adopt`` false),
    :class:`~tiered_ckpt.errors.LineageError` (diverged records of one run), ``ManifestError`` (the
    bucket's record is unreadable and ``adopt`` is false), ``UploadError`` (the bucket cannot be
    read or written; conditional writes lost :data:`CLAIM_ATTEMPTS` times)."""
    bad: ManifestError | None = None
    try:
        remote = read_remote_record(store)
    except ManifestError as exc:
        remote, bad = None, exc
    if local is None:
        if bad is not None:
            raise bad
        if remote is not None:
            if not adopt:
                raise _unrecorded(store, remote)
            log.warning(
                "%s is claimed by run %s; uploading a root without a run record into it "
                "(adopt_prefix): its steps are judged under run %s's record",
                store.url,
                remote.run_id,
                remote.run_id,
            )
        return remote
    if bad is None and remote is not None and _decide(store, remote, None, local, adopt) is None:
        return remote
    return _write(store, local, adopt)


def _write(store: ObjectStore, local: RunLineage, adopt: bool) -> RunLineage:
    """The conditional write path of :func:`claim_or_check` (rare: a claim, a new attempt, an
    adoption)."""
    body = local.to_json().encode()
    for _ in range(CLAIM_ATTEMPTS):
        raw, etag = _read_raw_versioned(store)
        bad, remote = None, None
        if raw is not None:
            try:
                remote = _parse(store, raw)
            except ManifestError as exc:
                bad = exc
        target = _decide(store, remote, bad, local, adopt)
        if target is None:
            assert remote is not None
            return remote
        try:
            if etag is None:
                if _has_steps(store):
                    log.warning(
                        "%s holds steps but no run claim (a round-1 prefix): adopting it for run %s",
                        store.url,
                        local.run_id,
                    )
                store.put_bytes(RUN_RECORD_NAME, body, if_none_match=True)
                log.info("%s: claimed for run %s", store.url, local.run_id)
            else:
                store.put_bytes(RUN_RECORD_NAME, body, if_match=etag)
                log.info(
                    "%s: run record of run %s now names attempt %d",
                    store.url,
                    local.run_id,
                    local.attempt,
                )
            return local
        except PreconditionFailedError:
            continue  # another writer moved it meanwhile: look again
    raise UploadError(
        f"could not write {object_url(store, RUN_RECORD_NAME)} after {CLAIM_ATTEMPTS} "
        "conditional attempts"
    )


def publish_lineage(store: ObjectStore, lineage: RunLineage) -> RunLineage:
    """Publish ``lineage`` (a newer attempt decided locally) to the prefix before the attempt's
    first step commits (SPEC §11): claims an unclaimed prefix, moves the record of the same run
    forward, leaves a record that already extends it. Returns the record now in the bucket. Raises
    RunMismatchError (another run's claim), LineageError, ManifestError, UploadError as
    :func:`claim_or_check`."""
    got = claim_or_check(store, lineage)
    assert got is not None
    return got


__all__ = [
    "CLAIM_ATTEMPTS",
    "claim_or_check",
    "publish_lineage",
    "read_remote_lineage",
    "read_remote_record",
]
