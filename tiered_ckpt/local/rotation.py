"""Local retention: which committed steps to delete, and deleting them safely (SPEC §3). No torch.

Rules, applied by :func:`plan_rotation` to the committed steps of one root, ordered by step number
(never by mtime):

1. The newest ``keep_last`` steps are kept (``keep_last >= 1``: the newest is never deleted).
2. An older step is kept while any live advisory lock names it (a reader, the uploader sidecar; see
   :mod:`tiered_ckpt.locks`).
3. With ``upload_gated=True``, an older step without the sidecar's ``uploaded.json`` marker is *pending*
   and kept, but at most ``max_pending_uploads`` pending steps are kept beyond the newest ``keep_last``:
   past that, the oldest pending ones are deleted with an ERROR log (a dead sidecar must not fill the
   disk). A root therefore holds at most ``keep_last + max_pending_uploads`` unlocked steps.
4. Everything else older is deleted.

Deleting (:func:`delete_step`, through :mod:`tiered_ckpt.local.trash`) follows the lock protocol of :mod:`tiered_ckpt.locks`: rename the step
directory to a trash name (atomic: readers stop seeing the step at once), check the locks again inside it,
rename it back if a holder raced in, otherwise remove the files and fsync the root.

Callers: :class:`~tiered_ckpt.CheckpointManager` after each successful commit (each committing
node on its own root), and the CLI ``gc``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tiered_ckpt.locks import live_locks
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.markers import has_uploaded_marker
from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.local.trash import move_to_trash, put_back, remove_trash, sweep_trash

log = logging.getLogger(__name__)

__all__ = ["RotationPolicy", "RotationPlan", "plan_rotation", "delete_step", "rotate", "sweep_trash"]


@dataclass(frozen=True)
class RotationPolicy:
    """Retention settings. ``max_pending_uploads`` only matters with ``upload_gated``.

    Raises ``ValueError`` for ``keep_last < 1`` or ``max_pending_uploads < 0``.
    """

    keep_last: int = 3
    upload_gated: bool = False
    max_pending_uploads: int = 8

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the newest step is never deleted), got {self.keep_last}")
        if self.max_pending_uploads < 0:
            raise ValueError(f"max_pending_uploads must be >= 0, got {self.max_pending_uploads}")


@dataclass(frozen=True)
class RotationPlan:
    """What :func:`plan_rotation` decided (step numbers, ascending)."""

    delete: tuple[int, ...]
    kept_locked: tuple[int, ...]
    kept_pending: tuple[int, ...]
    #: pending (not uploaded) steps deleted because ``max_pending_uploads`` was exceeded (in ``delete``)
    dropped_pending: tuple[int, ...]


def is_uploaded(root: str | os.PathLike[str], step: int) -> bool:
    """Whether the sidecar's ``uploaded.json`` marker is in the step directory."""
    return has_uploaded_marker(Path(root) / step_dir_name(step))


def plan_rotation(root: str | os.PathLike[str], policy: RotationPolicy) -> RotationPlan:
    """Apply the rules of the module docstring to the committed steps under ``root`` (no changes)."""
    steps = committed_steps(root)
    older = steps[: max(0, len(steps) - policy.keep_last)]
    delete: list[int] = []
    locked: list[int] = []
    pending: list[int] = []
    for s in older:
        if live_locks(Path(root) / step_dir_name(s)):
            locked.append(s)
        elif policy.upload_gated and not is_uploaded(root, s):
            pending.append(s)
        else:
            delete.append(s)
    dropped: list[int] = []
    if len(pending) > policy.max_pending_uploads:
        n = len(pending) - policy.max_pending_uploads
        dropped, pending = pending[:n], pending[n:]
        delete.extend(dropped)
    return RotationPlan(tuple(sorted(delete)), tuple(locked), tuple(pending), tuple(dropped))


def delete_step(root: str | os.PathLike[str], step: int) -> bool:
    """Delete one step directory under the lock protocol. Returns ``False`` if a lock holder raced in
    (the step is then back in place) or the step is already gone.

    Raises ``OSError`` if renaming or removing fails (the step stays, or stays un-committed in trash).
    """
    sdir = Path(root) / step_dir_name(step)
    try:
        trash = move_to_trash(sdir)
    except FileNotFoundError:
        return False
    if live_locks(trash):
        put_back(trash, sdir)
        log.info("rotation: step %d got locked while being deleted; kept", step)
        return False
    remove_trash(trash)
    return True


def rotate(root: str | os.PathLike[str], policy: RotationPolicy, *, rank: int = 0) -> list[int]:
    """Plan and delete; returns the steps actually deleted. ERROR-logs each pending step dropped
    because of ``max_pending_uploads``. Raises ``OSError`` from :func:`delete_step`.
    """
    plan = plan_rotation(root, policy)
    deleted = []
    for s in plan.delete:
        if s in plan.dropped_pending:
            log.error("rank %d step %d: deleting a step the sidecar has not uploaded: %d pending steps exceed "
                      "max_pending_uploads=%d (is the uploader running?)", rank, s,
                      len(plan.kept_pending) + len(plan.dropped_pending), policy.max_pending_uploads)
        if delete_step(root, s):
            deleted.append(s)
            log.info("rank %d step %d: rotated out (keep_last=%d)", rank, s, policy.keep_last)
    sweep_trash(root)
    return deleted
