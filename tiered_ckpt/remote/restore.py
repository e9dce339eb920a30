"""Restore: bring a remotely committed step back to local disk after cluster loss (SPEC §5).

Lifecycle of one :func:`restore` (made by one process: the CLI, an operator's script, or each rank's
:class:`~tiered_ckpt.training.manager.CheckpointManager` through
:func:`tiered_ckpt.training.resume.prepare_load_from_remote`):

1. **Candidates** and 2. **Plan**: :mod:`tiered_ckpt.remote.restore_plan` (over the catalogue,
   :mod:`tiered_ckpt.remote.catalogue`): the newest candidate whose upload manifest GET reads (or
   the requested ``step``), its mirrored ``manifest.json`` checked against it, every shard to fetch
   HEADed. Nothing local is touched yet (``--dry-run`` stops here).
3. **Download** (:mod:`tiered_ckpt.remote.download`): the parts of all shards go through one window
   of ranged GETs (per :class:`~tiered_ckpt.store.TransferSettings`) into names staged in the local
   step directory (:meth:`LocalStepCommit.stage`), hashed as they arrive and compared with the
   manifest's sha256 and size, their safetensors headers with the manifest's records; each shard is
   fsynced as soon as it is verified, while the others still download.
4. **Commit** with the local tier's own protocol
   (:class:`~tiered_ckpt.local.commit.LocalStepCommit`): the step's writer lock is claimed with the
   remote ``save_id`` (so a live local writer of the same step is refused, I4), verified shards are
   published (fsynced, renamed into place, the directory fsynced), then the exact ``manifest.json``
   bytes that were uploaded are committed last (exclusive link, fsync the directory). Finally the
   ``uploaded.json`` marker (:mod:`tiered_ckpt.local.markers`, naming the manifest's sha256) tells
   the sidecar and upload-gated rotation that the step is already in the bucket.

**The run is carried** (SPEC §11): candidates are the *current* saves under the bucket's
``run.json`` (merged with the root's when both name one run, so a restore never picks what the
root's record supersedes). Before the shards are published, a root without a run record gets the
bucket's (the run continues there after cluster loss), a root of the same run gets it when it is
newer; a root of another run keeps its own (fine tuning from another run's checkpoint is allowed).
Such a **foreign** step (its manifest names another run than the root's record, or none) keeps its
exact manifest bytes, so it carries the other run's attempt number; it is judged by the root's
instead: ``<step>/adopted.json`` = ``{"run_id": <the root's run>, "attempt": <the root's current
attempt>, "save_id": ...}`` (:func:`tiered_ckpt.local.catalogue.read_adopted`) is written durably
after the shards are published and before the manifest commits, so a crash leaves either no
committed step or one judged by the root's attempt (a later rollback of the root supersedes it; SPEC
§11).

If the chosen step fails (an object missing, a size or sha256 mismatch, a bad upload manifest), the
error (:class:`~tiered_ckpt.errors.MissingShardError`,
:class:`~tiered_ckpt.errors.ShardCorruptedError`, :class:`~tiered_ckpt.errors.ManifestError`) names
the step and the object, the staged files are removed and nothing is committed locally. A failure
after shards were renamed into place and before ``manifest.json`` commits (ENOSPC at the manifest
write, Ctrl-C) removes the files this restore placed again; a restore that finds a dead restore's
leftovers in the step removes them before it downloads (:mod:`tiered_ckpt.remote.restore_local`): a
retry starts clean. ``fallback=True`` moves on to the next older candidate with a warning.
Remote failures that outlast the retries are :class:`~tiered_ckpt.errors.UploadError` (never a
fallback: an unreachable bucket fails older steps the same way).

``ranks=`` restores only some shards: a replaced node fetches its own ranks while the other nodes
keep their copies. The local manifest is the global one (as after a node-local save), so loading a
restored rank verifies it like any other.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered_ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointWriteError,
    ConcurrentSaveError,
)
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.records import UploadedMarker
from tiered_ckpt.layout import shard_file_name, step_dir_name
from tiered_ckpt.local.catalogue import read_manifest_bytes, read_run_record
from tiered_ckpt.local.commit import LocalStepCommit
from tiered_ckpt.local.lineage import write_run_record
from tiered_ckpt.local.markers import write_uploaded_marker
from tiered_ckpt.remote.catalogue import (
    REMOTE_BAD_UPLOAD_MANIFEST,
    REMOTE_COMMITTED,
    REMOTE_NO_UPLOAD_MANIFEST,
    REMOTE_VANISHED,
    RemoteStep,
    list_remote_steps,
    read_latest_pointer,
    remote_committed_steps,
)
from tiered_ckpt.remote.download import fetch_shards
from tiered_ckpt.remote.handle import StoreHandle
from tiered_ckpt.remote.restore_local import (
    Placed,
    clear_dead_restore,
    record_adoption,
    record_held_ranks,
    record_to_carry,
    same_save,
)
from tiered_ckpt.remote.restore_plan import (
    STEP_FAULTS,
    RemoteObject,
    RestorePlan,
    iter_plans,
    plan_restore,
)
from tiered_ckpt.store.base import ObjectStore

if TYPE_CHECKING:
    from tiered_ckpt.store import TransferSettings

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
ProgressCallback = Callable[[int], None]


@dataclass(frozen=True)
class RestoreResult:
    """What :func:`restore_detailed` did: the committed ``manifest`` and the figures of the
    transfer."""

    plan: RestorePlan
    local_step_dir: Path
    bytes_downloaded: int
    seconds: float
    kept_local_manifest: bool

    @property
    def manifest(self) -> ShardManifest:
        return self.plan.manifest

    def to_dict(self) -> dict[str, Any]:
        d = self.plan.to_dict()
        d.update(
            local_step_dir=str(self.local_step_dir),
            bytes_downloaded=self.bytes_downloaded,
            seconds=round(self.seconds, 3),
            kept_local_manifest=self.kept_local_manifest,
        )
        return d


# --- local commit


def _download_all(
    store: ObjectStore,
    plan: RestorePlan,
    lsc: LocalStepCommit,
    on_progress: ProgressCallback | None,
    cancel: Callable[[], None],
    placed: Placed,
) -> None:
    """Step 3 for every planned object (:func:`~tiered_ckpt.remote.download.fetch_shards`: all
    shards' ranged GETs in one window, sha256 as the bytes arrive): each shard lands in its staged
    temp name, is verified, then fsynced on the transfer thread that completed it (so the flushes
    overlap the other shards' transfers) and recorded in ``placed`` (the file
    :meth:`LocalStepCommit.publish` renames; undone on failure); raises the lowest rank's error (a
    local ``OSError`` as :class:`CheckpointWriteError`). On KeyboardInterrupt the transfers in
    flight are cancelled (``cancel()``), not waited out."""
    targets = {o.rank: lsc.stage(shard_file_name(o.rank)) for o in plan.objects}

    def verified(obj: RemoteObject) -> None:
        lsc.sync_staged(shard_file_name(obj.rank))
        placed.record(shard_file_name(obj.rank), targets[obj.rank])

    try:
        fetch_shards(
            store,
            plan,
            plan.objects,
            targets,
            on_progress=on_progress,
            on_verified=verified,
            cancel=cancel,
        )
    except OSError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointWriteError.from_os_error(
            e, f"step {plan.step}: writing the download failed"
        ) from e


def _publish(
    lsc: LocalStepCommit, plan: RestorePlan, placed: Placed, *, uncommit: bool, keep_manifest: bool
) -> bool:
    """Step 4 after a successful download; returns whether the local manifest was kept (ours, or an
    identical one another restorer committed meanwhile). Raises ConcurrentSaveError, OSError."""
    carry = record_to_carry(read_run_record(lsc.root), plan.lineage)
    if carry is not None:
        write_run_record(
            lsc.root, carry, exact_root=True
        )  # before the step commits: judged under this record
    if uncommit:
        lsc.uncommit()  # I2: un-commit before any file of the step changes
        log.warning(
            "step %d: un-committed the local step to replace it with the bucket's copy", plan.step
        )
    lsc.publish()
    # before the manifest: a foreign step is never judged by its own attempt
    record_adoption(lsc, plan.manifest, placed)
    if not keep_manifest:
        try:
            lsc.commit_manifest(plan.manifest_bytes)
        except CheckpointExistsError:  # another rank of this node restored the same step meanwhile
            now = read_manifest_bytes(lsc.step_dir)
            if now is None or not same_save(now, plan):
                raise ConcurrentSaveError(
                    f"step {plan.step}: another writer committed a different save "
                    f"into {lsc.step_dir} meanwhile"
                ) from None
            keep_manifest = True
    record_held_ranks(lsc.step_dir, plan.manifest)
    lsc.release_lock()
    now = read_manifest_bytes(lsc.step_dir)
    write_uploaded_marker(
        lsc.step_dir,
        UploadedMarker(
            step=plan.step,
            remote=plan.remote_url,
            restored=True,
            upload_manifest_sha256=plan.upload_manifest_sha256,
        ),
        manifest_sha256=hashlib.sha256(now if now is not None else plan.manifest_bytes).hexdigest(),
    )
    return keep_manifest


def _commit(
    store: ObjectStore,
    plan: RestorePlan,
    root: Path,
    *,
    replace: bool,
    on_progress: ProgressCallback | None,
    cancel: Callable[[], None],
) -> RestoreResult:
    """Steps 3-4 of the lifecycle for a planned step."""
    t0 = time.perf_counter()
    step = plan.step
    try:  # claim or join the writer lock for the bucket's save first: I4, a live local writer of another
        lsc = LocalStepCommit.open(root, step, plan.manifest.save_id)  # save is refused
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointWriteError.from_os_error(
            e, f"step {step}: cannot claim the writer lock of {root / step_dir_name(step)}"
        ) from e
    placed = Placed()
    with lsc:
        try:
            # Decided under the lock, so that no save can commit the step between this look and
            # ours.
            local_bytes = read_manifest_bytes(lsc.step_dir)
            keep_manifest = local_bytes is not None and same_save(local_bytes, plan)
            if local_bytes is not None and not keep_manifest and not replace:
                raise CheckpointExistsError(
                    f"step {step} is committed under {root} by another save; pass "
                    "replace=True (--replace) to overwrite it with the bucket's copy"
                )
            try:
                clear_dead_restore(lsc, plan, committed=local_bytes is not None)
            except OSError as e:
                raise CheckpointWriteError.from_os_error(
                    e,
                    f"step {step}: removing leftovers of a dead writer from {lsc.step_dir} failed",
                ) from e
            _download_all(store, plan, lsc, on_progress, cancel, placed)
            lsc.check_lock()  # nobody took the step over while the shards downloaded
            try:
                keep_manifest = _publish(
                    lsc,
                    plan,
                    placed,
                    uncommit=local_bytes is not None and not keep_manifest,
                    keep_manifest=keep_manifest,
                )
            except OSError as e:
                raise CheckpointWriteError.from_os_error(
                    e, f"step {step}: committing the restored step in {lsc.step_dir} failed"
                ) from e
        except BaseException:
            if not lsc.committed:
                placed.undo(
                    lsc
                )  # the shards it renamed into the uncommitted step: a retry starts clean
                lsc.abandon()  # temps removed, our lock released, an empty step directory made here removed
            raise
    seconds = time.perf_counter() - t0
    log.info(
        "step %d: restored %d shard(s) (%d bytes) from %s into %s in %.2f s",
        step,
        len(plan.objects),
        plan.total_bytes,
        plan.remote_url,
        lsc.step_dir,
        seconds,
    )
    return RestoreResult(plan, lsc.step_dir, plan.total_bytes, seconds, keep_manifest)


# --- API


def not_a_directory(local_root: PathLike) -> Path | None:
    """The path that keeps ``local_root`` from being a run directory: ``local_root`` itself, or its
    nearest existing ancestor, when that exists and is not a directory (a regular file, a dangling
    symlink); ``None`` when ``local_root`` is a directory or can be made. ``lstat``/``stat``
    only."""
    p = Path(local_root).absolute()
    for q in (p, *p.parents):
        if os.path.lexists(q):
            return None if os.path.isdir(q) else q
    return None


def _transfer_settings(part_size: int | None, concurrency: int | None) -> TransferSettings | None:
    if part_size is None and concurrency is None:
        return None
    from tiered_ckpt.store import TransferSettings

    base = TransferSettings()
    return TransferSettings(
        download_part_size_bytes=part_size or base.download_part_size_bytes,
        download_max_concurrency=concurrency or base.download_max_concurrency,
    )


def restore_detailed(
    remote_url: str,
    local_root: PathLike,
    *,
    step: int | None = None,
    ranks: Iterable[int] | None = None,
    s3_client: Any = None,
    fallback: bool = False,
    replace: bool = False,
    endpoint_url: str | None = None,
    download_part_size_bytes: int | None = None,
    download_max_concurrency: int | None = None,
    max_parallel_shards: int = 8,
    store: ObjectStore | None = None,
    on_progress: ProgressCallback | None = None,
    on_plan: Callable[[RestorePlan], None] | None = None,
) -> RestoreResult:
    """:func:`restore`, returning the plan and the transfer's figures too. ``on_plan(plan)`` is
    called before the download starts (the CLI sizes its progress bar with it). ``store``: an open
    store to use instead of building one (its cancellation on Ctrl-C is then the caller's)."""
    transfer = _transfer_settings(download_part_size_bytes, download_max_concurrency)
    if transfer is not None and store is not None:
        raise ValueError("download settings are ignored when a store is given")
    if max_parallel_shards < 1:
        raise ValueError(f"max_parallel_shards must be >= 1, got {max_parallel_shards}")
    # ``local_root`` is the run root whatever its name looks like: a directory named like a step
    # (``/x/step_0000000003``) is restored into, never read as that step of its parent.
    root = Path(local_root).absolute()
    bad = not_a_directory(root)
    if bad is not None:
        raise CheckpointWriteError(
            f"{root} is not a directory"
            + ("" if bad == root else f" ({bad} is not one)")
            + ": nothing restored"
        )
    handle = StoreHandle(
        remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url, transfer=transfer
    )
    with handle as st:
        skipped: list[tuple[int, str]] = []
        plans = iter_plans(st, step, ranks, fallback, skipped, local_lineage=read_run_record(root))
        while True:
            plan = next(plans)
            if on_plan is not None:
                on_plan(plan)
            try:
                return _commit(
                    st, plan, root, replace=replace, on_progress=on_progress, cancel=handle.cancel
                )
            except STEP_FAULTS as exc:
                if not fallback:
                    raise
                log.warning(
                    "step %d failed to restore (%s: %s); falling back to the next older step",
                    plan.step,
                    type(exc).__name__,
                    exc,
                )
                skipped.append((plan.step, f"{type(exc).__name__}: {exc}"))


def restore(
    remote_url: str,
    local_root: PathLike,
    *,
    step: int | None = None,
    ranks: Iterable[int] | None = None,
    s3_client: Any = None,
    fallback: bool = False,
    replace: bool = False,
    endpoint_url: str | None = None,
    download_part_size_bytes: int | None = None,
    download_max_concurrency: int | None = None,
    max_parallel_shards: int = 8,
    on_progress: ProgressCallback | None = None,
) -> ShardManifest:
    """Restore a remotely committed step from ``remote_url`` (``s3://bucket/prefix``) into the run
    directory ``local_root``; returns its manifest (see the module docstring for the protocol).
    ``local_root`` is the run directory itself whatever its name: one named like a step directory
    (``/x/step_0000000003``) gets ``/x/step_0000000003/step_XXXXXXXXXX/``, nothing is written beside
    it.

    ``step``: the step to restore (default: the newest remotely committed one). ``ranks``: restore
    only these ranks' shards (default: all). ``fallback``: if the chosen step is broken remotely,
    try older ones (with a warning) instead of failing. ``replace``: overwrite a different save of
    the same step committed locally (un-committed first, I2; default: :class:`CheckpointExistsError`).
    ``s3_client``: an injected botocore client (default: one from boto3's chain, ``endpoint_url`` or
    ``AWS_ENDPOINT_URL``). ``download_part_size_bytes`` / ``download_max_concurrency``: ranged-GET size
    and requests in flight (defaults: :class:`~tiered_ckpt.store.TransferSettings`; large ranges suit
    servers such as moto where a ranged GET costs as much as the whole object, parallel moderate ranges
    suit S3 and MinIO). ``max_parallel_shards``: kept for callers of earlier versions and checked (>= 1),
    otherwise unused: all shards' parts share one window of ``download_max_concurrency`` ranged GETs. ``on_progress(delta_bytes)``
    is called from transfer threads.

    Raises :class:`NoCheckpointError` (nothing remotely committed, or the requested step has no upload
    manifest), :class:`MissingShardError` / :class:`ShardCorruptedError` / :class:`ManifestError` (the
    chosen step is broken remotely; nothing committed locally), :class:`CheckpointExistsError`,
    :class:`ConcurrentSaveError` (a live local writer of the same step), :class:`CheckpointWriteError`
    (local disk; ``local_root``, or an ancestor of it, exists and is not a directory: nothing fetched),
    :class:`UploadError` (the bucket cannot be read), ``ValueError`` (bad URL or ranks).
    """
    return restore_detailed(
        remote_url,
        local_root,
        step=step,
        ranks=ranks,
        s3_client=s3_client,
        fallback=fallback,
        replace=replace,
        endpoint_url=endpoint_url,
        download_part_size_bytes=download_part_size_bytes,
        download_max_concurrency=download_max_concurrency,
        max_parallel_shards=max_parallel_shards,
        on_progress=on_progress,
    ).manifest


__all__ = [
    "REMOTE_COMMITTED",
    "REMOTE_NO_UPLOAD_MANIFEST",
    "REMOTE_BAD_UPLOAD_MANIFEST",
    "REMOTE_VANISHED",
    "RemoteObject",
    "RestorePlan",
    "RestoreResult",
    "RemoteStep",
    "not_a_directory",
    "restore",
    "restore_detailed",
    "plan_restore",
    "list_remote_steps",
    "remote_committed_steps",
    "read_latest_pointer",
]
