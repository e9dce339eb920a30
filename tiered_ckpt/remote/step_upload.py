"""Uploading one step from this node: the local half around the remote commit protocol (SPEC §4).

:func:`upload_step` is what :meth:`tiered_ckpt.remote.upload.Uploader.upload_step` runs for step ``S``
(every node's sidecar, for the shards on its own disk):

1. Hold ``hold_step_lock(step_dir, "upload")`` (rotation skips the step) and read ``manifest.json``.
   A step directory that is gone raises :class:`~tiered_ckpt.remote.errors.LocalStepGoneError` (nothing
   committed remotely); a step without a manifest is not committed locally (``NoCheckpointError``).
2. Run :class:`~tiered_ckpt.remote.commit.RemoteStepCommit`: already committed -> straight to ``latest``;
   otherwise PUT the manifest, upload the local shards concurrently (:mod:`tiered_ckpt.remote.shard_upload`),
   gather every rank's confirmation, re-check the local step, write the upload manifest.
3. Move ``latest`` and write ``<step_dir>/uploaded.json`` (:mod:`tiered_ckpt.local.markers`); upload-gated
   rotation relies on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tiered_ckpt.errors import ManifestError, NoCheckpointError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.records import UploadedMarker
from tiered_ckpt.format.upload_manifest import UploadManifest
from tiered_ckpt.layout import MANIFEST_NAME
from tiered_ckpt.local.catalogue import read_manifest_bytes
from tiered_ckpt.local.markers import write_uploaded_marker
from tiered_ckpt.locks import hold_step_lock
from tiered_ckpt.remote.commit import RemoteStepCommit
from tiered_ckpt.remote.errors import LocalStepGoneError
from tiered_ckpt.remote.shard_upload import ShardSender, StepStats, upload_shard
from tiered_ckpt.retry import OperationInterruptedError

log = logging.getLogger(__name__)


def read_local_manifest(local_root: Path, step: int, sdir: Path) -> tuple[bytes, ShardManifest]:
    """The exact bytes and parsed form of ``sdir/manifest.json``, read as the local catalogue reads it (never
    through a symlink, size-capped). Raises :class:`LocalStepGoneError` (directory gone),
    ``NoCheckpointError`` (no manifest), ``ManifestError`` (a symlink, not a regular file, invalid, or
    another step's)."""
    data = read_manifest_bytes(sdir)
    if data is None:
        if not sdir.is_dir():
            raise LocalStepGoneError(f"step {step}: {sdir} disappeared")
        raise NoCheckpointError(f"step {step} is not committed under {local_root}")
    m = ShardManifest.from_json(data)
    if m.step != step:
        raise ManifestError(f"{sdir / MANIFEST_NAME} says step {m.step}")
    return data, m


def _upload_local_shards(sender: ShardSender, executor: ThreadPoolExecutor, commit: RemoteStepCommit,
                         sdir: Path, stats: StepStats) -> None:
    """Step 3 of the commit protocol for every shard of the step present in ``sdir``; raises the first
    failure after every transfer has ended (the others are logged)."""
    step, m = commit.step, commit.manifest
    local = [rec for rec in m.shards if (sdir / rec.path).is_file()]
    if not local and not sdir.is_dir():
        raise LocalStepGoneError(f"step {step}: {sdir} disappeared")
    log.info("step %d: %d of %d shard(s) on this node, %d bytes", step, len(local), m.world_size,
             sum(r.size_bytes for r in local))
    futures = [executor.submit(upload_shard, sender, commit, sdir, rec, stats) for rec in local]
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


def _commit_locked(sender: ShardSender, executor: ThreadPoolExecutor, prefix: str, local_root: Path,
                   step: int, sdir: Path, stats: StepStats) -> tuple[UploadManifest, ShardManifest]:
    mbytes, m = read_local_manifest(local_root, step, sdir)
    commit = RemoteStepCommit(sender.store, prefix, step, mbytes, m)
    done = commit.committed()
    if done is not None:
        log.info("step %d: already committed remotely", step)
        um, body = done
    else:
        commit.put_manifest()
        _upload_local_shards(sender, executor, commit, sdir, stats)
        um = commit.gather()
        if not (sdir / MANIFEST_NAME).is_file():
            raise LocalStepGoneError(f"step {step}: {sdir} was deleted during the upload; not committing it")
        body = commit.write_upload_manifest(um)
    commit.move_latest(body)
    try:
        write_uploaded_marker(sdir, UploadedMarker(step=step, remote=sender.store.url,
                                                   upload_manifest_sha256=hashlib.sha256(body).hexdigest()))
    except FileNotFoundError:
        log.warning("step %d: local step vanished after the remote commit; no marker written", step)
    return um, m


def upload_step(sender: ShardSender, executor: ThreadPoolExecutor, prefix: str, local_root: Path, step: int,
                sdir: Path, stats: StepStats) -> tuple[UploadManifest, ShardManifest]:
    """Steps 1-3 of the module docstring. Returns the committed upload manifest and the local manifest.
    Errors: see :meth:`tiered_ckpt.remote.upload.Uploader.upload_step`."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(hold_step_lock(sdir, "upload"))
        except FileNotFoundError as e:
            raise LocalStepGoneError(f"step {step}: {sdir} does not exist", last_exception=e) from None
        return _commit_locked(sender, executor, prefix, local_root, step, sdir, stats)


__all__ = ["read_local_manifest", "upload_step"]
