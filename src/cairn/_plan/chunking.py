"""Pure planning of a save: boxes, and who writes which chunk into which file.

Nothing here touches devices, files or processes: inputs are shapes and boxes
(per-axis ``(start, stop)`` index ranges), outputs are immutable records. That
keeps the planner testable, and lets the benchmark run it for clusters that do
not exist. The boxes held by the devices of a sharding form a regular grid;
each grid cell is one chunk, written once by one process (the holder of its
first replica, or spread over replicas). The load's side is `reads`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .._core.boxes import Box, cell_box, ravel, unravel
from .grid import regular_layout

# --------------------------------------------------------------------------- save


@dataclass(frozen=True)
class ChunkLayout:
    """How one array is cut into chunks and who writes each (grid order)."""

    grid: tuple[tuple[int, ...], ...]
    writer: tuple[int, ...]  # process index per chunk
    source: tuple[int, ...]  # per chunk: position in the device list of the copy to write
    # After `_merge.merge_rows`: the layout it merged, and per row of cells of this one, the rows
    # of that one it is made of (() when nothing was merged). See `_merge.pieces`.
    merged_from: ChunkLayout | None = None
    row_groups: tuple[tuple[int, ...], ...] = ()


class LayoutError(ValueError):
    pass


def chunk_layout(
    shape: Sequence[int],
    device_boxes: Sequence[Box],
    device_process: Sequence[int],
    split_replicas: bool = False,
    replica_offset: int = 0,
    split_elems: int = 0,
) -> ChunkLayout:
    """Cut an array into the grid its devices' boxes form and choose writers.

    `device_boxes[d]` is the box device `d` holds, `device_process[d]` the
    process it belongs to; the device order must be the same on every process
    (it is the sharding's device order). A chunk held by several devices
    (replicas) is written by its first holder, or with `split_replicas` by
    the holding process ``(cell + replica_offset) % holding processes`` (in
    order of first appearance), so that replicated data spreads its write load
    over processes; a caller passes a different `replica_offset` per array so
    that single-chunk replicated arrays do not all land on one process.

    With `split_elems` > 0, an array whose every chunk is held by R > 1
    processes and has at least `split_elems` elements is cut finer: each
    chunk splits into R pieces along the first axis long enough, piece k
    written by the chunk's ``(k + replica_offset) % R``-th holding process. A
    large replicated array is then written by all its holders in parallel,
    each byte still once. A piece's source device holds the whole chunk; the
    caller slices the piece out of it. (`_grid` computes the same in numpy where the boxes
    tile a grid; the loop below defines the layout, and reports what is wrong with the rest.)
    """
    fast = regular_layout(shape, device_boxes, device_process, split_replicas, replica_offset, split_elems)
    if fast is not None:
        return ChunkLayout(*fast)
    if hasattr(device_boxes, "tolist"):  # an array of boxes (`_grid.spec_boxes`): the loop takes tuples
        device_boxes = [tuple(map(tuple, b)) for b in device_boxes.tolist()]
    ndim = len(shape)
    bounds: list[tuple[int, ...]] = []
    for a in range(ndim):
        if shape[a] == 0:
            bounds.append((0, 0))
            continue
        cuts = {0, int(shape[a])}
        for box in device_boxes:
            cuts.add(box[a][0])
            cuts.add(box[a][1])
        bounds.append(tuple(sorted(cuts)))
    grid_shape = tuple(len(b) - 1 for b in bounds)
    n_cells = math.prod(grid_shape)
    holders: list[list[int]] = [[] for _ in range(n_cells)]
    for d, box in enumerate(device_boxes):
        if len(box) != ndim:
            raise LayoutError(f"device {d} holds a box of rank {len(box)} for an array of rank {ndim}")
        idx = []
        for a, (lo, hi) in enumerate(box):
            if shape[a] == 0:
                idx.append(0)
                continue
            i = bisect.bisect_left(bounds[a], lo)
            if i + 1 >= len(bounds[a]) or bounds[a][i] != lo or bounds[a][i + 1] != hi:
                raise LayoutError(
                    f"the shards of this array do not form a regular grid (axis {a}: {lo}..{hi})"
                )
            idx.append(i)
        cell = ravel(idx, grid_shape)
        holders[cell].append(d)
    if split_elems > 0 and n_cells:
        split = _split_replicated(shape, bounds, holders, device_process, replica_offset, split_elems)
        if split is not None:
            return split
    writer, source = [], []
    for cell, hs in enumerate(holders):
        if not hs:
            raise LayoutError(f"no device holds chunk {cell} of the array")
        d = hs[0]
        if split_replicas and len(hs) > 1:
            # Spread over processes, not devices: a process's devices share its bandwidth.
            procs = list(dict.fromkeys(device_process[h] for h in hs))
            p = procs[(cell + replica_offset) % len(procs)]
            d = next(h for h in hs if device_process[h] == p)
        writer.append(int(device_process[d]))
        source.append(d)
    return ChunkLayout(tuple(bounds), tuple(writer), tuple(source))


def _split_replicated(shape: Sequence[int], bounds: list[tuple[int, ...]], holders: list[list[int]],
                      device_process: Sequence[int], offset: int, split_elems: int) -> ChunkLayout | None:
    """`chunk_layout`'s finer grid for a replicated array (see there), or None to keep the plain one."""
    procs = [list(dict.fromkeys(device_process[h] for h in hs)) for hs in holders]
    if any(not hs for hs in holders):
        return None  # the caller reports the hole
    r = min(len(p) for p in procs)
    grid_shape = tuple(len(b) - 1 for b in bounds)
    sizes = [[b[i + 1] - b[i] for i in range(len(b) - 1)] for b in bounds]
    if r < 2 or min(math.prod(hi - lo for lo, hi in cell_box(bounds, c)) for c in range(len(holders))) < split_elems:
        return None
    axis = next((a for a in range(len(shape)) if min(sizes[a]) >= r), None)
    if axis is None:
        return None
    new_axis: list[int] = [0]
    parent_of: list[tuple[int, int]] = []  # per new interval on `axis`: (old interval, piece)
    for i, n in enumerate(sizes[axis]):
        lo = bounds[axis][i]
        for k in range(r):
            new_axis.append(lo + (n * (k + 1)) // r)
            parent_of.append((i, k))
    new_bounds = [*bounds[:axis], tuple(new_axis), *bounds[axis + 1 :]]
    new_shape = tuple(len(b) - 1 for b in new_bounds)
    writer, source = [], []
    for cell in range(math.prod(new_shape)):
        idx = unravel(cell, new_shape)
        old, k = parent_of[idx[axis]]
        parent = ravel([*idx[:axis], old, *idx[axis + 1 :]], grid_shape)
        p = procs[parent][(k + offset) % len(procs[parent])]
        d = next(h for h in holders[parent] if device_process[h] == p)
        writer.append(int(p))
        source.append(d)
    return ChunkLayout(tuple(new_bounds), tuple(writer), tuple(source))


class FileSlot(NamedTuple):
    """One chunk's place in one data file (a NamedTuple: a save makes one per chunk)."""

    leaf: int
    cell: int
    offset: int
    nbytes: int


def assign_files(
    chunks: Sequence[tuple[int, int, int]], max_files: int, min_file_bytes: int
) -> list[list[FileSlot]]:
    """Lay out one process's chunks, given as ``(leaf, cell, nbytes)``, in few files.

    Chunks keep their order and are split into at most `max_files` contiguous
    groups of about equal size, none smaller than `min_file_bytes` (except
    when there is only one), so files can be written in parallel.
    """
    chunks = [c for c in chunks if c[2] > 0]
    total = sum(c[2] for c in chunks)
    if not chunks:
        return []
    n_files = max(1, min(max_files, total // max(min_file_bytes, 1), len(chunks)))
    target = total / n_files
    files: list[list[FileSlot]] = [[]]
    acc = 0  # bytes in earlier files
    offset = 0
    for leaf, cell, nbytes in chunks:
        if files[-1] and len(files) < n_files and acc + offset + nbytes / 2 > target * len(files):
            acc += offset
            files.append([])
            offset = 0
        files[-1].append(FileSlot(leaf, cell, offset, nbytes))
        offset += nbytes
    return files
