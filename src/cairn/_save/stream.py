"""A single-process writer of cairn checkpoints, one slab at a time.

Importers (safetensors today) and `cairn.copy(..., compression=...)` use it
to turn arrays read from another checkpoint into a new one without holding
any array whole in memory: each array becomes one chunk, streamed from its
source with its block checksums computed on the way, and the checkpoint is
committed through the same strategy as `cairn.save`. With `compression`
each block of an array leaf is coded on its own as a save codes it (format
version 3); with "choose" the codec of a leaf is measured on a sample of its
first slab (`choose.choose`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .._core.buffers import as_view
from .._core.checksum import block_crcs
from .._errors import CorruptCheckpointError
from .._format import manifest as fmt
from .._storage.location import Location
from .._tree.pytree import display_path
from .._version import __version__
from .commit import strategy_for


@runtime_checkable
class SlabSource(Protocol):
    """An array read from another format (`cairn._sources.registry`), yielded as C-order byte slabs
    of exactly `slab` bytes each (the last may be shorter)."""

    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int: ...

    def slabs(self, slab: int) -> Iterator[np.ndarray]: ...


def _file_slabs(src: Any, slab: int, path: str) -> Iterator[np.ndarray]:
    """A tensor stored as one run of bytes in a file (safetensors), slab by slab."""
    reader = src.storage.open_read(src.key)
    try:
        for lo in range(0, src.nbytes, slab):
            buf = np.empty(min(slab, src.nbytes - lo), dtype=np.uint8)
            try:
                reader.read_into(src.start + lo, as_view(buf))
            except EOFError:
                raise CorruptCheckpointError(
                    f"{src.storage.describe(src.key)}: truncated (tensor for {display_path(path)!r})"
                ) from None
            yield buf
    finally:
        reader.close()


class Chunked:
    """An array to write with a grid of chunks (`fmt.ArrayLeaf.grid`): one `SlabSource` per grid
    cell, in C order, each giving that cell's C-order bytes. A recompressing copy keeps the
    source's chunks this way, so a load onto the saved sharding still reads each shard in one run."""

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...], grid: tuple[tuple[int, ...], ...],
                 cells: list[SlabSource]):
        self.dtype, self.shape, self.grid, self.cells = dtype, shape, grid, cells

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cells)


class StreamWriter:
    """Writes a cairn checkpoint one slab at a time (single process; one chunk per array, or the
    grid of a `Chunked` source).

    It follows the same layout and commit strategy as `cairn.save` (`_commit`):
    on local disk everything goes under ``.<name>.cairn-tmp-<token>/`` and is
    renamed into place; on an object store the manifest is put last,
    create-if-absent.
    """

    def __init__(self, loc: Location, block_size: int, compression: str | None = None, overwrite: bool = False,
                 pool: Any = None):
        """`compression`: None (raw blocks), "choose" (a codec per array leaf, measured), "auto" (the same,
        where it pays: `codecpolicy.leaf_codec`) or a codec name,
        as `codecpolicy.resolve_compression` gives; `pool` codes blocks in parallel."""
        self.strategy = strategy_for(loc.storage)
        self.strategy.check_destination(loc, overwrite=overwrite)
        self.loc, self.block, self.compression, self.overwrite, self.pool = (loc, block_size, compression, overwrite,
                                                                               pool)
        self.version = fmt.FORMAT_VERSION  # the manifest's (the highest of the items', `write_item`)
        self.bytes_written = 0  # data bytes (stored, so compressed where a leaf is)
        self.token = secrets.token_hex(6)
        self.root = self.strategy.attempt_root(loc.name, self.token)
        self.items: dict[str, fmt.ItemInfo] = {}
        self.needed: list[str] = []  # every file the manifest will name

    def write_item(self, name: str, root: bool, structure: Any, leaves: list[Any], slab: int,
                   progress: Callable[[int], None] | None = None) -> None:
        """`leaves`: ValueLeaf, or (kind, path, source, extra ArrayLeaf fields) for data read from a source:
        a `SlabSource`, a `Chunked` one, or a tensor in a file (`SrcTensor`)."""
        dirname = fmt.ROOT_ITEM_DIR if root else fmt.item_dirname(name)
        file_name = fmt.data_file_name(0, 0, self.token)
        # leaf -> per chunk: offset, block CRCs, stored sizes
        placed: dict[int, list[tuple[int, list[int], list[int]]]] = {}
        codecs: dict[int, str] = {}
        offset = 0

        def parts() -> Iterator[Any]:
            from .pipeline import encoded

            nonlocal offset
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, fmt.ValueLeaf):
                    continue
                kind, _path, src, _h = leaf
                placed[i] = []
                for cell in (src.cells if isinstance(src, Chunked) else [src]):
                    crcs: list[int] = []
                    sizes: list[int] = []
                    placed[i].append((offset, crcs, sizes))
                    pieces = cell.slabs(slab) if isinstance(cell, SlabSource) else _file_slabs(cell, slab, _path)
                    for buf in pieces:
                        codec = codecs.get(i)
                        if codec is None:
                            codec = codecs[i] = self._codec(kind, src.dtype, buf)
                        if codec == "none":
                            # Slabs are whole blocks (but the last), so block CRCs line up with the chunk's.
                            crcs.extend(block_crcs(buf, self.block))
                            offset += len(buf)
                            yield as_view(buf)
                        else:
                            for stored, crc in encoded(self.pool, codec, buf.data, self.block, src.dtype):
                                crcs.append(crc)
                                sizes.append(len(stored))
                                offset += len(stored)
                                yield memoryview(stored)
                        if progress is not None:
                            progress(len(buf))

        size = 0
        if any(not isinstance(leaf, fmt.ValueLeaf) and leaf[2].nbytes for leaf in leaves):
            size = self.loc.storage.write(f"{self.root}/{dirname}/{file_name}", parts())
            self.needed.append(f"{self.root}/{dirname}/{file_name}")
            self.bytes_written += size
        files = (fmt.FileInfo(file_name, size),) if size else ()
        out: list[fmt.Leaf] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, fmt.ValueLeaf):
                out.append(leaf)
                continue
            kind, path, src, extra = leaf
            cells = placed.get(i) or [(0, [], [])]
            # one chunk, the whole array, unless the source brings its grid
            grid = src.grid if isinstance(src, Chunked) and placed.get(i) else tuple((0, n) for n in src.shape)
            codec = codecs.get(i) or self._codec(kind, src.dtype, np.empty(0, np.uint8))  # (an empty array)
            if codec != "none":
                codecs[i] = codec
            stored = tuple(tuple(sizes) for _, _, sizes in cells) if codec != "none" else ()
            out.append(fmt.ArrayLeaf(path=path, dtype=src.dtype, shape=src.shape, grid=grid,
                                     chunks=tuple((0, off) for off, _, _ in cells),
                                     crcs=tuple(tuple(crcs) for _, crcs, _ in cells), kind=kind, **extra,
                                     codec=codec, stored=stored))
        version = fmt.COMPRESSED_VERSION if codecs and set(codecs.values()) != {"none"} else fmt.FORMAT_VERSION
        # The manifest's: 5 where a leaf is "blosc2", 6 "blosc2-lz4" (docs/FORMAT.md §6.6); the index keeps its
        # layout's.
        self.version = max(self.version, fmt.codecs_version(codecs.values()), version)
        index = fmt.ItemIndex(structure, tuple(out), files, self.block, version=version)
        data = index.to_json(version)
        fmt.ItemIndex.from_json(data, f"{self.loc.path} [{name}]")  # never commit what cairn cannot read back
        self.loc.storage.put(f"{self.root}/{dirname}/{fmt.index_name(self.token)}", data)
        self.needed.append(f"{self.root}/{dirname}/{fmt.index_name(self.token)}")
        nbytes = sum(leaf.nbytes for leaf in out if isinstance(leaf, fmt.ArrayLeaf))
        self.items[name] = fmt.ItemInfo(dirname, fmt.index_name(self.token), nbytes, len(out))

    def _codec(self, kind: str, dtype: np.dtype, first: np.ndarray) -> str:
        """A leaf's codec, from the writer's setting and (for "choose") its first slab's bytes."""
        from .codecpolicy import stream_codec

        return stream_codec(self.compression, kind, dtype, first, self.loc.storage)

    def commit(self, root: bool, metadata: dict[str, Any], process_count: int = 1) -> None:
        """Put the manifest; `process_count`: the processes that saved the source (a copy keeps it)."""
        manifest = fmt.Manifest(items=self.items, root=root, process_count=process_count, cairn_version=__version__,
                                created_unix=time.time(), metadata=metadata).to_json(self.version)
        self.strategy.commit(self.loc, self.token, manifest, self.needed, overwrite=self.overwrite)

    def abort(self) -> None:
        self.strategy.abort(self.loc, self.token)
