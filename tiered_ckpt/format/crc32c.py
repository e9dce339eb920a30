"""CRC32C (Castagnoli) checksums over any buffer without copies, and per-tensor chunk checksums.

- :func:`crc32c_extend` and :class:`Crc32c` call ``google_crc32c``'s C ``crc32c_extend`` through
  ctypes (zero-copy, GIL released); if unreachable, the ``bytes``-copy path of ``google_crc32c.extend`` is used.
- :class:`TensorChunkCrcs`: a tensor's bytes cut into ``chunk_bytes`` chunks (the last one shorter,
  none for a zero-size tensor), chunk ``k`` covering ``[k * chunk_bytes, min((k + 1) * chunk_bytes,
  nbytes))``, each CRC32C as 8 lower-case hex digits; a partial read verifies exactly the chunks it
  read.

Pure apart from loading the shared library; no file I/O. Why ctypes: docs/design.md, "CRC32C".
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Iterable
from typing import Any

import google_crc32c
import numpy as np

from tiered_ckpt.format.manifest import TensorRecord

log = logging.getLogger(__name__)

#: Default chunk size of per-tensor checksums (bytes). A partial read reads at most two extra chunks
#: per contiguous range; 1 MiB keeps that small and the manifest at ~11 bytes per MiB of tensor
#: data.
DEFAULT_CHUNK_BYTES = 1 << 20


def _load_extend() -> Any:
    try:
        from google_crc32c import _crc32c  # the C extension; libcrc32c is its dependency

        lib = ctypes.CDLL(_crc32c.__file__)
        fn = lib.crc32c_extend
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        if fn(0, b"123456789", 9) != 0xE3069283:  # the standard CRC32C check value
            raise OSError("crc32c_extend returned a wrong check value")
        return fn
    except (ImportError, OSError, AttributeError) as e:  # pragma: no cover - depends on the wheel
        log.warning("zero-copy CRC32C unavailable (%s); falling back to google_crc32c.extend", e)
        return None


_EXTEND = _load_extend()


def crc32c_extend(crc: int, data: Any) -> int:
    """CRC32C of ``data`` (any C-contiguous buffer: bytes, bytearray, memoryview, numpy array)
    continuing from ``crc`` (0 to start). Returns an int in ``[0, 2**32)``."""
    mv = memoryview(data)
    if mv.nbytes == 0:
        return crc
    if _EXTEND is None:  # pragma: no cover
        return int(google_crc32c.extend(crc, mv.tobytes()))
    if not mv.c_contiguous:
        raise ValueError("crc32c_extend needs a C-contiguous buffer")
    if mv.readonly and isinstance(data, bytes):
        return int(_EXTEND(crc, data, mv.nbytes))
    arr = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
    return int(_EXTEND(crc, arr.ctypes.data, arr.nbytes))


def crc_hex(crc: int) -> str:
    """8 lower-case hex digits."""
    return f"{crc:08x}"


class Crc32c:
    """hashlib-like CRC32C: ``update(buffer)``, ``hexdigest() -> "1a2b3c4d"``."""

    name = "crc32c"

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: Any) -> None:
        self._crc = crc32c_extend(self._crc, data)

    def hexdigest(self) -> str:
        return crc_hex(self._crc)


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """Number of checksum chunks of a tensor of ``nbytes`` bytes."""
    return -(-nbytes // chunk_bytes)


class TensorChunkCrcs:
    """A hasher fed the whole shard file in order (``update`` with consecutive pieces of any size)
    that computes, for every tensor, the CRC32C of each ``chunk_bytes`` chunk of its bytes.

    ``data_start``: file offset of the data section (8 + header length). ``records``: the tensors of
    the file (their ``data_offsets`` are relative to ``data_start`` and tile the data section).
    :meth:`result` -> ``{name: ("1a2b3c4d", ...)}``.
    """

    name = "crc32c-chunks"

    def __init__(self, data_start: int, records: Iterable[TensorRecord], chunk_bytes: int) -> None:
        self._data_start = data_start
        self._chunk = chunk_bytes
        self._tensors = sorted(
            (t for t in records if t.nbytes > 0), key=lambda t: t.data_offsets[0]
        )
        self._out: dict[str, list[str]] = {t.name: [] for t in records}
        self._pos = 0  # file offset of the next byte fed
        self._ti = 0  # index of the current tensor
        self._crc = 0  # running CRC of the current chunk
        self._in_chunk = 0  # bytes of the current chunk seen so far

    def update(self, data: Any) -> None:
        mv = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        i = 0
        n = mv.nbytes
        if self._pos < self._data_start:  # header bytes: skip
            skip = min(n, self._data_start - self._pos)
            i += skip
            self._pos += skip
        while i < n and self._ti < len(self._tensors):
            t = self._tensors[self._ti]
            t_end = self._data_start + t.data_offsets[1]
            # bytes left in this chunk, and in this tensor
            take = min(n - i, self._chunk - self._in_chunk, t_end - self._pos)
            self._crc = crc32c_extend(self._crc, mv[i : i + take])
            i += take
            self._pos += take
            self._in_chunk += take
            if self._in_chunk == self._chunk or self._pos == t_end:
                self._out[t.name].append(crc_hex(self._crc))
                self._crc, self._in_chunk = 0, 0
                if self._pos == t_end:
                    self._ti += 1
        self._pos += n - i

    def result(self) -> dict[str, tuple[str, ...]]:
        if self._ti != len(self._tensors):
            raise RuntimeError("TensorChunkCrcs.result() before every tensor byte was fed")
        return {k: tuple(v) for k, v in self._out.items()}


#: CRC32C (Castagnoli) polynomial, bit-reflected.
_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC32C polynomial, reflected bit order (zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    t, p = [], 1 << 30  # x^1
    for _ in range(64):
        t.append(p)
        p = _multmodp(p, p)
    return t


_X2N = _x2n_table()


@functools.lru_cache(maxsize=256)
def _x8n(n: int) -> int:
    """``x^(8 n)`` modulo the polynomial: the operator that shifts a CRC past ``n`` zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 63], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A + B`` from ``crc1`` = CRC32C(A), ``crc2`` = CRC32C(B) and ``len2`` = len(B) in
    bytes, without reading either (zlib's ``crc32_combine``, for the standard pre- and post-inverted
    CRC)."""
    return _multmodp(_x8n(len2), crc1) ^ crc2 if len2 else crc1


#: Below this many bytes an array's bytes are CRC'd a second time for the running CRC of the whole
#: sequence (cheap: they are small and in cache); above it its chunk CRCs are combined (no second
#: pass).
COMBINE_MIN_BYTES = 256 * 1024


def array_crcs(arrays: Iterable[np.ndarray], chunk_bytes: int) -> tuple[str, int, int]:
    """``(chunk CRCs, crc, nbytes)``: :func:`array_chunk_crcs` of ``arrays``, plus the CRC32C and
    byte count of all their bytes concatenated in that order (the data section of a shard), in one
    pass over large arrays (their chunk CRCs are combined with :func:`crc32c_combine`). An array of
    one chunk or less (the common case of many small tensors) costs two C calls on its memory in
    place (its chunk CRC, then the running CRC extended over the same, cached, bytes): no Python
    object per array beyond its hex string."""
    fn = _EXTEND
    if fn is None:  # pragma: no cover - depends on the wheel
        return _array_crcs_slow(arrays, chunk_bytes)
    out: list[str] = []
    crc, total = 0, 0
    for a in arrays:
        n = a.nbytes
        if n == 0:
            continue
        ptr = a.__array_interface__["data"][0]
        if n <= chunk_bytes:
            out.append(f"{fn(0, ptr, n):08x}")
            crc = fn(crc, ptr, n)
        else:
            hexes = array_chunk_crcs([a], chunk_bytes)
            out.append(hexes)
            if n < COMBINE_MIN_BYTES:
                crc = fn(crc, ptr, n)
            else:
                for i in range(0, len(hexes), 8):
                    crc = crc32c_combine(
                        crc, int(hexes[i : i + 8], 16), min(chunk_bytes, n - (i // 8) * chunk_bytes)
                    )
        total += n
    return "".join(out), crc, total


def _array_crcs_slow(
    arrays: Iterable[np.ndarray], chunk_bytes: int
) -> tuple[str, int, int]:  # pragma: no cover - only without the C library
    out, crc, total = [], 0, 0
    for a in arrays:
        if a.nbytes == 0:
            continue
        out.append(array_chunk_crcs([a], chunk_bytes))
        crc = crc32c_extend(crc, a.reshape(-1).view(np.uint8))
        total += a.nbytes
    return "".join(out), crc, total


def array_chunk_crcs(arrays: Iterable[np.ndarray], chunk_bytes: int) -> str:
    """The per-chunk CRC32Cs of each C-contiguous array's bytes (chunk ``k`` of an array covering
    bytes ``[k * chunk_bytes, min((k + 1) * chunk_bytes, nbytes))``, none for an empty array), as 8
    lower-case hex digits each, concatenated in the order given: the ``crc32c`` string of a format-2
    shard header (:func:`tiered_ckpt.format.tensor_index.encode_index`). Zero-copy (the arrays'
    memory is read in place); ctypes releases the GIL, so callers may split the arrays over
    threads."""
    out = []
    fn = _EXTEND
    for a in arrays:
        n = a.nbytes
        if n == 0:
            continue
        if fn is None:  # pragma: no cover
            flat = memoryview(a.reshape(-1).view(np.uint8))
            out += [
                crc_hex(crc32c_extend(0, flat[i : i + chunk_bytes]))
                for i in range(0, n, chunk_bytes)
            ]
            continue
        ptr = a.__array_interface__["data"][0]
        if n <= chunk_bytes:
            out.append(f"{fn(0, ptr, n):08x}")
        else:
            out += [
                f"{fn(0, ptr + i, min(chunk_bytes, n - i)):08x}" for i in range(0, n, chunk_bytes)
            ]
    return "".join(out)


def first_bad_chunk(data: Any, chunk_bytes: int, expected: Iterable[str]) -> int | None:
    """Index (from 0) of the first chunk of ``data`` (a buffer of bytes; chunk ``k`` covers bytes
    ``[k * chunk_bytes, (k + 1) * chunk_bytes)``, the last one shorter) whose CRC32C differs from
    ``expected[k]`` (8 hex digits each), or ``None`` when every chunk matches: one pass over the
    buffer in C (:func:`array_chunk_crcs`), one string comparison."""
    want = "".join(expected)
    got = array_chunk_crcs([np.frombuffer(data, dtype=np.uint8)], chunk_bytes)
    if got == want:
        return None
    return (
        next(
            (k for k in range(0, max(len(got), len(want)), 8) if got[k : k + 8] != want[k : k + 8]),
            0,
        )
        // 8
    )


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "first_bad_chunk",
    "Crc32c",
    "TensorChunkCrcs",
    "array_chunk_crcs",
    "array_crcs",
    "crc32c_combine",
    "crc32c_extend",
    "crc_hex",
    "chunk_count",
]
