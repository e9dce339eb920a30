"""``tiered-ckpt verify --remote s3://bucket/prefix``: the state of every remote save, checked against
its upload manifest with the same code restore uses (:func:`~tiered_ckpt.remote.restore_plan.plan_step`,
:func:`~tiered_ckpt.remote.download.fetch_shard`), so a save that verifies is one that restores.

- ``committed``: upload manifest valid, mirrored ``manifest.json`` matches its sha256, every shard object
  present with the right size (HEAD) and, unless ``fast``, downloaded and matching its sha256 and header.
  A committed save that is not its step's current one (SPEC §11) says why in its reason:
  ``superseded by attempt K from step S``, ``replaced by save X (attempt K)`` or ``run X, not the
  prefix's run Y`` (listed, never restored);
- ``uncommitted``: objects without an upload manifest (an upload in progress or abandoned);
- ``corrupt``: a bad upload manifest or manifest, or a shard whose size, sha256 or header is wrong;
- ``incomplete``: an object the upload manifest lists is missing.

One row per save, by step, the step's current save first. ``fast`` checks presence and sizes by HEAD only
(no download). Downloads go to a temporary directory and are deleted after hashing.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

from tiered_ckpt.errors import CheckpointError, MissingShardError, NoCheckpointError
from tiered_ckpt.local.scan import COMMITTED, CORRUPT, INCOMPLETE, UNCOMMITTED, StepStatus
from tiered_ckpt.remote.catalogue import (CURRENT, REMOTE_NO_UPLOAD_MANIFEST, RemoteSave, read_catalogue,
                                          remote_steps_of)
from tiered_ckpt.remote.download import fetch_shard
from tiered_ckpt.remote.handle import StoreHandle
from tiered_ckpt.remote.restore_plan import plan_step
from tiered_ckpt.store.base import ObjectStore


def scan_remote(remote_url: str, *, step: int | None = None, fast: bool = False, s3_client: Any = None,
                store: ObjectStore | None = None, endpoint_url: str | None = None) -> list[StepStatus]:
    """:class:`~tiered_ckpt.local.scan.StepStatus` of every save of ``step``, or of every remote save.

    Never raises for a bad remote save (the fault is its ``reason``); raises
    :class:`~tiered_ckpt.errors.UploadError` when the bucket cannot be read at all,
    ``ManifestError`` when its ``run.json`` is unreadable.
    """
    handle = StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url)
    with handle as st:  # Ctrl-C cuts the download in flight (handle.cancel), never waits it out
        cat = read_catalogue(st)
        saves = {(s.step, s.save_id): s for s in cat.saves}
        out = []
        for rs in remote_steps_of(cat):
            if step is not None and rs.step != step:
                continue
            save = saves.get((rs.step, rs.save_id)) if rs.ok else None
            if rs.state == REMOTE_NO_UPLOAD_MANIFEST:
                out.append(StepStatus(rs.step, UNCOMMITTED, rs.reason, size_bytes=0, save_id=rs.save_id))
            elif save is None:
                out.append(StepStatus(rs.step, CORRUPT, f"{rs.state}: {rs.reason}", save_id=rs.save_id))
            else:
                note = "" if rs.status == CURRENT else rs.status
                out.append(_check_save(st, save, rs.latest, fast, note, handle.cancel))
        return out


def _check_save(store: ObjectStore, save: RemoteSave, latest: bool, fast: bool, note: str,
                cancel: Callable[[], None] | None = None) -> StepStatus:
    step = save.step
    try:
        plan = plan_step(store, save, None, from_pointer=latest)
    except (MissingShardError, NoCheckpointError) as exc:
        return StepStatus(step, INCOMPLETE, str(exc), save_id=save.save_id)
    except CheckpointError as exc:
        return StepStatus(step, CORRUPT, str(exc), save_id=save.save_id)
    m = plan.manifest
    if not fast:
        with tempfile.TemporaryDirectory(prefix="tiered-ckpt-verify-") as tmp:
            for obj in plan.objects:
                path = Path(tmp) / f"rank_{obj.rank}.part"
                try:
                    fetch_shard(store, plan, obj, path, None, cancel)
                except MissingShardError as exc:
                    return StepStatus(step, INCOMPLETE, str(exc), m.world_size, plan.total_bytes, m.save_id)
                except CheckpointError as exc:
                    return StepStatus(step, CORRUPT, str(exc), m.world_size, plan.total_bytes, m.save_id)
                finally:
                    path.unlink(missing_ok=True)
    return StepStatus(step, COMMITTED, note, m.world_size, plan.total_bytes, m.save_id)


__all__ = ["scan_remote"]
