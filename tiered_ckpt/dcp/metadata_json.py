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

:func:`decode` checks every field's type and range, the chunks tiling each tensor exactly, every rank
below the manifest's ``world_size``; input capped at :data:`MAX_METADATA_BYTES`. Every failure
raises :class:`~tiered_ckpt.errors.DcpMetadataError`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
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
from tiered_ckpt.errors import DcpMetadataError, ManifestError, UnsupportedStateError
from tiered_ckpt.format.tensor_index import MAX_NAME_LEN
from tiered_ckpt.format.validate import (
    MAX_NUMEL,
    check_keys,
    fail,
    first_overlap,
    int_field,
    int_list,
    loads_json,
    str_field,
)
from tiered_ckpt.layout import MAX_WORLD_SIZE

FORMAT = 1
#: Largest metadata accepted (bytes of JSON); a larger one is refused before it is read.
MAX_METADATA_BYTES = 1 << 30
#: Longest flatten path of one key (DCP's nesting of dicts and lists), and the longest short string.
MAX_PATH_ITEMS = 256
MAX_SHORT_STR = 4096
_MEMORY_FORMATS = {
    torch.contiguous_format: "contiguous_format",
    torch.channels_last: "channels_last",
    torch.preserve_format: "preserve_format",
}
_MEMORY_FORMAT_BY_NAME = {v: k for k, v in _MEMORY_FORMATS.items()}
_TOP_KEYS = {"format", "version", "state_dict_metadata", "planner_data", "storage_meta"}
_TENSOR_KEYS = {"kind", "dtype", "size", "requires_grad", "pin_memory", "memory_format", "chunks"}
_META_KEYS = {"checkpoint_id", "save_id", "load_id", "modules"}


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
    an item not placed or placed under another name)."""
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
    obj = {
        "format": FORMAT,
        "version": md.version,
        "state_dict_metadata": sdm,
        "planner_data": _enc_planner(md.planner_data),
        "storage_meta": _enc_meta(md.storage_meta),
    }
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


# --- decode


def _opt_str(v: Any, what: str) -> str | None:
    if v is None:
        return None
    s = str_field(v, what)
    if len(s) > MAX_SHORT_STR:
        raise fail(f"{what} is longer than {MAX_SHORT_STR} characters")
    return s


def _bool(v: Any, what: str) -> bool:
    if not isinstance(v, bool):
        raise fail(f"{what} must be true or false, got {type(v).__name__}")
    return v


def _dec_tensor(
    obj: dict[str, Any], what: str, world_size: int
) -> tuple[TensorStorageMetadata, dict[Any, int]]:
    check_keys(obj, what, _TENSOR_KEYS)
    dtype = DTYPE_BY_NAME.get(obj["dtype"]) if isinstance(obj["dtype"], str) else None
    if dtype is None:
        raise fail(f"{what}.dtype {str(obj['dtype'])[:40]!r} is not a storable dtype")
    fmt = (
        _MEMORY_FORMAT_BY_NAME.get(obj["memory_format"])
        if isinstance(obj["memory_format"], str)
        else None
    )
    if fmt is None:
        raise fail(f"{what}.memory_format is unknown")
    size = int_list(obj["size"], f"{what}.size")
    if math.prod(size) > MAX_NUMEL:
        raise fail(f"{what}.size {list(size)[:8]} holds more than {MAX_NUMEL} elements")
    chunks, ranks = _dec_chunks(obj["chunks"], size, what, world_size)
    props = TensorProperties(
        dtype=dtype,
        layout=torch.strided,
        requires_grad=_bool(obj["requires_grad"], what),
        memory_format=fmt,
        pin_memory=_bool(obj["pin_memory"], what),
    )
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks), ranks


def _dec_chunks(
    flat: Any, size: tuple[int, ...], what: str, world_size: int
) -> tuple[list[ChunkStorageMetadata], dict[Any, int]]:
    """The chunks (``rank, offsets..., sizes...`` each, concatenated) of a tensor of ``size``,
    checked (types, ranks, inside the tensor, tiling it exactly) with numpy over all of them at
    once, and their ``{offsets: rank}``."""
    nd = len(size)
    width = 1 + 2 * nd
    if type(flat) is not list or len(flat) % width or not all(type(x) is int for x in flat):
        raise fail(
            f"{what}.chunks must be a list of integers, {width} per chunk (rank, offsets, sizes)"
        )
    n = len(flat) // width
    if not n:
        if math.prod(size) != 0:
            raise fail(
                f"{what}.chunks do not tile the tensor of size {list(size)[:8]} (none is stored)"
            )
        return [], {}
    try:
        a = np.array(flat, dtype=np.int64).reshape(n, width)
    except OverflowError:
        raise fail(f"{what}.chunks hold an integer out of range") from None
    rank, off, sz = a[:, 0], a[:, 1 : 1 + nd], a[:, 1 + nd :]
    dims = np.array(size, dtype=np.int64).reshape(1, nd)
    if (rank < 0).any() or (rank >= world_size).any():
        raise fail(f"{what}.chunks place a chunk on a rank outside world size {world_size}")
    if (
        (off < 0).any()
        or (sz < 0).any()
        or (off > dims).any()
        or (sz > dims).any()
        or (off + sz > dims).any()
    ):
        raise fail(f"{what}.chunks hold a chunk outside the tensor of size {list(size)[:8]}")
    _check_tiling(off, sz, size, what)
    chunks, ranks, sizes = [], {}, {}
    new, tsize = ChunkStorageMetadata, torch.Size
    for i in range(0, len(flat), width):
        o, s = tuple(flat[i + 1 : i + 1 + nd]), tuple(flat[i + 1 + nd : i + width])
        ts = sizes.get(s)
        if ts is None:  # chunks of one tensor mostly share a shape: one torch.Size each
            ts = sizes[s] = tsize(s)
        chunks.append(new(offsets=tsize(o), sizes=ts))
        ranks[o] = flat[i]
    if len(ranks) != n:
        raise fail(f"{what}.chunks hold two chunks at the same offsets")
    return chunks, ranks


def _check_tiling(off: np.ndarray, sz: np.ndarray, size: tuple[int, ...], what: str) -> None:
    """The non-empty chunks tile the tensor exactly: no two overlap and their volumes add up to its
    numel (what DCP's save planner checks in ``_validate_global_plan``); otherwise a load would
    leave part of the tensor unread or read it twice, silently. A split along one dimension (FSDP,
    TP, ZeRO) is checked by sorting; anything else by
    :func:`~tiered_ckpt.format.validate.first_overlap`."""
    vol = sz.prod(axis=1) if sz.shape[1] else np.ones(len(sz), dtype=np.int64)
    keep = vol > 0
    if sum(vol[keep].tolist()) != math.prod(size):
        raise fail(
            f"{what}.chunks do not tile the tensor of size {list(size)[:8]} (a chunk is missing or two overlap)"
        )
    off, sz = off[keep], sz[keep]
    if len(off) < 2:
        return
    dims = np.array(size, dtype=np.int64)
    split = [d for d in range(len(size)) if not ((off[:, d] == 0) & (sz[:, d] == dims[d])).all()]
    if len(split) == 1:
        d = split[0]
        order = np.argsort(off[:, d], kind="stable")
        start, end = off[order, d], off[order, d] + sz[order, d]
        overlap = bool((start[1:] < end[:-1]).any())
    else:
        boxes = [(tuple(o), tuple(s)) for o, s in zip(off.tolist(), sz.tolist())]
        overlap = first_overlap(boxes) is not None
    if overlap:
        raise fail(
            f"{what}.chunks do not tile the tensor of size {list(size)[:8]} (a chunk is missing or two overlap)"
        )


def _dec_state(obj: Any, world_size: int) -> tuple[dict[str, Any], Placement]:
    check_keys(obj, "state_dict_metadata", set(), ignore_unknown=True)
    out: dict[str, Any] = {}
    placed: dict[str, dict[Any, int]] = {}
    for fqn, v in obj.items():
        what = f"state_dict_metadata[{fqn[:80]!r}]"
        if not fqn or len(fqn) > MAX_NAME_LEN:
            raise fail(f"{what}: key is empty or over {MAX_NAME_LEN} characters")
        if not isinstance(v, dict) or v.get("kind") not in ("bytes", "tensor"):
            raise fail(f"{what} must be an object of kind 'bytes' or 'tensor'")
        if v["kind"] == "bytes":
            check_keys(v, what, {"kind", "rank"})
            out[fqn] = BytesStorageMetadata()
            placed[fqn] = {BYTES: int_field(v["rank"], f"{what}.rank", 0, world_size - 1)}
        else:
            out[fqn], placed[fqn] = _dec_tensor(v, what, world_size)
    return out, Placement(placed)


def _dec_planner(obj: Any) -> dict[str, tuple[str | int, ...]] | None:
    if obj is None:
        return None
    check_keys(obj, "planner_data", set(), ignore_unknown=True)
    out = {}
    for fqn, path in obj.items():
        what = f"planner_data[{fqn[:80]!r}]"
        if not isinstance(path, list) or not 1 <= len(path) <= MAX_PATH_ITEMS:
            raise fail(f"{what} must be a list of 1 to {MAX_PATH_ITEMS} path items")
        for i, p in enumerate(path):
            if isinstance(p, str):
                if len(p) > MAX_NAME_LEN:
                    raise fail(f"{what}[{i}] is too long")
            else:
                int_field(p, f"{what}[{i}]", 0, 2**40)
        out[fqn] = tuple(path)
    return out


def _dec_meta(obj: Any) -> StorageMeta | None:
    if obj is None:
        return None
    check_keys(obj, "storage_meta", _META_KEYS)
    mods = obj["modules"]
    if not isinstance(mods, list) or len(mods) > MAX_SHORT_STR:
        raise fail("storage_meta.modules must be a list of strings")
    return StorageMeta(
        checkpoint_id=_opt_str(obj["checkpoint_id"], "storage_meta.checkpoint_id"),
        save_id=_opt_str(obj["save_id"], "storage_meta.save_id"),
        load_id=_opt_str(obj["load_id"], "storage_meta.load_id"),
        modules=[str_field(m, f"storage_meta.modules[{i}]") for i, m in enumerate(mods)],
    )


def decode(raw: bytes, world_size: int, where: str = "DCP metadata") -> Metadata:
    """The ``Metadata`` :func:`encode` wrote, validated (see the module docstring); ``world_size``:
    the step's, which every storage rank must be below. Raises :class:`DcpMetadataError` (the
    message starts with ``where``)."""
    if len(raw) > MAX_METADATA_BYTES:
        raise DcpMetadataError(f"{where}: {len(raw)} bytes, over the {MAX_METADATA_BYTES}-byte cap")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise DcpMetadataError(f"{where}: world size {world_size} out of range")
    try:
        obj = check_keys(loads_json(raw, where), where, _TOP_KEYS)
        if type(obj["format"]) is not int or obj["format"] != FORMAT:
            raise fail(f"format {str(obj['format'])[:20]!r} is not {FORMAT}")
        sdm, placement = _dec_state(obj["state_dict_metadata"], world_size)
        return Metadata(
            state_dict_metadata=sdm,
            planner_data=_dec_planner(obj["planner_data"]),
            storage_data=placement,
            storage_meta=_dec_meta(obj["storage_meta"]),
            version=_opt_str(obj["version"], "version"),
        )
    except DcpMetadataError:
        raise
    except ManifestError as e:
        raise DcpMetadataError(f"{where}: {e}") from None


__all__ = ["FORMAT", "MAX_METADATA_BYTES", "decode", "encode"]
