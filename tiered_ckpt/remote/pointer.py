"""The ``latest`` pointer of a bucket prefix (``<prefix>/latest``, SPEC §4): read it, and read it
with its ETag for a conditional move (:mod:`tiered_ckpt.remote.upload.commit`). A hint only: a save is
committed iff its upload manifest is found (:mod:`tiered_ckpt.remote.catalogue`, which re-exports
these readers)."""

from __future__ import annotations

import logging

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.upload_manifest import LatestPointer
from tiered_ckpt.layout import LATEST_POINTER_NAME
from tiered_ckpt.remote.handle import get_or_none, object_url
from tiered_ckpt.remote.limits import MAX_POINTER_BYTES
from tiered_ckpt.store.base import ObjectStore

log = logging.getLogger(__name__)


def read_latest_pointer(store: ObjectStore) -> LatestPointer | None:
    """GET ``<prefix>/latest``; ``None`` when absent or unreadable (a warning: LIST is used
    then)."""
    raw = get_or_none(store, LATEST_POINTER_NAME, max_bytes=MAX_POINTER_BYTES)
    if raw is None:
        return None
    try:
        return LatestPointer.from_json(raw)
    except ManifestError as exc:
        log.warning(
            "%s: ignoring a malformed latest pointer: %s",
            object_url(store, LATEST_POINTER_NAME),
            exc,
        )
        return None


def read_latest_pointer_versioned(store: ObjectStore) -> tuple[LatestPointer | None, str | None]:
    """``(pointer, etag)`` for a conditional move of ``latest``: HEAD for the ETag, then GET.

    ``etag`` is ``None`` when no object exists (write with ``If-None-Match: *``); a malformed
    pointer gives ``(None, etag)`` with a warning (it is replaced with ``If-Match``)."""
    info = store.head(LATEST_POINTER_NAME)
    if info is None:
        return None, None
    if (
        info.size_bytes > MAX_POINTER_BYTES
    ):  # over its cap: replaced with If-Match, like a malformed one
        return None, info.etag
    raw = get_or_none(store, LATEST_POINTER_NAME, max_bytes=MAX_POINTER_BYTES)
    if raw is None:
        return None, None
    try:
        return LatestPointer.from_json(raw), info.etag
    except ManifestError:
        log.warning("%s/latest is unreadable; it will be replaced", store.url)
        return None, info.etag


__all__ = ["read_latest_pointer", "read_latest_pointer_versioned"]
