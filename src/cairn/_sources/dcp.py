"""PyTorch DCP checkpoints (``.metadata`` plus ``.distcp`` files) as a load source.

``.metadata`` is a pickle of DCP's dataclasses. It is unpickled with an
allow-list of exactly those classes (plus ``torch.Size``, dtypes, layouts
and the path of the checkpoint), each mapped to an inert stub that keeps
its pickled state: nothing from torch is imported and no other global is
resolved, so a crafted file that names ``os.system`` is refused with
`CorruptCheckpointError`. torch is not needed to read a DCP checkpoint.

Each saved chunk of a tensor is a ``torch.save`` blob in a ``.distcp`` file
(the default ``FileSystemWriter``); `torchpickle` finds the byte offset of its
raw C-order data (two small reads per chunk, only for the tensors a load
asks for). The chunks must form a regular grid (DCP's saves of DTensor and
FSDP shards do), so a tensor becomes a `fmt.ArrayLeaf` and cairn's planner
and `ChunkReader` read only the ranges each process's shards overlap.

Keys: the FQNs of DCP's flattened state dict, split into a tree (DCP's own
key tuples when the metadata records them, else the FQN split on '.').
Non-tensor values (saved by DCP as pickled bytes) are read when the source
is opened and expanded into the tree when they are plain Python data;
anything else loads as the raw ``torch.save`` bytes of that value.
"""

from __future__ import annotations

import collections
import io
import itertools
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._errors import CorruptCheckpointError, UnsupportedTypeError
from .._format import manifest as fmt
from .._format import values
from .._storage import RandomReader
from .._storage.location import Location
from .._tree.pytree import escape_key
from . import torchpickle as tsv
from .base import FlatLocation, Format, expand_value, split_name

METADATA = ".metadata"
_MAX_VALUE = 16 << 20  # a pickled non-tensor value larger than this stays raw bytes

_DCP = "torch.distributed.checkpoint.metadata"
_OLD_PROPS = "torch.distributed._shard.sharded_tensor.metadata"
_CLASSES = {
    (_DCP, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                        "TensorProperties", "MetadataIndex", "StorageMeta")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), (_OLD_PROPS, "TensorProperties")}


class _Stub:
    """A DCP metadata object: its pickled state, nothing else."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            self.__dict__.update(state[0] or {})  # (dict, slots) state
            self.__dict__.update(state[1] or {})
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state


_STUBS = {key: type(key[1], (_Stub,), {}) for key in _CLASSES}


def _path_str(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _STUBS:
            return _STUBS[(module, name)]
        if module == "torch" and name == "Size":
            return tuple
        if module == "torch" and name in tsv.TORCH_DTYPES:
            return tsv.TORCH_DTYPES[name]
        if module == "torch.serialization" and name == "_get_layout":
            return str
        if module in (_DCP, _OLD_PROPS) and name in ("_MEM_FORMAT_ENCODING", "MEM_FORMAT_ENCODING"):
            return int
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
            return _path_str
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise tsv.Refused(f"{module}.{name}")


def read_metadata(data: bytes, where: str) -> Any:
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except tsv.Refused as e:
        raise CorruptCheckpointError(
            f"{where}: the DCP metadata refers to {e}, which is not one of DCP's metadata classes; "
            "cairn does not unpickle it (it never runs code from a checkpoint)"
        ) from None
    except Exception as e:
        raise CorruptCheckpointError(f"{where}: unreadable DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(md, _STUBS[(_DCP, "Metadata")]) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CorruptCheckpointError(f"{where}: not DCP metadata (found {type(md).__name__})")
    return md


def _dtype_of(props: Any, where: str) -> np.dtype:
    state = getattr(props, "_state", None)
    name = state[0] if isinstance(state, tuple) and state else getattr(props, "dtype", None)
    if not isinstance(name, str) or name not in tsv.TORCH_DTYPES:
        raise UnsupportedTypeError(f"{where}: torch dtype {name!r} is not supported")
    return values.dtype_from_name(name, f"{where}: ")


class DCP(Format):
    name = "dcp"

    def __init__(self, loc: Location, md: Any, where: str):
        super().__init__(loc)
        self.md, self.where = md, where
        self._info: dict[tuple[Any, Any], Any] = {}
        for k, v in (getattr(md, "storage_data", None) or {}).items():
            off = getattr(k, "offset", None)
            self._info[(getattr(k, "fqn", None), None if off is None else tuple(off))] = v
        names = sorted({getattr(v, "relative_path", "") for v in self._info.values()})
        for n in names:
            if not n or "/" in n or "\\" in n or n in (".", ".."):
                raise CorruptCheckpointError(f"{where}: DCP metadata names the data file {n!r}")
        self.file_names = names
        sizes = dict.fromkeys(names, 0)
        for v in self._info.values():
            sizes[v.relative_path] = max(sizes[v.relative_path], int(v.offset) + int(v.length))
        self.files = tuple(fmt.FileInfo(n, sizes[n]) for n in names)
        self._file_no = {n: i for i, n in enumerate(names)}
        planner = getattr(md, "planner_data", None) or {}
        self._kinds: dict[str, str] = {}
        self._empty: dict[str, str] = {}
        self._values: dict[str, fmt.Leaf] = {}
        self._paths: list[str] = []
        self._fqn: dict[str, str] = {}
        for fqn, entry in md.state_dict_metadata.items():
            keys = planner.get(fqn)
            if isinstance(keys, tuple) and keys and all(isinstance(k, (str, int)) for k in keys):
                path = "/".join(escape_key(str(k)) for k in keys)
                for i, k in enumerate(keys):
                    if isinstance(k, int):
                        self._kinds["/".join(escape_key(str(x)) for x in keys[:i])] = "list"
            else:
                path = split_name(fqn)
            if type(entry).__name__ == "BytesStorageMetadata":
                self._add_value(fqn, path)
            else:
                self._paths.append(path)
                self._fqn[path] = fqn

    # ------------------------------------------------------------------ values (read when opened)

    def _add_value(self, fqn: str, path: str) -> None:
        info = self._info.get((fqn, None))
        if info is None:
            raise CorruptCheckpointError(f"{self.where}: no storage entry for value {fqn!r}")
        bytes_leaf = fmt.ArrayLeaf(path, np.dtype(np.uint8), (int(info.length),), ((0, int(info.length)),),
                                   ((self._file_no[info.relative_path], int(info.offset)),), kind="bytes")
        if info.length > _MAX_VALUE or getattr(info, "transform_descriptors", None):
            self._paths.append(path)
            self._values[path] = bytes_leaf
            return
        reader = self.loc.storage.open_read(self.loc.key(info.relative_path))
        try:
            blob = tsv.parse_blob(reader, int(info.offset), int(info.length), f"{self.where} [{fqn}]")
            value = tsv.value_of(blob.pickle) if blob is not None else None
            found: dict[str, fmt.Leaf] = {}
            kinds: dict[str, str] = {}
            empty: dict[str, str] = {}
            if blob is None:
                raise tsv.Refused("raw bytes")
            expand_value(path, value, found, kinds, empty)
        except (tsv.Refused, EOFError, TypeError, ValueError, pickle.UnpicklingError):
            found, kinds, empty = {path: bytes_leaf}, {}, {}
        finally:
            reader.close()
        self._paths.extend(found)
        self._values.update(found)
        self._kinds.update(kinds)
        self._empty.update(empty)

    # ------------------------------------------------------------------ Format

    def items(self) -> dict[str, list[str]]:
        return {"": self._paths}

    def kinds(self, item: str) -> dict[str, str]:
        return self._kinds

    def empty(self, item: str) -> dict[str, str]:
        return self._empty

    def metadata(self) -> dict[str, Any]:
        return {"format": "dcp", "dcp_version": str(getattr(self.md, "version", "") or "")}

    def leaves(self, item: str, paths: list[str]) -> dict[str, fmt.Leaf]:
        out: dict[str, fmt.Leaf] = {p: self._values[p] for p in paths if p in self._values}
        tensors = [p for p in paths if p not in self._values]
        jobs = []  # (path, chunk number, storage info)
        plans = {}
        for p in tensors:
            fqn = self._fqn[p]
            entry = self.md.state_dict_metadata[fqn]
            where = f"{self.where}: tensor {fqn!r}"
            shape = tuple(int(s) for s in entry.size)
            dtype = _dtype_of(entry.properties, where)
            grid, cells = _grid(shape, [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks], where)
            infos: list[Any] = []
            for off, size in cells:
                info = self._info.get((fqn, off))
                if info is None:
                    raise CorruptCheckpointError(f"{where}: no storage entry for its chunk at {list(off)}")
                if getattr(info, "transform_descriptors", None):
                    raise UnsupportedTypeError(f"{where} is stored through DCP extensions "
                                               f"{list(info.transform_descriptors)}, which cairn does not read")
                jobs.append((p, len(infos), info, dtype, size))
                infos.append(info)
            plans[p] = (shape, dtype, grid, len(infos))
        located: dict[tuple[str, int], tuple[int, int]] = {}
        readers: dict[str, RandomReader] = {}
        try:
            for n in {j[2].relative_path for j in jobs} if self.locate else ():
                readers[n] = self.loc.storage.open_read(self.loc.key(n))

            def locate(job: tuple[str, int, Any, np.dtype, tuple[int, ...]]) -> None:
                p, k, info, dtype, size = job
                if not self.locate:  # describing only: where the blob starts is enough
                    located[(p, k)] = (self._file_no[info.relative_path], int(info.offset))
                    return
                located[(p, k)] = (self._file_no[info.relative_path],
                                   _chunk_offset(readers[info.relative_path], info, dtype, size,
                                                 f"{self.where}: tensor {self._fqn[p]!r}"))

            if len(jobs) > 1:
                with ThreadPoolExecutor(min(8, len(jobs)), thread_name_prefix="cairn-dcp") as pool:
                    list(pool.map(locate, jobs))
            else:
                for j in jobs:
                    locate(j)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{self.where}: data file missing ({e})") from None
        except EOFError:
            raise CorruptCheckpointError(f"{self.where}: a .distcp file is truncated") from None
        finally:
            for r in readers.values():
                r.close()
        for p, (shape, dtype, grid, n) in plans.items():
            chunks = tuple(located[(p, k)] for k in range(n))
            # A torch tensor, sharded or not, is an array to a JAX program: with load(mesh=) it comes back
            # on the mesh (replicated: DCP records no JAX axis names), never as numpy. Its saved chunk
            # counts per axis say how it was split.
            sharding = {"type": "DCP", "chunks": [len(b) - 1 for b in grid]}
            out[p] = fmt.ArrayLeaf(p, dtype, shape, grid, chunks, sharding=sharding)
        return out


def _chunk_offset(reader: RandomReader, info: Any, dtype: np.dtype, size: tuple[int, ...], where: str) -> int:
    """The absolute file offset of a chunk's C-order bytes."""
    import math

    nbytes = math.prod(size) * dtype.itemsize
    blob = tsv.parse_blob(reader, int(info.offset), int(info.length), where)
    if blob is None:  # not a torch.save blob: the raw bytes themselves
        if int(info.length) != nbytes:
            raise CorruptCheckpointError(f"{where}: a raw chunk of {info.length} bytes, expected {nbytes}")
        return int(info.offset)
    ref, start = tsv.tensor_of(blob, where)
    if ref.shape != size:
        raise CorruptCheckpointError(f"{where}: a chunk of shape {ref.shape} where the metadata says {size}")
    if values.dtype_from_name(ref.dtype, f"{where}: ") != dtype:
        raise CorruptCheckpointError(f"{where}: a chunk of dtype {ref.dtype} where the metadata says {dtype}")
    if not tsv.is_c_order(ref.shape, ref.stride):
        raise UnsupportedTypeError(f"{where}: a chunk saved with strides {ref.stride} (not C order); "
                                   "cairn reads DCP tensors saved contiguous")
    if not tsv.storage_fits(ref, blob, dtype.itemsize):
        raise CorruptCheckpointError(f"{where}: a chunk larger than its storage record")
    return start + ref.offset * dtype.itemsize


def _grid(shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]],
          where: str) -> tuple[tuple[tuple[int, ...], ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The regular grid DCP's chunks form, and the chunks in grid (C) order."""
    if any(n == 0 for n in shape):
        if not chunks:
            raise CorruptCheckpointError(f"{where}: no chunks")
        return tuple((0, n) for n in shape), [chunks[0]]
    live = [(o, s) for o, s in chunks if all(n > 0 for n in s)]
    bounds = []
    for a, n in enumerate(shape):
        b = sorted({0, n, *(o[a] for o, _ in live)})
        bounds.append(tuple(b))
    by_off = {o: (o, s) for o, s in live}
    cells = []
    for idx in itertools.product(*(range(len(b) - 1) for b in bounds)):
        off = tuple(bounds[a][i] for a, i in enumerate(idx))
        want = tuple(bounds[a][i + 1] - bounds[a][i] for a, i in enumerate(idx))
        c = by_off.get(off)
        if c is None or c[1] != want:
            raise UnsupportedTypeError(f"{where}: its saved chunks do not form a regular grid "
                                       "(cairn reads DCP tensors whose shards tile a grid)")
        cells.append(c)
    if len(cells) != len(live):
        raise CorruptCheckpointError(f"{where}: overlapping chunks")
    return tuple(bounds), cells


def detect(loc: Location) -> bool:
    return loc.storage.exists(loc.key(METADATA))


def open_dcp(loc: Location) -> DCP:
    flat = FlatLocation(loc.storage, loc.name, loc.path)
    key = flat.key(METADATA)
    md = read_metadata(loc.storage.read(key), loc.storage.describe(key))
    return DCP(flat, md, loc.path)
