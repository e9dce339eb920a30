"""Uploading one step from this node: the local half around the remote commit protocol (SPEC §4,
§11).

:func:`upload_step` is what :meth:`tiered_ckpt.remote.upload.uploader.Uploader.upload_step` runs
for step ``S`` (every node's sidecar, for the shards on its own disk), with the uploader's
:class:`~tiered_ckpt.remote.upload.session.UploadSession`:

1. Hold an ``upload`` step lock (:mod:`tiered_ckpt.locks`: rotation skips the step) and read
   ``manifest.json``. A step directory that is gone raises :class:`~tiered_ckpt.remote.errors.LocalStepGoneError`
   (nothing committed remotely); a step without a manifest is not committed locally
   (``NoCheckpointError``).
2. **Lineage** (once per step, not per poll): the root's ``run.json`` and the bucket's are
   reconciled by :func:`tiered_ckpt.remote.lineage.claim_or_check` (one GET in the steady state; a
   claim, a newer attempt published, or ``RunMismatchError`` for a prefix of another run unless
   ``adopt_prefix``). A step that either record supersedes raises
   :class:`~tiered_ckpt.remote.errors.StepSupersededError`: never uploaded, no ``uploaded.json``.
3. Run :class:`~tiered_ckpt.remote.upload.commit.RemoteStepCommit` on the save's own keys: already
   committed -> straight to ``latest``; otherwise mirror the manifest, upload the local shards
   concurrently (:mod:`tiered_ckpt.remote.upload.shard_upload`), gather every rank's confirmation, re-check
   the local step, fence and write the upload manifest. Waiting for other nodes raises
   ``StepIncompleteError`` carrying the commit object; passed back as ``resume`` it makes the next
   poll one LIST.
4. Move ``latest``, mirror the step's pin (``pinned.json``) to the save's prefix, and write
   ``<step_dir>/uploaded.json`` with the manifest's sha256 (:mod:`tiered_ckpt.local.markers`);
   upload-gated rotation relies on it.

:func:`mirror_pins` mirrors the pins of steps uploaded earlier (one HEAD per pinned step not
mirrored yet).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
from pathlib import Path

from tiered_ckpt.errors import CheckpointError, ManifestError, NoCheckpointError
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.records import UploadedMarker
from tiered_ckpt.format.upload_manifest import UploadManifest
from tiered_ckpt.fs import is_real_dir
from tiered_ckpt.layout import MANIFEST_NAME, PINNED_MARKER_NAME, UPLOAD_MANIFEST_NAME
from tiered_ckpt.local.catalogue import (
    committed_steps,
    read_manifest_bytes,
    read_run_record,
    step_path,
    superseded_in,
)
from tiered_ckpt.local.markers import read_uploaded_marker, write_uploaded_marker
from tiered_ckpt.local.pins import MAX_PIN_BYTES, has_pin, pin_bytes
from tiered_ckpt.locks import acquire_step_lock, release_step_lock
from tiered_ckpt.remote.catalogue import save_key
from tiered_ckpt.remote.errors import LocalStepGoneError, StepIncompleteError, StepSupersededError
from tiered_ckpt.remote.lineage import claim_or_check
from tiered_ckpt.remote.upload.commit import RemoteStepCommit
from tiered_ckpt.remote.upload.session import StepStats, UploadSession
from tiered_ckpt.remote.upload.shard_upload import upload_shard
from tiered_ckpt.retry import OperationInterruptedError
from tiered_ckpt.safe_read import is_regular_file
from tiered_ckpt.store.base import ObjectStore

log = logging.getLogger(__name__)


def read_local_manifest(local_root: Path, step: int, sdir: Path) -> tuple[bytes, ShardManifest]:
    """The exact bytes and parsed form of ``sdir/manifest.json``, read as the local catalogue reads
    it (never through a symlink, size-capped). Raises :class:`LocalStepGoneError` (directory gone),
    ``NoCheckpointError`` (no manifest), ``ManifestError`` (a symlink, not a regular file, invalid,
    or another step's)."""
    data = read_manifest_bytes(sdir)
    if data is None:
        if not is_real_dir(sdir):
            raise LocalStepGoneError(f"step {step}: {sdir} disappeared")
        raise NoCheckpointError(f"step {step} is not committed under {local_root}")
    m = ShardManifest.from_json(data)
    if m.step != step:
        raise ManifestError(f"{sdir / MANIFEST_NAME} says step {m.step}")
    return data, m


def check_lineage(
    store: ObjectStore, local_root: Path, m: ShardManifest, *, adopt_prefix: bool = False
) -> RunLineage | None:
    """Step 2 of the module docstring: reconcile the root's and the bucket's run records and refuse
    a superseded step. Returns the record in effect. Raises :class:`StepSupersededError`,
    ``RunMismatchError``, ``LineageError``, ``ManifestError`` (an unreadable record),
    ``UploadError``."""
    local = read_run_record(local_root)
    lineage = claim_or_check(store, local, adopt=adopt_prefix)
    for rec, where in ((local, f"{local_root}/run.json"), (lineage, f"{store.url}/run.json")):
        # the catalogue's rule: a step restored from another run is judged by its adopted attempt
        sup = superseded_in(local_root, m.step, rec)
        if sup is not None:
            raise StepSupersededError(m.step, sup, where=where)
    return lineage


def _upload_local_shards(
    session: UploadSession, commit: RemoteStepCommit, sdir: Path, stats: StepStats
) -> None:
    """Step 3 of the commit protocol for every shard of the step present in ``sdir``; raises the
    first failure after every transfer has ended (the others are logged). An interrupt of this
    thread (Ctrl-C, SIGTERM) cancels the transfers (``session.cancel``: requests in flight cut,
    multipart uploads aborted) and propagates once they have ended."""
    step, m = commit.step, commit.manifest
    # any entry counts (send_shard refuses a symlink, FIFO or directory loudly); absent: another
    # node's
    local = [rec for rec in m.shards if os.path.lexists(sdir / rec.path)]
    if not local and not is_real_dir(sdir):
        raise LocalStepGoneError(f"step {step}: {sdir} disappeared")
    log.debug(
        "step %d: %d of %d shard(s) on this node, %d bytes",
        step,
        len(local),
        m.world_size,
        sum(r.size_bytes for r in local),
    )
    futures = [
        session.shard_executor.submit(upload_shard, session, commit, sdir, rec, stats)
        for rec in local
    ]
    try:
        errors = [
            e for e in (f.exception() for f in futures) if e is not None
        ]  # the first is raised below
    except (
        BaseException
    ):  # an interrupt of this thread: cut the transfers rather than wait them out
        session.cancel()
        for f in futures:
            f.cancel()
        concurrent.futures.wait(futures)  # each shard ends within a tick or two, its upload aborted
        raise
    if errors:
        for e in errors[1:]:
            if isinstance(e, OperationInterruptedError):  # a requested stop, not a failure
                log.debug("step %d: another shard transfer stopped: %s", step, e)
            else:
                log.error("step %d: another shard failed too: %s: %s", step, type(e).__name__, e)
        raise errors[0]


def mirror_pin(
    store: ObjectStore,
    step: int,
    key_save_id: str | None,
    sdir: Path,
    *,
    known_absent: bool = False,
) -> bool:
    """PUT ``sdir/pinned.json`` to the save's prefix unless HEAD finds it there (``known_absent``:
    the caller's HEAD just did not; SPEC §11: a pin holds in the bucket too; retention never removes
    a pinned save). Returns whether the save is pinned remotely now. A local pin that vanished
    meanwhile, or one over :data:`MAX_PIN_BYTES`, is not mirrored."""
    if not has_pin(sdir):
        return False
    key = save_key(step, key_save_id, PINNED_MARKER_NAME)
    if not known_absent and store.head(key) is not None:
        return True
    body = pin_bytes(sdir)  # never follows a symlink or opens a FIFO; a placeholder for those
    if body is None:  # unpinned meanwhile
        return False
    store.put_bytes(key, body)
    log.info("step %d: pin mirrored to %s/%s", step, store.url, key)
    return True


def mirror_pins(
    store: ObjectStore, local_root: Path, done: set[tuple[int, str]] | None = None
) -> list[int]:
    """Mirror the pins of local steps already uploaded to ``store`` (their ``uploaded.json`` names
    it): one HEAD per pinned step not in ``done`` (``(step, save_id)`` pairs mirrored earlier, kept
    by the caller across passes and updated here), a PUT when missing. A step uploaded by a round-1
    sidecar (its save has no upload manifest under the per-save keys) gets the pin in its round-1
    prefix. Returns the steps pinned remotely by this call. Raises ``UploadError``."""
    done = set() if done is None else done
    out = []
    for step in committed_steps(local_root):
        sdir = step_path(local_root, step)
        if not has_pin(sdir):
            continue
        marker = read_uploaded_marker(sdir)
        if marker is None or marker.skipped or not marker.names_remote(store.url):
            continue
        try:
            _, m = read_local_manifest(local_root, step, sdir)
        except (CheckpointError, OSError):
            continue
        if (step, m.save_id) in done:
            continue
        sid: str | None = m.save_id
        if store.head(save_key(step, sid, PINNED_MARKER_NAME)) is not None:
            done.add((step, m.save_id))
            continue
        if store.head(save_key(step, sid, UPLOAD_MANIFEST_NAME)) is None:
            sid = None  # a round-1 upload of this step
        if mirror_pin(store, step, sid, sdir, known_absent=sid is not None):
            done.add((step, m.save_id))
            out.append(step)
    return out


def _commit_locked(
    session: UploadSession,
    step: int,
    sdir: Path,
    stats: StepStats,
    resume: RemoteStepCommit | None,
) -> tuple[UploadManifest, ShardManifest]:
    local_root, store = session.local_root, session.store
    mbytes, m = read_local_manifest(local_root, step, sdir)
    commit = resume if resume is not None and resume.matches(step, mbytes) else None
    done = None
    if commit is None:
        check_lineage(store, local_root, m, adopt_prefix=session.adopt_prefix)
        commit = RemoteStepCommit(store, store.prefix, step, mbytes, m, session.key_layout)
        done = commit.committed()
    if done is not None:
        log.info("step %d: already committed remotely", step)
        um, body = done
    else:
        commit.put_manifest()
        _upload_local_shards(session, commit, sdir, stats)
        try:
            um = commit.gather()
        except StepIncompleteError as e:
            e.commit = commit
            raise
        # Another node may have committed while we waited (one GET instead of a fence); not asked
        # when this root holds every shard and this is the first pass (nobody else uploads this
        # save).
        waited = resume is not None or not all(os.path.lexists(sdir / rec.path) for rec in m.shards)
        done = commit.committed() if waited else None
        if done is not None:
            um, body = done
        else:
            if not is_regular_file(sdir / MANIFEST_NAME):  # never through a symlink
                raise LocalStepGoneError(
                    f"step {step}: {sdir} was deleted during the upload; not committing it"
                )
            body = commit.write_upload_manifest(um)
            if body != um.to_json().encode():  # another node of this save committed first
                um = UploadManifest.from_json(body)
    commit.move_latest(body)
    mirror_pin(store, step, commit.save_id, sdir)
    try:
        write_uploaded_marker(
            sdir,
            UploadedMarker(
                step=step, remote=store.url, upload_manifest_sha256=hashlib.sha256(body).hexdigest()
            ),
            manifest_sha256=commit.manifest_sha256,
        )
    except FileNotFoundError:
        log.warning("step %d: local step vanished after the remote commit; no marker written", step)
    return um, m


def upload_step(
    session: UploadSession, step: int, *, resume: RemoteStepCommit | None = None
) -> tuple[UploadManifest, ShardManifest, StepStats]:
    """Steps 1-4 of the module docstring for ``step`` of ``session.local_root``. Returns the
    committed upload manifest, the local manifest and this node's figures. ``resume``: the commit
    object of an earlier ``StepIncompleteError`` for this step (used when the local manifest is
    still the same bytes). Errors: see
    :meth:`tiered_ckpt.remote.upload.uploader.Uploader.upload_step`, plus
    :class:`StepSupersededError`, ``RunMismatchError``, ``LineageError`` and
    :class:`~tiered_ckpt.remote.errors.FencingError` (an object changed since it was confirmed;
    nothing committed, no marker)."""
    sdir = step_path(session.local_root, step)
    stats = StepStats()
    try:
        lock = acquire_step_lock(sdir, "upload")  # rotation skips a step being uploaded
    except FileNotFoundError as e:
        raise LocalStepGoneError(f"step {step}: {sdir} does not exist", last_exception=e) from None
    try:
        um, m = _commit_locked(session, step, sdir, stats, resume)
    finally:
        release_step_lock(lock)
    return um, m, stats


__all__ = [
    "MAX_PIN_BYTES",
    "check_lineage",
    "mirror_pin",
    "mirror_pins",
    "read_local_manifest",
    "upload_step",
]
