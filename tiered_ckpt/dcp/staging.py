"""``TieredStager``: the staging of ``dcp.async_save`` for the tiered backend (DCP's ``AsyncStager``
protocol, ``torch.distributed.checkpoint.staging``): a copy of the state dict whose tensors live in
host buffers kept from one save to the next, filled by a pool of copy threads.

DCP's ``DefaultStager`` copies tensor by tensor on the caller's thread. Here every tensor (the local
tensor of a ``DTensor``, which is re-wrapped with the same mesh, placements, shape and stride) is
copied into a buffer kept per key path, reallocated only when its shape or dtype changes; a
contiguous host tensor is cut into pieces of :data:`PIECE_BYTES` and the pieces spread in
consecutive runs of equal bytes over the threads (``Tensor.copy_`` releases the GIL), the caller's
thread among them. A tensor on an accelerator is copied device-to-host by the caller's thread
(``non_blocking`` into pinned buffers, then one synchronize). Buffers are page-locked (pinned) when
CUDA is available. Non-tensor values are deep-copied (``copy.deepcopy``, as DCP's stager does), so
later mutation of the caller's lists and dicts does not reach the checkpoint.

``stage`` returns once the copy is complete (``should_synchronize_after_execute`` is false: there
is nothing to wait for). The stager owns one set of buffers: stage again only after the save that
reads the previous staged state has finished (``dcp.async_save``'s future). Pass one stager to every
:class:`~tiered_ckpt.dcp.storage_writer.TieredStorageWriter` (``stager=``) or to
:func:`tiered_ckpt.dcp.async_save` (``async_stager=``) to reuse its buffers; :meth:`close` frees
them.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from tiered_ckpt.training.staging import PIECE_BYTES, PieceCopier


def _cuda_available() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken CUDA setup means no pinning, not a failed save
        return False


class TieredStager(AsyncStager):
    """Reusable host buffers for the tensors of a DCP state dict, filled in parallel; see the
    module docstring.

    ``threads``: how many threads copy (the caller's included); ``None`` = ``os.cpu_count()``.
    ``piece_bytes``: contiguous host tensors are copied in pieces of about this many bytes; a state
    of fewer bytes than twice this is copied by the caller's thread alone. ``pinned``: allocate
    buffers page-locked; ``None`` = when CUDA is available. Raises ``ValueError`` for
    ``threads < 1`` or ``piece_bytes < 1``."""

    _synchronize_after_execute = False  # stage() returns a finished copy

    def __init__(
        self,
        threads: int | None = None,
        *,
        piece_bytes: int = PIECE_BYTES,
        pinned: bool | None = None,
    ) -> None:
        self._copier = PieceCopier(threads, piece_bytes, _copy_pieces, "tiered-ckpt-dcp-stage")
        self.threads, self.piece_bytes = self._copier.threads, self._copier.piece_bytes
        self.pinned = _cuda_available() if pinned is None else bool(pinned)
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._used: set[tuple[Any, ...]] = set()
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._device: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: Buffers allocated by the last :meth:`stage` (0 when every buffer was reused).
        self.allocated = 0

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return sum(b.nbytes for b in self._buffers.values())

    def buffer(self, *path: Any) -> torch.Tensor | None:
        """The buffer of the tensor at key path ``path`` (keys and list positions), if any."""
        return self._buffers.get(tuple(path))

    def close(self) -> None:
        """Stop the copy threads and free the buffers. Idempotent; a later :meth:`stage` starts
        again (allocating anew)."""
        self._copier.close()
        self._buffers = {}

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns a finished copy."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` whose tensors live in this stager's buffers (valid until the
        next call). Tensors keep their shape, dtype and bytes; ``DTensor`` s their mesh,
        placements, global shape and stride."""
        self._used, self._host, self._device, self.allocated = set(), [], [], 0
        try:
            out = self._value(state_dict, ())
            self._copy_device(self._device)
            self._copy_host(self._host)
        finally:
            self._host, self._device = [], []
        for stale in set(self._buffers) - self._used:
            del self._buffers[stale]  # a key that left the state: its memory is freed
        return out

    # --- the walk

    def _value(self, v: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(v, DTensor):
            local = self._tensor(v._local_tensor, path)
            return DTensor.from_local(
                local,
                v.device_mesh,
                v.placements,
                run_check=False,
                shape=v.shape,
                stride=v.stride(),
            )
        if type(v) in (torch.Tensor, torch.nn.Parameter):
            return self._tensor(v, path)
        if type(v) in (dict, OrderedDict):
            return type(v)((k, self._value(x, path + (k,))) for k, x in v.items())
        if type(v) in (list, tuple):
            return type(v)(self._value(x, path + (i,)) for i, x in enumerate(v))
        return copy.deepcopy(v)

    def _tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            if buf is not None:
                del self._buffers[path]  # freed before its replacement: at most one copy held
            buf = torch.empty(
                t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pinned and t.numel() > 0
            )
            self._buffers[path] = buf
            self.allocated += 1
        self._used.add(path)
        (self._host if t.device.type == "cpu" else self._device).append((buf, t))
        return buf

    # --- the copy

    def _copy_device(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not copies:
            return
        for dst, src in copies:
            dst.copy_(src, non_blocking=self.pinned)
        for dev in {src.device for _, src in copies}:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

    def _pieces(self, dst: torch.Tensor, src: torch.Tensor) -> list[tuple[Any, Any, int]]:
        n = dst.numel() * dst.element_size()
        if n == 0:
            return []
        if not src.is_contiguous() or n <= self.piece_bytes:
            return [(dst, src, n)]
        d = dst.reshape(-1).view(torch.uint8)
        s = src.reshape(-1).view(torch.uint8)
        step = self.piece_bytes
        return [(d[i : i + step], s[i : i + step], min(step, n - i)) for i in range(0, n, step)]

    def _copy_host(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._copier.run([p for dst, src in copies for p in self._pieces(dst, src)])

    def __getstate__(self) -> dict[str, Any]:
        # a stager travelling to DCP's checkpoint process (process mode) goes without its
        # buffers (and its copier without its threads): it stages in the caller's process only
        return {**self.__dict__, "_buffers": {}, "_host": [], "_device": [], "_used": set()}


def _copy_pieces(pieces: list[tuple[Any, Any, int]]) -> None:
    with torch.no_grad():
        for dst, src, _ in pieces:
            dst.copy_(src)


__all__ = ["PIECE_BYTES", "TieredStager"]
