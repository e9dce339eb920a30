"""One-call save of every rank's state from one process (SPEC §2): :func:`save_sharded` writes each
rank's shard on its own thread under one ``save_id``, then commits the step.

1. claim the step once for the whole save (:class:`~tiered_ckpt.local.commit.LocalStepCommit`, a new
   ``save_id``); with ``replace``, un-commit an existing step up front (I2).
2. every rank, on up to 8 threads: :func:`~tiered_ckpt.local.writer.write_shard`, joining the claim.
3. :func:`~tiered_ckpt.local.commit.commit_step`: ``manifest.json``, last.
4. on failure before the commit: this save's shards are removed again and the lock released.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import CheckpointError, CheckpointWriteError
from tiered_ckpt.format.manifest import ShardManifest, ShardRecord
from tiered_ckpt.fs import new_save_id, unlink_quietly
from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.catalogue import write_root
from tiered_ckpt.local.commit import LocalStepCommit, commit_step
from tiered_ckpt.local.writer import write_shard

PathLike = str | os.PathLike[str]


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


__all__ = ["save_sharded"]
