"""Pure: `_plan.chunk_layout` for a regular grid of device boxes, over numpy arrays of boxes.

`chunk_layout` defines the layout with a loop over devices; at 8,192 devices that
loop is most of a process's save planning (benchmarks/probes/plan_scale.py). This module
computes the same grid, writers and sources with array operations. It answers
None for anything it does not handle (boxes that do not tile a grid, holes,
zero-length axes, rank 0), and the loop then runs and reports the problem, so
the errors and the results are the loop's in every case.

`spec_boxes` computes every device's box of a mesh and partition spec by
arithmetic, as ``NamedSharding.devices_indices_map`` does device by device in
Python (about 7 ms per (sharding, shape) at 4,096 devices, 14 at 8,192).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

Grid = tuple[tuple[int, ...], ...]
_chain = itertools.chain.from_iterable


def regular_layout(shape: Sequence[int], device_boxes: Sequence[Any], device_process: Sequence[int],
                   split_replicas: bool, replica_offset: int, split_elems: int,
                   ) -> tuple[Grid, tuple[int, ...], tuple[int, ...]] | None:
    """``(grid, writer, source)`` as `_plan.chunk_layout` computes them, or None (see the module)."""
    ndim, n_dev = len(shape), len(device_boxes)
    if ndim == 0 or n_dev == 0 or len(device_process) != n_dev or any(int(n) <= 0 for n in shape):
        return None
    if isinstance(device_boxes, np.ndarray):  # `spec_boxes`' form: no Python objects per device
        if device_boxes.shape != (n_dev, ndim, 2):
            return None
        flat = device_boxes.astype(np.int64, copy=False).reshape(-1)
        procs = np.asarray(device_process, dtype=np.int64)
    else:
        try:
            # Every box must be `ndim` pairs, or the flattened values would shift.
            if set(map(len, device_boxes)) != {ndim} or set(map(len, _chain(device_boxes))) != {2}:
                return None
            flat = np.fromiter(_chain(_chain(device_boxes)), dtype=np.int64, count=n_dev * ndim * 2)
            procs = np.fromiter(device_process, dtype=np.int64, count=n_dev)
        except (TypeError, ValueError, OverflowError):
            return None
    boxes = flat.reshape(n_dev, ndim, 2)
    bounds: list[np.ndarray] = []
    idx: list[np.ndarray] = []
    for a in range(ndim):
        lo, hi = boxes[:, a, 0], boxes[:, a, 1]
        # The cuts are every box's ends, 0 and the length; in a grid of boxes every box ends
        # where the next cut (a start) is, so the starts are all the cuts there are.
        b = _sorted_unique(np.concatenate([lo, [0, int(shape[a])]]))
        i = np.searchsorted(b, lo)
        if (i + 1 >= len(b)).any() or (b[np.minimum(i + 1, len(b) - 1)] != hi).any():
            return None
        bounds.append(b)
        idx.append(i)
    grid_shape = tuple(len(b) - 1 for b in bounds)
    n_cells = math.prod(grid_shape)
    if n_cells > n_dev:
        return None  # a hole, certainly
    cell = np.ravel_multi_index(tuple(idx), grid_shape)
    held = _Holders(cell, procs, n_cells)
    if not held.complete:
        return None
    grid = tuple(tuple(b.tolist()) for b in bounds)
    if split_elems > 0:
        split = _split(grid, held, replica_offset, split_elems)
        if split is not None:
            return split
    if split_replicas:
        chosen = held.start + (np.arange(n_cells) + replica_offset) % held.count
        source = held.first_dev[chosen]
    else:
        source = held.first
    return grid, tuple(procs[source].tolist()), tuple(source.tolist())


def spec_boxes(shape: Sequence[int], mesh_shape: Sequence[int], axis_names: Sequence[str],
               spec: Sequence[Any]) -> np.ndarray | None:
    """Every device's box, ``(devices, ndim, 2)`` in the mesh's flat device order, of an array of
    `shape` partitioned by `spec` (entries None, a mesh axis name, or a tuple of names, major
    first) over a mesh of `mesh_shape` with `axis_names`; None for what it does not handle
    (other entries, an axis named twice or unknown, a length the shards do not divide)."""
    ndim = len(shape)
    if len(spec) > ndim or len(mesh_shape) != len(axis_names):
        return None
    coords = np.indices(tuple(mesh_shape), dtype=np.int64).reshape(len(mesh_shape), -1)
    out = np.empty((coords.shape[1], ndim, 2), dtype=np.int64)
    used: set[str] = set()
    for a in range(ndim):
        entry = spec[a] if a < len(spec) else None
        names = () if entry is None else (entry,) if type(entry) is str else entry
        if type(names) is not tuple or any(type(n) is not str or n not in axis_names or n in used for n in names):
            return None
        used.update(names)
        idx, parts = np.zeros(coords.shape[1], dtype=np.int64), 1
        for n in names:
            k = axis_names.index(n)
            idx, parts = idx * mesh_shape[k] + coords[k], parts * mesh_shape[k]
        n = int(shape[a])
        if n <= 0 or n % parts:
            return None
        out[:, a, 0] = idx * (n // parts)
        out[:, a, 1] = out[:, a, 0] + n // parts
    return out


def _sorted_unique(x: np.ndarray) -> np.ndarray:
    x = np.sort(x)  # (np.unique is slower on these small arrays)
    keep = np.ones(len(x), dtype=bool)
    keep[1:] = x[1:] != x[:-1]
    return x[keep]


class _Holders:
    """Per cell of the grid, its holding processes in order of first appearance, and the first
    device of each: cell c's are entries ``start[c] .. start[c] + count[c]`` of `proc`/`first_dev`."""

    def __init__(self, cell: np.ndarray, procs: np.ndarray, n_cells: int):
        devices = np.arange(len(cell))
        if n_cells == len(cell):  # one device per cell, unless some cell has none
            self.first = self.first_dev = np.full(n_cells, -1, dtype=np.int64)
            self.first[cell] = devices
            self.complete = bool((self.first >= 0).all())
            self.proc, self.start, self.count = procs[self.first], devices, np.ones(n_cells, dtype=np.int64)
            return
        # One entry per (cell, process): its first device, in device order within a cell.
        order = np.lexsort((devices, procs, cell))
        c, p = cell[order], procs[order]
        new = np.ones(len(order), dtype=bool)
        new[1:] = (c[1:] != c[:-1]) | (p[1:] != p[:-1])
        first_dev = order[new]
        by_appearance = np.lexsort((first_dev, cell[first_dev]))
        self.first_dev = first_dev[by_appearance]
        self.proc = procs[self.first_dev]
        cells = cell[self.first_dev]
        self.start = np.searchsorted(cells, np.arange(n_cells))
        self.count = np.diff(np.append(self.start, len(cells)))
        self.complete = bool((self.count > 0).all())
        # The first holder of each cell is the first device of its first process.
        self.first = self.first_dev[np.minimum(self.start, len(cells) - 1)]


def _split(grid: Grid, held: _Holders, offset: int, split_elems: int,
           ) -> tuple[Grid, tuple[int, ...], tuple[int, ...]] | None:
    """`_plan._split_replicated` over `held`: each chunk cut into R pieces along the first long
    enough axis, piece k written by its ``(k + offset) % holding processes``-th process."""
    r = int(held.count.min())
    sizes = [np.diff(np.asarray(b, dtype=np.int64)) for b in grid]
    if r < 2 or math.prod(int(s.min()) for s in sizes) < split_elems:
        return None
    axis = next((a for a, s in enumerate(sizes) if int(s.min()) >= r), None)
    if axis is None:
        return None
    lo = np.asarray(grid[axis][:-1], dtype=np.int64)
    pieces = lo[:, None] + (sizes[axis][:, None] * np.arange(1, r + 1)) // r
    cuts = (0, *(int(x) for x in pieces.ravel()))
    new_grid = (*grid[:axis], cuts, *grid[axis + 1 :])
    new_shape = tuple(len(b) - 1 for b in new_grid)
    idx = list(np.unravel_index(np.arange(math.prod(new_shape)), new_shape))
    k = idx[axis] % r
    idx[axis] = idx[axis] // r
    parent = np.ravel_multi_index(tuple(idx), tuple(len(b) - 1 for b in grid))
    chosen = held.start[parent] + (k + offset) % held.count[parent]
    return new_grid, tuple(held.proc[chosen].tolist()), tuple(held.first_dev[chosen].tolist())


def cell_ranges(grid: Sequence[Sequence[int]], box: Sequence[tuple[int, int]]) -> list[range] | None:
    """Per axis, the cells of `grid` (bounds per axis) whose chunks intersect `box`; None for an empty box."""
    ranges = []
    for a, (lo, hi) in enumerate(box):
        b = grid[a]
        if hi <= lo:
            return None
        first = bisect.bisect_right(b, lo) - 1
        last = bisect.bisect_left(b, hi)  # exclusive cell bound
        ranges.append(range(max(first, 0), min(last, len(b) - 1)))
    return ranges
