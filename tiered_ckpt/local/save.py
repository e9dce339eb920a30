"""A step's commit on the local tier (SPEC §2): the coordinator's :func:`commit_step`, and
:func:`save_sharded`, which writes every rank's shard in one process and commits.

Lifecycle of one save of step ``S`` by ``world_size`` ranks (who makes each call):

1. coordinator: choose a ``save_id`` (:func:`~tiered_ckpt.local.commit.new_save_id`) and share it
   with every rank (in a job, a broadcast; :class:`~tiered_ckpt.CheckpointManager` does this).
2. every rank: :func:`~tiered_ckpt.local.write_shard` -> :class:`ShardRecord`. Claims the step's
   writer lock for ``save_id`` (a different live ``save_id`` -> :class:`ConcurrentSaveError`, I4),
   writes ``rank_XXXXX.safetensors`` durably.
3. coordinator: gathers the records and calls :func:`commit_step`, which checks that every listed
   shard is on disk with the right size and the same ``save_id`` in its header, then writes
   ``manifest.json`` the same durable way, last (I1). The step is committed from that link on.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
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
from tiered_ckpt.fs import is_real_dir, new_save_id, unlink_quietly, utc_now
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.catalogue import read_run_record, write_root
from tiered_ckpt.local.commit import LocalStepCommit
from tiered_ckpt.local.node_ranks import clear_node_ranks, record_node_ranks
from tiered_ckpt.local.writer import superseded_hint, write_shard
from tiered_ckpt.safe_read import open_file

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


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


def save_sharded(
    state_dict_per_rank: Sequence[Mapping[str, Any]],
    root: PathLike,
    step: int,
    extra: Mapping[str, Any] | None = None,
    *,
    replace: bool = False,
    wall_clock_seconds: float | None = None,
    run_id: str | None = None,
    attempt: int | None = None,
) -> ShardManifest:
    """Single-process convenience (the seed's API): write every rank's shard in parallel, then
    commit.

    ``state_dict_per_rank[i]`` is rank ``i`` 's state. ``run_id``/``attempt``: as
    :func:`commit_step` (default: the root's ``run.json``). With ``replace=True`` an existing step
    is un-committed first and its ``uploaded.json`` removed durably before that (the re-saved step
    is uploaded again). Errors as :func:`write_shard` and :func:`commit_step`; when several ranks
    fail, the lowest rank's error is raised.
    """
    world_size = len(state_dict_per_rank)
    if world_size < 1:
        raise ValueError("state_dict_per_rank is empty")
    r = write_root(root)
    step_dir_name(step)  # validates step
    try:
        # This call owns the whole save: claim the step once for every rank thread (they join it).
        hold = LocalStepCommit.open(r, step, new_save_id(), claim=True)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointWriteError.from_os_error(e, f"step {step}: cannot prepare {r}") from e
    records: list[ShardRecord] = []
    with hold:
        try:
            if replace and hold.is_committed():
                # Un-commit once, up front, so that no rank sees a committed step mid-way (I2).
                try:
                    hold.uncommit()
                except OSError as e:
                    raise CheckpointWriteError.from_os_error(
                        e, f"step {step}: cannot un-commit the step to replace it"
                    ) from e
            _write_all_ranks(r, step, hold.save_id, state_dict_per_rank, records)
            return commit_step(
                r,
                step,
                world_size,
                records,
                extra,
                save_id=hold.save_id,
                wall_clock_seconds=wall_clock_seconds,
                run_id=run_id,
                attempt=attempt,
            )
        except CheckpointError:
            # Failed: take this attempt's shards away again (a failed save on a full disk must not
            # keep the disk full) and let go of the step, so that another process may save it at
            # once.
            if not hold.is_committed():
                for rec in records:
                    unlink_quietly(hold.step_dir / rec.path)
            hold.release_lock()
            raise


def _write_all_ranks(
    r: Path,
    step: int,
    save_id: str,
    states: Sequence[Mapping[str, Any]],
    records: list[ShardRecord],
) -> None:
    """Every rank's shard, written by up to 8 threads that join ``save_id``; the records of the
    shards written are appended to ``records`` (also when another rank fails, so that they can be
    removed); then the lowest failed rank's error is raised."""
    errors: list[CheckpointError] = []
    with ThreadPoolExecutor(
        max_workers=min(len(states), 8), thread_name_prefix="tiered-ckpt-save"
    ) as pool:
        futs = [
            pool.submit(write_shard, r, step, rank, st, save_id=save_id)
            for rank, st in enumerate(states)
        ]
        for f in futs:
            try:
                records.append(f.result())
            except CheckpointError as e:
                errors.append(e)
    if errors:
        raise errors[0]


__all__ = ["check_written_shard", "commit_step", "default_lineage", "save_sharded"]
