"""The local commit protocol (SPEC §2, invariants I1-I5): the one place that makes local files
durable, and the coordinator's :func:`commit_step`.

Every durable local write goes through here (shards, manifests, downloads, ``uploaded.json``,
``node_ranks.json``, writer locks, ``run.json``; the set-aside of superseded steps, SPEC §11): a
unique temp name in the same directory, ``fsync``, ``rename(2)``, then ``fsync`` of the directory.

Lifecycle of one save of step ``S`` (:class:`LocalStepCommit`; who calls each):

1. every writer (each rank's :func:`~tiered_ckpt.local.writer.write_shard`, the coordinator's
   :func:`commit_step`, a restore): :meth:`LocalStepCommit.open` makes the step directory durably,
   registers the call in this process (threads of one save share a ``save_id``, chosen by the
   coordinator: :func:`tiered_ckpt.fs.new_save_id`) and, with ``claim=True``, claims or joins the
   on-disk writer lock ``.save.lock`` (a live writer of another save: :class:`ConcurrentSaveError`).
2. the writer: ``is_committed`` / ``uncommit`` (with ``replace``: ``manifest.json`` removed and the
   directory fsynced before any file of the step changes, I2).
3. the writer: ``write_file`` (a shard) or ``stage`` + ``publish`` (downloads: fetched into temp
   names, then fsynced and renamed together).
4. the coordinator: :func:`commit_step` checks every listed local shard (size, header's save id,
   rank and step), records a node-local root's ranks (``node_ranks.json``), then
   ``commit_manifest``: ``manifest.json`` linked exclusively (an existing one:
   :class:`CheckpointExistsError`) and the directory fsynced. The step is committed from that link
   on (I1). Then ``release_lock``. A restore calls ``commit_manifest`` itself.
5. everyone: leave the ``with`` block (``close``): the registration ends, unpublished temps are
   removed. A failed writer calls ``abandon`` first (lock released if this open made it, an empty
   directory too).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointWriteError,
    ConcurrentSaveError,
    ManifestError,
    MissingShardError,
    ShardCorruptedError,
)
from tiered_ckpt.format import shard_file as fmt
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.fs import (
    is_real_dir,
    new_save_id,
    owner_alive,
    owner_token,
    temp_name_for,
    unlink_quietly,
    utc_now,
    write_all,
)
from tiered_ckpt.layout import (
    MANIFEST_NAME,
    NODE_RANKS_NAME,
    SAVE_LOCK_NAME,
    SUPERSEDED_DIR,
    save_entry_name,
    step_dir_name,
)
from tiered_ckpt.layout import (
    UPLOADED_MARKER_NAME as UPLOADED,
)
from tiered_ckpt.local.catalogue import is_committed, read_run_record, superseded_hint, write_root
from tiered_ckpt.local.held_ranks import node_ranks_bytes
from tiered_ckpt.safe_read import open_file, read_existing, read_json_record

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


# --- durable files


def _fsync(path: str | os.PathLike[str], flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that entries created, renamed or removed in it are durable (POSIX)."""
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync a file that was written without (a download; not through a symlink); raises
    ``OSError``."""
    _fsync(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)


def rename_durable(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Rename ``src`` to ``dst`` (a file or directory; POSIX ``rename``, atomic within one file
    system) and fsync ``dst`` 's directory. Raises ``OSError``."""
    os.rename(src, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))


def durable_write(
    path: str | os.PathLike[str],
    writer: Callable[[int], None],
    *,
    exclusive: bool = False,
    dir_fsync: bool = True,
) -> None:
    """Durably create or replace ``path`` with whatever ``writer(fd)`` writes: a temp file in the
    same directory (``O_CREAT|O_EXCL``, mode 0o644), ``writer(fd)``, ``fsync``, ``rename`` over
    ``path`` (or, with ``exclusive=True``, ``link`` + ``unlink``: an existing ``path`` fails with
    ``FileExistsError``), then fsync the directory. On any error the temp file is removed and the
    ``OSError`` propagates; with ``exclusive=True`` an error of the directory fsync removes ``path``
    again: an error means "not created"."""
    path = Path(path)
    tmp = path.with_name(temp_name_for(path.name))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            writer(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            os.link(tmp, path)
        else:
            os.rename(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    if exclusive:
        unlink_quietly(tmp)  # a leftover hard link is harmless: gc removes it once we are gone
    if dir_fsync:
        try:
            fsync_dir(path.parent)
        except BaseException:
            if exclusive:
                # The new entry may not be durable: take it away again so that the caller's error is
                # the whole truth (for a manifest: the step is not committed, the previous stays
                # newest).
                unlink_quietly(path)
            raise


def durable_write_bytes(
    path: str | os.PathLike[str], data: bytes, *, exclusive: bool = False, dir_fsync: bool = True
) -> None:
    """:func:`durable_write` of a bytes object."""
    durable_write(path, lambda fd: write_all(fd, data), exclusive=exclusive, dir_fsync=dir_fsync)


def unlink_durable(path: str | os.PathLike[str]) -> bool:
    """Remove ``path`` and fsync its directory. Returns whether it existed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(Path(path).parent)
    return True


# --- step directory


def ensure_step_dir(root: Path, step: int) -> Path:
    """Make ``<root>/step_XXXXXXXXXX`` (and ``root``) if missing, durably; returns it. Raises
    :class:`CheckpointWriteError` if the entry exists and is not a real directory, ``OSError``
    otherwise."""
    sdir = root / step_dir_name(step)
    if not is_real_dir(root):
        os.makedirs(root, exist_ok=True)
    try:
        os.mkdir(sdir, 0o755)
        fsync_dir(root)
    except FileExistsError:
        if not is_real_dir(sdir):
            raise CheckpointWriteError(
                f"step {step}: {sdir} exists and is not a directory"
            ) from None
    return sdir


def set_aside_step(root: Path, step: int, save_id: str | None) -> Path | None:
    """Move the committed ``<root>/step_XXXXXXXXXX`` to ``<root>/superseded/<save_entry_name(step,
    save_id)>`` (SPEC §11), durably: ``superseded/`` made and the root fsynced, ``rename(2)``, then
    both parents fsynced. Returns the new path, or ``None`` if the step directory is already gone
    (another rank sharing the root moved it). Raises ``FileExistsError`` if the target exists (the
    step stays), :class:`CheckpointWriteError` if ``superseded`` is not a real directory,
    ``OSError`` otherwise."""
    into = root / SUPERSEDED_DIR
    dst = into / save_entry_name(step, save_id)
    try:
        os.mkdir(into, 0o755)
        fsync_dir(root)
    except FileExistsError:
        if not is_real_dir(into):
            raise CheckpointWriteError(f"{into} exists and is not a directory") from None
    if os.path.lexists(dst):
        raise FileExistsError(f"step {step}: {dst} already exists; the step stays in place")
    try:
        os.rename(root / step_dir_name(step), dst)
    except FileNotFoundError:
        return None
    for d in (into, root):
        fsync_dir(d)
    return dst


def lock_holder(step_dir: Path) -> str | None:
    """The ``save_id`` named by the step's writer lock, or ``None`` (no lock, or unreadable)."""
    sid = (read_json_record(step_dir / SAVE_LOCK_NAME) or {}).get(
        "save_id"
    )  # never follows or blocks
    return sid if isinstance(sid, str) else None


def claim_save_lock(step_dir: Path, step: int, save_id: str | None) -> tuple[str, bool]:
    """Claim (or join) the writer lock of ``step_dir`` for ``save_id``; returns the save id in force
    and whether this call created the lock file (``False``: it joined or adopted a lock already
    there). No lock, or a dead writer's: ours (``O_EXCL``: of two racing writers one loses and looks
    again). The same ``save_id``: joined (the other ranks of the save). This very process's (a
    sequential retry, or ``save_id=None`` after an earlier write of the save): taken over / adopted.
    Else :class:`ConcurrentSaveError` (I4)."""
    path = step_dir / SAVE_LOCK_NAME
    me = owner_token()
    for _ in range(8):
        try:
            cur = json.loads(read_existing(path))  # never follows, never blocks on a FIFO, capped
            cur_id, cur_owner = str(cur["save_id"]), str(cur["owner"])
        except FileNotFoundError:
            cur = None
        except (OSError, ValueError, KeyError, TypeError):
            cur, cur_id, cur_owner = {}, "", ""  # unreadable lock: treat as stale
        if cur is not None:
            if save_id is None and cur_owner == me:
                return cur_id, False
            if cur_id == save_id:
                return save_id, False
            if cur_owner and cur_owner != me and owner_alive(cur_owner):
                raise ConcurrentSaveError(
                    f"step {step}: another writer (save_id {cur_id}, process {cur_owner}) is saving this "
                    f"step; refusing to mix shards of two saves (I4)"
                )
            unlink_quietly(path)  # stale, or our own earlier attempt
        sid = save_id or new_save_id()
        body = json.dumps({"save_id": sid, "owner": me, "created_at": utc_now()}).encode()
        try:
            durable_write_bytes(path, body, exclusive=True)
            return sid, True
        except FileExistsError:
            continue  # lost a race: look again
    raise ConcurrentSaveError(f"step {step}: could not claim the writer lock of {step_dir}")


def release_save_lock(step_dir: Path, save_id: str) -> None:
    """Remove the writer lock if it is still ``save_id`` 's."""
    if lock_holder(step_dir) == save_id:
        unlink_quietly(step_dir / SAVE_LOCK_NAME)


def _rmdir_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)  # fails (and is left) when not empty: another rank may be writing into it


class _Registry:
    """Calls writing or committing a step directory within this process. The on-disk save lock names
    its owner process, so it cannot tell two threads of one process apart: this registry does. A
    second thread on the same step for another save (or with ``save_id=None``, which would adopt the
    first thread's save) gets :class:`ConcurrentSaveError` (I4); threads of one save
    (``save_sharded`` 's rank threads) share it. The on-disk lock is claimed under the registry's
    lock, so the two checks are one."""

    guard = threading.Lock()
    active: dict[str, tuple[str, int]] = {}  # str(step dir) -> (save_id, calls in flight)

    @classmethod
    def enter(cls, sdir: Path, step: int, save_id: str | None, claim: bool) -> tuple[str, bool]:
        """Register; with ``claim``, claim or join the on-disk lock. Returns ``(save id, lock
        created)``."""
        key = str(sdir)
        with cls.guard:
            cur = cls.active.get(key)
            if cur is not None and (save_id is None or cur[0] != save_id):
                raise ConcurrentSaveError(
                    f"step {step}: another thread of this process is saving this step (save {cur[0]}); "
                    "threads writing the ranks of one save must pass the same save_id"
                )
            sid, created = claim_save_lock(sdir, step, save_id) if claim else (save_id, False)
            assert sid is not None
            cls.active[key] = (sid, 1 if cur is None else cur[1] + 1)
            return sid, created

    @classmethod
    def exit(cls, sdir: Path) -> None:
        with cls.guard:
            sid, calls = cls.active.pop(str(sdir))
            if calls > 1:
                cls.active[str(sdir)] = (sid, calls - 1)


# --- the protocol


class LocalStepCommit:
    """One writer's hold on one step directory: the local commit protocol object (see the module
    docstring for the numbered lifecycle). Use as a context manager, from :meth:`open`.

    Attributes: ``root`` (the run directory), ``step``, ``step_dir``, ``save_id`` (the save in
    force), ``created_dir`` (whether this open made the step directory), ``claimed`` (whether this
    open created the writer lock, rather than joining one), ``committed`` (set by
    :meth:`commit_manifest`).
    """

    def __init__(
        self,
        root: Path,
        step: int,
        step_dir: Path,
        save_id: str,
        *,
        created_dir: bool,
        claimed: bool,
    ) -> None:
        self.root, self.step, self.step_dir, self.save_id = root, step, step_dir, save_id
        self.created_dir, self.claimed = created_dir, claimed
        self.committed = False
        self._staged: dict[str, Path] = {}
        self._synced: set[str] = set()
        self._open = True

    @classmethod
    def open(
        cls, root: Path, step: int, save_id: str | None, *, claim: bool = True, create: bool = True
    ) -> LocalStepCommit:
        """Step 1. ``claim``: claim or join the on-disk writer lock for ``save_id`` (``None``: adopt
        this process's save of the step, or start a new one); without it only the in-process
        registration is made (the coordinator's commit, whose ranks hold the lock). ``create``: make
        the step directory (else it must exist: :class:`~tiered_ckpt.errors.MissingShardError` is
        the caller's to raise). Raises :class:`ConcurrentSaveError` (I4),
        :class:`CheckpointWriteError` (the step entry is not a directory), ``OSError`` (disk)."""
        if not claim and save_id is None:
            raise ValueError("a registration without a claim needs the save_id")
        sdir = root / step_dir_name(step)
        existed = os.path.lexists(sdir)
        if create:
            sdir = ensure_step_dir(root, step)
        try:
            sid, created = _Registry.enter(sdir, step, save_id, claim)
        except BaseException:
            if create and not existed:
                _rmdir_if_empty(sdir)  # leave nothing behind when the claim fails (I3)
            raise
        return cls(root, step, sdir, sid, created_dir=create and not existed, claimed=created)

    # step 2
    def is_committed(self) -> bool:
        """Whether ``manifest.json`` is present (I1)."""
        return is_committed(self.step_dir)

    def uncommit(self) -> bool:
        """Remove ``uploaded.json`` (it was written for the old manifest: the step is to be uploaded
        again) and then ``manifest.json``, each durably, before any file of the step changes (I2).
        Returns whether there was a manifest."""
        unlink_durable(self.step_dir / UPLOADED)
        if unlink_durable(self.step_dir / MANIFEST_NAME):
            log.warning(
                "step %d: un-committed the existing step in %s to replace it",
                self.step,
                self.step_dir,
            )
            return True
        return False

    def check_lock(self) -> None:
        """Raise :class:`ConcurrentSaveError` if another save has taken the writer lock over
        (I4)."""
        cur = lock_holder(self.step_dir)
        if cur is not None and cur != self.save_id:
            raise ConcurrentSaveError(
                f"step {self.step}: save {cur} has taken over this step; not committing "
                f"save {self.save_id}"
            )

    # step 3
    def write_file(self, name: str, writer: Callable[[int], None]) -> None:
        """Durably create or replace ``<step dir>/<name>`` with what ``writer(fd)`` writes (temp
        name, fsync, rename, directory fsync). The ``OSError`` propagates; the temp file is
        removed."""
        durable_write(self.step_dir / name, writer)

    def stage(self, name: str) -> Path:
        """A unique temp path in the step directory for the future ``name`` (e.g. a download
        target); removed again by :meth:`close` unless :meth:`publish` renamed it."""
        tmp = self.step_dir / temp_name_for(name)
        self._staged[name] = tmp
        return tmp

    def sync_staged(self, name: str) -> None:
        """fsync the staged file of ``name`` now (e.g. on the thread that downloaded it, so that the
        flushes of several files overlap); :meth:`publish` then does not fsync it again. Raises
        ``OSError``."""
        fsync_file(self._staged[name])
        self._synced.add(name)

    def publish(self, names: list[str] | None = None) -> None:
        """fsync each staged file not yet synced (``names``: default all staged), rename it onto its
        name, then fsync the directory once. Raises ``OSError``; what was renamed stays renamed (the
        step is not committed)."""
        todo = sorted(self._staged) if names is None else names
        for name in todo:
            if name not in self._synced:
                fsync_file(self._staged[name])
        for name in todo:
            os.rename(self._staged[name], self.step_dir / name)
            del self._staged[
                name
            ]  # only once renamed: a failed rename leaves it for discard_staged
        fsync_dir(self.step_dir)

    def discard_staged(self) -> None:
        """Remove every staged temp file not yet published."""
        for tmp in self._staged.values():
            unlink_quietly(tmp)
        self._staged.clear()

    # step 4
    def commit_manifest(self, data: bytes) -> None:
        """Link ``manifest.json`` exclusively and fsync the directory: the commit point (I1). Raises
        :class:`CheckpointExistsError` if a manifest is present (another writer committed
        meanwhile), :class:`CheckpointWriteError` on I/O (then nothing is committed)."""
        try:
            durable_write_bytes(self.step_dir / MANIFEST_NAME, data, exclusive=True)
        except FileExistsError:
            raise CheckpointExistsError(
                f"step {self.step} was committed by another writer meanwhile"
            ) from None
        except OSError as e:
            raise CheckpointWriteError.from_os_error(
                e, f"step {self.step}: writing {MANIFEST_NAME} failed"
            ) from e
        self.committed = True

    def release_lock(self) -> None:
        """Remove the writer lock if it is still this save's."""
        release_save_lock(self.step_dir, self.save_id)

    # step 5
    def abandon(self) -> None:
        """A failed writer lets go: staged temps removed, the lock released if this open claimed it,
        and a step directory this open created removed again when empty (another rank may be writing
        into it)."""
        self.discard_staged()
        if self.committed:
            return
        if self.claimed:
            self.release_lock()
        if self.created_dir:
            _rmdir_if_empty(self.step_dir)

    def close(self) -> None:
        """End the in-process registration; staged temps not published are removed."""
        if self._open:
            self._open = False
            self.discard_staged()
            _Registry.exit(self.step_dir)

    def __enter__(self) -> LocalStepCommit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the step's commit: manifest.json, last


def record_node_ranks(
    step_dir: Path, ranks: Iterable[int], world_size: int, *, dir_fsync: bool = True
) -> None:
    """Durably write ``node_ranks.json`` into ``step_dir`` (``dir_fsync=False`` when a later
    directory fsync of the same directory, the manifest's, makes it durable). Raises ``OSError``,
    ``ValueError``."""
    durable_write_bytes(
        step_dir / NODE_RANKS_NAME, node_ranks_bytes(ranks, world_size), dir_fsync=dir_fsync
    )


def clear_node_ranks(step_dir: Path) -> bool:
    """Remove ``node_ranks.json`` (a step re-saved with every rank). Returns whether it existed.
    Looks first (one ``lstat``), so that the common case, no file, costs no ``unlink`` and no
    directory fsync."""
    path = step_dir / NODE_RANKS_NAME
    return os.path.lexists(path) and unlink_durable(path)


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
    run_id: str | None = None,
    attempt: int | None = None,
) -> ShardManifest:
    """Commit ``step``: write ``manifest.json`` last, after checking the shards (call on the
    coordinator; with node-local disks, on each node's local rank 0 with that node's
    ``local_ranks``).

    ``records``: one :class:`ShardRecord` per rank (as returned by :func:`write_shard`, gathered).
    ``extra``: step-level JSON metadata. ``wall_clock_seconds``: elapsed training time (seconds).
    ``local_ranks``: the ranks whose shard files must be present in this ``root`` (default: all).
    ``created_at``: the commit time to record (default now); every node committing one save passes
    the same value so that all copies of the global manifest are byte-identical.
    ``run_id``/``attempt``: the lineage to record in the manifest (SPEC §11); each defaults to the
    root's ``run.json`` (its run id and current attempt; ``None`` and 1 without a record). Recorded
    as given: this call never supersedes anything (only ``CheckpointManager`` and ``restore`` decide
    lineage). With ``replace``, the old step's ``uploaded.json`` is removed (durably, before its
    manifest) by the un-commit: the re-saved step is uploaded again.

    Raises :class:`MissingShardError` (a rank missing, duplicated, or its file absent),
    :class:`ShardCorruptedError` (a file's size or header disagrees with its record),
    :class:`ConcurrentSaveError` (records or files of another save, I4),
    :class:`CheckpointExistsError` (already committed and not ``replace``),
    :class:`CheckpointWriteError` (I/O), :class:`ManifestError` (a malformed ``run.json`` when the
    lineage is defaulted), ``ValueError`` (a bad ``run_id``/``attempt``).
    """
    r = write_root(root)
    run_id, attempt = default_lineage(r, run_id, attempt)
    records = sorted(records, key=lambda rec: rec.rank)
    ids = {rec.save_id for rec in records}
    if save_id is None:
        if len(ids) != 1:
            raise ConcurrentSaveError(f"step {step}: records come from {len(ids)} different saves")
        save_id = ids.pop()
    elif ids != {save_id}:
        raise ConcurrentSaveError(
            f"step {step}: records of save(s) {sorted(ids)[:4]} do not belong to save {save_id}"
        )
    sdir = r / step_dir_name(step)
    if not is_real_dir(sdir):
        raise MissingShardError(f"step {step}: {sdir} does not exist")
    manifest = ShardManifest(
        world_size=world_size,
        step=step,
        shards=tuple(records),
        save_id=save_id,
        wall_clock_seconds=float(wall_clock_seconds or 0.0),
        created_at=created_at or utc_now(),
        extra=dict(extra) if extra is not None else None,
        run_id=run_id,
        attempt=attempt,
    )
    # Registered as save_id's: no other thread of this process can rename a shard of another save
    # between the checks and the manifest link.
    present = set(range(world_size)) if local_ranks is None else set(local_ranks)
    if not present <= set(range(world_size)):
        raise ValueError(
            f"step {step}: local_ranks {sorted(present)[:8]} are not ranks of world size {world_size}"
        )
    with LocalStepCommit.open(r, step, save_id, claim=False, create=False) as hold:
        hold.check_lock()
        for rec in manifest.shards:
            if rec.rank in present:
                check_written_shard(sdir, rec, step, save_id)
        if hold.is_committed():
            if not replace:
                raise CheckpointExistsError(
                    f"step {step} is already committed under {r}{superseded_hint(r, step)}"
                )
            hold.uncommit()
        try:  # node-local: say which ranks this root holds (verify); durable with the manifest's dir fsync
            if present and present != set(range(world_size)):
                record_node_ranks(sdir, present, world_size, dir_fsync=False)
            else:
                clear_node_ranks(sdir)
        except OSError as e:
            raise CheckpointWriteError.from_os_error(
                e, f"step {step}: cannot record the node's ranks"
            ) from e
        hold.commit_manifest(manifest.to_json().encode())
        hold.release_lock()
    log.info(
        "step %d: committed %d shard(s), %d bytes, save %s, run %s attempt %d",
        step,
        world_size,
        manifest.total_bytes,
        save_id,
        run_id,
        attempt,
    )
    return manifest


def default_lineage(root: Path, run_id: str | None, attempt: int | None) -> tuple[str | None, int]:
    """``(run_id, attempt)`` to record for a save into ``root`` (SPEC §11): what is given, the rest
    from the root's ``run.json`` (a given ``run_id`` of another run takes attempt 1), else ``(None,
    1)``. Raises :class:`ManifestError` for a malformed ``run.json`` (only read when something is
    missing), :class:`CheckpointWriteError` when reading it fails with an I/O error."""
    if run_id is not None and attempt is not None:
        return run_id, attempt
    try:
        rec = read_run_record(root)
    except (
        ManifestError
    ) as e:  # an I/O error of the read is the save's I/O error (CheckpointWriteError)
        cause = e.__cause__
        if isinstance(cause, OSError) and cause.errno != errno.ELOOP:
            raise CheckpointWriteError.from_os_error(
                cause, f"reading {root}/run.json failed"
            ) from cause
        raise
    if rec is not None and run_id in (None, rec.run_id):
        return rec.run_id, rec.attempt if attempt is None else attempt
    return run_id, 1 if attempt is None else attempt


def header_digest(prefix: bytes, raw: bytes) -> str:
    """sha256 (hex) of a shard's length prefix plus JSON header (the manifest's
    ``header_sha256``)."""
    h = hashlib.sha256(prefix)
    h.update(raw)
    return h.hexdigest()


def check_written_shard(sdir: Path, rec: ShardRecord, step: int, save_id: str) -> None:
    """Cheap pre-commit check: file present, size right, header names this save, rank and step: the
    header bytes hash to the record's ``header_sha256`` (the writer of this record wrote them for
    this save) and open with this rank and step (no parse), else the header is parsed to say why.
    Raises MissingShardError, ShardCorruptedError (also a symlink, FIFO, device or directory there),
    ConcurrentSaveError (another save's file, I4), CheckpointWriteError (the open failed on I/O)."""
    path = sdir / rec.path
    where = f"step {step} rank {rec.rank} ({rec.path})"
    try:  # never through a symlink, never blocking on a FIFO, regular files only
        fd = open_file(path, error=ShardCorruptedError, io_error=CheckpointWriteError)
    except FileNotFoundError:
        raise MissingShardError(f"{where}: shard file is missing") from None
    except CheckpointError as e:
        if isinstance(e.__cause__, OSError):
            raise CheckpointWriteError.from_os_error(
                e.__cause__, f"{where}: cannot open"
            ) from e.__cause__
        raise ShardCorruptedError(f"{where}: {e}") from None
    try:
        size = os.fstat(fd).st_size
        if size != rec.size_bytes:
            raise ShardCorruptedError(
                f"{where}: {size} bytes on disk, record says {rec.size_bytes}"
            )
        n = fmt.parse_header_length(os.pread(fd, 8, 0), size, where)
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    if (
        rec.header_sha256 is not None
        and rec.save_id == save_id
        and _names_itself(raw, rec.rank, step)
        and header_digest(struct.pack("<Q", n), raw) == rec.header_sha256
    ):
        return  # the bytes the record's writer wrote, for this save, rank and step
    meta = fmt.parse_header(raw, size, where).metadata
    if meta.get("save_id") != save_id:
        raise ConcurrentSaveError(
            f"{where}: file belongs to save {meta.get('save_id')!r}, not {save_id} "
            "(another writer replaced it; I4)"
        )
    if meta.get("rank") != rec.rank or meta.get("step") != step:
        raise ShardCorruptedError(
            f"{where}: header names rank {meta.get('rank')} step {meta.get('step')}"
        )


def _names_itself(raw: bytes, rank: int, step: int) -> bool:
    """Whether a header this package's writer wrote (its metadata opens with format, rank and step,
    in that order) names ``rank`` and ``step``: a comparison of its first bytes, no parse. ``False``
    for any other layout (the caller then parses it all)."""
    inner = '{"format":%d,"rank":%d,"step":%d,' % (fmt.FORMAT_VERSION, rank, step)
    return raw.startswith(
        b'{"__metadata__":{"%s":%s' % (fmt.METADATA_KEY.encode(), json.dumps(inner)[:-1].encode())
    )


__all__ = [
    "LocalStepCommit",
    "check_written_shard",
    "claim_save_lock",
    "clear_node_ranks",
    "commit_step",
    "default_lineage",
    "durable_write",
    "durable_write_bytes",
    "ensure_step_dir",
    "fsync_dir",
    "fsync_file",
    "header_digest",
    "lock_holder",
    "record_node_ranks",
    "release_save_lock",
    "rename_durable",
    "set_aside_step",
    "unlink_durable",
]
