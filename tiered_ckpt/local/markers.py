"""The local ``uploaded.json`` marker of a step directory: the one place that writes and reads it.

Writers: the sidecar after a remote commit or a ``skip_intermediate`` release
(:mod:`tiered_ckpt.remote.upload.uploader`), and restore after its local commit
(:mod:`tiered_ckpt.remote.restore.restorer`). Readers: the sidecar's backlog (a step counts as uploaded only
for the remote its marker names) and upload-gated rotation
(:func:`tiered_ckpt.local.rotation.is_uploaded`). The format is
:class:`tiered_ckpt.format.records.UploadedMarker`.

A marker counts (:func:`has_uploaded_marker`) only while it matches the step's manifest (SPEC §11):
it names the sha256 of the local ``manifest.json`` bytes it was written for, and a step re-saved
with ``replace=True`` (new manifest bytes) is not uploaded until a new marker says so. A marker of an earlier release, without ``manifest_sha256``, counts for any manifest, as
before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import stat
from pathlib import Path

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.records import UploadedMarker
from tiered_ckpt.layout import UPLOADED_MARKER_NAME
from tiered_ckpt.local.catalogue import read_manifest_bytes
from tiered_ckpt.local.commit import durable_write_bytes
from tiered_ckpt.safe_read import lstat_in_dir, read_file

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

_HEX64 = re.compile(r"[0-9a-f]{64}")
#: Largest ``uploaded.json`` read (bytes); a larger one is treated as absent.
MAX_MARKER_BYTES = 64 * 1024


def manifest_sha256_of(step_dir: PathLike) -> str | None:
    """sha256 (hex) of the bytes of ``<step_dir>/manifest.json`` now, or ``None`` when the step is
    not committed or its manifest cannot be read (a symlink, not a regular file, over the size cap:
    see :func:`tiered_ckpt.local.catalogue.read_manifest_bytes`). Never raises for those; the value
    a writer passes as ``manifest_sha256`` should be that of the bytes it actually uploaded or
    restored."""
    try:
        data = read_manifest_bytes(Path(step_dir))
    except (ManifestError, OSError):
        return None
    return None if data is None else hashlib.sha256(data).hexdigest()


def write_uploaded_marker(
    step_dir: PathLike, marker: UploadedMarker, *, manifest_sha256: str | None = None
) -> None:
    """Write ``<step_dir>/uploaded.json`` durably (temp, fsync, rename, directory fsync), replacing
    any earlier marker.

    ``manifest_sha256``: sha256 (hex, 64 lowercase digits) of the local ``manifest.json`` bytes the
    upload or restore was made from; recorded in the marker (SPEC §11), which then counts only while
    the step's manifest has exactly those bytes. ``None``: the marker's own ``manifest_sha256`` (if
    any) is written as it is; a marker without one counts for any manifest (the behaviour of earlier
    releases).

    Raises ``ValueError`` if ``manifest_sha256`` is not 64 hex digits or disagrees with the marker's
    own value (nothing written), ``FileNotFoundError`` when the step directory is gone, ``OSError``
    otherwise."""
    if manifest_sha256 is not None:
        if not isinstance(manifest_sha256, str) or not _HEX64.fullmatch(manifest_sha256):
            raise ValueError(
                f"manifest_sha256 must be 64 lowercase hex digits, got {manifest_sha256!r}"
            )
        if marker.manifest_sha256 not in (None, manifest_sha256):
            raise ValueError(
                f"step {marker.step}: manifest_sha256={manifest_sha256} disagrees with the "
                f"marker's own {marker.manifest_sha256}"
            )
        marker = dataclasses.replace(marker, manifest_sha256=manifest_sha256)
    durable_write_bytes(Path(step_dir) / UPLOADED_MARKER_NAME, marker.to_json().encode())


def read_uploaded_marker(step_dir: PathLike) -> UploadedMarker | None:
    """The step's marker, or ``None`` when there is none or it cannot be read or parsed (the sidecar
    then treats the step as not uploaded and checks it remotely again). Never raises. The marker is
    returned whether or not it matches the step's manifest: see :func:`has_uploaded_marker`. Read
    through :func:`tiered_ckpt.safe_read.read_file`: a symlink, FIFO, device or directory, or a
    marker over :data:`MAX_MARKER_BYTES`, is treated as absent (never followed, never blocking)."""
    path = Path(step_dir) / UPLOADED_MARKER_NAME
    try:
        data = read_file(
            path, MAX_MARKER_BYTES
        )  # never through a symlink, never blocking on a FIFO
        return None if data is None else UploadedMarker.from_json(data)
    except ManifestError as exc:
        log.debug("%s is unreadable (%s); treated as absent", path, exc)
        return None


def marker_matches_manifest(step_dir: PathLike, marker: UploadedMarker | None) -> bool:
    """Whether ``marker`` (as read from ``step_dir``) counts for the step's current
    ``manifest.json``: :meth:`UploadedMarker.matches_manifest` with the sha256 of its bytes now
    (SPEC §11). ``False`` for no marker or a step without a readable manifest."""
    if marker is None:
        return False
    sha = manifest_sha256_of(step_dir)
    return sha is not None and marker.matches_manifest(sha)


def has_uploaded_marker(step_dir: PathLike) -> bool:
    """Whether the step has an ``uploaded.json`` that counts: it parses, and it was written for the
    step's current ``manifest.json`` bytes (or names none: a marker of an earlier release). The
    release that upload-gated rotation waits for. A stale marker (the step was re-saved with
    ``replace=True`` since) or an unreadable one does not count. Never
    raises."""
    ok = marker_matches_manifest(step_dir, read_uploaded_marker(step_dir))
    if not ok and os.path.lexists(Path(step_dir) / UPLOADED_MARKER_NAME):
        log.debug(
            "%s: uploaded.json does not match manifest.json (or is unreadable); not uploaded",
            step_dir,
        )
    return ok


def uploaded_marker_time(step_dir: PathLike) -> float | None:
    """When the marker was written (its mtime, seconds since the epoch), or ``None`` when there is
    none (or it is not a regular file: ``lstat`` without following anything below the root)."""
    st = lstat_in_dir(step_dir, UPLOADED_MARKER_NAME)
    return st.st_mtime if st is not None and stat.S_ISREG(st.st_mode) else None


def marker_state(step_dir: PathLike, remote_url: str | None = None) -> str | None:
    """What the step's ``uploaded.json`` says, in one word for ``ls`` and ``status``: ``None`` (no
    marker, or an unreadable one), ``"stale"`` (written for another ``manifest.json``: the step was
    saved again), ``"other remote"`` (it names a bucket other than ``remote_url``, when given), else
    ``"skipped"``, ``"restored"`` or ``"uploaded"``. Never raises."""
    marker = read_uploaded_marker(step_dir)
    if marker is None:
        return None
    if not marker_matches_manifest(step_dir, marker):
        return "stale"
    if remote_url is not None and not marker.names_remote(remote_url):
        return "other remote"
    return "skipped" if marker.skipped else "restored" if marker.restored else "uploaded"


__all__ = [
    "has_uploaded_marker",
    "manifest_sha256_of",
    "marker_matches_manifest",
    "marker_state",
    "read_uploaded_marker",
    "uploaded_marker_time",
    "write_uploaded_marker",
]
