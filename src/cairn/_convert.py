"""Streaming conversion: cairn <-> safetensors, cairn -> PyTorch state-dict files.

Every conversion moves one bounded slab of one array at a time: arrays are
read (from cairn: through the load planner, with checksums verified; from
safetensors: by ranged reads) in C-order slabs of at most a third of the
memory budget, and each slab is written out before the next is read. So the
whole state is never in memory, whatever its size.

A cairn checkpoint holds more than tensors (the tree's containers, ints,
strings, bytes), which safetensors cannot. Converting to safetensors records
all of that as JSON under the header's ``__metadata__["cairn"]``, so that
converting back rebuilds the checkpoint exactly; a safetensors file without
it (from another tool) becomes a checkpoint holding one flat dict.
"""

from __future__ import annotations

import collections
import json
import math
import os
import secrets
import struct
import time
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _format as fmt
from ._checksum import crc32c
from ._errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    UnsupportedTypeError,
)
from ._load import LoadStats, _Reader, read_index, read_manifest
from ._location import Location, resolve
from ._plan import Box, plan_reads
from ._tree import display_path, escape_key, unescape_key

DEFAULT_BUDGET = 256 << 20
ST_METADATA_KEY = "cairn"
ST_FORMAT = "cairn-safetensors"
MAX_ST_HEADER = 100 << 20  # what the safetensors reference implementation accepts

# cairn dtype name -> safetensors dtype name (the subset safetensors can hold).
_TO_ST = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32",
    "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16",
    "float32": "F32", "float64": "F64", "complex64": "C64", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}
_FROM_ST = {v: k for k, v in _TO_ST.items()}


# ---------------------------------------------------------------------- reading cairn


@dataclass
class Opened:
    """A committed checkpoint with its manifest and every index read (no array data)."""

    loc: Location
    manifest: fmt.Manifest
    indexes: dict[str, fmt.ItemIndex]


def open_checkpoint(path: str | os.PathLike[str], storage_options: dict | None = None) -> Opened:
    loc = resolve(path, storage_options)
    manifest = read_manifest(loc)
    return Opened(loc, manifest, {name: read_index(loc, info) for name, info in manifest.items.items()})


def make_reader(ck: Opened, item: str, pool: ThreadPoolExecutor, stats: LoadStats | None = None) -> _Reader:
    """The load engine's reader for one checkpointable (all reads verify their checksums)."""
    return _Reader(ck.loc, item, ck.manifest.items[item], ck.indexes[item], True, pool, stats or LoadStats())


def slab_boxes(shape: tuple[int, ...], itemsize: int, max_bytes: int) -> Iterator[Box]:
    """Boxes that tile `shape` in C order, each a contiguous run of at most `max_bytes`.

    A box fixes single indices on the leading axes, takes a range of the
    next one, and all of the trailing ones; the smallest array piece it can
    be is one element.
    """
    if any(s == 0 for s in shape):
        return
    if not shape:
        yield ()
        return
    # The first axis whose trailing block fits: slabs are ranges along it.
    axis, inner = len(shape) - 1, itemsize
    for a in range(len(shape)):
        tail = math.prod(shape[a + 1 :]) * itemsize
        if tail <= max_bytes:
            axis, inner = a, tail
            break
    step = max(1, max_bytes // inner)
    for prefix in np.ndindex(*shape[:axis]):
        for lo in range(0, shape[axis], step):
            hi = min(lo + step, shape[axis])
            lead = tuple((int(i), int(i) + 1) for i in prefix)
            yield (*lead, (lo, hi), *((0, n) for n in shape[axis + 1 :]))


def read_box(reader: _Reader, leaf: fmt.ArrayLeaf, box: Box, pool: ThreadPoolExecutor, verify: bool = True) -> np.ndarray:
    """Read one box of a stored array into a new numpy array (checksums verified)."""
    dest = np.empty(tuple(hi - lo for lo, hi in box), dtype=leaf.dtype)
    reads = plan_reads(leaf, [box], reader.index.block_size, verify)
    for f in [pool.submit(reader.do_read, r, leaf, [dest]) for r in reads]:
        f.result()
    return dest


def iter_array(reader: _Reader, leaf: fmt.ArrayLeaf, max_bytes: int, pool: ThreadPoolExecutor) -> Iterator[np.ndarray]:
    """A stored array's values, as C-order slabs of at most `max_bytes` each."""
    for box in slab_boxes(leaf.shape, leaf.dtype.itemsize, max_bytes):
        yield read_box(reader, leaf, box, pool)


def _slab_bytes(budget: int, block: int = fmt.DEFAULT_BLOCK_SIZE) -> int:
    # Up to three slabs can be alive at once: the one being written (a
    # storage backend may hold it until it asks for the next), the one being
    # read, and the temporary buffers of reads that cannot land in place. A
    # quarter of the budget each leaves room for everything else.
    return max(block, budget // 4 // block * block)


# ---------------------------------------------------------------------- safetensors header


def _flat_name(item: str, path: str, root: bool, per_item: bool) -> str:
    if root or per_item:
        return path or "%root"
    return f"{escape_key(item)}/{path}" if path else escape_key(item)


def parse_safetensors_header(head: bytes, size: int, where: str) -> tuple[dict[str, Any], dict[str, str], int]:
    """Validate a safetensors header; returns (tensors, metadata, data start offset)."""
    if len(head) < 8:
        raise CorruptCheckpointError(f"{where}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_ST_HEADER or 8 + n > size:
        raise CorruptCheckpointError(f"{where}: safetensors header of {n} bytes is too large or truncated")
    try:
        header = json.loads(head[8 : 8 + n])
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(f"{where}: safetensors __metadata__ must map strings to strings")
    data_size = size - 8 - n
    for name, t in header.items():
        ok = (
            isinstance(t, dict) and t.get("dtype") in _FROM_ST and isinstance(t.get("shape"), list)
            and all(isinstance(s, int) and s >= 0 for s in t["shape"])
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
        )
        if not ok:
            raise CorruptCheckpointError(f"{where}: tensor {name!r}: malformed or unsupported entry {t!r:.200}")
        lo, hi = t["data_offsets"]
        nbytes = math.prod(t["shape"]) * fmt.dtype_from_name(_FROM_ST[t["dtype"]]).itemsize
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= data_size and hi - lo == nbytes):
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r}: data_offsets {[lo, hi]} do not fit its shape and the file"
            )
    return header, meta, 8 + n


def _st_header(entries: list[tuple[str, str, tuple[int, ...], int]], meta: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": meta}
    off = 0
    for name, st_dtype, shape, nbytes in entries:
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keeps the tensor data 8-byte aligned, as the reference writer does
    return struct.pack("<Q", len(raw)) + raw


# ---------------------------------------------------------------------- cairn -> safetensors


def _item_meta(index: fmt.ItemIndex, names: list[str | None]) -> dict[str, Any]:
    leaves = []
    for leaf, name in zip(index.leaves, names):
        if isinstance(leaf, fmt.ArrayLeaf):
            e: dict[str, Any] = {"path": leaf.path, "kind": leaf.kind, "tensor": name}
            if leaf.handler is not None:
                e["handler"] = leaf.handler
        else:
            e = {"path": leaf.path, "kind": leaf.kind, "value": fmt.encode_value(leaf.kind, leaf.value)}
        leaves.append(e)
    return {"structure": index.structure, "leaves": leaves}


def to_safetensors(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    per_item: bool = False,
    budget_bytes: int = DEFAULT_BUDGET,
    threads: int = 4,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Write checkpoint `src` as one safetensors file `dst` (or, with `per_item`, a
    folder `dst` holding ``<checkpointable>.safetensors`` files); returns the files written.
    """
    ck = open_checkpoint(src, storage_options)
    root = ck.manifest.root
    groups = [[n] for n in ck.manifest.items] if per_item and not root else [list(ck.manifest.items)]
    out_loc = resolve(dst, storage_options)
    written = []
    slab = _slab_bytes(budget_bytes)
    for group in groups:
        if per_item and not root:
            key = out_loc.key(fmt.item_dirname(group[0]) + ".safetensors")
        else:
            key = out_loc.name
        entries, plan, items_meta = [], [], {}
        for item in group:
            index = ck.indexes[item]
            names: list[str | None] = []
            for leaf in index.leaves:
                if not isinstance(leaf, fmt.ArrayLeaf):
                    names.append(None)
                    continue
                st = _TO_ST.get(fmt.dtype_name(leaf.dtype) or "")
                if st is None:
                    raise UnsupportedTypeError(
                        f"{ck.loc.path} [{item}]: leaf {display_path(leaf.path)!r} has dtype {leaf.dtype}, "
                        "which safetensors cannot hold"
                    )
                name = _flat_name(item, leaf.path, root, per_item)
                names.append(name)
                entries.append((name, st, leaf.shape, leaf.nbytes))
                plan.append((item, leaf))
            items_meta[item] = _item_meta(index, names)
        if len({e[0] for e in entries}) != len(entries):
            raise CheckpointError(f"{ck.loc.path}: two leaves map to the same safetensors tensor name")
        cmeta = {"format": ST_FORMAT, "version": fmt.FORMAT_VERSION, "root": root,
                 "metadata": ck.manifest.metadata, "items": items_meta}
        header = _st_header(entries, {ST_METADATA_KEY: json.dumps(cmeta, separators=(",", ":"))})
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="cairn-convert") as pool:
            readers = {i: make_reader(ck, i, pool) for i in group}
            try:
                _write_file(out_loc, key, _st_parts(header, plan, readers, slab, pool, progress))
            finally:
                for r in readers.values():
                    r.close()
        written.append(out_loc.storage.describe(key))
    return written


def _st_parts(header: bytes, plan: list[tuple[str, fmt.ArrayLeaf]], readers: dict[str, _Reader], slab: int,
              pool: ThreadPoolExecutor, progress: Callable[[int], None] | None) -> Iterator[Any]:
    yield header
    for item, leaf in plan:
        for arr in iter_array(readers[item], leaf, slab, pool):
            n = arr.nbytes
            yield memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
            del arr  # not alive while the next slab is read
            if progress is not None:
                progress(n)


def _write_file(loc: Location, key: str, parts: Iterator[Any]) -> None:
    """Stream a file into place; on local disk it appears only once complete."""
    storage = loc.storage
    if storage.atomic_rename:
        tmp = f"{key}.cairn-tmp-{secrets.token_hex(4)}"
        try:
            storage.write(tmp, parts)
            os.replace(storage.describe(tmp), storage.describe(key))
        finally:
            storage.delete_prefix(tmp)
    else:
        storage.write(key, parts)


# ---------------------------------------------------------------------- safetensors -> cairn


@dataclass
class _SrcTensor:
    storage: Any
    key: str
    start: int  # absolute file offset of the tensor's bytes
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _open_safetensors(loc: Location, key: str) -> tuple[dict[str, _SrcTensor], dict[str, str]]:
    storage = loc.storage
    where = storage.describe(key)
    try:
        size = storage.size(key)
        reader = storage.open_read(key)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise CheckpointError(f"no safetensors file at {where}") from None
    try:
        first = bytearray(8)
        reader.read_into(0, memoryview(first))
        (n,) = struct.unpack("<Q", first)
        if n > MAX_ST_HEADER or 8 + n > size:
            raise CorruptCheckpointError(f"{where}: safetensors header of {n} bytes is too large or truncated")
        head = bytearray(8 + n)
        reader.read_into(0, memoryview(head))
    except EOFError:
        raise CorruptCheckpointError(f"{where}: truncated safetensors file") from None
    finally:
        reader.close()
    header, meta, data_start = parse_safetensors_header(bytes(head), size, where)
    tensors = {
        name: _SrcTensor(storage, key, data_start + t["data_offsets"][0],
                         fmt.dtype_from_name(_FROM_ST[t["dtype"]]), tuple(t["shape"]))
        for name, t in header.items()
    }
    return tensors, meta


def _items_from_safetensors(tensors: dict[str, _SrcTensor], meta: dict[str, str], where: str, fallback: str | None):
    """(root, user metadata, {item: (structure, [leaf specs])}) described by one file."""
    raw = meta.get(ST_METADATA_KEY)
    if raw is None:
        # A plain safetensors file: one flat dict, tensor name -> array.
        names = list(tensors)
        structure = {"dict": [[n, {"leaf": i}] for i, n in enumerate(names)]} if names else {"dict": []}
        flat: list[Any] = [("array", escape_key(n), tensors[n], None) for n in names]
        return fallback is None, {}, {fallback or "": (structure, flat)}
    try:
        cm = json.loads(raw)
        if cm.get("format") != ST_FORMAT or cm.get("version") != fmt.FORMAT_VERSION:
            raise ValueError(f"unknown format {cm.get('format')!r} version {cm.get('version')!r}")
        items = {}
        for item, d in cm["items"].items():
            leaves: list[Any] = []
            for e in d["leaves"]:
                if "tensor" in e:
                    if e["tensor"] not in tensors:
                        raise ValueError(f"tensor {e['tensor']!r} named by the metadata is missing")
                    leaves.append((e["kind"], e["path"], tensors[e["tensor"]], e.get("handler")))
                else:
                    leaves.append(fmt.ValueLeaf(e["path"], e["kind"], fmt.decode_value(e["kind"], e["value"], where)))
            items[item] = (d["structure"], leaves)
        return bool(cm.get("root")), cm.get("metadata") or {}, items
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{where}: bad cairn metadata in the safetensors header ({e})") from None


def from_safetensors(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    budget_bytes: int = DEFAULT_BUDGET,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Build checkpoint `dst` from a safetensors file, or a folder of them (one per checkpointable)."""
    src_loc = resolve(src, storage_options)
    st = src_loc.storage
    if st.exists(src_loc.name) and st.list(src_loc.name):
        keys = [src_loc.key(n) for n in st.list_dir(src_loc.name) if n.endswith(".safetensors")]
        if not keys:
            raise CheckpointError(f"{src_loc.path} is a folder with no .safetensors files")
        per_file = True
    else:
        keys, per_file = [src_loc.name], False
    root = False
    metadata: dict[str, Any] = {}
    items: dict[str, Any] = {}
    for key in keys:
        tensors, meta = _open_safetensors(src_loc, key)
        stem = key.rsplit("/", 1)[-1][: -len(".safetensors")] if per_file else None
        if stem is not None:
            stem = _unescape_item(stem)
        r, m, its = _items_from_safetensors(tensors, meta, st.describe(key), stem)
        root, metadata = root or r, {**metadata, **m}
        for name in its:
            if name in items:
                raise CheckpointError(f"{src_loc.path}: checkpointable {name!r} appears in two files")
        items.update(its)
    if root and list(items) != [""]:
        raise CheckpointError(f"{src_loc.path}: a root checkpoint must come from exactly one file")
    writer = StreamWriter(resolve(dst, storage_options), fmt.DEFAULT_BLOCK_SIZE)
    slab = _slab_bytes(budget_bytes)
    try:
        for name, (structure, leaves) in items.items():
            writer.write_item(name, root, structure, leaves, slab, progress)
        writer.commit(root, metadata)
    except BaseException:
        writer.abort()
        raise


def _unescape_item(stem: str) -> str:
    from urllib.parse import unquote

    return unquote(stem)


# ---------------------------------------------------------------------- a streaming cairn writer


class StreamWriter:
    """Writes a cairn checkpoint one slab at a time (single process, one chunk per array).

    It follows the same layout and commit rule as `cairn.save`: on local disk
    everything goes under ``.<name>.cairn-tmp-<token>/`` and is renamed into
    place; on an object store the manifest is put last, create-if-absent.
    """

    def __init__(self, loc: Location, block_size: int):
        from ._save import _check_destination

        _check_destination(loc, overwrite=False)
        self.loc, self.block = loc, block_size
        self.token = secrets.token_hex(6)
        self.root = fmt.tmp_dirname(loc.name, self.token) if loc.storage.atomic_rename else loc.name
        self.items: dict[str, fmt.ItemInfo] = {}

    def write_item(self, name: str, root: bool, structure: Any, leaves: list[Any], slab: int,
                   progress: Callable[[int], None] | None = None) -> None:
        """`leaves`: ValueLeaf, or (kind, path, _SrcTensor, handler) for data read from a source."""
        dirname = fmt.ROOT_ITEM_DIR if root else fmt.item_dirname(name)
        file_name = fmt.data_file_name(0, 0, self.token)
        placed: dict[int, tuple[int, list[int]]] = {}
        offset = 0

        def parts() -> Iterator[Any]:
            nonlocal offset
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, fmt.ValueLeaf):
                    continue
                _kind, _path, src, _h = leaf
                crcs: list[int] = []
                placed[i] = (offset, crcs)
                reader = src.storage.open_read(src.key)
                try:
                    for lo in range(0, src.nbytes, slab):
                        buf = np.empty(min(slab, src.nbytes - lo), dtype=np.uint8)
                        try:
                            reader.read_into(src.start + lo, memoryview(buf))  # type: ignore[arg-type]
                        except EOFError:
                            raise CorruptCheckpointError(
                                f"{src.storage.describe(src.key)}: truncated (tensor for {display_path(_path)!r})"
                            ) from None
                        # Slabs are whole blocks (but the last), so block CRCs line up with the chunk's.
                        crcs.extend(crc32c(buf[b : b + self.block]) for b in range(0, len(buf), self.block))
                        offset += len(buf)
                        yield memoryview(buf)  # type: ignore[arg-type]
                        if progress is not None:
                            progress(len(buf))
                finally:
                    reader.close()

        size = 0
        if any(not isinstance(leaf, fmt.ValueLeaf) and leaf[2].nbytes for leaf in leaves):
            size = self.loc.storage.write(f"{self.root}/{dirname}/{file_name}", parts())
        files = (fmt.FileInfo(file_name, size),) if size else ()
        out: list[fmt.Leaf] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, fmt.ValueLeaf):
                out.append(leaf)
                continue
            kind, path, src, handler = leaf
            off, crcs = placed.get(i, (0, []))
            grid = tuple((0, n) for n in src.shape)  # one chunk: the whole array
            out.append(fmt.ArrayLeaf(path=path, dtype=src.dtype, shape=src.shape, grid=grid,
                                     chunks=((0, off),), crcs=(tuple(crcs),), kind=kind, handler=handler))
        index = fmt.ItemIndex(structure, tuple(out), files, self.block)
        data = index.to_json()
        fmt.ItemIndex.from_json(data, f"{self.loc.path} [{name}]")  # never commit what cairn cannot read back
        self.loc.storage.put(f"{self.root}/{dirname}/{fmt.index_name(self.token)}", data)
        nbytes = sum(leaf.nbytes for leaf in out if isinstance(leaf, fmt.ArrayLeaf))
        self.items[name] = fmt.ItemInfo(dirname, fmt.index_name(self.token), nbytes, len(out))

    def commit(self, root: bool, metadata: dict[str, Any]) -> None:
        from . import __version__

        storage = self.loc.storage
        manifest = fmt.Manifest(items=self.items, root=root, process_count=1, cairn_version=__version__,
                                created_unix=time.time(), metadata=metadata).to_json()
        if storage.atomic_rename:
            storage.put(f"{self.root}/{fmt.MANIFEST}", manifest)
            storage.sync_dir(self.root)  # type: ignore[attr-defined]
            try:
                storage.rename_dir(self.root, self.loc.name)  # type: ignore[attr-defined]
            except FileExistsError:
                raise CheckpointExistsError(f"{self.loc.path} already exists") from None
        else:
            try:
                storage.put(self.loc.key(fmt.MANIFEST), manifest, create=True)
            except FileExistsError:
                raise CheckpointExistsError(f"{self.loc.path}: another save committed this checkpoint first") from None

    def abort(self) -> None:
        try:
            if self.loc.storage.atomic_rename:
                self.loc.storage.delete_prefix(self.root)
            else:
                for key in self.loc.storage.list(self.loc.name):
                    if f".{self.token}." in key.rsplit("/", 1)[-1]:
                        self.loc.storage.delete_prefix(key)
        except Exception:
            pass


# ---------------------------------------------------------------------- torch


_LEGACY_STORAGE = {
    "float32": "FloatStorage", "float64": "DoubleStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage",
    "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage",
    "complex64": "ComplexFloatStorage", "complex128": "ComplexDoubleStorage",
}
_TORCH_ONLY_V3 = {
    "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2", "float8_e4m3fnuz": "float8_e4m3fnuz", "float8_e5m2fnuz": "float8_e5m2fnuz",
    "float8_e8m0fnu": "float8_e8m0fnu",
}
# Same-width integer views numpy and torch share, used to hand ml_dtypes arrays to torch.
_VIEW_AS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise CheckpointError("this needs PyTorch, which is not installed (pip install 'cairn[torch]')") from None
    return torch


def torch_dtype(dtype: np.dtype, where: str) -> Any:
    torch = _import_torch()
    name = fmt.dtype_name(dtype) or str(dtype)
    t = getattr(torch, name, None)
    if not isinstance(t, torch.dtype):
        raise UnsupportedTypeError(f"{where}: dtype {name} has no PyTorch equivalent")
    return t


def numpy_to_torch(arr: np.ndarray, where: str) -> Any:
    """A torch tensor sharing `arr`'s memory, of the same dtype (bfloat16 stays bfloat16)."""
    torch = _import_torch()
    t_dtype = torch_dtype(arr.dtype, where)
    arr = np.ascontiguousarray(arr)
    if arr.dtype.kind in "biufc" and arr.dtype.name not in ("uint16", "uint32", "uint64"):
        return torch.from_numpy(arr)
    # ml_dtypes (bfloat16, float8_*) and the wide unsigned ints: reinterpret the bytes.
    view = arr.view(_VIEW_AS[arr.dtype.itemsize])
    return torch.from_numpy(view).view(t_dtype)


def tree_to_torch(tree: Any, where: str) -> Any:
    """Replace every numpy array in a loaded tree by a torch tensor (zero-copy)."""
    if isinstance(tree, np.ndarray):
        return numpy_to_torch(tree, where)
    if isinstance(tree, dict):
        return {k: tree_to_torch(v, f"{where}/{k}") for k, v in tree.items()}
    if isinstance(tree, list):
        return [tree_to_torch(v, f"{where}/{i}") for i, v in enumerate(tree)]
    if isinstance(tree, tuple):
        kids = [tree_to_torch(v, f"{where}/{i}") for i, v in enumerate(tree)]
        return type(tree)(*kids) if hasattr(type(tree), "_fields") else tuple(kids)
    if type(tree).__module__.startswith(("jax", "jaxlib")):
        return numpy_to_torch(np.asarray(tree), where)
    return tree


class _StorageRef:
    def __init__(self, key: str, dtype_name: str, numel: int, nbytes: int):
        self.key, self.dtype_name, self.numel, self.nbytes = key, dtype_name, numel, nbytes


class _TensorRef:
    """Pickles as the call ``torch.load`` makes to rebuild a CPU tensor from storage `key`."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce__(self) -> Any:
        torch = _import_torch()
        strides = tuple(int(s) for s in np.cumprod((1, *self.shape[:0:-1]))[::-1]) if self.shape else ()
        args: tuple[Any, ...] = (self.storage, 0, tuple(self.shape), strides, False, collections.OrderedDict())
        name = self.storage.dtype_name
        if name in _LEGACY_STORAGE:
            return torch._utils._rebuild_tensor_v2, args
        return torch._utils._rebuild_tensor_v3, (*args, getattr(torch, _TORCH_ONLY_V3[name]))


def to_torch_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    sep: str = ".",
    budget_bytes: int = DEFAULT_BUDGET,
    threads: int = 4,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
) -> str:
    """Write checkpoint `src` as a PyTorch state-dict file for ``torch.load(dst)``.

    The file holds one flat dict: key paths joined with `sep` (prefixed by the
    checkpointable's name) map to tensors, and to Python values for the
    non-array leaves. It is written in the format ``torch.save`` writes, one
    slab at a time, so it loads with ``weights_only=True`` and ``mmap=True``.
    """
    import io
    import pickle
    import tempfile

    torch = _import_torch()
    ck = open_checkpoint(src, storage_options)
    out_loc = resolve(dst, storage_options)
    slab = _slab_bytes(budget_bytes)
    local = out_loc.storage.atomic_rename
    final = out_loc.storage.describe(out_loc.name)
    tmp_dir = os.path.dirname(final) if local else tempfile.gettempdir()
    tmp_path = os.path.join(tmp_dir, f".{os.path.basename(final)}.cairn-tmp-{secrets.token_hex(4)}")
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="cairn-convert") as pool:
        readers = {i: make_reader(ck, i, pool) for i in ck.indexes}
        try:
            state, plan = _torch_state(ck, readers, sep)

            class _Pickler(pickle.Pickler):
                def persistent_id(self, obj: Any) -> Any:
                    if isinstance(obj, _StorageRef):
                        if obj.dtype_name in _LEGACY_STORAGE:
                            cls = getattr(torch, _LEGACY_STORAGE[obj.dtype_name])
                        else:
                            cls = torch.storage.UntypedStorage
                        return ("storage", cls, obj.key, "cpu", obj.numel)
                    return None

            pkl = io.BytesIO()
            _Pickler(pkl, protocol=2).dump(state)
            # The member names and small records are the ones torch.save writes.
            with open(tmp_path, "wb") as f:
                with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                    _zip_put(zf, "archive/data.pkl", pkl.getvalue())
                    _zip_put(zf, "archive/.format_version", b"1")
                    _zip_put(zf, "archive/.storage_alignment", b"64")
                    _zip_put(zf, "archive/byteorder", b"little")
                    for item, leaf, skey in plan:
                        with _zip_open_aligned(zf, f"archive/data/{skey}", leaf.nbytes) as w:
                            for arr in iter_array(readers[item], leaf, slab, pool):
                                w.write(memoryview(arr.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
                                n = arr.nbytes
                                del arr  # not alive while the next slab is read
                                if progress is not None:
                                    progress(n)
                    _zip_put(zf, "archive/version", b"3\n")
                    _zip_put(zf, "archive/.data/serialization_id", secrets.token_hex(20).encode())
                f.flush()
                os.fsync(f.fileno())
            if local:
                os.replace(tmp_path, final)
            else:
                def chunks() -> Iterator[bytes]:
                    with open(tmp_path, "rb") as f:
                        while piece := f.read(slab):
                            yield piece

                out_loc.storage.write(out_loc.name, chunks())
        finally:
            for r in readers.values():
                r.close()
            if os.path.exists(tmp_path):
                os.unlink(tmp_path)
    return final


def _torch_state(ck: Opened, readers: dict[str, _Reader], sep: str):
    """The flat state dict to pickle (with tensor placeholders) and the tensors to stream."""
    state: dict[str, Any] = {}
    plan: list[tuple[str, fmt.ArrayLeaf, str]] = []
    for item, index in ck.indexes.items():
        for leaf in index.leaves:
            comps = [unescape_key(c) for c in leaf.path.split("/")] if leaf.path else []
            if not ck.manifest.root:
                comps.insert(0, item)
            key = sep.join(comps) or "%root"
            if key in state:
                raise CheckpointError(f"{ck.loc.path}: two leaves map to the state-dict key {key!r}; choose another sep")
            if isinstance(leaf, fmt.ValueLeaf):
                v = leaf.value
                state[key] = v.item() if isinstance(v, np.generic) else v
                continue
            if leaf.kind != "array":  # bytes and handler objects: their (small) bytes, as Python bytes
                state[key] = readers[item].read_bytes(leaf)
                continue
            name = fmt.dtype_name(leaf.dtype) or ""
            if name not in _LEGACY_STORAGE and name not in _TORCH_ONLY_V3:
                raise UnsupportedTypeError(
                    f"{ck.loc.path}: leaf {display_path(leaf.path)!r} has dtype {name}, which PyTorch cannot hold"
                )
            skey = str(len(plan))
            numel = math.prod(leaf.shape)
            ref = _StorageRef(skey, name, numel if name in _LEGACY_STORAGE else leaf.nbytes, leaf.nbytes)
            state[key] = _TensorRef(ref, leaf.shape)
            plan.append((item, leaf, skey))
    return state, plan


def _zip_put(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    with _zip_open_aligned(zf, name, len(data)) as w:
        w.write(data)


def _zip_open_aligned(zf: zipfile.ZipFile, name: str, size: int, align: int = 64) -> Any:
    """Open a stored zip member whose data starts at a multiple of `align` (for mmap loads)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    info.CRC = info.compress_size = 0  # set for real when the member is closed
    zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # the rule ZipFile.open applies
    start = zf.start_dir
    header = len(info.FileHeader(zip64))
    pad = -(start + header + 4) % align  # 4: the padding field's own id and length
    info.extra = struct.pack("<HH", 0xCA1D, pad) + b"\0" * pad
    return zf.open(info, "w", force_zip64=zip64)
