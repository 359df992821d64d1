"""The load engine: read the manifest, plan the reads, fill host buffers, build arrays.

Every byte read is checked against its block checksum (unless the caller
turns verification off) before it is copied anywhere. A read whose bytes are
exactly one contiguous region of a destination buffer lands there directly;
other reads go through a small temporary buffer and a strided copy.
"""

from __future__ import annotations

import errno
import math
import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _format as fmt
from ._buffers import aligned_empty, release_snapshot_buffers
from ._checksum import crc32c
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MismatchError,
)
from ._leaves import handler_named
from ._location import Location
from ._plan import Box, Read, full_box, is_c_contiguous, plan_reads
from ._tree import display_path, map_with_path, unflatten

_SKIP = object()


@dataclass(frozen=True)
class ArrayMetadata:
    """What `cairn.metadata` reports for a stored array (no data is read).

    It can also serve as a load target leaf: the array comes back as a numpy
    array of the saved dtype.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    sharding: dict[str, Any] | None = None
    kind: str = "array"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass
class LoadStats:
    bytes_read: int = 0
    reads: int = 0
    direct_reads: int = 0


# ---------------------------------------------------------------------- metadata reading


def read_manifest(loc: Location) -> fmt.Manifest:
    key = loc.key(fmt.MANIFEST)
    try:
        data = loc.storage.read(key)
    except (FileNotFoundError, NotADirectoryError):
        if loc.storage.exists(loc.name):
            raise CheckpointNotFoundError(
                f"{loc.path} holds no committed checkpoint (no {fmt.MANIFEST}; an interrupted save?)"
            ) from None
        raise CheckpointNotFoundError(f"no checkpoint at {loc.path}") from None
    except IsADirectoryError:
        raise CorruptCheckpointError(f"{loc.path}: {fmt.MANIFEST} is not a file") from None
    except OSError as e:
        raise _read_error(loc, fmt.MANIFEST, e) from e
    return fmt.Manifest.from_json(data, loc.storage.describe(key))


def _read_error(loc: Location, what: str, e: OSError) -> CheckpointError:
    if e.errno == errno.ELOOP:
        return CorruptCheckpointError(
            f"{loc.path}: {what} is a symbolic link (or lies under one); cairn never follows links inside a checkpoint"
        )
    return CheckpointError(f"{loc.path}: reading {what} failed: {e}")


def read_index(loc: Location, info: fmt.ItemInfo) -> fmt.ItemIndex:
    key = loc.key(info.dir, info.index)
    try:
        data = loc.storage.read(key)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise CorruptCheckpointError(f"{loc.path}: the index {key!r} named by the manifest is missing") from None
    except OSError as e:
        raise _read_error(loc, f"the index {key!r}", e) from e
    return fmt.ItemIndex.from_json(data, loc.storage.describe(key))


# ---------------------------------------------------------------------- targets


@dataclass
class _Want:
    """How one stored array leaf should come back."""

    leaf: fmt.ArrayLeaf
    dtype: np.dtype
    sharding: Any = None  # a jax Sharding, or None for a numpy array
    result: Any = None


def _is_sharding(x: Any) -> bool:
    if not type(x).__module__.startswith(("jax", "jaxlib")):
        return False
    import jax

    return isinstance(x, jax.sharding.Sharding)


def _want_for(target: Any, leaf: fmt.ArrayLeaf, where: str, item: str) -> _Want | None:
    """Interpret a target leaf for stored array `leaf`; None means "as saved, numpy"."""
    if leaf.kind != "array":
        return None
    if _is_sharding(target):
        return _Want(leaf, leaf.dtype, target)
    shape = getattr(target, "shape", None)
    dtype = getattr(target, "dtype", None)
    if shape is None or dtype is None:
        return _Want(leaf, leaf.dtype, None)
    if tuple(shape) != leaf.shape:
        raise MismatchError(
            f"{where}: leaf {display_path(leaf.path, item)!r} has shape {tuple(shape)} in the target "
            f"but {leaf.shape} in the checkpoint"
        )
    try:
        out_dtype = np.dtype(dtype)
    except TypeError:
        raise MismatchError(f"{where}: leaf {display_path(leaf.path, item)!r}: target dtype {dtype!r} is not a dtype") from None
    if isinstance(target, (np.ndarray, ArrayMetadata)):
        return _Want(leaf, out_dtype, None)
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        import jax

        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return _Want(leaf, out_dtype, sharding)


# ---------------------------------------------------------------------- the reader


class _Reader:
    """Runs the reads of one checkpointable with a pool of threads."""

    def __init__(self, loc: Location, name: str, info: fmt.ItemInfo, index: fmt.ItemIndex, verify: bool,
                 pool: ThreadPoolExecutor, stats: LoadStats):
        self.loc, self.info, self.index, self.verify, self.pool, self.stats = loc, info, index, verify, pool, stats
        self.item = name
        self._readers: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _key(self, file: int) -> str:
        return self.loc.key(self.info.dir, self.index.files[file].name)

    def _reader(self, file: int) -> Any:
        with self._lock:
            r = self._readers.get(file)
            if r is None:
                name = self.index.files[file].name
                try:
                    r = self.loc.storage.open_read(self._key(file))
                except FileNotFoundError:
                    raise CorruptCheckpointError(f"{self.loc.path}: data file {name!r} is missing") from None
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        raise CorruptCheckpointError(
                            f"{self.loc.path}: data file {name!r} is a symbolic link (or lies under one); "
                            "cairn never follows links inside a checkpoint"
                        ) from None
                    raise CheckpointError(f"{self.loc.path}: opening data file {name!r} failed: {e}") from e
                # Local files know their size for free (object stores would need a request):
                # a file shorter than its index claims is refused before any buffer is allocated.
                size, claimed = getattr(r, "size", None), self.index.files[file].size
                if size is not None and size < claimed:
                    r.close()
                    raise CorruptCheckpointError(
                        f"{self.loc.path}: data file {name!r} has {size} bytes, its index claims {claimed}"
                    )
                self._readers[file] = r
            return r

    def close(self) -> None:
        with self._lock:
            for r in self._readers.values():
                try:
                    r.close()
                except Exception:
                    pass
            self._readers.clear()

    def _fill(self, file: int, start: int, out: memoryview | list[memoryview], leaf: fmt.ArrayLeaf) -> None:
        """Read file bytes from `start` into `out` (one buffer, or consecutive buffers)."""
        n = len(out) if isinstance(out, memoryview) else sum(len(o) for o in out)
        try:
            if isinstance(out, memoryview):
                self._reader(file).read_into(start, out)
            else:
                self._reader(file).read_into_many(start, out)
        except EOFError:
            raise CorruptCheckpointError(
                f"{self.loc.path}: data file {self.index.files[file].name!r} is truncated "
                f"(leaf {display_path(leaf.path, self.item)!r} needs bytes {start}..{start + n})"
            ) from None
        except FileNotFoundError:  # object stores learn of a missing object on the first read
            raise CorruptCheckpointError(
                f"{self.loc.path}: data file {self.index.files[file].name!r} is missing"
            ) from None
        except OSError as e:
            raise CheckpointError(
                f"{self.loc.path}: reading {self.index.files[file].name!r} for leaf "
                f"{display_path(leaf.path, self.item)!r} failed: {e}"
            ) from e
        with self._lock:
            self.stats.bytes_read += n
            self.stats.reads += 1

    def _check(self, read: Read, buf: memoryview | list[memoryview], leaf: fmt.ArrayLeaf) -> None:
        segments = [buf] if isinstance(buf, memoryview) else buf
        for c in read.checks:
            got = _crc_range(segments, c.start - read.start, c.end - read.start)
            if got != c.crc:
                raise CorruptCheckpointError(
                    f"{self.loc.path}: checksum mismatch in {self.index.files[read.file].name!r} bytes "
                    f"{c.start}..{c.end} (leaf {display_path(leaf.path, self.item)!r}): stored {c.crc:#010x}, "
                    f"computed {got:#010x}"
                )

    def do_read(self, read: Read, leaf: fmt.ArrayLeaf, dests: list[np.ndarray]) -> None:
        direct = read.direct
        if direct is not None:
            region = dests[direct.dest][_region(direct.dest_start, direct.shape)]
            if region.flags.c_contiguous:
                buf = memoryview(region.reshape(-1).view(np.uint8))
                self._fill(read.file, read.start, buf, leaf)
                self._check(read, buf, leaf)
                with self._lock:
                    self.stats.direct_reads += 1
                return
        if hasattr(self._reader(read.file), "read_into_many"):
            parts = _tiled_regions(read, dests)
            if parts is not None:  # consecutive whole regions: one vectored read, no copy
                self._fill(read.file, read.start, parts, leaf)
                self._check(read, parts, leaf)
                with self._lock:
                    self.stats.direct_reads += 1
                return
        raw = _scratch(read.nbytes)
        buf = memoryview(raw)  # type: ignore[arg-type]
        self._fill(read.file, read.start, buf, leaf)
        self._check(read, buf, leaf)
        for c in read.copies:
            src = np.ndarray(c.shape, dtype=leaf.dtype, buffer=raw, offset=c.src_offset, strides=c.src_strides)
            dests[c.dest][_region(c.dest_start, c.shape)] = src

    def read_array(self, want: _Want) -> tuple[list[Future[None]], list[np.ndarray], list[Box], Any]:
        leaf = want.leaf
        placement = None
        if want.sharding is None:
            boxes: list[Box] = [full_box(leaf.shape)]
        else:
            from ._jaxutil import slices_to_box

            dmap = want.sharding.addressable_devices_indices_map(leaf.shape)
            by_box: dict[Box, list[Any]] = {}
            for device, index in dmap.items():
                by_box.setdefault(slices_to_box(index, leaf.shape), []).append(device)
            boxes = list(by_box)
            placement = by_box
        reads = plan_reads(leaf, boxes, self.index.block_size, self.verify)
        for file in sorted({r.file for r in reads}):
            self._reader(file)  # checks the files first: a false size claim allocates nothing
        try:
            dests = [aligned_empty(tuple(hi - lo for lo, hi in b), leaf.dtype) for b in boxes]
        except MemoryError:
            nbytes = sum(math.prod(hi - lo for lo, hi in b) for b in boxes) * leaf.dtype.itemsize
            raise CheckpointError(
                f"{self.loc.path}: cannot allocate {nbytes} bytes for leaf "
                f"{display_path(leaf.path, self.item)!r} of shape {leaf.shape}"
            ) from None
        futures = [self.pool.submit(self.do_read, r, leaf, dests) for r in reads]
        return futures, dests, boxes, placement

    def read_bytes(self, leaf: fmt.ArrayLeaf) -> bytes:
        futures, dests, _, _ = self.read_array(_Want(leaf, leaf.dtype, None))
        for f in futures:
            f.result()
        return dests[0].tobytes()


_local = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """This reader thread's temporary buffer, reused from read to read.

    A fresh buffer per read costs first-touch page faults on every read, which
    on some hosts is slower than the read itself. The buffer lives as long as
    the load's thread pool.
    """
    buf = getattr(_local, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        _local.buf = buf
    return buf[:nbytes]


_MIN_RUN = 4096  # a destination row shorter than this is cheaper to fill by a copy
_MAX_PARTS = 1 << 16


def _tiled_regions(read: Read, dests: list[np.ndarray]) -> list[memoryview] | None:
    """Destination byte views that a vectored read can fill in place, in file order.

    The copies, in source order, must cover the read exactly, each contiguous in
    the file. A destination region that is not contiguous (a block of columns of
    the target shard, as when resharding) is split into its rows, provided rows
    are long enough for a vectored read to beat a read into a buffer plus a
    copy. Returns None when that does not apply.
    """
    out: list[memoryview] = []
    pos = 0
    for c in sorted(read.copies, key=lambda c: c.src_offset):
        if c.src_offset != pos or not is_c_contiguous(c.shape, c.src_strides):
            return None
        region = dests[c.dest][_region(c.dest_start, c.shape)]
        if region.flags.c_contiguous:
            out.append(memoryview(region.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
        else:
            if region.ndim < 2 or region.strides[-1] != region.itemsize:
                return None
            if region.shape[-1] * region.itemsize < _MIN_RUN:
                return None
            if len(out) + int(np.prod(region.shape[:-1])) > _MAX_PARTS:
                return None
            for idx in np.ndindex(*region.shape[:-1]):
                out.append(memoryview(region[idx].view(np.uint8)))  # type: ignore[arg-type]
        pos += c.nbytes
    return out if pos == read.nbytes else None


def _crc_range(segments: list[memoryview], start: int, end: int) -> int:
    """CRC-32C of bytes [start, end) of the concatenation of `segments`."""
    value, pos = 0, 0
    for seg in segments:
        lo, hi = max(start - pos, 0), min(end - pos, len(seg))
        if lo < hi:
            value = crc32c(seg[lo:hi], value)
        pos += len(seg)
        if pos >= end:
            break
    return value


def _region(start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[Any, ...]:
    # `...` keeps a 0-d selection a view (indexing with () would return a scalar copy).
    return tuple(slice(s, s + n) for s, n in zip(start, shape)) or (Ellipsis,)


def _assemble(want: _Want, dests: list[np.ndarray], boxes: list[Box], placement: Any) -> Any:
    if want.sharding is None:
        out = dests[0]
        return out if out.dtype == want.dtype else out.astype(want.dtype)
    import jax

    arrays = []
    devices_in_order = []
    for box, dest in zip(boxes, dests):
        host = dest if dest.dtype == want.dtype else dest.astype(want.dtype)
        for device in placement[box]:
            arrays.append(jax.device_put(host, device))
            devices_in_order.append(device)
    return jax.make_array_from_single_device_arrays(want.leaf.shape, want.sharding, arrays)


# ---------------------------------------------------------------------- load


def load(
    loc: Location,
    target: Any = None,
    *,
    partial: bool = False,
    verify: bool = True,
    threads: int = 8,
    budget_bytes: int = 1 << 30,
    stats: LoadStats | None = None,
) -> Any:
    """Load the checkpoint at `loc` (see `cairn.load`)."""
    manifest = read_manifest(loc)
    release_snapshot_buffers()  # a cache for repeated async saves; the load needs the memory
    stats = stats if stats is not None else LoadStats()
    if manifest.root:
        requests = [("", target)]
    elif target is None:
        requests = [(name, None) for name in manifest.items]
    elif isinstance(target, Mapping):
        unknown = [k for k in target if k not in manifest.items]
        if unknown:
            raise MismatchError(
                f"{loc.path}: the target asks for checkpointables {unknown} that the checkpoint does not "
                f"hold (it holds {sorted(manifest.items)})"
            )
        requests = list(target.items())
    else:
        raise MismatchError(
            f"{loc.path}: the checkpoint holds named checkpointables {sorted(manifest.items)}; "
            "pass a mapping from (some of) those names to targets"
        )
    out: dict[str, Any] = {}
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="cairn-read") as pool:
        # Indexes are independent small reads: fetch them together (one round trip on object stores).
        indexes = list(pool.map(lambda r: read_index(loc, manifest.items[r[0]]), requests))
        items = []
        try:
            for (name, item_target), index in zip(requests, indexes):
                reader = _Reader(loc, name, manifest.items[name], index, verify, pool, stats)
                items.append(_ItemLoad(name, index, reader, item_target,
                                       _match(loc, name, index, item_target, partial)))
            # One pipeline over the leaves of every requested checkpointable, so that
            # many small checkpointables keep the readers as busy as one large one.
            _read_leaves(items, loc.path, budget_bytes)
        finally:
            for it in items:
                it.reader.close()
        for it in items:
            out[it.name] = it.output()
    return out[""] if manifest.root else out


@dataclass
class _ItemLoad:
    """One requested checkpointable: its index, reader, target and what it wants."""

    name: str
    index: fmt.ItemIndex
    reader: _Reader
    target: Any
    wanted: dict[int, _Want | None]
    results: dict[int, Any] = field(default_factory=dict)

    def output(self) -> Any:
        if self.target is None:
            return unflatten(self.index.structure, self.results)
        by_path = {leaf.path: i for i, leaf in enumerate(self.index.leaves)}
        return map_with_path(lambda path, _t: self.results[by_path[path]], self.target, is_leaf=_is_target_leaf)


def _match(loc: Location, name: str, index: fmt.ItemIndex, target: Any, partial: bool) -> dict[int, _Want | None]:
    """Which stored leaves to load, and how: the target's leaves (all of them without a target)."""
    where = loc.path
    if target is None:
        return {i: None for i in range(len(index.leaves))}
    by_path = {leaf.path: i for i, leaf in enumerate(index.leaves)}
    wanted: dict[int, _Want | None] = {}

    def note(path: str, t: Any) -> Any:
        i = by_path.get(path)
        if i is None:
            raise MismatchError(
                f"{where}: leaf {display_path(path, name)!r} of the target is not in the checkpoint"
            )
        leaf = index.leaves[i]
        wanted[i] = _want_for(t, leaf, where, name) if isinstance(leaf, fmt.ArrayLeaf) else None
        return t

    map_with_path(note, target, is_leaf=_is_target_leaf)
    missing = [leaf.path for i, leaf in enumerate(index.leaves) if i not in wanted]
    if missing and not partial:
        shown = ", ".join(repr(display_path(p, name)) for p in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise MismatchError(
            f"{where}: the checkpoint has leaves the target omits: {shown}{more}; "
            "pass partial=True to load only the target's leaves"
        )
    return wanted


def _is_target_leaf(x: Any) -> bool:
    return _is_sharding(x) or type(x).__name__ == "ShapeDtypeStruct" or isinstance(x, ArrayMetadata)


def _read_leaves(items: list[_ItemLoad], where: str, budget: int) -> None:
    """Fill every item's `results`, with at most about `budget` bytes of buffers in flight."""
    inflight: deque[tuple[_ItemLoad, int, _Want, list[Future[None]], list[np.ndarray], list[Box], Any]] = deque()
    inflight_bytes = 0

    def finish() -> None:
        nonlocal inflight_bytes
        it, i, want, futures, dests, boxes, placement = inflight.popleft()
        try:
            for f in futures:
                f.result()
        except BaseException:
            for entry in inflight:
                for f in entry[3]:
                    f.cancel()
            raise
        it.results[i] = _assemble(want, dests, boxes, placement)
        inflight_bytes -= sum(d.nbytes for d in dests)

    for it in items:
        for i in sorted(it.wanted):
            leaf = it.index.leaves[i]
            if isinstance(leaf, fmt.ValueLeaf):
                it.results[i] = leaf.value
                continue
            if leaf.kind in ("bytes", "object"):
                data = it.reader.read_bytes(leaf)
                if leaf.kind == "bytes":
                    it.results[i] = data
                else:
                    h = handler_named(leaf.handler or "")
                    if h is None:
                        raise CheckpointError(
                            f"{where}: leaf {display_path(leaf.path, it.name)!r} was saved by handler "
                            f"{leaf.handler!r}; register it with cairn.register_type before loading"
                        )
                    it.results[i] = h.load(data)
                continue
            want = it.wanted[i] or _Want(leaf, leaf.dtype, None)
            futures, dests, boxes, placement = it.reader.read_array(want)
            inflight.append((it, i, want, futures, dests, boxes, placement))
            inflight_bytes += sum(d.nbytes for d in dests)
            while len(inflight) > 1 and inflight_bytes > budget:
                finish()
    while inflight:
        finish()


# ---------------------------------------------------------------------- metadata


def metadata(loc: Location) -> Any:
    """The stored tree with `ArrayMetadata` in place of arrays; reads no array data."""
    manifest = read_manifest(loc)
    out = {}
    for name, info in manifest.items.items():
        index = read_index(loc, info)
        leaves = []
        for leaf in index.leaves:
            if isinstance(leaf, fmt.ArrayLeaf):
                leaves.append(ArrayMetadata(leaf.shape, leaf.dtype, leaf.nbytes, leaf.sharding, leaf.kind))
            else:
                leaves.append(leaf.value)
        out[name] = unflatten(index.structure, leaves)
    return out[""] if manifest.root else out


__all__ = ["ArrayMetadata", "LoadStats", "load", "metadata", "read_index", "read_manifest"]
