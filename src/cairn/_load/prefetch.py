"""Before a load reads data: fetch, from the binary index parts, the records of the chunks it will read.

A version-2 index names each chunk's file, offset and checksums only in the
part of the process that wrote it (`_binindex`). A load knows which boxes of
each leaf this process reads (its target boxes, or for read-once leaves the
boxes of the sharding it reads before the reshard), so it asks for exactly
those chunks' records, for every leaf at once: a few ranged reads per part
touched, instead of one round per leaf.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._format import manifest as fmt
from .._format.binindex import cells_in


def prefetch(index: fmt.ItemIndex, wanted: dict[int, Any], reads: dict[int, Any]) -> None:
    """Fetch the records `index`'s leaves need: `wanted` maps leaf number to its `_Want` (or None),
    `reads` leaf number to the jax sharding this process reads it with (absent: read whole)."""
    table = index.table
    if table is None:
        return
    from .._tree.shardings import addressable_boxes

    need: dict[int, np.ndarray] = {}
    for i in wanted:
        leaf = index.leaves[i]
        if not isinstance(leaf, fmt.ArrayLeaf) or i not in table.leaves:
            continue
        sharding = reads.get(i)
        cells = len(table.leaves[i].writers)
        if sharding is None or cells == 1:
            need[i] = np.arange(cells)
        else:
            boxes, _ = addressable_boxes(sharding, leaf.shape)
            need[i] = cells_in(leaf.grid, boxes)
    if need:
        table.fetch(need)
