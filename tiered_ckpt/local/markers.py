"""The local ``uploaded.json`` marker of a step directory: the one place that writes and reads it.

Writers: the sidecar after a remote commit or a ``skip_intermediate`` release
(:mod:`tiered_ckpt.remote.upload`), and restore after its local commit (:mod:`tiered_ckpt.remote.restore`).
Readers: the sidecar's backlog (a step counts as uploaded only for the remote its marker names) and
upload-gated rotation (:func:`tiered_ckpt.local.rotation.is_uploaded`: any marker file releases the step,
SPEC §3). The format is :class:`tiered_ckpt.format.records.UploadedMarker`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.records import UploadedMarker
from tiered_ckpt.layout import UPLOADED_MARKER_NAME
from tiered_ckpt.local.commit import durable_write_bytes

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


def write_uploaded_marker(step_dir: PathLike, marker: UploadedMarker) -> None:
    """Write ``<step_dir>/uploaded.json`` durably (temp, fsync, rename, directory fsync), replacing any
    earlier marker. Raises ``FileNotFoundError`` when the step directory is gone, ``OSError`` otherwise."""
    durable_write_bytes(Path(step_dir) / UPLOADED_MARKER_NAME, marker.to_json().encode())


def read_uploaded_marker(step_dir: PathLike) -> UploadedMarker | None:
    """The step's marker, or ``None`` when there is none or it cannot be read or parsed (the sidecar then
    treats the step as not uploaded and checks it remotely again). Never raises."""
    path = Path(step_dir) / UPLOADED_MARKER_NAME
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        return UploadedMarker.from_json(data)
    except ManifestError as exc:
        log.debug("%s is unreadable (%s); treated as absent", path, exc)
        return None


def has_uploaded_marker(step_dir: PathLike) -> bool:
    """Whether ``<step_dir>/uploaded.json`` exists as a file, whatever it says: the release that
    upload-gated rotation waits for (the sidecar wrote it, for some remote)."""
    return (Path(step_dir) / UPLOADED_MARKER_NAME).is_file()


def uploaded_marker_time(step_dir: PathLike) -> float | None:
    """When the marker was written (its mtime, seconds since the epoch), or ``None`` when there is none."""
    try:
        return (Path(step_dir) / UPLOADED_MARKER_NAME).stat().st_mtime
    except OSError:
        return None


__all__ = ["has_uploaded_marker", "read_uploaded_marker", "uploaded_marker_time", "write_uploaded_marker"]
