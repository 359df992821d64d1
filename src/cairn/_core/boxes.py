"""Boxes and grid cells: the index arithmetic every planner and the format share.

A box is a tuple of per-axis ``(start, stop)`` index ranges. A grid is a
tuple of per-axis boundaries; its cells are numbered in C order. Plain
integer arithmetic (not ``np.unravel_index``): planners call these per chunk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Box = tuple[tuple[int, int], ...]


def full_box(shape: Sequence[int]) -> Box:
    """The box of a whole array of `shape`."""
    return tuple((0, int(s)) for s in shape)


def box_size(box: Box) -> int:
    """The number of elements in `box`."""
    return math.prod(hi - lo for lo, hi in box)


def c_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-order array of `shape` (an empty axis counts as one, so strides stay distinct)."""
    strides = []
    acc = itemsize
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


def unravel(flat: int, grid_shape: Sequence[int]) -> list[int]:
    """The per-axis index of cell number `flat` of a grid of `grid_shape` cells."""
    idx = []
    for n in reversed(grid_shape):
        idx.append(flat % n)
        flat //= n
    return idx[::-1]


def ravel(idx: Sequence[int], grid_shape: Sequence[int]) -> int:
    """The cell number of per-axis index `idx` (the inverse of `unravel`)."""
    flat = 0
    for i, n in zip(idx, grid_shape):
        flat = flat * n + i
    return flat


def cell_box(grid: Sequence[Sequence[int]], flat: int) -> Box:
    """The box of cell number `flat`; `grid` holds each axis's boundaries."""
    idx = unravel(flat, [len(b) - 1 for b in grid])
    return tuple((grid[a][i], grid[a][i + 1]) for a, i in enumerate(idx))
