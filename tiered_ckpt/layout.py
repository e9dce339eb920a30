"""Names of steps, shards and markers, locally and remotely. Pure: no I/O.

Local layout (SPEC §2, §11)::

    <root>/step_0000001234/rank_00000.safetensors   one file per rank, written by that rank
    <root>/step_0000001234/manifest.json            the commit point, written last
    <root>/step_0000001234/{uploaded,pinned,node_ranks,adopted}.json   markers
    <root>/run.json                                 run id and lineage
    <root>/superseded/step_0000001234.<save_id>/    a step set aside by a newer attempt
    <root>/.node.<token>                            node discovery token of a live rank

Remote layout (SPEC §4, §11): one key prefix per save::

    <prefix>/run.json                                        run claim + lineage
    <prefix>/latest                                          newest current step
    <prefix>/step_0000001234.<save_id>/{rank_00000.safetensors, manifest.json,
        .confirm/rank_00000.json, upload_manifest.json, pinned.json}

Key layout ``hashed`` (:data:`KEY_LAYOUTS`) moves only the shard objects to
``<prefix>/shards/<hh>/step_0000001234.<save_id>/rank_00000.safetensors``, ``<hh>``
(:func:`spread_prefix`) the first two hex digits of the sha256 of the flat key relative to the
prefix. Prefixes written before per-save prefixes (upload manifest schema 1) hold
``<prefix>/step_0000001234/``; :func:`parse_remote_step_entry` returns ``save_id=None`` for them.
Step numbers are zero-padded to 10 digits so that lexical order is numeric order.
"""

from __future__ import annotations

import hashlib
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
#: Folder of the per-shard confirmation records inside a remote step (remote/upload/commit.py).
CONFIRM_DIR = ".confirm"
#: Remote keys of the store's checksum-validation probe (store/probe.py), relative to the prefix.
PROBE_KEY_PREFIX = ".tiered_ckpt_probe/"
#: Run id and lineage of a root, and the run claim of a prefix (format/lineage.py).
RUN_RECORD_NAME = "run.json"
#: Folder of a root where superseded steps are set aside, as ``step_XXXXXXXXXX.<save_id>``.
SUPERSEDED_DIR = "superseded"
#: Pin of a step (local step directory, and the remote save prefix): rotation and retention keep it.
PINNED_MARKER_NAME = "pinned.json"
#: The ranks a node-local step directory holds (local/held_ranks.py).
NODE_RANKS_NAME = "node_ranks.json"
#: A DCP step's metadata in a node-local root whose ranks do not hold it (tiered_ckpt.dcp.node_roots).
DCP_METADATA_NAME = "dcp_metadata.json"
#: A step restored from another run: the root's run and attempt it entered in (local/catalogue.py).
ADOPTED_MARKER_NAME = "adopted.json"
#: Prefix of the node discovery tokens in a root (which ranks share this disk; training/dist.py).
NODE_TOKEN_PREFIX = ".node."
#: Multipart uploads the sidecar started and could not abort, swept later
#: (remote/upload/pending_aborts.py).
PENDING_ABORTS_NAME = ".pending_aborts.json"

#: Key layouts of a save's shard objects (module docstring); ``flat`` is the default.
KEY_LAYOUTS = ("flat", "hashed")
#: Folder of the ``hashed`` layout's shard objects, directly under the run prefix.
SPREAD_DIR = "shards"
#: Hex digits of the ``hashed`` layout's spread prefix: 16**2 = 256 prefixes.
SPREAD_HEX_DIGITS = 2

# ASCII digits only ("\d" would also match other scripts' digits) and a whole-string match ("$"
# would also accept a trailing newline): one step number has exactly one directory name.
_STEP_RE = re.compile(r"step_([0-9]{%d})" % STEP_DIGITS)
_SAVE_ID_CHARS = "[0-9A-Za-z_-]{1,64}"
_SAVE_ID_RE = re.compile(_SAVE_ID_CHARS)
_ENTRY_RE = re.compile(r"step_([0-9]{%d})(?:\.(%s))?" % (STEP_DIGITS, _SAVE_ID_CHARS))
_SHARD_RE = re.compile(r"rank_([0-9]{%d})\.safetensors" % RANK_DIGITS)
_SPREAD_RE = re.compile(
    r"%s/([0-9a-f]{%d})/step_([0-9]{%d})\.(%s)/rank_([0-9]{%d})\.safetensors"
    % (SPREAD_DIR, SPREAD_HEX_DIGITS, STEP_DIGITS, _SAVE_ID_CHARS, RANK_DIGITS)
)


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


def remote_run_key(prefix: str) -> str:
    """Key of the run claim + lineage record of ``prefix``: ``<prefix>/run.json``."""
    p = prefix.strip("/")
    return f"{p}/{RUN_RECORD_NAME}" if p else RUN_RECORD_NAME


def save_entry_name(step: int, save_id: str | None) -> str:
    """``step_0000001234.<save_id>``: the name of one save of a step (a remote save prefix, a
    superseded local step). ``save_id=None``: the round-1 name ``step_0000001234``. Raises
    ``ValueError`` for a bad step or save id."""
    if save_id is None:
        return step_dir_name(step)
    if not isinstance(save_id, str) or not _SAVE_ID_RE.fullmatch(save_id):
        raise ValueError(f"save_id must match {_SAVE_ID_CHARS}, got {save_id!r}")
    return f"{step_dir_name(step)}.{save_id}"


def parse_remote_step_entry(name: str) -> tuple[int, str | None] | None:
    """Inverse of :func:`save_entry_name`: ``(step, save_id)``, ``save_id`` ``None`` for a round-1
    entry; ``None`` for any other name."""
    m = _ENTRY_RE.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else None


def remote_save_prefix(prefix: str, step: int, save_id: str | None) -> str:
    """Key prefix of one save of a step: ``<prefix>/step_XXXXXXXXXX.<save_id>`` (no trailing slash);
    ``save_id=None`` gives the round-1 ``<prefix>/step_XXXXXXXXXX``."""
    p = prefix.strip("/")
    name = save_entry_name(step, save_id)
    return f"{p}/{name}" if p else name


def remote_save_key(prefix: str, step: int, save_id: str | None, name: str) -> str:
    """Key of file ``name`` (shard, manifest, upload manifest, pin) of one save of ``step``."""
    return f"{remote_save_prefix(prefix, step, save_id)}/{name}"


def spread_prefix(step: int, save_id: str, rank: int) -> str:
    """``<hh>`` of the ``hashed`` layout: the first :data:`SPREAD_HEX_DIGITS` hex digits of
    ``sha256("step_XXXXXXXXXX.<save_id>/rank_XXXXX.safetensors")`` (the flat key, relative to the
    run prefix). Stable across versions and machines. Raises ``ValueError`` for a bad step, save id
    or rank."""
    flat = f"{save_entry_name(step, save_id)}/{shard_file_name(rank)}"
    return hashlib.sha256(flat.encode("ascii")).hexdigest()[:SPREAD_HEX_DIGITS]


def save_shard_key(step: int, save_id: str | None, rank: int, key_layout: str = "flat") -> str:
    """Key of ``rank``'s shard object of one save, relative to the run prefix: ``flat``
    ``step_XXXXXXXXXX.<save_id>/rank_XXXXX.safetensors``; ``hashed``
    ``shards/<hh>/step_XXXXXXXXXX.<save_id>/rank_XXXXX.safetensors``. Raises ``ValueError`` for an
    unknown layout, a bad step, save id or rank, and for ``hashed`` with ``save_id=None`` (round-1
    saves are flat)."""
    if key_layout not in KEY_LAYOUTS:
        raise ValueError(f"key_layout must be one of {KEY_LAYOUTS}, got {key_layout!r}")
    flat = f"{save_entry_name(step, save_id)}/{shard_file_name(rank)}"
    if key_layout == "flat":
        return flat
    if save_id is None:
        raise ValueError("the hashed key layout needs a save id (round-1 saves are flat)")
    return f"{SPREAD_DIR}/{spread_prefix(step, save_id, rank)}/{flat}"


def remote_shard_key(
    prefix: str, step: int, save_id: str | None, rank: int, key_layout: str = "flat"
) -> str:
    """Full key (run prefix included) of :func:`save_shard_key`: what the upload manifest and the
    confirmation records name. ``flat`` equals ``remote_save_key(prefix, step, save_id,
    shard_file_name(rank))``."""
    p = prefix.strip("/")
    rel = save_shard_key(step, save_id, rank, key_layout)
    return f"{p}/{rel}" if p else rel


def parse_spread_shard_key(rel_key: str) -> tuple[int, str, int] | None:
    """``(step, save_id, rank)`` of a ``hashed``-layout shard key relative to the run prefix (its
    ``<hh>`` must be the one :func:`spread_prefix` gives); ``None`` for any other key."""
    m = _SPREAD_RE.fullmatch(rel_key)
    if m is None:
        return None
    step, save_id, rank = int(m.group(2)), m.group(3), int(m.group(4))
    return (step, save_id, rank) if m.group(1) == spread_prefix(step, save_id, rank) else None


__all__ = [
    "STEP_DIGITS",
    "RANK_DIGITS",
    "MAX_STEP",
    "MAX_WORLD_SIZE",
    "MANIFEST_NAME",
    "UPLOAD_MANIFEST_NAME",
    "LATEST_POINTER_NAME",
    "UPLOADED_MARKER_NAME",
    "SAVE_LOCK_NAME",
    "LOCK_PREFIX",
    "TMP_SUFFIX",
    "step_dir_name",
    "parse_step_dir_name",
    "shard_file_name",
    "parse_shard_file_name",
    "remote_step_prefix",
    "remote_key",
    "remote_latest_key",
    "RUN_RECORD_NAME",
    "SUPERSEDED_DIR",
    "PINNED_MARKER_NAME",
    "ADOPTED_MARKER_NAME",
    "NODE_TOKEN_PREFIX",
    "NODE_RANKS_NAME",
    "DCP_METADATA_NAME",
    "remote_run_key",
    "save_entry_name",
    "parse_remote_step_entry",
    "remote_save_prefix",
    "remote_save_key",
    "PENDING_ABORTS_NAME",
    "KEY_LAYOUTS",
    "SPREAD_DIR",
    "SPREAD_HEX_DIGITS",
    "spread_prefix",
    "save_shard_key",
    "remote_shard_key",
    "parse_spread_shard_key",
]
