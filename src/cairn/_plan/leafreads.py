"""Pure: the reads of one stored leaf, in the addressing its storage needs.

A plain leaf is read as `reads.plan_reads` plans it. A compressed leaf, or one
whose blocks may be references to an earlier checkpoint (format 4), is planned
over its raw bytes widened to whole blocks: every read within one chunk, its
`file` the chunk's cell number, its range raw bytes of that chunk
(`plan_leaf_reads`); `stored_span` maps such a read to the stored bytes it
covers. `whole_reads` cuts a whole array stored in row slabs into a few long
reads. The load's reader (`_load/reader`), its coalesced runs
(`_load/coalesce`) and the dry run (`_sources/dryrun`) share these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

from .._core.boxes import Box, c_strides
from .._format import manifest as fmt
from .reads import Check, Copy, Read, plan_reads

#: The largest read a load plans where the storage states no `preferred_read`.
DEFAULT_MAX_READ = 4 << 20


class _Zeros:
    __slots__ = ()

    def __getitem__(self, i: Any) -> int:
        return 0


class _RawChunks:
    """Chunk c of a compressed leaf as raw addressing sees it: file c (the cell), offset 0."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, cell: int) -> Any:
        return cell, 0


class _RawCrcs:
    __slots__ = ()

    def __getitem__(self, cell: int) -> _Zeros:
        return _Zeros()


class _RawView:
    """A compressed leaf in raw addressing, for `plan_reads`: each chunk alone in a file of its own."""

    def __init__(self, leaf: fmt.ArrayLeaf) -> None:
        self.dtype, self.shape, self.grid, self.path = leaf.dtype, leaf.shape, leaf.grid, leaf.path
        self.grid_shape = leaf.grid_shape
        self.chunks = _RawChunks(math.prod(self.grid_shape))
        self.crcs = _RawCrcs()


def plan_leaf_reads(leaf: fmt.ArrayLeaf, boxes: Sequence[Box], block: int, verify: bool,
                    max_read: int = DEFAULT_MAX_READ) -> list[Read]:
    """The reads that fill `boxes` from `leaf`. For a compressed leaf, planned over its raw bytes
    widened to whole blocks (every read within one chunk, its `file` the chunk's cell number,
    its range raw bytes of that chunk); `ChunkReader.do_read` maps them to stored blocks."""
    if leaf.codec == "none" and not leaf.refs:  # refs (format 4) are read block by block too
        return plan_reads(leaf, boxes, block, verify, max_read=max_read)
    return plan_reads(cast(fmt.ArrayLeaf, _RawView(leaf)), boxes, block, True, max_read=max_read)


def block_range(read: Read, block: int) -> range:
    """The checksum blocks of its chunk that a read of a compressed leaf covers."""
    return range(read.start // block, -(-read.end // block))


def stored_span(leaf: fmt.ArrayLeaf, read: Read, block: int) -> tuple[int, int, int]:
    """Where a read of a compressed leaf (`plan_leaf_reads`, raw addressing) lies in storage:
    ``(file, first byte, stored bytes)`` of the stored blocks it covers, read as one range."""
    file, off = leaf.chunks[read.file]
    sizes = leaf.stored_sizes(read.file, block)
    blocks = block_range(read, block)
    return file, off + sum(sizes[: blocks.start]), sum(sizes[blocks.start : blocks.stop])


def whole_reads(leaf: fmt.ArrayLeaf, block: int, verify: bool, max_read: int = 4 << 20) -> list[Read] | None:
    """The reads of a whole array cut along its first axis only: runs of consecutive chunks, each direct.

    Such chunks are row slabs of the array in order (what sharding on the first
    axis, or no sharding, saves), so a run of them that lies back to back in one
    file is one contiguous region of the destination: one read straight into it,
    however many chunks it spans (up to `max_read` bytes, or one chunk). This is
    what the general planner's pieces add up to, without a piece per chunk.
    None when the layout is not of that kind.
    """
    shape, grid = leaf.shape, leaf.grid
    if not shape or any(len(b) != 2 for b in grid[1:]) or 0 in shape:
        return None
    itemsize = leaf.dtype.itemsize
    row = math.prod(shape[1:]) * itemsize
    tail = shape[1:]
    rows = grid[0]
    reads: list[Read] = []
    run_first = 0

    def flush(first: int, last: int) -> None:  # chunks first..last (inclusive)
        file, start = leaf.chunks[first]
        end = start + (rows[last + 1] - rows[first]) * row
        checks: list[Check] = []
        if verify:
            for c in range(first, last + 1):
                off = leaf.chunks[c][1]
                size = (rows[c + 1] - rows[c]) * row
                crcs = leaf.crcs[c]
                checks.extend(Check(off + k * block, off + min((k + 1) * block, size), crcs[k])
                              for k in range(-(-size // block)))
        n = rows[last + 1] - rows[first]
        copy = Copy(0, 0, c_strides((n, *tail), itemsize), (n, *tail), (rows[first], *(0 for _ in tail)), itemsize)
        reads.append(Read(file, start, end, (copy,), tuple(checks)))

    for c in range(1, len(rows) - 1):
        file, off = leaf.chunks[c]
        prev_file, prev_off = leaf.chunks[c - 1]
        prev_end = prev_off + (rows[c] - rows[c - 1]) * row
        if file != prev_file or off != prev_end or (rows[c + 1] - rows[run_first]) * row > max_read:
            flush(run_first, c - 1)
            run_first = c
    flush(run_first, len(rows) - 2)
    return reads
