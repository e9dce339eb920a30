"""The local side of a restore's commit (lifecycle step 4 of :mod:`tiered_ckpt.remote.restore`):
which run record the root gets, ``adopted.json`` for a foreign step, ``node_ranks.json`` after a
partial restore, and what a restore places in a step directory and takes away again.

**Nothing left behind.** A restore records every file it renames into the step directory (the
shards, an ``adopted.json``) by ``(st_dev, st_ino)`` (:class:`Placed`; ``rename(2)`` keeps the
inode). When it fails anywhere after the first rename and before ``manifest.json`` is committed
(ENOSPC at the manifest write, a lock taken over, Ctrl-C), it removes exactly those files again
while the step is still uncommitted (:meth:`Placed.undo`; a file another writer renamed over one of
them since is not ours and stays), and the commit protocol removes its temp files: a retry starts
from a clean step directory, so it does not fail with "disk full" for the bytes of its own failed
attempt.

**Starting over after a dead restore** (:func:`clear_dead_restore`): a restore that was killed
leaves temp files (its downloads) and possibly renamed shards in an uncommitted step. The next
restore of the step removes the temp files of dead owners (owner tokens,
:mod:`tiered_ckpt.local.leftovers`) and, when it created the writer lock itself (so no live writer
of any save shares the step, I4), the files under the final names of the shards it is about to
download, before it downloads: the space is free for its own download. ``run.json`` is not taken
back: the run record carried into the root is true whatever happens to the step (SPEC §11).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tiered_ckpt.errors import CheckpointError
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.fs import write_all
from tiered_ckpt.layout import ADOPTED_MARKER_NAME, shard_file_name
from tiered_ckpt.local.catalogue import adopted_bytes, read_adopted, read_run_record
from tiered_ckpt.local.commit import LocalStepCommit, fsync_dir, record_node_ranks
from tiered_ckpt.local.leftovers import placed_identity, remove_dead_temps, remove_placed
from tiered_ckpt.remote.restore_plan import RestorePlan

log = logging.getLogger(__name__)


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


__all__ = [
    "Placed",
    "clear_dead_restore",
    "record_adoption",
    "record_held_ranks",
    "record_to_carry",
    "same_save",
]
