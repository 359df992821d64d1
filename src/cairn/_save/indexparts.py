"""The save side of format version 2's index: each process's binary part, and the item index.

Every process writes the records of the chunks it wrote into its own part
(`_partfile.encode_part`), and tells the primary only what the primary cannot
compute: its data files and the part's size. The primary then writes each
item's JSON index from the layouts, which every process computes alike (the
grid as runs, the writers as runs), and the files and parts it was told of.
No process reads another's part, and the commit does no per-chunk work.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.boxes import cell_box
from .._core.memo import Memo
from .._errors import CheckpointError
from .._format import manifest as fmt
from .._format.binindex import raw_blocks
from .._format.partfile import PartInfo, encode_part, part_name
from .._format.runlength import writer_runs
from .._tree.leaves import ValueSource
from .._tree.pytree import display_path
from .assign import SaveItem

# Keyed by the id of a layout's writer tuple, which each entry holds (so that the id stays its own).
_own_cells: Memo[tuple[tuple[int, ...], np.ndarray]] = Memo()
_runs: Memo[tuple[tuple[int, ...], Any]] = Memo()


def own_cells(writer: tuple[int, ...], me: int) -> np.ndarray:
    """The cells `me` writes in a layout (memoised per layout: a model repeats a few of them)."""
    key = (id(writer), me)
    hit = _own_cells.get(key)
    if hit is None or hit[0] is not writer:
        hit = _own_cells.put(key, (writer, np.flatnonzero(np.asarray(writer, dtype=np.int64) == me)))
    return hit[1]


def build_part(item: SaveItem, me: int, token: str, rows: list[tuple[int, ...]], where: str,
               stored: dict[tuple[int, int], tuple[int, ...]] | None = None, block: int = fmt.DEFAULT_BLOCK_SIZE,
               blocks: dict[tuple[int, int], tuple[bytes, bytes]] | None = None,
               ) -> tuple[str, bytes, int, int] | None:
    """This process's part of `item`: ``(name, bytes, records, crcs)``, None when it wrote no cell.

    `rows`: what the writers report per chunk, ``(leaf, cell, file, offset, *crcs)``. With
    `stored` (format version 3: each compressed chunk's stored block sizes), a version-3 part
    whose size column gives every block's stored size (the raw size where not compressed).
    With `blocks` too (format version 4: each chunk's hash and source column bytes,
    `incremental.Incremental.columns`), a version-4 part.
    """
    got = {(r[0], r[1]): r for r in rows}
    leaf_col: list[int] = []
    cell_col: list[int] = []
    file_col: list[int] = []
    off_col: list[int] = []
    crc_col: list[tuple[int, ...]] = []
    size_col: list[tuple[int, ...]] = []
    hash_col: list[bytes] = []
    src_col: list[bytes] = []
    for i in sorted(item.layouts):
        layout = item.layouts[i]
        for cell in own_cells(layout.writer, me).tolist():
            r = got.get((i, cell))
            if r is None:
                box = cell_box(layout.grid, cell)
                src = item.leaves[i]
                assert not isinstance(src, ValueSource)
                if int(np.prod([hi - lo for lo, hi in box])) * src.dtype.itemsize:
                    raise CheckpointError(
                        f"{where}: chunk {cell} of {display_path(src.path, item.name)!r} was not written")
                r = (i, cell, 0, 0)
            leaf_col.append(i)
            cell_col.append(cell)
            file_col.append(r[2])
            off_col.append(r[3])
            crc_col.append(tuple(r[4:]))
            if stored is not None:
                st = stored.get((i, cell))
                if st is None:
                    src = item.leaves[i]
                    assert not isinstance(src, ValueSource)
                    nbytes = int(np.prod([hi - lo for lo, hi in cell_box(layout.grid, cell)])) * src.dtype.itemsize
                    st = tuple(raw_blocks(nbytes, block))
                size_col.append(st)
            if blocks is not None:  # a chunk of no bytes has no blocks
                h, o = blocks.get((i, cell), (b"", b""))
                hash_col.append(h)
                src_col.append(o)
    if not leaf_col:
        return None
    data = encode_part(me, leaf_col, cell_col, file_col, off_col, crc_col,
                       size_col if stored is not None else None,
                       (b"".join(hash_col), b"".join(src_col)) if blocks is not None else None)
    return part_name(me, token), data, len(leaf_col), sum(len(c) for c in crc_col)


def item_index(item: SaveItem, statuses: dict[int, dict[str, Any]], processes: int, block_size: int) -> fmt.ItemIndex:
    """The primary's JSON index of `item` from the layouts and every process's reported files and part."""
    files: list[fmt.FileInfo] = []
    parts: list[PartInfo] = []
    codecs: dict[str, str] = {}
    refs: set[int] = set()  # incremental: the leaves some of whose blocks are references
    for p in range(processes):
        mine = statuses[p].get("items", {}).get(item.name, {})
        codecs.update(mine.get("codecs", {}))
        base = len(files)
        files.extend(fmt.FileInfo(name, size) for name, size in mine.get("files", ()))
        # Incremental (format 4): the base files its part refers to, numbered after its own.
        files.extend(fmt.FileInfo(name, size, b) for b, name, size in mine.get("ext", ()))
        refs.update(mine.get("refs", ()))
        part = mine.get("part")
        if part is not None:
            parts.append(PartInfo(part[0], p, part[1], part[2], base, len(files) - base))
    leaves: list[fmt.Leaf] = []
    for i, src in enumerate(item.leaves):
        if isinstance(src, ValueSource):
            leaves.append(fmt.ValueLeaf(src.path, src.kind, src.value))
            continue
        layout = item.layouts[i]
        runs = _runs.get(id(layout.writer))
        if runs is None or runs[0] is not layout.writer:
            runs = _runs.put(id(layout.writer), (layout.writer, writer_runs(layout.writer)))
        sharding = None
        if src.is_jax:
            from .._tree.shardings import describe_sharding

            sharding = describe_sharding(src.value.sharding)
        leaves.append(fmt.ArrayLeaf(
            path=src.path, dtype=src.dtype, shape=src.shape, grid=layout.grid, chunks=(), crcs=(), kind=src.kind,
            sharding=sharding, handler=src.handler, impl=src.impl, impl_shape=src.impl_shape, writers=runs[1],
            codec=codecs.get(str(i), "none"), refs=i in refs))
    return fmt.ItemIndex(item.structure, tuple(leaves), tuple(files), block_size, parts=tuple(parts),
                         processes=processes)
