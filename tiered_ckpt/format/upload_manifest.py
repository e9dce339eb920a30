"""The upload manifest: the remote commit point of a step (SPEC §4). Pure: no I/O, no S3.

``<prefix>/step_XXXXXXXXXX/upload_manifest.json`` is written only after every shard of the step is
confirmed remotely. It lists, per rank, the remote key, size, sha256 and how the shard was confirmed,
plus the sha256 of the local ``manifest.json`` it mirrors (uploaded next to it). Its content is
deterministic (no per-writer timestamps or host names), so two sidecars that race to write it produce
identical bytes. A step without it does not exist for restore.

``<prefix>/latest`` (see :class:`LatestPointer`) names the newest remotely committed step.

Validation failures raise :class:`~tiered_ckpt.errors.ManifestError`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.layout import MANIFEST_NAME, MAX_STEP, MAX_WORLD_SIZE, remote_key, shard_file_name
from tiered_ckpt.format.manifest import MAX_SHARD_BYTES
from tiered_ckpt.format.validate import check_keys, int_field, loads_json, str_field

UPLOAD_SCHEMA_VERSION = 1
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

#: How a shard was confirmed remotely:
#: ``server-checksum`` - the server validated the SHA256 checksum we sent and reported the same value
#:   back (S3, MinIO; a probe showed it rejects wrong checksums);
#: ``read-back`` - we downloaded the object and hashed it (servers that do not validate, e.g. moto).
CONFIRM_METHODS = ("server-checksum", "read-back")


@dataclass(frozen=True)
class RemoteShard:
    """One confirmed remote shard: ``key`` (full object key), ``size_bytes``, ``sha256`` (hex, equal to
    the local manifest's), ``confirmed_by`` (one of :data:`CONFIRM_METHODS`)."""

    rank: int
    key: str
    size_bytes: int
    sha256: str
    confirmed_by: str

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "key": self.key, "size_bytes": self.size_bytes, "sha256": self.sha256,
                "confirmed_by": self.confirmed_by}

    @classmethod
    def from_dict(cls, obj: Any, what: str = "shard") -> RemoteShard:
        check_keys(obj, what, {"rank", "key", "size_bytes", "sha256", "confirmed_by"})
        rank = int_field(obj["rank"], f"{what}.rank", 0, MAX_WORLD_SIZE - 1)
        key = str_field(obj["key"], f"{what}.key")
        size = int_field(obj["size_bytes"], f"{what}.size_bytes", 8, MAX_SHARD_BYTES)
        sha = str_field(obj["sha256"], f"{what}.sha256", _HEX64)
        how = str_field(obj["confirmed_by"], f"{what}.confirmed_by")
        if how not in CONFIRM_METHODS:
            raise ManifestError(f"{what}.confirmed_by {how[:30]!r} is not one of {CONFIRM_METHODS}")
        return cls(rank, key, size, sha, how)


@dataclass(frozen=True)
class UploadManifest:
    """Remote commit point of ``step``: every shard confirmed, and the local manifest mirrored.

    ``prefix``: the key prefix of the run in the bucket (no bucket name, so a bucket copied elsewhere
    still restores). ``manifest_sha256``: sha256 (hex) of the exact ``manifest.json`` bytes uploaded.
    """

    step: int
    world_size: int
    save_id: str
    prefix: str
    manifest_key: str
    manifest_sha256: str
    shards: tuple[RemoteShard, ...]
    schema_version: int = UPLOAD_SCHEMA_VERSION

    def __post_init__(self) -> None:
        UploadManifest.from_dict(self.to_dict())

    @property
    def total_bytes(self) -> int:
        return sum(s.size_bytes for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "step": self.step,
            "world_size": self.world_size,
            "save_id": self.save_id,
            "prefix": self.prefix,
            "manifest_key": self.manifest_key,
            "manifest_sha256": self.manifest_sha256,
            "shards": [s.to_dict() for s in sorted(self.shards, key=lambda s: s.rank)],
        }

    def to_json(self) -> str:
        """Deterministic bytes: sorted keys, shards in rank order, no timestamps."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> UploadManifest:
        return cls.from_dict(loads_json(text, "upload manifest"))

    @classmethod
    def from_dict(cls, obj: Any) -> UploadManifest:
        check_keys(obj, "upload manifest", {"schema_version", "step", "world_size", "save_id", "prefix",
                                       "manifest_key", "manifest_sha256", "shards"})
        version = int_field(obj["schema_version"], "schema_version", 0, 2**31)
        if version != UPLOAD_SCHEMA_VERSION:
            raise ManifestError(f"upload manifest schema_version {version} is not supported "
                                f"(this tiered_ckpt reads {UPLOAD_SCHEMA_VERSION})")
        step = int_field(obj["step"], "step", 0, MAX_STEP)
        ws = int_field(obj["world_size"], "world_size", 1, MAX_WORLD_SIZE)
        save_id = str_field(obj["save_id"], "save_id", re.compile(r"^[0-9A-Za-z_-]{1,64}$"))
        prefix = str_field(obj["prefix"], "prefix")
        mkey = str_field(obj["manifest_key"], "manifest_key")
        if mkey != remote_key(prefix, step, MANIFEST_NAME):
            raise ManifestError(f"manifest_key {mkey[:100]!r} is not the manifest of step {step} under "
                                f"{prefix!r}")
        msha = str_field(obj["manifest_sha256"], "manifest_sha256", _HEX64)
        raw = obj["shards"]
        if not isinstance(raw, list) or len(raw) != ws:
            raise ManifestError(f"upload manifest must list exactly {ws} shards")
        shards = tuple(RemoteShard.from_dict(s, f"shards[{i}]") for i, s in enumerate(raw))
        if sorted(s.rank for s in shards) != list(range(ws)):
            raise ManifestError(f"upload manifest shards do not cover ranks 0..{ws - 1} exactly once")
        for s in shards:
            if s.key != remote_key(prefix, step, shard_file_name(s.rank)):
                raise ManifestError(f"shard key {s.key[:100]!r} of rank {s.rank} is outside step {step}")
        m = object.__new__(cls)
        for k, v in dict(step=step, world_size=ws, save_id=save_id, prefix=prefix, manifest_key=mkey,
                         manifest_sha256=msha, shards=tuple(sorted(shards, key=lambda s: s.rank)),
                         schema_version=version).items():
            object.__setattr__(m, k, v)
        return m


@dataclass(frozen=True)
class LatestPointer:
    """Content of ``<prefix>/latest``: the newest remotely committed ``step`` and the sha256 of its
    upload manifest. Moved forward only, with conditional writes (``If-Match`` / ``If-None-Match``)."""

    step: int
    upload_manifest_sha256: str

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "upload_manifest_sha256": self.upload_manifest_sha256},
                          sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> LatestPointer:
        obj = check_keys(loads_json(text, "latest pointer"), "latest pointer", {"step", "upload_manifest_sha256"})
        return cls(int_field(obj["step"], "step", 0, MAX_STEP),
                   str_field(obj["upload_manifest_sha256"], "upload_manifest_sha256", _HEX64))


__all__ = ["UPLOAD_SCHEMA_VERSION", "CONFIRM_METHODS", "RemoteShard", "UploadManifest", "LatestPointer"]
