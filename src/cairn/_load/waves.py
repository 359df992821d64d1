"""Read-once leaves in waves: which leaves go together, and leaves restored in pieces.

`_load` runs the waves (reads, status exchange, collectives); this module
decides them from global figures only, so that every process forms the same
waves, and gathers a leaf restored in pieces into host buffers of this
process's target shards. See docs/ARCHITECTURE.md, "Read-once restore".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._core.boxes import Box
from .readonce import ProcessOf, Route, layout_of, process_bytes, read_bytes, slabs


@dataclass(frozen=True)
class Staged:
    """An array restored read-once: read its `route.read` boxes, then reshard on devices.

    A leaf too large for the budget is restored in `pieces` along `axis`, one
    wave each, into host buffers of its target shards (`Gather`).
    """

    item: Any  # the load's _ItemLoad
    leaf: int
    want: Any  # the load's _Want: leaf, dtype, target sharding
    route: Route
    axis: int = 0
    pieces: tuple[tuple[int, int], ...] = ()

    def region(self, piece: int | None) -> Any:
        shape = self.want.leaf.shape
        if piece is None:
            return None
        lo, hi = self.pieces[piece]
        return tuple((lo, hi) if a == self.axis else (0, n) for a, n in enumerate(shape))


def cut_in_pieces(s: Staged, budget: int, n: int, process_of: ProcessOf | None = None) -> Staged:
    """`s`, cut into pieces if its transient buffers per process would exceed `budget`."""
    leaf = s.want.leaf
    held = -(-s.route.cost // n) + process_bytes(s.want.sharding, leaf.shape, s.want.dtype.itemsize, process_of)
    block, verify = s.item.index.block_size, s.item.reader.verify

    def cost(axis: int, pieces: list[tuple[int, int]]) -> int:
        return sum(read_bytes(leaf, s.route.read, block, verify,
                              tuple(p if a == axis else (0, m) for a, m in enumerate(leaf.shape)), process_of)
                   for p in pieces)

    cut = slabs(leaf.shape, layout_of(s.want.sharding, leaf.shape), held, budget, cost, leaf.nbytes)
    if cut is None:
        return s
    return Staged(s.item, s.leaf, s.want, s.route, cut[0], tuple(cut[1]))


Unit = tuple[Staged, int | None]  # a leaf, or one piece of it


def plan_waves(staged: list[Staged], budget: int, n: int) -> list[list[Unit]]:
    """Group read-once leaves so that each process's share of a wave fits `budget`.

    A process's share is estimated from global figures (bytes read over
    processes), so every process forms the same waves. A leaf cut into pieces
    takes one wave per piece.
    """
    waves: list[list[Unit]] = []
    size = 0
    for s in staged:
        if s.pieces:
            waves.extend([[(s, j)] for j in range(len(s.pieces))])
            size = budget + 1  # nothing joins a piece's wave
            continue
        share = -(-s.route.cost // n)
        if waves and size + share <= budget:
            waves[-1].append((s, None))
            size += share
        else:
            waves.append([(s, None)])
            size = share
    return waves


class Gather:
    """Host buffers of one process's target shards of a leaf restored in pieces."""

    def __init__(self, s: Staged):
        from .._core.buffers import aligned_empty
        from .._tree.shardings import addressable_boxes

        self.s = s
        leaf = s.want.leaf
        _, self.placement = addressable_boxes(  # memoised: read, never modified
            s.want.sharding, leaf.shape)
        self.dests = {b: aligned_empty(tuple(hi - lo for lo, hi in b), s.want.dtype) for b in self.placement}

    def add(self, piece: Any, region: Box) -> None:
        """Copy this process's shards of a piece (already in the target's sharding) into place."""
        from .._tree.shardings import slices_to_box

        a, (plo, _) = self.s.axis, region[self.s.axis]
        done: set[Box] = set()
        for shard in piece.addressable_shards:
            rel = slices_to_box(shard.index, piece.shape)
            box = tuple((lo + plo, hi + plo) if i == a else (lo, hi) for i, (lo, hi) in enumerate(rel))
            if box in done:
                continue  # a replica on another local device: the same bytes
            done.add(box)
            # The target does not cut the piece's axis, so the shard's box lies in one target box.
            target = next(t for t in self.dests if all(t[i][0] <= box[i][0] and box[i][1] <= t[i][1]
                                                     for i in range(len(box))))
            view = self.dests[target][tuple(slice(lo - t0, hi - t0) for (lo, hi), (t0, _) in zip(box, target))]
            np.copyto(view, np.asarray(shard.data))

    def finish(self) -> Any:
        import jax

        arrays = [jax.device_put(self.dests[b], d) for b, devices in self.placement.items() for d in devices]
        return jax.make_array_from_single_device_arrays(self.s.want.leaf.shape, self.s.want.sharding, arrays)
