"""The size cap of every kind of small object the remote tier reads into memory, in one place.

Each ``get_bytes`` / :func:`~tiered_ckpt.remote.handle.get_or_none` of the remote tier passes the
cap of the object's kind; the store refuses a body that passes it as it arrives (a
:class:`~tiered_ckpt.errors.ManifestError` naming the object and the cap), so a hostile or broken
server cannot grow memory without bound. The manifests share the local tier's cap, so
that every manifest that restores from disk also restores from the bucket; the run record shares its
local cap.
"""

from __future__ import annotations

from tiered_ckpt.local.catalogue import MAX_MANIFEST_BYTES, MAX_RUN_RECORD_BYTES

KiB = 1024
MiB = 1024 * KiB

#: ``<prefix>/latest``: one small JSON pointer.
MAX_POINTER_BYTES = 1 * MiB
#: ``<save>/confirm/rank_NNNNN.json``: one rank's confirmation record.
MAX_CONFIRMATION_BYTES = 1 * MiB
#: ``<save>/pinned.json``: a pin mirrored by the sidecar (today only its presence in LIST is read).
MAX_PIN_BYTES = 1 * MiB
#: ``<save>/manifest.json`` (the mirrored local manifest): the local tier's cap.
MAX_REMOTE_MANIFEST_BYTES = MAX_MANIFEST_BYTES
#: ``<save>/upload_manifest.json``: one entry per rank next to the manifest's, the same cap.
MAX_UPLOAD_MANIFEST_BYTES = MAX_MANIFEST_BYTES
#: ``<prefix>/run.json``: the bucket's run record (claim), the local tier's cap.
MAX_REMOTE_RUN_RECORD_BYTES = MAX_RUN_RECORD_BYTES

__all__ = [
    "MAX_CONFIRMATION_BYTES",
    "MAX_PIN_BYTES",
    "MAX_POINTER_BYTES",
    "MAX_REMOTE_MANIFEST_BYTES",
    "MAX_REMOTE_RUN_RECORD_BYTES",
    "MAX_UPLOAD_MANIFEST_BYTES",
]
