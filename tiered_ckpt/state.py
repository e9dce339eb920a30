"""Markers that callers wrap state values in.

Pure module: no I/O. A *state* is a nested mapping of string keys to numpy arrays,
:class:`GlobalSlice` or :class:`Replicated` wrappers, or JSON-able values (SPEC §2, §3, §6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class GlobalSlice:
    """An array that is the slice of a larger global tensor.

    ``array`` (any supported dtype, shape ``s``) holds ``global[offset[0]:offset[0]+s[0], ...]`` of
    a global tensor of shape ``global_shape``. A ZeRO flat partition is the 1-D case: ``global_shape
    == (total_numel,)`` and ``offset == (param_shard_offset,)``. Loading returns the plain array;
    the manifest keeps ``global_shape`` and ``offset`` so that resharding can reassemble and
    re-split.

    Raises ``ValueError`` if ranks differ or the slice does not fit inside ``global_shape``.
    """

    array: Any
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]

    def __post_init__(self) -> None:
        arr = np.asarray(self.array) if not isinstance(self.array, np.ndarray) else self.array
        gs = tuple(int(x) for x in self.global_shape)
        off = tuple(int(x) for x in self.offset)
        object.__setattr__(self, "array", arr)
        object.__setattr__(self, "global_shape", gs)
        object.__setattr__(self, "offset", off)
        if len(gs) != arr.ndim or len(off) != arr.ndim:
            raise ValueError(
                f"GlobalSlice: array has {arr.ndim} dims but global_shape={gs} offset={off}"
            )
        for dim, (o, n, g) in enumerate(zip(off, arr.shape, gs)):
            if o < 0 or g < 0 or o + n > g:
                raise ValueError(
                    f"GlobalSlice: dim {dim}: slice [{o}, {o + n}) does not fit in global size {g}"
                )


@dataclass(frozen=True)
class Replicated:
    """A value identical on every rank (array or JSON-able): stored once, handed to every rank."""

    value: Any


__all__ = ["GlobalSlice", "Replicated"]
