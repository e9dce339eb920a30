"""Downloading one planned shard and verifying it (lifecycle step 3 of :mod:`tiered_ckpt.remote.restore`;
also what ``tiered-ckpt verify --remote`` runs, so a step that verifies is one that restores).

:func:`fetch_shard` downloads the object to a path the caller chose (a staged temp name in the step
directory for restore, a temporary directory for verify), then hashes it and compares the sha256 and size
with the manifest's, and its safetensors header with the manifest's record, as loading checks.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from tiered_ckpt.errors import MissingShardError, ShardCorruptedError
from tiered_ckpt.format.shard_file import decode_state
from tiered_ckpt.local.reader import check_header_bytes, read_header_bytes
from tiered_ckpt.remote.handle import object_url
from tiered_ckpt.remote.restore_plan import RemoteObject, RestorePlan
from tiered_ckpt.safe_read import opened
from tiered_ckpt.store.base import ObjectStore, RemoteNotFoundError

ProgressCallback = Callable[[int], None]

_HASH_CHUNK = 8 * 1024 * 1024


def hash_file(path: Path) -> tuple[str, int]:
    """``(sha256 hex, size in bytes)`` of a file, read in 8 MiB chunks through
    :func:`tiered_ckpt.safe_read.opened` (no symlink followed below its root, never blocking, a regular
    file only). Raises ``FileNotFoundError`` (absent), :class:`ShardCorruptedError` (a symlink, FIFO,
    device or directory there; a read error)."""
    sha = hashlib.sha256()
    n = 0
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with opened(path, error=ShardCorruptedError) as fd:
        while True:
            k = os.readv(fd, [buf])
            if not k:
                break
            sha.update(view[:k])
            n += k
    return sha.hexdigest(), n


def _check_header(path: Path, plan: RestorePlan, rank: int, where: str) -> None:
    """The downloaded file's safetensors header agrees with the manifest's record, and its state tree with
    the header's tensors (as loading and local ``verify`` check; rank 0 holds the replicated values)."""
    rec = plan.manifest.shards[rank]
    with opened(path, error=ShardCorruptedError) as fd:
        raw = read_header_bytes(fd, rec, where)
    decode_state(None, check_header_bytes(raw, rec, plan.manifest, where), where, lambda key_path: None)


def fetch_shard(store: ObjectStore, plan: RestorePlan, obj: RemoteObject, dest: Path,
                on_progress: ProgressCallback | None = None) -> None:
    """Download ``obj`` to ``dest`` and verify it against ``plan``'s manifest. Raises
    ``MissingShardError`` (object gone), ``ShardCorruptedError`` (size, sha256 or header differs; a HEAD
    size other than the manifest's before any byte is fetched, a body past it within one part),
    ``UploadError`` (the bucket cannot be read), ``OSError`` (local disk)."""
    where = f"step {plan.step} rank {obj.rank}: {object_url(store, obj.key)}"
    try:
        store.download_file(obj.key, dest, on_progress=on_progress, expected_size=obj.size_bytes)
    except RemoteNotFoundError as exc:
        raise MissingShardError(f"{where} disappeared before it could be downloaded") from exc
    sha, size = hash_file(dest)
    if size != obj.size_bytes:
        raise ShardCorruptedError(f"{where}: downloaded {size} bytes, the manifest says {obj.size_bytes}")
    if sha != obj.sha256:
        raise ShardCorruptedError(f"{where}: sha256 of the downloaded bytes {sha[:16]}... differs from the "
                                  f"manifest's {obj.sha256[:16]}... (the object in the bucket is corrupt)")
    _check_header(dest, plan, obj.rank, where)


__all__ = ["fetch_shard", "hash_file"]
