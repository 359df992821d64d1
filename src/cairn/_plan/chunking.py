"""Pure planning: who writes which chunk, and which byte ranges a load reads.

Nothing here touches devices, files or processes: inputs are shapes, boxes
(per-axis ``(start, stop)`` index ranges) and the stored index, outputs are
immutable records (frozen dataclasses, named tuples). That keeps the planner testable, and lets the benchmark
run it for clusters that do not exist.

Saving: the boxes held by the devices of a sharding form a regular grid; each
grid cell is one chunk, written once by one process (the holder of its first
replica, or spread over replicas). Loading: each target box overlaps a small
range of grid cells per axis (found by bisection), and each overlap becomes a
strided copy out of one byte range of one file. Ranges are widened to
checksum blocks (so that every byte read can be verified) and merged.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .._format.manifest import ArrayLeaf
from .grid import cell_ranges, regular_layout

Box = tuple[tuple[int, int], ...]


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(s)) for s in shape)


def box_size(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def c_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    strides = []
    acc = itemsize
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


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
        cell = _ravel(idx, grid_shape)
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
    if r < 2 or min(math.prod(hi - lo for lo, hi in _cell_box(bounds, c)) for c in range(len(holders))) < split_elems:
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
        idx = _unravel(cell, new_shape)
        old, k = parent_of[idx[axis]]
        parent = _ravel([*idx[:axis], old, *idx[axis + 1 :]], grid_shape)
        p = procs[parent][(k + offset) % len(procs[parent])]
        d = next(h for h in holders[parent] if device_process[h] == p)
        writer.append(int(p))
        source.append(d)
    return ChunkLayout(tuple(new_bounds), tuple(writer), tuple(source))


def _cell_box(bounds: Sequence[Sequence[int]], cell: int) -> Box:
    idx = _unravel(cell, tuple(len(b) - 1 for b in bounds))
    return tuple((bounds[a][i], bounds[a][i + 1]) for a, i in enumerate(idx))


cell_box_of = _cell_box


def _unravel(flat: int, grid_shape: Sequence[int]) -> list[int]:
    idx = []
    for n in reversed(grid_shape):
        idx.append(flat % n)
        flat //= n
    return idx[::-1]


def _ravel(idx: Sequence[int], grid_shape: Sequence[int]) -> int:
    flat = 0
    for i, n in zip(idx, grid_shape):
        flat = flat * n + i
    return flat


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


# --------------------------------------------------------------------------- load


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
    rule = _SplitRule(itemsize, dense_fraction, small_read, block_size if verify else 0)
    chunks: dict[int, _Chunk] = {}  # a chunk that several boxes overlap is described once
    pieces: list[_Piece] = []
    for dest, box in enumerate(boxes):
        if box_size(box) == 0:
            continue
        for idx in overlapping_cells(grid, box):
            cell = _ravel(idx, grid_shape)
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
    return _merge(pieces, leaf, block_size, verify, max_merge_gap, max_read)


_PIECE_COST = 64 << 10


@dataclass(frozen=True, slots=True)
class _SplitRule:
    """What `_split` needs of one `plan_reads` call: the leaf's item size and the knobs."""

    itemsize: int
    dense: float  # a covering read is kept if at least this fraction of it is needed...
    small: int  # ...or if it is under this many bytes
    block: int  # the checksum block each piece widens to; 0 when not verifying


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
    if not split or a is None:
        off = chunk.offset
        copy = Copy(dest, 0, strides, shape, tuple(lo_a - b[0] for lo_a, b in zip(lo, box)), itemsize)
        out.append(_Piece(chunk.file, off + first_byte, off + end_byte, off + first_byte, copy, chunk.cell, off,
                          chunk.nbytes))
        return
    for i in range(lo[a], hi[a]):
        sub_lo = tuple(i if k == a else v for k, v in enumerate(lo))
        sub_hi = tuple(i + 1 if k == a else v for k, v in enumerate(hi))
        _split(out, rule, chunk, box, dest, sub_lo, sub_hi)


def _widen(p: _Piece, leaf: ArrayLeaf, block: int) -> _Piece:
    chunk_off = p.chunk_off
    rel_start = (p.start - chunk_off) // block * block
    rel_end = min(-(-(p.end - chunk_off) // block) * block, p.chunk_size)
    return _Piece(p.file, chunk_off + rel_start, chunk_off + rel_end, p.elem, p.copy, p.chunk, chunk_off, p.chunk_size)


def _merge(pieces: list[_Piece], leaf: ArrayLeaf, block: int, verify: bool, gap: int, max_read: int) -> list[Read]:
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
