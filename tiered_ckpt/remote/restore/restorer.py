"""Restore: bring a remotely committed step back to local disk after cluster loss (SPEC §5).

Lifecycle of one :func:`restore` (made by one process: the CLI, an operator's script, or each rank's
:class:`~tiered_ckpt.training.manager.CheckpointManager` through
:func:`tiered_ckpt.training.resume.prepare_load_from_remote`):

1. **Candidates** and 2. **Plan**: :mod:`tiered_ckpt.remote.restore.plan` (over the catalogue,
   :mod:`tiered_ckpt.remote.catalogue`): the newest candidate whose upload manifest GET reads (or
   the requested ``step``), its mirrored ``manifest.json`` checked against it, every shard to fetch
   HEADed. Nothing local is touched yet (``--dry-run`` stops here).
3. **Download** (:mod:`tiered_ckpt.remote.restore.download`): the parts of all shards go through one window
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
write, Ctrl-C) removes the files this restore placed again (:class:`Placed`, by ``(st_dev,
st_ino)``: a file another writer renamed over one of them since stays); a restore that finds a dead
restore's leftovers in the step (temp files of dead owners; with the writer lock its own, the files
under the planned shards' names) removes them before it downloads (:func:`clear_dead_restore`): a
retry starts clean. ``run.json`` is not taken back: the run record carried into the root is true
whatever happens to the step. ``fallback=True`` moves on to the next older candidate with a warning.
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
    DcpMetadataError,
    ShardCorruptedError,
)
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.records import UploadedMarker
from tiered_ckpt.fs import write_all
from tiered_ckpt.layout import (
    ADOPTED_MARKER_NAME,
    DCP_METADATA_NAME,
    save_shard_key,
    shard_file_name,
    step_dir_name,
)
from tiered_ckpt.local.catalogue import (
    adopted_bytes,
    read_adopted,
    read_manifest_bytes,
    read_run_record,
    read_small_regular_file,
)
from tiered_ckpt.local.commit import (
    LocalStepCommit,
    durable_write_bytes,
    fsync_dir,
    record_node_ranks,
)
from tiered_ckpt.local.leftovers import placed_identity, remove_dead_temps, remove_placed
from tiered_ckpt.local.lineage import write_run_record
from tiered_ckpt.local.markers import write_uploaded_marker
from tiered_ckpt.local.verified_read import read_byte_tensor
from tiered_ckpt.remote.catalogue import (
    REMOTE_BAD_UPLOAD_MANIFEST,
    REMOTE_COMMITTED,
    REMOTE_NO_UPLOAD_MANIFEST,
    REMOTE_VANISHED,
    ListedSave,
    list_remote_steps,
    read_latest_pointer,
    remote_committed_steps,
)
from tiered_ckpt.remote.handle import StoreHandle
from tiered_ckpt.remote.restore.download import fetch_shards
from tiered_ckpt.remote.restore.plan import (
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


class Placed:
    """The files one restore renamed (or is about to rename) into its step directory, by name, with
    their ``(st_dev, st_ino)``. Filled from the download threads (one dict assignment per shard)."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[int, int]] = {}

    def record(self, name: str, path: Path) -> None:
        """Remember the file now at ``path`` (a staged temp, or the final name) as ours under
        ``name``."""
        ident = placed_identity(path)
        if ident is not None:
            self.files[name] = ident

    def undo(self, lsc: LocalStepCommit) -> None:
        """Remove the files of :attr:`files` still in place, unless the step got committed meanwhile
        (then they are part of it), and fsync the directory. Best effort: an ``OSError`` is logged
        (the caller is already failing with the original error)."""
        if not self.files or lsc.committed or lsc.is_committed():
            return
        try:
            removed = remove_placed(lsc.step_dir, self.files)
            if removed:
                fsync_dir(lsc.step_dir)
        except OSError as e:
            log.warning(
                "step %d: could not remove the files this failed restore placed in %s: %s",
                lsc.step,
                lsc.step_dir,
                e,
            )
            return
        if removed:
            log.info(
                "step %d: the restore failed before its manifest; removed what it placed (%s)",
                lsc.step,
                ", ".join(removed),
            )


def dcp_metadata_copy(store: ObjectStore, plan: RestorePlan, step_dir: Path) -> bytes | None:
    """The ``dcp_metadata.json`` a restored root of a DCP step saved into node-local roots needs
    to load without the bucket (:mod:`tiered_ckpt.dcp.node_roots`: each node's root holds the
    metadata, as its metadata rank's shard or as that copy) when the metadata rank is not among
    the ranks restored: the metadata tensor read from that rank's shard object by verified ranged
    GETs (its header, then the tensor's chunks, CRC32C-checked), then checked against the
    manifest's sha256. ``None`` for any other step, or when ``step_dir`` already holds the copy. A
    malformed ``extra["dcp"]`` is logged and skipped (the load refuses the step anyway). Raises
    ShardCorruptedError, MissingShardError, UploadError."""
    from tiered_ckpt.format.dcp_metadata import EXTRA_KEY, dcp_step_info

    m = plan.manifest
    if EXTRA_KEY not in (m.extra or {}):
        return None
    try:
        info = dcp_step_info(m)
    except DcpMetadataError as e:
        log.warning("step %d: no DCP metadata copy restored: %s", plan.step, e)
        return None
    if info.metadata_sha256 is None or info.metadata_rank in plan.ranks:
        return None
    have = read_small_regular_file(step_dir / DCP_METADATA_NAME, info.metadata_bytes + 1)
    if have is not None and hashlib.sha256(have).hexdigest() == info.metadata_sha256:
        return None
    from tiered_ckpt.remote.restore.ranged_read import RemoteShardReader

    um = plan.upload_manifest
    key = save_shard_key(plan.step, um.key_save_id, info.metadata_rank, um.key_layout)
    where = f"step {plan.step}: DCP metadata"
    with RemoteShardReader(store, m, info.metadata_rank, key) as rd:
        raw = read_byte_tensor(
            rd, info.metadata_tensor, info.metadata_bytes, DcpMetadataError, where
        )
    if hashlib.sha256(raw).hexdigest() != info.metadata_sha256:
        raise ShardCorruptedError(f"{where}: rank {info.metadata_rank}'s copy fails its sha256")
    return raw


def clear_dead_restore(lsc: LocalStepCommit, plan: RestorePlan, *, committed: bool) -> None:
    """Before downloading into a step directory: remove the temp files of dead owners there and,
    when the step is not ``committed`` and this restore created the writer lock (``lsc.claimed``: no
    live writer shares the step), the files under the final names of the planned shards (a dead
    writer's, about to be replaced). Raises ``OSError``."""
    gone = [p.name for p in remove_dead_temps(lsc.step_dir, owned_only=True)]
    if lsc.claimed and not committed:
        for obj in plan.objects:
            path = lsc.step_dir / shard_file_name(obj.rank)
            if os.path.lexists(path) and not os.path.isdir(path):
                os.unlink(path)
                gone.append(path.name)
    if gone:
        fsync_dir(lsc.step_dir)
        log.warning(
            "step %d: removed %d leftover(s) of a dead writer from %s before restoring: %s",
            plan.step,
            len(gone),
            lsc.step_dir,
            ", ".join(sorted(gone)),
        )


def same_save(local_bytes: bytes, plan: RestorePlan) -> bool:
    """The local committed manifest describes the same save as the remote one (node-local commits of
    one save differ only in ``created_at``)."""
    if local_bytes == plan.manifest_bytes:
        return True
    try:
        lm = ShardManifest.from_json(local_bytes)
    except CheckpointError:
        return False
    rm = plan.manifest
    return (lm.step, lm.world_size, lm.save_id) == (rm.step, rm.world_size, rm.save_id) and all(
        (a.sha256, a.size_bytes) == (b.sha256, b.size_bytes) for a, b in zip(lm.shards, rm.shards)
    )


def record_to_carry(local: RunLineage | None, remote: RunLineage | None) -> RunLineage | None:
    """The run record a restore writes into the root (``None``: keep the root's as it is): the
    bucket's lineage into a root without one, the newer record of the same run, nothing into a root
    of another run (fine tuning) or when the two records of one run diverge (a warning; the manager
    decides)."""
    if remote is None:
        return None
    if local is None:
        return remote
    if local.run_id != remote.run_id:
        log.info(
            "restoring from run %s into a root of run %s: the root keeps its run record",
            remote.run_id,
            local.run_id,
        )
        return None
    if remote.extends(local) and remote != local:
        return remote
    if not local.extends(remote):
        log.warning(
            "run %s: the root's run.json and the bucket's disagree about the attempts; the root keeps "
            "its own",
            local.run_id,
        )
    return None


def record_held_ranks(step_dir: Path, manifest: ShardManifest) -> None:
    """After a restore of some ranks only (a replaced node): record the ranks the step directory now
    holds (``node_ranks.json``), so that ``verify`` checks them and still reports a missing one.
    After the manifest: a crash in between leaves verify strict (it reports the step incomplete),
    never lenient."""
    held = {rec.rank for rec in manifest.shards if os.path.lexists(step_dir / rec.path)}
    if held and held != set(range(manifest.world_size)):
        record_node_ranks(step_dir, held, manifest.world_size)


def record_adoption(lsc: LocalStepCommit, manifest: ShardManifest, placed: Placed) -> None:
    """A foreign step (its manifest names another run than the root's record, or none) entering a
    root with a record: write ``adopted.json`` naming the root's run and current attempt (SPEC §11),
    durably, unless the step already holds exactly that for this save; it is then one of the
    ``placed`` files. Before the manifest commits (the caller's order). Raises ``OSError``."""
    rec = read_run_record(lsc.root)
    if rec is None or manifest.run_id == rec.run_id:
        return
    sid = manifest.save_id or None
    if read_adopted(lsc.step_dir, sid) == (rec.run_id, rec.attempt):
        return
    body = adopted_bytes(rec.run_id, rec.attempt, sid)
    lsc.write_file(ADOPTED_MARKER_NAME, lambda fd: write_all(fd, body))
    placed.record(ADOPTED_MARKER_NAME, lsc.step_dir / ADOPTED_MARKER_NAME)
    log.info(
        "step %d (run %s, attempt %d) entered run %s at its attempt %d: judged by that attempt",
        manifest.step,
        manifest.run_id,
        manifest.attempt,
        rec.run_id,
        rec.attempt,
    )


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
    """Step 3 for every planned object (:func:`~tiered_ckpt.remote.restore.download.fetch_shards`: all
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
    lsc: LocalStepCommit,
    plan: RestorePlan,
    placed: Placed,
    *,
    uncommit: bool,
    keep_manifest: bool,
    dcp_metadata: bytes | None = None,
) -> bool:
    """Step 4 after a successful download; returns whether the local manifest was kept (ours, or an
    identical one another restorer committed meanwhile). ``dcp_metadata``: the step's
    ``dcp_metadata.json`` to place before the manifest (:func:`dcp_metadata_copy`). Raises
    ConcurrentSaveError, OSError."""
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
    if dcp_metadata is not None:
        copy = lsc.step_dir / DCP_METADATA_NAME
        durable_write_bytes(copy, dcp_metadata)
        placed.record(DCP_METADATA_NAME, copy)
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
            md_copy = dcp_metadata_copy(store, plan, lsc.step_dir)
            lsc.check_lock()  # nobody took the step over while the shards downloaded
            try:
                keep_manifest = _publish(
                    lsc,
                    plan,
                    placed,
                    uncommit=local_bytes is not None and not keep_manifest,
                    keep_manifest=keep_manifest,
                    dcp_metadata=md_copy,
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
    suit S3 and MinIO); all shards' parts share one window of ``download_max_concurrency`` ranged GETs. ``on_progress(delta_bytes)``
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
        on_progress=on_progress,
    ).manifest


__all__ = [
    "Placed",
    "REMOTE_BAD_UPLOAD_MANIFEST",
    "REMOTE_COMMITTED",
    "REMOTE_NO_UPLOAD_MANIFEST",
    "REMOTE_VANISHED",
    "RemoteObject",
    "ListedSave",
    "RestorePlan",
    "RestoreResult",
    "clear_dead_restore",
    "list_remote_steps",
    "not_a_directory",
    "plan_restore",
    "read_latest_pointer",
    "record_adoption",
    "record_held_ranks",
    "record_to_carry",
    "remote_committed_steps",
    "restore",
    "restore_detailed",
    "same_save",
]
