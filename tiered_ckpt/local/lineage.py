"""A root's run record and its superseded steps (SPEC §11): the local side of step lineage.

``<root>/run.json`` (:class:`~tiered_ckpt.format.lineage.RunLineage`) names the run and its
attempts. A committed step of attempt ``a`` with number ``s`` is superseded when a later attempt's
``supersedes_from`` is ``<= s``; the catalogue (:mod:`tiered_ckpt.local.catalogue`) filters such
steps out of every read at once, from the record alone. This module then sets them aside: renamed
(by :func:`tiered_ckpt.local.commit.set_aside_step`) to
``<root>/superseded/step_XXXXXXXXXX.<save_id>/``, so that the step number is free for the new
attempt's save. Never deleted here except by :func:`remove_superseded` (rotation once ``keep_last``
current steps exist, ``gc --superseded``).

Lifecycle of one lineage decision on a root (who calls each; the decision itself is the manager's,
:mod:`tiered_ckpt.training.lineage_decision`, or restore's):

1. every node's committer: :func:`write_run_record` (temp + fsync + rename + directory fsync): from
   here on the superseded steps are filtered by every reader, and a crash repeats the same decision;
2. the same: :func:`set_aside_superseded` moves them (idempotent; a crash leaves each step either in
   place, still filtered, or moved);
3. only then the first step of the new attempt commits.

Steps that are superseded but not current are listed by :func:`superseded_local_steps`
(``ls``/``verify``).
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from tiered_ckpt.errors import CheckpointWriteError, LineageError, ManifestError
from tiered_ckpt.format.lineage import RunLineage, Superseded
from tiered_ckpt.layout import (
    RUN_RECORD_NAME,
    SUPERSEDED_DIR,
    parse_remote_step_entry,
    step_dir_name,
)
from tiered_ckpt.local.catalogue import (
    all_committed_steps,
    judged_attempt,
    read_run_record,
    resolve_root,
    step_lineage,
    superseded_in,
)
from tiered_ckpt.local.commit import durable_write_bytes, set_aside_step
from tiered_ckpt.local.trash import move_to_trash, put_back, remove_trash
from tiered_ckpt.safe_read import list_in_root

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


def new_run_id() -> str:
    """A fresh run id: 32 lowercase hex digits (uuid4), matching ``format.lineage.RUN_ID_RE``."""
    return uuid.uuid4().hex


def write_run_record(
    root: PathLike, lineage: RunLineage, *, force: bool = False, exact_root: bool = False
) -> bool:
    """Write ``<root>/run.json`` with the local commit protocol (temp name, fsync, rename, directory
    fsync). Idempotent: several ranks sharing a root may write the same record at once (unique temp
    names; the bytes are identical). A record only ever grows: one that ``lineage`` does not extend
    (an attempt it lacks or contradicts, another run) is not replaced unless ``force`` (an
    unreadable one is). Returns whether the file changed (``False``: it already held these bytes).
    Raises :class:`LineageError` (it would not extend the root's record),
    :class:`CheckpointWriteError` on I/O (the old record, if any, stays). ``exact_root``: ``root``
    is the run directory whatever its name (a restore's target), never read as a step directory of
    its parent (:func:`resolve_root`)."""
    r = Path(root).absolute() if exact_root else resolve_root(root)[0]
    data = lineage.to_json().encode()
    try:
        cur = read_run_record(r)
    except ManifestError:
        cur = None  # a broken record is replaced by the decided one
    if cur is not None and cur.to_json().encode() == data:
        return False
    if cur is not None and not force and not lineage.extends(cur):
        raise LineageError(
            f"{r / RUN_RECORD_NAME} records run {cur.run_id} with {len(cur.attempts)} attempt(s); "
            f"attempt {lineage.attempt} of run {lineage.run_id} does not extend it"
        )
    try:
        os.makedirs(r, exist_ok=True)
        durable_write_bytes(r / RUN_RECORD_NAME, data)
    except OSError as e:
        raise CheckpointWriteError.from_os_error(e, f"writing {r / RUN_RECORD_NAME} failed") from e
    log.info("run %s: %s records attempt %d", lineage.run_id, r / RUN_RECORD_NAME, lineage.attempt)
    return True


@dataclass(frozen=True)
class SupersededStep:
    """A committed step of an abandoned attempt (SPEC §11). ``run_id``/``attempt``: what its
    manifest records (``save_id`` ``None``: a manifest without one). ``superseded``: the attempt
    that superseded it and from which step (``None``: a set-aside step the root's record does not
    explain). ``path``: its directory now. ``set_aside``: whether it is already under
    ``<root>/superseded/`` (else still in place, filtered out of every catalogue read)."""

    step: int
    save_id: str | None
    attempt: int
    run_id: str | None
    superseded: Superseded | None
    path: Path
    set_aside: bool


def superseded_local_steps(root: PathLike) -> list[SupersededStep]:
    """Every superseded step of ``root``: those set aside under ``superseded/`` and committed ones
    still in place that the root's ``run.json`` supersedes. Sorted by ``(step, set_aside,
    save_id)``. A set-aside entry without a readable manifest, or one the current record no longer
    supersedes, is listed with what its manifest says; an unreadable one is skipped. Raises
    :class:`ManifestError` for a malformed ``run.json``."""
    r, _ = resolve_root(root)
    lineage = read_run_record(r)
    out: list[SupersededStep] = []
    if lineage is not None:
        for s in all_committed_steps(r):
            why = superseded_in(r, s, lineage)
            info = step_lineage(r / step_dir_name(s)) if why is not None else None
            if why is not None and info is not None:
                out.append(
                    SupersededStep(s, info[2], info[1], info[0], why, r / step_dir_name(s), False)
                )
    into = r / SUPERSEDED_DIR
    for name in list_in_root(r, SUPERSEDED_DIR):  # superseded/ opened O_NOFOLLOW: [] for a symlink
        parsed = parse_remote_step_entry(name)
        info = step_lineage(into / name) if parsed is not None else None
        if parsed is None or info is None:
            continue
        step = parsed[0]
        why = (
            lineage.superseded_by(judged_attempt(info, lineage), step)
            if lineage is not None
            else None
        )
        out.append(SupersededStep(step, info[2], info[1], info[0], why, into / name, True))
    return sorted(out, key=lambda e: (e.step, e.set_aside, e.save_id or ""))


def set_aside_superseded(root: PathLike, lineage: RunLineage | None = None) -> list[SupersededStep]:
    """Move every committed step of ``root`` that ``lineage`` (default: the root's ``run.json``)
    supersedes to ``<root>/superseded/step_XXXXXXXXXX.<save_id>/`` (durably; SPEC §11); ``lineage``
    must be in the root already (its record extends it; else :class:`LineageError`, nothing moved).
    Idempotent: a step already moved, or moved meanwhile by another rank sharing the root, is
    skipped; a crash at any point leaves each step either in place (still filtered by the record) or
    moved. Call it before the new attempt saves. Returns the steps moved by this call. A step whose
    target name already exists is left in place (logged). Raises :class:`CheckpointWriteError` on
    I/O."""
    r, _ = resolve_root(root)
    rec = read_run_record(r)
    if lineage is not None and (rec is None or not rec.extends(lineage)):
        raise LineageError(
            f"{r / RUN_RECORD_NAME} does not record attempt {lineage.attempt} of run "
            f"{lineage.run_id} yet: write it first (write_run_record), so that a crash "
            "repeats the decision"
        )
    lineage = rec
    moved: list[SupersededStep] = []
    if lineage is None or lineage.attempt == 1:
        return moved
    for s in all_committed_steps(r):
        why = superseded_in(r, s, lineage)
        info = step_lineage(r / step_dir_name(s)) if why is not None else None
        if why is None or info is None:
            continue
        try:
            dst = set_aside_step(r, s, info[2])
        except (FileExistsError, ValueError) as e:  # ValueError: a save id no entry name can carry
            if os.path.lexists(r / step_dir_name(s)):  # else another rank sharing the root moved it
                log.warning("step %d: not set aside: %s", s, e)
            continue
        except CheckpointWriteError:
            raise
        except OSError as e:
            raise CheckpointWriteError.from_os_error(
                e, f"step {s}: setting the superseded step aside failed"
            ) from e
        if dst is not None:
            log.warning(
                "step %d (attempt %d, save %s) is superseded by attempt %d (from step %d); set aside "
                "to %s",
                s,
                info[1],
                info[2],
                why.attempt,
                why.from_step,
                dst,
            )
            moved.append(SupersededStep(s, info[2], info[1], info[0], why, dst, True))
    return moved


def remove_superseded(root: PathLike, entry: SupersededStep) -> bool:
    """Delete one superseded step (rotation once ``keep_last`` current steps exist, ``gc
    --superseded``) through :mod:`tiered_ckpt.local.trash`: renamed to a trash name beside it,
    checked, removed, the parent fsynced. The check: the trash must hold the save ``entry`` names
    (an in-place entry's directory may have been set aside and its step number reused by the new
    attempt since it was listed); otherwise it is put back and nothing is removed. Returns whether
    it was removed (``False``: gone already, or put back). Raises ``ValueError`` for a path that is
    neither ``<root>/step_XXXXXXXXXX`` nor under ``<root>/superseded/``, ``OSError`` if renaming or
    removing fails."""
    r, _ = resolve_root(root)
    into = r / SUPERSEDED_DIR
    parsed = parse_remote_step_entry(entry.path.name)
    if (
        parsed is None
        or parsed[0] != entry.step
        or entry.path.parent not in (into, r)
        or (entry.path.parent == r and entry.path.name != step_dir_name(entry.step))
    ):
        raise ValueError(f"{entry.path} is not a step directory of {r} or of {into}")
    try:
        trash = move_to_trash(entry.path)
    except FileNotFoundError:
        return False
    info = step_lineage(trash)
    if info is None or info[2] != entry.save_id or info[1] != entry.attempt:
        put_back(trash, entry.path)
        log.warning(
            "step %d: %s no longer holds superseded save %s; kept",
            entry.step,
            entry.path,
            entry.save_id,
        )
        return False
    remove_trash(trash)
    log.info(
        "superseded step %d (attempt %d, save %s) removed from %s",
        entry.step,
        entry.attempt,
        entry.save_id,
        entry.path.parent,
    )
    return True


__all__ = [
    "SupersededStep",
    "new_run_id",
    "read_run_record",
    "remove_superseded",
    "set_aside_superseded",
    "superseded_local_steps",
    "write_run_record",
]
