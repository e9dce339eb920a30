"""The remote catalogue: which saves a bucket prefix holds, and which are current (SPEC §4-5, §11).

**A save is remotely committed iff GET finds its valid ``upload_manifest.json``** (the remote commit
point, written last by :mod:`tiered_ckpt.remote.upload.commit`). Nothing else makes it committed: not the
``latest`` pointer, not LIST. Keys: one prefix per save, ``<prefix>/step_XXXXXXXXXX.<save_id>/``
(schema 2; its shards in ``<prefix>/shards/<hh>/`` under the ``hashed`` key layout); round-1 saves
(schema 1) at ``<prefix>/step_XXXXXXXXXX/``, read as they are
(:func:`~tiered_ckpt.layout.parse_remote_step_entry`).

**A committed save is current** iff the prefix's ``run.json`` (:mod:`tiered_ckpt.remote.lineage`;
none: every save is current) does not supersede its ``(attempt, step)`` and it is not a save of
another run (a prefix adopted by a new run: the old run's saves are listed, never chosen). Among the
current saves of one step the newest attempt wins (then the newest ``created_at``, then the save
id); the others are *replaced*. Restore, ``verify --remote``, retention and the manager's resume
hook choose only the winners.

:func:`read_catalogue` builds one :class:`RemoteCatalogue`: one GET of ``latest``, one of
``run.json``, one paginated LIST of the prefix (:func:`list_save_entries`; the ``ObjectStore``
interface has no delimiter LIST, so it walks every key: shards and confirmation records too), and
one GET per save whose upload manifest LIST shows (or the pointer names). LIST may lag (the
pointer's save is read even when LIST does not show it) or lie (a save LIST shows whose upload
manifest GET does not find is *vanished*). Reads only: ``get_bytes``, ``head``, ``list_keys`` of an
:class:`~tiered_ckpt.store.base.ObjectStore`.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from tiered_ckpt.errors import ManifestError, UploadError
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.format.upload_manifest import LatestPointer, UploadManifest
from tiered_ckpt.layout import (
    PINNED_MARKER_NAME,
    RUN_RECORD_NAME,
    UPLOAD_MANIFEST_NAME,
    parse_remote_step_entry,
    parse_spread_shard_key,
    save_entry_name,
    save_shard_key,
)
from tiered_ckpt.remote.handle import StoreHandle, get_or_none, object_url
from tiered_ckpt.remote.limits import MAX_UPLOAD_MANIFEST_BYTES
from tiered_ckpt.remote.lineage import read_remote_record
from tiered_ckpt.remote.pointer import read_latest_pointer, read_latest_pointer_versioned
from tiered_ckpt.store.base import ObjectStore

log = logging.getLogger(__name__)

#: States of a remote save in :func:`list_remote_steps`.
REMOTE_COMMITTED = "committed"
REMOTE_NO_UPLOAD_MANIFEST = "no upload manifest"
REMOTE_BAD_UPLOAD_MANIFEST = "bad upload manifest"
REMOTE_VANISHED = "vanished"
#: :attr:`ListedSave.status` of the save a restore of its step would choose.
CURRENT = "current"

SaveKey = tuple[int, "str | None"]


def save_key(step: int, save_id: str | None, name: str) -> str:
    """Key of ``name`` in one save of ``step`` (``save_id=None``: a round-1 step), relative to the
    store prefix. Raises ``ValueError`` for a bad step or save id."""
    return f"{save_entry_name(step, save_id)}/{name}"


@dataclass(frozen=True)
class RemoteSave:
    """One remotely committed save: its upload manifest (``um``, exact bytes ``raw``) read by GET.
    ``key_save_id``: the save id in its keys (``None``: upload schema 1). ``names``: objects LIST showed
    directly under its prefix (``pinned.json`` among them when pinned), plus its ``hashed``-layout
    shard objects LIST showed, as keys relative to the run prefix (``shards/<hh>/...``, the only
    names with a ``/``)."""

    step: int
    key_save_id: str | None
    um: UploadManifest
    raw: bytes = field(repr=False)
    names: frozenset[str] = frozenset()

    @property
    def save_id(self) -> str:
        return self.um.save_id

    @property
    def attempt(self) -> int:
        return self.um.attempt

    @property
    def run_id(self) -> str | None:
        return self.um.run_id

    @property
    def order(self) -> tuple[int, int]:
        """``(attempt, step)``, as :attr:`LatestPointer.order`."""
        return (self.um.attempt, self.step)

    @property
    def pinned(self) -> bool:
        return PINNED_MARKER_NAME in self.names

    @property
    def upload_manifest_sha256(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    def key(self, name: str) -> str:
        """Key of ``name`` in this save, relative to the store prefix."""
        return save_key(self.step, self.key_save_id, name)

    def shard_key(self, rank: int) -> str:
        """Key of ``rank``'s shard object, relative to the store prefix, in the layout the upload
        manifest records (:func:`~tiered_ckpt.layout.save_shard_key`; a copied bucket's other prefix
        is fine)."""
        return save_shard_key(self.step, self.key_save_id, rank, self.um.key_layout)


@dataclass(frozen=True)
class SaveFault:
    """A save LIST (or the pointer) shows that is not a usable commit: ``state`` is one of
    ``no upload manifest``, ``bad upload manifest``, ``vanished``; ``reason`` says why."""

    step: int
    key_save_id: str | None
    state: str
    reason: str
    objects: int = 0


@dataclass(frozen=True)
class RemoteCatalogue:
    """What one :func:`read_catalogue` saw: the prefix's ``lineage`` (``None``: no claim), the
    ``latest`` ``pointer``, every committed save (``saves``, ascending by step, attempt) and the
    ``faults``."""

    lineage: RunLineage | None
    pointer: LatestPointer | None
    saves: tuple[RemoteSave, ...]
    faults: tuple[SaveFault, ...]
    objects: dict[SaveKey, int] = field(default_factory=dict)

    def _eligible(self, save: RemoteSave) -> str:
        lin = self.lineage
        if lin is None:
            return CURRENT
        if save.run_id is not None and save.run_id != lin.run_id:
            return f"run {save.run_id}, not the prefix's run {lin.run_id}"
        sup = lin.superseded_by(save.attempt, save.step)
        return (
            CURRENT
            if sup is None
            else f"superseded by attempt {sup.attempt} from step {sup.from_step}"
        )

    @cached_property
    def _winners(self) -> dict[int, RemoteSave]:
        best: dict[int, RemoteSave] = {}
        for s in self.saves:
            if self._eligible(s) != CURRENT:
                continue
            b = best.get(s.step)
            if b is None or _rank(s) > _rank(b):
                best[s.step] = s
        return {k: best[k] for k in sorted(best)}

    def current(self) -> list[RemoteSave]:
        """The winning current save of every step that has one, ascending by step."""
        return list(self._winners.values())

    def current_save(self, step: int) -> RemoteSave | None:
        """The save a restore of ``step`` chooses, or ``None`` when no save of it is current."""
        return self._winners.get(step)

    def status(self, save: RemoteSave) -> str:
        """``current``, ``superseded by attempt K from step S``, ``replaced by save X (attempt K)``
        (a current step's losing save), or ``run X, not the prefix's run Y``."""
        why = self._eligible(save)
        if why != CURRENT:
            return why
        win = self.current_save(save.step)
        if win is not None and win is not save:
            return f"replaced by save {win.save_id} (attempt {win.attempt})"
        return CURRENT

    def is_latest(self, step: int, key_save_id: str | None) -> bool:
        p = self.pointer
        return p is not None and (p.step, p.save_id) == (step, key_save_id)


def _rank(s: RemoteSave) -> tuple[int, str, str]:
    return (s.um.attempt, s.um.created_at, s.um.save_id)


def list_save_entries(store: ObjectStore) -> dict[SaveKey, frozenset[str]]:
    """``(step, key save id) -> names of the objects LIST shows directly under that save``, and its
    ``hashed``-layout shards (``shards/<hh>/...`` keys: :attr:`RemoteSave.names`) (one paginated
    LIST of the prefix; may lag or lie, never trusted alone). Raises ``UploadError``."""
    return scan_save_entries(store)[0]


def scan_save_entries(
    store: ObjectStore,
) -> tuple[dict[SaveKey, frozenset[str]], dict[SaveKey, int]]:
    """:func:`list_save_entries` and, from the same LIST, the number of objects of each save: every
    key under its prefix at any depth (``.confirm/`` records too) and its ``hashed``-layout shards,
    the same count in either key layout. Raises ``UploadError``."""
    out: dict[SaveKey, set[str]] = {}
    counts: dict[SaveKey, int] = {}
    for key in store.list_keys(""):
        head, sep, name = key.partition("/")
        parsed = parse_remote_step_entry(head) if sep and name else None
        spread = parse_spread_shard_key(key) if parsed is None else None
        save = parsed if parsed is not None else (spread[:2] if spread is not None else None)
        if save is None:
            continue
        counts[save] = counts.get(save, 0) + 1
        names = out.setdefault(save, set())
        if parsed is None or "/" not in name:
            names.add(name if parsed is not None else key)
    return {k: frozenset(v) for k, v in out.items()}, counts


def read_upload_manifest(
    store: ObjectStore, step: int, save_id: str | None = None
) -> tuple[UploadManifest, bytes] | None:
    """GET and validate the upload manifest of one save of ``step`` (``save_id=None``: the round-1
    one): ``(manifest, exact bytes)``, or ``None`` when it does not exist (not committed). Raises
    ``ManifestError`` (invalid, another step's or another save's) and ``UploadError`` (the bucket
    cannot be read)."""
    key = save_key(step, save_id, UPLOAD_MANIFEST_NAME)
    raw = get_or_none(store, key, max_bytes=MAX_UPLOAD_MANIFEST_BYTES)
    if raw is None:
        return None
    try:
        um = UploadManifest.from_json(raw)
    except ManifestError as exc:
        raise ManifestError(f"step {step}: {object_url(store, key)} is invalid: {exc}") from exc
    if um.step != step:
        raise ManifestError(f"step {step}: {object_url(store, key)} describes step {um.step}")
    if um.key_save_id != save_id:
        raise ManifestError(
            f"step {step}: {object_url(store, key)} describes save {um.key_save_id} (schema "
            f"{um.schema_version}), not the save its key names"
        )
    return um, raw


def read_catalogue(
    store: ObjectStore, *, lineage: RunLineage | None = None, merge_lineage: bool = True
) -> RemoteCatalogue:
    """One look at the prefix (see the module docstring). ``lineage``: a record to merge with the
    bucket's when both name the same run (a root's newer ``run.json``, so that a restore into it
    never picks what it supersedes); ``merge_lineage=False`` uses ``lineage`` alone (the caller read
    the bucket's). When LIST fails but the pointer was read, the pointer's save alone is used (a
    warning). Raises ``ManifestError`` (an unreadable ``run.json``) and ``UploadError`` (the bucket
    cannot be read)."""
    pointer = read_latest_pointer(store)
    if merge_lineage:
        remote = read_remote_record(store)
        if lineage is not None and remote is not None and lineage.run_id == remote.run_id:
            lineage = (
                lineage.merge(remote)
                if (lineage.extends(remote) or remote.extends(lineage))
                else remote
            )
        else:
            lineage = remote
    try:
        entries, counts = scan_save_entries(store)
    except UploadError as exc:
        if pointer is None:
            raise
        log.warning("%s: LIST failed (%s); using the latest pointer alone", store.url, exc)
        entries, counts = {}, {}
    if pointer is not None:
        entries.setdefault((pointer.step, pointer.save_id), frozenset())
    saves, faults = [], []
    for (step, sid), names in sorted(entries.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        is_ptr = pointer is not None and (pointer.step, pointer.save_id) == (step, sid)
        if UPLOAD_MANIFEST_NAME not in names and not is_ptr:
            faults.append(
                SaveFault(
                    step,
                    sid,
                    REMOTE_NO_UPLOAD_MANIFEST,
                    "objects without an upload manifest (upload in progress or abandoned)",
                    counts.get((step, sid), 0),
                )
            )
            continue
        try:
            got = read_upload_manifest(store, step, sid)
        except ManifestError as exc:
            faults.append(
                SaveFault(
                    step, sid, REMOTE_BAD_UPLOAD_MANIFEST, str(exc), counts.get((step, sid), 0)
                )
            )
            continue
        if got is None:
            what = "the latest pointer names it" if is_ptr else "LIST showed its upload manifest"
            faults.append(
                SaveFault(
                    step,
                    sid,
                    REMOTE_VANISHED,
                    f"{what}, but GET finds none",
                    counts.get((step, sid), 0),
                )
            )
            continue
        saves.append(RemoteSave(step, sid, got[0], got[1], names))
    saves.sort(key=lambda s: (s.step,) + _rank(s))
    return RemoteCatalogue(
        lineage, pointer, tuple(saves), tuple(faults), {k: counts.get(k, 0) for k in entries}
    )


@dataclass(frozen=True)
class ListedSave:
    """One save seen in the bucket (:func:`list_remote_steps`). ``state``: ``committed`` (upload
    manifest present and valid), ``no upload manifest`` (objects listed but no commit point: an
    upload in progress or abandoned; never restored), ``bad upload manifest`` (present but
    unreadable), ``vanished`` (LIST showed the upload manifest but GET did not find it: a save being
    deleted by retention). ``objects``: every key LIST showed under the save's prefix (confirmation
    records included) plus its ``hashed``-layout shards: the same count in either layout.
    ``latest``: the ``latest`` pointer names this save and it is the current save of its step (a
    pointer left on a superseded or broken save marks nothing). ``save_id``: of the save (``None``
    when unknown); ``attempt``/``run_id``: its lineage (committed saves). ``status`` (committed
    saves): ``current`` (what a restore of the step chooses), ``superseded by attempt K from step
    S``, ``replaced by save X (attempt K)``, or ``run X, not the prefix's run Y``."""

    step: int
    state: str
    reason: str = ""
    world_size: int | None = None
    size_bytes: int = 0
    save_id: str | None = None
    objects: int = 0
    latest: bool = False
    attempt: int | None = None
    run_id: str | None = None
    status: str = ""

    @property
    def ok(self) -> bool:
        return self.state == REMOTE_COMMITTED

    @property
    def current(self) -> bool:
        return self.status == CURRENT

    @property
    def shown_state(self) -> str:
        """``state`` for a listing, in one word: a committed save that is not current shows why
        (``superseded``, ``replaced``, ``other run``), as the local ``ls`` does."""
        if not self.ok or self.status in ("", CURRENT):
            return self.state
        for head, word in (
            ("superseded", "superseded"),
            ("replaced", "replaced"),
            ("run ", "other run"),
        ):
            if self.status.startswith(head):
                return word
        return self.state

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "state": self.state,
            "reason": self.reason,
            "world_size": self.world_size,
            "size_bytes": self.size_bytes,
            "save_id": self.save_id,
            "objects": self.objects,
            "latest": self.latest,
            "attempt": self.attempt,
            "run_id": self.run_id,
            "status": self.status,
            "shown_state": self.shown_state,
        }


def remote_steps_of(cat: RemoteCatalogue) -> list[ListedSave]:
    """:class:`ListedSave` rows of a catalogue: every save and fault, by step; within a step the
    current save first. Only a current save is marked ``latest``."""
    rows = []
    for s in cat.saves:
        status = cat.status(s)
        latest = status == CURRENT and cat.is_latest(s.step, s.key_save_id)
        rows.append(
            ListedSave(
                s.step,
                REMOTE_COMMITTED,
                "",
                s.um.world_size,
                s.um.total_bytes,
                s.save_id,
                cat.objects.get((s.step, s.key_save_id), 0),
                latest,
                s.attempt,
                s.run_id,
                status,
            )
        )
    for f in cat.faults:  # never marked latest: not a usable commit, whatever the pointer names
        rows.append(ListedSave(f.step, f.state, f.reason, save_id=f.key_save_id, objects=f.objects))
    return sorted(
        rows, key=lambda r: (r.step, not r.current, r.state != REMOTE_COMMITTED, r.save_id or "")
    )


def list_remote_steps_in(store: ObjectStore) -> list[ListedSave]:
    """:func:`list_remote_steps` on an open store."""
    return remote_steps_of(read_catalogue(store))


def list_remote_steps(
    remote_url: str,
    *,
    s3_client: Any = None,
    store: ObjectStore | None = None,
    endpoint_url: str | None = None,
) -> list[ListedSave]:
    """Every save seen under ``remote_url`` and its state and lineage status (see
    :class:`ListedSave`), ascending by step. Upload manifests are read with GET (small objects);
    shards are not HEADed (restore does that). The save named by the ``latest`` pointer is listed
    even when LIST does not show it yet. Raises :class:`~tiered_ckpt.errors.UploadError` when the
    bucket cannot be read, ``ManifestError`` when its ``run.json`` is unreadable.
    """
    with StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url) as st:
        return list_remote_steps_in(st)


def remote_target(
    remote_url: str, *, s3_client: Any = None, store: ObjectStore | None = None
) -> tuple[bool, list[int]]:
    """``(claimed, steps)`` of ``remote_url``: whether its ``run.json`` claim exists (HEAD), and
    every step any object of which LIST shows (committed or not), ascending. A prefix with neither holds no run: a
    wrong URL, not a run before its first upload. Raises ``UploadError`` (``RemoteAccessError``: e.g. no
    such bucket)."""
    with StoreHandle(remote_url, store=store, s3_client=s3_client) as st:
        claimed = st.head(RUN_RECORD_NAME) is not None
        return claimed, sorted({step for step, _ in scan_save_entries(st)[1]})


def committed_step_candidates(store: ObjectStore) -> tuple[list[int], LatestPointer | None]:
    """Steps with a current remotely committed save, ascending, and the ``latest`` pointer (see the
    module docstring; each step's save is :meth:`RemoteCatalogue.current_save`). Raises as
    :func:`read_catalogue`."""
    cat = read_catalogue(store)
    return [s.step for s in cat.current()], cat.pointer


def remote_committed_steps(
    remote_url: str,
    *,
    s3_client: Any = None,
    store: ObjectStore | None = None,
    endpoint_url: str | None = None,
) -> list[int]:
    """Steps of ``remote_url`` with a current committed save (ascending): the steps that may be restored
    (SPEC §11: superseded saves and saves of another run are not offered). Raises as
    :func:`read_catalogue`."""
    with StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url) as st:
        return committed_step_candidates(st)[0]


__all__ = [
    "CURRENT",
    "REMOTE_COMMITTED",
    "REMOTE_NO_UPLOAD_MANIFEST",
    "REMOTE_BAD_UPLOAD_MANIFEST",
    "REMOTE_VANISHED",
    "RemoteCatalogue",
    "RemoteSave",
    "ListedSave",
    "SaveFault",
    "committed_step_candidates",
    "get_or_none",
    "list_remote_steps",
    "list_remote_steps_in",
    "list_save_entries",
    "read_catalogue",
    "read_latest_pointer",
    "read_latest_pointer_versioned",
    "read_upload_manifest",
    "remote_committed_steps",
    "remote_steps_of",
    "remote_target",
    "save_key",
    "scan_save_entries",
]
