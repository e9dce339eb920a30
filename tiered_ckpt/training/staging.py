"""Staging: copy a state into host buffers that are reused from one save to the next. No torch
import (torch is used only when the caller already imported it).

The only work an async save does in the caller's thread. Arrays (and ``GlobalSlice`` arrays) are
copied into a buffer kept per key path, reallocated only when the shape or dtype changes (inside a
``Replicated`` too: the marker is kept), so after the first save the buffers hold exactly one copy of
the state's arrays (a buffer whose shape changed is freed before its replacement is allocated). The
copy runs on a pool of threads (``os.cpu_count()`` by default, the caller's thread among them):
arrays larger than :data:`PIECE_BYTES` are cut into pieces of that size and the pieces spread in
consecutive runs of equal bytes over the threads; ``np.copyto`` releases the GIL, so the threads
copy in parallel at memory speed. Buffers are page-locked (pinned) when CUDA is available, so a
device-to-host copy into them needs no bounce buffer.
JSON values are deep-copied (and validated) so that later mutation of the caller's lists and dicts
does not leak into the checkpoint. The stager owns one set of buffers: the caller must not stage
again while a background write still reads the previous staged state (the manager waits for it
first).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from tiered_ckpt.errors import UnsupportedStateError
from tiered_ckpt.state import GlobalSlice, Replicated

__all__ = ["Stager", "PieceCopier", "copy_json", "PIECE_BYTES"]

#: Arrays larger than this are copied in pieces of this many bytes (spread over the threads).
PIECE_BYTES = 8 << 20
_SAME_SIZE_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken CUDA setup means no pinning, not a failed save
        return False


def _allocate(shape: tuple[int, ...], dtype: np.dtype, pinned: bool) -> np.ndarray:
    """An uninitialised C-contiguous array; page-locked (a view of a pinned torch tensor, which
    it keeps alive) when ``pinned`` and the allocation succeeds."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if pinned and nbytes:
        torch = sys.modules.get("torch")
        try:
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # type: ignore[union-attr]
            return t.numpy().view(dtype).reshape(shape)
        except Exception:  # noqa: BLE001 - no pinned memory left: pageable memory works too
            pass
    return np.empty(shape, dtype=dtype)


def _copy_pieces(pieces: list[tuple[np.ndarray, np.ndarray, int]]) -> None:
    for dst, src, _ in pieces:
        np.copyto(dst, src, casting="no")


def copy_json(value: Any, where: str) -> Any:
    """A deep copy of a JSON value (tuples -> lists). Raises ``UnsupportedStateError`` otherwise,
    including for non-string dict keys (JSON would silently turn them into strings)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [copy_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnsupportedStateError(f"{where}: key {k!r} is not a string")
            out[k] = copy_json(v, f"{where}/{k}")
        return out
    raise UnsupportedStateError(
        f"{where}: {type(value).__name__} is neither an array nor JSON-able"
    )


class PieceCopier:
    """Copies ``(dst, src, nbytes)`` pieces on a pool of ``threads`` threads, the caller's among
    them: the pieces are spread in consecutive runs of about equal bytes, one run per thread, and
    at most one thread per ``piece_bytes`` of the total is used (fewer bytes than twice
    ``piece_bytes`` are copied by the caller's thread alone: a hand-off costs more than it saves).
    ``copy`` copies one run; it must release the GIL for the threads to overlap (``np.copyto``,
    ``Tensor.copy_``). ``threads=None`` = ``os.cpu_count()``. Raises ``ValueError`` for
    ``threads < 1`` or ``piece_bytes < 1``. Pickles without its threads."""

    def __init__(
        self,
        threads: int | None,
        piece_bytes: int,
        copy: Callable[[list[tuple[Any, Any, int]]], None],
        name: str,
    ) -> None:
        self.threads = int(threads) if threads is not None else (os.cpu_count() or 1)
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
        self.piece_bytes = int(piece_bytes)
        self._copy, self._name = copy, name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, pieces: list[tuple[Any, Any, int]]) -> None:
        """Copy every piece; returns when all are copied (re-raises a thread's failure, after
        every piece has finished)."""
        total = sum(p[2] for p in pieces)
        workers = min(self.threads, len(pieces), max(1, total // self.piece_bytes))
        if workers <= 1:
            self._copy(pieces)
            return
        # Consecutive pieces of about equal bytes per thread (each thread streams its own range).
        groups: list[list[tuple[Any, Any, int]]] = [[] for _ in range(workers)]
        share, acc, g = total / workers, 0, 0
        for p in pieces:
            if acc >= share * (g + 1) and g < workers - 1:
                g += 1
            groups[g].append(p)
            acc += p[2]
        pool = self._executor()
        futures = [pool.submit(self._copy, grp) for grp in groups[1:] if grp]
        try:
            self._copy(groups[0])  # the caller's share
        finally:
            for f in futures:
                f.result()

    def close(self) -> None:
        """Stop the threads. Idempotent; a later :meth:`run` starts them again."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=max(1, self.threads - 1), thread_name_prefix=self._name
                )
            return self._pool

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pool": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class Stager:
    """Reusable host buffers for the arrays of a state, filled by a pool of copy threads; see the
    module docstring.

    ``threads``: how many threads copy (the caller's included); ``None`` = ``os.cpu_count()``.
    ``piece_bytes``: arrays larger than this are copied in pieces of about this many bytes, so
    that one large array is spread over every thread; a state of fewer bytes than twice this is
    copied by the caller's thread alone (a hand-off costs more than it saves), and at most one
    thread per ``piece_bytes`` of the state is used. ``pinned``: allocate buffers in page-locked
    memory (``torch.empty(..., pin_memory=True)``); ``None`` = when torch is already imported and
    CUDA is available. Raises ``ValueError`` for ``threads < 1`` or ``piece_bytes < 1``.
    """

    def __init__(
        self,
        threads: int | None = None,
        *,
        piece_bytes: int = PIECE_BYTES,
        pinned: bool | None = None,
    ) -> None:
        self._copier = PieceCopier(threads, piece_bytes, _copy_pieces, "tiered-ckpt-stage")
        self.threads, self.piece_bytes = self._copier.threads, self._copier.piece_bytes
        self.pinned = _cuda_available() if pinned is None else bool(pinned)
        self._buffers: dict[tuple[str, ...], np.ndarray] = {}
        self._used: set[tuple[str, ...]] = set()
        self._copies: list[tuple[np.ndarray, np.ndarray]] = []

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return sum(b.nbytes for b in self._buffers.values())

    def close(self) -> None:
        """Stop the copy threads (the buffers stay until the stager is dropped). Idempotent; a
        later :meth:`stage` starts them again."""
        self._copier.close()

    def _buffer(self, path: tuple[str, ...], a: np.ndarray) -> np.ndarray:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != a.shape or buf.dtype != a.dtype:
            if buf is not None:
                del self._buffers[path]  # freed before its replacement: at most one copy held
                buf = None
            buf = _allocate(a.shape, a.dtype, self.pinned)
            self._buffers[path] = buf
        self._used.add(path)
        self._copies.append((buf, a))
        return buf

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` whose arrays live in this stager's buffers (valid until the next
        call). Arrays keep their shape and dtype (bit-exact bytes; 0-d and empty arrays too).

        Raises ``UnsupportedStateError`` for object arrays and non-JSON values.
        """
        self._used = set()
        self._copies = []
        try:
            out = self._walk(state, ())
            self._copy_all(self._copies)
        finally:
            self._copies = []
        for stale in set(self._buffers) - self._used:
            del self._buffers[stale]  # a key that disappeared from the state: free its memory
        return out

    # --- the copy

    def _pieces(self, dst: np.ndarray, src: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """``(dst piece, src piece, bytes)``: byte views of contiguous arrays cut every
        ``piece_bytes``; a strided source cut along its first axis."""
        n = dst.nbytes
        if n == 0:
            return []
        if src.flags.c_contiguous:
            d = dst.reshape(-1).view(np.uint8)
            s = src.reshape(-1).view(np.uint8)
            step = self.piece_bytes
            return [(d[i : i + step], s[i : i + step], min(step, n - i)) for i in range(0, n, step)]
        view = _SAME_SIZE_UINT.get(src.dtype.itemsize)
        if view is not None and src.dtype.kind not in "biuf":  # ml_dtypes etc.: plain integers
            dst, src = dst.view(view), src.view(view)
        if src.ndim == 0 or src.shape[0] <= 1 or n <= self.piece_bytes:
            return [(dst, src, n)]
        rows = max(1, self.piece_bytes // (n // src.shape[0]))
        return [
            (dst[i : i + rows], src[i : i + rows], dst[i : i + rows].nbytes)
            for i in range(0, src.shape[0], rows)
        ]

    def _copy_all(self, copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self._copier.run([p for dst, src in copies for p in self._pieces(dst, src)])

    # --- the walk

    def _walk(self, obj: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise UnsupportedStateError(f"{'/'.join(path)}: key {k!r} is not a string")
            out[k] = self._value(v, path + (k,))
        return out

    def _value(self, v: Any, p: tuple[str, ...], in_rep: bool = False) -> Any:
        if isinstance(v, np.ndarray):
            if v.dtype == object:
                raise UnsupportedStateError(f"{'/'.join(p)}: object arrays cannot be stored")
            return self._buffer(p, v)
        if isinstance(v, GlobalSlice):
            return GlobalSlice(self._buffer(p, v.array), v.global_shape, v.offset)
        if (
            isinstance(v, Replicated) and not in_rep
        ):  # the marker kept, its value staged like any other
            return Replicated(self._value(v.value, p, True))
        if isinstance(v, Mapping):
            return self._walk(v, p)
        if type(v).__module__.split(".")[0] == "torch" and hasattr(v, "detach"):
            # A torch tensor given directly: bit-exact host view via the torch adapter (torch is
            # necessarily imported already), then the same copy into the reused buffer.
            from tiered_ckpt.training.torch_state import tensor_to_numpy

            return self._buffer(
                p, tensor_to_numpy(v if v.device.type == "cpu" else v.detach().cpu())
            )
        if isinstance(v, np.generic):
            return v  # immutable scalar
        return copy_json(v, "/".join(p))
