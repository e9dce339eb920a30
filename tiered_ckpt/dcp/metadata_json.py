"""DCP's global ``Metadata`` as JSON (never pickle): :func:`encode` and a strict, bounded
:func:`decode`. Stored as a uint8 tensor in the coordinator's shard (covered by its sha256 and
per-chunk CRC32Cs). Format 1::

    {"format": 1, "version": "1.0.0" | null,
     "state_dict_metadata": {fqn: {"kind": "bytes", "rank": r}
                                | {"kind": "tensor", "dtype": "float32", "size": [d0, ...],
                                   "requires_grad": bool, "pin_memory": bool,
                                   "memory_format": "contiguous_format" | "channels_last" | "preserve_format",
                                   "chunks": [rank, o0, ..., s0, ..., rank, ...]}},  # per chunk: rank,
                                                                    # offsets, sizes (1 + 2 x ndim ints)
     "planner_data": null | {fqn: [path item (str | int), ...]},     # DefaultSavePlanner's flatten mapping
     "storage_meta": null | {"checkpoint_id": str | null, "save_id": str | null, "load_id": str | null,
                             "modules": [str, ...]}}

``Metadata.storage_data`` is not stored: an item's tensor name follows from its index, so each item
records only its rank, and :func:`decode` returns a :class:`~tiered_ckpt.dcp.placement.Placement`.
``TensorProperties.layout`` is always ``torch.strided``.

:func:`decode` checks through :func:`tiered_ckpt.format.dcp_metadata.parse` (which ``tiered-ckpt
verify`` uses too): every field's type and range, the chunks tiling each tensor exactly, every rank
below the manifest's ``world_size``, and caps on the bytes, entries and chunks, checked before
anything proportional to them is allocated. Every failure raises
:class:`~tiered_ckpt.errors.DcpMetadataError`.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tiered_ckpt.dcp.items import DTYPE_BY_NAME, DTYPE_NAME
from tiered_ckpt.dcp.placement import BYTES, Placement
from tiered_ckpt.errors import DcpMetadataError, UnsupportedStateError
from tiered_ckpt.format import dcp_metadata
from tiered_ckpt.format.dcp_metadata import FORMAT, MAX_METADATA_BYTES, BytesEntry, TensorEntry

_MEMORY_FORMATS = {
    torch.contiguous_format: "contiguous_format",
    torch.channels_last: "channels_last",
    torch.preserve_format: "preserve_format",
}
_MEMORY_FORMAT_BY_NAME = {v: k for k, v in _MEMORY_FORMATS.items()}


# --- encode


def _refuse(msg: str) -> UnsupportedStateError:
    return UnsupportedStateError(f"DCP metadata cannot be stored as JSON: {msg}")


def _enc_storage(fqn: str, md: Any, placement: Placement) -> dict[str, Any]:
    if isinstance(md, BytesStorageMetadata):
        rank = placement.rank_of(fqn, BYTES)
        if rank is None:
            raise _refuse(f"{fqn[:80]!r}: the byte item is not placed")
        return {"kind": "bytes", "rank": rank}
    if not isinstance(md, TensorStorageMetadata):
        raise _refuse(f"{fqn[:80]!r}: storage metadata of type {type(md).__name__}")
    p = md.properties
    if (
        p.dtype not in DTYPE_NAME
        or p.layout != torch.strided
        or p.memory_format not in _MEMORY_FORMATS
    ):
        raise _refuse(
            f"{fqn[:80]!r}: dtype {p.dtype}, layout {p.layout}, memory format {p.memory_format}"
        )
    ranks = placement.ranks.get(fqn, {})
    chunks: list[int] = []
    for c in md.chunks:
        off = tuple(c.offsets)
        rank = ranks.get(off)
        if rank is None:
            raise _refuse(f"{fqn[:80]!r}: the chunk at {list(off)[:8]} is not placed")
        chunks.append(rank)
        chunks += off
        chunks += c.sizes
    return {
        "kind": "tensor",
        "dtype": DTYPE_NAME[p.dtype],
        "size": [int(d) for d in md.size],
        "requires_grad": bool(p.requires_grad),
        "pin_memory": bool(p.pin_memory),
        "memory_format": _MEMORY_FORMATS[p.memory_format],
        "chunks": chunks,
    }


def _enc_planner(data: Any) -> Any:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise _refuse(
            f"planner_data of type {type(data).__name__} (only DefaultSavePlanner's flatten mapping)"
        )
    out = {}
    for fqn, path in data.items():
        if (
            not isinstance(fqn, str)
            or not isinstance(path, (tuple, list))
            or not all(
                isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in path
            )
        ):
            raise _refuse(f"planner_data entry {str(fqn)[:80]!r} is not a path of str/int items")
        out[fqn] = list(path)
    return out


def _enc_meta(sm: StorageMeta | None) -> Any:
    if sm is None:
        return None
    cid = None if sm.checkpoint_id is None else str(sm.checkpoint_id)
    return {
        "checkpoint_id": cid,
        "save_id": sm.save_id,
        "load_id": sm.load_id,
        "modules": list(sm.modules),
    }


def encode(md: Metadata) -> bytes:
    """``md`` as compact JSON (UTF-8). ``storage_data`` must map every chunk and byte item of
    ``state_dict_metadata`` (and nothing else) to its :class:`~tiered_ckpt.dcp.items.ItemLocation`
    (what the writer records; a :class:`Placement` or a dict). Raises :class:`UnsupportedStateError`
    for anything the format cannot hold (another planner's ``planner_data``, a non-strided tensor,
    an item not placed or placed under another name) or a load would refuse for its size (the caps
    of :mod:`tiered_ckpt.format.dcp_metadata`: bytes, keys, chunks per tensor and in all)."""
    if not isinstance(md.storage_data, (dict, Placement)):
        raise _refuse(f"storage_data of type {type(md.storage_data).__name__}")
    try:
        placement = Placement.of(md.storage_data)
    except ValueError as e:
        raise _refuse(str(e)) from None
    sdm = {fqn: _enc_storage(fqn, v, placement) for fqn, v in md.state_dict_metadata.items()}
    items = sum(
        1 if v["kind"] == "bytes" else len(v["chunks"]) // (1 + 2 * len(v["size"]))
        for v in sdm.values()
    )
    if items != len(placement):
        raise _refuse(f"storage_data places {len(placement)} items, the metadata describes {items}")
    _check_caps(md)
    obj = {
        "format": FORMAT,
        "version": md.version,
        "state_dict_metadata": sdm,
        "planner_data": _enc_planner(md.planner_data),
        "storage_meta": _enc_meta(md.storage_meta),
    }
    raw = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    if len(raw) > MAX_METADATA_BYTES:
        raise _refuse(f"{len(raw)} bytes of JSON, over the {MAX_METADATA_BYTES}-byte cap")
    return raw


def _check_caps(md: Metadata) -> None:
    """What a load would refuse past :mod:`~tiered_ckpt.format.dcp_metadata` 's caps is refused
    before the save writes anything."""
    n = len(md.state_dict_metadata)
    if n > dcp_metadata.MAX_ENTRIES:
        raise _refuse(f"{n} keys, over the cap of {dcp_metadata.MAX_ENTRIES}")
    total = 0
    for fqn, v in md.state_dict_metadata.items():
        n = len(getattr(v, "chunks", ()))
        if n > dcp_metadata.MAX_CHUNKS_PER_TENSOR:
            raise _refuse(
                f"{fqn[:80]!r} has {n} chunks, over the cap of {dcp_metadata.MAX_CHUNKS_PER_TENSOR}"
            )
        total += n
    if total > dcp_metadata.MAX_CHUNKS:
        raise _refuse(f"{total} chunks in all, over the cap of {dcp_metadata.MAX_CHUNKS}")


# --- decode


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while the per-chunk objects (none of them in a cycle) are
    built: with torch imported a full collection walks millions of objects, and the collections a
    million new objects set off took 10x the building itself."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _tensor(
    e: TensorEntry, shared: dict[tuple[int, ...], torch.Size]
) -> tuple[TensorStorageMetadata, dict[Any, int]]:
    """DCP's metadata of one tensor, and its chunks' ``{offsets: rank}``. ``shared``: one
    ``torch.Size`` per distinct offsets or sizes across the whole metadata (FSDP's chunks of
    every tensor sit at the same few offsets; immutable, so shared), filled here."""
    nd, n = len(e.size), len(e.chunks)
    cols = e.chunks.T.tolist()  # a few long lists: no object per chunk before the chunk's own
    chunks, offsets = [], []
    new, tsize, get = ChunkStorageMetadata, torch.Size, shared.get
    pairs = zip(zip(*cols[1 : 1 + nd]), zip(*cols[1 + nd :])) if nd else [((), ())] * n
    for o, s in pairs:
        to = get(o)
        if to is None:
            to = shared[o] = tsize(o)
        ts = get(s)
        if ts is None:
            ts = shared[s] = tsize(s)
        offsets.append(to)  # also the placement's key (a tuple: same hash, equal)
        chunks.append(new(to, ts))
    props = TensorProperties(
        dtype=DTYPE_BY_NAME[e.dtype],
        layout=torch.strided,
        requires_grad=e.requires_grad,
        memory_format=_MEMORY_FORMAT_BY_NAME[e.memory_format],
        pin_memory=e.pin_memory,
    )
    md = TensorStorageMetadata(properties=props, size=torch.Size(e.size), chunks=chunks)
    return md, dict(zip(offsets, cols[0]))


def _metadata(table: dcp_metadata.MetadataTable) -> Metadata:
    sdm: dict[str, Any] = {}
    placed: dict[str, dict[Any, int]] = {}
    shared: dict[tuple[int, ...], torch.Size] = {}
    with _gc_paused():
        for fqn, e in table.entries.items():
            if isinstance(e, BytesEntry):
                sdm[fqn], placed[fqn] = BytesStorageMetadata(), {BYTES: e.rank}
            else:
                sdm[fqn], placed[fqn] = _tensor(e, shared)
    sm = table.storage_meta
    return Metadata(
        state_dict_metadata=sdm,
        planner_data=table.planner_data,
        storage_data=Placement(placed),
        storage_meta=None if sm is None else StorageMeta(**sm),
        version=table.version,
    )


def decode(raw: bytes, world_size: int, where: str = "DCP metadata") -> Metadata:
    """The ``Metadata`` :func:`encode` wrote, validated by
    :func:`tiered_ckpt.format.dcp_metadata.parse` (the rules ``tiered-ckpt verify`` checks a step
    by; caps and costs in that module's docstring); ``world_size``: the step's, which every storage
    rank must be below. Raises :class:`DcpMetadataError` (the message starts with ``where``), also
    for a dtype this torch lacks."""
    table = dcp_metadata.parse(raw, world_size, where)
    for fqn, e in table.entries.items():
        if isinstance(e, TensorEntry) and e.dtype not in DTYPE_BY_NAME:
            raise DcpMetadataError(f"{where}: {fqn[:80]!r} has dtype {e.dtype}, unknown to torch")
    return _metadata(table)


def decode_trusted(raw: bytes, where: str = "DCP metadata") -> Metadata:
    """The ``Metadata`` of bytes :func:`decode` already accepted elsewhere, without validating
    them again (:func:`tiered_ckpt.format.dcp_metadata.parse_trusted`): for the DCP reader's ranks
    that receive the metadata its leading rank read, decoded and sent with its sha256 (checked by
    the receiver first). Never unpickles. Raises :class:`DcpMetadataError` for bytes without the
    shape of a metadata (other damage is not diagnosed: pass only bytes :func:`decode` accepted)."""
    table = dcp_metadata.parse_trusted(raw, where)
    try:
        return _metadata(table)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise DcpMetadataError(
            f"{where}: not a metadata table ({type(e).__name__}: {str(e)[:200]})"
        ) from None


__all__ = ["FORMAT", "MAX_METADATA_BYTES", "decode", "decode_trusted", "encode"]
