"""Names of steps, shards and markers, locally and remotely. Pure: no I/O.

Local layout (SPEC §2)::

    <root>/step_0000001234/rank_00000.safetensors   one file per rank, written by that rank
    <root>/step_0000001234/manifest.json            the commit point, written last

Remote layout (SPEC §4)::

    <prefix>/step_0000001234/rank_00000.safetensors
    <prefix>/step_0000001234/manifest.json          copy of the local manifest
    <prefix>/step_0000001234/upload_manifest.json   remote commit point, written last
    <prefix>/latest                                 pointer to the newest remotely committed step

Step numbers are zero-padded to 10 digits so that lexical order is numeric order.
"""

from __future__ import annotations

import re

STEP_DIGITS = 10
RANK_DIGITS = 5
MAX_STEP = 10**STEP_DIGITS - 1
MAX_WORLD_SIZE = 10**RANK_DIGITS

MANIFEST_NAME = "manifest.json"
UPLOAD_MANIFEST_NAME = "upload_manifest.json"
LATEST_POINTER_NAME = "latest"
#: Written into a local step directory by the sidecar after the remote commit (see upload.py).
UPLOADED_MARKER_NAME = "uploaded.json"
#: Content-based writer lock of a step being saved (see local.py, invariant I4).
SAVE_LOCK_NAME = ".save.lock"
#: Prefix of advisory lock files (readers, uploader) in a step directory (see _locks.py).
LOCK_PREFIX = ".lock."
TMP_SUFFIX = ".tmp"
#: Prefix of a step directory being deleted (renamed first, then removed; local/trash.py).
TRASH_PREFIX = ".trash."
#: Folder of the per-shard confirmation records inside a remote step (remote/commit.py).
CONFIRM_DIR = ".confirm"
#: Remote keys of the store's checksum-validation probe (store/probe.py), relative to the prefix.
PROBE_KEY_PREFIX = ".tiered_ckpt_probe/"

# ASCII digits only ("\d" would also match other scripts' digits) and a whole-string match ("$" would
# also accept a trailing newline): one step number has exactly one directory name.
_STEP_RE = re.compile(r"step_([0-9]{%d})" % STEP_DIGITS)
_SHARD_RE = re.compile(r"rank_([0-9]{%d})\.safetensors" % RANK_DIGITS)


def step_dir_name(step: int) -> str:
    """``step_0000001234`` for step 1234. Raises ``ValueError`` outside ``[0, MAX_STEP]``."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an int in [0, {MAX_STEP}], got {step!r}")
    return f"step_{step:0{STEP_DIGITS}d}"


def parse_step_dir_name(name: str) -> int | None:
    """Inverse of :func:`step_dir_name`; ``None`` for any other name."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def shard_file_name(rank: int) -> str:
    """``rank_00003.safetensors`` for rank 3."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_WORLD_SIZE:
        raise ValueError(f"rank must be an int in [0, {MAX_WORLD_SIZE}), got {rank!r}")
    return f"rank_{rank:0{RANK_DIGITS}d}.safetensors"


def parse_shard_file_name(name: str) -> int | None:
    """Inverse of :func:`shard_file_name`; ``None`` for any other name."""
    m = _SHARD_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def remote_step_prefix(prefix: str, step: int) -> str:
    """Key prefix of a step in the bucket: ``<prefix>/step_XXXXXXXXXX`` (no trailing slash)."""
    p = prefix.strip("/")
    return f"{p}/{step_dir_name(step)}" if p else step_dir_name(step)


def remote_key(prefix: str, step: int, name: str) -> str:
    """Key of a file ``name`` (shard, manifest, upload manifest) of ``step`` under ``prefix``."""
    return f"{remote_step_prefix(prefix, step)}/{name}"


def remote_latest_key(prefix: str) -> str:
    p = prefix.strip("/")
    return f"{p}/{LATEST_POINTER_NAME}" if p else LATEST_POINTER_NAME


__all__ = [
    "STEP_DIGITS", "RANK_DIGITS", "MAX_STEP", "MAX_WORLD_SIZE", "MANIFEST_NAME", "UPLOAD_MANIFEST_NAME",
    "LATEST_POINTER_NAME", "UPLOADED_MARKER_NAME", "SAVE_LOCK_NAME", "LOCK_PREFIX", "TMP_SUFFIX",
    "step_dir_name", "parse_step_dir_name", "shard_file_name", "parse_shard_file_name",
    "remote_step_prefix", "remote_key", "remote_latest_key",
]
