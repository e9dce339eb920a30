"""Helpers of the restore tests: small multi-rank steps on the local tier, and a minimal publisher
that writes a step into a bucket in the documented remote layout (SPEC §4), so the restore tests do
not depend on the uploader's internals (tests/test_restore_e2e.py uses the real Uploader)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np
from botocore.exceptions import ClientError

from tiered_ckpt import GlobalSlice, read_manifest, save_sharded
from tiered_ckpt.format.upload_manifest import LatestPointer, RemoteShard, UploadManifest
from tiered_ckpt.layout import (
    MANIFEST_NAME,
    UPLOAD_MANIFEST_NAME,
    remote_latest_key,
    remote_save_key,
    step_dir_name,
)


def make_states(step: int, world_size: int = 4, numel: int = 64 * 1024) -> list[dict]:
    """Per-rank states that differ by step and rank: a ZeRO-like slice, a bf16-ish fp16 tensor,
    JSON."""
    rng = np.random.default_rng(step)
    flat = rng.standard_normal(numel * world_size).astype(np.float32)
    out = []
    for r in range(world_size):
        out.append(
            {
                "master": GlobalSlice(
                    flat[r * numel : (r + 1) * numel].copy(), (numel * world_size,), (r * numel,)
                ),
                "half": rng.standard_normal((16, 33)).astype(np.float16),
                "counter": np.array(step * 10 + r, dtype=np.int64),
                "meta": {"step": step, "rank": r},
            }
        )
    return out


def save_step(root: Path, step: int, world_size: int = 4) -> list[dict]:
    states = make_states(step, world_size)
    save_sharded(states, root, step, extra={"loss": 1.0 / (step + 1)})
    return states


def put(client, bucket: str, key: str, body: bytes) -> str:
    """PUT ``body``; returns the object's ETag. A test's setup, not what it tests: a transient 500
    ``InternalError`` (SeaweedFS answers some under a fully loaded machine) is tried again, up to 5
    times."""
    for attempt in range(5):
        try:
            return client.put_object(Bucket=bucket, Key=key, Body=body)["ETag"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "InternalError" or attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def publish(
    client,
    bucket: str,
    prefix: str,
    root: Path,
    step: int,
    *,
    upload_manifest: bool = True,
    pointer: bool = True,
    schema: int = 1,
) -> UploadManifest | None:
    """Upload ``step`` of ``root``: shards, the manifest's exact bytes, then (optionally) the upload
    manifest and the latest pointer. ``schema=1``: the layout before per-save prefixes (``<prefix>/step_X/``, upload
    manifest schema 1); ``schema=2``: one prefix per save (``<prefix>/step_X.<save_id>/``, schema 2
    with the lineage and each shard's ETag)."""
    sdir = Path(root) / step_dir_name(step)
    m = read_manifest(root, step)
    raw = (sdir / MANIFEST_NAME).read_bytes()
    sid = m.save_id if schema >= 2 else None

    def key(name: str) -> str:
        return remote_save_key(prefix, step, sid, name)

    shards = []
    for rec in m.shards:
        etag = put(client, bucket, key(rec.path), (sdir / rec.path).read_bytes())
        shards.append(
            RemoteShard(
                rec.rank,
                key(rec.path),
                rec.size_bytes,
                rec.sha256,
                "read-back",
                etag if schema >= 2 else None,
            )
        )
    put(client, bucket, key(MANIFEST_NAME), raw)
    if not upload_manifest:
        return None
    lineage = (
        dict(run_id=m.run_id, attempt=m.attempt, created_at=m.created_at) if schema >= 2 else {}
    )
    um = UploadManifest(
        step=step,
        world_size=m.world_size,
        save_id=m.save_id,
        prefix=prefix,
        manifest_key=key(MANIFEST_NAME),
        manifest_sha256=hashlib.sha256(raw).hexdigest(),
        shards=tuple(shards),
        schema_version=schema,
        **lineage,
    )
    body = um.to_json().encode()
    put(client, bucket, key(UPLOAD_MANIFEST_NAME), body)
    if pointer:
        ptr = (
            LatestPointer(step, hashlib.sha256(body).hexdigest(), m.attempt, sid)
            if schema >= 2
            else LatestPointer(step, hashlib.sha256(body).hexdigest())
        )
        put(client, bucket, remote_latest_key(prefix), ptr.to_json().encode())
    return um


def assert_states_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        g = got[k]
        if isinstance(v, GlobalSlice):
            v = v.array
            g = g.array if isinstance(g, GlobalSlice) else g
        if isinstance(v, np.ndarray):
            g = np.asarray(g)
            assert g.dtype == v.dtype and g.shape == v.shape, k
            assert g.tobytes() == v.tobytes(), k
        else:
            assert g == v, k


def files_under(root: Path) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in names]
    return sorted(out)
