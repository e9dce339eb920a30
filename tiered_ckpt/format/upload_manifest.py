"""The upload manifest: the remote commit point of a save (SPEC §4). Pure: no I/O, no S3.

- ``<prefix>/step_XXXXXXXXXX.<save_id>/upload_manifest.json`` (schema 2; schema 1 at
  ``<prefix>/step_XXXXXXXXXX/`` is still read as ``run_id`` ``None``, ``attempt`` 1, ``etag``
  ``None``), written only after every shard is confirmed and re-checked (ETag and size of every
  object, sha256 of ``manifest.json``). A step without it does not exist for restore.
- Per rank: key, size, sha256, how it was confirmed, ``etag``; plus the local manifest's sha256 and
  ``created_at``, ``run_id``, ``attempt``. Content is deterministic: racing writers write identical
  bytes.
- ``key_layout`` (optional, absent: ``flat``, written only when not flat): every shard key must be
  exactly the key that layout gives its rank (:func:`~tiered_ckpt.layout.remote_shard_key`).
- :class:`LatestPointer`: ``<prefix>/latest``, the newest current committed save by
  ``(attempt, step)``.

Validation failures raise :class:`~tiered_ckpt.errors.ManifestError`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.lineage import MAX_ATTEMPTS, RUN_ID_RE
from tiered_ckpt.format.manifest import MAX_SHARD_BYTES
from tiered_ckpt.format.validate import check_keys, int_field, loads_json, str_field
from tiered_ckpt.layout import (
    KEY_LAYOUTS,
    MANIFEST_NAME,
    MAX_STEP,
    MAX_WORLD_SIZE,
    remote_save_key,
    remote_shard_key,
)

#: The upload manifest schema this code writes; 1 (keys without a save id) is still read.
UPLOAD_SCHEMA_VERSION = 2
_SAVE_ID = re.compile(r"^[0-9A-Za-z_-]{1,64}$")
_ETAG_MAX = 256
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

#: How a shard was confirmed remotely:
#: ``server-checksum`` - the server validated the SHA256 checksum we sent and reported the same
#: value
#:   back (S3, MinIO; a probe showed it rejects wrong checksums);
#: ``read-back`` - we downloaded the object and hashed it (servers that do not validate, e.g. moto).
CONFIRM_METHODS = ("server-checksum", "read-back")


@dataclass(frozen=True)
class RemoteShard:
    """One confirmed remote shard: ``key`` (full object key), ``size_bytes``, ``sha256`` (hex, equal
    to the local manifest's), ``confirmed_by`` (one of :data:`CONFIRM_METHODS`), ``etag`` (schema 2:
    the object's ETag as the commit re-checked it; ``None`` in schema 1)."""

    rank: int
    key: str
    size_bytes: int
    sha256: str
    confirmed_by: str
    etag: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {
            "rank": self.rank,
            "key": self.key,
            "size_bytes": self.size_bytes,
            "sha256": self.sha256,
            "confirmed_by": self.confirmed_by,
        }
        if self.etag is not None:
            d["etag"] = self.etag
        return d

    @classmethod
    def from_dict(cls, obj: Any, what: str = "shard") -> RemoteShard:
        check_keys(obj, what, {"rank", "key", "size_bytes", "sha256", "confirmed_by"}, {"etag"})
        rank = int_field(obj["rank"], f"{what}.rank", 0, MAX_WORLD_SIZE - 1)
        key = str_field(obj["key"], f"{what}.key")
        size = int_field(obj["size_bytes"], f"{what}.size_bytes", 8, MAX_SHARD_BYTES)
        sha = str_field(obj["sha256"], f"{what}.sha256", _HEX64)
        how = str_field(obj["confirmed_by"], f"{what}.confirmed_by")
        if how not in CONFIRM_METHODS:
            raise ManifestError(f"{what}.confirmed_by {how[:30]!r} is not one of {CONFIRM_METHODS}")
        etag = obj.get("etag")
        if etag is not None:
            etag = str_field(etag, f"{what}.etag")
            if not 0 < len(etag) <= _ETAG_MAX:
                raise ManifestError(f"{what}.etag has bad length {len(etag)}")
        return cls(rank, key, size, sha, how, etag)


@dataclass(frozen=True)
class UploadManifest:
    """Remote commit point of ``step``: every shard confirmed, and the local manifest mirrored.

    ``prefix``: the key prefix of the run in the bucket (no bucket name, so a bucket copied
    elsewhere still restores). ``manifest_sha256``: sha256 (hex) of the exact ``manifest.json``
    bytes uploaded. ``run_id``/``attempt``/``created_at`` (schema 2): copied from the local manifest
    (``None``/``1``/``""`` in schema 1). Object keys: :func:`~tiered_ckpt.layout.remote_save_key` of
    ``(step, save_id)`` in schema 2, of ``(step, None)`` in schema 1 (:attr:`key_save_id`); shard
    keys as ``key_layout`` gives them (:func:`~tiered_ckpt.layout.remote_shard_key`; ``hashed`` only
    in schema 2).
    """

    step: int
    world_size: int
    save_id: str
    prefix: str
    manifest_key: str
    manifest_sha256: str
    shards: tuple[RemoteShard, ...]
    run_id: str | None = None
    attempt: int = 1
    created_at: str = ""
    schema_version: int = UPLOAD_SCHEMA_VERSION
    key_layout: str = "flat"

    @property
    def key_save_id(self) -> str | None:
        """The save id in this save's object keys (``None``: a round-1, schema-1 step)."""
        return self.save_id if self.schema_version >= 2 else None

    def __post_init__(self) -> None:
        UploadManifest.from_dict(self.to_dict())

    @property
    def total_bytes(self) -> int:
        return sum(s.size_bytes for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return (
            {
                "schema_version": self.schema_version,
                "step": self.step,
                "world_size": self.world_size,
                "save_id": self.save_id,
                "prefix": self.prefix,
                "manifest_key": self.manifest_key,
                "manifest_sha256": self.manifest_sha256,
                "shards": [s.to_dict() for s in sorted(self.shards, key=lambda s: s.rank)],
            }
            | (
                {"run_id": self.run_id, "attempt": self.attempt, "created_at": self.created_at}
                if self.schema_version >= 2
                else {}
            )
            | ({"key_layout": self.key_layout} if self.key_layout != "flat" else {})
        )

    def to_json(self) -> str:
        """Deterministic bytes: sorted keys, shards in rank order, no timestamps."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> UploadManifest:
        return cls.from_dict(loads_json(text, "upload manifest"))

    @classmethod
    def from_dict(cls, obj: Any) -> UploadManifest:
        if not isinstance(obj, dict):
            raise ManifestError(f"upload manifest must be a JSON object, got {type(obj).__name__}")
        version = int_field(obj.get("schema_version"), "schema_version", 0, 2**31)
        if version not in (1, UPLOAD_SCHEMA_VERSION):
            raise ManifestError(
                f"upload manifest schema_version {version} is not supported "
                f"(this tiered_ckpt reads 1 and {UPLOAD_SCHEMA_VERSION}); upgrade tiered_ckpt"
            )
        lineage_keys = {"run_id", "attempt", "created_at"} if version >= 2 else set()
        check_keys(
            obj,
            "upload manifest",
            {
                "schema_version",
                "step",
                "world_size",
                "save_id",
                "prefix",
                "manifest_key",
                "manifest_sha256",
                "shards",
            }
            | lineage_keys,
            {"key_layout"} if version >= 2 else set(),
        )
        layout = str_field(obj.get("key_layout", "flat"), "key_layout")
        if layout not in KEY_LAYOUTS:
            raise ManifestError(
                f"key_layout {layout[:30]!r} is not one of {KEY_LAYOUTS}; upgrade tiered_ckpt"
            )
        run_id, attempt, created = None, 1, ""
        if version >= 2:
            run_id = (
                None if obj["run_id"] is None else str_field(obj["run_id"], "run_id", RUN_ID_RE)
            )
            attempt = int_field(obj["attempt"], "attempt", 1, MAX_ATTEMPTS)
            created = str_field(obj["created_at"], "created_at")
            if len(created) > 64:
                raise ManifestError("created_at is too long")
        step = int_field(obj["step"], "step", 0, MAX_STEP)
        ws = int_field(obj["world_size"], "world_size", 1, MAX_WORLD_SIZE)
        save_id = str_field(obj["save_id"], "save_id", _SAVE_ID)
        prefix = str_field(obj["prefix"], "prefix")
        key_sid = save_id if version >= 2 else None
        mkey = str_field(obj["manifest_key"], "manifest_key")
        if mkey != remote_save_key(prefix, step, key_sid, MANIFEST_NAME):
            raise ManifestError(
                f"manifest_key {mkey[:100]!r} is not the manifest of step {step} under {prefix!r}"
            )
        msha = str_field(obj["manifest_sha256"], "manifest_sha256", _HEX64)
        raw = obj["shards"]
        if not isinstance(raw, list) or len(raw) != ws:
            raise ManifestError(f"upload manifest must list exactly {ws} shards")
        shards = tuple(RemoteShard.from_dict(s, f"shards[{i}]") for i, s in enumerate(raw))
        if sorted(s.rank for s in shards) != list(range(ws)):
            raise ManifestError(
                f"upload manifest shards do not cover ranks 0..{ws - 1} exactly once"
            )
        for s in shards:
            if s.key != remote_shard_key(prefix, step, key_sid, s.rank, layout):
                raise ManifestError(
                    f"shard key {s.key[:100]!r} of rank {s.rank} is outside step {step} (not "
                    f"the key its {layout} key layout gives)"
                )
            if (s.etag is not None) != (version >= 2):
                raise ManifestError(
                    f"shard of rank {s.rank}: etag is required in schema 2 and unknown in 1"
                )
        m = object.__new__(cls)
        for k, v in dict(
            step=step,
            world_size=ws,
            save_id=save_id,
            prefix=prefix,
            manifest_key=mkey,
            manifest_sha256=msha,
            shards=tuple(sorted(shards, key=lambda s: s.rank)),
            run_id=run_id,
            attempt=attempt,
            created_at=created,
            schema_version=version,
            key_layout=layout,
        ).items():
            object.__setattr__(m, k, v)
        return m


@dataclass(frozen=True)
class LatestPointer:
    """Content of ``<prefix>/latest``: the newest current remotely committed save (``step``,
    ``attempt``, ``save_id``; ``save_id`` ``None`` for a round-1 step) and the sha256 of its upload
    manifest. Moved with conditional writes (``If-Match`` / ``If-None-Match``) and only to a greater
    :attr:`order` (SPEC §11): a live sidecar of an older attempt can no longer move it. A round-1
    pointer (``step`` and sha256 only) reads as attempt 1."""

    step: int
    upload_manifest_sha256: str
    attempt: int = 1
    save_id: str | None = None

    @property
    def order(self) -> tuple[int, int]:
        """``(attempt, step)``: the pointer's position in the run's history."""
        return (self.attempt, self.step)

    def to_json(self) -> str:
        d: dict[str, Any] = {
            "step": self.step,
            "upload_manifest_sha256": self.upload_manifest_sha256,
        }
        if self.save_id is not None:
            d.update(attempt=self.attempt, save_id=self.save_id)
        return json.dumps(d, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> LatestPointer:
        obj = check_keys(
            loads_json(text, "latest pointer"),
            "latest pointer",
            {"step", "upload_manifest_sha256"},
            {"attempt", "save_id"},
        )
        if ("attempt" in obj) != ("save_id" in obj):
            raise ManifestError("latest pointer: attempt and save_id go together")
        return cls(
            int_field(obj["step"], "step", 0, MAX_STEP),
            str_field(obj["upload_manifest_sha256"], "upload_manifest_sha256", _HEX64),
            int_field(obj.get("attempt", 1), "attempt", 1, MAX_ATTEMPTS),
            None if obj.get("save_id") is None else str_field(obj["save_id"], "save_id", _SAVE_ID),
        )


__all__ = [
    "UPLOAD_SCHEMA_VERSION",
    "CONFIRM_METHODS",
    "RemoteShard",
    "UploadManifest",
    "LatestPointer",
]
