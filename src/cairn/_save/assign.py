"""Which chunks of each array this process writes, and in which of its files.

The chunk layout of an array is a pure function of its sharding (`_plan.chunk_layout`),
so every process computes the same writers without talking. Layouts are
memoised per (sharding, shape): models repeat a few of them over hundreds of layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np

from .._core.boxes import cell_box, full_box
from .._core.memo import Memo
from .._errors import UnsupportedTypeError
from .._plan.chunking import ChunkLayout, FileSlot, assign_files, chunk_layout
from .._plan.rowmerge import merge_rows, pieces
from .._tree.leaves import ArraySource, ValueSource
from .._tree.pytree import display_path


@dataclass
class SaveItem:
    """One checkpointable being saved: its leaves and this process's share of the writing."""

    name: str
    dir: str
    structure: Any
    leaves: list[ArraySource | ValueSource]
    layouts: dict[int, ChunkLayout] = field(default_factory=dict)
    files: list[list[FileSlot]] = field(default_factory=list)
    # (leaf, cell) -> what to write: a single-device jax.Array, a numpy array,
    # or (after a snapshot) a host copy.
    sources: dict[tuple[int, int], Any] = field(default_factory=dict)



#: A replicated chunk of at least this many bytes is split between its holding processes, so that
#: they write it in parallel (each byte still once); smaller ones stay whole (fewer chunks).
REPLICA_SPLIT_BYTES = 8 << 20


def plan_item(item: SaveItem, me: int, split_replicas: bool, threads: int, min_file_bytes: int, where: str) -> None:
    from .._plan.chunking import LayoutError

    mine: list[tuple[int, int, int]] = []
    for i, src in enumerate(item.leaves):
        if not isinstance(src, ArraySource):
            continue
        shape, itemsize = src.shape, src.dtype.itemsize
        if src.is_jax:
            x = src.value
            try:
                layout, own = sources_for(x.sharding, shape, itemsize, me, split_replicas, i)
            except LayoutError as e:
                raise UnsupportedTypeError(f"{where}: leaf {display_path(src.path, item.name)!r}: {e}") from None
            if own:
                from .._tree.shardings import shard_arrays

                arrays, order = shard_arrays(x)
                for cell, parts, nbytes in own:
                    pieces = []
                    for device, cut in parts:
                        data = arrays[order[device]]
                        if cut is not None:  # a piece of a replicated chunk: cut it out on the device
                            data = data[cut]
                        pieces.append(data)
                    item.sources[(i, cell)] = pieces[0] if len(pieces) == 1 else Concat(pieces)
                    mine.append((i, cell, nbytes))
        else:
            layout = ChunkLayout(tuple((0, n) for n in shape), (src.owner,), (0,))
            if me == src.owner:
                item.sources[(i, 0)] = src.value
                mine.append((i, 0, box_bytes(full_box(shape), itemsize)))
        item.layouts[i] = layout
    item.files = assign_files(mine, threads, min_file_bytes)


class Concat:
    """The source of a merged chunk (`_plan.merge_rows`): shards whose C-order bytes, one after
    another, are the chunk's."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[Any]):
        self.parts = parts

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)


#: Per (sharding, shape, ...): the layout and this process's chunks as
#: ``(cell, ((source device, slices to cut on it or None), ...), bytes)``.
_sources_cache: Memo[tuple[ChunkLayout, tuple[tuple[int, Any, int], ...]]] = Memo()


def sources_for(sharding: Any, shape: tuple[int, ...], itemsize: int, me: int, split_replicas: bool,
                leaf: int) -> tuple[ChunkLayout, tuple[tuple[int, Any, int], ...]]:
    """`layout_for` of a jax sharding, with what plan_item needs per own chunk, memoised.

    The leaf's position picks the writers of replicated chunks; a layout without
    chunks held by several processes (every layout of a single process) does not
    depend on it, so one entry serves every leaf of that sharding and shape.
    """
    split = REPLICA_SPLIT_BYTES // max(itemsize, 1)
    key: Any = (sharding, shape, itemsize, me, split_replicas)
    hit = _sources_cache.get(key) or _sources_cache.get((*key, leaf))
    if hit is not None:
        return hit
    from .._tree.shardings import device_box_array

    devices, boxes, procs = device_box_array(sharding, shape)
    layout, own = layout_for(sharding, shape, boxes, devices, me, split_replicas, leaf, split, itemsize, procs)
    entries = []
    for cell, _source, elems in own:
        parts = []
        for box, src in pieces(layout, cell):
            held = boxes[src] if type(boxes) is list else tuple(map(tuple, boxes[src].tolist()))
            cut = None
            if box != held:
                cut = tuple(slice(lo - dlo, hi - dlo) for (lo, hi), (dlo, _) in zip(box, held))
            parts.append((devices[src], cut))
        entries.append((cell, tuple(parts), elems * itemsize))
    return _sources_cache.put(key if not _shared_cells(boxes, procs) else (*key, leaf), (layout, tuple(entries)))


def _shared_cells(boxes: Any, procs: np.ndarray) -> bool:
    """Whether some box is held by devices of more than one process (then writers depend on the leaf)."""
    if type(boxes) is list:
        first: dict[Any, int] = {}
        return any(first.setdefault(box, p) != p for box, p in zip(boxes, procs.tolist()))
    rows = boxes.reshape(len(boxes), -1)
    order = np.lexsort(rows.T[::-1])
    rows, p = rows[order], procs[order]
    same_box = (rows[1:] == rows[:-1]).all(axis=1)
    return bool((same_box & (p[1:] != p[:-1])).any())


layout_cache: Memo[tuple[ChunkLayout, tuple[tuple[int, int, int], ...]]] = Memo()


def layout_for(sharding: Any, shape: tuple[int, ...], boxes: Any, devices: Any, me: int,
                split_replicas: bool, offset: int, split_elems: int = 0, merge_itemsize: int = 0,
                procs: Any = None) -> tuple[ChunkLayout, tuple[tuple[int, int, int], ...]]:
    """The chunk layout of an array and this process's ``(cell, device, elements)`` in it.

    Both cost O(devices) per array (in numpy, `_grid`: a few ms at 8,192 devices);
    models repeat a few (sharding, shape) pairs over hundreds of layers, so they
    are memoised (benchmarks/probes/plan_scale.py measures the difference at 4,096 devices).
    """
    spread = split_replicas or split_elems > 0  # the offset picks writers
    key: Any = (sharding, shape, split_replicas, offset if spread else 0, me, split_elems, merge_itemsize)
    hit = layout_cache.get(key)
    if hit is not None:
        return hit
    if procs is None:
        procs = list(map(attrgetter("process_index"), devices))
    layout = chunk_layout(shape, boxes, procs, split_replicas, offset, split_elems)
    if merge_itemsize:  # a process's consecutive shards become one chunk (`merge_rows`)
        layout = merge_rows(layout, merge_itemsize)
    cells = np.flatnonzero(np.asarray(layout.writer, dtype=np.int64) == me).tolist()
    own = tuple((cell, layout.source[cell], box_bytes(cell_box(layout.grid, cell), 1)) for cell in cells)
    return layout_cache.put(key, (layout, own))


def box_bytes(box: Any, itemsize: int) -> int:
    n = itemsize
    for lo, hi in box:
        n *= hi - lo
    return n


def files_in_turn(items: list[SaveItem]) -> list[tuple[SaveItem, int]]:
    """The data files of a save in the order its writers start them: each checkpointable's first file,
    then each one's second... (`write_data`; the codec choosing and the host-copy pipeline follow it)."""
    most = max((len(item.files) for item in items), default=0)
    return [(item, k) for k in range(most) for item in items if k < len(item.files)]


class _Unchanged:
    """The source of a chunk an incremental save decided before the snapshot (`incremental.Incremental.decide_unchanged`):
    never read."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED"


#: `_Unchanged`'s one instance.
UNCHANGED = _Unchanged()
