"""``tiered-ckpt verify --remote s3://bucket/prefix``: the state of every remote save, checked
against its upload manifest with the same code restore uses
(:func:`~tiered_ckpt.remote.restore.plan.plan_step`,
:func:`~tiered_ckpt.remote.restore.download.fetch_shard`), so a save that verifies is one that restores.

- ``committed``: upload manifest valid, mirrored ``manifest.json`` matches its sha256, every shard
  object present with the right size (HEAD) and, unless ``fast``, downloaded and matching its sha256
  and header; with ``fast``, the checksum the server stores for each object matching the recorded
  one (:mod:`tiered_ckpt.remote.inspect.stored_checksums`).
  A committed save that is not its step's current one (SPEC §11) says why in its reason:
  ``superseded by attempt K from step S``, ``replaced by save X (attempt K)`` or ``run X, not the
  prefix's run Y`` (listed, never restored);
- ``uncommitted``: objects without an upload manifest (an upload in progress or abandoned);
- ``corrupt``: a bad upload manifest or manifest, or a shard whose size, sha256 or header is wrong
  (with ``fast``: whose stored checksum differs from the recorded one, or which another object
  replaced);
- ``incomplete``: an object the upload manifest lists is missing.

One row per save, by step, the step's current save first (a :class:`RemoteStepStatus`: ``checked``
says how a committed row was checked, :data:`~tiered_ckpt.remote.inspect.stored_checksums.CHECKED_LEVELS`:
``sha256`` for the full check; with ``fast`` ``crc32c`` or ``server-sha256`` (the weakest over its
shards) where the server stores checksums, ``size`` where it stores none, which the row's note then
says: ``size only: the server stores no CRC32C or SHA-256 checksum``). ``fast`` downloads no shard:
it catches an object replaced or re-uploaded since the commit, or a wrong part, never bytes rotting
at rest on the server. Downloads go to a temporary directory and are deleted after hashing.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import CheckpointError, MissingShardError, NoCheckpointError, UploadError
from tiered_ckpt.local.scan import COMMITTED, CORRUPT, INCOMPLETE, UNCOMMITTED, StepStatus
from tiered_ckpt.remote.catalogue import (
    CURRENT,
    REMOTE_NO_UPLOAD_MANIFEST,
    RemoteSave,
    read_catalogue,
    remote_steps_of,
)
from tiered_ckpt.remote.handle import StoreHandle
from tiered_ckpt.remote.inspect.stored_checksums import check_stored_checksums, summarize
from tiered_ckpt.remote.restore.download import fetch_shard
from tiered_ckpt.remote.restore.plan import plan_step
from tiered_ckpt.store.base import ObjectStore, RemoteNotFoundError


@dataclass(frozen=True)
class RemoteStepStatus(StepStatus):
    """A :class:`~tiered_ckpt.local.scan.StepStatus` of a remote save, plus ``checked`` (committed
    rows: one of :data:`~tiered_ckpt.remote.inspect.stored_checksums.CHECKED_LEVELS`; ``None`` otherwise)
    and ``checked_note`` (``"size only: ..."`` when some shard was checked by size only; shown among
    the :attr:`details`, so in the note and the verify line, never as a key of its own)."""

    checked: str | None = None
    checked_note: str = ""

    @property
    def details(self) -> list[str]:
        return super().details + ([self.checked_note] if self.checked_note else [])

    def to_dict(self) -> dict[str, object]:
        d = super().to_dict()
        del d["checked_note"]
        return d


def scan_remote(
    remote_url: str,
    *,
    step: int | None = None,
    fast: bool = False,
    s3_client: Any = None,
    store: ObjectStore | None = None,
    endpoint_url: str | None = None,
) -> list[RemoteStepStatus]:
    """:class:`RemoteStepStatus` of every save of ``step``, or of every remote save.

    Never raises for a bad remote save (the fault is its ``reason``); raises
    :class:`~tiered_ckpt.errors.UploadError` when the bucket cannot be read at all,
    ``ManifestError`` when its ``run.json`` is unreadable.
    """
    handle = StoreHandle(remote_url, store=store, s3_client=s3_client, endpoint_url=endpoint_url)
    with handle as st:  # Ctrl-C cuts the download in flight (handle.cancel), never waits it out
        cat = read_catalogue(st)
        saves = {(s.step, s.save_id): s for s in cat.saves}
        out = []
        for rs in remote_steps_of(cat):
            if step is not None and rs.step != step:
                continue
            save = saves.get((rs.step, rs.save_id)) if rs.ok else None
            if rs.state == REMOTE_NO_UPLOAD_MANIFEST:
                out.append(
                    RemoteStepStatus(
                        rs.step, UNCOMMITTED, rs.reason, size_bytes=0, save_id=rs.save_id
                    )
                )
            elif save is None:
                out.append(
                    RemoteStepStatus(
                        rs.step, CORRUPT, f"{rs.state}: {rs.reason}", save_id=rs.save_id
                    )
                )
            else:
                note = "" if rs.status == CURRENT else rs.status
                out.append(_check_save(st, save, rs.latest, fast, note, handle.cancel))
        return out


def _check_save(
    store: ObjectStore,
    save: RemoteSave,
    latest: bool,
    fast: bool,
    note: str,
    cancel: Callable[[], None] | None = None,
) -> RemoteStepStatus:
    step = save.step
    try:
        plan = plan_step(store, save, None, from_pointer=latest)
    except (MissingShardError, NoCheckpointError, RemoteNotFoundError) as exc:
        return RemoteStepStatus(step, INCOMPLETE, str(exc), save_id=save.save_id)
    except UploadError:
        raise  # the bucket cannot be read (throttled, slow, denied): no verdict on the step
    except CheckpointError as exc:
        return RemoteStepStatus(step, CORRUPT, str(exc), save_id=save.save_id)
    m = plan.manifest
    if fast:
        checks = check_stored_checksums(store, save, plan)
        bad = next((c for c in checks if c.fault), None)
        if bad is not None:
            return RemoteStepStatus(
                step,
                INCOMPLETE if bad.missing else CORRUPT,
                bad.fault,
                m.world_size,
                plan.total_bytes,
                m.save_id,
            )
        checked, checked_note = summarize(checks)
        return RemoteStepStatus(
            step,
            COMMITTED,
            note,
            m.world_size,
            plan.total_bytes,
            m.save_id,
            checked=checked,
            checked_note=checked_note,
        )
    with tempfile.TemporaryDirectory(prefix="tiered-ckpt-verify-") as tmp:
        for obj in plan.objects:
            path = Path(tmp) / f"rank_{obj.rank}.part"
            try:
                fetch_shard(store, plan, obj, path, None, cancel)
            except (MissingShardError, RemoteNotFoundError) as exc:
                return RemoteStepStatus(
                    step, INCOMPLETE, str(exc), m.world_size, plan.total_bytes, m.save_id
                )
            except UploadError:
                raise
            except CheckpointError as exc:
                return RemoteStepStatus(
                    step, CORRUPT, str(exc), m.world_size, plan.total_bytes, m.save_id
                )
            finally:
                path.unlink(missing_ok=True)
    return RemoteStepStatus(
        step, COMMITTED, note, m.world_size, plan.total_bytes, m.save_id, checked="sha256"
    )


__all__ = ["RemoteStepStatus", "scan_remote"]
