"""Pure: merging a process's neighbouring shards of an array into one chunk (fewer chunks, fewer records)."""

from __future__ import annotations

import bisect
import itertools

import numpy as np

from .._core.boxes import Box, cell_box
from .chunking import ChunkLayout

#: Shards of one process that follow each other along axis 0 are written as one chunk while it
#: stays under this size: fewer chunks and index records, and still chunks enough to write in parallel.
MERGE_MAX_BYTES = 4 << 20


def merge_rows(layout: ChunkLayout, itemsize: int, max_bytes: int | None = None) -> ChunkLayout:
    """`layout` with neighbouring rows of cells merged where one process writes both.

    Rows of cells (all cells sharing an axis-0 range) j and j + 1 merge when every
    cell of row j + 1 has the writer of the cell above it, and the merged cells
    stay under `max_bytes`. Merging along axis 0 keeps a chunk's bytes the
    concatenation of its pieces' C-order bytes, so a writer streams the pieces
    one after another. FSDP over a process's 8 devices becomes one chunk per array.
    """
    if max_bytes is None:
        max_bytes = MERGE_MAX_BYTES
    grid = layout.grid
    if not grid or len(grid[0]) <= 2 or any(len(b) == 2 and b[0] == b[1] for b in grid):
        return layout
    rows = len(grid[0]) - 1
    per_row = len(layout.writer) // rows
    writers = np.asarray(layout.writer, dtype=np.int64).reshape(rows, per_row)
    # breaks: the rows whose writers differ from the row above's (no group reaches across one).
    breaks = (np.flatnonzero((writers[1:] != writers[:-1]).any(axis=1)) + 1).tolist()
    if len(breaks) == rows - 1:
        return layout
    other = 1  # elements of the largest cell of a row
    for b in grid[1:]:
        other *= max(hi - lo for lo, hi in itertools.pairwise(b))
    row_bytes = np.diff(np.asarray(grid[0], dtype=np.int64)) * (other * itemsize)
    starts = _group_starts(row_bytes, breaks, max_bytes)
    if len(starts) == rows:
        return layout
    ends = [*starts[1:], rows]
    axis0 = (*(grid[0][s] for s in starts), grid[0][-1])
    sources = np.asarray(layout.source, dtype=np.int64).reshape(rows, per_row)
    return ChunkLayout((axis0, *grid[1:]), tuple(writers[starts].ravel().tolist()),
                       tuple(sources[starts].ravel().tolist()), layout,
                       tuple(tuple(range(s, e)) for s, e in zip(starts, ends)))


def _group_starts(row_bytes: np.ndarray, breaks: list[int], max_bytes: int) -> list[int]:
    """The first rows of `merge_rows`'s groups: from row s, a group takes the rows that follow while
    no break (a row with other writers) comes and it stays under `max_bytes` (its first row alone
    may exceed it)."""
    rows = len(row_bytes)
    if (row_bytes == row_bytes[0]).all():  # the usual even split: `per` rows a group between breaks
        per = max(1, max_bytes // int(row_bytes[0]))
        seg = np.asarray([0, *breaks, rows], dtype=np.int64)
        groups = -(-np.diff(seg) // per)
        first = np.repeat(seg[:-1], groups)
        nth = np.arange(len(first)) - np.repeat(np.cumsum(groups) - groups, groups)
        return (first + nth * per).tolist()
    cum = [0, *np.cumsum(row_bytes).tolist()]  # cum[j]: bytes of rows 0..j-1
    ends = [*breaks, rows]
    starts: list[int] = []
    s = k = 0
    while s < rows:
        while ends[k] <= s:
            k += 1
        starts.append(s)
        s = min(ends[k], max(s + 1, bisect.bisect_right(cum, cum[s] + max_bytes) - 1))
    return starts


def pieces(layout: ChunkLayout, cell: int) -> tuple[tuple[Box, int], ...]:
    """The ``(box, source)`` of the shards chunk `cell` is made of, in order along axis 0: their
    C-order bytes, one after another, are the chunk's."""
    base = layout.merged_from
    if base is None:
        return ((cell_box(layout.grid, cell), layout.source[cell]),)
    per_row = len(layout.writer) // (len(layout.grid[0]) - 1)
    row, k = divmod(cell, per_row)
    return tuple((cell_box(base.grid, j * per_row + k), base.source[j * per_row + k])
                 for j in layout.row_groups[row])
