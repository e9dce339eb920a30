"""Where a run stands (``tiered-ckpt status``): per step its local state, its remote state, the
upload's progress and the sidecar's local mark; per run the newest local and remote steps and the
training time at risk. Reads only: the local scan (:func:`tiered_ckpt.local.scan.scan`, sizes only),
the markers (:mod:`tiered_ckpt.local.markers`), the remote catalogue
(:func:`tiered_ckpt.remote.catalogue.read_catalogue`), one ListMultipartUploads and, per save being
uploaded, one LIST of its ``.confirm/`` records.

**Runs.** A local step belongs to the root's run (``run.json``; none: run ``None``); a remote save
to the run its upload manifest names, else to the prefix's claim (``<prefix>/run.json``). A save
being uploaded (no upload manifest yet) belongs to the local run when the root holds a step of that
save id, else to the claim. One :class:`RunState` per run: the local run first, then the claim's,
then any other.

**States of a step.** ``local``: ``committed``, ``uncommitted`` (a save in progress or interrupted),
``superseded`` (a later attempt abandoned it), ``corrupt`` / ``incomplete`` (as ``ls`` says),
``absent``; ``None`` without a root. ``remote``: ``committed`` (its current save's upload manifest
is there: the remote commit point), ``uploading`` (objects or multipart uploads of a save, no upload
manifest yet; an abandoned upload looks the same), ``superseded`` (committed saves, none current: a
later attempt, or another run, supersedes them), ``broken`` (an unreadable or vanished upload
manifest), ``absent``; ``None`` without a remote. When several saves of a step exist, the local
step's own save decides. ``uploaded_bytes``: bytes of the step's shards confirmed remotely (every
shard of a committed save; the ranks whose confirmation record exists while uploading; sizes from
the local manifest or the save's mirrored one). ``marker``: the step's ``uploaded.json``:
``uploaded``, ``restored``, ``skipped`` (released unsent), ``stale`` (written for another save of
the step), ``other remote`` (names another bucket than the one looked at), ``None`` (no marker).

**Time at risk** (:mod:`tiered_ckpt.remote.at_risk`, the sidecar's gauge): now minus the local
commit time (``created_at``) of the newest remotely committed step: the newest current committed
save with a remote; without one, the newest committed local step whose marker says ``uploaded`` or
``restored`` (what a sidecar starting on this root learns first).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import CheckpointError, ManifestError, UploadError
from tiered_ckpt.format.lineage import RunLineage
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.layout import (
    CONFIRM_DIR,
    MANIFEST_NAME,
    parse_remote_step_entry,
    parse_spread_shard_key,
    step_dir_name,
)
from tiered_ckpt.local.catalogue import read_manifest, read_run_record, resolve_root
from tiered_ckpt.local.markers import marker_state
from tiered_ckpt.local.scan import COMMITTED, SUPERSEDED, StepStatus, scan
from tiered_ckpt.remote.at_risk import commit_time, seconds_at_risk
from tiered_ckpt.remote.catalogue import (
    CURRENT,
    REMOTE_NO_UPLOAD_MANIFEST,
    RemoteCatalogue,
    RemoteSave,
    SaveFault,
    read_catalogue,
    save_key,
)
from tiered_ckpt.remote.handle import get_or_none
from tiered_ckpt.remote.limits import MAX_REMOTE_MANIFEST_BYTES
from tiered_ckpt.remote.upload.commit import confirmed_ranks
from tiered_ckpt.store.base import ObjectStore

log = logging.getLogger(__name__)

ABSENT = "absent"
R_COMMITTED, R_UPLOADING, R_SUPERSEDED, R_BROKEN = "committed", "uploading", "superseded", "broken"
#: Markers that say the step is in the bucket (the newest such step feeds the time at risk without a
#: remote).
IN_BUCKET_MARKERS = ("uploaded", "restored")


@dataclass(frozen=True)
class StepState:
    """One step of one run (module docstring for the words). Bytes are ``None`` where they cannot be
    known (no remote looked at, no manifest to size the shards)."""

    step: int
    local: str | None
    remote: str | None
    uploaded_bytes: int | None = None
    total_bytes: int | None = None
    marker: str | None = None
    save_id: str | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "local": self.local,
            "remote": self.remote,
            "uploaded_bytes": self.uploaded_bytes,
            "total_bytes": self.total_bytes,
            "marker": self.marker,
            "save_id": self.save_id,
            "note": self.note,
        }


@dataclass(frozen=True)
class RunState:
    """One run: its id and newest attempt (``None`` when unknown), its steps ascending, the newest
    current committed local step, the newest remotely committed step and its local commit time
    (seconds since the epoch; ``None``: none yet)."""

    run_id: str | None
    attempt: int | None
    steps: tuple[StepState, ...]
    newest_local_step: int | None
    newest_remote_step: int | None
    newest_remote_commit_s: float | None

    def at_risk_s(self, now: float | None = None) -> float | None:
        """Seconds of training since the newest remote commit
        (:func:`~tiered_ckpt.remote.at_risk.seconds_at_risk`)."""
        return seconds_at_risk(self.newest_remote_commit_s, now)

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        """The stable JSON form: ``run_id``, ``attempt``, ``steps`` (each
        :meth:`StepState.to_dict`), ``newest_local_step``, ``newest_remote_step``, ``at_risk_s`` (at
        ``now``)."""
        return {
            "run_id": self.run_id,
            "attempt": self.attempt,
            "steps": [s.to_dict() for s in self.steps],
            "newest_local_step": self.newest_local_step,
            "newest_remote_step": self.newest_remote_step,
            "at_risk_s": self.at_risk_s(now),
        }


# --- local side


@dataclass
class _Local:
    lineage: RunLineage | None
    rows: dict[int, StepStatus] = field(default_factory=dict)
    manifests: dict[int, ShardManifest] = field(default_factory=dict)
    markers: dict[int, str] = field(default_factory=dict)


def _read_local(root: Path, remote_url: str | None) -> _Local:
    """The root's record and one row per step (a current step before a superseded one of its
    number), the manifests of its current steps, and their markers. Raises ``ManifestError``
    (unreadable run.json)."""
    loc = _Local(read_run_record(root))
    for st in scan(root, verify=False, require_all=False):
        if st.step not in loc.rows or loc.rows[st.step].state == SUPERSEDED:
            loc.rows[st.step] = st
    for step, st in loc.rows.items():
        if st.state == SUPERSEDED or st.save_id is None:
            continue
        try:
            loc.manifests[step] = read_manifest(root, step)
        except CheckpointError:
            continue
        word = marker_state(root / step_dir_name(step), remote_url)
        if word is not None:
            loc.markers[step] = word
    return loc


# --- remote side


@dataclass
class _Remote:
    cat: RemoteCatalogue
    #: ``(step, key save id)`` of saves with objects or multipart uploads and no upload manifest.
    uploading: dict[tuple[int, str | None], SaveFault | None] = field(default_factory=dict)


def _multipart_saves(store: ObjectStore) -> set[tuple[int, str | None]]:
    """Saves with a multipart upload in progress (one ListMultipartUploads; a server without it:
    none)."""
    out: set[tuple[int, str | None]] = set()
    try:
        for u in store.list_multipart_uploads(""):
            head, sep, _ = u.key.partition("/")
            entry = parse_remote_step_entry(head) if sep else None
            spread = parse_spread_shard_key(u.key) if entry is None else None
            if entry is not None:
                out.add(entry)
            elif spread is not None:
                out.add((spread[0], spread[1]))
    except UploadError as exc:  # e.g. a server without ListMultipartUploads: objects alone tell
        log.debug("%s: multipart uploads not listed (%s)", store.url, exc)
    return out


def _read_remote(store: ObjectStore, lineage: RunLineage | None) -> _Remote:
    cat = read_catalogue(store, lineage=lineage)
    rem = _Remote(cat)
    for f in cat.faults:
        if f.state == REMOTE_NO_UPLOAD_MANIFEST:
            rem.uploading[(f.step, f.key_save_id)] = f
    committed = {(s.step, s.key_save_id) for s in cat.saves}
    for key in _multipart_saves(store) - committed:
        rem.uploading.setdefault(key, None)
    return rem


def _confirmed_bytes(
    store: ObjectStore, step: int, sid: str | None, m: ShardManifest | None
) -> int | None:
    """Bytes of the shards of save ``(step, sid)`` whose confirmation record LIST shows (sizes from
    ``m``)."""
    if m is None:
        return None
    ranks = confirmed_ranks(store.list_keys(save_key(step, sid, CONFIRM_DIR) + "/"))
    return sum(rec.size_bytes for rec in m.shards if rec.rank in ranks)


def _mirrored_manifest(store: ObjectStore, step: int, sid: str | None) -> ShardManifest | None:
    """The local manifest the sidecar mirrored into the save (sizes of its shards), or ``None``."""
    try:
        raw = get_or_none(
            store, save_key(step, sid, MANIFEST_NAME), max_bytes=MAX_REMOTE_MANIFEST_BYTES
        )
        return None if raw is None else ShardManifest.from_json(raw)
    except ManifestError:
        return None


# --- one view


@dataclass
class _Run:
    run_id: str | None
    attempt: int | None = None
    saves: list[RemoteSave] = field(default_factory=list)
    uploading: list[tuple[int, str | None]] = field(default_factory=list)
    broken: list[SaveFault] = field(default_factory=list)
    local: bool = False


def _runs(loc: _Local | None, rem: _Remote | None) -> list[_Run]:
    """The runs to show, in order, each with its remote saves (module docstring, "Runs")."""
    runs: dict[str | None, _Run] = {}

    def run(rid: str | None) -> _Run:
        return runs.setdefault(rid, _Run(rid))

    if loc is not None:
        r = run(loc.lineage.run_id if loc.lineage else None)
        r.local, r.attempt = True, loc.lineage.attempt if loc.lineage else None
    if rem is not None:
        claim = rem.cat.lineage
        claim_id = (
            claim.run_id
            if claim is not None
            else (loc.lineage.run_id if loc and loc.lineage else None)
        )
        if claim is not None:
            r = run(claim.run_id)
            r.attempt = max(r.attempt or 0, claim.attempt)
        for s in rem.cat.saves:
            run(s.run_id if s.run_id is not None else claim_id).saves.append(s)
        local_sids = {(k, st.save_id) for k, st in (loc.rows.items() if loc else ())}
        local_id = loc.lineage.run_id if loc and loc.lineage else None
        for key in rem.uploading:
            run(local_id if loc is not None and key in local_sids else claim_id).uploading.append(
                key
            )
        for f in rem.cat.faults:
            if f.state != REMOTE_NO_UPLOAD_MANIFEST:
                run(claim_id).broken.append(f)
    for r in runs.values():  # a run known from its saves alone: their newest attempt
        if r.attempt is None and r.saves:
            r.attempt = max(s.attempt for s in r.saves)
    return list(runs.values())


def _remote_of(
    r: _Run, rem: _Remote, step: int, local_sid: str | None
) -> tuple[str, RemoteSave | None, str | None, str]:
    """``(state, committed save, uploading save id, note)`` of ``step`` in run ``r``."""
    saves = [s for s in r.saves if s.step == step]
    current = [s for s in saves if rem.cat.status(s) == CURRENT]
    ups = [sid for (st, sid) in r.uploading if st == step]
    for s in current:
        if s.save_id == local_sid:
            return R_COMMITTED, s, None, ""
    if local_sid is not None and local_sid in ups:
        return R_UPLOADING, None, local_sid, ""
    if current:
        other = (
            ""
            if local_sid is None
            else f"remote save {current[0].save_id} is another save than the local one"
        )
        return R_COMMITTED, current[0], None, other
    if ups:
        return R_UPLOADING, None, ups[0], ""
    if saves:
        return R_SUPERSEDED, saves[-1], None, rem.cat.status(saves[-1])
    broken = [f for f in r.broken if f.step == step]
    if broken:
        return R_BROKEN, None, None, f"{broken[0].state}: {broken[0].reason}"
    return ABSENT, None, None, ""


def _run_state(
    r: _Run, loc: _Local | None, rem: _Remote | None, store: ObjectStore | None
) -> RunState:
    """The rows of run ``r`` and its newest local and remote steps."""
    local_rows = loc.rows if loc is not None and r.local else {}
    steps = (
        set(local_rows)
        | {s.step for s in r.saves}
        | {k for k, _ in r.uploading}
        | {f.step for f in r.broken}
    )
    rows: list[StepState] = []
    newest_remote: tuple[int, float | None] | None = None
    for step in sorted(steps):
        st = local_rows.get(step)
        m = loc.manifests.get(step) if loc is not None and r.local else None
        local = None if loc is None else (st.state if st is not None else ABSENT)
        marker = loc.markers.get(step) if loc is not None and r.local else None
        total = m.total_bytes if m is not None else None
        uploaded: int | None = None
        remote, note, sid = (
            None,
            st.note if st is not None else "",
            st.save_id if st is not None else None,
        )
        if rem is not None and store is not None:
            remote, save, up_sid, rnote = _remote_of(r, rem, step, sid)
            if not (
                local == SUPERSEDED and remote == R_SUPERSEDED
            ):  # the local note says it already
                note = "; ".join(x for x in (note, rnote) if x)
            if save is not None:
                total = total if total is not None and save.save_id == sid else save.um.total_bytes
                uploaded, sid = save.um.total_bytes, sid or save.save_id
                if remote == R_COMMITTED and (newest_remote is None or step > newest_remote[0]):
                    t = commit_time(save.um.created_at)
                    newest_remote = (
                        step,
                        t if t is not None or m is None else commit_time(m.created_at),
                    )
            elif remote == R_UPLOADING:
                mm = (
                    m
                    if m is not None and up_sid == sid
                    else _mirrored_manifest(store, step, up_sid)
                )
                total = mm.total_bytes if mm is not None else total
                uploaded, sid = _confirmed_bytes(store, step, up_sid, mm), sid or up_sid
            elif remote == ABSENT:
                uploaded = 0
        elif m is not None and marker in IN_BUCKET_MARKERS and local == COMMITTED:
            uploaded = total
            if newest_remote is None or step > newest_remote[0]:
                newest_remote = (step, commit_time(m.created_at))
        rows.append(StepState(step, local, remote, uploaded, total, marker, sid, note))
    newest_local = max((s for s, st in local_rows.items() if st.state == COMMITTED), default=None)
    return RunState(
        r.run_id,
        r.attempt,
        tuple(rows),
        newest_local,
        newest_remote[0] if newest_remote else None,
        newest_remote[1] if newest_remote else None,
    )


def read_status(
    root: Path | None = None, store: ObjectStore | None = None, *, remote_url: str | None = None
) -> list[RunState]:
    """One look at a run root and/or a bucket prefix (at least one): a :class:`RunState` per run
    (module docstring). ``remote_url``: the URL markers are compared with (default: ``store.url``).
    Raises ``ValueError`` when neither is given, ``ManifestError`` (an unreadable ``run.json``,
    local or remote) and ``UploadError`` (the bucket cannot be read)."""
    if root is None and store is None:
        raise ValueError("read_status needs a root or a store")
    url = remote_url if remote_url is not None else (store.url if store is not None else None)
    loc = _read_local(resolve_root(root)[0], url) if root is not None else None
    rem = _read_remote(store, loc.lineage if loc else None) if store is not None else None
    return [_run_state(r, loc, rem, store) for r in _runs(loc, rem)]


__all__ = [
    "ABSENT",
    "IN_BUCKET_MARKERS",
    "R_BROKEN",
    "R_COMMITTED",
    "R_SUPERSEDED",
    "R_UPLOADING",
    "RunState",
    "StepState",
    "read_status",
]
