"""Restore planning (SPEC §5, §11): which remotely committed save to restore and what to fetch for
it.

Lifecycle steps 1-2 of :mod:`tiered_ckpt.remote.restore.restorer` (nothing local is touched; ``--dry-run``
and ``tiered-ckpt verify --remote`` stop here):

1. **Candidates** (:func:`~tiered_ckpt.remote.catalogue.read_catalogue`): the current save of every
   step (superseded saves, replaced saves and saves of another run are never candidates), newest
   step first, or the current save of the requested ``step`` (then, with ``fallback``, the older
   ones). A save whose upload manifest is present but unreadable is a candidate at its step (it
   fails there).
2. **Plan** (:func:`plan_step`): GET the mirrored ``manifest.json``; check its sha256 against the
   upload manifest's ``manifest_sha256`` and that both agree rank by rank; HEAD every shard to fetch
   (at the key the upload manifest's ``key_layout`` gives it) and compare its size.

Fallback order (:func:`iter_plans`): a candidate whose planning fails with one of
:data:`STEP_FAULTS` is skipped with a warning when ``fallback=True`` (and recorded in
``RestorePlan.skipped``), otherwise raised. ``UploadError`` (bucket unreachable) is never a
fallback: it would fail older steps the same way.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tiered_ckpt.errors import (
    ManifestError,
    MissingShardError,
    NoCheckpointError,
    NoSuchStepError,
    NotACheckpointRootError,
    RankOutOfRangeError,
    ShardCorruptedError,
)
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.upload_manifest import UploadManifest
from tiered_ckpt.layout import MANIFEST_NAME, RUN_RECORD_NAME, UPLOAD_MANIFEST_NAME
from tiered_ckpt.remote.catalogue import (
    REMOTE_BAD_UPLOAD_MANIFEST,
    REMOTE_VANISHED,
    RemoteCatalogue,
    RemoteSave,
    SaveFault,
    read_catalogue,
)
from tiered_ckpt.remote.handle import StoreHandle, get_or_none, object_url
from tiered_ckpt.remote.limits import MAX_REMOTE_MANIFEST_BYTES
from tiered_ckpt.store.base import ObjectStore

log = logging.getLogger(__name__)

#: HEAD requests in flight while a plan confirms the shards it will fetch.
PLAN_HEAD_CONCURRENCY = 16
#: Errors of one candidate step that ``fallback=True`` skips (an unreachable bucket is not one of
#: them).
STEP_FAULTS = (MissingShardError, ShardCorruptedError, ManifestError)


@dataclass(frozen=True)
class RemoteObject:
    """One object a restore fetches: ``key`` relative to the store prefix, size confirmed by
    HEAD."""

    rank: int
    key: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True)
class RestorePlan:
    """What a restore will fetch (the result of steps 1-2 of the lifecycle; ``--dry-run`` prints
    it).

    ``skipped``: ``(step, reason)`` of newer candidates passed over (with ``fallback=True``).
    ``lineage``: the run record the choice was made under (the bucket's, merged with the root's when
    both name one run; ``None``: no claim); restore carries it into a root without one (SPEC §11).
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
    lineage: RunLineage | None = None

    @property
    def total_bytes(self) -> int:
        return sum(o.size_bytes for o in self.objects)

    def to_dict(self) -> dict[str, Any]:
        um = self.upload_manifest
        return {
            "remote_url": self.remote_url,
            "step": self.step,
            "ranks": list(self.ranks),
            "world_size": self.manifest.world_size,
            "save_id": self.manifest.save_id,
            "attempt": um.attempt,
            "run_id": um.run_id,
            "total_bytes": self.total_bytes,
            "from_pointer": self.from_pointer,
            "upload_manifest_sha256": self.upload_manifest_sha256,
            "objects": [
                {"rank": o.rank, "key": o.key, "size_bytes": o.size_bytes, "sha256": o.sha256}
                for o in self.objects
            ],
            "skipped": [{"step": s, "reason": r} for s, r in self.skipped],
        }


def check_ranks(ranks: Iterable[int] | None, world_size: int, step: int) -> tuple[int, ...]:
    """``ranks`` sorted and de-duplicated (``None``: all of ``world_size``). Raises ``ValueError``
    (empty), :class:`~tiered_ckpt.errors.RankOutOfRangeError` (a ``ValueError``: ranks the step does
    not have)."""
    if ranks is None:
        return tuple(range(world_size))
    out = tuple(sorted(set(int(r) for r in ranks)))
    if not out:
        raise ValueError("ranks is empty")
    bad = [r for r in out if not 0 <= r < world_size]
    if bad:
        raise RankOutOfRangeError(
            f"ranks {bad} are outside step {step}'s world_size {world_size}",
            ranks=tuple(bad),
            world_size=world_size,
            step=step,
        )
    return out


def read_mirrored_manifest(store: ObjectStore, save: RemoteSave) -> tuple[ShardManifest, bytes]:
    """GET ``manifest.json`` and check it against the upload manifest (sha256, step, save, per
    rank); returns it with its exact bytes. Raises MissingShardError, ShardCorruptedError,
    ManifestError, UploadError."""
    mkey = save.key(MANIFEST_NAME)
    raw = get_or_none(store, mkey, max_bytes=MAX_REMOTE_MANIFEST_BYTES)
    if raw is None:
        raise MissingShardError(
            f"step {save.step}: {object_url(store, mkey)} is missing (the upload manifest mirrors "
            "it)"
        )
    return check_mirrored_manifest(store, save, raw), raw


def check_mirrored_manifest(store: ObjectStore, save: RemoteSave, raw: bytes) -> ShardManifest:
    """The mirrored ``manifest.json`` bytes ``raw`` of ``save``, checked against its upload
    manifest as :func:`read_mirrored_manifest` checks them (no request: ``store`` names the key in
    messages). Raises ShardCorruptedError, ManifestError."""
    step, um = save.step, save.um
    mkey = save.key(MANIFEST_NAME)
    sha = hashlib.sha256(raw).hexdigest()
    if sha != um.manifest_sha256:
        raise ShardCorruptedError(
            f"step {step}: {object_url(store, mkey)} has sha256 {sha[:16]}..., the upload "
            f"manifest says {um.manifest_sha256[:16]}..."
        )
    try:
        m = ShardManifest.from_json(raw)
    except (ManifestError, MissingShardError) as exc:
        raise ManifestError(f"step {step}: {object_url(store, mkey)} is invalid: {exc}") from exc
    if (m.step, m.world_size, m.save_id) != (step, um.world_size, um.save_id):
        raise ManifestError(
            f"step {step}: {object_url(store, mkey)} (step {m.step}, world {m.world_size}, save "
            f"{m.save_id}) disagrees with its upload manifest"
        )
    for rec, rs in zip(m.shards, um.shards):
        if (rec.rank, rec.sha256, rec.size_bytes) != (rs.rank, rs.sha256, rs.size_bytes):
            raise ManifestError(
                f"step {step} rank {rec.rank}: manifest and upload manifest disagree on "
                "the shard's size or sha256"
            )
    return m


def plan_step(
    store: ObjectStore,
    save: RemoteSave,
    ranks: Iterable[int] | None,
    *,
    from_pointer: bool,
    lineage: RunLineage | None = None,
) -> RestorePlan:
    """Step 2 of the lifecycle for one committed save. Raises ManifestError, MissingShardError,
    ShardCorruptedError, UploadError."""
    step, um = save.step, save.um
    if um.prefix.strip("/") != store.prefix.strip("/"):
        log.warning(
            "step %d: upload manifest was written under prefix %r, restoring from %s (a copied "
            "bucket?)",
            step,
            um.prefix,
            store.url,
        )
    m, raw = read_mirrored_manifest(store, save)
    chosen = check_ranks(ranks, m.world_size, step)

    def confirm(rank: int) -> RemoteObject:
        key = save.shard_key(rank)  # in the key layout its upload manifest records
        info = store.head(key)
        rec = m.shards[rank]
        if info is None:
            raise MissingShardError(
                f"step {step} rank {rank}: {object_url(store, key)} is missing (the upload "
                "manifest lists it)"
            )
        if info.size_bytes != rec.size_bytes:
            raise ShardCorruptedError(
                f"step {step} rank {rank}: {object_url(store, key)} is {info.size_bytes} "
                f"bytes, the manifest says {rec.size_bytes}"
            )
        return RemoteObject(rank, key, rec.size_bytes, rec.sha256)

    # The HEADs in parallel (a 512-rank step: 512 round trips); the lowest rank's error is raised.
    with ThreadPoolExecutor(
        max_workers=max(1, min(PLAN_HEAD_CONCURRENCY, len(chosen))),
        thread_name_prefix="tiered-ckpt-plan",
    ) as pool:
        objects = list(pool.map(confirm, chosen))
    return RestorePlan(
        store.url,
        step,
        chosen,
        um,
        m,
        raw,
        tuple(objects),
        from_pointer,
        save.upload_manifest_sha256,
        lineage=lineage,
    )


def _no_current_save(cat: RemoteCatalogue, store: ObjectStore, step: int) -> NoCheckpointError:
    others = [s for s in cat.saves if s.step == step]
    if others:
        why = "; ".join(
            f"save {s.save_id} (attempt {s.attempt}): {cat.status(s)}" for s in others[:4]
        )
        return NoCheckpointError(
            f"step {step} has no current save under {store.url} ({why}): it is not "
            "restored (SPEC §11)"
        )
    steps = sorted({s for s, _ in cat.objects})
    if step not in steps:
        shown = ", ".join(map(str, steps[:5] + ["..."] + steps[-5:] if len(steps) > 10 else steps))
        return NoSuchStepError(
            f"step {step} does not exist under {store.url} "
            f"({f'steps: {shown}' if steps else 'no steps'})",
            steps=tuple(steps),
        )
    return NoCheckpointError(
        f"step {step} exists under {store.url} but was never fully uploaded (no "
        f"{UPLOAD_MANIFEST_NAME}: an upload in progress or abandoned)"
    )


def candidates(
    cat: RemoteCatalogue, store: ObjectStore, step: int | None, fallback: bool
) -> list[RemoteSave | SaveFault]:
    """Step 1: the saves to try, in order (a :class:`SaveFault` fails where it stands). Raises
    ``NoCheckpointError`` when there is none, or when ``step`` has no current save: its
    :class:`~tiered_ckpt.errors.NoSuchStepError` when the bucket holds no object of ``step``,
    :class:`~tiered_ckpt.errors.NotACheckpointRootError` when the prefix holds no claim and no
    step."""
    if cat.lineage is None and not cat.objects:
        raise NotACheckpointRootError(
            f"{store.url} is not a checkpoint prefix (no {RUN_RECORD_NAME} and no step_* objects)"
        )
    current = cat.current()[::-1]
    bad = [f for f in cat.faults if f.state == REMOTE_BAD_UPLOAD_MANIFEST]
    if step is not None:
        first = cat.current_save(step)
        if first is None:
            broken = [f for f in bad if f.step == step]
            if broken:
                return [broken[0]]
            raise _no_current_save(cat, store, step)
        return [first] + ([c for c in current if c.step < step] if fallback else [])
    order: list[RemoteSave | SaveFault] = sorted(
        current + bad, key=lambda c: (-c.step, isinstance(c, SaveFault))
    )
    if not order:
        raise NoCheckpointError(
            f"no remotely committed step under {store.url} (no latest pointer and "
            f"no current {UPLOAD_MANIFEST_NAME} found)"
        )
    return order


def iter_plans(
    store: ObjectStore,
    step: int | None,
    ranks: Iterable[int] | None,
    fallback: bool,
    skipped: list[tuple[int, str]] | None = None,
    *,
    local_lineage: RunLineage | None = None,
) -> Iterator[RestorePlan]:
    """Candidate plans, newest first; faults of a save are raised, or (``fallback``) logged,
    appended to ``skipped`` (shared with the caller, which adds the steps that fail later) and
    passed over. ``local_lineage``: the restoring root's record (merged with the bucket's when they
    name one run). Raises ``NoCheckpointError`` when the candidates run out."""
    cat = read_catalogue(store, lineage=local_lineage)
    for f in cat.faults:
        if (
            f.state == REMOTE_VANISHED
        ):  # LIST (or an old pointer) named a commit point GET does not find
            log.warning("step %d (save %s): %s; skipping it", f.step, f.key_save_id, f.reason)
    if skipped is None:
        skipped = []
    for c in candidates(cat, store, step, fallback):
        try:
            if isinstance(c, SaveFault):
                raise ManifestError(c.reason)
            plan = plan_step(
                store,
                c,
                ranks,
                from_pointer=cat.is_latest(c.step, c.key_save_id),
                lineage=cat.lineage,
            )
        except STEP_FAULTS as exc:
            if not fallback:
                raise
            log.warning(
                "step %d cannot be restored (%s: %s); falling back to the next older step",
                c.step,
                type(exc).__name__,
                exc,
            )
            skipped.append((c.step, f"{type(exc).__name__}: {exc}"))
            continue
        yield RestorePlan(**{**plan.__dict__, "skipped": tuple(skipped)})
    raise NoCheckpointError(
        f"no restorable step under {store.url}"
        + (f"; tried {', '.join(f'{s} ({r})' for s, r in skipped)}" if skipped else "")
    )


def plan_restore(
    remote_url: str,
    *,
    step: int | None = None,
    ranks: Iterable[int] | None = None,
    fallback: bool = False,
    s3_client: Any = None,
    store: ObjectStore | None = None,
    endpoint_url: str | None = None,
) -> RestorePlan:
    """What :func:`~tiered_ckpt.remote.restore.restorer.restore` would fetch (``--dry-run``): choose the save
    and confirm its objects with HEAD, downloading nothing but the small manifests. Errors as
    restore."""
    with StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url) as st:
        return next(iter_plans(st, step, ranks, fallback))


__all__ = [
    "STEP_FAULTS",
    "RemoteObject",
    "RestorePlan",
    "candidates",
    "check_mirrored_manifest",
    "check_ranks",
    "iter_plans",
    "plan_restore",
    "plan_step",
    "read_mirrored_manifest",
]
