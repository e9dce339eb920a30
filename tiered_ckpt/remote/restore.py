"""Restore: bring a remotely committed step back to local disk after cluster loss (SPEC §5).

Lifecycle of one :func:`restore` (made by one process: the CLI, an operator's script, or each rank's
:class:`~tiered_ckpt.manager.CheckpointManager` through :func:`prepare_load_from_remote`):

1. **Candidates.** A step exists for restore only if its ``upload_manifest.json`` (the remote commit
   point) can be read with GET. The ``latest`` pointer is read with GET; LIST adds the steps whose upload
   manifest it shows. LIST may lag (a new step not shown yet) or lie (a key shown that is gone), so the
   pointer's step is a candidate even when LIST does not show it, and a step LIST shows counts only once
   its upload manifest is read back. The newest candidate is tried first (or the requested ``step``).
2. **Plan.** GET the upload manifest and the mirrored ``manifest.json``; check the latter's sha256 against
   ``manifest_sha256`` and that both agree rank by rank; HEAD every shard to fetch and compare its size.
   Nothing local is touched yet (``--dry-run`` stops here).
3. **Download.** Shards are downloaded in parallel (ranged GETs per
   :class:`~tiered_ckpt.store.s3.TransferSettings`) to unique temp names in the local step directory,
   then hashed and compared with the manifest's sha256 and size, and their safetensors headers with the
   manifest's records.
4. **Commit** with the local tier's own protocol (:mod:`tiered_ckpt.local`, :mod:`tiered_ckpt._fs`):
   the step's writer lock is claimed with the remote ``save_id`` (so a live local writer of the same step
   is refused, I4), verified shards are renamed into place and the directory fsynced, then the exact
   ``manifest.json`` bytes that were uploaded are written last (temp, fsync, link, fsync the directory).
   Finally the ``uploaded.json`` marker tells the sidecar and upload-gated rotation that the step is
   already in the bucket.

If the chosen step fails (an object missing, a size or sha256 mismatch, a bad upload manifest), the
error (:class:`~tiered_ckpt.errors.MissingShardError`, :class:`~tiered_ckpt.errors.ShardCorruptedError`,
:class:`~tiered_ckpt.errors.ManifestError`) names the step and the object, the temp files are removed and
nothing is committed locally. ``fallback=True`` moves on to the next older candidate with a warning.
Remote failures that outlast the retries are :class:`~tiered_ckpt.errors.UploadError` (never a fallback:
an unreachable bucket fails older steps the same way).

``ranks=`` restores only some shards: a replaced node fetches its own ranks while the other nodes keep
their copies. The local manifest is the global one (as after a node-local save), so loading a restored
rank verifies it like any other.
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
from typing import Any, Callable, Iterable, Iterator, Sequence

from tiered_ckpt.format import shard_file as fmt
from tiered_ckpt.local import steps as _local
from tiered_ckpt.local.reader import match_header
from tiered_ckpt.fs import atomic_write_bytes, atomic_write_json, fsync_dir, temp_name_for, unlink_durable, unlink_quietly
from tiered_ckpt.errors import (CheckpointError, CheckpointExistsError, CheckpointWriteError, ConcurrentSaveError,
                     ManifestError, MissingShardError, NoCheckpointError, ShardCorruptedError, UploadError)
from tiered_ckpt.layout import (LATEST_POINTER_NAME, MANIFEST_NAME, SAVE_LOCK_NAME, UPLOAD_MANIFEST_NAME,
                     UPLOADED_MARKER_NAME, parse_step_dir_name, shard_file_name, step_dir_name)
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.upload_manifest import LatestPointer, UploadManifest

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
ProgressCallback = Callable[[int], None]

#: States of a remote step in :func:`list_remote_steps`.
REMOTE_COMMITTED = "committed"
REMOTE_NO_UPLOAD_MANIFEST = "no upload manifest"
REMOTE_BAD_UPLOAD_MANIFEST = "bad upload manifest"
REMOTE_VANISHED = "vanished"

_HASH_CHUNK = 8 * 1024 * 1024
#: Errors of one candidate step that ``fallback=True`` skips (an unreachable bucket is not one of them).
_STEP_FAULTS = (MissingShardError, ShardCorruptedError, ManifestError)


# ------------------------------------------------------------------------------------------ values


@dataclass(frozen=True)
class RemoteObject:
    """One object a restore fetches: ``key`` relative to the store prefix, size confirmed by HEAD."""

    rank: int
    key: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True)
class RestorePlan:
    """What a restore will fetch (the result of steps 1-2 of the lifecycle; ``--dry-run`` prints it).

    ``skipped``: ``(step, reason)`` of newer candidates passed over (with ``fallback=True``).
    """

    remote_url: str
    step: int
    ranks: tuple[int, ...]
    upload_manifest: UploadManifest
    manifest: ShardManifest
    manifest_bytes: bytes = field(repr=False)
    objects: tuple[RemoteObject, ...]
    from_pointer: bool
    upload_manifest_sha256: str
    skipped: tuple[tuple[int, str], ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(o.size_bytes for o in self.objects)

    def to_dict(self) -> dict[str, Any]:
        return {"remote_url": self.remote_url, "step": self.step, "ranks": list(self.ranks),
                "world_size": self.manifest.world_size, "save_id": self.manifest.save_id,
                "total_bytes": self.total_bytes, "from_pointer": self.from_pointer,
                "upload_manifest_sha256": self.upload_manifest_sha256,
                "objects": [{"rank": o.rank, "key": o.key, "size_bytes": o.size_bytes, "sha256": o.sha256}
                            for o in self.objects],
                "skipped": [{"step": s, "reason": r} for s, r in self.skipped]}


@dataclass(frozen=True)
class RestoreResult:
    """What :func:`restore_detailed` did: the committed ``manifest`` and the figures of the transfer."""

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
        d.update(local_step_dir=str(self.local_step_dir), bytes_downloaded=self.bytes_downloaded,
                 seconds=round(self.seconds, 3), kept_local_manifest=self.kept_local_manifest)
        return d


@dataclass(frozen=True)
class RemoteStep:
    """One step seen in the bucket (:func:`list_remote_steps`).

    ``state``: ``committed`` (upload manifest present and valid: restorable), ``no upload manifest``
    (objects listed but no commit point: an upload in progress or abandoned; never restored),
    ``bad upload manifest`` (present but unreadable), ``vanished`` (LIST showed the upload manifest but
    GET did not find it: a step being deleted by retention). ``objects``: keys LIST showed under the step.
    ``latest``: the ``latest`` pointer names this step.
    """

    step: int
    state: str
    reason: str = ""
    world_size: int | None = None
    size_bytes: int = 0
    save_id: str | None = None
    objects: int = 0
    latest: bool = False

    @property
    def ok(self) -> bool:
        return self.state == REMOTE_COMMITTED

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "state": self.state, "reason": self.reason, "world_size": self.world_size,
                "size_bytes": self.size_bytes, "save_id": self.save_id, "objects": self.objects,
                "latest": self.latest}


# ------------------------------------------------------------------------------------------ store


class _StoreHandle:
    """The store a call works on: the caller's (left open) or one built here (closed on exit)."""

    def __init__(self, remote_url: str, *, store: Any = None, s3_client: Any = None,
                 endpoint_url: str | None = None, transfer: Any = None) -> None:
        self.owned = store is None
        if store is None:
            from tiered_ckpt.store.s3 import S3Store, make_s3_client  # the only path to boto3

            if s3_client is None:
                s3_client = make_s3_client(endpoint_url=endpoint_url)
            # A stop event lets an interrupted restore (Ctrl-C) cancel its transfers in flight.
            store = S3Store.from_url(remote_url, client=s3_client, transfer=transfer,
                                     stop_event=threading.Event())
        self.store = store

    def __enter__(self) -> Any:
        return self.store

    def __exit__(self, *exc: object) -> None:
        if self.owned:
            self.store.close()


def _url(store: Any, key: str) -> str:
    return f"{store.url}/{key}"


def _rel_key(step: int, name: str) -> str:
    return f"{step_dir_name(step)}/{name}"


def _get_or_none(store: Any, key: str) -> bytes | None:
    from tiered_ckpt.store.base import RemoteNotFoundError

    try:
        return store.get_bytes(key)
    except RemoteNotFoundError:
        return None


def read_latest_pointer(store: Any) -> LatestPointer | None:
    """GET ``<prefix>/latest``; ``None`` when absent or unreadable (a warning: LIST is used then)."""
    raw = _get_or_none(store, LATEST_POINTER_NAME)
    if raw is None:
        return None
    try:
        return LatestPointer.from_json(raw)
    except ManifestError as exc:
        log.warning("%s: ignoring a malformed latest pointer: %s", _url(store, LATEST_POINTER_NAME), exc)
        return None


def _list_steps(store: Any) -> dict[int, set[str]]:
    """``step -> names of the objects LIST shows under it`` (may lag or lie; never trusted alone)."""
    out: dict[int, set[str]] = {}
    for key in store.list_keys(""):
        head, sep, name = key.partition("/")
        step = parse_step_dir_name(head)
        if step is not None and sep and name and "/" not in name:
            out.setdefault(step, set()).add(name)
    return out


def _candidate_steps(store: Any) -> tuple[list[int], LatestPointer | None]:
    """Steps that may be remotely committed, newest first: the pointer's (by GET) plus those whose upload
    manifest LIST shows. Each is confirmed later by reading its upload manifest."""
    pointer = read_latest_pointer(store)
    try:
        listed = {s for s, names in _list_steps(store).items() if UPLOAD_MANIFEST_NAME in names}
    except UploadError as exc:
        if pointer is None:
            raise
        log.warning("%s: LIST failed (%s); using the latest pointer alone", store.url, exc)
        listed = set()
    if pointer is not None:
        listed.add(pointer.step)
    return sorted(listed, reverse=True), pointer


def _read_upload_manifest(store: Any, step: int) -> tuple[UploadManifest, bytes] | None:
    """GET and validate a step's upload manifest; ``None`` when it does not exist. Raises ManifestError."""
    key = _rel_key(step, UPLOAD_MANIFEST_NAME)
    raw = _get_or_none(store, key)
    if raw is None:
        return None
    try:
        um = UploadManifest.from_json(raw)
    except ManifestError as exc:
        raise ManifestError(f"step {step}: {_url(store, key)} is invalid: {exc}") from exc
    if um.step != step:
        raise ManifestError(f"step {step}: {_url(store, key)} describes step {um.step}")
    return um, raw


# ------------------------------------------------------------------------------------------ listing


def list_remote_steps(remote_url: str, *, s3_client: Any = None, store: Any = None,
                      endpoint_url: str | None = None) -> list[RemoteStep]:
    """Every step seen under ``remote_url`` and its state (see :class:`RemoteStep`), ascending.

    Upload manifests are read with GET (small objects); shards are not HEADed (restore does that).
    The step named by the ``latest`` pointer is listed even when LIST does not show it yet.
    Raises :class:`~tiered_ckpt.errors.UploadError` when the bucket cannot be read.
    """
    with _StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url) as st:
        pointer = read_latest_pointer(st)
        by_step = _list_steps(st)
        if pointer is not None:
            by_step.setdefault(pointer.step, set())
        out = []
        for step in sorted(by_step):
            names = by_step[step]
            latest = pointer is not None and pointer.step == step
            if UPLOAD_MANIFEST_NAME not in names and not latest:
                out.append(RemoteStep(step, REMOTE_NO_UPLOAD_MANIFEST,
                                      "objects without an upload manifest (upload in progress or abandoned)",
                                      objects=len(names)))
                continue
            try:
                got = _read_upload_manifest(st, step)
            except ManifestError as exc:
                out.append(RemoteStep(step, REMOTE_BAD_UPLOAD_MANIFEST, str(exc), objects=len(names),
                                      latest=latest))
                continue
            if got is None:
                what = "the latest pointer names it" if latest else "LIST showed its upload manifest"
                out.append(RemoteStep(step, REMOTE_VANISHED, f"{what}, but GET finds none",
                                      objects=len(names), latest=latest))
                continue
            um = got[0]
            out.append(RemoteStep(step, REMOTE_COMMITTED, "", um.world_size, um.total_bytes, um.save_id,
                                  len(names), latest))
        return out


def remote_committed_steps(remote_url: str, *, s3_client: Any = None, store: Any = None,
                           endpoint_url: str | None = None) -> list[int]:
    """Steps that may be restored (the pointer's and those whose upload manifest LIST shows), ascending.
    Cheaper than :func:`list_remote_steps`: upload manifests are not read here."""
    with _StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url) as st:
        return sorted(_candidate_steps(st)[0])


# ------------------------------------------------------------------------------------------ planning


def _check_ranks(ranks: Iterable[int] | None, world_size: int, step: int) -> tuple[int, ...]:
    if ranks is None:
        return tuple(range(world_size))
    out = tuple(sorted(set(int(r) for r in ranks)))
    if not out:
        raise ValueError("ranks is empty")
    bad = [r for r in out if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"ranks {bad} are outside step {step}'s world_size {world_size}")
    return out


def _plan_step(store: Any, step: int, ranks: Iterable[int] | None, *, from_pointer: bool,
               um_pair: tuple[UploadManifest, bytes] | None = None) -> RestorePlan:
    """Steps 2 of the lifecycle for one step. Raises NoCheckpointError (no upload manifest),
    ManifestError, MissingShardError, ShardCorruptedError, UploadError."""
    if um_pair is None:
        um_pair = _read_upload_manifest(store, step)
    if um_pair is None:
        raise NoCheckpointError(f"step {step} has no {UPLOAD_MANIFEST_NAME} under {store.url}: it was never "
                                "fully uploaded, so it does not exist for restore")
    um, um_raw = um_pair
    if um.prefix.strip("/") != getattr(store, "prefix", um.prefix).strip("/"):
        log.warning("step %d: upload manifest was written under prefix %r, restoring from %s (a copied "
                    "bucket?)", step, um.prefix, store.url)
    mkey = _rel_key(step, MANIFEST_NAME)
    raw = _get_or_none(store, mkey)
    if raw is None:
        raise MissingShardError(f"step {step}: {_url(store, mkey)} is missing (the upload manifest mirrors it)")
    sha = hashlib.sha256(raw).hexdigest()
    if sha != um.manifest_sha256:
        raise ShardCorruptedError(f"step {step}: {_url(store, mkey)} has sha256 {sha[:16]}..., the upload "
                                  f"manifest says {um.manifest_sha256[:16]}...")
    try:
        m = ShardManifest.from_json(raw)
    except (ManifestError, MissingShardError) as exc:
        raise ManifestError(f"step {step}: {_url(store, mkey)} is invalid: {exc}") from exc
    if (m.step, m.world_size, m.save_id) != (step, um.world_size, um.save_id):
        raise ManifestError(f"step {step}: {_url(store, mkey)} (step {m.step}, world {m.world_size}, save "
                            f"{m.save_id}) disagrees with its upload manifest")
    for rec, rs in zip(m.shards, um.shards):
        if (rec.rank, rec.sha256, rec.size_bytes) != (rs.rank, rs.sha256, rs.size_bytes):
            raise ManifestError(f"step {step} rank {rec.rank}: manifest and upload manifest disagree on "
                                "the shard's size or sha256")
    chosen = _check_ranks(ranks, m.world_size, step)
    objects = []
    for rank in chosen:
        key = _rel_key(step, shard_file_name(rank))
        info = store.head(key)
        rec = m.shards[rank]
        if info is None:
            raise MissingShardError(f"step {step} rank {rank}: {_url(store, key)} is missing (the upload "
                                    "manifest lists it)")
        if info.size_bytes != rec.size_bytes:
            raise ShardCorruptedError(f"step {step} rank {rank}: {_url(store, key)} is {info.size_bytes} "
                                      f"bytes, the manifest says {rec.size_bytes}")
        objects.append(RemoteObject(rank, key, rec.size_bytes, rec.sha256))
    return RestorePlan(store.url, step, chosen, um, m, raw, tuple(objects), from_pointer,
                       hashlib.sha256(um_raw).hexdigest())


def _plans(store: Any, step: int | None, ranks: Iterable[int] | None, fallback: bool,
           skipped: list[tuple[int, str]] | None = None) -> Iterator[RestorePlan]:
    """Candidate plans, newest first; faults of a step are raised, or (``fallback``) logged, appended to
    ``skipped`` (shared with the caller, which adds the steps that fail later) and passed over."""
    candidates, pointer = _candidate_steps(store)
    if step is not None:
        older = [s for s in candidates if s < step] if fallback else []
        order = [step] + older
    else:
        if not candidates:
            raise NoCheckpointError(f"no remotely committed step under {store.url} (no latest pointer and "
                                    f"no {UPLOAD_MANIFEST_NAME} found)")
        order = candidates
    if skipped is None:
        skipped = []
    for s in order:
        explicit = step is not None and s == step
        try:
            got = _read_upload_manifest(store, s)
            if got is None:
                if explicit:
                    raise NoCheckpointError(f"step {s} has no {UPLOAD_MANIFEST_NAME} under {store.url}: it "
                                            "was never fully uploaded, so it does not exist for restore")
                # LIST (or an old pointer) named a commit point that GET does not find: not a candidate.
                log.warning("step %d: %s not found by GET although %s; skipping it", s,
                            _url(store, _rel_key(s, UPLOAD_MANIFEST_NAME)),
                            "the latest pointer names it" if pointer and pointer.step == s else "LIST showed it")
                skipped.append((s, "upload manifest not found"))
                continue
            plan = _plan_step(store, s, ranks, from_pointer=pointer is not None and pointer.step == s,
                              um_pair=got)
        except _STEP_FAULTS as exc:
            if not fallback:
                raise
            log.warning("step %d cannot be restored (%s: %s); falling back to the next older step", s,
                        type(exc).__name__, exc)
            skipped.append((s, f"{type(exc).__name__}: {exc}"))
            continue
        yield RestorePlan(**{**plan.__dict__, "skipped": tuple(skipped)})
    raise NoCheckpointError(f"no restorable step under {store.url}"
                            + (f"; tried {', '.join(f'{s} ({r})' for s, r in skipped)}" if skipped else ""))


def plan_restore(remote_url: str, *, step: int | None = None, ranks: Iterable[int] | None = None,
                 fallback: bool = False, s3_client: Any = None, store: Any = None,
                 endpoint_url: str | None = None) -> RestorePlan:
    """What :func:`restore` would fetch (``--dry-run``): choose the step and confirm its objects with
    HEAD, downloading nothing but the two small manifests. Errors as :func:`restore`."""
    with _StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url) as st:
        return next(_plans(st, step, ranks, fallback))


# ------------------------------------------------------------------------------------------ downloading


def _hash_file(path: Path) -> tuple[str, int]:
    sha = hashlib.sha256()
    n = 0
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            k = f.readinto(buf)
            if not k:
                break
            sha.update(view[:k])
            n += k
    return sha.hexdigest(), n


def _check_header(path: Path, plan: RestorePlan, rank: int, where: str) -> None:
    """The downloaded file's safetensors header agrees with the manifest's record (as loading checks)."""
    rec = plan.manifest.shards[rank]
    with open(path, "rb") as f:
        n = fmt.parse_header_length(f.read(8), rec.size_bytes, where)
        hdr = fmt.parse_header(f.read(n), rec.size_bytes, where)
    match_header(hdr, rec, plan.manifest, where)


def _fetch_one(store: Any, plan: RestorePlan, obj: RemoteObject, tmp: Path,
               on_progress: ProgressCallback | None) -> None:
    """Download one shard to ``tmp`` and verify it; raises MissingShardError / ShardCorruptedError."""
    from tiered_ckpt.store.base import RemoteNotFoundError

    where = f"step {plan.step} rank {obj.rank}: {_url(store, obj.key)}"
    try:
        store.download_file(obj.key, tmp, on_progress=on_progress)
    except RemoteNotFoundError as exc:
        raise MissingShardError(f"{where} disappeared before it could be downloaded") from exc
    sha, size = _hash_file(tmp)
    if size != obj.size_bytes:
        raise ShardCorruptedError(f"{where}: downloaded {size} bytes, the manifest says {obj.size_bytes}")
    if sha != obj.sha256:
        raise ShardCorruptedError(f"{where}: sha256 of the downloaded bytes {sha[:16]}... differs from the "
                                  f"manifest's {obj.sha256[:16]}... (the object in the bucket is corrupt)")
    _check_header(tmp, plan, obj.rank, where)


def _existing_manifest(sdir: Path) -> bytes | None:
    try:
        return (sdir / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise ManifestError(f"{sdir / MANIFEST_NAME} is a directory") from None


def _same_save(local_bytes: bytes, plan: RestorePlan) -> bool:
    """The local committed manifest describes the same save as the remote one (node-local commits of one
    save differ only in ``created_at``)."""
    if local_bytes == plan.manifest_bytes:
        return True
    try:
        lm = ShardManifest.from_json(local_bytes)
    except CheckpointError:
        return False
    rm = plan.manifest
    return (lm.step, lm.world_size, lm.save_id) == (rm.step, rm.world_size, rm.save_id) and all(
        (a.sha256, a.size_bytes) == (b.sha256, b.size_bytes) for a, b in zip(lm.shards, rm.shards))


def _os_error(e: OSError, what: str) -> CheckpointWriteError:
    return _local._write_error(e, what)


def _commit(store: Any, plan: RestorePlan, root: Path, *, replace: bool, max_parallel_shards: int,
            on_progress: ProgressCallback | None) -> RestoreResult:
    """Steps 3-4 of the lifecycle for a planned step."""
    t0 = time.perf_counter()
    step = plan.step
    existed = (root / step_dir_name(step)).exists()
    try:
        sdir = _local._ensure_step_dir(root, step)
    except OSError as e:
        raise _os_error(e, f"step {step}: cannot prepare {root}") from e
    local_bytes = _existing_manifest(sdir)
    keep_manifest = local_bytes is not None and _same_save(local_bytes, plan)
    if local_bytes is not None and not keep_manifest and not replace:
        raise CheckpointExistsError(f"step {step} is committed under {root} by another save; pass "
                                    "replace=True (--replace) to overwrite it with the bucket's copy")
    lock_claimed = False
    tmps: dict[int, Path] = {}
    committed = False
    try:
        if not keep_manifest:
            try:
                _local._claim_save_lock(sdir, step, plan.manifest.save_id)  # I4: refuses a live local writer
            except OSError as e:
                raise _os_error(e, f"step {step}: cannot claim the writer lock of {sdir}") from e
            lock_claimed = True
        for obj in plan.objects:
            tmps[obj.rank] = sdir / temp_name_for(shard_file_name(obj.rank))
        errors: dict[int, BaseException] = {}
        with ThreadPoolExecutor(max_workers=max(1, min(max_parallel_shards, len(plan.objects))),
                                thread_name_prefix="tiered-ckpt-restore") as pool:
            futs = {o.rank: pool.submit(_fetch_one, store, plan, o, tmps[o.rank], on_progress)
                    for o in plan.objects}
            try:
                for rank, fut in futs.items():
                    exc = fut.exception()
                    if exc is not None:
                        errors[rank] = exc
            except BaseException:  # KeyboardInterrupt: stop the transfers in flight, don't wait them out
                for fut in futs.values():
                    fut.cancel()
                stop = getattr(store, "_stop_event", None)
                if stop is not None:
                    stop.set()
                raise
        if errors:
            first = errors[min(errors)]
            if isinstance(first, OSError) and not isinstance(first, CheckpointError):
                raise _os_error(first, f"step {step} rank {min(errors)}: writing the download failed") from first
            raise first
        try:
            if local_bytes is not None and not keep_manifest:
                unlink_durable(sdir / MANIFEST_NAME)  # I2: un-commit before any file of the step changes
                log.warning("step %d: un-committed the local step to replace it with the bucket's copy", step)
            for rank, tmp in sorted(tmps.items()):
                os.rename(tmp, sdir / shard_file_name(rank))
            fsync_dir(sdir)
            if not keep_manifest:
                try:
                    atomic_write_bytes(sdir / MANIFEST_NAME, plan.manifest_bytes, exclusive=True)
                except FileExistsError:  # another rank of this node restored the same step meanwhile
                    now = _existing_manifest(sdir)
                    if now is None or not _same_save(now, plan):
                        raise ConcurrentSaveError(f"step {step}: another writer committed a different save "
                                                  f"into {sdir} meanwhile") from None
                    keep_manifest = True
            committed = True
            _release_lock(sdir, plan.manifest.save_id)
            atomic_write_json(sdir / UPLOADED_MARKER_NAME, _marker(plan))
        except OSError as e:
            raise _os_error(e, f"step {step}: committing the restored step in {sdir} failed") from e
    except BaseException:
        for tmp in tmps.values():
            unlink_quietly(tmp)
        if not committed:
            if lock_claimed and not existed:
                _release_lock(sdir, plan.manifest.save_id)
            if not existed:
                try:
                    os.rmdir(sdir)  # only if empty: another rank may be restoring into it
                except OSError:
                    pass
        raise
    seconds = time.perf_counter() - t0
    log.info("step %d: restored %d shard(s) (%d bytes) from %s into %s in %.2f s", step, len(plan.objects),
             plan.total_bytes, plan.remote_url, sdir, seconds)
    return RestoreResult(plan, sdir, plan.total_bytes, seconds, keep_manifest)


def _release_lock(sdir: Path, save_id: str) -> None:
    path = sdir / SAVE_LOCK_NAME
    try:
        if json.loads(path.read_bytes()).get("save_id") == save_id:
            unlink_quietly(path)
    except (OSError, ValueError, AttributeError):
        pass


def _marker(plan: RestorePlan) -> dict[str, Any]:
    """The sidecar's own marker fields (see upload.py), plus where it came from."""
    return {"step": plan.step, "remote": plan.remote_url, "upload_manifest_sha256": plan.upload_manifest_sha256,
            "restored": True}


# ------------------------------------------------------------------------------------------ API


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
    store: Any = None,
    on_progress: ProgressCallback | None = None,
    on_plan: Callable[[RestorePlan], None] | None = None,
) -> RestoreResult:
    """:func:`restore`, returning the plan and the transfer's figures too. ``on_plan(plan)`` is called
    before the download starts (the CLI sizes its progress bar with it)."""
    transfer = None
    if download_part_size_bytes is not None or download_max_concurrency is not None:
        if store is not None:
            raise ValueError("download settings are ignored when a store is given")
        from tiered_ckpt.store.s3 import TransferSettings

        base = TransferSettings()
        transfer = TransferSettings(
            download_part_size_bytes=download_part_size_bytes or base.download_part_size_bytes,
            download_max_concurrency=download_max_concurrency or base.download_max_concurrency)
    if max_parallel_shards < 1:
        raise ValueError(f"max_parallel_shards must be >= 1, got {max_parallel_shards}")
    root, _ = _local.resolve_root(local_root)
    with _StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url,
                      transfer=transfer) as st:
        skipped: list[tuple[int, str]] = []
        plans = _plans(st, step, ranks, fallback, skipped)
        while True:
            plan = next(plans)
            if on_plan is not None:
                on_plan(plan)
            try:
                return _commit(st, plan, root, replace=replace, max_parallel_shards=max_parallel_shards,
                               on_progress=on_progress)
            except _STEP_FAULTS as exc:
                if not fallback:
                    raise
                log.warning("step %d failed to restore (%s: %s); falling back to the next older step",
                            plan.step, type(exc).__name__, exc)
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

    ``step``: the step to restore (default: the newest remotely committed one). ``ranks``: restore only
    these ranks' shards (default: all). ``fallback``: if the chosen step is broken remotely, try older
    ones (with a warning) instead of failing. ``replace``: overwrite a different save of the same step
    committed locally (un-committed first, I2; default: :class:`CheckpointExistsError`).
    ``s3_client``: an injected botocore client (default: one from boto3's chain, ``endpoint_url`` or
    ``AWS_ENDPOINT_URL``). ``download_part_size_bytes`` / ``download_max_concurrency``: ranged-GET size
    and requests in flight (defaults: :class:`~tiered_ckpt.store.s3.TransferSettings`; large ranges suit
    servers such as moto where a ranged GET costs as much as the whole object, parallel moderate ranges
    suit S3 and MinIO). ``max_parallel_shards``: shards downloaded at once. ``on_progress(delta_bytes)``
    is called from transfer threads.

    Raises :class:`NoCheckpointError` (nothing remotely committed, or the requested step has no upload
    manifest), :class:`MissingShardError` / :class:`ShardCorruptedError` / :class:`ManifestError` (the
    chosen step is broken remotely; nothing committed locally), :class:`CheckpointExistsError`,
    :class:`ConcurrentSaveError` (a live local writer of the same step), :class:`CheckpointWriteError`
    (local disk), :class:`UploadError` (the bucket cannot be read), ``ValueError`` (bad URL or ranks).
    """
    return restore_detailed(remote_url, local_root, step=step, ranks=ranks, s3_client=s3_client,
                            fallback=fallback, replace=replace, endpoint_url=endpoint_url,
                            download_part_size_bytes=download_part_size_bytes,
                            download_max_concurrency=download_max_concurrency,
                            max_parallel_shards=max_parallel_shards, on_progress=on_progress).manifest


# ------------------------------------------------------------------------------------------ training side


def local_ranks_present(root: PathLike, step: int, ranks: Iterable[int]) -> list[int]:
    """Of ``ranks``, those whose shard of the locally committed ``step`` is on disk with the manifest's
    size (cheap: no hashing; loading verifies). ``[]`` if the step is not committed locally."""
    try:
        m = _local.read_manifest(root, step)
    except CheckpointError:
        return []
    sdir = _local.step_path(_local.resolve_root(root)[0], step)
    out = []
    for r in ranks:
        if 0 <= r < m.world_size:
            try:
                if os.lstat(sdir / m.shards[r].path).st_size == m.shards[r].size_bytes:
                    out.append(r)
            except OSError:
                pass
    return out


def ensure_local(root: PathLike, remote_url: str, step: int, ranks: Sequence[int], *, s3_client: Any = None,
                 endpoint_url: str | None = None, **restore_kwargs: Any) -> ShardManifest:
    """Make ``ranks``' shards of ``step`` present in ``root``, restoring the missing ones from the bucket
    (a replaced node, or a whole missing step). No remote call when everything is already local."""
    present = set(local_ranks_present(root, step, ranks))
    missing = sorted(set(ranks) - present)
    if not missing:
        return _local.read_manifest(root, step)
    log.warning("step %d: rank(s) %s missing under %s; restoring them from %s", step, missing, root, remote_url)
    return restore(remote_url, root, step=step, ranks=missing, s3_client=s3_client, endpoint_url=endpoint_url,
                   **restore_kwargs)


def prepare_load_from_remote(root: PathLike, remote_url: str, rank: int, step: int | None, *,
                             common_steps: Callable[[list[int]], list[int]] | None = None,
                             s3_client: Any = None, endpoint_url: str | None = None) -> int:
    """The restore hook of :meth:`CheckpointManager.load`: choose the step to load and make this rank's
    shard of it local. Returns the step.

    ``step=None``: every rank offers the steps it can provide (committed locally with its own shard, or
    remotely committed) and the newest step every rank can provide wins (``common_steps``, a collective
    over the ranks; ``None`` for one process). So a replaced node's ranks restore the newest step the
    bucket holds while the surviving nodes load their local copies of it. When the bucket cannot be read,
    the local steps alone are offered (with a warning). Raises :class:`NoCheckpointError` when no step is
    available to every rank, and :func:`restore`'s errors.
    """
    local = [s for s in _local.committed_steps(root) if local_ranks_present(root, s, [rank])]
    if step is None:
        try:
            remote = remote_committed_steps(remote_url, s3_client=s3_client, endpoint_url=endpoint_url)
        except UploadError as exc:
            log.warning("rank %d: cannot read %s (%s); resuming from local steps only", rank, remote_url, exc)
            remote = []
        offer = sorted(set(local) | set(remote))
        avail = common_steps(offer) if common_steps is not None else offer
        if not avail:
            raise NoCheckpointError(f"no step is available to every rank, locally ({root}) or in {remote_url}")
        step = avail[-1]
    if step not in local:
        ensure_local(root, remote_url, step, [rank], s3_client=s3_client, endpoint_url=endpoint_url)
    return step


__all__ = [
    "REMOTE_COMMITTED", "REMOTE_NO_UPLOAD_MANIFEST", "REMOTE_BAD_UPLOAD_MANIFEST", "REMOTE_VANISHED",
    "RemoteObject", "RestorePlan", "RestoreResult", "RemoteStep",
    "restore", "restore_detailed", "plan_restore", "list_remote_steps", "remote_committed_steps",
    "read_latest_pointer", "ensure_local", "local_ranks_present", "prepare_load_from_remote",
]
