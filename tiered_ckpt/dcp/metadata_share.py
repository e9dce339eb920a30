"""One rank of a collective DCP load reads the step's metadata; the others receive it
(:class:`~tiered_ckpt.dcp.storage_reader.TieredStorageReader`, ``read_metadata``).

Without sharing, every loading rank finds the manifest, reads the metadata tensor (or the node's
``dcp_metadata.json``) and decodes it strictly: at 512 ranks x 2,000 tensors that is ~20 MB and
~2.5 s of validation and object building per rank, and, for a step only the bucket holds, a LIST
and the pointer's, run record's, upload manifests' and manifest's GETs per rank. Shared, the
group's rank 0 (the *leader*) does that once and broadcasts one payload; the others check it and
build DCP's ``Metadata`` with :func:`~tiered_ckpt.dcp.metadata_json.decode_trusted` (no second
validation; never unpickled), and, for a step from the bucket, open its copy from the shipped
upload manifest and manifest
(:func:`~tiered_ckpt.remote.restore.ranged_read.remote_step_from`): their only requests are the
ranged GETs of the shards they read.

**Payload** (two ``torch.distributed.broadcast`` calls of the group's rank 0: an int64 length, then
that many bytes as a uint8 tensor, on the group's object-collective device: the host for gloo, the
current CUDA device for NCCL; no pickle, no ``broadcast_object_list``)::

    u64 little-endian H | H bytes of JSON header | the parts the header names, concatenated

    header: {"ok": true, "step": S, "from_bucket": bool, "parts": [m, u, d],
             "metadata_sha256": hex}         # parts: manifest.json, upload manifest (0 bytes
                                             # unless from_bucket), metadata JSON
          | {"ok": false, "error": "DcpMetadataError", "message": "..."}

**The bucket, once.** When the leader read the step from its own root, one more round follows
(every rank, :func:`any_rank`): a rank whose root lacks the step (a replaced node) and has a
``remote_url`` says so; if any does, the leader opens the bucket's copy of the same save and
broadcasts its manifest and upload manifest (a payload without metadata, or the leader's error:
then those ranks open the bucket themselves, and fail as it did), so a replaced node's ranks do not
each list the bucket and read its manifests.

A failure on the leader is sent as its error's class name and message: every other rank raises
that same :class:`~tiered_ckpt.errors.CheckpointError` subclass (found among the classes already
defined, never imported by name; anything else: ``CheckpointError``), so no rank waits for a
payload that never comes and all report one typed error. A receiver checks the metadata's sha256
against the header (a transport check: the leader validated the bytes) and the manifest's own
validation (``ShardManifest.from_json``).

**When a load is collective.** DCP 2.13 calls ``read_metadata()`` on every rank inside
``local_step``, before its first collective, and tells the reader nothing of the process group or
of ``no_dist`` before ``set_up_storage_reader`` (whose ``use_collectives`` comes after the
metadata). So a broadcast there must know from elsewhere that every rank of the group is
calling: a ``dcp.load(..., no_dist=True)`` on one rank of an initialized job (rank 0 exporting)
would otherwise wait forever for ranks that never come. The reader's ``share_metadata`` says
where it learns it:

- ``None`` (default, for plain ``dcp.load(sd, storage_reader=TieredStorageReader(...))``):
  :func:`dcp_load_share` looks up the ``_load_state_dict`` frame of
  ``torch.distributed.checkpoint.state_dict_loader`` that called ``read_metadata`` and reads its
  ``_DistWrapper`` (``distW``: ``use_dist``, ``group``): shared exactly when DCP itself will run
  the load's collectives on that group. This reads DCP's private locals: where they are not found
  (another torch, a call from outside ``dcp.load``), nothing is shared, so a load never waits on
  a guess.
- ``True``: shared over the reader's ``process_group`` (``None``: the default group) whenever
  torch.distributed is initialized and the group has more than one rank;
  :func:`tiered_ckpt.dcp.load` and ``DCPCheckpointManager`` pass it (with the ``process_group``
  and ``no_dist`` they give DCP).
- ``False``: never (every rank reads and validates the metadata itself).

"Once per job": the leader is the group's rank 0, whatever the nodes; with node-local roots the
other nodes' ranks get the leader's root's manifest and metadata (byte-identical across the
nodes' roots, :mod:`tiered_ckpt.dcp.node_roots`) and read their own shards from their own root.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tiered_ckpt.errors import CheckpointError, DcpMetadataError

#: The module and function of DCP's load whose frame :func:`dcp_load_share` reads.
_DCP_LOADER = ("torch.distributed.checkpoint.state_dict_loader", "_load_state_dict")
#: Frames walked up from ``read_metadata`` looking for it (DCP 2.13: local_step, its logging
#: wrapper, reduce_scatter, _load_state_dict).
_MAX_FRAMES = 16
_HEADER_CAP = 1 << 20


@dataclass(frozen=True)
class Share:
    """A collective load: every rank of ``group`` (``None``: the default group) reads the metadata
    through one broadcast; ``rank``: this process's rank in it (0 leads)."""

    group: Any
    rank: int


def share_of(group: Any) -> Share | None:
    """A :class:`Share` over ``group`` when torch.distributed is initialized and the group has
    more than one rank, else ``None``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(group) <= 1:
        return None
    return Share(group, dist.get_rank(group))


def dcp_load_share() -> Share | None:
    """The :class:`Share` of the ``dcp.load`` that is calling (its ``_DistWrapper``: a collective
    load on its group), ``None`` when that load is not collective or no DCP load frame is found
    (see the module docstring)."""
    f = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if f is None:
            return None
        if (f.f_globals.get("__name__"), f.f_code.co_name) == _DCP_LOADER:
            w = f.f_locals.get("distW")
            if not getattr(w, "use_dist", False):
                return None
            return share_of(getattr(w, "group", None))
        f = f.f_back
    return None


# --- the payload


@dataclass(frozen=True)
class Shared:
    """What a receiver got: the step, whether its manifest came from the bucket, the exact
    ``manifest.json`` bytes, the upload manifest's (empty unless ``from_bucket``) and the
    metadata's (sha256 checked)."""

    step: int
    from_bucket: bool
    manifest: bytes
    upload_manifest: bytes
    metadata: bytes


def _frame(header: dict[str, Any], *parts: bytes) -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([struct.pack("<Q", len(h)), h, *parts])


def pack(step: int, from_bucket: bool, manifest: bytes, upload_manifest: bytes, md: bytes) -> bytes:
    """The payload of a successful read (module docstring)."""
    header = {
        "ok": True,
        "step": step,
        "from_bucket": from_bucket,
        "parts": [len(manifest), len(upload_manifest), len(md)],
        "metadata_sha256": hashlib.sha256(md).hexdigest(),
    }
    return _frame(header, manifest, upload_manifest, md)


def pack_error(exc: BaseException) -> bytes:
    """The payload of a failed read: ``exc`` 's class name (a ``CheckpointError`` 's own, anything
    else as ``CheckpointError`` naming its type) and message."""
    if isinstance(exc, CheckpointError):
        name, msg = type(exc).__name__, str(exc)
    else:
        name, msg = "CheckpointError", f"{type(exc).__name__}: {exc}"
    return _frame({"ok": False, "error": name, "message": msg[:8192]})


def _error_class(name: str) -> type[CheckpointError]:
    """The defined ``CheckpointError`` subclass named ``name`` (``CheckpointError`` if none or
    several)."""
    found: list[type[CheckpointError]] = []
    todo: list[type[CheckpointError]] = [CheckpointError]
    seen: set[type] = set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if cls.__name__ == name:
            found.append(cls)
        todo += cls.__subclasses__()
    return found[0] if len(found) == 1 else CheckpointError


def unpack(payload: bytes, where: str) -> Shared:
    """The :class:`Shared` of a payload, or the leader's error raised (its class,
    :func:`_error_class`). Raises :class:`DcpMetadataError` for a payload that is not one or
    whose metadata fails its sha256."""
    try:
        (n,) = struct.unpack_from("<Q", payload)
        if n > min(_HEADER_CAP, len(payload) - 8):
            raise ValueError(f"a header of {n} bytes")
        header = json.loads(payload[8 : 8 + n])
        if not header["ok"]:
            error, message = str(header["error"]), str(header["message"])
        else:
            error = None
            sizes = [int(x) for x in header["parts"]]
            ends = [8 + n]
            for k in sizes:
                ends.append(ends[-1] + k)
            if len(sizes) != 3 or min(sizes) < 0 or ends[-1] != len(payload):
                raise ValueError("its parts do not add up to its length")
            manifest, um, md = (payload[a:b] for a, b in zip(ends, ends[1:]))
            step, from_bucket = int(header["step"]), bool(header["from_bucket"])
            digest = str(header["metadata_sha256"])
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise DcpMetadataError(f"{where}: the leading rank's payload is malformed: {e}") from None
    if error is not None:
        cls = _error_class(error)
        try:
            exc = cls(message)
        except TypeError:  # a subclass whose constructor takes more
            exc = CheckpointError(f"{error}: {message}")
        raise exc
    if hashlib.sha256(md).hexdigest() != digest:
        raise DcpMetadataError(f"{where}: the metadata received fails its sha256")
    return Shared(step, from_bucket, manifest, um, md)


# --- the broadcast


def _device(group: Any) -> torch.device:
    try:
        from torch.distributed.distributed_c10d import _get_object_coll_device

        return torch.device(_get_object_coll_device(group))
    except Exception:  # noqa: BLE001 - an older or newer torch: gloo's host memory
        return torch.device("cpu")


def broadcast(share: Share, payload: bytes | None) -> bytes:
    """The leader's ``payload`` (rank 0 passes it, the others ``None``), on every rank of
    ``share.group``. Raises :class:`CheckpointError` when the collective fails."""
    try:
        dev = _device(share.group)
        src = 0 if share.group is None else dist.get_global_rank(share.group, 0)
        n = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        n = n.to(dev)
        dist.broadcast(n, src=src, group=share.group)
        size = int(n.item())
        if payload is not None:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
        else:
            buf = torch.empty(size, dtype=torch.uint8, device=dev)
        dist.broadcast(buf, src=src, group=share.group)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - gloo/NCCL errors are RuntimeErrors
        raise CheckpointError(
            f"sharing the DCP metadata over the process group failed: {type(e).__name__}: {e}"
        ) from e
    if payload is not None:
        return payload
    return buf.cpu().numpy().tobytes()


def any_rank(share: Share, flag: bool) -> bool:
    """Whether ``flag`` is true on any rank of ``share.group`` (an all-reduce of one integer; every
    rank calls it at the same point). Raises :class:`CheckpointError` when the collective fails."""
    try:
        t = torch.tensor([int(flag)], dtype=torch.int64).to(_device(share.group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=share.group)
        return bool(t.item())
    except Exception as e:  # noqa: BLE001 - gloo/NCCL errors are RuntimeErrors
        raise CheckpointError(
            f"asking the process group which ranks need the bucket failed: {type(e).__name__}: {e}"
        ) from e


__all__ = [
    "Share",
    "Shared",
    "any_rank",
    "broadcast",
    "dcp_load_share",
    "pack",
    "pack_error",
    "share_of",
    "unpack",
]
