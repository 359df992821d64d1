"""Which chunks of each array this process writes, and in which of its files.

The chunk layout of an array is a pure function of its sharding (`_plan.chunk_layout`),
so every process computes the same writers without talking. Layouts are
memoised per (sharding, shape): models repeat a few of them over hundreds of layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._errors import UnsupportedTypeError
from ._format import cell_box
from ._leaves import ArraySource, ValueSource
from ._plan import ChunkLayout, FileSlot, assign_files, chunk_layout, full_box
from ._tree import display_path


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
    from ._plan import LayoutError

    mine: list[tuple[int, int, int]] = []
    for i, src in enumerate(item.leaves):
        if not isinstance(src, ArraySource):
            continue
        shape, itemsize = src.shape, src.dtype.itemsize
        if src.is_jax:
            from ._jaxutil import device_boxes

            devices, boxes = device_boxes(src.value.sharding, shape)
            try:
                split = REPLICA_SPLIT_BYTES // max(itemsize, 1)
                layout, own = layout_for(src.value.sharding, shape, boxes, devices, me, split_replicas, i, split)
            except LayoutError as e:
                raise UnsupportedTypeError(f"{where}: leaf {display_path(src.path, item.name)!r}: {e}") from None
            shards = None
            for cell, d, elems in own:
                if shards is None:
                    shards = {s.device: s.data for s in src.value.addressable_shards}
                data = shards[devices[d]]
                box = cell_box(layout.grid, cell)
                if box != boxes[d]:  # a piece of a replicated chunk: cut it out on the device
                    data = data[tuple(slice(lo - dlo, hi - dlo) for (lo, hi), (dlo, _) in zip(box, boxes[d]))]
                item.sources[(i, cell)] = data
                mine.append((i, cell, elems * itemsize))
        else:
            layout = ChunkLayout(tuple((0, n) for n in shape), (0,), (0,))
            if me == 0:
                item.sources[(i, 0)] = src.value
                mine.append((i, 0, box_bytes(full_box(shape), itemsize)))
        item.layouts[i] = layout
    item.files = assign_files(mine, threads, min_file_bytes)


layout_cache: dict[Any, tuple[ChunkLayout, tuple[tuple[int, int, int], ...]]] = {}


def layout_for(sharding: Any, shape: tuple[int, ...], boxes: Any, devices: Any, me: int,
                split_replicas: bool, offset: int, split_elems: int = 0,
                ) -> tuple[ChunkLayout, tuple[tuple[int, int, int], ...]]:
    """The chunk layout of an array and this process's ``(cell, device, elements)`` in it.

    Both cost O(devices) per array; models repeat a few (sharding, shape)
    pairs over hundreds of layers, so they are memoised (benchmarks/plan_scale.py
    measures the difference at 4,096 devices).
    """
    spread = split_replicas or split_elems > 0  # the offset picks writers
    key: Any = (sharding, shape, split_replicas, offset if spread else 0, me, split_elems)
    try:
        hit = layout_cache.get(key)
    except TypeError:  # unhashable sharding
        hit, key = None, None
    if hit is not None:
        return hit
    layout = chunk_layout(shape, boxes, [d.process_index for d in devices], split_replicas, offset, split_elems)
    own = tuple(
        (cell, d, box_bytes(cell_box(layout.grid, cell), 1))
        for cell, (w, d) in enumerate(zip(layout.writer, layout.source))
        if w == me
    )
    if key is not None:
        if len(layout_cache) > 4096:
            layout_cache.clear()
        layout_cache[key] = (layout, own)
    return layout, own


def box_bytes(box: Any, itemsize: int) -> int:
    n = itemsize
    for lo, hi in box:
        n *= hi - lo
    return n
