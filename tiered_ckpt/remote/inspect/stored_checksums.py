"""``verify --remote --fast``: each shard object of a committed save checked by the checksum the
server stores for it (``HeadObject`` with ``ChecksumMode=ENABLED``), against the one the save
recorded, without downloading any shard.

What the server stores is what the writer sent (S3, SeaweedFS and moto 5.2.1 alike): our uploader
sends one ``PutObject`` with ``ChecksumSHA256`` (a shard below the multipart threshold) or a
multipart upload with a ``ChecksumCRC32C`` per part, whose object then carries the composite
``base64(crc32c(c1..cn))-n`` (moto reports it without the ``-n``; see
:mod:`tiered_ckpt.store.checksums`). The expected values, with no schema change and no byte of the
shard read:

* a full-object ``ChecksumSHA256``: the upload manifest's sha256 of the shard;
* a full-object ``ChecksumCRC32C`` (a re-PUT with CRC32C, a ``FULL_OBJECT`` multipart upload): the
  mirrored ``manifest.json``'s whole-file ``crc32c`` (schema 2 and later);
* a composite (``-n``) value: the one the sidecar sent and recorded in the shard's confirmation
  record (``<save>/.confirm/rank_XXXXX.json``,
  :class:`~tiered_ckpt.format.records.ConfirmationRecord`: the algorithm and the composite value),
  read (one small GET) only when the direct comparison does not match. Its sha256 and size must be
  the upload manifest's, else it is not used.

Verdict per shard (:class:`ShardCheck`): a stored checksum that equals the expected one -> checked
by ``crc32c`` or ``server-sha256``; one that differs -> a fault (the object was replaced or
re-uploaded since the commit: another object, or a wrong part). No comparable checksum (none stored,
or a composite of another part layout or without a record) -> checked by size only, unless the
object's ETag differs from the one the commit recorded (schema 2): then it is another object than
the one committed, a fault too. What this never catches: bytes rotting at rest on the server (its
stored checksum is the one computed at write time); only the full verify, which downloads and hashes
every byte, does.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.records import ConfirmationRecord
from tiered_ckpt.local.held_ranks import format_ranks
from tiered_ckpt.remote.catalogue import RemoteSave
from tiered_ckpt.remote.handle import get_or_none, object_url
from tiered_ckpt.remote.limits import MAX_CONFIRMATION_BYTES
from tiered_ckpt.remote.restore.plan import PLAN_HEAD_CONCURRENCY, RestorePlan
from tiered_ckpt.remote.upload.commit import confirm_key
from tiered_ckpt.store.base import ObjectInfo, ObjectStore
from tiered_ckpt.store.checksums import checksums_match, split_checksum

#: What a check compared, weakest first: sizes only; the server's stored CRC32C; the server's stored
#: SHA-256 (objects sent in one PUT); every byte downloaded and hashed (the full verify).
CHECKED_LEVELS = ("size", "crc32c", "server-sha256", "sha256")
#: Why a shard was checked by size only when the server reports no checksum for it.
NO_STORED_CHECKSUMS = "the server stores no CRC32C or SHA-256 checksum"

_LABEL = {"CRC32C": "crc32c", "SHA256": "server-sha256"}
_MULTIPART_ETAG = re.compile(r'-\d+"?$')
_MATCH, _MISMATCH, _UNKNOWN = "match", "mismatch", "unknown"


@dataclass(frozen=True)
class ShardCheck:
    """One shard object's fast check. ``checked``: one of :data:`CHECKED_LEVELS` (not ``sha256``);
    ``fault``: one line when the object is not the one committed (``""``: it is, as far as checked);
    ``missing``: no object at the key; ``why``: with ``checked == "size"``, why no checksum was
    compared."""

    rank: int
    checked: str = "size"
    fault: str = ""
    missing: bool = False
    why: str = ""


def _compare(
    alg: str,
    value: str,
    full: str | None,
    multipart: bool,
    record: Callable[[], ConfirmationRecord | None],
) -> tuple[str, str]:
    """``(verdict, detail)`` of one stored checksum: ``detail`` is the expected value of a mismatch,
    the reason of an ``unknown``."""
    parts = split_checksum(value)[1]
    if (
        parts is None and full is not None
    ):  # a full-object value, or a composite one without its -n (moto)
        if value == full:
            return _MATCH, ""
        if not multipart:
            return _MISMATCH, full
    rec = record()
    if rec is not None and rec.checksum_algorithm == alg and rec.checksum:
        if checksums_match(value, rec.checksum):
            return _MATCH, ""
        sent_parts = split_checksum(rec.checksum)[1]
        if parts is not None and sent_parts is not None and parts != sent_parts:
            return _UNKNOWN, (
                f"its {alg} is of {parts} parts, the upload sent {sent_parts}: no recorded part "
                "checksums to compare"
            )
        return _MISMATCH, rec.checksum
    return (
        _UNKNOWN,
        f"no recorded part checksums for its {'multipart ' if parts is None else f'{parts}-part '}{alg}",
    )


def judge(
    rank: int,
    info: ObjectInfo,
    *,
    what: str,
    sha256_hex: str,
    crc32c_hex: str | None,
    recorded_etag: str | None,
    record: Callable[[], ConfirmationRecord | None],
) -> ShardCheck:
    """The verdict of the module docstring for the object ``info`` of ``rank`` (``what``: its URL,
    for messages). ``sha256_hex`` / ``crc32c_hex``: the save's whole-file digests of the shard
    (``crc32c_hex`` ``None`` when its manifest has none); ``recorded_etag``: the upload manifest's
    (``None``: schema 1); ``record()``: the shard's confirmation record, or ``None`` (called at most
    when needed). Pure apart from ``record``."""
    full = {
        "SHA256": base64.b64encode(bytes.fromhex(sha256_hex)).decode("ascii"),
        "CRC32C": (
            base64.b64encode(bytes.fromhex(crc32c_hex)).decode("ascii")
            if crc32c_hex is not None
            else None
        ),
    }
    multipart = bool(_MULTIPART_ETAG.search(info.etag))
    unknown: list[str] = []
    for alg, value in (("CRC32C", info.checksum_crc32c), ("SHA256", info.checksum_sha256)):
        if not value:
            continue
        verdict, detail = _compare(alg, value, full[alg], multipart, record)
        if verdict == _MATCH:
            return ShardCheck(rank, _LABEL[alg])
        if verdict == _MISMATCH:
            return ShardCheck(
                rank,
                _LABEL[alg],
                fault=f"{what} has stored {alg} {value}, the save recorded "
                f"{detail}: replaced or re-uploaded since the commit",
            )
        unknown.append(detail)
    why = "; ".join(unknown) or NO_STORED_CHECKSUMS
    if recorded_etag is not None and info.etag != recorded_etag:
        return ShardCheck(
            rank,
            fault=f"{what} was replaced since the commit (ETag {info.etag}, recorded "
            f"{recorded_etag}) and {why}: verify without --fast reads its bytes",
        )
    return ShardCheck(rank, why=why)


def _record_reader(
    store: ObjectStore, save: RemoteSave, rank: int
) -> Callable[[], ConfirmationRecord | None]:
    """``rank``'s confirmation record, read once on first call; ``None`` when absent, unreadable, or
    not for the bytes the upload manifest lists. Raises ``UploadError`` (bucket unreachable)."""
    shard = save.um.shards[rank]
    got: list[ConfirmationRecord | None] = []

    def read() -> ConfirmationRecord | None:
        if not got:
            rec = None
            try:
                raw = get_or_none(
                    store,
                    confirm_key(save.step, rank, save.key_save_id),
                    max_bytes=MAX_CONFIRMATION_BYTES,
                )
                rec = ConfirmationRecord.from_json(raw) if raw is not None else None
            except ManifestError:
                rec = None
            if rec is not None and not rec.confirms(
                sha256=shard.sha256, size_bytes=shard.size_bytes, save_id=save.save_id
            ):
                rec = None
            got.append(rec)
        return got[0]

    return read


def check_stored_checksums(
    store: ObjectStore, save: RemoteSave, plan: RestorePlan
) -> list[ShardCheck]:
    """:class:`ShardCheck` of every object of ``plan`` (a plan of ``save``), in rank order: one HEAD
    each (in parallel), and a GET of the confirmation record where the direct comparison does not
    match. Raises ``UploadError`` (after the store's retries)."""

    def check(rank: int, key: str) -> ShardCheck:
        what = f"step {save.step} rank {rank}: {object_url(store, key)}"
        info = store.head(key)
        rec = plan.manifest.shards[rank]
        if info is None:
            return ShardCheck(
                rank, missing=True, fault=f"{what} is missing (the upload manifest lists it)"
            )
        if info.size_bytes != rec.size_bytes:
            return ShardCheck(
                rank, fault=f"{what} is {info.size_bytes} bytes, the manifest says {rec.size_bytes}"
            )
        return judge(
            rank,
            info,
            what=what,
            sha256_hex=rec.sha256,
            crc32c_hex=rec.crc32c,
            recorded_etag=save.um.shards[rank].etag,
            record=_record_reader(store, save, rank),
        )

    objects = plan.objects
    with ThreadPoolExecutor(
        max_workers=max(1, min(PLAN_HEAD_CONCURRENCY, len(objects))),
        thread_name_prefix="tiered-ckpt-fast-verify",
    ) as pool:
        return list(pool.map(lambda o: check(o.rank, o.key), objects))


def summarize(checks: list[ShardCheck]) -> tuple[str, str]:
    """``(checked, note)`` of a save whose every check passed: the weakest :data:`CHECKED_LEVELS` of
    its shards, and, when some were checked by size only, ``"size only: WHY"`` (all of them) or
    ``"size only for ranks R: WHY"`` (``""`` otherwise)."""
    if not checks:
        return "size", ""
    checked = min((c.checked for c in checks), key=CHECKED_LEVELS.index)
    sized = [c for c in checks if c.checked == "size"]
    if not sized:
        return checked, ""
    why = "; ".join(dict.fromkeys(c.why for c in sized))
    if len(sized) == len(checks):
        return checked, f"size only: {why}"
    return checked, f"size only for ranks {format_ranks(c.rank for c in sized)}: {why}"


__all__ = [
    "CHECKED_LEVELS",
    "NO_STORED_CHECKSUMS",
    "ShardCheck",
    "check_stored_checksums",
    "judge",
    "summarize",
]
