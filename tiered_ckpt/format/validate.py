"""Shared validators of the pure format layer: typed checks of JSON values that raise
:class:`~tiered_ckpt.errors.ManifestError` (never ``KeyError``/``TypeError``) with the field's path
in the message, and a JSON reader that refuses duplicate keys. Pure: no I/O."""

from __future__ import annotations

import bisect
import heapq
import json
import re
from typing import Any

from tiered_ckpt.errors import ManifestError

#: Most dimensions of one tensor shape.
MAX_NDIM = 64
#: Largest number of elements of one tensor (or global tensor).
MAX_NUMEL = 2**48


def fail(msg: str) -> ManifestError:
    """The error every validator raises (returned, for ``raise fail(...)``)."""
    return ManifestError(msg)


def int_field(v: Any, what: str, lo: int = 0, hi: int = 2**62) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise fail(f"{what} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise fail(f"{what} = {v} out of range [{lo}, {hi}]")
    return v


def str_field(v: Any, what: str, pattern: re.Pattern[str] | None = None) -> str:
    if not isinstance(v, str):
        raise fail(f"{what} must be a string, got {type(v).__name__}")
    if pattern is not None and not pattern.fullmatch(v):
        raise fail(f"{what} = {v[:80]!r} is malformed")
    return v


def int_list(v: Any, what: str, hi: int = MAX_NUMEL) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise fail(f"{what} must be a list, got {type(v).__name__}")
    if len(v) > MAX_NDIM:
        raise fail(f"{what} has {len(v)} dims (max {MAX_NDIM})")
    return tuple(int_field(x, f"{what}[{i}]", 0, hi) for i, x in enumerate(v))


def check_keys(
    obj: Any,
    what: str,
    required: set[str],
    optional: set[str] = frozenset(),
    *,
    ignore_unknown: bool = False,
) -> dict[str, Any]:
    """``obj`` is a JSON object holding every ``required`` key and (unless ``ignore_unknown``: for
    records other versions may extend) no key outside ``required | optional``."""
    if not isinstance(obj, dict):
        raise fail(f"{what} must be a JSON object, got {type(obj).__name__}")
    missing = required - obj.keys()
    if missing:
        raise fail(f"{what} lacks {sorted(missing)}")
    unknown = obj.keys() - required - optional
    if unknown and not ignore_unknown:
        raise fail(f"{what} has unknown keys {sorted(unknown)[:5]}")
    return obj


def loads_json(text: str | bytes, what: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=no_duplicate_keys)
    except ManifestError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{what} is not valid JSON: {e}") from None


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ManifestError("duplicate key in JSON object")
    return d


#: Most box comparisons :func:`first_overlap` makes per box, and at least, for boxes split along 3
#: or more dimensions (along 1 or 2 it is exact in ``O(n log n)``): real layouts (block grids)
#: need a few per box; past it the boxes are refused instead of checked for seconds or days.
MAX_OVERLAP_COMPARISONS_PER_BOX = 8
MIN_OVERLAP_COMPARISONS = 200_000


def first_overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[int, int] | None:
    """Indices of two overlapping boxes ``(offset, shape)`` (all non-empty, same rank), or ``None``.

    1-D: sorted by start, each box against the farthest end so far. 2-D: a sweep along dimension 0
    keeping the boxes open at the sweep line as disjoint intervals of dimension 1 in a sorted list,
    so each box is checked against its two neighbours there; both ``O(n log n)`` whatever the
    layout (before: boxes that cross, rows in one block and columns in another, made the sweep
    quadratic: 6,000 boxes 9 s). Dimensions every box spans alike are left out first. Split along 3
    or more: a sweep along the dimension that keeps the fewest boxes open, each compared with those
    open; block grids stay near-linear, and past :data:`MAX_OVERLAP_COMPARISONS_PER_BOX` per box
    (at least :data:`MIN_OVERLAP_COMPARISONS`) the boxes are refused
    (:class:`~tiered_ckpt.errors.ManifestError`) rather than checked for minutes. Exact
    tilings have their own check, :func:`tiered_ckpt.format.dcp_metadata.check_tiling`.
    """
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0][0])
    first = boxes[0]
    varying = [
        d for d in range(ndim) if any((o[d], s[d]) != (first[0][d], first[1][d]) for o, s in boxes)
    ]  # a dimension every box spans alike decides nothing: overlap is decided by the others
    if not varying:
        return (0, 1)
    if len(varying) < ndim:
        boxes = [(tuple(o[d] for d in varying), tuple(s[d] for d in varying)) for o, s in boxes]
    if len(varying) == 1:
        return _first_overlap_1d(boxes)
    if len(varying) == 2:
        return _first_overlap_2d(boxes)
    return _first_overlap_sweep(boxes, len(varying))


def _first_overlap_1d(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
) -> tuple[int, int] | None:
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
    far, far_i = -1, -1
    for i in order:
        start, stop = boxes[i][0][0], boxes[i][0][0] + boxes[i][1][0]
        if start < far:
            return (far_i, i)
        if stop > far:
            far, far_i = stop, i
    return None


def _first_overlap_2d(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
) -> tuple[int, int] | None:
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
    starts: list[int] = []  # dimension-1 starts of the open boxes, ascending (they are disjoint)
    owners: list[int] = []  # the box of each start
    closing: list[tuple[int, int]] = []  # heap of (end along dimension 0, dimension-1 start)
    for i in order:
        (r0, c0), (nr, nc) = boxes[i]
        while closing and closing[0][0] <= r0:
            _, c = heapq.heappop(closing)
            k = bisect.bisect_left(starts, c)
            del starts[k], owners[k]
        k = bisect.bisect_left(starts, c0)
        if k < len(starts) and starts[k] < c0 + nc:
            return (owners[k], i)
        if k > 0:
            j = owners[k - 1]
            if boxes[j][0][1] + boxes[j][1][1] > c0:
                return (j, i)
        starts.insert(k, c0)
        owners.insert(k, i)
        heapq.heappush(closing, (r0 + nr, c0))
    return None


def _first_overlap_sweep(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], ndim: int
) -> tuple[int, int] | None:
    def open_peak(d: int) -> int:
        ends: list[int] = []
        peak = 0
        for off, shp in sorted(boxes, key=lambda b: b[0][d]):
            while ends and ends[0] <= off[d]:
                heapq.heappop(ends)
            heapq.heappush(ends, off[d] + shp[d])
            peak = max(peak, len(ends))
        return peak

    d = min(range(ndim), key=open_peak)
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][d])
    active: list[tuple[int, int]] = []  # heap of (end along d, index)
    comparisons, budget = (
        0,
        max(MIN_OVERLAP_COMPARISONS, MAX_OVERLAP_COMPARISONS_PER_BOX * len(boxes)),
    )
    for i in order:
        off, shp = boxes[i]
        while active and active[0][0] <= off[d]:
            heapq.heappop(active)
        comparisons += len(active)
        if comparisons > budget:
            raise fail(
                f"{len(boxes)} slices split along {ndim} dimensions cross in too many ways to "
                f"check for overlaps (more than {budget} comparisons)"
            )
        for _, j in active:
            o2, s2 = boxes[j]
            if all(a < b + sb and b < a + sa for a, sa, b, sb in zip(off, shp, o2, s2)):
                return (j, i)
        heapq.heappush(active, (off[d] + shp[d], i))
    return None


__all__ = [
    "MAX_NDIM",
    "MAX_OVERLAP_COMPARISONS_PER_BOX",
    "MIN_OVERLAP_COMPARISONS",
    "MAX_NUMEL",
    "check_keys",
    "fail",
    "first_overlap",
    "int_field",
    "int_list",
    "loads_json",
    "no_duplicate_keys",
    "str_field",
]
