"""Multipart uploads this node started and could not abort, recorded locally and swept later.

A failed multipart shard upload is aborted at once (:mod:`tiered_ckpt.remote.upload.transfer`). When that
abort fails too (credentials that expired mid-upload answer the abort with 403 as well; a server
without AbortMultipartUpload answers 501), the upload would stay open on the server, holding its
parts' bytes, until a bucket lifecycle rule or the next sidecar's listing sweep finds it; and a
server without ListMultipartUploads gives that sweep nothing to list. So the upload is recorded here
instead:

- ``<root>/.pending_aborts.json`` (:data:`~tiered_ckpt.layout.PENDING_ABORTS_NAME`), a small JSON
  file (``{"format": "tiered_ckpt.pending_aborts", "version": 1, "uploads": [{"url", "key",
  "upload_id", "recorded_at", "error"}]}``): ``url`` is the store's ``s3://bucket/prefix``, ``key``
  relative to it, ``error`` only the S3 error code and HTTP status (never a message, which may echo
  a request). Written with the local commit protocol's ``durable_write_bytes`` (temp file, fsync,
  rename), read with a size cap (:data:`MAX_PENDING_ABORTS_BYTES`) and never following a symlink; at
  most :data:`MAX_PENDING_ABORTS` entries (the oldest go first, logged).
- :func:`sweep_pending_aborts` (the sidecar: at start and on every poll; ``upload --once``: before
  its steps) aborts the recorded uploads of its store, at most ``max_aborts`` per call: an entry
  whose abort succeeds or whose upload is gone is dropped; at the first abort that fails (the server
  still refuses, or lacks the operation) the sweep stops and that entry moves to the end (so one
  entry refused forever does not hold back the others). Entries of other stores (a root re-pointed
  at another prefix) are kept.

Several processes sharing a root: each read-modify-write is atomic but not serialised across
processes, so a concurrent update may drop an entry; the listing sweep for uploads older than
``stale_multipart_age_s`` (:mod:`tiered_ckpt.remote.upload.retention`) still finds it where the server
lists.

Source: S3 API reference (AbortMultipartUpload; ListMultipartUploads), seed lesson "expired
credentials leave multipart uploads open".
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import CheckpointError, UploadError
from tiered_ckpt.fs import utc_now
from tiered_ckpt.layout import PENDING_ABORTS_NAME
from tiered_ckpt.local.commit import durable_write_bytes
from tiered_ckpt.retry import s3_error_code_and_status
from tiered_ckpt.safe_read import read_in_root
from tiered_ckpt.store.base import ObjectStore
from tiered_ckpt.store.optional_apis import OperationNotSupportedError

log = logging.getLogger(__name__)

FORMAT = "tiered_ckpt.pending_aborts"
VERSION = 1
#: Cap of the record file when read (bytes); far above :data:`MAX_PENDING_ABORTS` entries.
MAX_PENDING_ABORTS_BYTES = 1024 * 1024
#: Entries kept at most (the oldest are dropped first).
MAX_PENDING_ABORTS = 1000
#: Aborts one sweep sends at most (bounded work per sidecar poll).
DEFAULT_SWEEP_MAX_ABORTS = 16
_MAX_FIELD = 2048

_LOCK = threading.Lock()  # serialises read-modify-write within the process


def pending_aborts_path(root: Path) -> Path:
    """``<root>/.pending_aborts.json``."""
    return Path(root) / PENDING_ABORTS_NAME


def _valid(e: Any) -> bool:
    return isinstance(e, dict) and all(
        isinstance(e.get(f), str) and 0 < len(e[f]) <= _MAX_FIELD
        for f in ("url", "key", "upload_id")
    )


def _read(root: Path) -> tuple[list[dict[str, Any]], bool]:
    """``(entries, invalid)``: ``invalid`` when a file is there but is no valid record (logged)."""
    path = pending_aborts_path(root)
    try:
        data = read_in_root(
            root, PENDING_ABORTS_NAME, MAX_PENDING_ABORTS_BYTES
        )  # from the root's fd: a
        # symlinked root named like a step directory is still the root
        if data is None:
            return [], False
        doc = json.loads(data)
    except (CheckpointError, ValueError) as e:
        log.warning("%s is not a valid pending-abort record (%s); replacing it", path, e)
        return [], True
    if (
        not isinstance(doc, dict)
        or doc.get("format") != FORMAT
        or doc.get("version") != VERSION
        or not isinstance(doc.get("uploads"), list)
    ):
        log.warning("%s is not a version-%d pending-abort record; replacing it", path, VERSION)
        return [], True
    return [e for e in doc["uploads"] if _valid(e)], False


def read_pending_aborts(root: Path) -> list[dict[str, Any]]:
    """The recorded uploads (oldest first); ``[]`` without a file. A file that is not a valid record
    (oversized, a symlink, a FIFO, bad JSON, another format) is logged and read as empty (the next
    write or sweep replaces it). Malformed entries are skipped. Never raises for the file's
    content."""
    return _read(root)[0]


def _write(root: Path, entries: list[dict[str, Any]]) -> None:
    body = json.dumps(
        {"format": FORMAT, "version": VERSION, "uploads": entries}, indent=1, sort_keys=True
    )
    durable_write_bytes(pending_aborts_path(root), body.encode("utf-8") + b"\n")


def _error_text(exc: BaseException | None) -> str:
    code, status = s3_error_code_and_status(exc) if exc is not None else (None, None)
    if code is None and isinstance(exc, UploadError) and exc.last_exception is not None:
        code, status = s3_error_code_and_status(exc.last_exception)
    return (
        f"{code} (HTTP {status})"
        if code is not None
        else (type(exc).__name__ if exc is not None else "")
    )


def record_failed_abort(
    root: Path, store_url: str, key: str, upload_id: str, exc: BaseException | None = None
) -> bool:
    """Add ``(store_url, key, upload_id)`` to ``root``'s record (no duplicate). Returns whether it
    is recorded; a local error writing it is logged, not raised (the caller is already failing)."""
    entry = {
        "url": store_url,
        "key": key,
        "upload_id": upload_id,
        "recorded_at": utc_now(),
        "error": _error_text(exc),
    }
    if not _valid(entry):
        return False
    try:
        with _LOCK:
            entries = [
                e
                for e in read_pending_aborts(root)
                if (e["url"], e["key"], e["upload_id"]) != (store_url, key, upload_id)
            ]
            entries.append(entry)
            if len(entries) > MAX_PENDING_ABORTS:
                dropped = entries[: len(entries) - MAX_PENDING_ABORTS]
                entries = entries[-MAX_PENDING_ABORTS:]
                log.warning(
                    "pending-abort record of %s is full: forgetting the %d oldest entries",
                    root,
                    len(dropped),
                )
            _write(root, entries)
    except OSError as e:
        log.warning(
            "could not record multipart upload %s of %s/%s for a later abort: %s",
            upload_id,
            store_url,
            key,
            e,
        )
        return False
    log.warning(
        "multipart upload %s of %s/%s could not be aborted (%s); recorded in %s for a later sweep",
        upload_id,
        store_url,
        key,
        entry["error"],
        pending_aborts_path(root),
    )
    return True


def _abort_some(
    store: ObjectStore, todo: list[dict[str, Any]]
) -> tuple[set[tuple[str, str]], tuple[str, str] | None]:
    """Abort ``todo`` in order until one fails; returns (done (key, upload id)s, the failed one)."""
    done: set[tuple[str, str]] = set()
    for e in todo:
        ident = (e["key"], e["upload_id"])
        try:
            existed = store.abort_multipart_upload(e["key"], e["upload_id"])
        except OperationNotSupportedError:
            log.debug(
                "%s: AbortMultipartUpload not implemented; %d recorded upload(s) stay open",
                store.url,
                len(todo),
            )
            return done, ident
        except UploadError as exc:
            log.info(
                "recorded multipart upload %s of %s/%s still cannot be aborted: %s",
                e["upload_id"],
                store.url,
                e["key"],
                _error_text(exc),
            )
            return done, ident
        done.add(ident)
        log.info(
            "recorded multipart upload %s of %s/%s %s",
            e["upload_id"],
            store.url,
            e["key"],
            "aborted" if existed else "is gone already",
        )
    return done, None


def sweep_pending_aborts(
    store: ObjectStore, root: Path, *, max_aborts: int = DEFAULT_SWEEP_MAX_ABORTS
) -> int:
    """Abort up to ``max_aborts`` recorded uploads of ``store`` (module docstring); returns how many
    entries were settled (aborted or found gone). Never raises for a remote failure; ``OSError`` if
    the updated record cannot be written."""
    with _LOCK:
        entries, invalid = _read(root)
        if invalid:
            _write(root, [])  # once: later polls read an empty record quietly
        todo = [e for e in entries if e["url"] == store.url][:max_aborts]
    if not todo:
        return 0
    done, failed = _abort_some(store, todo)
    with _LOCK:
        entries = read_pending_aborts(root)
        keep = [
            e for e in entries if not (e["url"] == store.url and (e["key"], e["upload_id"]) in done)
        ]
        mine = [e for e in keep if e["url"] == store.url]
        if failed is not None and len(mine) > 1:  # rotate the refused entry behind the others
            moved = [e for e in mine if (e["key"], e["upload_id"]) == failed]
            keep = [e for e in keep if e not in moved] + moved
        if keep != entries:
            _write(root, keep)
    return len(done)


__all__ = [
    "DEFAULT_SWEEP_MAX_ABORTS",
    "MAX_PENDING_ABORTS",
    "MAX_PENDING_ABORTS_BYTES",
    "pending_aborts_path",
    "read_pending_aborts",
    "record_failed_abort",
    "sweep_pending_aborts",
]
