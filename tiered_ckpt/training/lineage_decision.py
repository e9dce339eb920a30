"""The manager's lineage decision (SPEC §11): made at :meth:`CheckpointManager.load` (in memory,
recorded by the next save) and at a first save without a load (recorded at once).

The rule (``N``: the newest attempt any visible record names; visible: every rank's root and, with a
``remote_url``, the bucket):

- every load of step ``S`` (the manager's first or a later one, ``load(S)`` or ``load()``) while a
  current committed step ``> S`` is visible starts attempt ``N+1`` with ``supersedes_from = S + 1``
  (a rollback, or a node replacement that lost the newest step); loading the newest current step
  again starts none;
- a first save of step ``T`` without a load while a current step ``>= T`` is visible starts attempt
  ``N+1`` with ``supersedes_from = T``;
- a bucket that cannot be read (``UploadError``: an outage) may hold newer current steps: the
  decision goes on from the local tier (a warning) as if it did, so a load (or first save) starts a
  new attempt that supersedes whatever newer the bucket holds once the record reaches it (the
  sidecar publishes the root's record before any step of the new attempt); a load that finds no step
  locally then raises ``UploadError``, never :class:`NoCheckpointError` (the bucket may hold one);
- otherwise the run goes on in attempt ``N``; with no record anywhere a run is created (attempt 1, a
  new run id, rank 0's choice).

Lifecycle of one decision (every rank, in the caller's thread; collectives on the manager's policy
group):

1. survey: every rank reads its root's ``run.json``; rank 0 also reads the bucket (its record and
   its committed steps) and draws a candidate run id and timestamp. All-gathered; every rank merges
   the records (:meth:`RunLineage.merge`; :class:`LineageError` on divergence) to the same result;
2. steps: every rank reports its root's committed steps current under the merged record (and, to
   load, the steps it can offer: holding its own shard, or restorable from the bucket).
   All-gathered; the step to load is the newest every rank offers; every rank reports the world size
   of the step as it would load it (its root's manifest, else the bucket's save), all-gathered: a
   mismatch raises :class:`WorldSizeMismatchError` on every rank before anything is written or
   downloaded; the decision above is made (identically on every rank);
3. record: every rank writes the decided record into its root (:func:`write_run_record`: idempotent,
   so ranks sharing a root may all write it) and sets the superseded steps aside
   (:func:`set_aside_superseded`, race-tolerant); rank 0 publishes it to the bucket; an all-gather
   of the outcomes is the barrier (any failure raises on every rank). Only then may the new attempt
   save.

A load (:meth:`LineageDecider.at_load`) runs phases 1-2 and returns the decision unrecorded (a
:class:`Decision`): loading has no side effect on the lineage, so steps can be loaded one after
another to inspect or compare them. Phase 3 (:meth:`LineageDecider.record`) runs at the next save,
before anything of that save is written (the record must be in every root before the new attempt's
first manifest commits, and a superseded step's number must be free for it), or when the user asks
(``record_lineage()``). The one write a load makes is bringing a root whose record lags the run's
own (the bucket's, another node's) up to it, before a shard is restored: no new attempt.

A crash anywhere repeats the decision on restart: once a root holds the record, its superseded steps
are filtered by every catalogue read, so the same step is loaded and no newer current step is seen
(no third attempt); a crash before the record leaves the root as the load found it. ``run_id`` and
``attempt`` of the decided record go into every manifest the manager commits. An error on one rank
in phases 1-2 is raised on every rank with its own type (``ManifestError`` for an unreadable
``run.json``, local or the bucket's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered_ckpt.errors import (
    CheckpointError,
    DistributedSaveError,
    LineageError,
    ManifestError,
    MissingShardError,
    NoCheckpointError,
    RunMismatchError,
    ShardCorruptedError,
    UploadError,
    WorldSizeMismatchError,
)
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.fs import utc_now
from tiered_ckpt.local.catalogue import all_committed_steps, read_manifest, read_run_record
from tiered_ckpt.local.lineage import new_run_id, set_aside_superseded, write_run_record
from tiered_ckpt.training.resume import (
    RemoteView,
    current_local_steps,
    ensure_local,
    local_ranks_present,
    offer_steps,
    publish_remote_lineage,
    read_remote_view,
    step_complete,
)

if TYPE_CHECKING:
    from tiered_ckpt.training.dist import SaveCoordinator

log = logging.getLogger(__name__)

#: Error types a rank's failure in phases 1-2 is raised as on every rank (others: CheckpointError).
_GATHERED_ERRORS = {
    c.__name__: c
    for c in (
        ManifestError,
        LineageError,
        UploadError,
        RunMismatchError,
        NoCheckpointError,
        WorldSizeMismatchError,
        MissingShardError,
        ShardCorruptedError,
    )
}


def _error_entry(exc: BaseException, where: str) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": f"{where}{type(exc).__name__}: {exc}"}


def _raise_gathered(got: list[dict[str, Any]], what: str) -> None:
    """Raise the lowest failing rank's error (``got[i]["error"]``, see :func:`_error_entry`) with
    its type, on every rank alike."""
    errors = {g["rank"]: g["error"] for g in got if "error" in g}
    if errors:
        first = errors[min(errors)]
        cls = _GATHERED_ERRORS.get(first["type"], CheckpointError)
        raise cls(f"{what} on rank(s) {sorted(errors)}: {first['message']}")


@dataclass(frozen=True)
class Survey:
    """Phase 1 on every rank: the merged record (``None``: no record anywhere), rank 0's candidate
    run id and timestamp, the bucket's view (``None`` without a remote; ``readable=False`` when it
    could not be read) and whether the bucket is this run's (a bucket of another run is read for
    restoring, never written)."""

    merged: RunLineage | None
    run_id: str
    started_at: str
    remote: RemoteView | None
    remote_ours: bool

    @property
    def remote_lineage(self) -> RunLineage | None:
        """The record the bucket's saves are judged under: the run's merged one, or the bucket's own
        when it is another run's."""
        return self.merged if self.remote_ours or self.remote is None else self.remote.lineage

    @property
    def remote_current(self) -> list[int]:
        if self.remote is None:
            return []
        return self.remote.current_steps(self.remote_lineage)

    @property
    def remote_unknown(self) -> bool:
        """The manager has a bucket and it could not be read: it may hold newer current steps."""
        return self.remote is not None and not self.remote.readable


@dataclass(frozen=True)
class Decision:
    """A load's decision, not recorded yet: the :class:`Survey` it was made from and the record the
    next save continues in (:meth:`LineageDecider.record` writes it)."""

    survey: Survey
    lineage: RunLineage


def decide(
    survey: Survey, visible: set[int], *, loaded: int | None = None, first_save: int | None = None
) -> RunLineage:
    """The record the run continues in (see the module docstring); pure. An unreadable bucket counts
    as holding a current step newer than any."""
    base = (
        survey.merged
        if survey.merged is not None
        else RunLineage.first(survey.run_id, survey.started_at)
    )
    unknown = survey.remote_unknown
    if loaded is not None and (unknown or any(s > loaded for s in visible)):
        return base.new_attempt(
            supersedes_from=loaded + 1, resumed_from=loaded, started_at=survey.started_at
        )
    if first_save is not None and (unknown or any(s >= first_save for s in visible)):
        return base.new_attempt(
            supersedes_from=first_save, resumed_from=None, started_at=survey.started_at
        )
    return base


class LineageDecider:
    """One manager's lineage decisions (see the module docstring). ``coord``: the manager's
    :class:`~tiered_ckpt.training.dist.SaveCoordinator` (its ``all_gather_json(obj, policy=True)``
    gathers from every rank on the policy group), ``None`` for one process."""

    def __init__(
        self,
        root: Path,
        rank: int,
        coord: SaveCoordinator | None,
        *,
        remote_url: str | None = None,
        s3_client: Any = None,
        world_size: int = 1,
    ) -> None:
        self.root, self.rank, self.world_size = root, rank, world_size
        self._coord = coord
        self.remote_url, self._s3_client = remote_url, s3_client

    def _gather(self, obj: Any, what: str) -> list[Any]:
        if self._coord is None:
            return [obj]
        try:
            return list(self._coord.all_gather_json(obj, policy=True))
        except RuntimeError as exc:
            raise DistributedSaveError(
                f"rank {self.rank}: {what}: a collective failed (a rank died or timed out?): {exc}"
            ) from exc

    # --- phases

    def survey(self, known: RunLineage | None = None) -> Survey:
        """Phase 1. ``known``: the record the manager already runs in (merged with the roots').
        Raises :class:`LineageError` (records that diverge), ``ManifestError`` (a ``run.json`` that
        cannot be read, on any rank or in the bucket), and whatever else reading the bucket raised,
        with its type."""
        mine: dict[str, Any] = {"rank": self.rank}
        try:
            rec = read_run_record(self.root)
            mine["record"] = None if rec is None else rec.to_dict()
        except ManifestError as exc:
            mine["error"] = _error_entry(exc, f"{self.root}: ")
        if self.rank == 0:
            mine.update(run_id=new_run_id(), started_at=utc_now())
            if self.remote_url is not None:
                try:  # whatever fails here must reach every rank, not leave them waiting in the gather
                    mine["remote"] = read_remote_view(
                        self.remote_url, s3_client=self._s3_client
                    ).to_json()
                except Exception as exc:
                    mine["error"] = _error_entry(exc, f"reading {self.remote_url}: ")
        got = self._gather(mine, "gathering run records")
        _raise_gathered(got, "the run's records cannot be read")
        merged = known
        for g in got:
            if g["record"] is not None:
                rec = RunLineage.from_dict(g["record"])
                merged = rec if merged is None else merged.merge(rec)
        head = got[0]
        remote = RemoteView.from_json(head["remote"]) if head.get("remote") is not None else None
        ours = True
        if remote is not None and remote.lineage is not None:
            if merged is None or merged.run_id == remote.lineage.run_id:
                merged = remote.lineage if merged is None else merged.merge(remote.lineage)
            else:
                ours = False
                log.warning(
                    "rank %d: %s belongs to run %s, this root to run %s: its steps may be restored, "
                    "its record is left alone",
                    self.rank,
                    self.remote_url,
                    remote.lineage.run_id,
                    merged.run_id,
                )
        if remote is not None and not remote.readable:
            log.warning(
                "rank %d: %s could not be read (%s): only the local tier's steps are considered (the "
                "bucket may hold newer ones); with no step here, the load fails",
                self.rank,
                self.remote_url,
                remote.error,
            )
        return Survey(merged, head["run_id"], head["started_at"], remote, ours)

    def _steps(
        self, sv: Survey, *, offers: bool, whole: bool = False
    ) -> tuple[set[int], list[set[int]]]:
        """Phase 2: the visible current steps (every root's and the bucket's) and, with ``offers``,
        what each rank can load (``whole``: steps with every rank's shard, not just its own)."""
        local = current_local_steps(self.root, sv.merged)
        mine: dict[str, Any] = {"current": local}
        if offers:
            mine["offer"] = offer_steps(
                self.root, None if whole else self.rank, local, sv.remote_current
            )
        got = self._gather(mine, "gathering the current steps")
        visible = set(sv.remote_current).union(*(g["current"] for g in got))
        return visible, [set(g["offer"]) for g in got] if offers else []

    def _record(self, sv: Survey, lineage: RunLineage, *, publish: bool = True) -> None:
        """Phase 3: write the record, set superseded steps aside, publish (unless ``publish`` is
        false); the outcome gather is the barrier. Raises :class:`LineageError` if any rank
        failed."""
        failure: BaseException | None = None
        mine: dict[str, Any] = {"rank": self.rank}
        try:
            write_run_record(self.root, lineage)
            set_aside_superseded(self.root, lineage)
        except (CheckpointError, OSError) as exc:
            failure, mine["error"] = exc, f"{type(exc).__name__}: {exc}"
        if (
            publish
            and self.rank == 0
            and failure is None
            and self.remote_url is not None
            and sv.remote_ours
            and not sv.remote_unknown
            and (sv.remote is None or sv.remote.lineage != lineage)
        ):
            self._publish(lineage)  # an unreadable bucket is left to the sidecar (no retries here)
        got = self._gather(mine, "recording the run's lineage")
        errors = {g["rank"]: g["error"] for g in got if "error" in g}
        if errors:
            raise LineageError(
                f"recording attempt {lineage.attempt} of run {lineage.run_id} failed on rank(s) "
                f"{sorted(errors)}: {next(iter(errors.values()))}"
            ) from failure

    def _publish(self, lineage: RunLineage) -> None:
        """Rank 0: the record into the bucket. A failure is logged, not raised: the sidecar
        publishes the root's record before it uploads any step of a newer attempt (SPEC §11)."""
        assert self.remote_url is not None
        try:
            publish_remote_lineage(self.remote_url, lineage, s3_client=self._s3_client)
        except CheckpointError as exc:
            log.warning(
                "run %s attempt %d: could not publish the record to %s (%s); the sidecar will",
                lineage.run_id,
                lineage.attempt,
                self.remote_url,
                exc,
            )

    def _announce(
        self, sv: Survey, lineage: RunLineage, visible: set[int], *, deferred: bool = False
    ) -> None:
        if sv.merged is None and not deferred:
            log.info("rank %d: run %s starts in %s", self.rank, lineage.run_id, self.root)
        if lineage.attempt > (sv.merged.attempt if sv.merged is not None else 1):
            a = lineage.attempts[-1]
            newer = sorted(
                s for s in visible if a.supersedes_from is not None and s >= a.supersedes_from
            )
            log.log(
                logging.INFO if deferred else logging.WARNING,
                "rank %d: run %s attempt %d (resumed from %s) supersedes steps >= %s of earlier "
                "attempts: %s %s",
                self.rank,
                lineage.run_id,
                a.attempt,
                a.resumed_from,
                a.supersedes_from,
                newer,
                "will be set aside by the next save (none is yet)"
                if deferred
                else "are set aside, not loaded",
            )

    # --- decisions

    def _choose(
        self, sv: Survey, step: int | None, visible: set[int], offers: list[set[int]]
    ) -> int:
        """The step to load: ``step``, or the newest every rank offers. Raises (on every rank alike)
        ``UploadError`` when none is found and the bucket could not be read (it may hold one),
        :class:`MissingShardError` when current committed steps exist (``visible``) but none that
        every rank can load (a lost shard: never a silent fresh start over them), else
        :class:`NoCheckpointError`."""
        common = set.intersection(*offers) if offers else set()
        if step is not None and step in common or step is None and common:
            return step if step is not None else max(common)
        where = f"rank {self.rank}: {self.root}"
        if sv.remote_unknown:
            assert sv.remote is not None
            what = (
                "no current step"
                if step is None
                else f"step {step} is not a current committed step that"
            )
            raise UploadError(
                f"{what} every rank holds locally ({where}), and {self.remote_url} could not be "
                f"read ({sv.remote.error}): it may hold one; not deciding without it"
            )
        wanted = step if step is not None else max(visible, default=None)
        if wanted is not None and wanted in visible:
            lacking = [r for r, o in enumerate(offers) if wanted not in o]
            what = (
                f"step {step} is not"
                if step is not None
                else f"no current step (the newest: {wanted}) is"
            )
            raise MissingShardError(
                f"{what} loadable by every rank: rank(s) {lacking} lack their shard of "
                f"{wanted} ({where}); restore it from the bucket or load an older step"
            )
        if step is None:
            remote = f" or in {self.remote_url}" if self.remote_url is not None else ""
            raise NoCheckpointError(
                f"no current step is available to every rank, locally ({where}){remote}"
            )
        raise NoCheckpointError(
            f"step {step} is not a current committed step every rank can load ({where})"
        )

    def _check_world_size(self, sv: Survey, step: int) -> None:
        """Phase 2, after choosing: every rank's world size of ``step`` as it would load it (its
        root's manifest when its shard is here, else the bucket's save), gathered. Raises
        :class:`WorldSizeMismatchError` on every rank before anything is written or downloaded."""
        mine: dict[str, Any] = {"rank": self.rank}
        try:
            if step in current_local_steps(self.root, sv.merged) and local_ranks_present(
                self.root, step, [self.rank]
            ):
                mine["world_size"] = read_manifest(self.root, step).world_size
            elif sv.remote is not None:
                mine["world_size"] = sv.remote.world_size_of(step, sv.remote_lineage)
        except CheckpointError as exc:
            mine["error"] = _error_entry(exc, f"{self.root}: ")
        got = self._gather(mine, "checking the world size")
        _raise_gathered(got, f"step {step} cannot be read")
        for g in got:
            ws = g.get("world_size")
            if ws is not None and ws != self.world_size:
                raise WorldSizeMismatchError(
                    f"step {step} was saved by {ws} ranks, but {self.world_size} are "
                    f"loading it (resharding was not asked for)"
                )

    def _restore_whole(self, sv: Survey, step: int) -> None:
        """Rank 0 makes every rank's shard of ``step`` local in its root (the ranks of a resharding
        load share one root), restoring what is missing from the bucket; the outcome gather is the
        barrier. Raises restore's errors on every rank alike (their type where
        :data:`_GATHERED_ERRORS` has it)."""
        mine: dict[str, Any] = {"rank": self.rank}
        ws = sv.remote.world_size_of(step, sv.remote_lineage) if sv.remote is not None else None
        if self.rank == 0 and ws is not None and not step_complete(self.root, step):
            assert self.remote_url is not None
            try:
                ensure_local(self.root, self.remote_url, step, range(ws), s3_client=self._s3_client)
            except Exception as exc:  # reported to every rank, not left waiting in the gather
                mine["error"] = _error_entry(exc, f"restoring into {self.root}: ")
        _raise_gathered(
            self._gather(mine, "restoring the step"), f"step {step} could not be restored"
        )

    def at_load(
        self, step: int | None, *, known: RunLineage | None = None, resharding: bool = False
    ) -> tuple[int, Decision]:
        """The step to load (``None``: the newest current step every rank can load) and the
        :class:`Decision` the run continues in, **not recorded**: :meth:`record` writes it (the
        manager's next save, or ``record_lineage()``), so a load sets nothing aside and a later
        load may choose any current step again. This rank's shard of the step is made local from the
        bucket if missing (a root whose record lags the run's is brought up to it first, without a
        new attempt). Every load decides, the manager's first and any later one (``known``: the
        record the manager has recorded so far, never an unrecorded decision): loading a step older
        than a visible current step decides a new attempt. ``resharding`` (:class:`tiered_ckpt.dcp.DCPCheckpointManager`: DCP
        reshards through its planner, and any rank may read any shard): a step saved by another
        world size may be loaded (no :class:`WorldSizeMismatchError`), a step counts as local only
        with every rank's shard present, and rank 0 restores the whole step (the ranks share one
        root). Raises :class:`NoCheckpointError` (nothing, or not that step, is committed and
        current), :class:`MissingShardError` (it is, but not every rank can load it),
        ``UploadError`` (either, with a bucket that could not be read),
        :class:`WorldSizeMismatchError` (nothing is decided or downloaded then), ``ManifestError``,
        :class:`LineageError`, restore's errors."""
        sv = self.survey(known)
        visible, offers = self._steps(sv, offers=True, whole=resharding)
        step = self._choose(sv, step, visible, offers)
        if not resharding:
            self._check_world_size(sv, step)
        lineage = decide(sv, visible, loaded=step)
        self._announce(sv, lineage, visible, deferred=True)
        if sv.merged is not None:  # catch a lagging root up (idempotent; before any restore)
            self._record(sv, sv.merged, publish=False)
        if self.remote_url is not None and resharding:
            self._restore_whole(sv, step)
        elif self.remote_url is not None:
            self._restore_own(step)
        return step, Decision(sv, lineage)

    def record(self, decision: Decision) -> RunLineage:
        """Phase 3 for a load's ``decision`` (every rank, before the new lineage's first save writes
        anything): the record into every root, the steps it supersedes set aside, rank 0 publishes
        it to the bucket. Returns the recorded lineage. Raises :class:`LineageError` (on every rank
        when any failed; a root whose record it does not extend)."""
        sv, lineage = decision.survey, decision.lineage
        self._announce(sv, lineage, set(sv.remote_current) | set(all_committed_steps(self.root)))
        self._record(sv, lineage)
        return lineage

    def _restore_own(self, step: int) -> None:
        """Make every rank's shard of ``step`` local, restoring the missing ones from the bucket: one
        restore per root that lacks any, by the lowest rank of the ranks sharing it (found from the
        filesystem, :func:`~tiered_ckpt.training.dist.find_disk_groups`), for all of its missing
        ranks at once, so a replaced node lists the bucket and reads the step's manifests once, not
        once per rank. The outcome gather is the barrier: no rank loads before every rank's shard
        is in place, since a rank's Replicated values may be in another local rank's shard (each
        node's first rank holds the copy). Raises restore's errors on every rank alike."""
        missing = not local_ranks_present(self.root, step, [self.rank])
        lacking = [
            g["rank"]
            for g in self._gather({"rank": self.rank, "missing": missing}, "finding missing shards")
            if g["missing"]
        ]
        if not lacking:
            return
        mine: dict[str, Any] = {"rank": self.rank}
        try:
            if self._coord is None:
                groups = [[self.rank]]
            else:  # a coordinator means torch.distributed (the one-process manager needs no torch)
                from tiered_ckpt.training.dist import find_disk_groups

                groups = find_disk_groups(
                    self.root, self._coord.policy_group, self.rank, self.world_size
                )
            shared = next(g for g in groups if self.rank in g)
            todo = sorted(set(shared) & set(lacking))
            if todo and self.rank == min(shared):
                assert self.remote_url is not None
                ensure_local(self.root, self.remote_url, step, todo, s3_client=self._s3_client)
        except DistributedSaveError:
            raise  # a collective failed: every rank raises its own
        except Exception as exc:  # reported to every rank, not left waiting in the gather
            mine["error"] = _error_entry(exc, f"restoring into {self.root}: ")
        _raise_gathered(
            self._gather(mine, "restoring the step"), f"step {step} could not be restored"
        )

    def at_first_save(self, step: int) -> RunLineage:
        """The record a manager that did not load continues in, before its first save of ``step``;
        recorded everywhere. Raises :class:`LineageError`."""
        sv = self.survey()
        visible, _ = self._steps(sv, offers=False)
        lineage = decide(sv, visible, first_save=step)
        self._announce(sv, lineage, visible)
        self._record(sv, lineage)
        return lineage


__all__ = ["Decision", "LineageDecider", "Survey", "decide"]
