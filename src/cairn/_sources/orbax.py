"""Orbax checkpoints (orbax-checkpoint 0.11-0.12) as a load source, read with tensorstore.

What is understood: a PyTree/Standard item folder (``_METADATA`` with the
tree's keys and value types, arrays in zarr2 or zarr3, inside OCDBT or one
folder per array, compressed or not), and a CheckpointManager step folder
(``<step>/<item>/...`` with ``_CHECKPOINT_METADATA``), whose items become
named checkpointables (a lone ``default`` item is the tree itself); JSON
items are read as values. orbax itself is not needed, only tensorstore (the
``orbax`` extra).

Orbax's chunks are zarr chunks (compressed by default) inside OCDBT's own
files, which cairn's byte-range planner cannot address. Each array is
therefore opened with tensorstore and read box by box:
``store[box].read()`` for each distinct box of the target's shards on this
process, which reads only the zarr chunks that box overlaps. In the index an
array is one chunk of a "file" that names its zarr array, so `_load`'s
matching, budget and assembly are cairn's own. Small metadata files are read
through cairn's `Storage`; array bytes through tensorstore's own drivers
(local files, and ``gs://`` / ``s3://`` URLs as tensorstore reads them).
"""

from __future__ import annotations

import base64
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedTypeError,
)
from .._format import manifest as fmt
from .._format import values
from .._load import reader as _reader
from .._load.reader import ArrayReads, ChunkReader, LoadStats
from .._storage import split_url
from .._storage.location import Location
from .._tree.pytree import escape_key
from .base import FlatLocation, Format, expand_value

METADATA = "_METADATA"
STEP_METADATA = "_CHECKPOINT_METADATA"
METRICS = "metrics"  # the item in which Orbax's CheckpointManager keeps a step's metrics
_ARRAYS = ("jax.Array", "np.ndarray", "scalar")
_EMPTY = {"Dict": "dict", "List": "list", "Tuple": "tuple", "NamedTuple": "dict"}


@dataclass
class _Item:
    dir: str  # key of the item folder under the storage root
    kind: str  # "pytree" | "json"
    entries: dict[str, tuple[str, str]] = field(default_factory=dict)  # path -> (param name, value type)
    kinds: dict[str, str] = field(default_factory=dict)
    empty: dict[str, str] = field(default_factory=dict)
    values: dict[str, fmt.Leaf] = field(default_factory=dict)
    ocdbt: bool = True
    zarr3: bool = False
    shardings: dict[str, dict[str, Any]] = field(default_factory=dict)  # param name -> as describe_sharding


def _ts() -> Any:
    try:
        import tensorstore
    except ImportError:
        raise CheckpointError("reading Orbax checkpoints needs tensorstore: pip install 'cairn-ckpt[orbax]'") from None
    return tensorstore


class Orbax(Format):
    name = "orbax"

    def __init__(self, loc: Location, items: dict[str, _Item], where: str, step_meta: dict[str, Any]):
        super().__init__(loc)
        self._items, self.where, self._step_meta = items, where, step_meta
        self._arrays: list[tuple[str, str]] = []  # "file" number -> (item, path)
        self._file_of: dict[tuple[str, str], int] = {}
        self._stores: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._ctx: Any = None

    @property
    def files(self) -> tuple[fmt.FileInfo, ...]:  # type: ignore[override]
        return tuple(fmt.FileInfo(self._items[i].entries[p][0], 0) for i, p in self._arrays)

    def items(self) -> dict[str, list[str]]:
        return {name: [*it.entries, *it.values] for name, it in self._items.items()}

    def kinds(self, item: str) -> dict[str, str]:
        return self._items[item].kinds

    def empty(self, item: str) -> dict[str, str]:
        return self._items[item].empty

    def nones(self, item: str) -> set[str]:
        it = self._items[item]
        return {p for p, leaf in it.values.items() if isinstance(leaf, fmt.ValueLeaf) and leaf.kind == "none"}

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": "orbax"}
        for key in ("metrics", "custom_metadata"):
            if self._step_meta.get(key):
                out[key] = self._step_meta[key]
        return out

    # ------------------------------------------------------------------ tensorstore

    def _spec(self, it: _Item, param: str) -> dict[str, Any]:
        storage = self.loc.storage
        scheme, _ = split_url(storage.url)
        if scheme in ("", "file"):
            base: Any = {"driver": "file", "path": storage.describe(it.dir).rstrip("/") + "/"}
        elif scheme in ("gs", "s3"):
            base = f"{storage.url.rstrip('/')}/{it.dir}/"
        else:
            raise CheckpointError(f"{self.where}: cairn reads Orbax checkpoints from local paths, gs:// and s3:// "
                                  f"only (tensorstore has no driver for {scheme}://)")
        if it.ocdbt:
            kv: Any = {"driver": "ocdbt", "base": base, "path": param}
        elif isinstance(base, dict):
            kv = {**base, "path": base["path"] + param + "/"}
        else:
            kv = base + param + "/"
        return {"driver": "zarr3" if it.zarr3 else "zarr", "kvstore": kv,
                "recheck_cached_data": False, "recheck_cached_metadata": False}

    def _open(self, pairs: list[tuple[str, str]]) -> list[Any]:
        ts = _ts()
        if self._ctx is None:
            self._ctx = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
        futures = [ts.open(self._spec(self._items[i], self._items[i].entries[p][0]), open=True, read=True,
                           context=self._ctx) for i, p in pairs]
        out = []
        for (i, p), f in zip(pairs, futures):
            try:
                out.append(f.result())
            except Exception as e:
                raise CorruptCheckpointError(f"{self.where}: cannot open array {self._items[i].entries[p][0]!r} "
                                             f"of item {i!r}: {e}") from None
        return out

    def store(self, file: int) -> Any:
        with self._lock:
            s = self._stores.get(file)
        if s is None:
            s = self._open([self._arrays[file]])[0]
            with self._lock:
                self._stores[file] = s
        return s

    def leaves(self, item: str, paths: list[str]) -> dict[str, fmt.Leaf]:
        it = self._items[item]
        out: dict[str, fmt.Leaf] = {p: it.values[p] for p in paths if p in it.values}
        arrays = [p for p in paths if p in it.entries]
        for p in arrays:
            if it.entries[p][1] not in _ARRAYS:
                raise UnsupportedTypeError(f"{self.where}: leaf {p!r} has Orbax value type {it.entries[p][1]!r}, "
                                           "which cairn does not read")
        stores = self._open([(item, p) for p in arrays])
        for p, s in zip(arrays, stores):
            dtype = values.dtype_from_name(np.dtype(s.dtype.numpy_dtype).name, f"{self.where}: {p!r}: ")
            if it.entries[p][1] == "scalar":
                v = s.read().result()
                out[p] = fmt.ValueLeaf(p, values.value_kind(v.item()) or "scalar", v.item())
                continue
            key = (item, p)
            if key not in self._file_of:
                self._file_of[key] = len(self._arrays)
                self._arrays.append(key)
            file = self._file_of[key]
            with self._lock:
                self._stores[file] = s
            shape = tuple(int(n) for n in s.shape)
            out[p] = fmt.ArrayLeaf(p, dtype, shape, tuple((0, n) for n in shape), ((file, 0),),
                                   sharding=it.shardings.get(it.entries[p][0]))
        return out

    def reader(self, item: str, index: fmt.ItemIndex, verify: bool, pool: ThreadPoolExecutor,
               stats: LoadStats) -> ChunkReader:
        return TensorStoreReader(self, item, index, pool, stats)

    def read_box(self, reader: ChunkReader, leaf: fmt.ArrayLeaf, box: Any, pool: ThreadPoolExecutor) -> np.ndarray:
        return _read(self.store(leaf.chunks[0][0]), box, leaf.dtype)


def _read(store: Any, box: Any, dtype: np.dtype) -> np.ndarray:
    a = np.asarray(store[tuple(slice(lo, hi) for lo, hi in box)].read().result())
    return a if a.dtype == dtype else a.view(dtype) if a.dtype.itemsize == dtype.itemsize else a.astype(dtype)


class TensorStoreReader(ChunkReader):
    """`ChunkReader`'s read_array, through tensorstore: one read per distinct target box."""

    def __init__(self, source: Orbax, item: str, index: fmt.ItemIndex, pool: ThreadPoolExecutor, stats: LoadStats):
        super().__init__(source.loc, item, fmt.ItemInfo("", "", 0, len(index.leaves)), index, False, pool, stats)
        self.source = source

    def read_array(self, leaf: fmt.ArrayLeaf, sharding: Any = None, region: Any = None,
                   planned: Any = None) -> ArrayReads:  # `planned`: a chunk reader's reads, not tensorstore's
        from .._core.boxes import full_box

        placement = None
        shape = leaf.shape if region is None else tuple(hi - lo for lo, hi in region)
        if sharding is None:
            boxes = [full_box(shape)]
        else:
            from .._tree.shardings import addressable_boxes

            boxes, placement = addressable_boxes(sharding, shape)
        # With `region` (a slab of a leaf restored in pieces) boxes are relative to it.
        absolute = boxes if region is None else [
            tuple((lo + o, hi + o) for (lo, hi), (o, _) in zip(b, region)) for b in boxes]
        store = self.source.store(leaf.chunks[0][0])
        # Not touched until the read replaces it: costs no memory while queued. Lent where the arrays go to
        # devices, as a cairn checkpoint's (`reader.lends`).
        lend = _reader.lends(sharding)
        dests = [_reader.host_buffer(tuple(hi - lo for lo, hi in b), leaf.dtype, lend) for b in boxes]

        def fill(i: int) -> None:
            try:
                dests[i][...] = _read(store, absolute[i], leaf.dtype)
            except Exception as e:
                raise CheckpointError(f"{self.loc.path}: reading leaf {leaf.path!r} with tensorstore failed: {e}") from e
            with self._lock:
                self.stats.bytes_read += dests[i].nbytes
                self.stats.reads += 1

        futures: list[Future[None]] = [self.pool.submit(fill, i) for i in range(len(boxes))]
        return ArrayReads(futures, dests, boxes, placement)

    def read_bytes(self, leaf: fmt.ArrayLeaf) -> bytes:
        raise UnsupportedTypeError(f"{self.loc.path}: Orbax checkpoints hold no bytes leaves")

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------- opening


def _pytree_item(st: Any, key: str, where: str) -> _Item:
    d = fmt.parse_json(st.read(f"{key}/{METADATA}"), f"{where}/{METADATA}")
    tree = d.get("tree_metadata") if isinstance(d, dict) else None
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"{where}/{METADATA}: no tree_metadata (an Orbax format cairn does not know)")
    it = _Item(key, "pytree", ocdbt=bool(d.get("use_ocdbt", True)), zarr3=bool(d.get("use_zarr3", False)))
    strings: dict[str, Any] | None = None
    for entry in tree.values():
        try:
            keys = [(str(k["key"]), int(k["key_type"])) for k in entry["key_metadata"]]
            vtype = str(entry["value_metadata"]["value_type"])
            skip = bool(entry["value_metadata"].get("skip_deserialize", False))
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(f"{where}/{METADATA}: malformed entry {entry!r:.200}") from None
        path = "/".join(escape_key(k) for k, _ in keys)
        for n, (_k, kt) in enumerate(keys):
            if kt == 1:
                it.kinds["/".join(escape_key(k) for k, _ in keys[:n])] = "list"
        param = ".".join(k for k, _ in keys)
        if vtype in _EMPTY:
            it.empty[path] = _EMPTY[vtype]
        elif vtype == "None":
            it.values[path] = fmt.ValueLeaf(path, "none", None)
        elif vtype == "string":
            if strings is None:
                strings = json.loads(st.read(f"{key}/_strings.json")) if st.exists(f"{key}/_strings.json") else {}
            if not isinstance(strings, dict) or not isinstance(strings.get(param), str):
                raise CorruptCheckpointError(f"{where}: string {param!r} is missing from _strings.json")
            it.values[path] = fmt.ValueLeaf(path, "str", strings[param])
        elif vtype == "placeholder" or skip:
            continue
        else:
            it.entries[path] = (param, vtype)
    if st.exists(f"{key}/_sharding"):
        it.shardings = _shardings(st.read(f"{key}/_sharding"), f"{where}/_sharding")
    return it


def _shardings(raw: bytes, where: str) -> dict[str, dict[str, Any]]:
    """Orbax's ``_sharding`` file (base64 of each param name -> a JSON string), as `describe_sharding`
    describes shardings; what cairn does not understand is left out (the array loads as if unsharded)."""
    d = fmt.parse_json(raw, where)
    out: dict[str, dict[str, Any]] = {}
    for name, text in (d.items() if isinstance(d, dict) else ()):
        try:
            param, x = base64.b64decode(name).decode(), json.loads(text)
        except (ValueError, TypeError):
            continue
        if not isinstance(x, dict):
            continue
        if x.get("sharding_type") == "NamedSharding" and isinstance(x.get("partition_spec"), list):
            out[param] = {"type": "NamedSharding", "spec": [e if e is None or isinstance(e, (str, list)) else str(e)
                                                          for e in x["partition_spec"]],
                          "mesh": {"axis_names": list(x.get("axis_names", [])), "shape": list(x.get("shape", []))}}
        elif isinstance(x.get("sharding_type"), str):
            out[param] = {"type": x["sharding_type"]}
    return out


def _json_item(st: Any, key: str, where: str) -> _Item:
    it = _Item(key, "json")
    names = [n for n in st.list_dir(key) if n != "commit_success.txt"]
    if len(names) != 1:
        raise CorruptCheckpointError(f"{where}: a JSON item should hold one file, found {names}")
    data = fmt.parse_json(st.read(f"{key}/{names[0]}"), f"{where}/{names[0]}")
    try:
        expand_value("", data, it.values, it.kinds, it.empty)
    except TypeError as e:
        raise CorruptCheckpointError(f"{where}: {e}") from None
    return it


def detect(loc: Location) -> bool:
    st = loc.storage
    return st.exists(loc.key(METADATA)) or st.exists(loc.key(STEP_METADATA))


def open_orbax(loc: Location) -> Orbax:
    st, name = loc.storage, loc.name
    flat = FlatLocation(st, name, loc.path)
    step_meta: dict[str, Any] = {}
    if st.exists(loc.key(STEP_METADATA)):
        raw = fmt.parse_json(st.read(loc.key(STEP_METADATA)), f"{loc.path}/{STEP_METADATA}")
        step_meta = raw if isinstance(raw, dict) else {}
    if st.exists(loc.key(METADATA)):
        return Orbax(flat, {"": _pytree_item(st, name, loc.path)}, loc.path, step_meta)
    handlers = step_meta.get("item_handlers")
    items: dict[str, _Item] = {}
    for sub in st.list_dir(name):
        key = f"{name}/{sub}"
        if sub == METRICS and not step_meta.get("metrics"):
            # Orbax's manager reserves the item name for the metrics of `save(metrics=)`
            # (written when it tracks the best step): the step's metrics, not a checkpointable.
            metrics = _json_item(st, key, f"{loc.path}/{sub}")
            step_meta = {**step_meta, "metrics": {p: v.value for p, v in metrics.values.items()
                                                  if isinstance(v, fmt.ValueLeaf)}}
            continue
        if st.exists(f"{key}/{METADATA}"):
            items[sub] = _pytree_item(st, key, f"{loc.path}/{sub}")
        elif isinstance(handlers, dict) and "JsonCheckpointHandler" in str(handlers.get(sub, "")):
            items[sub] = _json_item(st, key, f"{loc.path}/{sub}")
    if not items:
        raise CheckpointNotFoundError(f"{loc.path}: an Orbax step folder with no items cairn can read")
    if list(items) == ["default"]:
        items = {"": items["default"]}
    return Orbax(flat, items, loc.path, step_meta)


def step_metrics(st: Any, key: str, where: str) -> dict[str, Any]:
    """The metrics of the Orbax step folder at `key`: ``_CHECKPOINT_METADATA``'s, else its ``metrics`` item."""
    raw = fmt.parse_json(st.read(f"{key}/{STEP_METADATA}"), f"{where}/{STEP_METADATA}")
    got = raw.get("metrics") if isinstance(raw, dict) else None
    if not got and st.exists(f"{key}/{METRICS}/{METRICS}"):
        got = fmt.parse_json(st.read(f"{key}/{METRICS}/{METRICS}"), f"{where}/{METRICS}/{METRICS}")
    return got if isinstance(got, dict) else {}


def manager_steps(loc: Location) -> list[str]:
    """The step folders of an Orbax CheckpointManager directory at `loc` (for a helpful error)."""
    st = loc.storage
    return sorted((n for n in st.list_dir(loc.name) if n.isdigit() and st.exists(f"{loc.name}/{n}/{STEP_METADATA}")),
                  key=int)
