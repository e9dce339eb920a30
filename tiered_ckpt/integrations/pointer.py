"""Checkpoint pointer files: the small JSON file a framework sees at a checkpoint path, naming the
run root and the committed step that hold the state. No torch.

A framework lists, compares and deletes its checkpoint paths itself (PyTorch Lightning's
``ModelCheckpoint`` keeps its top-k by path and resolves ``ckpt_path="last"`` by listing its
folder), so every path it saved must exist; the state itself is a step of the local tier. The file
(sorted-key JSON, at most :data:`MAX_POINTER_BYTES`)::

    {"format": "tiered-ckpt-pointer", "version": 1, "root": "/abs/run/root", "step": 1234}

It is written with the local commit protocol (temp file, fsync, rename), so a reader sees a whole
pointer or none.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tiered_ckpt.errors import ManifestError, NoCheckpointError
from tiered_ckpt.local.catalogue import read_small_regular_file
from tiered_ckpt.local.commit import durable_write_bytes, unlink_durable

__all__ = [
    "MAX_POINTER_BYTES",
    "POINTER_FORMAT",
    "Pointer",
    "read_pointer",
    "remove_pointer",
    "write_pointer",
]

POINTER_FORMAT = "tiered-ckpt-pointer"
#: A pointer larger than this is not one (a real checkpoint file, say): refused without reading it.
MAX_POINTER_BYTES = 64 * 1024


@dataclass(frozen=True)
class Pointer:
    """``root``: the absolute run root; ``step``: the committed step there."""

    root: Path
    step: int

    def to_bytes(self) -> bytes:
        obj = {"format": POINTER_FORMAT, "version": 1, "root": str(self.root), "step": self.step}
        return (json.dumps(obj, sort_keys=True) + "\n").encode()


def write_pointer(path: str | os.PathLike[str], pointer: Pointer) -> None:
    """Write (or replace) the pointer file ``path`` atomically and durably; creates its folder.
    Raises ``OSError``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    durable_write_bytes(p, pointer.to_bytes())


def read_pointer(path: str | os.PathLike[str]) -> Pointer:
    """The pointer stored at ``path``. Raises :class:`NoCheckpointError` when there is no regular
    file there, :class:`ManifestError` when the file is not a pointer (too large, not JSON, another
    format: a framework's own checkpoint file is refused here, never unpickled)."""
    p = Path(path)
    try:
        raw = read_small_regular_file(p, MAX_POINTER_BYTES)  # ManifestError: larger, a symlink
    except OSError as exc:
        raise NoCheckpointError(f"{p}: cannot read the checkpoint pointer: {exc}") from exc
    if raw is None:
        raise NoCheckpointError(f"{p}: no checkpoint pointer (not a regular file)")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise ManifestError(f"{p}: not a tiered-ckpt pointer (not JSON)") from None
    if (
        not isinstance(obj, dict)
        or obj.get("format") != POINTER_FORMAT
        or obj.get("version") != 1
        or not isinstance(obj.get("root"), str)
        or type(obj.get("step")) is not int
        or obj["step"] < 0
    ):
        raise ManifestError(f"{p}: not a tiered-ckpt pointer of version 1")
    return Pointer(Path(obj["root"]), obj["step"])


def remove_pointer(path: str | os.PathLike[str]) -> bool:
    """Remove the pointer file (durably); returns whether it existed."""
    return unlink_durable(path)
