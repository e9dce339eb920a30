"""The overlap check of global slices (``format.validate.first_overlap``): agrees with brute force on
random boxes in 1, 2 and 3 dimensions, and stays fast on the layouts that made the old sweep
quadratic (non-overlapping boxes that cross: rows in one block, columns in another)."""

from __future__ import annotations

import random
import time

import pytest

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.validate import first_overlap

Box = tuple[tuple[int, ...], tuple[int, ...]]


def overlaps(a: Box, b: Box) -> bool:
    return all(x < y + sy and y < x + sx for x, sx, y, sy in zip(a[0], a[1], b[0], b[1]))


def brute(boxes: list[Box]) -> bool:
    return any(overlaps(boxes[i], boxes[j]) for i in range(len(boxes)) for j in range(i))


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_agrees_with_brute_force(ndim: int) -> None:
    rng = random.Random(ndim)
    for _ in range(600):
        n = rng.randint(2, 9)
        boxes = [
            (
                tuple(rng.randint(0, 12) for _ in range(ndim)),
                tuple(rng.randint(1, 5) for _ in range(ndim)),
            )
            for _ in range(n)
        ]
        pair = first_overlap(boxes)
        assert (pair is not None) == brute(boxes), boxes
        if pair is not None:
            i, j = pair
            assert i != j and overlaps(boxes[i], boxes[j])


def crossing(n: int) -> list[Box]:
    """``n`` rows of an ``n x n`` block above ``n`` columns of another: nothing overlaps."""
    rows = [((r, 0), (1, n)) for r in range(n)]
    cols = [((n, c), (n, 1)) for c in range(n)]
    return rows + cols


def test_crossing_boxes_are_checked_in_well_under_a_second() -> None:
    boxes = crossing(3000)  # 6,000 boxes: 9 s before
    t0 = time.perf_counter()
    assert first_overlap(boxes) is None
    boxes.append(((2999, 2999), (2, 1)))  # one cell of the last row and of the last column
    assert first_overlap(boxes) is not None
    assert time.perf_counter() - t0 < 1.0


def test_a_dimension_every_box_spans_alike_is_left_out() -> None:
    """Crossing boxes of a 3-D tensor split along two of its dimensions: exact, and fast."""
    boxes = [((r, 0, 0), (1, 3000, 4)) for r in range(3000)]
    boxes += [((3000, c, 0), (3000, 1, 4)) for c in range(3000)]
    t0 = time.perf_counter()
    assert first_overlap(boxes) is None
    assert first_overlap([*boxes, ((2999, 2999, 0), (2, 1, 4))]) is not None
    assert time.perf_counter() - t0 < 1.0


def test_boxes_crossing_along_three_dimensions_are_refused_not_checked_for_minutes() -> None:
    n = 1500
    boxes = [((r, 0, z), (1, n, 1)) for r in range(n) for z in (0, 1)]
    boxes += [((n, c, z), (n, 1, 1)) for c in range(n) for z in (0, 1)]
    t0 = time.perf_counter()
    with pytest.raises(ManifestError, match="cross in too many ways to check"):
        first_overlap(boxes)
    assert time.perf_counter() - t0 < 1.5
