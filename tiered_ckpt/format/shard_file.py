"""Shard file format: safetensors (8-byte little-endian header length, JSON header, raw little-endian
tensor bytes), encoded and decoded here. Pure: no I/O, threads, steps, manifests or S3 (the
streaming writer and verified reader are :mod:`tiered_ckpt.local.shard_io`).

- The nested state is ``__metadata__["tiered_ckpt"]``: a JSON tree of ``{"d": {key: node}}``,
  ``{"t": name}`` (a tensor of this file), ``{"v": value}`` or ``{"r": node | null}`` (a
  :class:`~tiered_ckpt.state.Replicated` value, stored in the file of each node's first rank;
  ``null`` elsewhere). Nothing is ever pickled.
- Tensor names are the key path joined by ``/`` (``%`` and ``/`` in keys escaped as ``%25``,
  ``%2F``), readable by plain safetensors tools.
- Decoding follows safetensors' validation rules (header size cap, offsets that cover the data
  without holes or overlap).

Why our own codec: docs/design.md, "Shard files".
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from tiered_ckpt.errors import ShardCorruptedError, UnsupportedStateError
from tiered_ckpt.format.tensor_index import (
    DTYPE_SIZES,
    MAX_HEADER_BYTES,
    MAX_NAME_LEN,
    TensorRecord,
    build_records,
    numel,
)
from tiered_ckpt.format.validate import MAX_NDIM
from tiered_ckpt.state import GlobalSlice, Replicated

#: Deepest nesting of dicts in a state (the reader refuses deeper trees too).
MAX_STATE_DEPTH = 200
METADATA_KEY = "tiered_ckpt"
#: Header format written (2: the tensor index is in the header); :data:`READ_FORMATS` are
#: read.
FORMAT_VERSION = 2
READ_FORMATS = (1, 2)
#: Writes and hash updates are issued in chunks of this many bytes. Small enough that the hashing
#: thread reads each chunk while it is still in the CPU cache after the writing thread copied it
#: (measured on 2 GiB: 1 MiB chunks 1.7-2.0 s, 16 MiB chunks 2.9-3.1 s for the same save).
CHUNK_BYTES = 1024 * 1024
_LITTLE = np.little_endian
#: A str as the JSON string ``json.dumps`` writes (``ensure_ascii``: the C encoder).
_JSON_STR = json.encoder.encode_basestring_ascii

_NP_TO_CODE: dict[np.dtype, str] = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint64): "U64",
    np.dtype(np.int64): "I64",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.complex64): "C64",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
    np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0",
}
_CODE_TO_NP: dict[str, np.dtype] = {code: dt.newbyteorder("<") for dt, code in _NP_TO_CODE.items()}
assert set(_CODE_TO_NP) == set(DTYPE_SIZES)


def dtype_code(dt: np.dtype) -> str:
    """safetensors code of a numpy dtype (either byte order). Raises UnsupportedStateError."""
    code = _NP_TO_CODE.get(dt.newbyteorder("="))
    if code is None:
        raise UnsupportedStateError(
            f"dtype {dt} has no safetensors code; supported: {sorted(str(d) for d in _NP_TO_CODE)}"
        )
    return code


def numpy_dtype(code: str) -> np.dtype:
    return _CODE_TO_NP[code]


@dataclass
class TensorEntry:
    """A tensor to write: ``array`` is C-contiguous little-endian (possibly a copy of a
    non-contiguous input, never of a contiguous one)."""

    name: str
    array: np.ndarray
    code: str
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def flatten_state(
    state: Mapping[str, Any], *, replicated_owner: bool | None = None
) -> tuple[dict[str, Any], list[TensorEntry]]:
    """Split a nested state into a JSON tree and the tensors to write.

    ``replicated_owner``: how :class:`~tiered_ckpt.state.Replicated` values are stored: ``True``
    (rank 0, and each node's first rank) stores the value as ``{"r": node}``, ``False`` (any other
    rank) stores the reference ``{"r": null}`` and nothing else; ``None`` refuses them.

    Raises :class:`UnsupportedStateError` for a non-string key, an unsupported dtype, an object
    array, a value that JSON cannot hold, or a ``Replicated`` inside a ``Replicated``.
    """
    entries: list[TensorEntry] = []

    def array_entry(name: str, arr: Any, gs: Any = None, go: Any = None) -> dict[str, Any]:
        if name == "__metadata__":
            raise UnsupportedStateError(
                "a tensor cannot be named '__metadata__' (safetensors reserves it)"
            )
        a = arr if type(arr) is np.ndarray else np.asarray(arr)
        code = _NP_TO_CODE.get(a.dtype) or dtype_code(a.dtype)
        if a.ndim > MAX_NDIM:
            raise UnsupportedStateError(f"{name}: {a.ndim} dims (max {MAX_NDIM})")
        if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not _LITTLE):
            a = a.astype(a.dtype.newbyteorder("<"))
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # per-tensor copy of a non-contiguous input only
        entries.append(TensorEntry(name, a, code, gs, go))
        return {"t": name}

    def walk(obj: Any, name: str, depth: int, in_rep: bool = False) -> dict[str, Any]:
        # ``name``: the escaped key path of ``obj`` ("" at the root), ``depth``: its length
        if depth > MAX_STATE_DEPTH:
            raise UnsupportedStateError(
                f"state nested deeper than {MAX_STATE_DEPTH} levels at {name[:80]!r}"
            )
        if isinstance(obj, Mapping):
            out = {}
            prefix = name + "/" if depth else ""
            for k, v in obj.items():
                if not isinstance(k, str):
                    raise UnsupportedStateError(
                        f"state key {k!r} under {name or '<root>'!r} is a {type(k).__name__}; keys must "
                        "be strings (convert integer keys yourself)"
                    )
                if not k:
                    raise UnsupportedStateError(f"empty state key under {name or '<root>'!r}")
                key = _escape(k) if ("%" in k or "/" in k) else k
                out[k] = walk(v, prefix + key, depth + 1, in_rep)
            return {"d": out}
        if not depth:
            raise UnsupportedStateError("state must be a mapping")
        if len(name) > MAX_NAME_LEN:
            raise UnsupportedStateError(f"state key path too long ({len(name)} chars)")
        if type(obj) is np.ndarray and obj.dtype != object:  # the common case first
            return array_entry(name, obj)
        if isinstance(obj, GlobalSlice):
            return array_entry(name, obj.array, obj.global_shape, obj.offset)
        if isinstance(obj, Replicated):
            if replicated_owner is None:
                raise UnsupportedStateError(f"{name}: Replicated values need a rank (write_shard)")
            if in_rep:
                raise UnsupportedStateError(f"{name}: Replicated inside Replicated")
            if isinstance(obj.value, GlobalSlice):
                raise UnsupportedStateError(f"{name}: a GlobalSlice cannot be Replicated")
            return {"r": walk(obj.value, name, depth, True) if replicated_owner else None}
        if isinstance(obj, (np.ndarray, np.generic)):
            if isinstance(obj, np.ndarray) and obj.dtype == object:
                raise UnsupportedStateError(f"{name}: object arrays cannot be stored (no pickle)")
            return array_entry(name, obj)
        try:
            json.dumps(obj, allow_nan=True)
        except (TypeError, ValueError, RecursionError) as e:
            raise UnsupportedStateError(
                f"{name}: {type(obj).__name__} is neither an array nor JSON-able ({e})"
            ) from None
        _check_json_keys(obj, name)
        return {"v": obj}

    tree = walk(state, "", 0)
    return tree, entries


def _check_json_keys(obj: Any, name: str) -> None:
    """json.dumps silently turns int/float/bool/None keys into strings; refuse them instead, so that
    a value never comes back different from what was saved."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            bad = [k for k in o if not isinstance(k, str)]
            if bad:
                raise UnsupportedStateError(
                    f"{name}: JSON value has a non-string key {bad[0]!r}; convert "
                    "keys to strings yourself"
                )
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)


def layout(entries: list[TensorEntry]) -> list[TensorRecord]:
    """Byte ranges for ``entries``: sorted by element size (largest first, then name) so that every
    tensor starts at a multiple of its element size once the data section starts 8-aligned;
    contiguous."""
    order = sorted(entries, key=lambda e: (-e.array.dtype.itemsize, e.name))
    entries[:] = order
    pos = 0
    out = []
    new = object.__new__
    for e in order:
        n = e.array.nbytes
        t = new(TensorRecord)  # the fields come from checked arrays: skip the frozen __init__
        t.__dict__.update(
            name=e.name,
            dtype=e.code,
            shape=e.array.shape,  # a tuple of ints
            data_offsets=(pos, pos + n),
            global_shape=e.global_shape,
            global_offset=e.global_offset,
            crc32c=None,
        )
        out.append(t)
        pos += n
    return out


def encode_header(records: list[TensorRecord], metadata: Mapping[str, Any]) -> bytes:
    """The 8-byte length plus the JSON header, padded with spaces to a multiple of 8 bytes.

    The bytes ``json.dumps(header, separators=(",", ":"))`` would give (ASCII, escaped names),
    built as one string join: no dict or list object per tensor."""
    meta = json.dumps(metadata, allow_nan=True, separators=(",", ":"))
    esc = _JSON_STR
    parts = ['{"__metadata__":{', esc(METADATA_KEY), ":", esc(meta), "}"]
    parts += [
        f',{esc(r.name)}:{{"dtype":"{r.dtype}","shape":[{",".join(map(str, r.shape))}],'
        f'"data_offsets":[{r.data_offsets[0]},{r.data_offsets[1]}]}}'
        for r in records
    ]
    parts.append("}")
    body = "".join(parts).encode()
    body += b" " * (-len(body) % 8)
    if len(body) > MAX_HEADER_BYTES:
        raise UnsupportedStateError(
            f"the shard header would be {len(body)} bytes, over the {MAX_HEADER_BYTES}-byte "
            "safetensors cap: store large values as arrays, not JSON"
        )
    return struct.pack("<Q", len(body)) + body


def iter_chunks(header: bytes, entries: list[TensorEntry]) -> Iterator[memoryview]:
    """The file's bytes as buffers of at most :data:`CHUNK_BYTES`: pieces (header, tensors) that
    large are views (no copy); smaller ones are packed into fresh (never reused: a consumer may
    still be hashing one) staging buffers of :data:`CHUNK_BYTES`, so 10,000 tensors of 4 KiB are ~40
    writes, not 10,000."""
    stage = np.empty(CHUNK_BYTES, np.uint8)
    fill = 0
    pieces = [np.frombuffer(header, np.uint8)] + [
        e.array.reshape(-1).view(np.uint8) for e in entries
    ]
    for flat in pieces:
        n = flat.nbytes
        if n >= CHUNK_BYTES:
            if fill:
                yield memoryview(stage[:fill])
                stage, fill = np.empty(CHUNK_BYTES, np.uint8), 0
            mv = memoryview(flat)
            for i in range(0, n, CHUNK_BYTES):
                yield mv[i : i + CHUNK_BYTES]
            continue
        pos = 0
        while pos < n:
            take = min(n - pos, CHUNK_BYTES - fill)
            stage[fill : fill + take] = flat[pos : pos + take]
            fill += take
            pos += take
            if fill == CHUNK_BYTES:
                yield memoryview(stage)
                stage, fill = np.empty(CHUNK_BYTES, np.uint8), 0
    if fill:
        yield memoryview(stage[:fill])


# --- read


@dataclass(frozen=True)
class ParsedHeader:
    header_len: int  # bytes of JSON (padding included), after the 8-byte length
    tensors: tuple[
        TensorRecord, ...
    ]  # in file order; format 2: with chunk CRC32Cs and global slices
    metadata: dict[str, Any]
    crc32c_chunk_bytes: int | None = (
        None  # format 2 (the header holds the tensor index); None: format 1
    )

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def corrupt(where: str, msg: str) -> ShardCorruptedError:
    return ShardCorruptedError(f"{where}: {msg}")


def parse_header_length(prefix: bytes, file_size: int, where: str) -> int:
    if len(prefix) < 8 or file_size < 8:
        raise corrupt(where, f"file of {file_size} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise corrupt(where, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if 8 + n > file_size:
        raise corrupt(where, f"header length {n} runs past the end of the {file_size}-byte file")
    return n


def parse_header(raw: bytes, file_size: int, where: str) -> ParsedHeader:
    """Strictly parse the JSON header ``raw`` (without the 8-byte length) of a file of ``file_size``
    bytes. Raises :class:`ShardCorruptedError` on anything malformed: bad JSON, unknown dtype,
    offsets outside the file, gaps or overlaps, a missing or malformed tiered_ckpt metadata block or
    (format 2) tensor index (:func:`~tiered_ckpt.format.tensor_index.build_records`)."""
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_pairs_unique)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise corrupt(where, f"header is not valid JSON ({str(e)[:100]})") from None
    if not isinstance(obj, dict):
        raise corrupt(where, "header is not a JSON object")
    meta_raw = obj.pop("__metadata__", None)
    if not isinstance(meta_raw, dict) or not all(isinstance(v, str) for v in meta_raw.values()):
        raise corrupt(where, "header __metadata__ is missing or not a string map")
    try:
        meta = json.loads(meta_raw[METADATA_KEY], object_pairs_hook=_pairs_unique)
    except (KeyError, ValueError, RecursionError):
        raise corrupt(where, f"header lacks valid {METADATA_KEY!r} metadata") from None
    if (
        not isinstance(meta, dict)
        or meta.get("format") not in READ_FORMATS
        or type(meta["format"]) is not int
        or not isinstance(meta.get("tree"), dict)
    ):
        raise corrupt(where, "tiered_ckpt metadata block is malformed")
    data_len = file_size - 8 - len(raw)
    entries = _entries(obj, data_len, where)
    pos = 0
    for b, e, _, _, _ in entries:
        if b != pos:
            raise corrupt(where, f"tensor data has a gap or overlap at byte {pos}")
        pos = e
    if pos != data_len:
        raise corrupt(where, f"tensors cover {pos} bytes but the data section holds {data_len}")
    tensors, chunk = build_records(
        entries, meta if meta["format"] >= 2 else None, lambda m: corrupt(where, m)
    )
    return ParsedHeader(len(raw), tensors, meta, chunk)


def _entries(
    obj: dict[str, Any], data_len: int, where: str
) -> list[tuple[int, int, str, str, tuple[int, ...]]]:
    """``(begin, end, name, dtype, shape)`` of every safetensors tensor entry, validated, sorted by
    begin."""
    out = []
    for name, info in obj.items():
        if type(info) is not dict or len(info) != 3:
            raise corrupt(where, f"tensor {name[:80]!r} entry is malformed")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        size = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
        if size is None:
            raise corrupt(where, f"tensor {name[:80]!r} has unsupported dtype {str(dtype)[:20]!r}")
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise corrupt(where, f"tensor {name[:80]!r} has a malformed shape")
        n = size
        for d in shape:
            if type(d) is not int or d < 0:
                raise corrupt(where, f"tensor {name[:80]!r} has a malformed shape")
            n *= d
        if (
            type(offs) is not list
            or len(offs) != 2
            or type(offs[0]) is not int
            or type(offs[1]) is not int
            or not 0 <= offs[0] <= offs[1] <= data_len
        ):
            raise corrupt(
                where,
                f"tensor {name[:80]!r} data_offsets {str(offs)[:60]} lie outside the "
                f"{data_len}-byte data section",
            )
        if offs[1] - offs[0] != n:
            raise corrupt(
                where, f"tensor {name[:80]!r} data_offsets do not match its shape and dtype"
            )
        out.append((offs[0], offs[1], name, dtype, tuple(shape)))
    out.sort()
    return out


def _pairs_unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key")
    return d


def decode_state(
    buf: np.ndarray | bytearray | memoryview | None,
    hdr: ParsedHeader,
    where: str,
    resolve_ref: Callable[[tuple[str, ...]], Any] | None = None,
) -> dict[str, Any]:
    """Rebuild the nested state from a verified file buffer. Arrays are views into ``buf``.

    ``resolve_ref(key_path)`` supplies the value of a replicated reference ``{"r": null}`` (stored
    in another rank's file); without it such a node raises :class:`ShardCorruptedError`.
    ``buf=None`` only validates the tree against the header (every tensor leaf comes back as
    ``None``).
    """
    by_name = {t.name: t for t in hdr.tensors}
    used: set[str] = set()
    base = hdr.data_start

    def node(n: Any, depth: int, path: tuple[str, ...] = (), in_rep: bool = False) -> Any:
        if depth > 256 or not isinstance(n, dict) or len(n) != 1:
            raise corrupt(where, "state tree node is malformed")
        ((kind, val),) = n.items()
        if kind == "d":
            if not isinstance(val, dict):
                raise corrupt(where, "state tree dict node is malformed")
            return {k: node(v, depth + 1, path + (k,), in_rep) for k, v in val.items()}
        if kind == "r" and not in_rep:
            if val is not None:
                return node(val, depth + 1, path, True)
            if resolve_ref is None:
                raise corrupt(
                    where,
                    f"replicated value {'/'.join(path)[:80]!r} is stored in another rank's "
                    "shard, which this read has no access to",
                )
            return resolve_ref(path)
        if kind == "v":
            return val
        if kind == "t":
            t = by_name.get(val) if isinstance(val, str) else None
            if t is None or val in used:
                raise corrupt(
                    where, f"state tree names unknown or repeated tensor {str(val)[:80]!r}"
                )
            used.add(val)
            dt = numpy_dtype(t.dtype)
            count = numel(t.shape)
            if buf is None:
                return None
            if count == 0:
                return np.empty(t.shape, dtype=dt)
            return np.frombuffer(
                buf, dtype=dt, count=count, offset=base + t.data_offsets[0]
            ).reshape(t.shape)
        raise corrupt(where, f"state tree node kind {str(kind)[:10]!r} is unknown")

    state = node(hdr.metadata["tree"], 0)
    if set(by_name) - used:
        raise corrupt(
            where, f"{len(set(by_name) - used)} tensor(s) are not referenced by the state tree"
        )
    return state


def new_sha256() -> Any:
    return hashlib.sha256()


__all__ = [
    "flatten_state",
    "layout",
    "encode_header",
    "iter_chunks",
    "parse_header",
    "parse_header_length",
    "decode_state",
    "corrupt",
    "new_sha256",
    "dtype_code",
    "numpy_dtype",
    "TensorEntry",
    "ParsedHeader",
    "CHUNK_BYTES",
    "MAX_HEADER_BYTES",
    "METADATA_KEY",
    "FORMAT_VERSION",
    "READ_FORMATS",
]
