"""The manager's resume hook (SPEC §5): choose the step to load and make this rank's shard of it local,
restoring from the bucket what the local disk lacks (a replaced node, or a whole missing step).

Called by :meth:`tiered_ckpt.training.manager.CheckpointManager.load` on every rank when the manager has a
``remote_url``; the step choice is a collective over the ranks (``common_steps``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Sequence

from tiered_ckpt.errors import CheckpointError, NoCheckpointError, UploadError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.local.catalogue import committed_steps, read_manifest, resolve_root, step_path
from tiered_ckpt.remote.catalogue import remote_committed_steps
from tiered_ckpt.remote.restore import restore

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


def local_ranks_present(root: PathLike, step: int, ranks: Iterable[int]) -> list[int]:
    """Of ``ranks``, those whose shard of the locally committed ``step`` is on disk with the manifest's
    size (cheap: no hashing; loading verifies). ``[]`` if the step is not committed locally."""
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


def ensure_local(root: PathLike, remote_url: str, step: int, ranks: Sequence[int], *, s3_client: Any = None,
                 endpoint_url: str | None = None, **restore_kwargs: Any) -> ShardManifest:
    """Make ``ranks``' shards of ``step`` present in ``root``, restoring the missing ones from the bucket
    (a replaced node, or a whole missing step). No remote call when everything is already local.
    Raises :func:`~tiered_ckpt.remote.restore.restore`'s errors."""
    present = set(local_ranks_present(root, step, ranks))
    missing = sorted(set(ranks) - present)
    if not missing:
        return read_manifest(root, step)
    log.warning("step %d: rank(s) %s missing under %s; restoring them from %s", step, missing, root, remote_url)
    return restore(remote_url, root, step=step, ranks=missing, s3_client=s3_client, endpoint_url=endpoint_url,
                   **restore_kwargs)


def prepare_load_from_remote(root: PathLike, remote_url: str, rank: int, step: int | None, *,
                             common_steps: Callable[[list[int]], list[int]] | None = None,
                             s3_client: Any = None, endpoint_url: str | None = None) -> int:
    """The restore hook of :meth:`CheckpointManager.load`: choose the step to load and make this rank's
    shard of it local. Returns the step.

    ``step=None``: every rank offers the steps it can provide (committed locally with its own shard, or
    remote candidates: :func:`~tiered_ckpt.remote.catalogue.committed_step_candidates`) and the newest step
    every rank can provide wins (``common_steps``, a collective over the ranks; ``None`` for one process).
    So a replaced node's ranks restore the newest step the bucket holds while the surviving nodes load
    their local copies of it. When the bucket cannot be read, the local steps alone are offered (with a
    warning). Raises :class:`NoCheckpointError` when no step is available to every rank, and
    :func:`~tiered_ckpt.remote.restore.restore`'s errors.
    """
    local = [s for s in committed_steps(root) if local_ranks_present(root, s, [rank])]
    if step is None:
        try:
            remote = remote_committed_steps(remote_url, s3_client=s3_client, endpoint_url=endpoint_url)
        except UploadError as exc:
            log.warning("rank %d: cannot read %s (%s); resuming from local steps only", rank, remote_url, exc)
            remote = []
        offer = sorted(set(local) | set(remote))
        avail = common_steps(offer) if common_steps is not None else offer
        if not avail:
            raise NoCheckpointError(f"no step is available to every rank, locally ({root}) or in {remote_url}")
        step = avail[-1]
    if step not in local:
        ensure_local(root, remote_url, step, [rank], s3_client=s3_client, endpoint_url=endpoint_url)
    return step


__all__ = ["ensure_local", "local_ranks_present", "prepare_load_from_remote"]
