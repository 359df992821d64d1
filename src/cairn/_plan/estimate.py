"""Pure: about how many bytes a load reads, without planning its reads.

Every process decides a read route for every leaf (`_readonce`), so the
decision must be cheap at any cluster size. This models `_plan.plan_reads`
with numpy over the overlapped chunks instead of building its pieces.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._core.boxes import Box, box_size


def estimate_read_bytes(grid: Sequence[Sequence[int]], itemsize: int, boxes: Sequence[Box],
                        block_size: int, verify: bool = True) -> int:
    """About the bytes `plan_reads` reads for `boxes` (one process's); see `estimate_reads`."""
    return estimate_reads(grid, itemsize, boxes, block_size, verify)[0]


class ReadWork(NamedTuple):
    """What one process's reads come to (`estimate_read_work`)."""

    nbytes: int  # storage bytes read (stored bytes, for a compressed leaf)
    requests: int
    scattered: int  # bytes of the target that cannot land in place: read into a buffer, then copied


#: Each checksum block's stored size in a chunk (grid cell): a compressed leaf's `stored_sizes`.
StoredSizes = Callable[[int], Sequence[int]]


def estimate_reads(grid: Sequence[Sequence[int]], itemsize: int, boxes: Sequence[Box], block_size: int,
                   verify: bool = True, max_read: int = 0, stored: StoredSizes | None = None) -> tuple[int, int]:
    """(bytes, requests) of `estimate_read_work`."""
    work = estimate_read_work(grid, itemsize, boxes, block_size, verify, max_read, stored)
    return work.nbytes, work.requests


def estimate_read_work(grid: Sequence[Sequence[int]], itemsize: int, boxes: Sequence[Box], block_size: int,
                       verify: bool = True, max_read: int = 0, stored: StoredSizes | None = None) -> ReadWork:
    """About the bytes `plan_reads` reads for `boxes` (one process's), without planning them.

    Per overlap of a box with a chunk it charges the covering range (from the
    first byte needed to the last, widened to the chunk's checksum blocks when
    verifying), and ranges of one chunk that several boxes overlap once. That
    is what the planner reads except where it splits a large sparse overlap
    row by row, so this is an upper bound, computed with numpy over the
    overlapped chunks (no per-piece Python objects): cheap enough to decide a
    read route for every leaf on every process of a large cluster.

    Returns bytes, requests (one per merged range, split every `max_read`
    bytes when it is positive: a lower bound of the planner's requests where
    it splits rows) and the bytes scattered: the overlaps that are not one
    contiguous run both in their chunk and in their target box, which the
    reader lands in a buffer and copies out strided (host CPU work the other
    overlaps do not cost). Vectored reads of long rows into place count as
    scattered here.

    With `stored` (a compressed leaf: each block's stored size per cell),
    ranges are always widened to whole blocks (a compressed block is read and
    checked whole) and the bytes are the stored sizes of the blocks they
    cover, which is what the reader fetches; requests still count raw ranges,
    as the planner cuts them.
    """
    if stored is not None:
        verify = True
    if not boxes:
        return ReadWork(0, 0, 0)
    ndim = len(grid)
    if ndim == 0:
        return ReadWork(itemsize, 1, 0)
    bounds = [np.asarray(b, dtype=np.int64) for b in grid]
    ncells = [len(b) - 1 for b in bounds]
    cells, los, his = [], [], []
    scattered = 0
    for box in boxes:
        if box_size(box) == 0:
            continue
        axes = []
        for a, (lo, hi) in enumerate(box):
            b = bounds[a]
            idx = np.arange(max(int(np.searchsorted(b, lo, "right")) - 1, 0),
                            min(int(np.searchsorted(b, hi, "left")), ncells[a]))
            clo, chi = b[idx], b[idx + 1]
            start = np.maximum(clo, lo) - clo
            axes.append((idx, start, np.minimum(chi, hi) - clo - start, chi - clo))
        shape = [len(x[0]) for x in axes]

        def along(v: Any, a: int) -> Any:
            return v.reshape([-1 if i == a else 1 for i in range(ndim)])

        stride = np.ones(shape, dtype=np.int64)
        first = np.zeros(shape, dtype=np.int64)
        last = np.zeros(shape, dtype=np.int64)
        cell = np.zeros(shape, dtype=np.int64)
        for a in reversed(range(ndim)):
            idx, start, extent, cext = axes[a]
            first = first + along(start, a) * stride
            last = last + along(start + extent - 1, a) * stride
            stride = stride * along(cext, a)
        for a in range(ndim):
            cell = cell * ncells[a] + along(axes[a][0], a)
        scattered += _scattered(axes, [hi - lo for lo, hi in box], shape, along) * itemsize
        lo_b, hi_b = first * itemsize, (last + 1) * itemsize
        if verify:
            chunk_bytes = stride * itemsize
            lo_b = lo_b // block_size * block_size
            hi_b = np.minimum(-(-hi_b // block_size) * block_size, chunk_bytes)
        cells.append(cell.reshape(-1))
        los.append(lo_b.reshape(-1))
        his.append(hi_b.reshape(-1))
    if not cells:
        return ReadWork(0, 0, 0)
    cell_a, lo_a, hi_a = np.concatenate(cells), np.concatenate(los), np.concatenate(his)
    # Union of intervals per chunk, as one union over a line where each chunk has a stretch of its own.
    span = int(hi_a.max()) + 1
    if int(cell_a.max()) * span >= 1 << 62:
        # Cannot happen for real grids (64 PiB arrays at most); stay exact in int64 anyway and
        # charge overlapping ranges twice, which keeps the figure an upper bound.
        sizes = hi_a - lo_a
        if stored is not None:
            return ReadWork(_stored(stored, cell_a, lo_a, hi_a, block_size), _requests(sizes, max_read), scattered)
        return ReadWork(int(sizes.sum()), _requests(sizes, max_read), scattered)
    order = np.lexsort((lo_a, cell_a))
    lo_k, hi_k = (cell_a * span + lo_a)[order], (cell_a * span + hi_a)[order]
    reach = np.maximum.accumulate(hi_k)
    starts = np.concatenate(([True], lo_k[1:] > reach[:-1]))
    run_starts = np.flatnonzero(starts)
    run_ends = np.concatenate((run_starts[1:] - 1, [len(lo_k) - 1]))
    sizes = reach[run_ends] - lo_k[run_starts]
    if stored is not None:
        run_cells = cell_a[order][run_starts]
        base = run_cells * span
        return ReadWork(_stored(stored, run_cells, lo_k[run_starts] - base, reach[run_ends] - base, block_size),
                        _requests(sizes, max_read), scattered)
    return ReadWork(int(sizes.sum()), _requests(sizes, max_read), scattered)


def _scattered(axes: list[tuple[Any, Any, Any, Any]], box_extents: list[int], shape: list[int], along: Any) -> int:
    """Elements of one box's overlaps with its chunks that are not one contiguous run in both:
    a region is contiguous in an array when every axis after its first longer than 1 is whole."""
    ndim = len(axes)
    ext = [along(axes[a][2], a) for a in range(ndim)]
    ok_chunk = np.ones(shape, dtype=bool)
    ok_box = np.ones(shape, dtype=bool)
    partial_chunk = np.zeros(shape, dtype=bool)  # an axis after this one is not whole
    partial_box = np.zeros(shape, dtype=bool)
    for a in reversed(range(ndim)):
        long = ext[a] > 1
        ok_chunk &= ~(partial_chunk & long)
        ok_box &= ~(partial_box & long)
        partial_chunk = partial_chunk | (ext[a] < along(axes[a][3], a))
        partial_box = partial_box | (ext[a] < box_extents[a])
    size = np.ones(shape, dtype=np.int64)
    for e in ext:
        size = size * e
    return int(size[~(ok_chunk & ok_box)].sum())


def _stored(stored: StoredSizes, cells: Any, lo: Any, hi: Any, block: int) -> int:
    """Stored bytes of the blocks that raw ranges [lo, hi) of chunks `cells` cover (block-aligned ranges)."""
    total = 0
    prefix: dict[int, list[int]] = {}
    for cell, a, b in zip(cells.tolist(), lo.tolist(), hi.tolist()):
        sums = prefix.get(cell)
        if sums is None:
            sums = prefix[cell] = list(itertools.accumulate(stored(cell), initial=0))
        last = len(sums) - 1
        total += sums[min(-(-b // block), last)] - sums[min(a // block, last)]
    return total


def _requests(sizes: Any, max_read: int) -> int:
    if max_read <= 0:
        return len(sizes)
    return int((-(-sizes // max_read)).sum())
