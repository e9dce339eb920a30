"""Manifest schema migrations (pure): ``MIGRATIONS[v]`` upgrades a manifest dict of schema version
``v`` to ``v + 1``; :func:`migrate` chains them up to the current :data:`SCHEMA_VERSION`. A loader
reads any older version through this registry and never writes the old version back."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tiered_ckpt.format.validate import fail

#: The manifest schema version this code writes.
SCHEMA_VERSION = 3


def migrate_v1_to_v2(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Upgrade a version-1 manifest dict to version 2 (pure; the input is not modified).

    Version 1 has no checksums beyond the whole-file sha256: every shard gets ``crc32c``,
    ``header_sha256`` and ``crc32c_chunk_bytes`` set to ``null`` (unknown; tensors have no
    ``crc32c``), so that fast and partial verification of such a step fall back to sha256 of whole
    files. A version-1 dict that already carries one of these keys is refused (they were unknown
    keys in v1). Malformed parts are left for validation to report.
    """
    out = dict(obj)
    out["schema_version"] = 2
    shards = out.get("shards")
    if not isinstance(shards, list):
        return out
    new_shards: list[Any] = []
    for i, s in enumerate(shards):
        if not isinstance(s, dict):
            new_shards.append(s)
            continue
        s = dict(s)
        clash = sorted({"crc32c", "header_sha256", "crc32c_chunk_bytes"} & s.keys())
        if clash:
            raise fail(f"shards[{i}] has unknown keys {clash} (schema_version 1)")
        s.update(crc32c=None, header_sha256=None, crc32c_chunk_bytes=None)
        tensors = s.get("tensors")
        if isinstance(tensors, list):
            for j, t in enumerate(tensors):
                if isinstance(t, dict) and "crc32c" in t:
                    raise fail(
                        f"shards[{i}].tensors[{j}] has unknown keys ['crc32c'] (schema_version 1)"
                    )
        new_shards.append(s)
    out["shards"] = new_shards
    return out


def migrate_v2_to_v3(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Upgrade a version-2 manifest dict to version 3 (pure; the input is not modified).

    Version 2 has no lineage: the step gets ``run_id: null`` (no known run) and ``attempt: 1`` (the
    first attempt, which no rollback has happened before). A version-2 dict that already carries
    ``run_id`` or ``attempt`` is refused (they were unknown keys in v2).
    """
    clash = sorted({"run_id", "attempt"} & obj.keys())
    if clash:
        raise fail(f"manifest has unknown keys {clash} (schema_version 2)")
    out = dict(obj)
    out.update(schema_version=3, run_id=None, attempt=1)
    return out


#: Named migrations: ``MIGRATIONS[v]`` upgrades a manifest dict of version ``v`` to ``v + 1``.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: migrate_v1_to_v2,
    2: migrate_v2_to_v3,
}


def migrate(obj: Mapping[str, Any], version: int) -> dict[str, Any]:
    """Upgrade a manifest dict of ``version`` to :data:`SCHEMA_VERSION` with the named
    migrations."""
    if version < 1:
        raise fail(f"manifest schema_version {version} is not a known version")
    out = dict(obj)
    while version < SCHEMA_VERSION:
        fn = MIGRATIONS.get(version)
        if fn is None:  # pragma: no cover - every version has a migration
            raise fail(f"no migration from schema_version {version}")
        out = fn(out)
        version += 1
    return out


__all__ = ["SCHEMA_VERSION", "MIGRATIONS", "migrate", "migrate_v1_to_v2", "migrate_v2_to_v3"]
