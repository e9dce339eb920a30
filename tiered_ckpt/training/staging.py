"""Staging: copy a state into host buffers that are reused from one save to the next. No torch.

The only work an async save does in the caller's thread. Arrays (and ``GlobalSlice`` arrays) are
copied with ``np.copyto`` into a buffer kept per key path, reallocated only when the shape or dtype
changes (inside a ``Replicated`` too: the marker is kept);
JSON values are deep-copied (and validated) so that later mutation of the caller's lists and dicts
does not leak into the checkpoint. The stager owns one set of buffers: the caller must not stage
again while a background write still reads the previous staged state (the manager waits for it
first).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tiered_ckpt.errors import UnsupportedStateError
from tiered_ckpt.state import GlobalSlice, Replicated

__all__ = ["Stager", "copy_json"]


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


class Stager:
    """Reusable host buffers for the arrays of a state; see the module docstring."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, ...], np.ndarray] = {}
        self._used: set[tuple[str, ...]] = set()

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return sum(b.nbytes for b in self._buffers.values())

    def _copy(self, path: tuple[str, ...], a: np.ndarray) -> np.ndarray:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != a.shape or buf.dtype != a.dtype:
            buf = np.empty(a.shape, dtype=a.dtype)
            self._buffers[path] = buf
        np.copyto(buf, a, casting="no")
        self._used.add(path)
        return buf

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` whose arrays live in this stager's buffers (valid until the next
        call).

        Raises ``UnsupportedStateError`` for object arrays and non-JSON values.
        """
        self._used = set()
        out = self._walk(state, ())
        for stale in set(self._buffers) - self._used:
            del self._buffers[stale]  # a key that disappeared from the state: free its memory
        return out

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
            return self._copy(p, v)
        if isinstance(v, GlobalSlice):
            return GlobalSlice(self._copy(p, v.array), v.global_shape, v.offset)
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

            return self._copy(p, tensor_to_numpy(v if v.device.type == "cpu" else v.detach().cpu()))
        if isinstance(v, np.generic):
            return v  # immutable scalar
        return copy_json(v, "/".join(p))
