"""Pure: the chunk table of one stored array in a version-1 index, checked and parsed.

Opening a checkpoint checks every chunk of every array against the spec
(`docs/FORMAT.md`) before anything is read. A tree of thousands of small
leaves makes this the bulk of `cairn.metadata` and of planning a load, so
the common table, every chunk within one checksum block (``[file, offset,
crc]``), has a loop of its own with the fewest operations per chunk; anything
else, or anything it rejects, goes through the exact per-chunk loop, which
names the first bad chunk.
"""

from __future__ import annotations

import itertools
from typing import Any

from .._core.memo import Memo
from .._errors import corrupt

MAX_OFFSET = 1 << 56
MAX_CRC = 0xFFFFFFFF

Chunks = tuple[tuple[tuple[int, int], ...], tuple[tuple[int, ...], ...]]


class At:
    """Where in an index a leaf is, for messages: formatted only if one is raised (``str(at)``)."""

    __slots__ = ("base", "i", "path", "tail")

    def __init__(self, base: Any, i: int, path: str | None = None, tail: str = "") -> None:
        self.base, self.i, self.path, self.tail = base, i, path, tail

    def __str__(self) -> str:
        shown = f" ({self.path!r})" if self.path is not None else ""
        return f"{self.base}: leaves[{self.i}]{shown}{self.tail}"


_sizes: Memo[list[int]] = Memo(limit=1024)
_checked: Memo[tuple[int, ...]] = Memo()


def cell_sizes(grid: tuple[tuple[int, ...], ...], itemsize: int) -> list[int]:
    """Bytes of every grid cell, in C order over the grid (memoised: a tree repeats a few grids)."""
    hit = _sizes.get((grid, itemsize))
    if hit is None:
        hit = [itemsize]
        for bounds in grid:
            hit = [s * (hi - lo) for s in hit for lo, hi in itertools.pairwise(bounds)]
        if len(hit) <= 1 << 16:
            _sizes.put((grid, itemsize), hit)
    return hit


def bounds(b: Any, a: int, n: int, where: object) -> tuple[int, ...]:
    """Grid axis `a`'s boundaries, checked: integers from 0 to `n`, increasing ([0, 0] for an empty axis)."""
    if type(b) is not list or len(b) < 2:
        raise corrupt(where, f"grid axis {a} needs at least two boundaries")
    if set(map(type, b)) == {int}:
        hit = _checked.get((n, tuple(b)))
        if hit is not None:  # exact ints, checked before: the same tuple serves every leaf (one object to keep)
            return hit
    for v in b:
        if type(v) is not int or not 0 <= v <= n:
            raise corrupt(where, f"expected an integer in [0, {n}], found {v!r}")
    t = tuple(b)
    if t != (0, 0) if n == 0 else t[0] or t[-1] != n or any(lo >= hi for lo, hi in itertools.pairwise(t)):
        raise corrupt(where, f"grid axis {a} boundaries {b} do not tile 0..{n} (an empty axis: [0, 0])")
    _checked.put((n, t), t)
    return t


def parse_chunks(raw: list[Any], sizes: list[int], file_sizes: list[int], block: int, where: object) -> Chunks:
    """``((file, offset) per chunk, (block CRCs) per chunk)`` from the index's ``chunks`` list."""
    fast = _single_block(raw, sizes, file_sizes, block)
    return fast if fast is not None else _one_by_one(raw, sizes, file_sizes, block, where)


def _single_block(raw: list[Any], sizes: list[int], file_sizes: list[int], block: int) -> Chunks | None:
    """The common table, every chunk within one checksum block: ``[file, offset, crc]`` each."""
    if not sizes or max(sizes) > block or min(sizes) == 0:
        return None
    chunks, crcs = [], []
    n_files = len(file_sizes)
    for c, size in zip(raw, sizes):
        try:
            fi, off, crc = c  # anything but three values fails here or in the type checks below
        except (TypeError, ValueError):
            return None
        if (type(fi) is not int or type(off) is not int or type(crc) is not int or not 0 <= fi < n_files
                or not 0 <= off <= MAX_OFFSET or off + size > file_sizes[fi] or not 0 <= crc <= MAX_CRC):
            return None
        chunks.append((fi, off))
        crcs.append((crc,))
    return tuple(chunks), tuple(crcs)


def _one_by_one(raw: list[Any], sizes: list[int], file_sizes: list[int], block: int, where: object) -> Chunks:
    chunks, crcs = [], []
    last_file = max(len(file_sizes) - 1, 0)
    for i, c in enumerate(raw):
        if type(c) is not list or len(c) < 2:
            raise corrupt(where, f"chunk {i} must be [file, offset, crc...]")
        fi, off = c[0], c[1]
        if type(fi) is not int or type(off) is not int or not 0 <= fi <= last_file or not 0 <= off <= MAX_OFFSET:
            raise corrupt(where, f"chunk {i}: file number and offset must be integers in range, found {c[:2]!r}")
        size = sizes[i]
        if size and (not file_sizes or off + size > file_sizes[fi]):
            raise corrupt(where, f"chunk {i} (bytes {off}..{off + size}) lies outside its data file")
        crc = tuple(c[2:])
        if len(crc) != -(-size // block):
            raise corrupt(where, f"chunk {i} has {len(crc)} checksums for {-(-size // block)} blocks")
        for v in crc:
            if type(v) is not int or not 0 <= v <= MAX_CRC:
                raise corrupt(where, f"chunk {i} has a bad checksum {v!r}")
        chunks.append((fi, off))
        crcs.append(crc)
    return tuple(chunks), tuple(crcs)

