"""The remote catalogue: which steps a bucket prefix holds (SPEC §4-5). ONE meaning of "committed".

**A step is remotely committed iff GET finds its valid ``upload_manifest.json``** (the remote commit
point, written last by :mod:`tiered_ckpt.remote.commit`). Nothing else makes a step committed: not the
``latest`` pointer, not LIST.

Two cheaper questions are asked on the way, each under its own name:

- :func:`committed_step_candidates`: steps that *may* be committed, without reading any upload manifest:
  the ``latest`` pointer's step (GET) plus the steps whose upload manifest LIST shows. LIST may lag (a new
  step not shown yet) or lie (a key shown that is gone), so the pointer's step is a candidate even when
  LIST does not show it, and each candidate is confirmed by :func:`read_upload_manifest` before use.
  Restore, the manager's resume hook and remote retention use it.
- :func:`list_remote_steps`: every step LIST shows (or the pointer names) with its confirmed state
  (:class:`RemoteStep`): reads each upload manifest. ``tiered-ckpt ls --remote`` and verify use it.

Reads only: ``get_bytes``, ``head``, ``list_keys`` of an :class:`~tiered_ckpt.store.base.ObjectStore`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tiered_ckpt.errors import ManifestError, UploadError
from tiered_ckpt.format.upload_manifest import LatestPointer, UploadManifest
from tiered_ckpt.layout import LATEST_POINTER_NAME, UPLOAD_MANIFEST_NAME, parse_step_dir_name, step_dir_name
from tiered_ckpt.remote.handle import StoreHandle, object_url
from tiered_ckpt.store.base import ObjectStore, RemoteNotFoundError

log = logging.getLogger(__name__)

#: States of a remote step in :func:`list_remote_steps`.
REMOTE_COMMITTED = "committed"
REMOTE_NO_UPLOAD_MANIFEST = "no upload manifest"
REMOTE_BAD_UPLOAD_MANIFEST = "bad upload manifest"
REMOTE_VANISHED = "vanished"


@dataclass(frozen=True)
class RemoteStep:
    """One step seen in the bucket (:func:`list_remote_steps`).

    ``state``: ``committed`` (upload manifest present and valid: restorable), ``no upload manifest``
    (objects listed but no commit point: an upload in progress or abandoned; never restored),
    ``bad upload manifest`` (present but unreadable), ``vanished`` (LIST showed the upload manifest but
    GET did not find it: a step being deleted by retention). ``objects``: keys LIST showed directly under
    the step (confirmation records not counted). ``latest``: the ``latest`` pointer names this step.
    """

    step: int
    state: str
    reason: str = ""
    world_size: int | None = None
    size_bytes: int = 0
    save_id: str | None = None
    objects: int = 0
    latest: bool = False

    @property
    def ok(self) -> bool:
        return self.state == REMOTE_COMMITTED

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "state": self.state, "reason": self.reason, "world_size": self.world_size,
                "size_bytes": self.size_bytes, "save_id": self.save_id, "objects": self.objects,
                "latest": self.latest}


def step_key(step: int, name: str) -> str:
    """Key of ``name`` in ``step``'s directory, relative to the store prefix."""
    return f"{step_dir_name(step)}/{name}"


def get_or_none(store: ObjectStore, key: str) -> bytes | None:
    """GET ``key``; ``None`` when it does not exist. Other failures raise ``UploadError``."""
    try:
        return store.get_bytes(key)
    except RemoteNotFoundError:
        return None


def read_latest_pointer(store: ObjectStore) -> LatestPointer | None:
    """GET ``<prefix>/latest``; ``None`` when absent or unreadable (a warning: LIST is used then)."""
    raw = get_or_none(store, LATEST_POINTER_NAME)
    if raw is None:
        return None
    try:
        return LatestPointer.from_json(raw)
    except ManifestError as exc:
        log.warning("%s: ignoring a malformed latest pointer: %s", object_url(store, LATEST_POINTER_NAME), exc)
        return None


def read_latest_pointer_versioned(store: ObjectStore) -> tuple[LatestPointer | None, str | None]:
    """``(pointer, etag)`` for a conditional move of ``latest``: HEAD for the ETag, then GET.

    ``etag`` is ``None`` when no object exists (write with ``If-None-Match: *``); a malformed pointer
    gives ``(None, etag)`` with a warning (it is replaced with ``If-Match``)."""
    info = store.head(LATEST_POINTER_NAME)
    if info is None:
        return None, None
    raw = get_or_none(store, LATEST_POINTER_NAME)
    if raw is None:
        return None, None
    try:
        return LatestPointer.from_json(raw), info.etag
    except ManifestError:
        log.warning("%s/latest is unreadable; it will be replaced", store.url)
        return None, info.etag


def list_step_objects(store: ObjectStore) -> dict[int, set[str]]:
    """``step -> names of the objects LIST shows directly under it`` (may lag or lie; never trusted alone)."""
    out: dict[int, set[str]] = {}
    for key in store.list_keys(""):
        head, sep, name = key.partition("/")
        step = parse_step_dir_name(head)
        if step is not None and sep and name and "/" not in name:
            out.setdefault(step, set()).add(name)
    return out


def committed_step_candidates(store: ObjectStore) -> tuple[list[int], LatestPointer | None]:
    """Steps that may be remotely committed, ascending, and the ``latest`` pointer (see the module
    docstring). When LIST fails but the pointer was read, the pointer's step alone is returned (a
    warning); without a pointer the LIST failure (``UploadError``) is raised."""
    pointer = read_latest_pointer(store)
    try:
        listed = {s for s, names in list_step_objects(store).items() if UPLOAD_MANIFEST_NAME in names}
    except UploadError as exc:
        if pointer is None:
            raise
        log.warning("%s: LIST failed (%s); using the latest pointer alone", store.url, exc)
        listed = set()
    if pointer is not None:
        listed.add(pointer.step)
    return sorted(listed), pointer


def read_upload_manifest(store: ObjectStore, step: int) -> tuple[UploadManifest, bytes] | None:
    """GET and validate ``step``'s upload manifest: ``(manifest, exact bytes)``, or ``None`` when it does
    not exist (the step is not committed). Raises ``ManifestError`` (invalid, or another step's) and
    ``UploadError`` (the bucket cannot be read)."""
    key = step_key(step, UPLOAD_MANIFEST_NAME)
    raw = get_or_none(store, key)
    if raw is None:
        return None
    try:
        um = UploadManifest.from_json(raw)
    except ManifestError as exc:
        raise ManifestError(f"step {step}: {object_url(store, key)} is invalid: {exc}") from exc
    if um.step != step:
        raise ManifestError(f"step {step}: {object_url(store, key)} describes step {um.step}")
    return um, raw


def list_remote_steps_in(store: ObjectStore) -> list[RemoteStep]:
    """:func:`list_remote_steps` on an open store."""
    pointer = read_latest_pointer(store)
    by_step = list_step_objects(store)
    if pointer is not None:
        by_step.setdefault(pointer.step, set())
    out = []
    for step in sorted(by_step):
        names = by_step[step]
        latest = pointer is not None and pointer.step == step
        if UPLOAD_MANIFEST_NAME not in names and not latest:
            out.append(RemoteStep(step, REMOTE_NO_UPLOAD_MANIFEST,
                                  "objects without an upload manifest (upload in progress or abandoned)",
                                  objects=len(names)))
            continue
        try:
            got = read_upload_manifest(store, step)
        except ManifestError as exc:
            out.append(RemoteStep(step, REMOTE_BAD_UPLOAD_MANIFEST, str(exc), objects=len(names), latest=latest))
            continue
        if got is None:
            what = "the latest pointer names it" if latest else "LIST showed its upload manifest"
            out.append(RemoteStep(step, REMOTE_VANISHED, f"{what}, but GET finds none", objects=len(names),
                                  latest=latest))
            continue
        um = got[0]
        out.append(RemoteStep(step, REMOTE_COMMITTED, "", um.world_size, um.total_bytes, um.save_id, len(names),
                              latest))
    return out


def list_remote_steps(remote_url: str, *, s3_client: Any = None, store: ObjectStore | None = None,
                      endpoint_url: str | None = None) -> list[RemoteStep]:
    """Every step seen under ``remote_url`` and its state (see :class:`RemoteStep`), ascending.

    Upload manifests are read with GET (small objects); shards are not HEADed (restore does that).
    The step named by the ``latest`` pointer is listed even when LIST does not show it yet.
    Raises :class:`~tiered_ckpt.errors.UploadError` when the bucket cannot be read.
    """
    with StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url) as st:
        return list_remote_steps_in(st)


def remote_committed_steps(remote_url: str, *, s3_client: Any = None, store: ObjectStore | None = None,
                           endpoint_url: str | None = None) -> list[int]:
    """:func:`committed_step_candidates` of ``remote_url`` (ascending): the steps that may be restored.
    Cheaper than :func:`list_remote_steps`: upload manifests are not read here."""
    with StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url) as st:
        return committed_step_candidates(st)[0]


__all__ = [
    "REMOTE_COMMITTED", "REMOTE_NO_UPLOAD_MANIFEST", "REMOTE_BAD_UPLOAD_MANIFEST", "REMOTE_VANISHED",
    "RemoteStep", "committed_step_candidates", "get_or_none", "list_remote_steps", "list_remote_steps_in",
    "list_step_objects", "read_latest_pointer", "read_latest_pointer_versioned", "read_upload_manifest",
    "remote_committed_steps", "step_key",
]
