"""Restore planning (SPEC §5): which remotely committed step to restore and what to fetch for it.

Lifecycle steps 1-2 of :mod:`tiered_ckpt.remote.restore` (nothing local is touched; ``--dry-run`` and
``tiered-ckpt verify --remote`` stop here):

1. **Candidates** (:func:`~tiered_ckpt.remote.catalogue.committed_step_candidates`): the ``latest``
   pointer's step plus those whose upload manifest LIST shows, newest first (or the requested ``step``,
   then, with ``fallback``, the older candidates). A candidate counts only once GET reads its upload
   manifest.
2. **Plan** (:func:`plan_step`): GET the upload manifest and the mirrored ``manifest.json``; check the
   latter's sha256 against ``manifest_sha256`` and that both agree rank by rank; HEAD every shard to fetch
   and compare its size.

Fallback order (:func:`iter_plans`): a step whose planning fails with one of :data:`STEP_FAULTS` is
skipped with a warning when ``fallback=True`` (and recorded in ``RestorePlan.skipped``), otherwise raised.
``UploadError`` (bucket unreachable) is never a fallback: it would fail older steps the same way.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from tiered_ckpt.errors import ManifestError, MissingShardError, NoCheckpointError, ShardCorruptedError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.upload_manifest import UploadManifest
from tiered_ckpt.layout import MANIFEST_NAME, UPLOAD_MANIFEST_NAME, shard_file_name
from tiered_ckpt.remote.catalogue import committed_step_candidates, get_or_none, read_upload_manifest, step_key
from tiered_ckpt.remote.handle import StoreHandle, object_url
from tiered_ckpt.store.base import ObjectStore

log = logging.getLogger(__name__)

#: Errors of one candidate step that ``fallback=True`` skips (an unreachable bucket is not one of them).
STEP_FAULTS = (MissingShardError, ShardCorruptedError, ManifestError)


@dataclass(frozen=True)
class RemoteObject:
    """One object a restore fetches: ``key`` relative to the store prefix, size confirmed by HEAD."""

    rank: int
    key: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True)
class RestorePlan:
    """What a restore will fetch (the result of steps 1-2 of the lifecycle; ``--dry-run`` prints it).

    ``skipped``: ``(step, reason)`` of newer candidates passed over (with ``fallback=True``).
    """

    remote_url: str
    step: int
    ranks: tuple[int, ...]
    upload_manifest: UploadManifest
    manifest: ShardManifest
    manifest_bytes: bytes = field(repr=False)
    objects: tuple[RemoteObject, ...]
    from_pointer: bool
    upload_manifest_sha256: str
    skipped: tuple[tuple[int, str], ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(o.size_bytes for o in self.objects)

    def to_dict(self) -> dict[str, Any]:
        return {"remote_url": self.remote_url, "step": self.step, "ranks": list(self.ranks),
                "world_size": self.manifest.world_size, "save_id": self.manifest.save_id,
                "total_bytes": self.total_bytes, "from_pointer": self.from_pointer,
                "upload_manifest_sha256": self.upload_manifest_sha256,
                "objects": [{"rank": o.rank, "key": o.key, "size_bytes": o.size_bytes, "sha256": o.sha256}
                            for o in self.objects],
                "skipped": [{"step": s, "reason": r} for s, r in self.skipped]}


def check_ranks(ranks: Iterable[int] | None, world_size: int, step: int) -> tuple[int, ...]:
    """``ranks`` sorted and de-duplicated (``None``: all of ``world_size``). Raises ``ValueError``."""
    if ranks is None:
        return tuple(range(world_size))
    out = tuple(sorted(set(int(r) for r in ranks)))
    if not out:
        raise ValueError("ranks is empty")
    bad = [r for r in out if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"ranks {bad} are outside step {step}'s world_size {world_size}")
    return out


def _read_mirrored_manifest(store: ObjectStore, step: int, um: UploadManifest) -> tuple[ShardManifest, bytes]:
    """GET ``manifest.json`` and check it against the upload manifest (sha256, step, save, per rank)."""
    mkey = step_key(step, MANIFEST_NAME)
    raw = get_or_none(store, mkey)
    if raw is None:
        raise MissingShardError(f"step {step}: {object_url(store, mkey)} is missing (the upload manifest "
                                "mirrors it)")
    sha = hashlib.sha256(raw).hexdigest()
    if sha != um.manifest_sha256:
        raise ShardCorruptedError(f"step {step}: {object_url(store, mkey)} has sha256 {sha[:16]}..., the upload "
                                  f"manifest says {um.manifest_sha256[:16]}...")
    try:
        m = ShardManifest.from_json(raw)
    except (ManifestError, MissingShardError) as exc:
        raise ManifestError(f"step {step}: {object_url(store, mkey)} is invalid: {exc}") from exc
    if (m.step, m.world_size, m.save_id) != (step, um.world_size, um.save_id):
        raise ManifestError(f"step {step}: {object_url(store, mkey)} (step {m.step}, world {m.world_size}, save "
                            f"{m.save_id}) disagrees with its upload manifest")
    for rec, rs in zip(m.shards, um.shards):
        if (rec.rank, rec.sha256, rec.size_bytes) != (rs.rank, rs.sha256, rs.size_bytes):
            raise ManifestError(f"step {step} rank {rec.rank}: manifest and upload manifest disagree on "
                                "the shard's size or sha256")
    return m, raw


def plan_step(store: ObjectStore, step: int, ranks: Iterable[int] | None, *, from_pointer: bool,
              um_pair: tuple[UploadManifest, bytes] | None = None) -> RestorePlan:
    """Step 2 of the lifecycle for one step (``um_pair``: its upload manifest when already read).
    Raises NoCheckpointError (no upload manifest), ManifestError, MissingShardError, ShardCorruptedError,
    UploadError."""
    if um_pair is None:
        um_pair = read_upload_manifest(store, step)
    if um_pair is None:
        raise NoCheckpointError(f"step {step} has no {UPLOAD_MANIFEST_NAME} under {store.url}: it was never "
                                "fully uploaded, so it does not exist for restore")
    um, um_raw = um_pair
    if um.prefix.strip("/") != store.prefix.strip("/"):
        log.warning("step %d: upload manifest was written under prefix %r, restoring from %s (a copied "
                    "bucket?)", step, um.prefix, store.url)
    m, raw = _read_mirrored_manifest(store, step, um)
    chosen = check_ranks(ranks, m.world_size, step)
    objects = []
    for rank in chosen:
        key = step_key(step, shard_file_name(rank))
        info = store.head(key)
        rec = m.shards[rank]
        if info is None:
            raise MissingShardError(f"step {step} rank {rank}: {object_url(store, key)} is missing (the upload "
                                    "manifest lists it)")
        if info.size_bytes != rec.size_bytes:
            raise ShardCorruptedError(f"step {step} rank {rank}: {object_url(store, key)} is {info.size_bytes} "
                                      f"bytes, the manifest says {rec.size_bytes}")
        objects.append(RemoteObject(rank, key, rec.size_bytes, rec.sha256))
    return RestorePlan(store.url, step, chosen, um, m, raw, tuple(objects), from_pointer,
                       hashlib.sha256(um_raw).hexdigest())


def iter_plans(store: ObjectStore, step: int | None, ranks: Iterable[int] | None, fallback: bool,
               skipped: list[tuple[int, str]] | None = None) -> Iterator[RestorePlan]:
    """Candidate plans, newest first; faults of a step are raised, or (``fallback``) logged, appended to
    ``skipped`` (shared with the caller, which adds the steps that fail later) and passed over. Raises
    ``NoCheckpointError`` when the candidates run out."""
    ascending, pointer = committed_step_candidates(store)
    candidates = ascending[::-1]
    if step is not None:
        order = [step] + ([s for s in candidates if s < step] if fallback else [])
    else:
        if not candidates:
            raise NoCheckpointError(f"no remotely committed step under {store.url} (no latest pointer and "
                                    f"no {UPLOAD_MANIFEST_NAME} found)")
        order = candidates
    if skipped is None:
        skipped = []
    for s in order:
        try:
            got = read_upload_manifest(store, s)
            if got is None:
                if step is not None and s == step:
                    raise NoCheckpointError(f"step {s} has no {UPLOAD_MANIFEST_NAME} under {store.url}: it "
                                            "was never fully uploaded, so it does not exist for restore")
                # LIST (or an old pointer) named a commit point that GET does not find: not a candidate.
                log.warning("step %d: %s not found by GET although %s; skipping it", s,
                            object_url(store, step_key(s, UPLOAD_MANIFEST_NAME)),
                            "the latest pointer names it" if pointer and pointer.step == s else "LIST showed it")
                skipped.append((s, "upload manifest not found"))
                continue
            plan = plan_step(store, s, ranks, from_pointer=pointer is not None and pointer.step == s, um_pair=got)
        except STEP_FAULTS as exc:
            if not fallback:
                raise
            log.warning("step %d cannot be restored (%s: %s); falling back to the next older step", s,
                        type(exc).__name__, exc)
            skipped.append((s, f"{type(exc).__name__}: {exc}"))
            continue
        yield RestorePlan(**{**plan.__dict__, "skipped": tuple(skipped)})
    raise NoCheckpointError(f"no restorable step under {store.url}"
                            + (f"; tried {', '.join(f'{s} ({r})' for s, r in skipped)}" if skipped else ""))


def plan_restore(remote_url: str, *, step: int | None = None, ranks: Iterable[int] | None = None,
                 fallback: bool = False, s3_client: Any = None, store: ObjectStore | None = None,
                 endpoint_url: str | None = None) -> RestorePlan:
    """What :func:`~tiered_ckpt.remote.restore.restore` would fetch (``--dry-run``): choose the step and
    confirm its objects with HEAD, downloading nothing but the two small manifests. Errors as restore."""
    with StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url) as st:
        return next(iter_plans(st, step, ranks, fallback))


__all__ = ["STEP_FAULTS", "RemoteObject", "RestorePlan", "check_ranks", "iter_plans", "plan_restore", "plan_step"]
