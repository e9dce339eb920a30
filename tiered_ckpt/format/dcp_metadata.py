"""The checks of a DCP save's metadata JSON (format 1, written by
:func:`tiered_ckpt.dcp.metadata_json.encode`; the layout is in that module's docstring), without
torch: :func:`parse` validates every field and returns a :class:`MetadataTable`, the chunks of each
tensor as one ``int64`` array. The DCP reader builds DCP's ``Metadata`` from it and ``tiered-ckpt
verify`` checks it against the shards, so a step verifies under the rules it loads under. Every
failure raises :class:`~tiered_ckpt.errors.DcpMetadataError`.

**Caps.** A 1.1 TB FSDP2 job on 512 ranks (a 70B-parameter model with Adam: ~2,200 tensors, each
split along dim 0 over the ranks) stores ~1.1M chunks, at most 512 per tensor, in ~30 MB of JSON.

- :data:`MAX_METADATA_BYTES` (256 MiB): 8x that job's metadata; a larger one is not read.
- :data:`MAX_ENTRIES` (131,072 keys): ~60x its tensors; a mixture-of-experts model with a tensor per
  expert and layer stays below too. :data:`MAX_JSON_VALUES` (32 per entry): JSON values besides the
  chunk arrays, bounded from counts of quotes and brackets before the scan below and of commas
  before ``json.loads`` runs.
- :data:`MAX_CHUNKS_PER_TENSOR` (65,536): 128x its chunks per tensor; DCP writes at most one chunk
  of a DTensor per rank, so a job of 65,536 ranks fits.
- :data:`MAX_CHUNKS` (4,194,304 in all): ~4x its chunks. Decoded into DCP's objects a chunk keeps
  ~270 bytes (~420 at the peak of its decoding), so an accepted metadata costs at most ~1.1 GiB
  (~1.7 GiB at the peak) however it was forged.

**Bounded work and memory.** Before anything is decoded, the bytes are scanned once (C regular
expressions) for JSON strings and arrays of integers; every array of integers of
:data:`_OUT_OF_LINE` bytes or more outside strings is cut out, its elements counted with
``bytes.count`` and checked against the caps before it is parsed (straight into int64); the rest,
small, goes to ``json.loads``. So a file past a chunk cap is refused having allocated nothing per
chunk (1.5M chunks in 16 MB: refused in 0.05 s, under 1 MiB allocated), and an accepted one costs
8 bytes per integer kept plus ~250 bytes per chunk of one tensor while its tiling is checked
(:func:`check_tiling`: ``O(n log n)`` for ``n`` chunks whatever their layout; 50,000 chunks
crossing a 2-D tensor: 0.06 s). ``json.loads`` of the rest costs a few dozen bytes per JSON value
there: at most ~250 MiB under :data:`MAX_JSON_VALUES`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiered_ckpt.errors import DcpMetadataError, ManifestError
from tiered_ckpt.format.manifest import ShardManifest
from tiered_ckpt.format.tensor_index import MAX_NAME_LEN
from tiered_ckpt.format.validate import (
    MAX_NDIM,
    MAX_NUMEL,
    check_keys,
    fail,
    int_field,
    int_list,
    no_duplicate_keys,
    str_field,
)
from tiered_ckpt.layout import MAX_WORLD_SIZE

FORMAT = 1
#: ``manifest.extra`` key of the DCP backend, and its format (the writer's
#: :data:`tiered_ckpt.dcp.storage_writer.EXTRA_KEY` and ``EXTRA_FORMAT``).
EXTRA_KEY = "dcp"
EXTRA_FORMAT = 1
#: Largest metadata accepted (bytes of JSON); a larger one is refused before it is read.
MAX_METADATA_BYTES = 1 << 28
#: Most keys of ``state_dict_metadata`` (tensors and byte items).
MAX_ENTRIES = 1 << 17
#: Most JSON values outside the integer arrays cut out (module docstring): ~20 per entry in real
#: metadata (its fields, its size, its planner path).
MAX_JSON_VALUES = 32 * MAX_ENTRIES
#: Most chunks of one tensor.
MAX_CHUNKS_PER_TENSOR = 1 << 16
#: Most chunks of all tensors together.
MAX_CHUNKS = 1 << 22
#: Most corners the tiling check of one tensor sorts (``chunks x 2**dims split``): a tensor split
#: along more than a handful of dimensions into many chunks, which DCP never writes, is refused.
MAX_CORNERS = 1 << 22
#: Most dimensions along which the chunks of one tensor may split it (DCP splits along one or two).
MAX_SPLIT_DIMS = 13
#: Longest flatten path of one key (DCP's nesting of dicts and lists), and the longest short string.
MAX_PATH_ITEMS = 256
MAX_SHORT_STR = 4096
#: A metadata dtype name -> the safetensors code of a shard tensor holding it.
DTYPE_CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
}
MEMORY_FORMATS = ("contiguous_format", "channels_last", "preserve_format")

_TOP_KEYS = {"format", "version", "state_dict_metadata", "planner_data", "storage_meta"}
_TENSOR_KEYS = {"kind", "dtype", "size", "requires_grad", "pin_memory", "memory_format", "chunks"}
_META_KEYS = {"checkpoint_id", "save_id", "load_id", "modules"}
#: Arrays of integers this long (bytes) or longer are parsed apart (module docstring).
_OUT_OF_LINE = 64
_INTS = rb"[0-9, \t\n\r-]"  # what an array of integers holds
#: From where it starts, everything up to the next array of integers of :data:`_OUT_OF_LINE` bytes
#: or more outside strings (skipped in the regular expression engine: other characters, whole
#: strings, shorter arrays of integers, other brackets), and that array (group 1; ``None`` at the
#: end, or where the input stops being JSON). Every repetition is possessive: no backtracking.
_SCAN = re.compile(
    rb'(?:[^"\[]++|"(?:[^"\\]++|\\.)*+"|\['
    + _INTS
    + b"{0,%d}+\\]|\\[(?!" % (_OUT_OF_LINE - 3)
    + _INTS
    + rb"*+\]))*+(\["
    + _INTS
    + rb"*+\])?",
    re.DOTALL,
)
#: An array of JSON integers, exactly.
_INT_ARRAY = re.compile(
    rb"\[_*+(?:-?+(?:0|[1-9][0-9]*+)_*+(?:,_*+-?+(?:0|[1-9][0-9]*+)_*+)*+)?+\]".replace(
        b"_", rb"[ \t\n\r]"
    )
)
_HUGE_INT = re.compile(rb"[0-9]{19}")  # 10**18 or more: past any field's range (and int64's)
#: A string cut-out arrays become (NUL never occurs in a string of an accepted input).
_MARK = "\x00"


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the metadata. ``chunks``: ``(n, 1 + 2 * ndim)`` int64, per chunk the rank
    whose shard holds it, its offsets and its sizes (elements); they tile ``size`` exactly."""

    dtype: str
    size: tuple[int, ...]
    requires_grad: bool
    pin_memory: bool
    memory_format: str
    chunks: np.ndarray


@dataclass(frozen=True)
class BytesEntry:
    """A byte item, stored in rank ``rank`` 's shard."""

    rank: int


@dataclass(frozen=True)
class MetadataTable:
    """A validated metadata: ``entries`` in file order; ``planner_data``: ``{fqn: path}`` or
    ``None``; ``storage_meta``: ``{"checkpoint_id", "save_id", "load_id": str | None, "modules":
    [str]}`` or ``None``."""

    version: str | None
    entries: dict[str, TensorEntry | BytesEntry]
    planner_data: dict[str, tuple[str | int, ...]] | None
    storage_meta: dict[str, Any] | None

    def items(self) -> Iterator[tuple[int, str, str, tuple[int, ...] | None]]:
        """``(rank, name, code, shape)`` of every item: the tensor ``name`` holding it in rank
        ``rank`` 's shard (:func:`item_name`, escaped as the shard escapes keys), its safetensors
        dtype ``code`` and its chunk's sizes (``None``: a byte item, a 1-D ``"U8"`` tensor of any
        length). Chunks with no element are not stored and are not listed."""
        for fqn, e in self.entries.items():
            if isinstance(e, BytesEntry):
                yield e.rank, stored_name(item_name(fqn, None)), "U8", None
                continue
            nd, code = len(e.size), DTYPE_CODES[e.dtype]
            for row in e.chunks.tolist():
                sizes = tuple(row[1 + nd :])
                if 0 not in sizes:
                    yield row[0], stored_name(item_name(fqn, tuple(row[1 : 1 + nd]))), code, sizes


def item_name(fqn: str, offsets: tuple[int, ...] | None) -> str:
    """The key of an item in the state a rank's shard is written from: ``"<fqn>@<o0>,<o1>,..."``
    for a chunk at ``offsets`` (0-d: ``"<fqn>@"``), ``"<fqn>@b"`` for a byte item (``None``)."""
    if offsets is None:
        return f"{fqn}@b"
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


def stored_name(key: str) -> str:
    """The tensor name a shard gives the top-level key ``key`` (``%`` -> ``%25``, ``/`` ->
    ``%2F``, as :func:`tiered_ckpt.format.shard_file.flatten_state` escapes keys)."""
    return key.replace("%", "%25").replace("/", "%2F")


@dataclass(frozen=True)
class DcpStepInfo:
    """A DCP step's ``manifest.extra["dcp"]``: the rank whose shard holds the metadata tensor, its
    name and its size (bytes); for a save into node-local roots also the metadata's hex sha256 (the
    other nodes' ``dcp_metadata.json`` copies are checked against it)."""

    metadata_rank: int
    metadata_tensor: str
    metadata_bytes: int
    metadata_sha256: str | None = None


def dcp_step_info(m: ShardManifest) -> DcpStepInfo:
    """``m.extra["dcp"]``, validated against ``m``. Raises :class:`DcpMetadataError` (also for a
    step not written through the DCP backend)."""
    where = f"step {m.step}"
    info = (m.extra or {}).get(EXTRA_KEY)
    if not isinstance(info, dict):
        raise DcpMetadataError(
            f"{where} was not saved through tiered_ckpt.dcp (its manifest has no extra.dcp)"
        )
    keys = {"format", "metadata_rank", "metadata_tensor", "metadata_bytes"}
    if not keys <= set(info) <= keys | {"metadata_sha256"} or info["format"] != EXTRA_FORMAT:
        raise DcpMetadataError(f"{where}: extra.dcp is malformed or of an unknown format")
    digest = info.get("metadata_sha256")
    if digest is not None and (
        type(digest) is not str or len(digest) != 64 or digest.strip("0123456789abcdef")
    ):
        raise DcpMetadataError(f"{where}: extra.dcp.metadata_sha256 is not a hex sha256")
    rank, name, n = info["metadata_rank"], info["metadata_tensor"], info["metadata_bytes"]
    if (
        type(rank) is not int
        or not 0 <= rank < m.world_size
        or type(name) is not str
        or not 0 < len(name) <= MAX_NAME_LEN
        or type(n) is not int
        or not 0 < n <= MAX_METADATA_BYTES
    ):
        raise DcpMetadataError(
            f"{where}: extra.dcp names metadata rank {str(rank)[:20]}, a tensor name or a size "
            "out of range"
        )
    return DcpStepInfo(rank, name, n, digest)


# --- the scan


class _Arrays:
    """The arrays of integers cut out of ``raw``: ``spans[i]`` is the ``[start, end)`` of the one
    the skeleton names ``"\\x00<i>"``."""

    def __init__(self, raw: bytes, spans: list[int]) -> None:
        self.raw = raw
        self.spans = spans

    def count(self, v: Any) -> int | None:
        """Elements of the cut-out array ``v`` names (counted, not parsed), or ``None``."""
        i = self._index(v)
        if i is None:
            return None
        return self.raw.count(b",", self.spans[2 * i], self.spans[2 * i + 1]) + 1  # at most

    def parse(self, v: Any, what: str) -> np.ndarray:
        """The integers of ``v``: a cut-out array (validated, parsed straight into int64) or a short
        JSON list. Raises ManifestError for anything else."""
        i = self._index(v)
        if i is None:
            if type(v) is not list or not all(type(x) is int for x in v):
                raise fail(f"{what} must be a list of integers")
            if any(not -(2**62) <= x <= 2**62 for x in v):
                raise fail(f"{what} hold an integer out of range")
            return np.array(v, dtype=np.int64)
        text = self.raw[self.spans[2 * i] : self.spans[2 * i + 1]]
        if not _INT_ARRAY.fullmatch(text):
            raise fail(f"{what} must be a list of integers")
        if _HUGE_INT.search(text):
            raise fail(f"{what} hold an integer out of range")
        if not any(c in text for c in b"0123456789"):
            return np.empty(0, dtype=np.int64)  # numpy reads no number as [0]
        a = np.fromstring(text[1:-1], dtype=np.int64, sep=",")
        if len(a) != text.count(b",") + 1:
            raise fail(f"{what} must be a list of integers")
        return a

    def _index(self, v: Any) -> int | None:
        if type(v) is str and v.startswith(_MARK):
            return int(v[1:])
        return None


def _skeleton(raw: bytes) -> tuple[bytes, _Arrays]:
    """``raw`` with each array of integers of :data:`_OUT_OF_LINE` bytes or more (outside strings)
    replaced by a string naming it, and those arrays. Input holding ``\\u0000`` is refused (the
    replacement strings are the only ones that hold NUL). Arrays past a point where the input is
    not JSON are left in place (``json.loads`` then refuses it)."""
    if b"\\u0000" in raw:
        raise fail("a string holds a NUL character")
    parts: list[bytes] = []
    spans: list[int] = []
    pos = 0
    while (m := _SCAN.match(raw, pos)).group(1) is not None:
        a, b = m.span(1)
        parts += [raw[pos:a], b'"\\u0000%d"' % (len(spans) // 2)]
        spans += [a, b]
        pos = b
    if not spans:
        return raw, _Arrays(raw, spans)
    parts.append(raw[pos:])
    return b"".join(parts), _Arrays(raw, spans)


def _loads(text: bytes) -> Any:
    try:
        return json.loads(text, object_pairs_hook=no_duplicate_keys)
    except ManifestError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise fail(f"not valid JSON: {e}") from None


# --- the tiling


def check_tiling(off: np.ndarray, sz: np.ndarray, size: tuple[int, ...], what: str) -> None:
    """The boxes ``off[i] + [0, sz[i])`` (``(n, ndim)`` int64, inside the tensor) tile a tensor of
    ``size`` exactly: every element lies in exactly one box. Raises ManifestError otherwise (a load
    would leave part of the tensor unread, or read it twice, silently).

    The count of boxes covering a point is ``sum_v c_v * H(x - v)`` over the boxes' corners ``v``
    (``H``: 1 where ``x >= v`` in every dimension; ``c_v``: the sum of ``(-1)**(upper sides)`` of
    the corners at ``v``), and such a sum is zero everywhere only if every ``c_v`` is (the least
    ``v`` with ``c_v != 0`` would count ``c_v`` at ``x = v``). So the boxes tile the tensor iff their
    corner sums equal the tensor's own: +-1 at its corners, 0 everywhere else. One sort of the
    ``n * 2**k`` corners (``k``: the dimensions some box does not span whole, at most
    :data:`MAX_SPLIT_DIMS`; corners capped at :data:`MAX_CORNERS`), each packed into one int64:
    ``O(n log n)`` time, ``24 * n * 2**k`` bytes.
    """
    dims = np.array(size, dtype=np.int64)
    keep = (sz > 0).all(axis=1) if sz.shape[1] else np.ones(len(sz), dtype=bool)
    off, sz = off[keep], sz[keep]
    gap = f"{what} do not tile the tensor of size {list(size)[:8]} (a chunk is missing or two overlap)"
    if math.prod(size) == 0:
        if len(off):
            raise fail(gap)
        return
    if sum((sz.prod(axis=1) if sz.shape[1] else np.ones(len(sz), np.int64)).tolist()) != math.prod(
        size
    ):
        raise fail(gap)
    split = [d for d in range(len(size)) if not ((off[:, d] == 0) & (sz[:, d] == dims[d])).all()]
    if not split:
        return  # one box: the whole tensor (the volumes add up)
    k, n = len(split), len(off)
    if k > MAX_SPLIT_DIMS or n << k > MAX_CORNERS:
        raise fail(
            f"{what}: {n} chunks split the tensor along {k} dimensions (at most {MAX_SPLIT_DIMS} "
            f"and {MAX_CORNERS} corners are checked)"
        )
    # a corner as one integer: mixed radix (size + 1 per dimension: at most 2**(48 + k) in all),
    # shifted left once for the sign bit (set: an odd number of upper sides)
    ext = [size[d] + 1 for d in split]
    strides = np.array([math.prod(ext[:i]) for i in range(k)], dtype=np.int64)
    base = off[:, split] @ strides
    step = sz[:, split] * strides
    keys = np.empty(n << k, dtype=np.int64)
    want = {}
    for mask in range(1 << k):
        upper = [i for i in range(k) if mask >> i & 1]
        part = keys[mask * n : (mask + 1) * n]
        np.add(base, step[:, upper].sum(axis=1), out=part)
        part <<= 1
        part |= len(upper) & 1
        want[sum(size[split[i]] * int(strides[i]) for i in upper)] = 1 - 2 * (len(upper) & 1)
    keys.sort()
    corner = keys >> 1
    new = np.empty(len(keys), dtype=bool)
    new[0] = True
    np.not_equal(corner[1:], corner[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    sums = np.add.reduceat(1 - 2 * (keys & 1).astype(np.int32), starts)
    nonzero = np.flatnonzero(sums)
    if (
        len(nonzero) != len(want)
        or dict(zip(corner[starts[nonzero]].tolist(), sums[nonzero].tolist())) != want
    ):
        raise fail(gap)


# --- the fields


def _has_duplicate_rows(a: np.ndarray) -> bool:
    s = a[np.lexsort(a.T[::-1])]
    return bool((s[1:] == s[:-1]).all(axis=1).any())


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


class _Parser:
    def __init__(self, arrays: _Arrays, world_size: int) -> None:
        self.arrays = arrays
        self.world_size = world_size
        self.chunks = 0

    def tensor(self, obj: dict[str, Any], what: str) -> TensorEntry:
        check_keys(obj, what, _TENSOR_KEYS)
        if not isinstance(obj["dtype"], str) or obj["dtype"] not in DTYPE_CODES:
            raise fail(f"{what}.dtype {str(obj['dtype'])[:40]!r} is not a storable dtype")
        if obj["memory_format"] not in MEMORY_FORMATS:
            raise fail(f"{what}.memory_format is unknown")
        size_v = obj["size"]
        if self.arrays.count(size_v) is not None:  # a long size: at most MAX_NDIM numbers anyway
            if self.arrays.count(size_v) > MAX_NDIM:
                raise fail(f"{what}.size has more than {MAX_NDIM} dims")
            size_v = self.arrays.parse(size_v, f"{what}.size").tolist()
        size = int_list(size_v, f"{what}.size")
        if math.prod(size) > MAX_NUMEL:
            raise fail(f"{what}.size {list(size)[:8]} holds more than {MAX_NUMEL} elements")
        chunks = self.chunk_array(obj["chunks"], size, what)
        return TensorEntry(
            dtype=obj["dtype"],
            size=size,
            requires_grad=_bool(obj["requires_grad"], what),
            pin_memory=_bool(obj["pin_memory"], what),
            memory_format=obj["memory_format"],
            chunks=chunks,
        )

    def chunk_array(self, v: Any, size: tuple[int, ...], what: str) -> np.ndarray:
        """The ``(n, 1 + 2 * ndim)`` chunks of a tensor of ``size``: counted against the caps
        before they are parsed, then checked (ranks, inside the tensor, tiling it exactly)."""
        nd = len(size)
        width = 1 + 2 * nd
        count = self.arrays.count(v)
        if count is None:
            count = len(v) if type(v) is list else 0
        n = count // width
        if n > MAX_CHUNKS_PER_TENSOR:
            raise fail(f"{what}.chunks: {n} chunks, over the cap of {MAX_CHUNKS_PER_TENSOR}")
        self.chunks += n
        if self.chunks > MAX_CHUNKS:
            raise fail(f"more than {MAX_CHUNKS} chunks in all (the cap)")
        flat = self.arrays.parse(v, f"{what}.chunks")
        if len(flat) % width:
            raise fail(
                f"{what}.chunks must be a list of integers, {width} per chunk (rank, offsets, "
                "sizes)"
            )
        a = flat.reshape(-1, width)
        rank, off, sz = a[:, 0], a[:, 1 : 1 + nd], a[:, 1 + nd :]
        dims = np.array(size, dtype=np.int64).reshape(1, nd)
        if (rank < 0).any() or (rank >= self.world_size).any():
            raise fail(
                f"{what}.chunks place a chunk on a rank outside world size {self.world_size}"
            )
        if (off < 0).any() or (sz < 0).any() or (off > dims).any() or (sz > dims - off).any():
            raise fail(f"{what}.chunks hold a chunk outside the tensor of size {list(size)[:8]}")
        if n > 1 and (not nd or _has_duplicate_rows(off)):
            raise fail(f"{what}.chunks hold two chunks at the same offsets")
        check_tiling(off, sz, size, f"{what}.chunks")
        return a

    def count_chunks(self, obj: dict[str, Any]) -> None:
        """The chunk caps, checked on counts alone before any chunk array is parsed (an entry
        malformed here is refused when it is parsed)."""
        total = 0
        for v in obj.values():
            if not isinstance(v, dict) or v.get("kind") != "tensor":
                continue
            size = v.get("size")
            if self.arrays.count(size) is not None:  # a long size: parsed (a few numbers)
                if self.arrays.count(size) > MAX_NDIM:
                    continue
                size = self.arrays.parse(size, "a size").tolist()
            nd = len(size) if type(size) is list else 0
            n = self.arrays.count(v.get("chunks"))
            if n is None:
                n = len(v["chunks"]) if type(v.get("chunks")) is list else 0
            total += n // (1 + 2 * nd)
            if total > MAX_CHUNKS:
                raise fail(f"more than {MAX_CHUNKS} chunks in all (the cap)")

    def state(self, obj: Any) -> dict[str, TensorEntry | BytesEntry]:
        check_keys(obj, "state_dict_metadata", set(), ignore_unknown=True)
        if len(obj) > MAX_ENTRIES:
            raise fail(f"state_dict_metadata has {len(obj)} entries, over the cap of {MAX_ENTRIES}")
        self.count_chunks(obj)
        out: dict[str, TensorEntry | BytesEntry] = {}
        for fqn, v in obj.items():
            what = f"state_dict_metadata[{fqn[:80]!r}]"
            if not fqn or len(fqn) > MAX_NAME_LEN:
                raise fail(f"{what}: key is empty or over {MAX_NAME_LEN} characters")
            if not isinstance(v, dict) or v.get("kind") not in ("bytes", "tensor"):
                raise fail(f"{what} must be an object of kind 'bytes' or 'tensor'")
            if v["kind"] == "bytes":
                check_keys(v, what, {"kind", "rank"})
                out[fqn] = BytesEntry(int_field(v["rank"], f"{what}.rank", 0, self.world_size - 1))
            else:
                out[fqn] = self.tensor(v, what)
        return out


def _planner(obj: Any, arrays: _Arrays) -> dict[str, tuple[str | int, ...]] | None:
    if obj is None:
        return None
    check_keys(obj, "planner_data", set(), ignore_unknown=True)
    out = {}
    for fqn, path in obj.items():
        what = f"planner_data[{fqn[:80]!r}]"
        n = arrays.count(path)
        if n is not None and n <= MAX_PATH_ITEMS:  # a path of integers only, cut out
            path = arrays.parse(path, what).tolist()
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


def _storage_meta(obj: Any) -> dict[str, Any] | None:
    if obj is None:
        return None
    check_keys(obj, "storage_meta", _META_KEYS)
    mods = obj["modules"]
    if not isinstance(mods, list) or len(mods) > MAX_SHORT_STR:
        raise fail("storage_meta.modules must be a list of strings")
    return {
        **{
            k: _opt_str(obj[k], f"storage_meta.{k}")
            for k in ("checkpoint_id", "save_id", "load_id")
        },
        "modules": [str_field(m, f"storage_meta.modules[{i}]") for i, m in enumerate(mods)],
    }


def parse(raw: bytes, world_size: int, where: str = "DCP metadata") -> MetadataTable:
    """The metadata ``raw`` (JSON, format 1), validated: every field's type and range, the caps
    (module docstring), the chunks of each tensor tiling it exactly, every rank below
    ``world_size`` (the step's). Raises :class:`DcpMetadataError` (the message starts with
    ``where``)."""
    if len(raw) > MAX_METADATA_BYTES:
        raise DcpMetadataError(f"{where}: {len(raw)} bytes, over the {MAX_METADATA_BYTES}-byte cap")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise DcpMetadataError(f"{where}: world size {world_size} out of range")
    try:
        # strings, arrays and objects first (each a JSON value; quotes and brackets in strings only
        # add to the bound): they bound the scan's steps too
        values = raw.count(b'"') // 2 + raw.count(b"[") + raw.count(b"{")
        if values > MAX_JSON_VALUES:
            raise fail(f"up to {values} JSON values, over the cap of {MAX_JSON_VALUES}")
        skeleton, arrays = _skeleton(raw)
        # values <= 1 + commas + containers (commas and brackets in strings only add to the bound)
        values = 1 + sum(skeleton.count(c) for c in (b",", b"[", b"{"))
        if values > MAX_JSON_VALUES:
            raise fail(
                f"up to {values} JSON values besides the chunks, over the cap of {MAX_JSON_VALUES}"
            )
        obj = check_keys(_loads(skeleton), "the metadata", _TOP_KEYS)
        if type(obj["format"]) is not int or obj["format"] != FORMAT:
            raise fail(f"format {str(obj['format'])[:20]!r} is not {FORMAT}")
        entries = _Parser(arrays, world_size).state(obj["state_dict_metadata"])
        return MetadataTable(
            version=_opt_str(obj["version"], "version"),
            entries=entries,
            planner_data=_planner(obj["planner_data"], arrays),
            storage_meta=_storage_meta(obj["storage_meta"]),
        )
    except DcpMetadataError:
        raise
    except ManifestError as e:
        raise DcpMetadataError(f"{where}: {e}") from None


def _trusted_ints(v: Any, arrays: _Arrays) -> np.ndarray:
    i = arrays._index(v)
    if i is None:
        return np.array(v, dtype=np.int64)
    text = arrays.raw[arrays.spans[2 * i] + 1 : arrays.spans[2 * i + 1] - 1]
    if not text.strip():
        return np.empty(0, dtype=np.int64)
    return np.fromstring(text, dtype=np.int64, sep=",")


def parse_trusted(raw: bytes, where: str = "DCP metadata") -> MetadataTable:
    """The table of metadata bytes :func:`parse` already accepted elsewhere (the same bytes, by
    sha256: the DCP reader's leading rank validated them and sent them to the others), read without
    checking any field: the cut-out integer arrays parsed straight into int64, the rest by
    ``json.loads``; nothing but JSON is ever interpreted. Input :func:`parse` would refuse is not
    diagnosed: it raises :class:`DcpMetadataError` where it does not even have the table's shape,
    and may otherwise give a table :func:`parse` would refuse (so only ever pass accepted bytes).
    About 5x faster than :func:`parse` (no scans of the arrays, no tiling check)."""
    try:
        skeleton, arrays = _skeleton(raw)
        obj = json.loads(skeleton)
        entries: dict[str, TensorEntry | BytesEntry] = {}
        for fqn, v in obj["state_dict_metadata"].items():
            if v["kind"] == "bytes":
                entries[fqn] = BytesEntry(int(v["rank"]))
                continue
            size = tuple(int(d) for d in _trusted_ints(v["size"], arrays).tolist())
            entries[fqn] = TensorEntry(
                dtype=v["dtype"],
                size=size,
                requires_grad=bool(v["requires_grad"]),
                pin_memory=bool(v["pin_memory"]),
                memory_format=v["memory_format"],
                chunks=_trusted_ints(v["chunks"], arrays).reshape(-1, 1 + 2 * len(size)),
            )
        planner = obj["planner_data"]
        if planner is not None:
            planner = {
                fqn: tuple(_trusted_ints(path, arrays).tolist() if isinstance(path, str) else path)
                for fqn, path in planner.items()
            }
        sm = obj["storage_meta"]
        return MetadataTable(
            version=obj["version"],
            entries=entries,
            planner_data=planner,
            storage_meta=None if sm is None else {k: sm[k] for k in _META_KEYS},
        )
    except DcpMetadataError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as e:
        # ManifestError (a NUL in a string) is a ValueError
        raise DcpMetadataError(
            f"{where}: not a metadata table ({type(e).__name__}: {str(e)[:200]})"
        ) from None


__all__ = [
    "DTYPE_CODES",
    "EXTRA_FORMAT",
    "EXTRA_KEY",
    "FORMAT",
    "MAX_CHUNKS",
    "MAX_CHUNKS_PER_TENSOR",
    "MAX_CORNERS",
    "MAX_ENTRIES",
    "MAX_JSON_VALUES",
    "MAX_METADATA_BYTES",
    "MAX_SPLIT_DIMS",
    "MEMORY_FORMATS",
    "BytesEntry",
    "DcpStepInfo",
    "MetadataTable",
    "TensorEntry",
    "check_tiling",
    "dcp_step_info",
    "item_name",
    "parse",
    "parse_trusted",
    "stored_name",
]
