"""DCP's global ``Metadata`` as JSON (never pickle): :func:`encode` and a strict, bounded :func:`decode`.

DCP's ``FileSystemWriter`` pickles its ``.metadata`` and ``FileSystemReader`` loads it with
``pickle.load``; here the metadata is JSON, stored as a uint8 tensor in the coordinator's shard (covered
by that shard's sha256 and per-chunk CRC32Cs). Format 1::

    {"format": 1, "version": "1.0.0" | null,
     "state_dict_metadata": {fqn: {"kind": "bytes"}
                                | {"kind": "tensor", "dtype": "float32", "size": [d0, ...],
                                   "requires_grad": bool, "pin_memory": bool,
                                   "memory_format": "contiguous_format" | "channels_last" | "preserve_format",
                                   "chunks": [[[offsets...], [sizes...]], ...]}},
     "planner_data": null | {fqn: [path item (str | int), ...]},     # DefaultSavePlanner's flatten mapping
     "storage_data": [[fqn, [offsets...] | null, rank, name], ...],   # MetadataIndex -> ItemLocation
     "storage_meta": null | {"checkpoint_id": str | null, "save_id": str | null, "load_id": str | null,
                             "modules": [str, ...]}}

(``TensorProperties.layout`` is always ``torch.strided``.) :func:`decode` checks every field's type and
range, every chunk inside its tensor, the chunks tiling it exactly (no overlap, no gap), every storage
entry naming an fqn of the metadata (a byte item with a null offset, a tensor chunk with a chunk's
offsets), no entry twice, every chunk and byte item stored, every rank below the manifest's
``world_size``; the input is capped at :data:`MAX_METADATA_BYTES`. Every
failure raises :class:`~tiered_ckpt.errors.DcpMetadataError` (never ``KeyError``/``TypeError``).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from tiered_ckpt.dcp.items import DTYPE_BY_NAME, DTYPE_NAME, ItemLocation
from tiered_ckpt.errors import DcpMetadataError, ManifestError, UnsupportedStateError
from tiered_ckpt.format.tensor_index import MAX_NAME_LEN
from tiered_ckpt.format.validate import (MAX_NUMEL, check_keys, fail, first_overlap, int_field, int_list, loads_json,
                                         str_field)
from tiered_ckpt.layout import MAX_WORLD_SIZE

FORMAT = 1
#: Largest metadata accepted (bytes of JSON); a larger one is refused before it is read.
MAX_METADATA_BYTES = 1 << 30
#: Longest flatten path of one key (DCP's nesting of dicts and lists), and the longest short string.
MAX_PATH_ITEMS = 256
MAX_SHORT_STR = 4096
_MEMORY_FORMATS = {torch.contiguous_format: "contiguous_format", torch.channels_last: "channels_last",
                   torch.preserve_format: "preserve_format"}
_MEMORY_FORMAT_BY_NAME = {v: k for k, v in _MEMORY_FORMATS.items()}
_TOP_KEYS = {"format", "version", "state_dict_metadata", "planner_data", "storage_data", "storage_meta"}
_TENSOR_KEYS = {"kind", "dtype", "size", "requires_grad", "pin_memory", "memory_format", "chunks"}
_META_KEYS = {"checkpoint_id", "save_id", "load_id", "modules"}


# ------------------------------------------------------------------------------------------------ encode


def _refuse(msg: str) -> UnsupportedStateError:
    return UnsupportedStateError(f"DCP metadata cannot be stored as JSON: {msg}")


def _enc_storage(fqn: str, md: Any) -> dict[str, Any]:
    if isinstance(md, BytesStorageMetadata):
        return {"kind": "bytes"}
    if not isinstance(md, TensorStorageMetadata):
        raise _refuse(f"{fqn[:80]!r}: storage metadata of type {type(md).__name__}")
    p = md.properties
    if p.dtype not in DTYPE_NAME or p.layout != torch.strided or p.memory_format not in _MEMORY_FORMATS:
        raise _refuse(f"{fqn[:80]!r}: dtype {p.dtype}, layout {p.layout}, memory format {p.memory_format}")
    return {"kind": "tensor", "dtype": DTYPE_NAME[p.dtype], "size": [int(d) for d in md.size],
            "requires_grad": bool(p.requires_grad), "pin_memory": bool(p.pin_memory),
            "memory_format": _MEMORY_FORMATS[p.memory_format],
            "chunks": [[[int(o) for o in c.offsets], [int(s) for s in c.sizes]] for c in md.chunks]}


def _enc_planner(data: Any) -> Any:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise _refuse(f"planner_data of type {type(data).__name__} (only DefaultSavePlanner's flatten mapping)")
    out = {}
    for fqn, path in data.items():
        if (not isinstance(fqn, str) or not isinstance(path, (tuple, list))
                or not all(isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in path)):
            raise _refuse(f"planner_data entry {str(fqn)[:80]!r} is not a path of str/int items")
        out[fqn] = list(path)
    return out


def _enc_storage_data(data: Any) -> list[list[Any]]:
    if not isinstance(data, dict):
        raise _refuse(f"storage_data of type {type(data).__name__}")
    out = []
    for idx, loc in data.items():
        if not isinstance(idx, MetadataIndex) or not isinstance(loc, ItemLocation):
            raise _refuse(f"storage_data entry {idx!r}: {type(loc).__name__}")
        off = None if idx.offset is None else [int(o) for o in idx.offset]
        out.append([idx.fqn, off, loc.rank, loc.name])
    return out


def _enc_meta(sm: StorageMeta | None) -> Any:
    if sm is None:
        return None
    cid = None if sm.checkpoint_id is None else str(sm.checkpoint_id)
    return {"checkpoint_id": cid, "save_id": sm.save_id, "load_id": sm.load_id, "modules": list(sm.modules)}


def encode(md: Metadata) -> bytes:
    """``md`` as compact JSON (UTF-8). ``storage_data`` must map ``MetadataIndex`` to
    :class:`ItemLocation` (what the writer records). Raises :class:`UnsupportedStateError` for anything
    the format cannot hold (another planner's ``planner_data``, a non-strided tensor)."""
    obj = {"format": FORMAT, "version": md.version,
           "state_dict_metadata": {fqn: _enc_storage(fqn, v) for fqn, v in md.state_dict_metadata.items()},
           "planner_data": _enc_planner(md.planner_data),
           "storage_data": _enc_storage_data(md.storage_data),
           "storage_meta": _enc_meta(md.storage_meta)}
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


# ------------------------------------------------------------------------------------------------ decode


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


def _dec_tensor(obj: dict[str, Any], what: str) -> TensorStorageMetadata:
    check_keys(obj, what, _TENSOR_KEYS)
    dtype = DTYPE_BY_NAME.get(obj["dtype"]) if isinstance(obj["dtype"], str) else None
    if dtype is None:
        raise fail(f"{what}.dtype {str(obj['dtype'])[:40]!r} is not a storable dtype")
    fmt = _MEMORY_FORMAT_BY_NAME.get(obj["memory_format"]) if isinstance(obj["memory_format"], str) else None
    if fmt is None:
        raise fail(f"{what}.memory_format is unknown")
    size = int_list(obj["size"], f"{what}.size")
    if math.prod(size) > MAX_NUMEL:
        raise fail(f"{what}.size {list(size)[:8]} holds more than {MAX_NUMEL} elements")
    chunks = obj["chunks"]
    if not isinstance(chunks, list):
        raise fail(f"{what}.chunks must be a list")
    out = []
    for i, c in enumerate(chunks):
        if not isinstance(c, list) or len(c) != 2:
            raise fail(f"{what}.chunks[{i}] must be [offsets, sizes]")
        off, sz = int_list(c[0], f"{what}.chunks[{i}][0]"), int_list(c[1], f"{what}.chunks[{i}][1]")
        if len(off) != len(size) or len(sz) != len(size) or any(o + s > d for o, s, d in zip(off, sz, size)):
            raise fail(f"{what}.chunks[{i}] lies outside the tensor of size {list(size)[:8]}")
        out.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz)))
    _check_tiling(out, size, what)
    props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=_bool(obj["requires_grad"], what),
                             memory_format=fmt, pin_memory=_bool(obj["pin_memory"], what))
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=out)


def _check_tiling(chunks: list[ChunkStorageMetadata], size: tuple[int, ...], what: str) -> None:
    """The non-empty chunks tile the tensor exactly: no two overlap and their volumes add up to its
    numel (what DCP's save planner checks in ``_validate_global_plan``); otherwise a load would leave part
    of the tensor unread or read it twice, silently."""
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks if math.prod(c.sizes) > 0]
    if sum(math.prod(b[1]) for b in boxes) != math.prod(size) or first_overlap(boxes) is not None:
        raise fail(f"{what}.chunks do not tile the tensor of size {list(size)[:8]} (a chunk is missing or two overlap)")


def _dec_state(obj: Any) -> dict[str, Any]:
    check_keys(obj, "state_dict_metadata", set(), ignore_unknown=True)
    out: dict[str, Any] = {}
    for fqn, v in obj.items():
        what = f"state_dict_metadata[{fqn[:80]!r}]"
        if not fqn or len(fqn) > MAX_NAME_LEN:
            raise fail(f"{what}: key is empty or over {MAX_NAME_LEN} characters")
        if not isinstance(v, dict) or v.get("kind") not in ("bytes", "tensor"):
            raise fail(f"{what} must be an object of kind 'bytes' or 'tensor'")
        if v["kind"] == "bytes":
            check_keys(v, what, {"kind"})
            out[fqn] = BytesStorageMetadata()
        else:
            out[fqn] = _dec_tensor(v, what)
    return out


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


def _dec_storage_data(obj: Any, sdm: dict[str, Any], world_size: int) -> dict[MetadataIndex, ItemLocation]:
    if not isinstance(obj, list):
        raise fail("storage_data must be a list")
    out: dict[MetadataIndex, ItemLocation] = {}
    chunk_offsets = {fqn: {tuple(c.offsets) for c in md.chunks} for fqn, md in sdm.items()
                     if isinstance(md, TensorStorageMetadata)}
    for i, e in enumerate(obj):
        what = f"storage_data[{i}]"
        if not isinstance(e, list) or len(e) != 4:
            raise fail(f"{what} must be [fqn, offsets, rank, name]")
        fqn, off, rank, name = e
        if not isinstance(fqn, str) or fqn not in sdm:
            raise fail(f"{what} names no key of the metadata")
        if isinstance(sdm[fqn], BytesStorageMetadata):
            if off is not None:
                raise fail(f"{what}: a byte item has no offsets")
            idx = MetadataIndex(fqn)
        else:
            offs = int_list(off, f"{what}[1]")
            if offs not in chunk_offsets[fqn]:
                raise fail(f"{what}: offsets {list(offs)[:8]} are no chunk of {fqn[:80]!r}")
            idx = MetadataIndex(fqn, offs)
        int_field(rank, f"{what}[2]", 0, world_size - 1)
        if len(str_field(name, f"{what}[3]")) > MAX_NAME_LEN or not name:
            raise fail(f"{what}[3]: name is empty or over {MAX_NAME_LEN} characters")
        if idx in out:
            raise fail(f"{what}: {fqn[:80]!r} at {off} is stored twice")
        out[idx] = ItemLocation(rank, name)
    expected = sum(1 if isinstance(md, BytesStorageMetadata) else len(chunk_offsets[fqn]) for fqn, md in sdm.items())
    if len(out) != expected:
        raise fail(f"storage_data locates {len(out)} items, the metadata describes {expected}")
    return out


def _dec_meta(obj: Any) -> StorageMeta | None:
    if obj is None:
        return None
    check_keys(obj, "storage_meta", _META_KEYS)
    mods = obj["modules"]
    if not isinstance(mods, list) or len(mods) > MAX_SHORT_STR:
        raise fail("storage_meta.modules must be a list of strings")
    return StorageMeta(checkpoint_id=_opt_str(obj["checkpoint_id"], "storage_meta.checkpoint_id"),
                       save_id=_opt_str(obj["save_id"], "storage_meta.save_id"),
                       load_id=_opt_str(obj["load_id"], "storage_meta.load_id"),
                       modules=[str_field(m, f"storage_meta.modules[{i}]") for i, m in enumerate(mods)])


def decode(raw: bytes, world_size: int, where: str = "DCP metadata") -> Metadata:
    """The ``Metadata`` :func:`encode` wrote, validated (see the module docstring); ``world_size``: the
    step's, which every storage rank must be below. Raises :class:`DcpMetadataError` (the message starts
    with ``where``)."""
    if len(raw) > MAX_METADATA_BYTES:
        raise DcpMetadataError(f"{where}: {len(raw)} bytes, over the {MAX_METADATA_BYTES}-byte cap")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise DcpMetadataError(f"{where}: world size {world_size} out of range")
    try:
        obj = check_keys(loads_json(raw, where), where, _TOP_KEYS)
        if type(obj["format"]) is not int or obj["format"] != FORMAT:
            raise fail(f"format {str(obj['format'])[:20]!r} is not {FORMAT}")
        sdm = _dec_state(obj["state_dict_metadata"])
        return Metadata(state_dict_metadata=sdm, planner_data=_dec_planner(obj["planner_data"]),
                        storage_data=_dec_storage_data(obj["storage_data"], sdm, world_size),
                        storage_meta=_dec_meta(obj["storage_meta"]), version=_opt_str(obj["version"], "version"))
    except DcpMetadataError:
        raise
    except ManifestError as e:
        raise DcpMetadataError(f"{where}: {e}") from None


__all__ = ["FORMAT", "MAX_METADATA_BYTES", "decode", "encode"]
