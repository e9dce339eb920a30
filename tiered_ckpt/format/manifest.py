"""The step manifest (schema version 3): who owns what in a committed step (SPEC §2).

Pure: frozen dataclasses, JSON (de)serialisation, strict validation (stricter than
``schemas/manifest.v3.schema.json``: cross-field rules). No I/O, threads or S3.

- Per shard: ``rank``, ``path``, ``size_bytes``, ``sha256``, ``param_shard_offset/numel``, and the
  nullable checksums ``crc32c``, ``header_sha256``, ``crc32c_chunk_bytes`` (``null``: unknown, whole
  file sha256 is the fallback).
- Per step: lineage ``run_id`` (``null``: unknown) and ``attempt`` (>= 1).
- A record written now omits ``tensors`` (:attr:`ShardRecord.tensors` is ``None``) and gives
  ``header_size_bytes``: the tensor index is in the shard's header
  (:mod:`tiered_ckpt.format.tensor_index`), verified through ``header_sha256``. Records that list
  tensors are read and validated as before.
- Older versions are upgraded on read through :data:`MIGRATIONS`; optional keys extend version 3
  without a migration.

Every validation failure raises :class:`~tiered_ckpt.errors.ManifestError`, except a missing or
duplicate rank: :class:`~tiered_ckpt.errors.MissingShardError` (SPEC §2 failure table). History of
the versions: docs/design.md, "Manifest".
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from tiered_ckpt.errors import MissingShardError
from tiered_ckpt.format.lineage import MAX_ATTEMPTS, RUN_ID_RE
from tiered_ckpt.format.migration import (
    MIGRATIONS,
    SCHEMA_VERSION,
    migrate,
    migrate_v1_to_v2,
    migrate_v2_to_v3,
)
from tiered_ckpt.format.tensor_index import (
    DTYPE_SIZES,
    MAX_CRC_CHUNK_BYTES,
    MAX_HEADER_BYTES,
    MAX_NAME_LEN,
    MAX_SHARD_BYTES,
    MAX_TENSORS_PER_SHARD,
    MIN_CRC_CHUNK_BYTES,
    TensorRecord,
    check_global_slices,
    check_tensor_layout,
    numel,
)
from tiered_ckpt.format.validate import (
    MAX_NUMEL,
    check_keys,
    fail,
    int_field,
    loads_json,
    str_field,
)
from tiered_ckpt.layout import MAX_STEP, MAX_WORLD_SIZE, shard_file_name

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX8 = re.compile(r"^[0-9a-f]{8}$")
_SAVE_ID = re.compile(r"^[0-9A-Za-z_-]{1,64}$")
_HOST = re.compile(r"^[0-9A-Za-z_.-]{0,255}$")


@dataclass(frozen=True)
class ShardRecord:
    """One rank's shard of a step: file ``path`` (relative to the step directory), its ``sha256``
    (hex) and ``size_bytes``, the rank's ZeRO flat partition ``[param_shard_offset,
    +param_shard_numel)`` (elements of the flat parameter vector; ``0, 0`` when the rank holds
    none), the ``host`` that wrote it, the ``save_id`` of the save, and its tensors. Schema v2 adds
    ``crc32c`` (whole file, 8 hex digits), ``header_sha256`` (hex sha256 of the length prefix plus
    JSON header) and ``crc32c_chunk_bytes`` (chunk size of the tensors' ``crc32c`` lists): all three
    set, or all ``None`` (unknown, migrated from v1)."""

    rank: int
    path: str
    sha256: str
    size_bytes: int
    param_shard_offset: int = 0
    param_shard_numel: int = 0
    host: str = ""
    save_id: str = ""
    tensors: tuple[TensorRecord, ...] | None = ()
    crc32c: str | None = None
    header_sha256: str | None = None
    crc32c_chunk_bytes: int | None = None
    header_size_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "rank": self.rank,
            "path": self.path,
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "param_shard_offset": self.param_shard_offset,
            "param_shard_numel": self.param_shard_numel,
            "host": self.host,
            "save_id": self.save_id,
            "crc32c": self.crc32c,
            "header_sha256": self.header_sha256,
            "crc32c_chunk_bytes": self.crc32c_chunk_bytes,
        }
        if self.tensors is not None:
            d["tensors"] = [t.to_dict() for t in self.tensors]
        if self.header_size_bytes is not None:
            d["header_size_bytes"] = self.header_size_bytes
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, obj: Any, what: str = "shard") -> ShardRecord:
        fast = _fast_record(cls, obj)
        if fast is not None:
            return fast
        check_keys(
            obj,
            what,
            {
                "rank",
                "path",
                "sha256",
                "size_bytes",
                "param_shard_offset",
                "param_shard_numel",
                "crc32c",
                "header_sha256",
                "crc32c_chunk_bytes",
            },
            {"host", "save_id", "tensors", "header_size_bytes"},
        )
        rank = int_field(obj["rank"], f"{what}.rank", 0, MAX_WORLD_SIZE - 1)
        path = str_field(obj["path"], f"{what}.path")
        if path != shard_file_name(rank):
            # Only the canonical name is accepted: this rules out "../x", absolute paths, other
            # directories and files shared between ranks, before any file is opened.
            raise fail(
                f"{what}.path {path[:100]!r} is not the shard file of rank {rank} "
                f"({shard_file_name(rank)!r}); paths outside the step directory are refused"
            )
        sha = str_field(obj["sha256"], f"{what}.sha256", _HEX64)
        size = int_field(obj["size_bytes"], f"{what}.size_bytes", 8, MAX_SHARD_BYTES)
        off = int_field(obj["param_shard_offset"], f"{what}.param_shard_offset", 0, MAX_NUMEL)
        num = int_field(obj["param_shard_numel"], f"{what}.param_shard_numel", 0, MAX_NUMEL)
        host = str_field(obj.get("host", ""), f"{what}.host", _HOST)
        save_id = str_field(obj.get("save_id", ""), f"{what}.save_id", _SHARD_SAVE_ID)
        crc, hsha, chunk = obj["crc32c"], obj["header_sha256"], obj["crc32c_chunk_bytes"]
        if (crc is None) != (hsha is None) or (crc is None) != (chunk is None):
            raise fail(
                f"{what}: crc32c, header_sha256 and crc32c_chunk_bytes are all set or all null"
            )
        if crc is not None:
            crc = str_field(crc, f"{what}.crc32c", _HEX8)
            hsha = str_field(hsha, f"{what}.header_sha256", _HEX64)
            chunk = int_field(
                chunk, f"{what}.crc32c_chunk_bytes", MIN_CRC_CHUNK_BYTES, MAX_CRC_CHUNK_BYTES
            )
            if chunk & (chunk - 1):
                raise fail(f"{what}.crc32c_chunk_bytes = {chunk} is not a power of two")
        hsize = obj.get("header_size_bytes")
        if hsize is not None:
            hsize = int_field(
                hsize, f"{what}.header_size_bytes", 8, min(size, 8 + MAX_HEADER_BYTES)
            )
        if (
            "tensors" not in obj
        ):  # header format 2: the tensor index is in the shard's header, verified by its sha256
            if hsha is None:
                raise fail(
                    f"{what} lists no tensors and has no header_sha256 (its tensor index cannot be "
                    "verified)"
                )
            return cls(
                rank, path, sha, size, off, num, host, save_id, None, crc, hsha, chunk, hsize
            )
        tensors = _tensors_of(obj["tensors"], size, chunk, what)
        return cls(rank, path, sha, size, off, num, host, save_id, tensors, crc, hsha, chunk, hsize)

    @classmethod
    def from_json(cls, text: str | bytes) -> ShardRecord:
        return cls.from_dict(loads_json(text, "shard record"))


def _tensors_of(raw: Any, size: int, chunk: int | None, what: str) -> tuple[TensorRecord, ...]:
    """The ``tensors`` list of a shard record (schema v1-v3 as written before header format 2),
    validated."""
    if not isinstance(raw, list):
        raise fail(f"{what}.tensors must be a list")
    if len(raw) > MAX_TENSORS_PER_SHARD:
        raise fail(f"{what}.tensors has too many entries")
    tensors = tuple(TensorRecord.from_dict(t, f"{what}.tensors[{i}]") for i, t in enumerate(raw))
    check_tensor_layout(tensors, size, what)
    for i, t in enumerate(tensors):
        if chunk is None:
            if t.crc32c is not None:
                raise fail(f"{what}.tensors[{i}].crc32c is set but crc32c_chunk_bytes is null")
        elif t.crc32c is not None and len(t.crc32c) != -(-t.nbytes // chunk):
            raise fail(
                f"{what}.tensors[{i}].crc32c must list {-(-t.nbytes // chunk)} chunk checksum(s) "
                f"for {t.nbytes} bytes in chunks of {chunk}"
            )
    return tensors


_FAST_REQUIRED = frozenset(
    {
        "rank",
        "path",
        "sha256",
        "size_bytes",
        "param_shard_offset",
        "param_shard_numel",
        "crc32c",
        "header_sha256",
        "crc32c_chunk_bytes",
    }
)
_FAST_ALLOWED = _FAST_REQUIRED | {"host", "save_id", "header_size_bytes"}
_SHARD_SAVE_ID = re.compile(r"^[0-9A-Za-z_-]{0,64}$")


def _fast_record(cls: type[ShardRecord], obj: Any) -> ShardRecord | None:
    """The record of ``obj`` when it is plainly valid in the form this version writes (no
    ``tensors``, every checksum set), checked with the same rules as :meth:`ShardRecord.from_dict`
    but without building a message per field: a manifest of 512 ranks parses in milliseconds.
    ``None`` for anything else (the full validation then accepts it or says what is wrong)."""
    if type(obj) is not dict or not _FAST_REQUIRED <= obj.keys() or not obj.keys() <= _FAST_ALLOWED:
        return None
    rank, size, off, num = (
        obj["rank"],
        obj["size_bytes"],
        obj["param_shard_offset"],
        obj["param_shard_numel"],
    )
    chunk, hsize = obj["crc32c_chunk_bytes"], obj.get("header_size_bytes", 0)
    path, sha, crc, hsha = obj["path"], obj["sha256"], obj["crc32c"], obj["header_sha256"]
    host, save_id = obj.get("host", ""), obj.get("save_id", "")
    if not (
        type(rank) is int
        and type(size) is int
        and type(off) is int
        and type(num) is int
        and type(chunk) is int
        and type(hsize) is int
        and type(path) is str
        and type(sha) is str
        and type(crc) is str
        and type(hsha) is str
        and type(host) is str
        and type(save_id) is str
    ):
        return None
    if not (
        0 <= rank < MAX_WORLD_SIZE
        and 8 <= size <= MAX_SHARD_BYTES
        and 0 <= off <= MAX_NUMEL
        and 0 <= num <= MAX_NUMEL
        and MIN_CRC_CHUNK_BYTES <= chunk <= MAX_CRC_CHUNK_BYTES
        and not chunk & (chunk - 1)
        and path == shard_file_name(rank)
        and (
            hsize == 0
            and "header_size_bytes" not in obj
            or 8 <= hsize <= min(size, 8 + MAX_HEADER_BYTES)
        )
        and _HEX64.fullmatch(sha)
        and _HEX64.fullmatch(hsha)
        and _HEX8.fullmatch(crc)
        and _HOST.fullmatch(host)
        and _SHARD_SAVE_ID.fullmatch(save_id)
    ):
        return None
    rec = object.__new__(cls)
    rec.__dict__.update(
        rank=rank,
        path=path,
        sha256=sha,
        size_bytes=size,
        param_shard_offset=off,
        param_shard_numel=num,
        host=host,
        save_id=save_id,
        tensors=None,
        crc32c=crc,
        header_sha256=hsha,
        crc32c_chunk_bytes=chunk,
        header_size_bytes=hsize if "header_size_bytes" in obj else None,
    )
    return rec


@dataclass(frozen=True)
class ShardManifest:
    """The commit point of a step (``manifest.json``): one :class:`ShardRecord` per rank, in rank
    order.

    ``wall_clock_seconds``: the run's elapsed training time as the caller reports it (seconds).
    ``created_at``: UTC ISO-8601 time of the commit. ``extra``: caller JSON (step-level metadata).
    ``run_id``/``attempt`` (v3): the lineage the step was saved in (see
    :mod:`tiered_ckpt.format.lineage`).
    """

    world_size: int
    step: int
    shards: tuple[ShardRecord, ...]
    save_id: str
    wall_clock_seconds: float = 0.0
    created_at: str = ""
    extra: dict[str, Any] | None = None
    run_id: str | None = None
    attempt: int = 1
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        # Validate objects built in code exactly as those read from disk.
        ShardManifest.from_dict(self.to_dict())

    @property
    def total_bytes(self) -> int:
        return sum(s.size_bytes for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "world_size": self.world_size,
            "step": self.step,
            "save_id": self.save_id,
            "wall_clock_seconds": self.wall_clock_seconds,
            "created_at": self.created_at,
            "extra": self.extra,
            "run_id": self.run_id,
            "attempt": self.attempt,
            "shards": [s.to_dict() for s in self.shards],
        }

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, NaN/Infinity allowed in ``extra`` as Python's json writes
        them)."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, allow_nan=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> ShardManifest:
        """Parse and validate. Raises :class:`ManifestError` / :class:`MissingShardError`."""
        return cls.from_dict(loads_json(text, "manifest"))

    @classmethod
    def from_dict(cls, obj: Any) -> ShardManifest:
        if not isinstance(obj, dict):
            raise fail(f"manifest must be a JSON object, got {type(obj).__name__}")
        version = obj.get("schema_version")
        version = int_field(version, "schema_version", 0, 2**31)
        if version > SCHEMA_VERSION:
            raise fail(
                f"manifest schema_version {version} is newer than this tiered_ckpt "
                f"understands ({SCHEMA_VERSION}); upgrade tiered_ckpt to read it"
            )
        obj = migrate(obj, version)
        check_keys(
            obj,
            "manifest",
            {
                "schema_version",
                "world_size",
                "step",
                "save_id",
                "wall_clock_seconds",
                "created_at",
                "shards",
                "run_id",
                "attempt",
            },
            {"extra"},
        )
        run_id = obj["run_id"]
        run_id = None if run_id is None else str_field(run_id, "run_id", RUN_ID_RE)
        attempt = int_field(obj["attempt"], "attempt", 1, MAX_ATTEMPTS)
        ws = int_field(obj["world_size"], "world_size", 1, MAX_WORLD_SIZE)
        step = int_field(obj["step"], "step", 0, MAX_STEP)
        save_id = str_field(obj["save_id"], "save_id", _SAVE_ID)
        wcs = obj["wall_clock_seconds"]
        if (
            isinstance(wcs, bool)
            or not isinstance(wcs, (int, float))
            or not math.isfinite(wcs)
            or wcs < 0
        ):
            raise fail("wall_clock_seconds must be a finite number >= 0")
        created = str_field(obj["created_at"], "created_at")
        if len(created) > 64:
            raise fail("created_at is too long")
        extra = obj.get("extra")
        if extra is not None and not isinstance(extra, dict):
            raise fail("extra must be a JSON object or null")
        raw = obj["shards"]
        if not isinstance(raw, list):
            raise fail("shards must be a list")
        if len(raw) > MAX_WORLD_SIZE:
            raise fail("shards has too many entries")
        shards = [ShardRecord.from_dict(s, f"shards[{i}]") for i, s in enumerate(raw)]
        ranks = [s.rank for s in shards]
        dup = (
            sorted({r for r in ranks if ranks.count(r) > 1})
            if len(set(ranks)) != len(ranks)
            else []
        )
        if dup:
            raise MissingShardError(
                f"step {step}: rank(s) {dup[:8]} listed more than once in shards"
            )
        missing = sorted(set(range(ws)) - set(ranks))
        if missing:
            raise MissingShardError(
                f"step {step}: world_size is {ws} but shards lacks rank(s) {missing[:8]}"
            )
        if len(shards) != ws:
            extra_ranks = sorted(set(ranks) - set(range(ws)))
            raise fail(
                f"step {step}: shards lists rank(s) {extra_ranks[:8]} beyond world_size {ws}"
            )
        shards.sort(key=lambda s: s.rank)
        for s in shards:
            if s.save_id and s.save_id != save_id:
                raise fail(
                    f"step {step}: shard of rank {s.rank} belongs to save {s.save_id!r}, "
                    f"the manifest to {save_id!r} (mixed checkpoint)"
                )
        _check_partitions(shards, step)
        m = object.__new__(cls)
        for k, v in dict(
            world_size=ws,
            step=step,
            shards=tuple(shards),
            save_id=save_id,
            wall_clock_seconds=float(wcs),
            created_at=created,
            extra=extra,
            run_id=run_id,
            attempt=attempt,
            schema_version=SCHEMA_VERSION,
        ).items():
            object.__setattr__(m, k, v)
        return m


def _check_partitions(shards: list[ShardRecord], step: int) -> None:
    """ZeRO flat partitions must not overlap; slices of one global tensor must agree on its global
    shape and dtype and must not overlap."""
    spans = sorted(
        (s.param_shard_offset, s.param_shard_offset + s.param_shard_numel, s.rank)
        for s in shards
        if s.param_shard_numel > 0
    )
    for (b0, e0, r0), (b1, e1, r1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise fail(
                f"step {step}: param shards of ranks {r0} [{b0}, {e0}) and {r1} [{b1}, {e1}) overlap"
            )
    check_global_slices(step, ((s.rank, s.tensors) for s in shards if s.tensors is not None))


__all__ = [
    "SCHEMA_VERSION",
    "DTYPE_SIZES",
    "MAX_NAME_LEN",
    "MAX_SHARD_BYTES",
    "TensorRecord",
    "ShardRecord",
    "ShardManifest",
    "migrate",
    "MIGRATIONS",
    "migrate_v1_to_v2",
    "migrate_v2_to_v3",
    "numel",
    "check_global_slices",
]
