"""``tiered-ckpt verify --remote s3://bucket/prefix``: the state of every remote step, checked against
its upload manifest with the same code restore uses (:func:`~tiered_ckpt.remote.restore_plan.plan_step`,
:func:`~tiered_ckpt.remote.download.fetch_shard`), so a step that verifies is one that restores.

- ``committed``: upload manifest valid, mirrored ``manifest.json`` matches its sha256, every shard object
  present with the right size (HEAD) and, unless ``fast``, downloaded and matching its sha256 and header;
- ``uncommitted``: objects without an upload manifest (an upload in progress or abandoned);
- ``corrupt``: a bad upload manifest or manifest, or a shard whose size, sha256 or header is wrong;
- ``incomplete``: an object the upload manifest lists is missing.

``fast`` checks presence and sizes by HEAD only (no download). Downloads go to a temporary directory
and are deleted after hashing.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import CheckpointError, MissingShardError, NoCheckpointError
from tiered_ckpt.local.scan import COMMITTED, CORRUPT, INCOMPLETE, UNCOMMITTED, StepStatus
from tiered_ckpt.remote.catalogue import REMOTE_COMMITTED, REMOTE_NO_UPLOAD_MANIFEST, list_remote_steps_in
from tiered_ckpt.remote.download import fetch_shard
from tiered_ckpt.remote.handle import StoreHandle
from tiered_ckpt.remote.restore_plan import plan_step
from tiered_ckpt.store.base import ObjectStore


def scan_remote(remote_url: str, *, step: int | None = None, fast: bool = False, s3_client: Any = None,
                store: ObjectStore | None = None, endpoint_url: str | None = None) -> list[StepStatus]:
    """:class:`~tiered_ckpt.local.scan.StepStatus` of ``step``, or of every remote step (ascending).

    Never raises for a bad remote step (the fault is its ``reason``); raises
    :class:`~tiered_ckpt.errors.UploadError` when the bucket cannot be read at all.
    """
    with StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url) as st:
        listed = list_remote_steps_in(st)
        if step is not None:
            listed = [r for r in listed if r.step == step]
        out = []
        for rs in listed:
            if rs.state == REMOTE_NO_UPLOAD_MANIFEST:
                out.append(StepStatus(rs.step, UNCOMMITTED, rs.reason, size_bytes=0))
            elif rs.state != REMOTE_COMMITTED:
                out.append(StepStatus(rs.step, CORRUPT, f"{rs.state}: {rs.reason}"))
            else:
                out.append(_check_step(st, rs.step, rs.latest, fast))
        return out


def _check_step(store: ObjectStore, step: int, latest: bool, fast: bool) -> StepStatus:
    try:
        plan = plan_step(store, step, None, from_pointer=latest)
    except (MissingShardError, NoCheckpointError) as exc:
        return StepStatus(step, INCOMPLETE, str(exc))
    except CheckpointError as exc:
        return StepStatus(step, CORRUPT, str(exc))
    m = plan.manifest
    if not fast:
        with tempfile.TemporaryDirectory(prefix="tiered-ckpt-verify-") as tmp:
            for obj in plan.objects:
                path = Path(tmp) / f"rank_{obj.rank}.part"
                try:
                    fetch_shard(store, plan, obj, path, None)
                except MissingShardError as exc:
                    return StepStatus(step, INCOMPLETE, str(exc), m.world_size, plan.total_bytes, m.save_id)
                except CheckpointError as exc:
                    return StepStatus(step, CORRUPT, str(exc), m.world_size, plan.total_bytes, m.save_id)
                finally:
                    path.unlink(missing_ok=True)
    return StepStatus(step, COMMITTED, "", m.world_size, plan.total_bytes, m.save_id)


__all__ = ["scan_remote"]
