"""Remote cleanup (SPEC §4, §11): rotation of remotely committed saves, and the sweep of abandoned
multipart uploads. Both are called by the sidecar (:class:`tiered_ckpt.remote.upload.uploader.Uploader`): the
sweep once at start, retention after each step it commits.

- :func:`apply_remote_retention` keeps the newest ``keep_last`` *current* steps (their winning save;
  plus every ``keep_every_n_steps``-th, the save ``latest`` names, anything newer than the newest
  kept step, and every pinned save: ``pinned.json`` in its prefix) and un-commits the other current
  ones. Saves that are not current (superseded by a later attempt, or replaced by a newer save of
  their step) are removed only once ``keep_last`` current steps exist, and never when pinned. Saves
  of another run (a prefix adopted from it) are never removed here. Un-commit deletes
  ``upload_manifest.json`` FIRST (the save stops existing for restore at once), then the save's
  shard objects wherever its key layout put them (``hashed``: ``shards/<hh>/...``, the keys its
  upload manifest names and those the catalogue's LIST attributed to the save), then everything LIST
  shows under its save prefix.
- :func:`abort_abandoned_uploads` aborts multipart uploads under the prefix left by an earlier
  (crashed) sidecar of this node (shard keys of either key layout: one ListMultipartUploads of the
  prefix, filtered to ``step_*`` and ``shards/*`` keys): those of shard keys whose rank this node
  holds locally, and any older than ``stale_age_s`` whoever started them (other nodes' live uploads
  are left alone). It first aborts the uploads this root recorded as not abortable
  (:mod:`tiered_ckpt.remote.upload.pending_aborts`). A server without ListMultipartUploads or
  AbortMultipartUpload (501; :mod:`tiered_ckpt.store.optional_apis`, warned once per store) ends the
  listing sweep quietly instead of failing it. Retention deletes through ``store.delete``, which
  falls back to one DeleteObject per key where DeleteObjects is missing.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from tiered_ckpt.layout import (
    SPREAD_DIR,
    UPLOAD_MANIFEST_NAME,
    parse_shard_file_name,
    parse_step_dir_name,
    save_entry_name,
)
from tiered_ckpt.remote.catalogue import CURRENT, RemoteCatalogue, RemoteSave, read_catalogue
from tiered_ckpt.remote.upload.pending_aborts import sweep_pending_aborts
from tiered_ckpt.safe_read import list_dir
from tiered_ckpt.store.base import ObjectStore
from tiered_ckpt.store.optional_apis import OperationNotSupportedError

log = logging.getLogger(__name__)

#: Multipart uploads older than this under the prefix are aborted at start whoever started them.
DEFAULT_STALE_MULTIPART_AGE_S = 24 * 3600.0


def retention_victims(
    steps: list[int], latest: int | None, keep_last: int, keep_every_n_steps: int | None
) -> list[int]:
    """Of the current committed ``steps`` (ascending), those the policy deletes (pure; see the
    module docstring)."""
    keep = set(steps[-keep_last:])
    if latest is not None:
        keep.add(latest)
    newest_kept = max(keep, default=-1)
    return [
        s
        for s in steps
        if s not in keep
        and s <= newest_kept
        and not (keep_every_n_steps is not None and s % keep_every_n_steps == 0)
    ]


def retention_victim_saves(
    cat: RemoteCatalogue, keep_last: int, keep_every_n_steps: int | None = None
) -> list[RemoteSave]:
    """The saves of ``cat`` that :func:`apply_remote_retention` deletes (pure; module docstring)."""
    current = cat.current()
    ptr = cat.pointer
    latest = next((s.step for s in current if cat.is_latest(s.step, s.key_save_id)), None)
    doomed = set(
        retention_victims([s.step for s in current], latest, keep_last, keep_every_n_steps)
    )
    out = [s for s in current if s.step in doomed and not s.pinned]
    if len(current) >= keep_last:
        for s in cat.saves:
            status = cat.status(s)
            if status == CURRENT or s.pinned or status.startswith("run "):
                continue
            if ptr is not None and cat.is_latest(s.step, s.key_save_id):
                continue
            out.append(s)
    return sorted(out, key=lambda s: (s.step, s.save_id))


def apply_remote_retention(
    store: ObjectStore, keep_last: int | None, keep_every_n_steps: int | None = None
) -> list[int]:
    """Delete remotely committed saves beyond the policy (upload manifest first). Returns their
    steps (a step twice when two of its saves went). ``keep_last=None`` keeps everything. Raises
    ``UploadError`` (the bucket cannot be listed or written), ``ManifestError`` (an unreadable
    ``run.json``: nothing is deleted)."""
    if keep_last is None:
        return []
    cat = read_catalogue(store)
    deleted = []
    for s in retention_victim_saves(cat, keep_last, keep_every_n_steps):
        why = cat.status(s)
        store.delete([s.key(UPLOAD_MANIFEST_NAME)])  # un-commit first
        own = save_entry_name(s.step, s.key_save_id) + "/"
        spread = {s.shard_key(r.rank) for r in s.um.shards} | {n for n in s.names if "/" in n}
        # spread shards (none in the flat layout) and the save prefix, in one DeleteObjects batch
        # per 1000
        store.delete(
            sorted(k for k in spread if not k.startswith(own)) + list(store.list_keys(own))
        )
        deleted.append(s.step)
        log.info(
            "step %d: save %s (%s) deleted remotely (retention keeps the last %d current steps)",
            s.step,
            s.save_id,
            why,
            keep_last,
        )
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
        for f in list_dir(local_root / name):  # a symlinked step directory is not followed
            r = parse_shard_file_name(f)
            if r is not None:
                ranks.add(r)
    return ranks


def abort_abandoned_uploads(
    store: ObjectStore, local_root: Path, stale_age_s: float = DEFAULT_STALE_MULTIPART_AGE_S
) -> int:
    """See the module docstring. Returns how many multipart uploads were aborted (recorded ones
    included). Raises ``UploadError`` (listing or an abort failed); a pending-abort record that
    cannot be rewritten is logged."""
    try:
        n = sweep_pending_aborts(store, local_root)
    except OSError as e:  # the record cannot be rewritten: the listing sweep below still runs
        log.warning("could not update the pending-abort record of %s: %s", local_root, e)
        n = 0
    local_ranks = local_shard_ranks(local_root)
    now = time.time()
    try:
        listed = [
            u
            for u in store.list_multipart_uploads("")
            if u.key.startswith(("step_", SPREAD_DIR + "/"))
        ]
    except OperationNotSupportedError:
        return (
            n  # the store warned once; the recorded uploads above are all this server lets us find
        )
    for mpu in listed:
        rank = parse_shard_file_name(mpu.key.rsplit("/", 1)[-1])
        age = now - mpu.initiated.timestamp() if mpu.initiated is not None else 0.0
        if (rank is not None and rank in local_ranks) or age > stale_age_s:
            try:
                aborted = store.abort_multipart_upload(mpu.key, mpu.upload_id)
            except OperationNotSupportedError:
                return n  # the store warned once; nothing here can abort
            if aborted:
                n += 1
                log.info(
                    "aborted abandoned multipart upload %s of %s/%s",
                    mpu.upload_id,
                    store.url,
                    mpu.key,
                )
    return n


__all__ = [
    "DEFAULT_STALE_MULTIPART_AGE_S",
    "abort_abandoned_uploads",
    "apply_remote_retention",
    "local_shard_ranks",
    "retention_victims",
]
