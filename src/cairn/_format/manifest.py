"""The on-disk format: manifest and index dataclasses, JSON codecs (file names: `_names`, re-exported).

Pure: no I/O, no JAX. Everything read from a checkpoint passes through the
``*_from_json`` parsers here, which reject anything outside the spec in
``docs/FORMAT.md`` (unknown versions, out-of-range offsets, absurd sizes)
with `CorruptCheckpointError` before any memory is allocated for it.
"""

from __future__ import annotations

import json
import marshal
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._core.boxes import cell_box
from .._errors import CorruptCheckpointError, corrupt
from .binindex import (
    ChunkTable,
    LazyChunks,
    LazyCrcs,
    LazyStored,
    cell_bytes,
    parse_parts,
    raw_blocks,
    stored_bound,
)
from .names import TMP_MARK as TMP_MARK
from .names import data_file_name as data_file_name
from .names import index_name as index_name
from .names import item_dirname as item_dirname
from .names import num_blocks as num_blocks
from .names import partial_index_name as partial_index_name
from .names import tmp_dirname as tmp_dirname
from .partfile import PartInfo
from .runlength import bounds_from_runs, expand_writers, grid_runs
from .structure import check_structure
from .v1chunks import At, bounds, cell_sizes, parse_chunks
from .values import VALUE_KINDS, decode_value, dtype_from_name, dtype_name, encode_value

FORMAT_VERSION = 2  # what this cairn writes when no leaf is compressed
COMPRESSED_VERSION = 3  # what it writes when one is (docs/FORMAT.md §6.4)
INCREMENTAL_VERSION = 4  # what it writes with block hashes and references (docs/FORMAT.md §6.5)
# What a manifest says when some block of the checkpoint needs a reader that knows codec "blosc2" (§6.4)
# or sparse deltas (§6.5): a cairn that predates them then stops at the manifest with its version message
# (docs/FORMAT.md §6.6). Its indexes keep the version of their layout (3 or 4): 5 is a manifest version only.
NEWER_BLOCKS_VERSION = 5
#: ... and where some block is of codec "blosc2-lz4" (C-Blosc2 chunks with the bit shuffle, which a reader of
#: version 5 rejects as corrupt): version 6, a manifest version only too (docs/FORMAT.md §6.6).
BIT_SHUFFLE_VERSION = 6
#: The manifest version a block of each codec needs, where it needs more than its index's layout.
CODEC_VERSIONS = {"blosc2": NEWER_BLOCKS_VERSION, "blosc2-lz4": BIT_SHUFFLE_VERSION}
READ_VERSIONS = (1, 2, 3, 4, 5, 6)  # the manifests it reads (docs/FORMAT.md: version 1 is a subset of 2 but for the grid form)
INDEX_VERSIONS = (1, 2, 3, 4)  # the indexes it reads: an index's version names its layout
CODECS = ("none", "zstd", "planes", "blosc2", "blosc2-lz4")  # the block codecs of version 3 (`codecs`)
MANIFEST = "manifest.json"
INDEX = "index.json"
ROOT_ITEM_DIR = "%root"
DEFAULT_BLOCK_SIZE = 1 << 20

# Hard limits applied when parsing: a checkpoint outside them is rejected.
MAX_METADATA_BYTES = 1 << 30
MAX_NDIM = 64
MAX_ARRAY_BYTES = 1 << 56  # 64 PiB
MAX_FILE_BYTES = 1 << 56
MIN_BLOCK, MAX_BLOCK = 1 << 12, 1 << 30
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,200}$")


def codecs_version(codecs: Any) -> int:
    """The manifest version that blocks of `codecs` (names) need beyond their index's layout, 0 for none:
    5 for "blosc2", 6 for "blosc2-lz4" (docs/FORMAT.md §6.6)."""
    return max((CODEC_VERSIONS.get(c, 0) for c in codecs), default=0)


# --------------------------------------------------------------------------- helpers



def _req(d: Any, key: str, typ: type | tuple[type, ...], where: object) -> Any:
    if not isinstance(d, dict):
        raise corrupt(where, f"expected a JSON object, found {type(d).__name__}")
    if key not in d:
        raise corrupt(where, f"missing field {key!r}")
    v = d[key]
    if (typ is int and isinstance(v, bool)) or not isinstance(v, typ):
        raise corrupt(where, f"field {key!r} has type {type(v).__name__}")
    return v


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise corrupt(where, f"expected a finite number, found {v!r:.80}")
    return float(v)


def _int(v: Any, where: object, lo: int = 0, hi: int = MAX_FILE_BYTES) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise corrupt(where, f"expected an integer in [{lo}, {hi}], found {v!r}")
    return v


def unknown_version(what: str, version: int, known: Sequence[int], writer: object = None) -> str:
    """Why a manifest or index of `version` is refused. One newer than any this cairn knows was written by a
    newer cairn (`writer`: the manifest's `cairn_version`), so the message says to upgrade, not only refuse."""
    reads = f"this cairn reads {what} versions {', '.join(map(str, known))}"
    if version > max(known):
        by = f" ({writer})" if isinstance(writer, str) and writer else ""
        return (f"{what} version {version} is not supported: a newer cairn{by} wrote it, and {reads}; "
                "upgrade cairn to read it")
    return f"{what} version {version} is not supported ({reads})"


def parse_json(data: bytes, where: str) -> Any:
    if len(data) > MAX_METADATA_BYTES:
        raise corrupt(where, f"metadata file of {len(data)} bytes exceeds the limit")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise corrupt(where, f"not valid JSON ({e})") from None


def dump_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


# The manifest and every index start with this field: the CRC-32C of all the
# bytes after the 21-byte prefix ``{"crc32c":"xxxxxxxx",``. JSON has no
# checksum of its own, and a flipped digit in an inline value, a file size or
# the user's metadata would otherwise load as a silently different value.
_CHECK_HEAD, _CHECK_LEN = b'{"crc32c":"', 21


def dump_checked_json(obj: dict[str, Any]) -> bytes:
    """`dump_json` of a non-empty object, led by the checksum of the rest of its bytes."""
    from .._core.checksum import crc32c

    rest = dump_json(obj)[1:]
    return b'%s%08x",%s' % (_CHECK_HEAD, crc32c(rest), rest)


def parse_checked_json(data: bytes, where: str) -> Any:
    """`parse_json`, after verifying the leading checksum field (which is required)."""
    from .._core.checksum import crc32c

    stored = data[len(_CHECK_HEAD) : _CHECK_LEN - 2]
    if (
        not data.startswith(_CHECK_HEAD)
        or data[_CHECK_LEN - 2 : _CHECK_LEN] != b'",'
        or not re.fullmatch(rb"[0-9a-f]{8}", stored)
    ):
        raise corrupt(where, 'does not start with its checksum field {"crc32c":"<8 hex digits>",')
    computed = crc32c(memoryview(data)[_CHECK_LEN:])
    if int(stored, 16) != computed:
        raise corrupt(where, f"checksum mismatch: stored {stored.decode()}, computed {computed:08x}")
    return parse_json(data, where)


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class ItemInfo:
    dir: str  # folder of the checkpointable, relative to the checkpoint
    index: str  # name of its index file inside that folder
    nbytes: int
    num_leaves: int
    kind: str = "pytree"


@dataclass(frozen=True)
class Manifest:
    """Top-level description of one checkpoint: which checkpointables it holds."""

    items: dict[str, ItemInfo]
    root: bool = False  # the state was not a mapping: one item, named ""
    process_count: int = 1
    cairn_version: str = ""
    created_unix: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION  # the format version it was read as (written: the version the save chose, docs/FORMAT.md §6.6)
    # Version 4: the sibling checkpoints whose data files this one's indexes refer to (§6.5).
    bases: tuple[str, ...] = ()

    def to_json(self, version: int = FORMAT_VERSION) -> bytes:
        return dump_checked_json(
            {
                "format": "cairn",
                "version": version,
                "cairn_version": self.cairn_version,
                "created_unix": self.created_unix,
                "process_count": self.process_count,
                "root": self.root,
                "items": {
                    k: {"dir": v.dir, "index": v.index, "kind": v.kind, "nbytes": v.nbytes,
                        "num_leaves": v.num_leaves}
                    for k, v in self.items.items()
                },
                "metadata": self.metadata,
                **({"bases": list(self.bases)} if version >= INCREMENTAL_VERSION else {}),
            }
        )

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        d = parse_checked_json(data, where)
        if _req(d, "format", str, where) != "cairn":
            raise corrupt(where, "not a cairn manifest")
        version = _req(d, "version", int, where)
        if version not in READ_VERSIONS:
            raise corrupt(where, unknown_version("format", version, READ_VERSIONS, d.get("cairn_version")))
        items = {}
        for name, v in _req(d, "items", dict, where).items():
            w = f"{where}: item {name!r}"
            dirname = _req(v, "dir", str, w)
            if dirname != item_dirname(name) and not (name == "" and dirname == ROOT_ITEM_DIR):
                raise corrupt(w, f"folder {dirname!r} does not match the item name")
            kind = _req(v, "kind", str, w)
            if kind != "pytree":
                raise corrupt(w, f"unknown item kind {kind!r}")
            index = _req(v, "index", str, w)
            if not _FILE_NAME.match(index):
                raise corrupt(w, f"bad index file name {index!r}")
            items[name] = ItemInfo(
                dirname, index, _int(_req(v, "nbytes", int, w), w), _int(_req(v, "num_leaves", int, w), w), kind
            )
        root = bool(d.get("root", False))
        if root and list(items) != [""]:
            raise corrupt(where, "a root checkpoint must hold exactly one item")
        meta = d.get("metadata", {})
        if not isinstance(meta, dict):
            raise corrupt(where, "metadata must be an object")
        bases: tuple[str, ...] = ()
        if version >= INCREMENTAL_VERSION:
            raw_bases = d.get("bases", [])
            if not isinstance(raw_bases, list) or any(not isinstance(b, str) or not _FILE_NAME.match(b)
                                                      for b in raw_bases):
                raise corrupt(where, "'bases' must be a list of sibling checkpoint names")
            bases = tuple(raw_bases)
        return cls(
            items=items,
            root=root,
            process_count=_int(d.get("process_count", 1), where, 1, 1 << 24),
            cairn_version=str(d.get("cairn_version", "")),
            created_unix=_number(d.get("created_unix", 0.0), f"{where}: created_unix"),
            metadata=meta,
            version=version,
            bases=bases,
        )


# --------------------------------------------------------------------------- item index


@dataclass(frozen=True)
class FileInfo:
    name: str
    size: int
    base: str | None = None  # version 4: the sibling checkpoint whose item folder holds it (§6.5)


@dataclass(frozen=True)
class ArrayLeaf:
    """A stored array: a regular grid of chunks, each a C-order run of bytes in a file."""

    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]  # per axis: boundaries 0 = b0 < b1 < ... = shape[axis]
    # Per grid cell in C order: (file, offset), and the CRC-32C of each block_size piece of the chunk.
    # Tuples for an explicit chunk table; `LazyChunks`/`LazyCrcs` over the item's binary index parts.
    chunks: Sequence[tuple[int, int]]
    crcs: Sequence[tuple[int, ...]] = ()
    kind: str = "array"  # "array" | "bytes" | "object" | "prng_key"
    sharding: dict[str, Any] | None = None
    handler: str | None = None  # for kind "object": the registered handler's name
    impl: str | None = None  # for kind "prng_key": the JAX key implementation ("threefry2x32", ...)
    impl_shape: tuple[int, ...] = ()  # for kind "prng_key": the trailing data dimensions of one key
    writers: Any = None  # version 2, part-indexed: the cells' writers as runs (docs/FORMAT.md §5.2)
    codec: str = "none"  # version 3: how each block is stored (`codecs`)
    # Version 3, a compressed leaf: per grid cell, each block's stored size (tuples, or `LazyStored`).
    stored: Sequence[tuple[int, ...]] = ()
    refs: bool = False  # version 4: some blocks are references to a base checkpoint's (§6.5)

    @property
    def part_table(self) -> tuple[ChunkTable, int] | None:
        """The item's binary part table and this leaf's number in it, where the leaf is indexed there
        (version 2 on: `LazyChunks`); None for an explicit chunk list."""
        chunks = self.chunks
        return (chunks.table, chunks.leaf) if isinstance(chunks, LazyChunks) else None

    def parts(self) -> tuple[ChunkTable, int]:
        """`part_table` of a leaf that must have one (a version-4 ``refs`` leaf: the parser checks)."""
        got = self.part_table
        if got is None:
            raise CorruptCheckpointError(f"leaf {self.path!r} has references but no binary part table")
        return got

    def stored_sizes(self, cell: int, block: int) -> tuple[int, ...]:
        """Each checksum block's stored size in chunk `cell` (the raw sizes for codec "none")."""
        if self.codec == "none":
            return tuple(raw_blocks(self.chunk_nbytes(cell), block))
        return tuple(self.stored[cell])

    @property
    def key_shape(self) -> tuple[int, ...]:
        """The shape of the stored array as the user saw it: a key array's without its key-data dimensions."""
        return self.shape[: len(self.shape) - len(self.impl_shape)]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def grid_shape(self) -> tuple[int, ...]:
        return tuple(len(b) - 1 for b in self.grid)

    def chunk_box(self, flat: int) -> tuple[tuple[int, int], ...]:
        return cell_box(self.grid, flat)

    def chunk_nbytes(self, flat: int) -> int:
        return math.prod(hi - lo for lo, hi in self.chunk_box(flat)) * self.dtype.itemsize

    @classmethod
    def _parsed(cls, path: str, dtype: np.dtype, shape: tuple[int, ...], grid: tuple[tuple[int, ...], ...],
                chunks: Sequence[tuple[int, int]], crcs: Sequence[tuple[int, ...]], kind: str,
                sharding: dict[str, Any] | None, handler: str | None, writers: Any, codec: str = "none",
                stored: Sequence[tuple[int, ...]] = (), refs: bool = False) -> ArrayLeaf:
        """A leaf from checked parts, as the constructor builds it, without its per-field
        ``object.__setattr__`` (a frozen dataclass's ``__init__`` pays ~0.3 µs per field:
        about a quarter of parsing a leaf of a tree of thousands)."""
        leaf = object.__new__(cls)
        leaf.__dict__.update(path=path, dtype=dtype, shape=shape, grid=grid, chunks=chunks, crcs=crcs, kind=kind,
                             sharding=sharding, handler=handler, impl=None, impl_shape=(), writers=writers,
                             codec=codec, stored=stored, refs=refs)
        return leaf


@dataclass(frozen=True)
class ValueLeaf:
    """A value stored inline in the index: None, bool, int, float, complex, str, numpy scalar."""

    path: str
    kind: str
    value: Any  # the decoded Python/numpy value


Leaf = ArrayLeaf | ValueLeaf
ARRAY_KINDS = ("array", "bytes", "object", "prng_key")


@dataclass(frozen=True)
class ItemIndex:
    """Everything needed to read one checkpointable: its tree, leaves and files."""

    structure: Any
    leaves: tuple[Leaf, ...]
    files: tuple[FileInfo, ...]
    block_size: int = DEFAULT_BLOCK_SIZE
    # Version 2: the per-process binary parts holding the chunk records of part-indexed leaves.
    parts: tuple[PartInfo, ...] = ()
    processes: int = 1
    table: ChunkTable | None = None  # set when read; fetches records from the parts
    version: int = FORMAT_VERSION

    def to_json(self, version: int = FORMAT_VERSION, explicit: bool = False) -> bytes:
        """The index file; `version` 1 (or `explicit`) writes every chunk explicitly (the parts are then
        not needed)."""
        d: dict[str, Any] = {
            "format": "cairn-index",
            "version": version,
            "block_size": self.block_size,
            "files": [{"name": f.name, "size": f.size, **({"base": f.base} if f.base is not None else {})}
                      for f in self.files],
        }
        if self.parts and version >= 2 and not explicit:
            d["processes"] = self.processes
            d["parts"] = [{"name": p.name, "process": p.process, "records": p.records, "crcs": p.crcs,
                           "file_base": p.file_base, "files": p.files} for p in self.parts]
        d["structure"] = self.structure
        d["leaves"] = [_leaf_to_json(leaf, version, explicit) for leaf in self.leaves]
        return dump_checked_json(d)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> ItemIndex:
        d = parse_checked_json(data, where)
        if _req(d, "format", str, where) != "cairn-index":
            raise corrupt(where, "not a cairn item index")
        version = _req(d, "version", int, where)
        if version not in INDEX_VERSIONS:
            raise corrupt(where, unknown_version("index", version, INDEX_VERSIONS))
        block = _int(_req(d, "block_size", int, where), where, MIN_BLOCK, MAX_BLOCK)
        files = []
        names = set()
        for i, f in enumerate(_req(d, "files", list, where)):
            w = f"{where}: files[{i}]"
            name = _req(f, "name", str, w)
            base = f.get("base") if version >= INCREMENTAL_VERSION else None
            if base is not None and (not isinstance(base, str) or not _FILE_NAME.match(base)):
                raise corrupt(w, f"bad base checkpoint name {base!r:.80}")
            # Several processes may refer to one file of a base: only the item's own files are unique.
            if not _FILE_NAME.match(name) or (base is None and name in names):
                raise corrupt(w, f"bad or repeated data file name {name!r}")
            if base is None:
                names.add(name)
            files.append(FileInfo(name, _int(_req(f, "size", int, w), w), base))
        raw_leaves = _req(d, "leaves", list, where)
        table = parse_parts(d, [f.size for f in files], where, version) if version >= 2 else None
        layouts: dict[Any, _Layout] = {}
        leaves = tuple(
            _leaf_from_json(x, files, block, At(where, i), version, table, i, layouts)
            for i, x in enumerate(raw_leaves)
        )
        paths = [leaf.path for leaf in leaves]
        if len(set(paths)) != len(paths):
            raise corrupt(where, "repeated leaf key paths")
        structure = d.get("structure")
        check_structure(structure, len(leaves), where)
        return cls(structure=structure, leaves=leaves, files=tuple(files), block_size=block,
                   parts=tuple(table.parts.values()) if table else (), processes=table.processes if table else 1,
                   table=table if table and table.leaves else None, version=version)


def _leaf_to_json(leaf: Leaf, version: int = 1, explicit: bool = False) -> dict[str, Any]:
    if isinstance(leaf, ArrayLeaf):
        out: dict[str, Any] = {
            "path": leaf.path,
            "kind": leaf.kind,
            "dtype": dtype_name(leaf.dtype),
            "shape": list(leaf.shape),
            "grid": [list(b) for b in leaf.grid] if version < 2 else [grid_runs(b) for b in leaf.grid],
        }
        if leaf.codec != "none":
            out["codec"] = leaf.codec
        if leaf.refs and version >= INCREMENTAL_VERSION:
            out["refs"] = True
        if leaf.writers is not None and version >= 2 and not explicit:
            out["writers"] = leaf.writers
        else:
            out["chunks"] = [[f, o, *c] for (f, o), c in zip(leaf.chunks, leaf.crcs)]
            if leaf.codec != "none":
                out["stored"] = [list(x) for x in leaf.stored]
        if leaf.sharding is not None:
            out["sharding"] = leaf.sharding
        if leaf.handler is not None:
            out["handler"] = leaf.handler
        if leaf.impl is not None:
            out["impl"] = leaf.impl
            out["impl_shape"] = list(leaf.impl_shape)
        return out
    return {"path": leaf.path, "kind": leaf.kind, "value": encode_value(leaf.kind, leaf.value)}


def _leaf_from_json(x: Any, files: list[FileInfo], block: int, at: At, version: int = 1,
                    table: ChunkTable | None = None, number: int = 0,
                    layouts: dict[Any, _Layout] | None = None) -> Leaf:
    """Leaf `number` of an index; `layouts` memoises, for one index, the checked layouts of its leaves."""
    path = _req(x, "path", str, at)
    where = At(at.base, at.i, path)
    kind = _req(x, "kind", str, where)
    if kind in ARRAY_KINDS:
        layout = _layout(x, files, block, where, version, table, layouts)
        dtype, shape, grid = layout.dtype, layout.shape, layout.grid
        handler = x["handler"] if isinstance(x.get("handler"), str) else None
        codec = "none"
        if version >= 3 and "codec" in x:
            codec = x["codec"]
            if codec not in CODECS:
                raise corrupt(where, f"unknown codec {codec!r:.80} (known: {', '.join(CODECS)})")
        chunks: Sequence[tuple[int, int]]
        crcs: Sequence[tuple[int, ...]]
        stored: Sequence[tuple[int, ...]] = ()
        if layout.writers is not None:
            assert table is not None and layout.sizes is not None
            table.add_leaf(number, layout.writers, layout.sizes, block, codec)
            chunks, crcs = LazyChunks(table, number, layout.n_chunks), LazyCrcs(table, number, layout.n_chunks)
            if codec != "none":
                stored = LazyStored(table, number, layout.n_chunks)
        else:
            chunks_raw = _req(x, "chunks", list, where)
            if len(chunks_raw) != layout.n_chunks:
                raise corrupt(where, f"{len(chunks_raw)} chunks for a grid of {layout.n_chunks} cells")
            sizes = cell_sizes(grid, dtype.itemsize)
            file_sizes = [f.size for f in files]
            if codec == "none":
                chunks, crcs = parse_chunks(chunks_raw, sizes, file_sizes, block, where)
            else:  # the range check is on the stored sizes, below
                chunks, crcs = parse_chunks(chunks_raw, sizes, [MAX_FILE_BYTES] * len(files), block, where)
                stored = _stored_sizes(x, sizes, chunks, file_sizes, block, where)
        if kind in ("bytes", "object") and (len(shape) != 1 or dtype != np.uint8):
            raise corrupt(where, f"a {kind} leaf must be a 1-D uint8 array")
        if kind == "object" and handler is None:
            raise corrupt(where, "an object leaf must name its handler")
        refs = version >= INCREMENTAL_VERSION and x.get("refs") is True
        if refs and layout.writers is None:
            raise corrupt(where, "a leaf with references must list its chunks in the binary parts")
        leaf = ArrayLeaf._parsed(path, dtype, shape, grid, chunks, crcs, kind,
                                 x["sharding"] if isinstance(x.get("sharding"), dict) else None, handler,
                                 x["writers"] if layout.writers is not None else None, codec, stored, refs)
        if kind == "prng_key":
            leaf = _key_fields(x, leaf, where)
        return leaf
    if kind in VALUE_KINDS:
        if "value" not in x:
            raise corrupt(where, "missing field 'value'")
        return ValueLeaf(path, kind, decode_value(kind, x["value"], where))
    raise corrupt(where, f"unknown leaf kind {kind!r}")


def _stored_sizes(x: dict[str, Any], sizes: list[int], chunks: Sequence[tuple[int, int]], file_sizes: list[int],
                  block: int, where: object) -> tuple[tuple[int, ...], ...]:
    """A compressed explicit-chunk leaf's ``stored`` list (per chunk, each block's stored size), checked:
    one size per block, each within what its codec can store of its raw block, and every chunk's
    stored bytes inside its data file."""
    raw = x.get("stored")
    if type(raw) is not list or len(raw) != len(sizes):
        raise corrupt(where, "a compressed leaf needs 'stored': one list of block sizes per chunk")
    out = []
    for i, (st, size, (fi, off)) in enumerate(zip(raw, sizes, chunks)):
        raws = raw_blocks(size, block)
        if type(st) is not list or len(st) != len(raws):
            raise corrupt(where, f"chunk {i} has {len(st) if type(st) is list else 'no'} stored sizes for "
                                 f"{len(raws)} blocks")
        for v, r in zip(st, raws):
            if type(v) is not int or not 0 <= v <= stored_bound(r):
                raise corrupt(where, f"chunk {i} has a bad stored block size {v!r:.40}")
        total = sum(st)
        if size and (not file_sizes or off + total > file_sizes[fi]):
            raise corrupt(where, f"chunk {i} (stored bytes {off}..{off + total}) lies outside its data file")
        out.append(tuple(st))
    return tuple(out)


@dataclass(frozen=True)
class _Layout:
    """What an array leaf's dtype, shape, grid and writer runs say, checked (`_layout`)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    grid: tuple[tuple[int, ...], ...]
    n_chunks: int
    writers: np.ndarray | None  # per cell, for a part-indexed leaf of version 2
    sizes: np.ndarray | None  # bytes per cell, likewise


def _layout(x: dict[str, Any], files: list[FileInfo], block: int, where: At, version: int,
            table: ChunkTable | None, layouts: dict[Any, _Layout] | None) -> _Layout:
    """The checked layout of array leaf `x`, memoised in `layouts` by the JSON values it comes from.

    The leaves of a model repeat a few layouts (every layer's weights alike),
    so an index of thousands of leaves checks each distinct one once. The key
    is the very JSON values the checks read, marshalled: equal bytes mean equal
    values of equal types (``1``, ``1.0`` and ``true`` differ, as the checks
    want), hence equal outcomes; a failing layout is never stored. (marshal
    is ~3x faster than `repr` on these nested lists.)
    """
    key = None
    if layouts is not None and version >= 2 and "writers" in x:
        key = marshal.dumps((x.get("dtype"), x.get("shape"), x.get("grid"), x["writers"]))
        hit = layouts.get(key)
        if hit is not None:
            return hit
    dtype = dtype_from_name(x.get("dtype"), At(where.base, where.i, where.path, ": "))
    shape = _ints(_req(x, "shape", list, where), MAX_ARRAY_BYTES, where)
    if len(shape) > MAX_NDIM:
        raise corrupt(where, f"{len(shape)} dimensions exceed the limit of {MAX_NDIM}")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_ARRAY_BYTES:
        raise corrupt(where, f"array of {nbytes} bytes exceeds the limit")
    grid_raw = _req(x, "grid", list, where)
    if len(grid_raw) != len(shape):
        raise corrupt(where, "grid rank differs from the shape's")
    if version < 2:
        grid = tuple(bounds(b, a, shape[a], where) for a, b in enumerate(grid_raw))
    else:
        grid = tuple(bounds_from_runs(b, shape[a], a, where) for a, b in enumerate(grid_raw))
    n_chunks = math.prod(len(b) - 1 for b in grid)
    writers = sizes = None
    runs = x.get("writers") if version >= 2 else None
    if runs is not None:
        assert table is not None
        writers = expand_writers(runs, n_chunks, table.processes, where)
        sizes = cell_bytes(grid, dtype.itemsize)
    out = _Layout(dtype, shape, grid, n_chunks, writers, sizes)
    if key is not None and layouts is not None:
        layouts[key] = out
    return out


def _key_fields(x: dict[str, Any], leaf: ArrayLeaf, where: object) -> ArrayLeaf:
    """A prng_key leaf's `impl` and `impl_shape`, checked against its uint32 data."""
    impl, impl_shape = x.get("impl"), x.get("impl_shape")
    if not isinstance(impl, str) or not impl or len(impl) > 200:
        raise corrupt(where, "a prng_key leaf must name its key implementation in 'impl'")
    if not isinstance(impl_shape, list) or any(type(n) is not int or n < 1 for n in impl_shape):
        raise corrupt(where, "a prng_key leaf needs 'impl_shape', a list of positive integers")
    n = len(impl_shape)
    if leaf.dtype != np.dtype("uint32") or n > len(leaf.shape) or list(leaf.shape[len(leaf.shape) - n:]) != impl_shape:
        raise corrupt(where, f"a prng_key leaf must be uint32 data whose shape ends with impl_shape {impl_shape}")
    return ArrayLeaf(**{**leaf.__dict__, "impl": impl, "impl_shape": tuple(impl_shape)})


def _ints(v: list[Any], hi: int, where: object) -> tuple[int, ...]:
    for i in v:
        if type(i) is not int or not 0 <= i <= hi:
            raise corrupt(where, f"expected an integer in [0, {hi}], found {i!r}")
    return tuple(v)
