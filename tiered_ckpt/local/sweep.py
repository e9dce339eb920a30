"""``gc``: remove the leftovers of dead writers under a run root, and say what was left alone and
why (:class:`GcReport`: a young uncommitted directory kept for the minimum age, a live writer's, a
run root named like a step, a live deleter's trash, a pinned or held superseded step). Re-exported
by :mod:`tiered_ckpt.local.scan`.

Leftovers: temp files are removed by the owner token in their names
(:mod:`tiered_ckpt.local.leftovers`), also in the root itself; uncommitted step directories by their
age and writer; trash directories by their deleter.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tiered_ckpt.fs import owner_alive, temp_owner
from tiered_ckpt.layout import SAVE_LOCK_NAME, SUPERSEDED_DIR, step_dir_name
from tiered_ckpt.local.catalogue import (
    all_step_dirs,
    is_committed,
    looks_like_run_root,
    resolve_root,
    write_root,
)
from tiered_ckpt.local.leftovers import remove_dead_temps
from tiered_ckpt.local.rotation import remove_superseded_step, superseded_entries
from tiered_ckpt.local.trash import (
    is_trash_name,
    move_to_trash,
    put_back,
    remove_trash,
    trash_owner,
)
from tiered_ckpt.locks import stale_lock_files
from tiered_ckpt.safe_read import list_dir, list_in_root, read_json_record

log = logging.getLogger(__name__)

#: Why an uncommitted step directory is left alone (the reasons of :attr:`GcReport.skipped_others`).
NESTED_RUN = "holds a run of its own (run.json or step directories); left alone"
LIVE_WRITER = "uncommitted, its writer is alive (a save or restore in progress)"
CLAIMED = "uncommitted, a writer claimed it while gc was removing it; put back"
LIVE_DELETER = "a trash directory of a live process (it may still put the step back)"


def too_young(min_age_s: float) -> str:
    """The reason of an uncommitted directory younger than ``min_age_s`` seconds."""
    return f"uncommitted, younger than the minimum age of {min_age_s:g} s (a writer may still be filling it)"


@dataclass(frozen=True)
class GcReport:
    """What :func:`gc_report` did: ``removed`` paths, in order; ``kept_superseded``: ``(path, why)``
    of the superseded steps ``superseded=True`` kept (pinned, being read or uploaded);
    ``skipped_others``: ``(path, why)`` of the other leftovers left alone (one of the reasons above,
    :func:`too_young`, or why a directory could not be moved aside)."""

    removed: tuple[Path, ...] = ()
    kept_superseded: tuple[tuple[Path, str], ...] = ()
    skipped_others: tuple[tuple[Path, str], ...] = ()

    @property
    def skipped(self) -> list[tuple[Path, str]]:
        """Everything left alone, with why: the superseded steps kept (``superseded step, kept:
        why``), then the others."""
        return [(p, f"superseded step, kept: {why}") for p, why in self.kept_superseded] + list(
            self.skipped_others
        )


def _writer_alive(sdir: Path) -> bool:
    """Whether a live process may still be writing into ``sdir``: its save lock or a temp file names
    a live owner."""
    owner = (read_json_record(sdir / SAVE_LOCK_NAME) or {}).get(
        "owner", ""
    )  # never follows or blocks
    if owner and owner_alive(str(owner)):
        return True
    names = list_dir(sdir)  # the step directory opened O_NOFOLLOW
    return any((o := temp_owner(n)) is not None and owner_alive(o) for n in names)


def gc_superseded(root: str | os.PathLike[str]) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Remove every superseded step of ``root`` (SPEC §11, ``gc --superseded``) through
    :func:`tiered_ckpt.local.lineage.remove_superseded`, except pinned ones and ones a live reader
    or uploader holds. Returns ``(removed paths, [(kept path, why)])``. Raises
    :class:`ManifestError` for an unreadable ``run.json``, ``OSError`` from a removal."""
    removed: list[Path] = []
    kept: list[tuple[Path, str]] = []
    r = write_root(root)  # a remover: only inside the directory named
    if (
        resolve_root(r)[0] != r
    ):  # named like a step, no run.json or step yet: read as a step of its parent,
        return removed, kept  # it has no superseded steps of its own
    for e in sorted(superseded_entries(r), key=lambda e: (e.step, str(e.path))):
        why = remove_superseded_step(r, e)
        if why:
            kept.append((Path(e.path), why))
        else:
            removed.append(Path(e.path))
    return removed, kept


def gc(
    root: str | os.PathLike[str],
    *,
    force: bool = False,
    min_age_s: float = 60.0,
    superseded: bool = False,
) -> list[Path]:
    """:attr:`GcReport.removed` of :func:`gc_report` (see there), as a list."""
    return list(gc_report(root, force=force, min_age_s=min_age_s, superseded=superseded).removed)


def gc_report(
    root: str | os.PathLike[str],
    *,
    force: bool = False,
    min_age_s: float = 60.0,
    superseded: bool = False,
) -> GcReport:
    """Remove leftovers of dead writers under ``root`` (I3) and report what was removed and what was
    left alone, and why:

    - uncommitted step directories whose writer is dead (not touched for ``min_age_s`` seconds, so
      that a writer that has only just made the directory is left alone; looked at again inside the
      trash after the rename, and put back if a writer claimed it meanwhile); a run root named like
      a step directory (``restore --local x/step_...``) is never one;
    - temp files and stale lock files of dead owners inside committed steps, and owner-named temp
      files of dead owners in ``root`` itself: also the downloads of a killed restore, whatever
      suffix the download tool added to the staged temp name (:mod:`tiered_ckpt.local.leftovers`);
    - trash directories left by an interrupted rotation or ``gc --superseded``, in ``root`` and in
      ``root/superseded/`` (not those of a live deleter, which may still put the step back);
    - with ``superseded``, superseded steps (:func:`gc_superseded`: not pinned or locked ones).

    ``root`` is the run root as given, even when it is named like a step directory (nothing outside
    it is touched). Committed current steps are never removed, and without ``superseded`` no
    superseded one either. ``force`` also removes leftovers whose owner cannot be checked (another
    host) or is alive: only for an operator who knows no job is running. Raises ``ManifestError``
    (``superseded`` with an unreadable ``run.json``).
    """
    r = write_root(root)  # a remover: only inside the directory named, whatever its name looks like
    removed, kept = gc_superseded(r) if superseded else ([], [])
    skipped: list[tuple[Path, str]] = []
    if not os.path.lexists(r):
        return GcReport(tuple(removed), tuple(kept))
    removed += _sweep_trash_dirs(r, list_in_root(r, None), force, skipped)
    # remove_superseded's trash of a set-aside entry lies in superseded/ (opened O_NOFOLLOW: [] for
    # a symlink)
    removed += _sweep_trash_dirs(
        r / SUPERSEDED_DIR, list_in_root(r, SUPERSEDED_DIR), force, skipped
    )
    removed += remove_dead_temps(
        r, force=force, owned_only=True
    )  # e.g. a killed restore's run.json temp
    now = time.time()
    for step in all_step_dirs(r):
        sdir = r / step_dir_name(step)
        if not is_committed(
            sdir
        ):  # lexists: a dangling or odd manifest.json still counts (never swept)
            why = _remove_uncommitted(sdir, now, force, min_age_s)
            if why:
                skipped.append((sdir, why))
            else:
                removed.append(sdir)
            continue
        removed += remove_dead_temps(
            sdir, force=force
        )  # a killed writer's or restore's temps and downloads
        for f in stale_lock_files(sdir):
            _rm(f, removed)
        lock = sdir / SAVE_LOCK_NAME
        if lock.exists() and (force or not _writer_alive(sdir)):
            _rm(lock, removed)
    return GcReport(tuple(removed), tuple(kept), tuple(skipped))


def _remove_uncommitted(sdir: Path, now: float, force: bool, min_age_s: float) -> str:
    """Remove the uncommitted step directory ``sdir`` unless it must be left alone; returns why it
    was left alone (``""``: removed)."""
    if looks_like_run_root(
        sdir
    ):  # a run root named like a step (restore --local x/step_...): not ours
        log.info("gc: %s holds a run of its own (run.json or step directories); left alone", sdir)
        return NESTED_RUN
    try:
        age = now - os.lstat(sdir).st_mtime
    except OSError as e:
        return f"cannot be looked at: {e.strerror or e}"
    if not force and age < min_age_s:
        return too_young(min_age_s)
    if not force and _writer_alive(sdir):
        return LIVE_WRITER
    try:
        trash = move_to_trash(sdir, owned=False)
        if not force and (
            is_committed(trash) or _writer_alive(trash)
        ):  # one raced in: as delete_step
            put_back(trash, sdir)
            return CLAIMED
    except OSError as e:
        return f"could not be moved aside: {e.strerror or e}"
    remove_trash(trash, durable=False)
    log.info("gc: removed uncommitted step directory %s", sdir)
    return ""


def _sweep_trash_dirs(
    directory: Path, names: list[str], force: bool, skipped: list[tuple[Path, str]]
) -> list[Path]:
    """Remove the trash directories among ``names`` in ``directory`` (not symlinks), except those of
    a live deleter (``force``: those too), which may still put the step back (``delete_step``):
    appended to ``skipped``."""
    removed = []
    for name in sorted(names):
        p = directory / name
        if is_trash_name(name) and p.is_dir() and not p.is_symlink():
            owner = trash_owner(name)
            if not force and owner is not None and owner_alive(owner):
                skipped.append((p, LIVE_DELETER))
                continue
            remove_trash(p, durable=False)
            removed.append(p)
    return removed


def _rm(p: Path, removed: list[Path]) -> None:
    try:
        os.unlink(p)
        removed.append(p)
    except OSError:
        pass


__all__ = ["GcReport", "gc", "gc_report", "gc_superseded", "too_young"]
