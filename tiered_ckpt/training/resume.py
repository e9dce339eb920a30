"""The manager's resume hook (SPEC §5, §11): what the bucket shows the lineage decision, which steps
a rank can offer to load, and making this rank's shard of the chosen step local, restoring from the
bucket what the local disk lacks (a replaced node, or a whole missing step).

Called by :mod:`tiered_ckpt.training.lineage_decision` (on behalf of
:meth:`tiered_ckpt.training.manager.CheckpointManager.load`) when the manager has a ``remote_url``.
Only steps *current* under the run's lineage are ever offered: a step of an abandoned attempt, local
or remote, is never loaded (a node-replacement resume from 30 while node A still holds 40 of the old
attempt starts a new attempt instead of loading or colliding with 40).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tiered_ckpt.errors import CheckpointError, ManifestError, NoCheckpointError, UploadError
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.local.catalogue import (
    all_committed_steps,
    committed_steps,
    read_manifest,
    read_run_record,
    resolve_root,
    step_path,
    superseded_in,
)
from tiered_ckpt.remote.catalogue import read_catalogue
from tiered_ckpt.remote.handle import StoreHandle
from tiered_ckpt.remote.lineage import publish_lineage
from tiered_ckpt.remote.restore.restorer import restore
from tiered_ckpt.store.base import ObjectStore

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class RemoteView:
    """What the bucket shows a lineage decision (read by one rank): its run record (``None``: none,
    or the bucket could not be read), its remotely committed saves as ``(step, attempt,
    world_size)`` (``attempt`` ``None``: unknown, judged current; ascending by step, then in the
    order a restore ranks them, the winner of a step last), whether it could be read at all and, if
    not, why (``error``)."""

    lineage: RunLineage | None
    steps: tuple[tuple[int, int | None, int], ...]
    readable: bool = True
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "lineage": None if self.lineage is None else self.lineage.to_dict(),
            "steps": [list(s) for s in self.steps],
            "readable": self.readable,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RemoteView:
        lin = obj["lineage"]
        return cls(
            None if lin is None else RunLineage.from_dict(lin),
            tuple((int(s), None if a is None else int(a), int(w)) for s, a, w in obj["steps"]),
            bool(obj["readable"]),
            obj.get("error"),
        )

    def _current(self, lineage: RunLineage | None) -> dict[int, int]:
        out: dict[int, int] = {}
        for s, a, w in self.steps:  # the last current save of a step is the one a restore picks
            if lineage is None or a is None or lineage.is_current(a, s):
                out[s] = w
        return out

    def current_steps(self, lineage: RunLineage | None) -> list[int]:
        """The bucket's steps with a save current under ``lineage`` (the run's merged record),
        ascending."""
        return sorted(self._current(lineage))

    def world_size_of(self, step: int, lineage: RunLineage | None) -> int | None:
        """The world size of the save of ``step`` a restore under ``lineage`` picks (``None``: no
        current save of it)."""
        return self._current(lineage).get(step)


def read_remote_view(
    remote_url: str,
    *,
    s3_client: Any = None,
    endpoint_url: str | None = None,
    store: ObjectStore | None = None,
) -> RemoteView:
    """Read the bucket's run record and committed saves for a lineage decision: one look at the
    prefix (:func:`~tiered_ckpt.remote.catalogue.read_catalogue`). Saves of another run than the
    bucket's record names are left out. A bucket that cannot be read (``UploadError``: an outage,
    refused credentials) is logged and returned as ``readable=False`` with the cause in ``error``:
    the decision must then assume it may hold newer current steps (SPEC §11). Raises
    ``ManifestError`` for a malformed, empty or oversized ``<prefix>/run.json`` (never read around:
    it decides what is superseded)."""
    try:
        with StoreHandle(
            remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url
        ) as st:
            cat = read_catalogue(st)
    except ManifestError:
        raise
    except UploadError as exc:
        log.warning("cannot read %s (%s)", remote_url, exc)
        return RemoteView(None, (), False, f"{type(exc).__name__}: {exc}")
    run = cat.lineage.run_id if cat.lineage is not None else None
    steps = [
        (s.step, s.attempt, s.um.world_size)
        for s in cat.saves
        if run is None or s.run_id in (None, run)
    ]
    return RemoteView(cat.lineage, tuple(steps))


def publish_remote_lineage(
    remote_url: str, lineage: RunLineage, *, s3_client: Any = None, endpoint_url: str | None = None
) -> None:
    """Write ``lineage`` into the bucket (``<prefix>/run.json``, conditionally:
    :func:`~tiered_ckpt.remote.lineage.publish_lineage`) before the first step of a new attempt
    commits (SPEC §11). Raises ``UploadError``, ``RunMismatchError``, ``LineageError``,
    ``ManifestError``."""
    with StoreHandle(remote_url, s3_client=s3_client, endpoint_url=endpoint_url) as st:
        publish_lineage(st, lineage)


def current_local_steps(root: PathLike, lineage: RunLineage | None) -> list[int]:
    """Committed steps of ``root`` current under ``lineage`` (the run's merged record; ``None``: the
    root's own), ascending. Reads only manifests of steps ``lineage`` could supersede."""
    if lineage is None:
        return committed_steps(root)
    r, _ = resolve_root(root)
    return [s for s in all_committed_steps(r) if superseded_in(r, s, lineage) is None]


def local_ranks_present(root: PathLike, step: int, ranks: Iterable[int]) -> list[int]:
    """Of ``ranks``, those whose shard of the locally committed ``step`` is on disk with the
    manifest's size (cheap: no hashing; loading verifies). ``[]`` if the step is not committed
    locally."""
    try:
        m = read_manifest(root, step)
    except CheckpointError:
        return []
    sdir = step_path(resolve_root(root)[0], step)
    out = []
    for r in ranks:
        if 0 <= r < m.world_size:
            try:
                if os.lstat(sdir / m.shards[r].path).st_size == m.shards[r].size_bytes:
                    out.append(r)
            except OSError:
                pass
    return out


def step_complete(root: PathLike, step: int) -> bool:
    """Whether ``step`` is committed in ``root`` with every rank's shard present (see
    :func:`local_ranks_present`)."""
    try:
        n = read_manifest(root, step).world_size
    except CheckpointError:
        return False
    return len(local_ranks_present(root, step, range(n))) == n


def offer_steps(
    root: PathLike, rank: int | None, local_current: Sequence[int], remote_current: Sequence[int]
) -> list[int]:
    """The steps this rank can load: current local steps holding its shard (``rank=None``: every
    rank's, :func:`step_complete`, for a resharding load that may read any shard), plus the bucket's
    current steps (restorable). Ascending."""
    local = [
        s
        for s in local_current
        if (step_complete(root, s) if rank is None else local_ranks_present(root, s, [rank]))
    ]
    return sorted(set(local) | set(remote_current))


def ensure_local(
    root: PathLike,
    remote_url: str,
    step: int,
    ranks: Sequence[int],
    *,
    s3_client: Any = None,
    endpoint_url: str | None = None,
    **restore_kwargs: Any,
) -> ShardManifest:
    """Make ``ranks``' shards of ``step`` present in ``root``, restoring the missing ones from the
    bucket (a replaced node, or a whole missing step). No remote call when everything is already
    local. Raises :func:`~tiered_ckpt.remote.restore.restorer.restore`'s errors."""
    present = set(local_ranks_present(root, step, ranks))
    missing = sorted(set(ranks) - present)
    if not missing:
        return read_manifest(root, step)
    log.warning(
        "step %d: rank(s) %s missing under %s; restoring them from %s",
        step,
        missing,
        root,
        remote_url,
    )
    return restore(
        remote_url,
        root,
        step=step,
        ranks=missing,
        s3_client=s3_client,
        endpoint_url=endpoint_url,
        **restore_kwargs,
    )


def prepare_load_from_remote(
    root: PathLike,
    remote_url: str,
    rank: int,
    step: int | None,
    *,
    common_steps: Callable[[list[int]], list[int]] | None = None,
    s3_client: Any = None,
    endpoint_url: str | None = None,
    lineage: RunLineage | None = None,
) -> int:
    """Choose the step to load and make this rank's shard of it local (without a lineage decision:
    the manager decides through :mod:`tiered_ckpt.training.lineage_decision`). Returns the step.

    ``step=None``: every rank offers the current steps it can provide (:func:`offer_steps`, under
    ``lineage``, default the root's ``run.json`` merged with the bucket's) and the newest step every
    rank can provide wins (``common_steps``, a collective over the ranks; ``None`` for one process).
    Raises :class:`NoCheckpointError` when no step is available to every rank (``UploadError``
    instead when the bucket could not be read: it may hold one), ``ManifestError`` (the bucket's
    ``run.json``), :class:`LineageError` when the root's and the bucket's records disagree, and
    :func:`~tiered_ckpt.remote.restore.restorer.restore`'s errors.
    """
    view = read_remote_view(remote_url, s3_client=s3_client, endpoint_url=endpoint_url)
    if lineage is None:
        lineage = read_run_record(root)
        if view.lineage is not None and (lineage is None or lineage.run_id == view.lineage.run_id):
            lineage = view.lineage if lineage is None else lineage.merge(view.lineage)
    local = current_local_steps(root, lineage)
    if step is None:
        offer = offer_steps(root, rank, local, view.current_steps(lineage))
        avail = common_steps(offer) if common_steps is not None else offer
        if not avail and not view.readable:
            raise UploadError(
                f"no step is available to every rank locally ({root}), and {remote_url} could "
                f"not be read ({view.error})"
            )
        if not avail:
            raise NoCheckpointError(
                f"no step is available to every rank, locally ({root}) or in {remote_url}"
            )
        step = avail[-1]
    if not local_ranks_present(root, step, [rank]):
        ensure_local(root, remote_url, step, [rank], s3_client=s3_client, endpoint_url=endpoint_url)
    return step


__all__ = [
    "RemoteView",
    "current_local_steps",
    "ensure_local",
    "local_ranks_present",
    "offer_steps",
    "step_complete",
    "prepare_load_from_remote",
    "publish_remote_lineage",
    "read_remote_view",
]
