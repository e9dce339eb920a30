"""Local retention: which committed steps to delete, and deleting them safely (SPEC §3, §11). No
torch.

Rules, applied by :func:`plan_rotation` to the *current* committed steps of one root (superseded
ones are filtered by the catalogue, SPEC §11), ordered by step number (never by mtime):

1. The newest ``keep_last`` steps are kept (``keep_last >= 1``: the newest is never deleted).
2. The step just committed (``just_committed``) is kept, whatever its number: a job rolled back to
   an older step must not lose the step it has just saved.
3. A pinned step (``pinned.json``, :mod:`tiered_ckpt.local.pins`) is kept.
4. With ``keep_every_steps=N``, every step with ``step % N == 0`` is kept for good.
5. An older step is kept while any live advisory lock names it (a reader, the uploader sidecar; see
   :mod:`tiered_ckpt.locks`).
6. With ``upload_gated=True``, an older step without an ``uploaded.json`` that counts (one written
   for the step's current ``manifest.json`` bytes:
   :func:`tiered_ckpt.local.markers.has_uploaded_marker`) is *pending* and kept, but at most
   ``max_pending_uploads`` pending steps are kept beyond the others: from half that bound on each
   rotation logs a WARNING (the sidecar is falling behind), past it the oldest pending ones are
   deleted with an ERROR log (a dead sidecar must not fill the disk). A root therefore
   holds at most ``keep_last + max_pending_uploads`` unlocked, unpinned steps besides the
   ``keep_every_steps`` multiples and the one just committed.
7. Everything else older is deleted.

Superseded steps (SPEC §11, listed by :func:`tiered_ckpt.local.lineage.superseded_local_steps`, set
aside or still in place) are removed only once at least ``keep_last`` current steps exist, and never
while pinned or locked; they are not upload-gated (abandoned history is never uploaded as the
newest).

Deleting (:func:`delete_step`, through :mod:`tiered_ckpt.local.trash`) follows the lock protocol of
:mod:`tiered_ckpt.locks`: rename the step directory to a trash name (atomic: readers stop seeing the
step at once), check the locks and the pin again inside it, rename it back if a holder or a pin
raced in, otherwise remove the files and fsync the root.

Callers: :class:`~tiered_ckpt.CheckpointManager` after each successful commit (each committing node
on its own root, passing the step it committed as ``just_committed``), and the CLI ``gc``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.layout import RUN_RECORD_NAME, step_dir_name
from tiered_ckpt.local import lineage
from tiered_ckpt.local.catalogue import committed_steps
from tiered_ckpt.local.lineage import SupersededStep
from tiered_ckpt.local.markers import has_uploaded_marker
from tiered_ckpt.local.pins import has_pin
from tiered_ckpt.local.trash import move_to_trash, put_back, remove_trash, sweep_trash
from tiered_ckpt.locks import live_locks

log = logging.getLogger(__name__)

__all__ = [
    "RotationPolicy",
    "RotationPlan",
    "delete_step",
    "is_uploaded",
    "plan_rotation",
    "remove_superseded_step",
    "rotate",
    "superseded_entries",
    "sweep_trash",
]


@dataclass(frozen=True)
class RotationPolicy:
    """Retention settings. ``max_pending_uploads`` only matters with ``upload_gated``;
    ``keep_every_steps`` (``None``: off) keeps every step whose number is a multiple of it.

    Raises ``ValueError`` for ``keep_last < 1``, ``max_pending_uploads < 0`` or a
    ``keep_every_steps`` that is not an int ``>= 1``.
    """

    keep_last: int = 3
    upload_gated: bool = False
    max_pending_uploads: int = 8
    keep_every_steps: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(
                f"keep_last must be >= 1 (the newest step is never deleted), got {self.keep_last}"
            )
        if self.max_pending_uploads < 0:
            raise ValueError(f"max_pending_uploads must be >= 0, got {self.max_pending_uploads}")
        k = self.keep_every_steps
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"keep_every_steps must be None or an int >= 1, got {k!r}")


@dataclass(frozen=True)
class RotationPlan:
    """What :func:`plan_rotation` decided (step numbers, ascending)."""

    delete: tuple[int, ...]
    kept_locked: tuple[int, ...]
    kept_pending: tuple[int, ...]
    #: pending (not uploaded) steps deleted because ``max_pending_uploads`` was exceeded (in
    #: ``delete``)
    dropped_pending: tuple[int, ...]
    kept_pinned: tuple[int, ...] = ()
    #: multiples of ``keep_every_steps`` older than the newest ``keep_last``
    kept_every: tuple[int, ...] = ()
    #: ``just_committed`` when it is older than the newest ``keep_last`` (else empty)
    kept_just_committed: tuple[int, ...] = ()
    #: superseded entries (:func:`superseded_entries`) to remove, oldest step first
    remove_superseded: tuple[SupersededStep, ...] = ()


def is_uploaded(root: str | os.PathLike[str], step: int) -> bool:
    """Whether the step has an ``uploaded.json`` that counts: written for its current
    ``manifest.json`` (:func:`tiered_ckpt.local.markers.has_uploaded_marker`; a stale marker does
    not)."""
    return has_uploaded_marker(Path(root) / step_dir_name(step))


def superseded_entries(root: str | os.PathLike[str]) -> list[SupersededStep]:
    """The root's superseded steps (:func:`tiered_ckpt.local.lineage.superseded_local_steps`).
    Raises :class:`ManifestError` naming the file for a malformed ``run.json`` (which steps are
    current cannot be told)."""
    try:
        return list(lineage.superseded_local_steps(root))
    except ManifestError as e:
        where = str(Path(root) / RUN_RECORD_NAME)
        raise ManifestError(
            str(e) if str(e).startswith(where) else f"{where}: {e}"
        ) from e  # named once


def _superseded_to_remove(
    root: str | os.PathLike[str], policy: RotationPolicy, n_current: int
) -> tuple[SupersededStep, ...]:
    """Superseded entries rotation may remove now: only once ``keep_last`` current steps exist;
    never a pinned or locked one."""
    if n_current < policy.keep_last:
        return ()
    out = [e for e in superseded_entries(root) if not has_pin(e.path) and not live_locks(e.path)]
    return tuple(sorted(out, key=lambda e: (e.step, str(e.path))))


def plan_rotation(
    root: str | os.PathLike[str], policy: RotationPolicy, *, just_committed: int | None = None
) -> RotationPlan:
    """Apply the rules of the module docstring to the committed steps under ``root`` (no
    changes)."""
    steps = committed_steps(root)
    older = steps[: max(0, len(steps) - policy.keep_last)]
    delete: list[int] = []
    kept: dict[str, list[int]] = {"locked": [], "pinned": [], "every": [], "just": []}
    pending: list[int] = []
    every = policy.keep_every_steps
    for s in older:
        sdir = Path(root) / step_dir_name(s)
        if s == just_committed:
            kept["just"].append(s)
        elif has_pin(sdir):
            kept["pinned"].append(s)
        elif every is not None and s % every == 0:
            kept["every"].append(s)
        elif live_locks(sdir):
            kept["locked"].append(s)
        elif policy.upload_gated and not is_uploaded(root, s):
            pending.append(s)
        else:
            delete.append(s)
    dropped: list[int] = []
    if len(pending) > policy.max_pending_uploads:
        n = len(pending) - policy.max_pending_uploads
        dropped, pending = pending[:n], pending[n:]
        delete.extend(dropped)
    return RotationPlan(
        tuple(sorted(delete)),
        tuple(kept["locked"]),
        tuple(pending),
        tuple(dropped),
        kept_pinned=tuple(kept["pinned"]),
        kept_every=tuple(kept["every"]),
        kept_just_committed=tuple(kept["just"]),
        remove_superseded=_superseded_to_remove(root, policy, len(steps)),
    )


def delete_step(root: str | os.PathLike[str], step: int) -> bool:
    """Delete one step directory under the lock protocol. Returns ``False`` if a lock holder or a
    pin raced in (the step is then back in place) or the step is already gone.

    Raises ``OSError`` if renaming or removing fails (the step stays, or stays un-committed in
    trash).
    """
    sdir = Path(root) / step_dir_name(step)
    try:
        trash = move_to_trash(sdir)
    except FileNotFoundError:
        return False
    if live_locks(trash) or has_pin(trash):
        put_back(trash, sdir)
        log.info("rotation: step %d got locked or pinned while being deleted; kept", step)
        return False
    remove_trash(trash)
    return True


def remove_superseded_step(root: str | os.PathLike[str], entry: SupersededStep) -> str:
    """Remove one superseded entry (:func:`superseded_entries`) through
    :func:`tiered_ckpt.local.lineage.remove_superseded`, unless it is pinned or a live lock names it
    (checked now: one may have appeared since a plan). Returns ``""`` when removed, else why it was
    kept. Raises ``OSError`` from the removal."""
    path = Path(entry.path)
    why = (
        "pinned"
        if has_pin(path)
        else "locked by a live reader or uploader"
        if live_locks(path)
        else ""
    )
    if why:
        return why
    if lineage.remove_superseded(root, entry) is False:
        return "gone, or no longer that save"
    sup = entry.superseded
    log.info(
        "step %d: superseded step (save %s, %s) removed from %s",
        entry.step,
        entry.save_id,
        "set aside"
        if sup is None
        else f"superseded by attempt {sup.attempt} from step {sup.from_step}",
        path,
    )
    return ""


def rotate(
    root: str | os.PathLike[str],
    policy: RotationPolicy,
    *,
    rank: int = 0,
    just_committed: int | None = None,
) -> list[int]:
    """Plan and delete; returns the current steps actually deleted (superseded ones removed are
    logged, not returned). ``just_committed``: the step the caller has just committed, never
    deleted. WARNING-logs pending steps kept from half of ``max_pending_uploads`` on, ERROR-logs
    each pending step dropped because of it. Raises
    ``OSError`` from :func:`delete_step` or the removal of a superseded step.
    """
    plan = plan_rotation(root, policy, just_committed=just_committed)
    pending = len(plan.kept_pending)
    if not plan.dropped_pending and pending and 2 * pending >= policy.max_pending_uploads:
        log.warning(
            "rank %d: %d step(s) kept because the sidecar has not uploaded them (%s), of at most "
            "max_pending_uploads=%d; past that the oldest is deleted (is the uploader running?)",
            rank,
            pending,
            list(plan.kept_pending),
            policy.max_pending_uploads,
        )
    deleted = []
    for s in plan.delete:
        if s in plan.dropped_pending:
            log.error(
                "rank %d step %d: deleting a step the sidecar has not uploaded: %d pending steps exceed "
                "max_pending_uploads=%d (is the uploader running?)",
                rank,
                s,
                len(plan.kept_pending) + len(plan.dropped_pending),
                policy.max_pending_uploads,
            )
        if delete_step(root, s):
            deleted.append(s)
            log.info("rank %d step %d: rotated out (keep_last=%d)", rank, s, policy.keep_last)
    for entry in plan.remove_superseded:
        remove_superseded_step(root, entry)
    sweep_trash(root)
    return deleted
