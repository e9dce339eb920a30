"""The two small JSON records of the upload tier (SPEC §4). Pure: no I/O.

- :class:`ConfirmationRecord`: ``<prefix>/step_XXXXXXXXXX.<save_id>/.confirm/rank_XXXXX.json``, PUT
  by the sidecar that sent and confirmed one shard, read (GET, never LIST) by
  :mod:`tiered_ckpt.remote.upload.commit` before it writes the upload manifest. Bytes:
  ``json.dumps(sort_keys=True)`` plus a newline.
- :class:`UploadedMarker`: ``<step_dir>/uploaded.json``: the step is in the bucket named by
  ``remote`` (uploaded, restored from it, or released unsent by ``skip_intermediate``); written and
  read by :mod:`tiered_ckpt.local.markers`. Bytes: ``json.dumps(indent=1, sort_keys=True)`` plus a
  newline, optional fields omitted when unset.

Both byte formats are frozen (existing buckets and roots stay readable); readers ignore unknown
keys. Validation failures raise :class:`~tiered_ckpt.errors.ManifestError`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.manifest import MAX_SHARD_BYTES
from tiered_ckpt.format.upload_manifest import CONFIRM_METHODS
from tiered_ckpt.format.validate import check_keys, int_field, loads_json, str_field
from tiered_ckpt.layout import MAX_STEP, MAX_WORLD_SIZE

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SAVE_ID = re.compile(r"^[0-9A-Za-z_-]{1,64}$")
_CONFIRM_KEYS = {"rank", "key", "size_bytes", "sha256", "confirmed_by", "save_id"}
#: Absent from records written before per-part checksums (and, before schema 3, ETags) were
#: recorded; read as ``None``.
_CONFIRM_OPTIONAL = {"checksum_algorithm", "checksum", "etag"}


def _opt_str(v: Any, what: str) -> str | None:
    return None if v is None else str_field(v, what)


@dataclass(frozen=True)
class ConfirmationRecord:
    """One shard confirmed remotely by the sidecar that sent it.

    ``key``: the full object key (prefix included). ``size_bytes`` and ``sha256`` (hex): of the
    bytes read for sending, equal to the local manifest's record. ``confirmed_by``: one of
    :data:`~tiered_ckpt.format.upload_manifest.CONFIRM_METHODS`. ``checksum_algorithm`` /
    ``checksum``: the S3 additional checksum sent (``"SHA256"`` for a single PUT, ``"CRC32C"``
    composite ``...-N`` for a multipart upload; see :mod:`tiered_ckpt.remote.upload.transfer`).
    ``save_id``: the save the shard belongs to. ``etag``: the object's ETag when it was confirmed
    (the commit re-checks it; ``None`` in older records).
    """

    rank: int
    key: str
    size_bytes: int
    sha256: str
    confirmed_by: str
    checksum_algorithm: str | None
    checksum: str | None
    save_id: str
    etag: str | None = None

    def __post_init__(self) -> None:
        ConfirmationRecord.from_dict(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "key": self.key,
            "size_bytes": self.size_bytes,
            "sha256": self.sha256,
            "confirmed_by": self.confirmed_by,
            "checksum_algorithm": self.checksum_algorithm,
            "checksum": self.checksum,
            "save_id": self.save_id,
        } | ({"etag": self.etag} if self.etag is not None else {})

    def to_json(self) -> str:
        """The record's bytes as PUT (sorted keys, one line, trailing newline)."""
        return json.dumps(self.to_dict(), sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> ConfirmationRecord:
        return cls.from_dict(loads_json(text, "confirmation record"))

    @classmethod
    def from_dict(cls, obj: Any) -> ConfirmationRecord:
        what = "confirmation record"
        check_keys(obj, what, _CONFIRM_KEYS, _CONFIRM_OPTIONAL, ignore_unknown=True)
        how = str_field(obj["confirmed_by"], f"{what}.confirmed_by")
        if how not in CONFIRM_METHODS:
            raise ManifestError(f"{what}.confirmed_by {how[:30]!r} is not one of {CONFIRM_METHODS}")
        rec = object.__new__(cls)
        for k, v in dict(
            rank=int_field(obj["rank"], f"{what}.rank", 0, MAX_WORLD_SIZE - 1),
            key=str_field(obj["key"], f"{what}.key"),
            size_bytes=int_field(obj["size_bytes"], f"{what}.size_bytes", 0, MAX_SHARD_BYTES),
            sha256=str_field(obj["sha256"], f"{what}.sha256", _HEX64),
            confirmed_by=how,
            checksum_algorithm=_opt_str(
                obj.get("checksum_algorithm"), f"{what}.checksum_algorithm"
            ),
            checksum=_opt_str(obj.get("checksum"), f"{what}.checksum"),
            save_id=str_field(obj["save_id"], f"{what}.save_id", _SAVE_ID),
            etag=_opt_str(obj.get("etag"), f"{what}.etag"),
        ).items():
            object.__setattr__(rec, k, v)
        return rec

    def confirms(self, *, sha256: str, size_bytes: int, save_id: str) -> bool:
        """Whether this record confirms the shard of the local manifest with these values."""
        return (self.sha256, self.size_bytes, self.save_id) == (sha256, size_bytes, save_id)


@dataclass(frozen=True)
class UploadedMarker:
    """``uploaded.json``: the step is in the bucket ``remote`` (``s3://bucket/prefix``).

    ``upload_manifest_sha256``: sha256 (hex) of the step's upload manifest (absent on a skip
    marker). ``skipped``: released unsent (``UploadPolicy.skip_intermediate``). ``restored``:
    written by restore. ``manifest_sha256`` (SPEC §11): sha256 (hex) of the local ``manifest.json``
    the marker was written for; the marker counts only while it matches (a step re-saved with
    ``replace=True`` is uploaded again). ``None`` in markers of earlier releases (then it counts as
    before).
    """

    step: int
    remote: str
    upload_manifest_sha256: str | None = None
    skipped: bool = False
    restored: bool = False
    manifest_sha256: str | None = None

    def __post_init__(self) -> None:
        UploadedMarker.from_dict(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.step, "remote": self.remote}
        if self.upload_manifest_sha256 is not None:
            d["upload_manifest_sha256"] = self.upload_manifest_sha256
        if self.manifest_sha256 is not None:
            d["manifest_sha256"] = self.manifest_sha256
        if self.skipped:
            d["skipped"] = True
        if self.restored:
            d["restored"] = True
        return d

    def to_json(self) -> str:
        """The marker's bytes (indented, sorted keys, trailing newline), as earlier releases wrote
        them."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> UploadedMarker:
        return cls.from_dict(loads_json(text, "uploaded marker"))

    @classmethod
    def from_dict(cls, obj: Any) -> UploadedMarker:
        what = "uploaded marker"
        check_keys(
            obj,
            what,
            {"step", "remote"},
            {"upload_manifest_sha256", "skipped", "restored", "manifest_sha256"},
            ignore_unknown=True,
        )
        sha = obj.get("upload_manifest_sha256")
        msha = obj.get("manifest_sha256")
        flags = {}
        for name in ("skipped", "restored"):
            v = obj.get(name, False)
            if not isinstance(v, bool):
                raise ManifestError(f"{what}.{name} must be true or false, got {type(v).__name__}")
            flags[name] = v
        m = object.__new__(cls)
        for k, v in dict(
            step=int_field(obj["step"], f"{what}.step", 0, MAX_STEP),
            remote=str_field(obj["remote"], f"{what}.remote"),
            upload_manifest_sha256=None
            if sha is None
            else str_field(sha, f"{what}.upload_manifest_sha256", _HEX64),
            manifest_sha256=None
            if msha is None
            else str_field(msha, f"{what}.manifest_sha256", _HEX64),
            **flags,
        ).items():
            object.__setattr__(m, k, v)
        return m

    def matches_manifest(self, manifest_sha256: str) -> bool:
        """Whether the marker was written for the local manifest with this sha256 (a marker of an
        earlier release, without ``manifest_sha256``, matches any)."""
        return self.manifest_sha256 is None or self.manifest_sha256 == manifest_sha256

    def names_remote(self, remote_url: str) -> bool:
        """Whether the marker was written for ``remote_url`` (trailing ``/`` ignored)."""
        return self.remote.rstrip("/") == remote_url.rstrip("/")


__all__ = ["ConfirmationRecord", "UploadedMarker"]
