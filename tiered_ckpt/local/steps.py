"""Local tier: per-rank shard files, the manifest commit, and fail-loud loading (SPEC §2).

Lifecycle of one save of step ``S`` by ``world_size`` ranks (who makes each call):

1. coordinator: choose a ``save_id`` (:func:`new_save_id`) and share it with every rank (in a job, a
   broadcast; :class:`~tiered_ckpt.manager.CheckpointManager` does this).
2. every rank: :func:`write_shard` -> :class:`ShardRecord`. Claims the step's writer lock for
   ``save_id`` (a different live ``save_id`` -> :class:`ConcurrentSaveError`, I4), writes
   ``rank_XXXXX.safetensors`` under a unique temp name, fsyncs, renames, fsyncs the directory.
3. coordinator: gathers the records and calls :func:`commit_step`, which checks that every listed
   shard is on disk with the right size and the same ``save_id`` in its header, then writes
   ``manifest.json`` the same durable way, last (I1). The step is committed from that rename on.

Readers (:func:`load_shard`, :func:`load_sharded`, :func:`read_manifest`) see committed steps only (I3),
and verify sizes and hashes before returning anything.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import stat
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from tiered_ckpt.format import shard_file as fmt
from tiered_ckpt.local import reader as sr
from tiered_ckpt.format.crc32c import DEFAULT_CHUNK_BYTES, Crc32c, TensorChunkCrcs
from tiered_ckpt.fs import (atomic_write_bytes, fsync_dir, hostname, owner_alive, owner_token, temp_name_for,
                  unlink_durable, unlink_quietly)
from tiered_ckpt.locks import hold_step_lock
from tiered_ckpt.errors import (CheckpointError, CheckpointExistsError, CheckpointWriteError, ConcurrentSaveError,
                     ManifestError, MissingShardError, NoCheckpointError, ShardCorruptedError,
                     WorldSizeMismatchError)
from tiered_ckpt.layout import MANIFEST_NAME, SAVE_LOCK_NAME, parse_step_dir_name, shard_file_name, step_dir_name
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord

log = logging.getLogger(__name__)

#: Largest manifest we read (bytes).
MAX_MANIFEST_BYTES = 512 * 1024 * 1024
#: Prefix of a step directory being deleted by rotation or gc (renamed first, then removed).
TRASH_PREFIX = ".trash."

PathLike = str | os.PathLike[str]


# ------------------------------------------------------------------------------------------ locating


def new_save_id() -> str:
    """A fresh random save id (32 hex chars)."""
    return uuid.uuid4().hex


def resolve_root(root: PathLike, step: int | None = None) -> tuple[Path, int | None]:
    """Accept a run directory or a step directory. Returns ``(run_root, step)``.

    Raises ``ValueError`` if a step directory is given together with a different ``step``.
    """
    p = Path(root).absolute()
    parsed = parse_step_dir_name(p.name)
    if parsed is not None and not (p / step_dir_name(parsed)).is_dir():
        if step is not None and step != parsed:
            raise ValueError(f"{p} is the directory of step {parsed}, but step={step} was asked for")
        return p.parent, parsed
    return p, step


def step_path(root: PathLike, step: int) -> Path:
    """``<root>/step_XXXXXXXXXX`` (no I/O)."""
    return Path(root).absolute() / step_dir_name(step)


def _is_real_dir(p: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(p).st_mode)
    except OSError:
        return False


def _is_committed(sdir: Path) -> bool:
    """A step is committed iff an entry named ``manifest.json`` is present (I1). One that is not a
    regular file still counts, so that loading it fails loudly (ManifestError) instead of silently
    falling back to an older step."""
    return os.path.lexists(sdir / MANIFEST_NAME)


def all_step_dirs(root: PathLike) -> list[int]:
    """Every step number with a (real, not symlinked) step directory, committed or not, ascending."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        s = parse_step_dir_name(name)
        if s is not None and _is_real_dir(Path(root) / name):
            steps.append(s)
    return sorted(steps)


def symlinked_step_entries(root: PathLike) -> list[int]:
    """Step numbers whose ``step_XXXXXXXXXX`` entry under ``root`` is a symlink (ignored by loads)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(s for name in names
                  if (s := parse_step_dir_name(name)) is not None and os.path.islink(os.path.join(root, name)))


def committed_steps(root: PathLike) -> list[int]:
    """Committed steps (their ``manifest.json`` is present) under the run directory ``root``, ascending
    by step number. Uncommitted leftovers are ignored (I3)."""
    r, _ = resolve_root(root)
    return [s for s in all_step_dirs(r) if _is_committed(r / step_dir_name(s))]


def latest_step(root: PathLike) -> int | None:
    """The newest committed step, or ``None`` when nothing is committed."""
    steps = committed_steps(root)
    return steps[-1] if steps else None


def _pick_step(root: PathLike, step: int | None) -> tuple[Path, int]:
    r, step = resolve_root(root, step)
    if step is None:
        step = latest_step(r)
        if step is None:
            raise NoCheckpointError(f"no committed step under {r}")
    elif not _is_committed(r / step_dir_name(step)):
        raise NoCheckpointError(f"step {step} is not committed under {r}")
    return r, step


# ------------------------------------------------------------------------------------------ manifest


def read_manifest(root: PathLike, step: int | None = None) -> ShardManifest:
    """Read and validate the manifest of ``step`` (newest committed when ``None``).

    Raises :class:`NoCheckpointError` if the step is not committed, :class:`ManifestError` if the
    manifest is unreadable, malformed, hostile, names another step or is a symlink, and
    :class:`MissingShardError` if it lacks or repeats a rank.
    """
    r, step = _pick_step(root, step)
    sdir = r / step_dir_name(step)
    if not _is_real_dir(sdir):
        raise ManifestError(f"{sdir} is not a directory (symlinked step directories are refused)")
    path = sdir / MANIFEST_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NoCheckpointError(f"step {step} is not committed under {r}") from None
    except OSError as e:
        what = "is a symlink" if e.errno == errno.ELOOP else f"cannot be opened: {e.strerror or e}"
        raise ManifestError(f"{path} {what}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"{path} is not a regular file")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{path} is {st.st_size} bytes, over the {MAX_MANIFEST_BYTES}-byte cap")
        data = os.pread(fd, st.st_size + 1, 0)
    except OSError as e:
        raise ManifestError(f"cannot read {path}: {e.strerror or e}") from e
    finally:
        os.close(fd)
    m = ShardManifest.from_json(data)
    if m.step != step:
        raise ManifestError(f"{path} says step {m.step} but lies in the directory of step {step}")
    return m


# ------------------------------------------------------------------------------------------ writing


class _InFlight:
    """Registers a call writing or committing a step directory within this process.

    The on-disk save lock names its owner process, so it cannot tell two threads of one process apart:
    this registry does. A second thread working on the same step for another save (or with
    ``save_id=None``, which would adopt the first thread's save) gets :class:`ConcurrentSaveError`
    (I4); threads of one save (same ``save_id``, e.g. :func:`save_sharded` 's rank threads) share it.
    With ``claim`` the on-disk lock is claimed (across processes) under the same registry lock.
    """

    _guard = threading.Lock()
    _active: dict[str, list[Any]] = {}  # str(step dir) -> [save_id, calls in flight]

    def __init__(self, sdir: Path, step: int, save_id: str | None, *, claim: bool) -> None:
        self.key, self.sdir, self.step, self.save_id, self.claim = str(sdir), sdir, step, save_id, claim

    def enter(self) -> str:
        with self._guard:
            cur = self._active.get(self.key)
            if cur is not None and (self.save_id is None or cur[0] != self.save_id):
                raise ConcurrentSaveError(
                    f"step {self.step}: another thread of this process is saving this step (save {cur[0]}); "
                    "threads writing the ranks of one save must pass the same save_id")
            sid = _claim_save_lock(self.sdir, self.step, self.save_id) if self.claim else self.save_id
            assert sid is not None
            if cur is None:
                self._active[self.key] = [sid, 1]
            else:
                cur[1] += 1
            return sid

    def exit(self) -> None:
        with self._guard:
            ent = self._active[self.key]
            ent[1] -= 1
            if ent[1] == 0:
                del self._active[self.key]


def _claim_save_lock(sdir: Path, step: int, save_id: str | None) -> str:
    """Claim (or join) the writer lock of ``sdir`` for ``save_id``; returns the save id in force.

    - no lock, or a lock of a dead writer: ours (created with ``O_EXCL``, so one of two racing writers
      loses and retries against the winner);
    - a lock with the same ``save_id``: joined (the other ranks of the same save);
    - a lock of this very process (sequential retry, or ``save_id=None`` after an earlier
      :func:`write_shard` of the same save): taken over / adopted;
    - otherwise :class:`ConcurrentSaveError`.
    """
    path = sdir / SAVE_LOCK_NAME
    me = owner_token()
    for _ in range(8):
        try:
            cur = json.loads(path.read_bytes())
            cur_id, cur_owner = str(cur["save_id"]), str(cur["owner"])
        except FileNotFoundError:
            cur = None
        except (OSError, ValueError, KeyError, TypeError):
            cur, cur_id, cur_owner = {}, "", ""  # unreadable lock: treat as stale
        if cur is not None:
            if save_id is None and cur_owner == me:
                return cur_id
            if cur_id == save_id:
                return save_id
            if cur_owner and cur_owner != me and owner_alive(cur_owner):
                raise ConcurrentSaveError(
                    f"step {step}: another writer (save_id {cur_id}, process {cur_owner}) is saving this "
                    f"step; refusing to mix shards of two saves (I4)")
            unlink_quietly(path)  # stale, or our own earlier attempt
        sid = save_id or new_save_id()
        body = json.dumps({"save_id": sid, "owner": me, "created_at": utc_now()}).encode()
        try:
            atomic_write_bytes(path, body, exclusive=True)
            return sid
        except FileExistsError:
            continue  # lost a race: look again
    raise ConcurrentSaveError(f"step {step}: could not claim the writer lock of {sdir}")


def _release_save_lock(sdir: Path, save_id: str) -> None:
    """Remove the writer lock if it is still ``save_id`` 's."""
    path = sdir / SAVE_LOCK_NAME
    try:
        if json.loads(path.read_bytes()).get("save_id") == save_id:
            unlink_quietly(path)
    except (OSError, ValueError, AttributeError):
        pass


def _ensure_step_dir(r: Path, step: int) -> Path:
    sdir = r / step_dir_name(step)
    if not _is_real_dir(r):
        os.makedirs(r, exist_ok=True)
    try:
        os.mkdir(sdir, 0o755)
        fsync_dir(r)
    except FileExistsError:
        if not _is_real_dir(sdir):
            raise CheckpointWriteError(f"{sdir} exists and is not a directory") from None
    return sdir


def _uncommit(sdir: Path, step: int) -> None:
    """Remove ``manifest.json`` (and fsync the directory) before any file of the step changes (I2)."""
    if unlink_durable(sdir / MANIFEST_NAME):
        log.warning("step %d: un-committed the existing step to replace it", step)


def _infer_param_shard(entries: list[fmt.TensorEntry]) -> tuple[int, int]:
    """The rank's ZeRO flat partition: the common ``(offset, numel)`` of its 1-D global slices, or
    ``(0, 0)`` when it holds none or they disagree (pass ``param_shard=`` explicitly then)."""
    spans = {(e.global_offset[0], e.array.shape[0]) for e in entries
             if e.global_shape is not None and len(e.global_shape) == 1}
    if len(spans) == 1:
        return spans.pop()
    if len(spans) > 1:
        log.debug("1-D global slices disagree (%d spans); param_shard left at (0, 0)", len(spans))
    return 0, 0


def write_shard(
    root: PathLike,
    step: int,
    rank: int,
    state: Mapping[str, Any],
    *,
    save_id: str | None = None,
    replace: bool = False,
    param_shard: tuple[int, int] | None = None,
) -> ShardRecord:
    """Write one rank's shard of ``step`` durably (call on every rank).

    ``state``: nested mapping of ``str`` to numpy arrays (bool, (u)int8-64, float16, bfloat16,
    float32/64, complex64, float8 e4m3fn/e5m2/e8m0fnu; any shape incl. 0-d and zero-size; non-contiguous
    is copied per tensor), :class:`~tiered_ckpt.state.GlobalSlice`, or JSON-able values.
    ``param_shard``: the rank's ZeRO flat partition ``(offset, numel)`` in elements; inferred from 1-D
    ``GlobalSlice`` s when omitted. :class:`~tiered_ckpt.state.Replicated` values are stored in rank 0's
    shard only (the other ranks' files hold a reference), so every rank must pass the same value; a load
    hands it to every rank. The record carries the shard's sha256, CRC32C, header sha256 and per-tensor
    chunk CRC32C (manifest schema v2), all computed in the same streaming pass as the write. ``save_id``: shared by every rank of one save (``None``: adopt the
    one this process is already writing for ``step``, or start a new one).

    Raises :class:`CheckpointExistsError` if ``step`` is committed and ``replace`` is false (with
    ``replace=True`` the old step is un-committed first, I2), :class:`ConcurrentSaveError` if another live
    save of ``step`` is in progress (I4), :class:`UnsupportedStateError` for unstorable values, and
    :class:`CheckpointWriteError` (the ``OSError`` as cause) on disk full, EIO or permission errors, after
    removing this attempt's temp file (I5).
    """
    r, _ = resolve_root(root)
    entries: list[fmt.TensorEntry]
    shard_file_name(rank)  # validates rank
    tree, entries = fmt.flatten_state(state, replicated_owner=rank == 0)
    step_dir_name(step)  # validates step
    # Refuse an unstorable state before anything touches the disk (the real header differs only in the
    # save id, at most 64 characters).
    fmt.encode_header(fmt.layout(entries), {"format": fmt.FORMAT_VERSION, "rank": rank, "step": step,
                                            "save_id": "x" * 64, "tree": tree})
    try:
        sdir = _ensure_step_dir(r, step)
        inflight = _InFlight(sdir, step, save_id, claim=True)
        sid = inflight.enter()
    except CheckpointError:
        raise
    except OSError as e:
        raise _write_error(e, f"rank {rank} step {step}: cannot prepare {r}") from e
    try:
        return _write_claimed_shard(r, sdir, step, rank, sid, tree, entries, replace, param_shard)
    finally:
        inflight.exit()


def _write_claimed_shard(r: Path, sdir: Path, step: int, rank: int, sid: str, tree: dict[str, Any],
                         entries: list[fmt.TensorEntry], replace: bool,
                         param_shard: tuple[int, int] | None) -> ShardRecord:
    """The part of :func:`write_shard` that runs with the step claimed for ``sid``."""
    try:
        # Checked after the lock is ours: a save that committed meanwhile linked its manifest before it
        # released the lock, so it is seen here and its shards are never renamed over (I2, I4).
        if _is_committed(sdir):
            if not replace:
                _release_save_lock(sdir, sid)
                raise CheckpointExistsError(
                    f"step {step} is already committed under {r}; pass replace=True to overwrite it")
            _uncommit(sdir, step)
    except CheckpointError:  # CheckpointExistsError is an OSError too: keep its type
        raise
    except OSError as e:
        raise _write_error(e, f"rank {rank} step {step}: cannot prepare {r}") from e
    records = fmt.layout(entries)
    offset, numel_ = param_shard if param_shard is not None else _infer_param_shard(entries)
    header = fmt.encode_header(records, {"format": fmt.FORMAT_VERSION, "rank": rank, "step": step,
                                         "save_id": sid, "tree": tree})
    final = sdir / shard_file_name(rank)
    tmp = sdir / temp_name_for(final.name)
    sha = fmt.new_sha256()
    crc = Crc32c()
    chunk_crcs = TensorChunkCrcs(len(header), records, DEFAULT_CHUNK_BYTES)
    log.debug("rank %d step %d: writing %s", rank, step, final)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            size = fmt.write_stream(fd, fmt.iter_chunks(header, entries), [sha],
                                    inline_hashers=[crc, chunk_crcs])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        fsync_dir(sdir)
    except OSError as e:
        unlink_quietly(tmp)
        raise _write_error(e, f"rank {rank} step {step}: writing {final.name} failed") from e
    except BaseException:
        unlink_quietly(tmp)
        raise
    crcs = chunk_crcs.result()
    return ShardRecord(rank=rank, path=final.name, sha256=sha.hexdigest(), size_bytes=size,
                       param_shard_offset=int(offset), param_shard_numel=int(numel_), host=hostname(),
                       save_id=sid, tensors=tuple(dataclasses.replace(t, crc32c=crcs[t.name]) for t in records),
                       crc32c=crc.hexdigest(), header_sha256=hashlib.sha256(header).hexdigest(),
                       crc32c_chunk_bytes=DEFAULT_CHUNK_BYTES)


def _write_error(e: OSError, what: str) -> CheckpointWriteError:
    reason = {errno.ENOSPC: "disk full", errno.EDQUOT: "quota exceeded", errno.EIO: "I/O error",
              errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
              errno.EROFS: "read-only filesystem"}.get(e.errno or -1, e.strerror or str(e))
    return CheckpointWriteError(f"{what}: {reason}", errno_=e.errno)


def utc_now() -> str:
    """Now in UTC, ISO-8601 with microseconds and a ``Z`` (the manifest's ``created_at``)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def commit_step(
    root: PathLike,
    step: int,
    world_size: int,
    records: Iterable[ShardRecord],
    extra: Mapping[str, Any] | None = None,
    *,
    save_id: str | None = None,
    replace: bool = False,
    wall_clock_seconds: float | None = None,
    local_ranks: Iterable[int] | None = None,
    created_at: str | None = None,
) -> ShardManifest:
    """Commit ``step``: write ``manifest.json`` last, after checking the shards (call on the coordinator;
    with node-local disks, on each node's local rank 0 with that node's ``local_ranks``).

    ``records``: one :class:`ShardRecord` per rank (as returned by :func:`write_shard`, gathered).
    ``extra``: step-level JSON metadata. ``wall_clock_seconds``: elapsed training time (seconds).
    ``local_ranks``: the ranks whose shard files must be present in this ``root`` (default: all).
    ``created_at``: the commit time to record (default now); every node committing one save passes the
    same value so that all copies of the global manifest are byte-identical.

    Raises :class:`MissingShardError` (a rank missing, duplicated, or its file absent),
    :class:`ShardCorruptedError` (a file's size or header disagrees with its record),
    :class:`ConcurrentSaveError` (records or files of another save, I4), :class:`CheckpointExistsError`
    (already committed and not ``replace``), :class:`CheckpointWriteError` (I/O).
    """
    r, _ = resolve_root(root)
    records = sorted(records, key=lambda rec: rec.rank)
    ids = {rec.save_id for rec in records}
    if save_id is None:
        if len(ids) != 1:
            raise ConcurrentSaveError(f"step {step}: records come from {len(ids)} different saves")
        save_id = ids.pop()
    elif ids != {save_id}:
        raise ConcurrentSaveError(f"step {step}: records of save(s) {sorted(ids)[:4]} do not belong to "
                                  f"save {save_id}")
    sdir = r / step_dir_name(step)
    if not _is_real_dir(sdir):
        raise MissingShardError(f"step {step}: {sdir} does not exist")
    manifest = ShardManifest(world_size=world_size, step=step, shards=tuple(records), save_id=save_id,
                             wall_clock_seconds=float(wall_clock_seconds or 0.0),
                             created_at=created_at or utc_now(),
                             extra=dict(extra) if extra is not None else None)
    inflight = _InFlight(sdir, step, save_id, claim=False)
    inflight.enter()
    try:
        return _commit_registered(r, sdir, step, world_size, manifest, save_id, replace, local_ranks)
    finally:
        inflight.exit()


def _commit_registered(r: Path, sdir: Path, step: int, world_size: int, manifest: ShardManifest,
                       save_id: str, replace: bool, local_ranks: Iterable[int] | None) -> ShardManifest:
    """The part of :func:`commit_step` that runs registered as ``save_id`` 's (no other thread of this
    process can rename a shard of another save between the checks and the manifest link)."""
    try:
        cur = json.loads((sdir / SAVE_LOCK_NAME).read_bytes()).get("save_id")
    except (OSError, ValueError, AttributeError):
        cur = None
    if cur is not None and cur != save_id:
        raise ConcurrentSaveError(f"step {step}: save {cur} has taken over this step; not committing "
                                  f"save {save_id}")
    present = set(range(world_size)) if local_ranks is None else set(local_ranks)
    for rec in manifest.shards:
        if rec.rank in present:
            _check_written_shard(sdir, rec, step, save_id)
    if _is_committed(sdir):
        if not replace:
            raise CheckpointExistsError(f"step {step} is already committed under {r}")
        _uncommit(sdir, step)
    try:
        atomic_write_bytes(sdir / MANIFEST_NAME, manifest.to_json().encode(), exclusive=True)
    except FileExistsError:
        raise CheckpointExistsError(f"step {step} was committed by another writer meanwhile") from None
    except OSError as e:
        raise _write_error(e, f"step {step}: writing {MANIFEST_NAME} failed") from e
    _release_save_lock(sdir, save_id)
    log.info("step %d: committed %d shard(s), %d bytes, save %s", step, world_size, manifest.total_bytes,
             save_id)
    return manifest


def _check_written_shard(sdir: Path, rec: ShardRecord, step: int, save_id: str) -> None:
    """Cheap pre-commit check: file present, size right, header names this save, rank and step."""
    path = sdir / rec.path
    where = f"step {step} rank {rec.rank} ({rec.path})"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MissingShardError(f"{where}: shard file is missing") from None
    except OSError as e:
        raise _write_error(e, f"{where}: cannot open") from e
    try:
        size = os.fstat(fd).st_size
        if size != rec.size_bytes:
            raise ShardCorruptedError(f"{where}: {size} bytes on disk, record says {rec.size_bytes}")
        n = fmt.parse_header_length(os.pread(fd, 8, 0), size, where)
        hdr = fmt.parse_header(os.pread(fd, n, 8), size, where)
    finally:
        os.close(fd)
    meta = hdr.metadata
    if meta.get("save_id") != save_id:
        raise ConcurrentSaveError(f"{where}: file belongs to save {meta.get('save_id')!r}, not {save_id} "
                                  "(another writer replaced it; I4)")
    if meta.get("rank") != rec.rank or meta.get("step") != step:
        raise ShardCorruptedError(f"{where}: header names rank {meta.get('rank')} step {meta.get('step')}")


def save_sharded(
    state_dict_per_rank: Sequence[Mapping[str, Any]],
    root: PathLike,
    step: int,
    extra: Mapping[str, Any] | None = None,
    *,
    replace: bool = False,
    wall_clock_seconds: float | None = None,
) -> ShardManifest:
    """Single-process convenience (the seed's API): write every rank's shard in parallel, then commit.

    ``state_dict_per_rank[i]`` is rank ``i`` 's state. Errors as :func:`write_shard` and
    :func:`commit_step`; when several ranks fail, the lowest rank's error is raised.
    """
    world_size = len(state_dict_per_rank)
    if world_size < 1:
        raise ValueError("state_dict_per_rank is empty")
    r, _ = resolve_root(root)
    step_dir_name(step)  # validates step
    try:
        sdir = _ensure_step_dir(r, step)
        # This call owns the whole save: claim the step once for every rank thread (they join it).
        inflight = _InFlight(sdir, step, new_save_id(), claim=True)
        sid = inflight.enter()
    except OSError as e:
        raise _write_error(e, f"step {step}: cannot prepare {r}") from e
    records: list[ShardRecord] = []
    try:
        if replace and _is_committed(sdir):
            # Un-commit once, up front, so that no rank sees a committed step mid-way (I2).
            try:
                _uncommit(sdir, step)
            except OSError as e:
                raise _write_error(e, f"step {step}: cannot un-commit the step to replace it") from e
        with ThreadPoolExecutor(max_workers=min(world_size, 8), thread_name_prefix="tiered-ckpt-save") as pool:
            futs = [pool.submit(write_shard, r, step, rank, st, save_id=sid)
                    for rank, st in enumerate(state_dict_per_rank)]
            errors = []
            for f in futs:
                try:
                    records.append(f.result())
                except CheckpointError as e:
                    errors.append(e)
        if errors:
            raise errors[0]
        return commit_step(r, step, world_size, records, extra, save_id=sid,
                           wall_clock_seconds=wall_clock_seconds)
    except CheckpointError:
        # Failed: take this attempt's shards away again (a failed save on a full disk must not keep the
        # disk full) and let go of the step, so that another process may save it at once.
        if not _is_committed(sdir):
            for rec in records:
                unlink_quietly(sdir / rec.path)
        _release_save_lock(sdir, sid)
        raise
    finally:
        inflight.exit()


# ------------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class VerifiedShard:
    """A shard read whole and verified: ``buffer`` holds the file, ``header`` its parsed header."""

    record: ShardRecord
    buffer: np.ndarray  # uint8, the whole file
    header: fmt.ParsedHeader


def read_shard_verified(sdir: Path, manifest: ShardManifest, rank: int, verify: str = "sha256") -> VerifiedShard:
    """Open rank ``rank`` 's shard without following symlinks, check size, hash, header against the
    manifest's record. ``verify``: ``"sha256"`` (default) or ``"crc32c"`` (the fast path; sha256 when the
    manifest has no CRC32C, as for a step saved by schema version 1).
    Raises MissingShardError, ShardCorruptedError, ManifestError; ``ValueError`` for another ``verify``."""
    sr.check_verify_mode(verify)
    rec = manifest.shards[rank]
    where = f"step {manifest.step} rank {rank} ({rec.path})"
    fd = sr.open_shard(sdir, rec, where)  # no symlinks, a regular file of the recorded size
    try:
        algo = "crc32c" if verify == "crc32c" and rec.crc32c is not None else "sha256"
        sha: Any = Crc32c() if algo == "crc32c" else fmt.new_sha256()
        expected = rec.crc32c if algo == "crc32c" else rec.sha256
        try:
            buf = fmt.read_verified(fd, rec.size_bytes, [sha], where)
        except OSError as e:
            raise ShardCorruptedError(f"{where}: read failed: {e.strerror or e}") from e
    finally:
        os.close(fd)
    if sha.hexdigest() != expected:
        raise ShardCorruptedError(f"{where}: {algo} {sha.hexdigest()[:16]}... differs from the manifest's "
                                  f"{str(expected)[:16]}... (corrupt or partial write)")
    n = fmt.parse_header_length(bytes(buf[:8]), len(buf), where)
    hdr = fmt.parse_header(bytes(buf[8 : 8 + n]), len(buf), where)
    sr.match_header(hdr, rec, manifest, where)
    return VerifiedShard(rec, buf, hdr)


def _load_rank(sdir: Path, manifest: ShardManifest, rank: int, verify: str = "sha256",
               resolve_ref: Callable[[tuple[str, ...]], Any] | None = None) -> dict[str, Any]:
    """Rank ``rank`` 's state. Replicated values stored in rank 0's shard come from ``resolve_ref``
    (default: read from rank 0's file, only the parts needed, verified by the per-tensor checksums)."""
    shard = read_shard_verified(sdir, manifest, rank, verify)
    where = f"step {manifest.step} rank {rank}"
    if resolve_ref is None and rank != 0:
        reader: list[sr.ShardReader] = []

        def resolve_ref(path: tuple[str, ...]) -> Any:
            if not reader:
                reader.append(sr.ShardReader(sdir, manifest, 0))
            return sr.read_replicated(reader[0], path)

        try:
            return fmt.decode_state(shard.buffer, shard.header, where, resolve_ref)
        finally:
            for rd in reader:
                rd.close()
    return fmt.decode_state(shard.buffer, shard.header, where, resolve_ref)


def _copy_value(v: Any) -> Any:
    """An independent copy of a loaded value (nested dicts, arrays, JSON)."""
    if isinstance(v, dict):
        return {k: _copy_value(x) for k, x in v.items()}
    if isinstance(v, np.ndarray):
        return v.copy()
    return json.loads(json.dumps(v, allow_nan=True)) if isinstance(v, list) else v


def _get_path(state: Mapping[str, Any], path: tuple[str, ...], where: str) -> Any:
    v: Any = state
    for k in path:
        if not isinstance(v, Mapping) or k not in v:
            raise ShardCorruptedError(f"{where}: rank 0 holds no replicated value at {'/'.join(path)[:80]!r}")
        v = v[k]
    return v


def _check_world(manifest: ShardManifest, expected_world_size: int) -> None:
    if manifest.world_size != expected_world_size:
        raise WorldSizeMismatchError(
            f"step {manifest.step} was saved by {manifest.world_size} ranks, but {expected_world_size} "
            "are loading it (resharding was not asked for)")


class _MaybeReadLock:
    """A ``read`` lock so that rotation skips the step while it is read; a read-only checkpoint
    directory (where no lock file can be made) is read without one."""

    def __init__(self, sdir: Path) -> None:
        self._cm = hold_step_lock(sdir, "read")
        self._held = False

    def __enter__(self) -> None:
        try:
            self._cm.__enter__()
            self._held = True
        except OSError:
            self._held = False

    def __exit__(self, *exc: object) -> None:
        if self._held:
            self._cm.__exit__(None, None, None)


def load_shard(
    root: PathLike,
    rank: int,
    expected_world_size: int,
    step: int | None = None,
    *,
    verify: str = "sha256",
    reshard: bool = False,
    rules: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load and verify rank ``rank`` 's state of ``step`` (newest committed when ``None``).

    Returns the nested state as saved; arrays are byte-identical (little-endian, writable);
    :class:`~tiered_ckpt.state.Replicated` values come back plain. ``verify``: ``"sha256"`` (default,
    whole file) or ``"crc32c"`` (fast path; sha256 for steps without CRC32C). ``reshard=True`` with an
    ``expected_world_size`` other than the saved one returns this rank's share of a re-split checkpoint,
    reading only the byte ranges it needs (see :func:`tiered_ckpt.reshard.reshard_states` for the split
    rule, ``rules`` and what ``verify`` means there).
    Raises :class:`NoCheckpointError`, :class:`WorldSizeMismatchError`, :class:`MissingShardError`,
    :class:`ShardCorruptedError`, :class:`ManifestError`, :class:`ReshardError`; ``ValueError`` for a rank
    outside the world.
    """
    sr.check_verify_mode(verify)
    r, step = _pick_step(root, step)
    m = read_manifest(r, step)
    if reshard and m.world_size != expected_world_size:
        from tiered_ckpt.local.reshard import reshard_states

        if not 0 <= rank < expected_world_size:
            raise ValueError(f"rank {rank} is outside world_size {expected_world_size}")
        return reshard_states(r, step, expected_world_size, ranks=[rank], rules=rules, manifest=m)[0]
    _check_world(m, expected_world_size)
    if not 0 <= rank < m.world_size:
        raise ValueError(f"rank {rank} is outside world_size {m.world_size}")
    sdir = r / step_dir_name(step)
    with _MaybeReadLock(sdir):
        return _load_rank(sdir, m, rank, verify)


def load_sharded(
    root: PathLike,
    expected_world_size: int,
    step: int | None = None,
    *,
    verify: str = "sha256",
    reshard: bool = False,
    rules: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Load and verify every rank's state of ``step``; element ``i`` is rank ``i`` 's state.

    ``verify``, ``reshard`` and ``rules`` as in :func:`load_shard` (with ``reshard=True`` the list has
    ``expected_world_size`` entries). Errors as :func:`load_shard`; every shard is verified before
    anything is returned.
    """
    sr.check_verify_mode(verify)
    r, step = _pick_step(root, step)
    m = read_manifest(r, step)
    if reshard and m.world_size != expected_world_size:
        from tiered_ckpt.local.reshard import reshard_states

        return reshard_states(r, step, expected_world_size, rules=rules, manifest=m)
    _check_world(m, expected_world_size)
    sdir = r / step_dir_name(step)
    with _MaybeReadLock(sdir), ThreadPoolExecutor(max_workers=min(4, m.world_size)) as pool:
        first = _load_rank(sdir, m, 0, verify)

        def resolve(path: tuple[str, ...]) -> Any:
            return _copy_value(_get_path(first, path, f"step {m.step} rank 0"))

        rest = list(pool.map(lambda k: _load_rank(sdir, m, k, verify, resolve), range(1, m.world_size)))
        return [first] + rest
