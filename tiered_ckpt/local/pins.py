"""Pinned steps (SPEC §11): ``<root>/step_XXXXXXXXXX/pinned.json``. Rotation and retention never
remove a pinned step, whatever ``keep_last`` says (:mod:`tiered_ckpt.local.rotation`), and ``gc
--superseded`` keeps a pinned superseded step too. No torch.

Writers: :meth:`tiered_ckpt.CheckpointManager.pin` (each node's committer, on its own root) and
operators. The sidecar mirrors the file to the save's remote prefix. The file is written with the
local commit protocol (temp, fsync, rename, directory fsync:
:func:`tiered_ckpt.local.commit.durable_write_bytes`), so a
pin either exists whole or not at all after a crash. Its content (sorted-key JSON) is
informational::

    {"pinned_at": "2026-01-01T00:00:00.000000Z", "step": 1234}

A step counts as pinned iff an entry named ``pinned.json`` exists, of any kind (safe side: a regular
file, empty or garbage, a symlink, dangling or not, a FIFO, a directory); what it says is not
checked. The entry is only ``lstat``-ed: never followed, never opened. :func:`pin_bytes` is what a
mirror of the pin may upload (the regular file's bytes, read without following or blocking; a
placeholder otherwise).

Rotation renames a step into trash before removing it and looks for a pin inside the trash, as it
does for locks: a pin written while rotation deletes the step either fails
(:class:`NoCheckpointError`, the step is gone) or is found and the step is put back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tiered_ckpt.errors import ManifestError, NoCheckpointError
from tiered_ckpt.fs import is_real_dir, utc_now
from tiered_ckpt.layout import PINNED_MARKER_NAME, parse_step_dir_name, step_dir_name
from tiered_ckpt.local.catalogue import (
    all_step_dirs,
    is_committed,
    read_small_regular_file,
    resolve_root,
    write_root,
)
from tiered_ckpt.local.commit import durable_write_bytes, unlink_durable

PathLike = str | os.PathLike[str]


def _step_dir(root: PathLike, step: int) -> Path:
    r = write_root(
        root
    )  # pin/unpin write: into the root as given, never the parent of a step-named root
    return r / step_dir_name(step)  # ValueError for a bad step number


#: Bytes of a ``pinned.json`` that :func:`pin_bytes` returns as they are (larger: the placeholder).
MAX_PIN_BYTES = 64 * 1024


def has_pin(step_dir: PathLike) -> bool:
    """Whether an entry named ``<step_dir>/pinned.json`` exists, of any kind (``lstat``: a symlink
    is not followed, a FIFO not opened). Never raises: an error other than "no such entry" counts as
    pinned (safe side: rotation keeps the step)."""
    try:
        os.lstat(Path(step_dir) / PINNED_MARKER_NAME)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


def pin_bytes(step_dir: PathLike, *, cap: int = MAX_PIN_BYTES) -> bytes | None:
    """What a mirror of the pin of ``step_dir`` uploads (SPEC §11: a pin holds in the bucket too),
    or ``None`` when the step is not pinned. A regular ``pinned.json`` of at most ``cap`` bytes: its
    bytes (opened with ``O_NOFOLLOW | O_NONBLOCK``). Any other pinning entry (a symlink, never
    followed; a FIFO, never read; a directory; an oversized or unreadable file): the placeholder
    ``{"pinned_at": null, "step": <step or null>}``. Never raises for the entry's kind."""
    path = Path(step_dir) / PINNED_MARKER_NAME
    if not has_pin(step_dir):
        return None
    try:
        data = read_small_regular_file(path, cap)
    except ManifestError:
        data = None
    if data is not None:
        return data
    if not os.path.lexists(path):
        return None  # removed meanwhile: unpinned
    step = parse_step_dir_name(Path(step_dir).name)
    return (json.dumps({"step": step, "pinned_at": None}, sort_keys=True) + "\n").encode()


def pin_step(root: PathLike, step: int) -> None:
    """Pin the committed ``step`` under ``root``: write ``pinned.json`` into its directory durably
    (idempotent: an existing pin is rewritten).

    Raises :class:`NoCheckpointError` if the step is not committed under ``root`` (no directory, no
    ``manifest.json``, a symlinked step directory, or the step deleted while pinning);
    ``ValueError`` for a step number outside ``[0, MAX_STEP]``; ``OSError`` for an I/O error (no pin
    written)."""
    sdir = _step_dir(root, step)
    if not is_real_dir(sdir) or not is_committed(sdir):
        raise NoCheckpointError(f"step {step} is not committed under {sdir.parent}; cannot pin it")
    body = json.dumps({"step": step, "pinned_at": utc_now()}, sort_keys=True) + "\n"
    try:
        durable_write_bytes(sdir / PINNED_MARKER_NAME, body.encode())
    except FileNotFoundError:
        raise NoCheckpointError(
            f"step {step} under {sdir.parent} was deleted while being pinned"
        ) from None


def unpin_step(root: PathLike, step: int) -> bool:
    """Remove the pin of ``step`` durably (unlink, directory fsync). Returns whether there was one;
    a step that is not pinned (or not there) is not an error. Raises ``ValueError`` for a bad step
    number, ``OSError`` for an I/O error."""
    sdir = _step_dir(root, step)
    if not is_real_dir(sdir) or not has_pin(sdir):
        return False
    return unlink_durable(sdir / PINNED_MARKER_NAME)


def is_pinned(root: PathLike, step: int) -> bool:
    """Whether ``step``'s directory under ``root`` holds a pin (committed or not). Raises
    ``ValueError`` for a bad step number only."""
    sdir = _step_dir(root, step)
    return is_real_dir(sdir) and has_pin(sdir)


def pinned_steps(root: PathLike) -> list[int]:
    """Committed steps under ``root`` that are pinned, ascending (superseded ones still in place
    included; those set aside under ``superseded/`` are not step directories of the root)."""
    r, _ = resolve_root(root)
    return [
        s
        for s in all_step_dirs(r)
        if is_committed(r / step_dir_name(s)) and has_pin(r / step_dir_name(s))
    ]


__all__ = [
    "MAX_PIN_BYTES",
    "has_pin",
    "is_pinned",
    "pin_bytes",
    "pin_step",
    "pinned_steps",
    "unpin_step",
]
