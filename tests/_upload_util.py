"""Helpers shared by the uploader / sidecar tests (not a test module)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np

from tiered_ckpt.layout import step_dir_name
from tiered_ckpt.local.single_process_save import save_sharded

MiB = 1024 * 1024
#: Small transfer settings so that ~12 MiB shards go multipart (5 MiB parts, 6 MiB threshold).
SMALL = dict(multipart_threshold_bytes=6 * MiB, part_size_bytes=5 * MiB, max_concurrency=4)


def make_step(
    root: Path, step: int, *, world_size: int = 4, shard_bytes: int = 12 * MiB, seed: int = 0
):
    """Commit a ``world_size``-rank step whose shards each hold ~``shard_bytes`` of random data."""
    rng = np.random.default_rng(seed * 1000 + step)
    n = shard_bytes // 4
    states = [
        {"w": rng.integers(0, 2**31, size=n, dtype=np.int32), "step": step, "rank": r}
        for r in range(world_size)
    ]
    return save_sharded(states, root, step)


def split_nodes(src: Path, dst_a: Path, dst_b: Path, step: int, ranks_a: list[int]) -> None:
    """Copy a committed step into two node-local roots: ``ranks_a`` to ``dst_a``, the rest to
    ``dst_b``; both get the global manifest (as with node-local disks)."""
    sd = src / step_dir_name(step)
    for dst, pick in ((dst_a, lambda r: r in ranks_a), (dst_b, lambda r: r not in ranks_a)):
        d = dst / step_dir_name(step)
        d.mkdir(parents=True)
        for f in sorted(os.listdir(sd)):
            if f.startswith("rank_"):
                if pick(int(f[5:10])):
                    shutil.copy2(sd / f, d / f)
        shutil.copy2(sd / "manifest.json", d / "manifest.json")


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(4 * MiB), b""):
            h.update(chunk)
    return h.hexdigest()


def remote_bytes(loc, key: str) -> bytes:
    return loc.client.get_object(Bucket=loc.bucket, Key=key)["Body"].read()


def list_keys(loc, prefix: str | None = None) -> list[str]:
    p = loc.prefix + "/" if prefix is None else prefix
    out = []
    for page in loc.client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=p):
        out.extend(o["Key"] for o in page.get("Contents", []))
    return out


def save_entry(root: Path, step: int) -> str:
    """``step_XXXXXXXXXX.<save_id>``: the remote entry of the local step's save (SPEC §11 keys)."""
    from tiered_ckpt.layout import save_entry_name
    from tiered_ckpt.local.catalogue import read_manifest

    return save_entry_name(step, read_manifest(root, step).save_id)


def save_prefix(loc, root: Path, step: int) -> str:
    """Full key prefix (no trailing slash) of the local step's save under ``loc``."""
    return f"{loc.prefix}/{save_entry(root, step)}" if loc.prefix else save_entry(root, step)
