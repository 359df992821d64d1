"""Pure planning of a load: which byte ranges of which files a load reads, and where they go.

Each target box overlaps a small range of the saved grid's cells per axis
(found by bisection), and each overlap becomes a strided copy out of one byte
range of one file. Ranges are widened to checksum blocks (so that every byte
read can be verified) and merged up to the largest read the storage prefers.
A plan is data: `Read` records of `Copy` and `Check` records, carried out by
the load's reader.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .._core.boxes import Box, box_size, c_strides, ravel
from .._format.manifest import ArrayLeaf
from .grid import cell_ranges


class Copy(NamedTuple):
    """Copy a strided region out of a read buffer into a destination box.

    (The plan's records are NamedTuples: a load of many leaves makes thousands.)
    """

    dest: int  # index of the destination box
    src_offset: int  # byte offset of the region's first element in the read buffer
    src_strides: tuple[int, ...]  # byte strides of the region in the buffer
    shape: tuple[int, ...]
    dest_start: tuple[int, ...]  # the region's first index inside the destination box
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


class Check(NamedTuple):
    """A checksum block to verify: file bytes [start, end) must have CRC-32C `crc`."""

    start: int
    end: int
    crc: int


class Read(NamedTuple):
    """One ranged read of file bytes [start, end) and what to do with them."""

    file: int
    start: int
    end: int
    copies: tuple[Copy, ...]
    checks: tuple[Check, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def direct(self) -> Copy | None:
        """The single copy when the read's bytes are exactly one contiguous region.

        Such a read can land straight in its destination (if the destination
        region is contiguous too), with no intermediate buffer.
        """
        if len(self.copies) != 1:
            return None
        c = self.copies[0]
        if c.src_offset != 0 or c.nbytes != self.nbytes:
            return None
        return c if is_c_contiguous(c.shape, c.src_strides) else None


def is_c_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    if not strides:
        return True
    expected = strides[-1]
    for s, st in zip(reversed(shape), reversed(strides)):
        if s > 1 and st != expected:
            return False
        expected *= s
    return True


class _Piece(NamedTuple):
    file: int
    start: int  # file byte range to read
    end: int
    elem: int  # file byte offset of the region's first element
    copy: Copy
    chunk: int
    chunk_off: int  # where the chunk starts in the file
    chunk_size: int  # its bytes


def overlapping_cells(grid: Sequence[Sequence[int]], box: Box) -> list[tuple[int, ...]]:
    """Grid cell indices (per axis) whose chunk intersects `box`, by bisection."""
    ranges = cell_ranges(grid, box)
    return [] if ranges is None else list(itertools.product(*ranges))


def plan_reads(
    leaf: ArrayLeaf,
    boxes: Sequence[Box],
    block_size: int,
    verify: bool = True,
    dense_fraction: float = 0.5,
    small_read: int = 1 << 20,
    max_merge_gap: int = 0,
    max_read: int = 4 << 20,
) -> list[Read]:
    """Plan the reads that fill each of `boxes` (distinct target boxes) from `leaf`.

    Each overlap of a box with a chunk is read as one range when it is dense
    (at least `dense_fraction` of the range is needed), small (under
    `small_read` bytes), or when splitting it along its leading axis would not
    read less than `dense_fraction` of the range; otherwise it is split. With
    `verify`, ranges widen to whole checksum blocks of their chunk. Ranges that
    overlap always share one read; ranges of the same file that touch (or lie
    within `max_merge_gap`) are merged while the merged read stays under
    `max_read` bytes, so that large chunks stay separate reads that can land
    directly in their destination.
    """
    itemsize = leaf.dtype.itemsize
    grid = leaf.grid
    grid_shape = leaf.grid_shape
    rule = _SplitRule(itemsize, dense_fraction, small_read, block_size if verify else 0, max_read)
    chunks: dict[int, _Chunk] = {}  # a chunk that several boxes overlap is described once
    pieces: list[_Piece] = []
    for dest, box in enumerate(boxes):
        if box_size(box) == 0:
            continue
        for idx in overlapping_cells(grid, box):
            cell = ravel(idx, grid_shape)
            chunk = chunks.get(cell)
            if chunk is None:
                cbox = tuple((grid[a][i], grid[a][i + 1]) for a, i in enumerate(idx))
                file, chunk_off = leaf.chunks[cell]
                cshape = tuple(hi - lo for lo, hi in cbox)
                chunk = chunks[cell] = _Chunk(cell, file, chunk_off, cbox, c_strides(cshape, itemsize),
                                              math.prod(cshape) * itemsize)
            cbox = chunk.box
            lo = tuple(max(b[0], c[0]) for b, c in zip(box, cbox))
            hi = tuple(min(b[1], c[1]) for b, c in zip(box, cbox))
            _split(pieces, rule, chunk, box, dest, lo, hi)
    if verify:
        pieces = [_widen(p, leaf, block_size) for p in pieces]
    return _merge_pieces(pieces, leaf, block_size, verify, max_merge_gap, max_read)


_PIECE_COST = 64 << 10


@dataclass(frozen=True, slots=True)
class _SplitRule:
    """What `_split` needs of one `plan_reads` call: the leaf's item size and the knobs."""

    itemsize: int
    dense: float  # a covering read is kept if at least this fraction of it is needed...
    small: int  # ...or if it is under this many bytes
    block: int  # the checksum block each piece widens to; 0 when not verifying
    slab: int  # a covering read of a strided region is cut into row slabs of about this many bytes


class _Chunk(NamedTuple):
    """One stored chunk, as the read planner sees it.

    (A NamedTuple: one is built per chunk touched, faster than a frozen dataclass.)
    """

    cell: int
    file: int
    offset: int  # where the chunk starts in its file
    box: Box
    strides: tuple[int, ...]  # its C-order byte strides
    nbytes: int


def _split(out: list[_Piece], rule: _SplitRule, chunk: _Chunk, box: Box, dest: int,
           lo: tuple[int, ...], hi: tuple[int, ...]) -> None:
    """Emit the overlap ``lo..hi`` of `chunk` and target box `dest` as one read, or split it along one axis.

    One covering read is kept when it is dense enough, small, or when reading
    the pieces separately would not read much less (each piece widens to
    checksum blocks when verifying): fewer, larger reads with one strided copy
    each beat many small ones.
    """
    cbox, strides, itemsize = chunk.box, chunk.strides, rule.itemsize
    rel = [lo_a - c[0] for lo_a, c in zip(lo, cbox)]
    last = [hi_a - 1 - c[0] for hi_a, c in zip(hi, cbox)]
    first_byte = sum(r * s for r, s in zip(rel, strides))
    end_byte = sum(r * s for r, s in zip(last, strides)) + itemsize
    shape = tuple(h - lo_a for lo_a, h in zip(lo, hi))
    needed = math.prod(shape) * itemsize
    span = end_byte - first_byte
    a = next((i for i, n in enumerate(shape) if n > 1), None)
    split = a is not None and needed < rule.dense * span and span > rule.small
    if split and a is not None:
        n = shape[a]
        block = rule.block
        sub_span = span - (n - 1) * strides[a]
        per_piece = (-(-sub_span // block) + 1) * block if block else sub_span
        # A separate request costs about as much as reading this many bytes more.
        per_piece = max(per_piece, _PIECE_COST)
        split = n * min(per_piece, span) < rule.dense * span
    if not split and a == 0 and needed < span and span > rule.slab > 0:
        rows = _slab_rows(strides[0], rule)
        if rows:
            _slabs(out, rule, chunk, box, dest, lo, hi, rows)
            return
    if not split or a is None:
        _emit(out, chunk, box, dest, lo, shape, first_byte, end_byte, itemsize)
        return
    for i in range(lo[a], hi[a]):
        sub_lo = tuple(i if k == a else v for k, v in enumerate(lo))
        sub_hi = tuple(i + 1 if k == a else v for k, v in enumerate(hi))
        _split(out, rule, chunk, box, dest, sub_lo, sub_hi)


def _slab_rows(stride: int, rule: _SplitRule) -> int:
    """Rows of the chunk per slab: about `rule.slab` bytes, a whole number of checksum blocks
    (so that slabs widened to blocks never overlap); 0 when no such slab is near that size."""
    unit = rule.block // math.gcd(rule.block, stride) if rule.block else 1  # rows per whole blocks
    rows = rule.slab // stride // unit * unit
    if rows == 0:
        rows = unit
    return rows if rows * stride <= 2 * rule.slab else 0


def _slabs(out: list[_Piece], rule: _SplitRule, chunk: _Chunk, box: Box, dest: int,
           lo: tuple[int, ...], hi: tuple[int, ...], rows: int) -> None:
    """The strided overlap ``lo..hi`` as one covering piece per slab of `rows` chunk rows.

    One covering read of a whole chunk (a column strip of a row chunk, loaded
    across its rows) would land in a buffer of the chunk's size, be checked
    and then copied from memory; cut at the same chunk rows for every target
    box, the slabs of the boxes that share a chunk still merge into one read
    each, but a slab's bytes are checked and scattered while still in cache,
    and the slabs spread over the reader threads.
    """
    cbox, strides, itemsize = chunk.box, chunk.strides, rule.itemsize
    c0 = cbox[0][0]
    # Bytes of the overlap's rows from the chunk's first row: the first and the last element of a row.
    inner_first = sum((lo_a - c[0]) * s for lo_a, c, s in zip(lo[1:], cbox[1:], strides[1:]))
    inner_last = sum((hi_a - 1 - c[0]) * s for hi_a, c, s in zip(hi[1:], cbox[1:], strides[1:])) + itemsize
    inner_shape = tuple(hi_a - lo_a for lo_a, hi_a in zip(lo[1:], hi[1:]))
    for r in range(c0 + (lo[0] - c0) // rows * rows, hi[0], rows):
        r0, r1 = max(r, lo[0]), min(r + rows, hi[0])
        _emit(out, chunk, box, dest, (r0, *lo[1:]), (r1 - r0, *inner_shape),
              (r0 - c0) * strides[0] + inner_first, (r1 - 1 - c0) * strides[0] + inner_last, itemsize)


def _emit(out: list[_Piece], chunk: _Chunk, box: Box, dest: int, lo: tuple[int, ...], shape: tuple[int, ...],
          first_byte: int, end_byte: int, itemsize: int) -> None:
    """The overlap of `shape` from `lo` as one covering piece: chunk bytes [first_byte, end_byte)."""
    off = chunk.offset
    copy = Copy(dest, 0, chunk.strides, shape, tuple(lo_a - b[0] for lo_a, b in zip(lo, box)), itemsize)
    out.append(_Piece(chunk.file, off + first_byte, off + end_byte, off + first_byte, copy, chunk.cell, off,
                      chunk.nbytes))


def _widen(p: _Piece, leaf: ArrayLeaf, block: int) -> _Piece:
    chunk_off = p.chunk_off
    rel_start = (p.start - chunk_off) // block * block
    rel_end = min(-(-(p.end - chunk_off) // block) * block, p.chunk_size)
    return _Piece(p.file, chunk_off + rel_start, chunk_off + rel_end, p.elem, p.copy, p.chunk, chunk_off, p.chunk_size)


def _merge_pieces(pieces: list[_Piece], leaf: ArrayLeaf, block: int, verify: bool, gap: int, max_read: int) -> list[Read]:
    pieces.sort(key=lambda p: (p.file, p.start, p.end))
    reads: list[Read] = []
    group: list[_Piece] = []
    g_start = g_end = 0

    def flush() -> None:
        copies = tuple(
            Copy(p.copy.dest, p.elem - g_start, p.copy.src_strides, p.copy.shape, p.copy.dest_start, p.copy.itemsize) for p in group
        )
        checks: dict[int, Check] = {}
        if verify:
            for p in group:
                for c in _checks_for(p, leaf, block):
                    checks[c.start] = c
        reads.append(Read(group[0].file, g_start, g_end, copies, tuple(checks[k] for k in sorted(checks))))

    for p in pieces:
        if group and p.file == group[0].file and (
            p.start < g_end  # overlapping ranges must share one buffer
            or (p.start <= g_end + gap and max(g_end, p.end) - g_start <= max_read)
        ):
            group.append(p)
            g_end = max(g_end, p.end)
            continue
        if group:
            flush()
        group = [p]
        g_start, g_end = p.start, p.end
    if group:
        flush()
    return reads


def _checks_for(p: _Piece, leaf: ArrayLeaf, block: int) -> list[Check]:
    chunk_off, size = p.chunk_off, p.chunk_size
    crcs = leaf.crcs[p.chunk]
    first = (p.start - chunk_off) // block
    last = -(-(p.end - chunk_off) // block)
    return [
        Check(chunk_off + b * block, chunk_off + min((b + 1) * block, size), crcs[b]) for b in range(first, last)
    ]
