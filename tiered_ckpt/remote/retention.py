"""Remote cleanup (SPEC §4): rotation of remotely committed steps, and the sweep of abandoned multipart
uploads. Both are called by the sidecar (:class:`tiered_ckpt.remote.upload.Uploader`): the sweep once at
start, retention after each step it commits.

- :func:`apply_remote_retention` keeps the newest ``keep_last`` committed steps (plus every
  ``keep_every_n_steps``-th, the step ``latest`` names, and anything newer than the newest kept step) and
  un-commits the others: ``upload_manifest.json`` is deleted FIRST (the step stops existing for restore
  at once), then the step's other objects.
- :func:`abort_abandoned_uploads` aborts multipart uploads under the prefix left by an earlier (crashed)
  sidecar of this node: those of shard keys whose rank this node holds locally, and any older than
  ``stale_age_s`` whoever started them (other nodes' live uploads are left alone).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from tiered_ckpt.layout import UPLOAD_MANIFEST_NAME, parse_shard_file_name, parse_step_dir_name, step_dir_name
from tiered_ckpt.remote.catalogue import committed_step_candidates, step_key
from tiered_ckpt.store.base import ObjectStore

log = logging.getLogger(__name__)

#: Multipart uploads older than this under the prefix are aborted at start whoever started them.
DEFAULT_STALE_MULTIPART_AGE_S = 24 * 3600.0


def retention_victims(steps: list[int], latest: int | None, keep_last: int,
                      keep_every_n_steps: int | None) -> list[int]:
    """Of the committed ``steps`` (ascending), those the policy deletes (pure; see the module docstring)."""
    keep = set(steps[-keep_last:])
    if latest is not None:
        keep.add(latest)
    newest_kept = max(keep, default=-1)
    return [s for s in steps if s not in keep and s <= newest_kept
            and not (keep_every_n_steps is not None and s % keep_every_n_steps == 0)]


def apply_remote_retention(store: ObjectStore, keep_last: int | None,
                           keep_every_n_steps: int | None = None) -> list[int]:
    """Delete remotely committed steps beyond the policy (upload manifest first). Returns them.
    ``keep_last=None`` keeps everything. Raises ``UploadError`` (the bucket cannot be listed or written)."""
    if keep_last is None:
        return []
    steps, pointer = committed_step_candidates(store)
    deleted = []
    for s in retention_victims(steps, pointer.step if pointer is not None else None, keep_last,
                               keep_every_n_steps):
        store.delete([step_key(s, UPLOAD_MANIFEST_NAME)])  # un-commit first
        store.delete(list(store.list_keys(step_dir_name(s) + "/")))
        deleted.append(s)
        log.info("step %d: deleted remotely (retention keeps the last %d)", s, keep_last)
    return deleted


def _listdir(p: Path) -> list[str]:
    try:
        return os.listdir(p)
    except OSError:
        return []


def local_shard_ranks(local_root: Path) -> set[int]:
    """Ranks of the shard files in any step directory under ``local_root`` (this node's ranks)."""
    ranks: set[int] = set()
    for name in _listdir(local_root):
        if parse_step_dir_name(name) is None:
            continue
        for f in _listdir(local_root / name):
            r = parse_shard_file_name(f)
            if r is not None:
                ranks.add(r)
    return ranks


def abort_abandoned_uploads(store: ObjectStore, local_root: Path,
                            stale_age_s: float = DEFAULT_STALE_MULTIPART_AGE_S) -> int:
    """See the module docstring. Returns how many multipart uploads were aborted."""
    local_ranks = local_shard_ranks(local_root)
    now = time.time()
    n = 0
    for mpu in list(store.list_multipart_uploads("step_")):
        rank = parse_shard_file_name(mpu.key.rsplit("/", 1)[-1])
        age = now - mpu.initiated.timestamp() if mpu.initiated is not None else 0.0
        if (rank is not None and rank in local_ranks) or age > stale_age_s:
            if store.abort_multipart_upload(mpu.key, mpu.upload_id):
                n += 1
                log.info("aborted abandoned multipart upload %s of %s/%s", mpu.upload_id, store.url, mpu.key)
    return n


__all__ = ["DEFAULT_STALE_MULTIPART_AGE_S", "abort_abandoned_uploads", "apply_remote_retention",
           "local_shard_ranks", "retention_victims"]
