"""Pure: merging a process's neighbouring shards of an array into one chunk (fewer chunks, fewer records)."""

from __future__ import annotations

import itertools

from ._plan import Box, ChunkLayout, cell_box_of

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
    other = 1  # elements of the largest cell of a row
    for b in grid[1:]:
        other *= max(hi - lo for lo, hi in itertools.pairwise(b))
    row_bytes = [(grid[0][j + 1] - grid[0][j]) * other * itemsize for j in range(rows)]
    groups: list[list[int]] = [[0]]
    size = row_bytes[0]
    for j in range(1, rows):
        same = layout.writer[j * per_row : (j + 1) * per_row] == layout.writer[(j - 1) * per_row : j * per_row]
        if same and size + row_bytes[j] <= max_bytes:
            groups[-1].append(j)
            size += row_bytes[j]
        else:
            groups.append([j])
            size = row_bytes[j]
    if len(groups) == rows:
        return layout
    axis0 = (*(grid[0][g[0]] for g in groups), grid[0][-1])
    writer: list[int] = []
    source: list[int] = []
    for g in groups:
        writer.extend(layout.writer[g[0] * per_row : (g[0] + 1) * per_row])
        source.extend(layout.source[g[0] * per_row : (g[0] + 1) * per_row])
    return ChunkLayout((axis0, *grid[1:]), tuple(writer), tuple(source), layout, tuple(map(tuple, groups)))


def pieces(layout: ChunkLayout, cell: int) -> tuple[tuple[Box, int], ...]:
    """The ``(box, source)`` of the shards chunk `cell` is made of, in order along axis 0: their
    C-order bytes, one after another, are the chunk's."""
    base = layout.merged_from
    if base is None:
        return ((cell_box_of(layout.grid, cell), layout.source[cell]),)
    per_row = len(layout.writer) // (len(layout.grid[0]) - 1)
    row, k = divmod(cell, per_row)
    return tuple((cell_box_of(base.grid, j * per_row + k), base.source[j * per_row + k])
                 for j in layout.row_groups[row])
