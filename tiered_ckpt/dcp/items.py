"""What one DCP write item becomes in a rank's shard: its tensor name, its bytes, its dtype.

- **Names.** ``"<fqn>@<o0>,<o1>,..."`` for a tensor chunk at those offsets (0-d: ``"<fqn>@"``),
  ``"<fqn>@b"`` for a byte item; the part after the last ``@`` holds no ``@``, so names never
  collide, nor meet :data:`METADATA_TENSOR`. Escaped in the file as
  :func:`tiered_ckpt.format.shard_file.flatten_state` does (:func:`stored_name`); a key that is not
  valid Unicode is refused.
- **Bytes.** A ``BYTE_IO`` value is a 1-D ``uint8`` tensor: ``b"J"`` + UTF-8 JSON for a value
  plain JSON holds exactly (``None``, bools, numbers, strings, lists, ``dict`` with string keys),
  ``b"T"`` + UTF-8 typed JSON (:mod:`tiered_ckpt.format.typed_json`) for one that also holds
  tuples (Adam's ``betas``), dicts with other keys (an optimizer state's parameter indices) or an
  ``OrderedDict``, so it comes back of the same types (a value typed JSON does not hold, such as a
  ``torch.Size`` or a namedtuple, is stored as plain JSON: it comes back as lists), or ``b"B"`` + raw bytes for
  ``bytes``/``bytearray``. Anything else raises :class:`UnsupportedStateError` naming the key.
  Never pickle.
- **Dtypes.** :data:`STORABLE_DTYPES` and the bit-exact tensor -> numpy conversion
  (:func:`tensor_array`) for :func:`tiered_ckpt.local.writer.write_shard`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from tiered_ckpt.errors import ManifestError, ShardCorruptedError, UnsupportedStateError
from tiered_ckpt.format import typed_json
from tiered_ckpt.format.tensor_index import MAX_NAME_LEN

#: Name of the uint8 tensor in the coordinator's shard that holds the DCP metadata as JSON.
METADATA_TENSOR = "__tiered_ckpt_dcp_metadata__"
#: ``MetadataIndex.fqn`` of the extra ``WriteResult`` each rank's ``write_data`` returns: its
#: storage_data is the rank's :class:`~tiered_ckpt.format.manifest.ShardRecord` as JSON, for
#: ``finish`` to commit.
SHARD_RESULT_FQN = "__tiered_ckpt_dcp_shard__"
JSON_TAG = b"J"
TYPED_TAG = b"T"
BYTES_TAG = b"B"
#: Deepest nesting of a JSON value (deeper: refused on write, a typed error on read).
MAX_JSON_DEPTH = 200


@dataclass(frozen=True)
class ItemLocation:
    """Where one item lies: the tensor ``name`` (as stored, :func:`stored_name`) in rank ``rank`` 's
    shard. The values of ``Metadata.storage_data`` (keys: ``MetadataIndex``)."""

    rank: int
    name: str


# torch dtype -> (safetensors code, numpy dtype of the array handed to write_shard, integer view for
# torch)
_TABLE: list[tuple[torch.dtype, str, Any, torch.dtype | None]] = [
    (torch.bool, "BOOL", np.bool_, None),
    (torch.uint8, "U8", np.uint8, None),
    (torch.int8, "I8", np.int8, None),
    (torch.int16, "I16", np.int16, None),
    (torch.uint16, "U16", np.uint16, None),
    (torch.int32, "I32", np.int32, None),
    (torch.uint32, "U32", np.uint32, None),
    (torch.int64, "I64", np.int64, None),
    (torch.uint64, "U64", np.uint64, None),
    (torch.float16, "F16", np.float16, None),
    (torch.float32, "F32", np.float32, None),
    (torch.float64, "F64", np.float64, None),
    (torch.complex64, "C64", np.complex64, None),
    (torch.bfloat16, "BF16", ml_dtypes.bfloat16, torch.int16),
    (torch.float8_e4m3fn, "F8_E4M3", ml_dtypes.float8_e4m3fn, torch.uint8),
    (torch.float8_e5m2, "F8_E5M2", ml_dtypes.float8_e5m2, torch.uint8),
]
if hasattr(torch, "float8_e8m0fnu") and hasattr(ml_dtypes, "float8_e8m0fnu"):
    _TABLE.append((torch.float8_e8m0fnu, "F8_E8M0", ml_dtypes.float8_e8m0fnu, torch.uint8))

#: torch dtype -> safetensors code, for every dtype a shard can hold.
STORABLE_DTYPES: dict[torch.dtype, str] = {dt: code for dt, code, _, _ in _TABLE}
#: safetensors code -> torch dtype.
TORCH_DTYPE_OF_CODE: dict[str, torch.dtype] = {code: dt for dt, code, _, _ in _TABLE}
#: name in the JSON metadata (``"float32"``) -> torch dtype, and back.
DTYPE_BY_NAME: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt for dt, _, _, _ in _TABLE
}
DTYPE_NAME: dict[torch.dtype, str] = {dt: name for name, dt in DTYPE_BY_NAME.items()}
_VIEWS: dict[torch.dtype, tuple[torch.dtype, Any]] = {
    dt: (view, npdt) for dt, _, npdt, view in _TABLE if view
}


def item_name(index: MetadataIndex) -> str:
    """The key of an item in the state handed to ``write_shard`` (see the module docstring)."""
    if index.offset is None:
        return f"{index.fqn}@b"
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def stored_name(key: str) -> str:
    """The tensor name ``write_shard`` gives the top-level key ``key`` (``%`` -> ``%25``, ``/`` ->
    ``%2F``, as :func:`tiered_ckpt.format.shard_file.flatten_state` escapes keys)."""
    return key.replace("%", "%25").replace("/", "%2F")


def check_item(index: MetadataIndex, dtype: torch.dtype | None) -> None:
    """Refuse, before anything is written, an item a shard cannot hold: a tensor of a dtype outside
    :data:`STORABLE_DTYPES` (``dtype``; ``None`` for a byte item), a name over the shard's limit or
    a name with a lone surrogate (no UTF-8 for it).
    Raises :class:`UnsupportedStateError` naming the key."""
    if dtype is not None and dtype not in STORABLE_DTYPES:
        raise UnsupportedStateError(
            f"state key {index.fqn[:200]!r}: a tensor of dtype {dtype} cannot be stored; "
            f"storable: {sorted(DTYPE_BY_NAME)}"
        )
    if len(stored_name(item_name(index))) > MAX_NAME_LEN:
        raise UnsupportedStateError(
            f"state key {index.fqn[:80]!r}...: name longer than {MAX_NAME_LEN} characters"
        )
    try:
        index.fqn.encode("utf-8")
    except (
        UnicodeEncodeError
    ):  # a lone surrogate: the shard's JSON header would not be valid UTF-8 JSON
        raise UnsupportedStateError(
            f"state key {index.fqn[:80]!r} is not valid Unicode (a lone surrogate)"
        ) from None


def tensor_array(t: torch.Tensor, fqn: str) -> np.ndarray:
    """The bytes of ``t`` (any device, any strides: copied to a contiguous host tensor where needed)
    as a numpy array of the same shape for ``write_shard``; bfloat16/float8 through ``ml_dtypes``
    views. Raises :class:`UnsupportedStateError` for a dtype outside :data:`STORABLE_DTYPES`."""
    if t.dtype not in STORABLE_DTYPES:
        raise UnsupportedStateError(
            f"state key {fqn[:200]!r}: a tensor of dtype {t.dtype} cannot be stored"
        )
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    view = _VIEWS.get(t.dtype)
    if view is None:
        return t.numpy()
    return t.view(view[0]).numpy().view(view[1])


def _jsonable(value: Any, where: str, depth: int = 0) -> Any:
    """A JSON-able copy of ``value`` (tuples -> lists), else UnsupportedStateError naming
    ``where``."""
    if depth > MAX_JSON_DEPTH:
        raise UnsupportedStateError(f"{where[:200]}: nested deeper than {MAX_JSON_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnsupportedStateError(
                    f"{where[:200]}: key {k!r} is a {type(k).__name__}; JSON keys must be "
                    "strings (convert them yourself)"
                )
            out[k] = _jsonable(v, f"{where}.{k}", depth + 1)
        return out
    raise UnsupportedStateError(
        f"{where[:200]}: a value of type {type(value).__name__} is neither a tensor, "
        "JSON-able nor bytes (no pickle: convert it yourself)"
    )


def _needs_types(value: Any, depth: int = 0) -> bool:
    """Whether plain JSON would change ``value`` 's types: it holds a tuple, an ``OrderedDict`` or
    another dict subclass, or a dict with a key that is not a string."""
    if depth > MAX_JSON_DEPTH:
        return False  # refused by the encoding that follows
    if isinstance(value, tuple):
        return True
    if isinstance(value, list):
        return any(_needs_types(v, depth + 1) for v in value)
    if isinstance(value, dict):
        if type(value) is not dict or not all(isinstance(k, str) for k in value):
            return True
        return any(_needs_types(v, depth + 1) for v in value.values())
    return False


def encode_value(value: Any, fqn: str) -> bytes:
    """The stored bytes of a non-tensor value under state key ``fqn`` (see the module docstring).
    Raises :class:`UnsupportedStateError` naming the key for anything neither bytes nor
    JSON-able."""
    if isinstance(value, (bytes, bytearray)):
        return BYTES_TAG + bytes(value)
    if _needs_types(value):
        try:
            doc = typed_json.encode(value, root=f"state key {fqn[:200]!r}")
            return TYPED_TAG + json.dumps(doc, separators=(",", ":")).encode()
        except (UnsupportedStateError, ValueError):
            pass  # a subclass typed JSON does not hold (torch.Size, a namedtuple): plain JSON
    doc = _jsonable(value, f"state key {fqn!r}")
    try:
        return JSON_TAG + json.dumps(doc, allow_nan=True, separators=(",", ":")).encode()
    except ValueError as e:  # an int over Python's digit limit for str()
        raise UnsupportedStateError(
            f"state key {fqn[:200]!r}: value cannot be stored as JSON ({str(e)[:100]})"
        ) from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return d


def decode_value(raw: bytes, fqn: str) -> Any:
    """The value :func:`encode_value` stored, of the same types. Raises
    :class:`ShardCorruptedError` for an unknown tag, malformed JSON or typed JSON; never unpickles
    anything."""
    tag, body = raw[:1], raw[1:]
    if tag == BYTES_TAG:
        return bytes(body)
    if tag == TYPED_TAG:
        try:
            doc = json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicates)
            return typed_json.decode(doc)
        except (ValueError, UnicodeDecodeError, RecursionError, ManifestError) as e:
            raise ShardCorruptedError(
                f"state key {fqn[:200]!r}: stored value is not valid typed JSON ({str(e)[:100]})"
            ) from None
    if tag == JSON_TAG:
        try:
            return json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ShardCorruptedError(
                f"state key {fqn[:200]!r}: stored value is not valid JSON ({str(e)[:100]})"
            ) from None
    raise ShardCorruptedError(
        f"state key {fqn[:200]!r}: stored value has unknown tag {tag!r} (expected b'J', b'T' or b'B')"
    )


def byte_range(
    shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...], itemsize: int
) -> tuple[int, int, tuple[int, ...]]:
    """``(start, end, strides)`` for reading the box ``offsets``/``lengths`` of a C-contiguous
    tensor of ``shape``: the one contiguous byte range from the box's first element to its last (for
    a box of whole rows along dim 0, exactly those rows; otherwise the smallest range that covers
    it) and the tensor's element strides, with which ``as_strided(lengths, strides, 0)`` over the
    range is the box. A box with a zero length is ``(0, 0, strides)``. ``ValueError`` for a box
    outside ``shape``."""
    if not len(shape) == len(offsets) == len(lengths):
        raise ValueError(
            f"box of {len(offsets)}/{len(lengths)} dims for a tensor of {len(shape)} dims"
        )
    strides = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    for d, (s, o, n) in enumerate(zip(shape, offsets, lengths)):
        if o < 0 or n < 0 or o + n > s:
            raise ValueError(f"box [{o}, {o + n}) outside dim {d} of size {s}")
    if any(n == 0 for n in lengths):
        return 0, 0, strides
    first = sum(o * st for o, st in zip(offsets, strides))
    last = first + sum((n - 1) * st for n, st in zip(lengths, strides))
    return first * itemsize, (last + 1) * itemsize, strides


__all__ = [
    "BYTES_TAG",
    "DTYPE_BY_NAME",
    "DTYPE_NAME",
    "ItemLocation",
    "JSON_TAG",
    "TYPED_TAG",
    "MAX_JSON_DEPTH",
    "METADATA_TENSOR",
    "SHARD_RESULT_FQN",
    "STORABLE_DTYPES",
    "TORCH_DTYPE_OF_CODE",
    "byte_range",
    "check_item",
    "decode_value",
    "encode_value",
    "item_name",
    "stored_name",
    "tensor_array",
]
