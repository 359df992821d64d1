"""Conversion of any readable checkpoint into a cairn one, and the CLI's ``convert`` command.

A source's arrays are streamed into a `StreamWriter` in slabs of a quarter
of the memory budget, through the same readers a load uses (byte ranges for
safetensors and DCP, tensorstore for Orbax), so no array is ever held whole.
Files written by ``cairn convert --to safetensors`` (cairn's tree in their
metadata) go back through `_safetensors.from_safetensors`, exactly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._core.stats import Progress
from .._errors import CheckpointError, CheckpointNotFoundError
from .._format import manifest as fmt
from .._load.reader import DEFAULT_BUDGET, ChunkReader, LoadStats, slab_bytes
from .._save.stream import StreamWriter
from .._sources.base import FormatSource, open_format
from .._sources.hf import Safetensors
from .._sources.registry import open_foreign
from .._storage.location import resolve
from .safetensors import from_safetensors


class _Slabs:
    """One array of a source as a `_streamwriter.SlabSource`: slabs of exactly `slab` bytes."""

    def __init__(self, source: FormatSource, reader: ChunkReader, leaf: fmt.ArrayLeaf, pool: ThreadPoolExecutor):
        self.source, self.reader, self.leaf, self.pool = source, reader, leaf, pool
        self.dtype, self.shape = leaf.dtype, leaf.shape

    @property
    def nbytes(self) -> int:
        return self.leaf.nbytes

    def slabs(self, slab: int) -> Iterator[np.ndarray]:
        return exact_slabs(self.source.slabs(self.reader, self.leaf, slab, self.pool), self.nbytes, slab)


def exact_slabs(arrays: Iterable[np.ndarray], nbytes: int, slab: int) -> Iterator[np.ndarray]:
    """The C-order bytes of `arrays` (`nbytes` in all) as fresh buffers of exactly `slab` bytes (the last
    may be shorter), so that a writer's checksum blocks line up with the slabs."""
    left = nbytes
    buf, fill = np.empty(min(slab, left), np.uint8), 0
    for arr in arrays:
        raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        pos = 0
        while pos < len(raw):
            k = min(len(buf) - fill, len(raw) - pos)
            buf[fill : fill + k] = raw[pos : pos + k]
            fill, pos = fill + k, pos + k
            if fill == len(buf):
                left -= fill
                yield buf  # a fresh buffer next: the writer may still hold this one
                buf, fill = np.empty(min(slab, left), np.uint8), 0


def convert_to_cairn(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str | None = None,
    budget_bytes: int = DEFAULT_BUDGET,
    threads: int = 4,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> None:
    """Build cairn checkpoint `dst` from checkpoint `src` of any format `cairn.load` reads.

    `on_total(n)` is called once with the bytes of array data to convert and `progress(n)` as each
    `n` of them is written; listeners added with ``progress=True`` get ``"convert"`` progress events."""
    loc = resolve(src, storage_options)
    try:
        f = open_foreign(loc, format)
    except CheckpointNotFoundError:
        if format in (None, "safetensors") and loc.storage.list_dir(loc.name):
            # a folder of cairn's per-checkpointable safetensors files
            return from_safetensors(src, dst, budget_bytes=budget_bytes, storage_options=storage_options,
                                    progress=progress, on_total=on_total)
        raise
    if isinstance(f, Safetensors) and f.from_cairn:
        return from_safetensors(src, dst, budget_bytes=budget_bytes, storage_options=storage_options,
                                progress=progress, on_total=on_total)
    if f.name == "cairn":
        raise CheckpointError(f"{loc.path} is a cairn checkpoint already")
    source = open_format(f, None, None, loc.path)
    tracker = Progress("convert", os.fspath(dst))
    on_total, progress = tracker.wrap(on_total, progress)
    on_total(sum(leaf.nbytes for index in source.indexes.values() for leaf in index.leaves
                 if isinstance(leaf, fmt.ArrayLeaf)))
    slab = slab_bytes(budget_bytes)
    writer = StreamWriter(resolve(dst, storage_options), fmt.DEFAULT_BLOCK_SIZE)
    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="cairn-convert") as pool:
            for name, index in source.indexes.items():
                reader = source.reader(name, index, False, pool, LoadStats())
                try:
                    leaves: list[Any] = [
                        leaf if isinstance(leaf, fmt.ValueLeaf)
                        else (leaf.kind, leaf.path, _Slabs(source, reader, leaf, pool), {})
                        for leaf in index.leaves
                    ]
                    writer.write_item(name, source.manifest.root, index.structure, leaves, slab, progress)
                finally:
                    reader.close()
        # The source's own "format" names what it was, which "converted_from" says; kept, it would
        # read as a claim about the cairn checkpoint written here.
        meta = {k: v for k, v in source.manifest.metadata.items() if k != "format"}
        writer.commit(source.manifest.root, {"converted_from": f.name, **meta})
    except BaseException:
        writer.abort()
        raise
    tracker.finish()


def run_convert(args: Any, out: Any) -> int:
    """``cairn convert SRC DST --to ...`` (the parsed arguments, the CLI's `Output`)."""
    from .export import export_safetensors
    from .safetensors import to_safetensors
    from .statedict import to_torch_file

    # One bar (on a terminal; nothing otherwise or with --quiet), its total set by the conversion itself.
    with out.progress(f"converting to {args.to}", None) as (set_total, advance):
        if args.to == "safetensors" and args.max_shard_size is not None:
            written = export_safetensors(args.src, args.dst, max_shard_size=args.max_shard_size, item=args.item,
                                         names=args.names, prng_keys=args.prng_keys, per_process=args.per_process,
                                         all_items=args.all_items, overwrite=args.overwrite,
                                         budget_bytes=args.budget, progress=advance, on_total=set_total)
        elif args.to == "safetensors":
            written = to_safetensors(args.src, args.dst, per_item=args.per_item, names=args.names, item=args.item,
                                     all_items=args.all_items, budget_bytes=args.budget, progress=advance,
                                     on_total=set_total)
        elif args.to == "torch":
            written = [to_torch_file(args.src, args.dst, sep=args.sep, budget_bytes=args.budget, progress=advance,
                                     on_total=set_total)]
        elif args.to == "orbax":
            from .orbax import export_orbax

            written = [export_orbax(args.src, args.dst, overwrite=args.overwrite, per_process=args.per_process,
                                    progress=advance, on_total=set_total)]
        else:
            convert_to_cairn(args.src, args.dst, format=args.format, budget_bytes=args.budget, progress=advance,
                             on_total=set_total)
            written = [args.dst]
    for w in written:
        out.line(f"wrote {w}")
    return 0
