"""A rank's tensor index: what each tensor of a shard file is (dtype, shape, byte range, global slice,
per-chunk CRC32Cs), and the cross-rank rules the tensors of a step obey. Pure: no I/O, no threads.

- Steps saved now keep the index in each shard's header (:func:`encode_index` /
  :func:`apply_index`), verified through the manifest's ``header_sha256``; older steps list every
  tensor in the manifest (:meth:`TensorRecord.to_dict`) and still load.
- Manifest-side failures raise :class:`~tiered_ckpt.errors.ManifestError`; header-side functions
  take the caller's error factory.

Why the index moved out of the manifest: docs/design.md, "Tensor index".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tiered_ckpt.format.validate import (
    MAX_NUMEL,
    check_keys,
    fail,
    first_overlap,
    int_list,
    str_field,
)

#: Largest shard we accept in a manifest (bytes): 2**48 = 256 TiB. Guards integer arithmetic.
MAX_SHARD_BYTES = 2**48
MAX_TENSORS_PER_SHARD = 10_000_000
MAX_NAME_LEN = 4096
#: safetensors caps the JSON header at 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000
#: Bounds of ``crc32c_chunk_bytes`` (a power of two).
MIN_CRC_CHUNK_BYTES, MAX_CRC_CHUNK_BYTES = 4096, 2**30

#: safetensors dtype code -> bytes per element (the codes safetensors defines that numpy can hold).
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}

_HEX8 = re.compile(r"^[0-9a-f]{8}$")
_HEX_RUN = re.compile(r"[0-9a-f]*")


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a shard file.

    ``dtype``: a safetensors code (``"F16"``, ``"BF16"``, ``"F8_E4M3"``...). ``shape``: the local
    shape. ``data_offsets``: ``(begin, end)`` in bytes, relative to the start of the data section
    (after the 8-byte length and the JSON header), as in the safetensors header.
    ``global_shape``/``global_offset``: set together for a slice of a larger global tensor (see
    :class:`~tiered_ckpt.state.GlobalSlice`). ``crc32c`` (v2, optional): CRC32C (8 hex digits) of
    each chunk of the tensor's bytes, chunk size set by the shard's ``crc32c_chunk_bytes``; ``None``
    (key absent) when unknown: a partial read of such a tensor verifies the whole shard's sha256
    instead.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    crc32c: tuple[str, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "data_offsets": list(self.data_offsets),
        }
        if self.crc32c is not None:
            d["crc32c"] = list(self.crc32c)
        if self.global_shape is not None:
            d["global_shape"] = list(self.global_shape)
            d["global_offset"] = list(self.global_offset or ())
        return d

    @classmethod
    def from_dict(cls, obj: Any, what: str = "tensor") -> TensorRecord:
        check_keys(
            obj,
            what,
            {"name", "dtype", "shape", "data_offsets"},
            {"global_shape", "global_offset", "crc32c"},
        )
        name = str_field(obj["name"], f"{what}.name")
        if not name or len(name) > MAX_NAME_LEN:
            raise fail(f"{what}.name has bad length {len(name)}")
        dtype = str_field(obj["dtype"], f"{what}.dtype")
        if dtype not in DTYPE_SIZES:
            raise fail(f"{what}.dtype {dtype[:20]!r} is not supported")
        shape = int_list(obj["shape"], f"{what}.shape")
        offs = int_list(obj["data_offsets"], f"{what}.data_offsets", MAX_SHARD_BYTES)
        if len(offs) != 2 or offs[0] > offs[1]:
            raise fail(f"{what}.data_offsets must be [begin, end] with begin <= end")
        n = numel(shape)
        if n > MAX_NUMEL:
            raise fail(f"{what}.shape {shape} has too many elements")
        if offs[1] - offs[0] != n * DTYPE_SIZES[dtype]:
            raise fail(
                f"{what}: data_offsets span {offs[1] - offs[0]} bytes, shape x dtype needs "
                f"{n * DTYPE_SIZES[dtype]}"
            )
        gs = go = None
        if ("global_shape" in obj) != ("global_offset" in obj):
            raise fail(f"{what}: global_shape and global_offset go together")
        if "global_shape" in obj:
            gs = int_list(obj["global_shape"], f"{what}.global_shape")
            go = int_list(obj["global_offset"], f"{what}.global_offset")
            if not len(gs) == len(go) == len(shape):
                raise fail(f"{what}: global_shape/global_offset/shape ranks differ")
            if numel(gs) > MAX_NUMEL:
                raise fail(f"{what}.global_shape {gs} has too many elements")
            for d, (o, s, g) in enumerate(zip(go, shape, gs)):
                if o + s > g:
                    raise fail(f"{what}: dim {d} slice [{o}, {o + s}) exceeds global size {g}")
        crcs = obj.get("crc32c")
        if crcs is not None:
            if not isinstance(crcs, list) or len(crcs) > MAX_SHARD_BYTES // MIN_CRC_CHUNK_BYTES + 1:
                raise fail(f"{what}.crc32c must be a list of chunk checksums or null")
            crcs = tuple(str_field(c, f"{what}.crc32c[{i}]", _HEX8) for i, c in enumerate(crcs))
        return cls(name, dtype, shape, (offs[0], offs[1]), gs, go, crcs)


def check_tensor_layout(tensors: Iterable[TensorRecord], size_bytes: int, what: str) -> None:
    """Names unique; byte ranges cover ``[0, data_len)`` without gaps or overlap (as safetensors'
    validator requires) and fit in a file of ``size_bytes``. Raises ManifestError."""
    seen: set[str] = set()
    tensors = list(tensors)
    for t in tensors:
        if t.name in seen:
            raise fail(f"{what}: tensor {t.name[:80]!r} listed twice")
        seen.add(t.name)
    pos = 0
    for t in sorted(tensors, key=lambda t: (t.data_offsets[0], t.data_offsets[1])):
        if t.data_offsets[0] != pos:
            raise fail(
                f"{what}: tensor {t.name[:80]!r} data_offsets {list(t.data_offsets)} "
                f"{'overlap' if t.data_offsets[0] < pos else 'leave a gap after'} byte {pos}"
            )
        pos = t.data_offsets[1]
    if pos + 8 > size_bytes:
        raise fail(f"{what}: tensor data ({pos} bytes) does not fit in size_bytes={size_bytes}")


def check_global_slices(step: int, per_rank: Iterable[tuple[int, Iterable[TensorRecord]]]) -> None:
    """Across the ranks of one step (``(rank, tensors)`` pairs): slices of one global tensor agree
    on its global shape and dtype and do not overlap (a sweep: near-linear, :func:`first_overlap`).
    Raises ManifestError. Called by the manifest reader for manifests that list tensors, and by the
    reshard planner and ``verify`` of a whole step on the verified headers' indexes."""
    boxes: dict[str, list[tuple[int, TensorRecord]]] = {}
    for rank, tensors in per_rank:
        for t in tensors:
            if t.global_shape is not None:
                boxes.setdefault(t.name, []).append((rank, t))
    for name, items in boxes.items():
        g0, d0 = items[0][1].global_shape, items[0][1].dtype
        for rank, t in items:
            if t.global_shape != g0 or t.dtype != d0:
                raise fail(
                    f"step {step}: slices of {name[:80]!r} disagree on global shape/dtype "
                    f"(rank {rank}: {t.dtype} {list(t.global_shape or ())})"
                )
        nonempty = [(r, t) for r, t in items if numel(t.shape) > 0]
        pair = first_overlap([(t.global_offset or (), t.shape) for _, t in nonempty])
        if pair is not None:
            ra, rb = nonempty[pair[0]][0], nonempty[pair[1]][0]
            raise fail(f"step {step}: slices of {name[:80]!r} on ranks {ra} and {rb} overlap")


# --- the index in a header


def encode_index(records: list[TensorRecord], crc32c: str, chunk_bytes: int) -> dict[str, Any]:
    """The index keys of a format-2 ``tiered_ckpt`` metadata block for ``records`` (in file order):
    ``crc32c_chunk_bytes``; ``crc32c``: the 8-hex-digit CRC32C of every ``chunk_bytes`` chunk of
    every tensor, concatenated in file order (``ceil(nbytes / chunk_bytes)`` per tensor, none for an
    empty one); ``slices``: ``{name: [global_shape, global_offset]}`` of the tensors that are slices
    of a global tensor. One string and one small map per shard: no per-tensor JSON object."""
    return {
        "crc32c_chunk_bytes": chunk_bytes,
        "crc32c": crc32c,
        "slices": {
            t.name: [list(t.global_shape), list(t.global_offset or ())]
            for t in records
            if t.global_shape is not None
        },
    }


def build_records(
    entries: list[tuple[int, int, str, str, tuple[int, ...]]],
    meta: dict[str, Any] | None,
    err: Callable[[str], Exception],
) -> tuple[tuple[TensorRecord, ...], int | None]:
    """The :class:`TensorRecord` s of a header's tensors ``entries`` (``(begin, end, name, dtype,
    shape)``, sorted by ``begin``, already checked to tile the data section), with the format-2
    index of ``meta`` applied (``None``: a format-1 header, no index). Returns ``(records,
    crc32c_chunk_bytes or None)``. Raises ``err(message)`` for a malformed index: a chunk size that
    is not a power of two in bounds, a CRC string of the wrong length or with other than lower-case
    hex digits, a slice of an unknown tensor or out of its global bounds."""
    if meta is None:
        return tuple(TensorRecord(n, d, s, (b, e)) for b, e, n, d, s in entries), None
    chunk, crcs, slices = meta.get("crc32c_chunk_bytes"), meta.get("crc32c"), meta.get("slices")
    if (
        type(chunk) is not int
        or not MIN_CRC_CHUNK_BYTES <= chunk <= MAX_CRC_CHUNK_BYTES
        or chunk & (chunk - 1)
    ):
        raise err("tensor index: crc32c_chunk_bytes is not a power of two in bounds")
    if type(crcs) is not str or not _HEX_RUN.fullmatch(crcs):
        raise err("tensor index: crc32c is not a string of lower-case hex digits")
    if type(slices) is not dict:
        raise err("tensor index: slices is not an object")
    need = sum(-(-(e - b) // chunk) for b, e, _, _, _ in entries)
    if len(crcs) != 8 * need:
        raise err(
            f"tensor index: crc32c holds {len(crcs) // 8} chunk checksums, the tensors have {need}"
        )
    out = []
    pos = 0
    new = object.__new__
    for b, e, n, d, s in entries:
        k = -(-(e - b) // chunk)
        crc = (
            (crcs[pos : pos + 8],)
            if k == 1
            else tuple(crcs[i : i + 8] for i in range(pos, pos + 8 * k, 8))
        )
        pos += 8 * k
        sl = slices.get(n)
        gs, go = (None, None) if sl is None else _slice_of(sl, s, err, n)
        t = new(
            TensorRecord
        )  # the fields are validated above: skip the frozen __init__ (half the cost)
        t.__dict__.update(
            name=n,
            dtype=d,
            shape=s,
            data_offsets=(b, e),
            global_shape=gs,
            global_offset=go,
            crc32c=crc,
        )
        out.append(t)
    if len(slices) != sum(1 for t in out if t.global_shape is not None):
        raise err("tensor index: slices names a tensor the header does not hold")
    return tuple(out), chunk


def _slice_of(
    sl: Any, shape: tuple[int, ...], err: Callable[[str], Exception], name: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if type(sl) is not list or len(sl) != 2 or type(sl[0]) is not list or type(sl[1]) is not list:
        raise err(f"tensor index: slice of {name[:80]!r} is malformed")
    gs, go = sl
    if not len(gs) == len(go) == len(shape) or not all(type(x) is int and 0 <= x for x in gs + go):
        raise err(f"tensor index: slice of {name[:80]!r} does not match its shape")
    if numel(tuple(gs)) > MAX_NUMEL or any(o + n > g for o, n, g in zip(go, shape, gs)):
        raise err(f"tensor index: slice of {name[:80]!r} exceeds its global shape")
    return tuple(gs), tuple(go)


__all__ = [
    "DTYPE_SIZES",
    "MAX_CRC_CHUNK_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_NAME_LEN",
    "MAX_SHARD_BYTES",
    "MAX_TENSORS_PER_SHARD",
    "MIN_CRC_CHUNK_BYTES",
    "TensorRecord",
    "build_records",
    "check_global_slices",
    "check_tensor_layout",
    "encode_index",
    "numel",
]
