"""Read plans reused across the leaves of one layout.

A model repeats a few layouts: every layer's query matrix has the same shape,
chunk grid and target sharding, and a save writes each leaf's chunks back to
back in the same pattern. `plan_reads` (splitting overlaps, widening to
checksum blocks, merging ranges) then computes the same plan again and again,
shifted to another place in a file. On a resharding load this planning runs
on the loading thread and costs a few milliseconds per leaf (measured: 0.22-
0.33 s of a 2 GiB bfloat16 load of 156 leaves that takes 1.1-1.4 s warm).

`PlanMemo` keeps, per layout, the plan as a template: byte positions relative
to the first chunk touched, and for each checksum block the (chunk, block)
it belongs to. Another leaf of the layout gets the template shifted to its
own first chunk, with its own checksums filled in. Two leaves share a
template only when everything `plan_reads` looks at is equal: shape, item
size, grid, target boxes (hence the cells touched), the checking and merge
settings, and those cells' offsets relative to the first one, all in one
file. The key reads only the index entries of the cells the boxes touch, as
planning does, so a process still reads only the records it needs. Anything
else is planned afresh.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from typing import Any

from .._core.boxes import Box, ravel
from .grid import cell_ranges
from .reads import Check, Read, plan_reads

#: Distinct layouts kept per memo (a model has a few dozen; a bound keeps odd trees cheap).
MAX_TEMPLATES = 256
#: A leaf whose target boxes touch more cells than this is planned afresh: the key would cost
#: about as much as the planning it saves, and such fan-ins rarely repeat offset for offset.
MAX_CELLS = 64

# A template: per read (start, end, copies, checks), positions relative to the first cell's offset;
# each check as (start, end, position of its cell among the touched cells, block number).
_Template = tuple[tuple[int, int, Any, tuple[tuple[int, int, int, int], ...]], ...]


class PlanMemo:
    """`plan_reads` for a sequence of leaves, reusing the plan of an earlier leaf of the same layout."""

    def __init__(self) -> None:
        self._templates: dict[Any, _Template] = {}
        self.hits = self.misses = 0

    def plan(self, leaf: Any, boxes: Sequence[Box], block_size: int, verify: bool, max_read: int) -> list[Read]:
        touched = self._touched(leaf, boxes)
        if touched is None:
            return plan_reads(leaf, boxes, block_size, verify, max_read=max_read)
        chunks = leaf.chunks
        file, base = chunks[touched[0]]
        rel = []
        for c in touched:
            f, off = chunks[c]
            if f != file:  # chunks of several files (a multi-process save): no shared pattern to expect
                return plan_reads(leaf, boxes, block_size, verify, max_read=max_read)
            rel.append(off - base)
        # The cells touched follow from the grid and the boxes; their offsets do not.
        key = (leaf.shape, leaf.dtype.itemsize, leaf.grid, tuple(boxes), block_size, verify, max_read, tuple(rel))
        template = self._templates.get(key)
        if template is None:
            self.misses += 1
            reads = plan_reads(leaf, boxes, block_size, verify, max_read=max_read)
            made = _template(reads, leaf, touched, key[-1], file, base, block_size)
            if made is not None and len(self._templates) < MAX_TEMPLATES:
                self._templates[key] = made
            return reads
        self.hits += 1
        crcs = leaf.crcs
        mine: dict[int, Sequence[int]] = {}
        out = []
        for start, end, copies, checks in template:
            filled = []
            for cs, ce, pos, b in checks:
                block_crcs = mine.get(pos)
                if block_crcs is None:
                    block_crcs = mine[pos] = crcs[touched[pos]]
                filled.append(Check(base + cs, base + ce, block_crcs[b]))
            out.append(Read(file, base + start, base + end, copies, tuple(filled)))
        return out

    @staticmethod
    def _touched(leaf: Any, boxes: Sequence[Box]) -> list[int] | None:
        """The cells `boxes` touch, in order; None for none, or where the cells seen so far plus the next
        box's cells (a cell shared by two boxes counted twice: a bound, not the union) pass `MAX_CELLS`."""
        grid, shape = leaf.grid, leaf.grid_shape
        cells: set[int] = set()
        for box in boxes:
            ranges = cell_ranges(grid, box)
            if ranges is None:
                continue
            if len(cells) + math.prod(len(r) for r in ranges) > MAX_CELLS:
                return None
            cells.update(ravel(idx, shape) for idx in itertools.product(*ranges))
        return sorted(cells) or None


def _template(reads: list[Read], leaf: Any, touched: list[int], rel: tuple[int, ...], file: int, base: int,
              block: int) -> _Template | None:
    """`reads` (the plan of `leaf`) relative to `base`; None where a read or check does not fit the pattern."""
    order = sorted(range(len(rel)), key=rel.__getitem__)
    starts = [rel[i] for i in order]
    out = []
    for r in reads:
        if r.file != file:
            return None
        checks = []
        for c in r.checks:
            at = c.start - base
            k = bisect.bisect_right(starts, at) - 1
            if k < 0:
                return None
            pos = order[k]
            b, off = divmod(at - rel[pos], block)
            crcs = leaf.crcs[touched[pos]]
            if off or b >= len(crcs) or crcs[b] != c.crc:  # not the block it must be: plan afresh
                return None
            checks.append((at, c.end - base, pos, b))
        out.append((r.start - base, r.end - base, r.copies, tuple(checks)))
    return tuple(out)
