"""The load engine: match the target, read the arrays, build numpy or jax arrays.

The manifest and indexes are read by `_metadata`; the reads of each
checkpointable are planned by `_plan` and run by `_reader.ChunkReader`
(checksums verified, direct reads into the final buffers where possible).
What is left here is choosing which stored leaves to load and how, keeping
the bytes in flight under the budget, and handing the host buffers to JAX.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from .._core import stats as _stats
from .._core.buffers import release_save_buffers
from .._core.gcpause import paused
from .._dist.agree import sequence
from .._dist.coord import Coordinator, activity, default_coordinator
from .._errors import CheckpointError, MismatchError
from .._format import manifest as fmt
from .._read.metadata import read_index, read_manifest
from .._storage.location import Location
from .._tree.leaves import check_key_target, handler_named, is_key_dtype, key_dtype, wrap_key
from .._tree.perprocess import LoadView
from .._tree.pytree import display_path, map_with_path, unflatten
from .._tree.shardings import WHOLE_PUT_BYTES, concrete_sharding, misfit, on_mesh, puts_whole
from . import casts
from .decodepool import stop_threads as stop_decoders
from .landing import in_scope
from .options import LoadOptions, options_of
from .plan import Limits, Plan, plan
from .prefetch import prefetch
from .reader import ArrayReads, ChunkReader, LoadStats
from .readonce import (
    MAX_READ,
    Agreement,
    Bandwidths,
    bandwidths_for,
    platform_of,
    resolve_bandwidths,
    routes_digest,
)
from .schedule import schedule
from .source import Source, checkpointables
from .waves import Gather, Unit


@dataclass(frozen=True)
class ArrayMetadata:
    """What `cairn.metadata` reports for a stored array (no data is read).

    It can also serve as a load target leaf: the array comes back as a numpy
    array of the saved dtype.
    """

    shape: tuple[int, ...]
    dtype: Any  # a numpy dtype; for typed PRNG keys, the JAX key dtype (key shape, not key-data shape)
    nbytes: int
    sharding: dict[str, Any] | None = None
    kind: str = "array"
    impl: str | None = None  # kind "prng_key": the key implementation, e.g. "threefry2x32"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def _of(cls, shape: tuple[int, ...], dtype: Any, nbytes: int, sharding: dict[str, Any] | None,
            kind: str) -> ArrayMetadata:
        """`ArrayMetadata(shape, dtype, nbytes, sharding, kind)`, without a frozen dataclass's
        ``object.__setattr__`` per field (`cairn.metadata` builds one per leaf)."""
        m = object.__new__(cls)
        m.__dict__.update(shape=shape, dtype=dtype, nbytes=nbytes, sharding=sharding, kind=kind, impl=None)
        return m


# ---------------------------------------------------------------------- targets


@dataclass
class _Want:
    """How one stored array leaf should come back."""

    leaf: fmt.ArrayLeaf
    dtype: np.dtype
    sharding: Any = None  # a jax Sharding, or None for a numpy array
    result: Any = None
    key_impl: str | None = None  # wrap the loaded key data as typed keys of this implementation


def _is_sharding(x: Any) -> bool:
    if not type(x).__module__.startswith(("jax", "jaxlib")):
        return False
    import jax

    return isinstance(x, jax.sharding.Sharding)


def _want_for(target: Any, leaf: fmt.ArrayLeaf, where: str, item: str) -> _Want | None:
    """Interpret a target leaf for stored array `leaf`; None means "as saved, numpy"."""
    if leaf.kind == "prng_key" and (_is_sharding(target) or is_key_dtype(getattr(target, "dtype", None))):
        # Typed keys, read as key data onto the key sharding (the trailing data axes whole, as
        # jax.random.key_data lays them out); an ArrayMetadata target loads numpy: the key data.
        check_key_target(target, leaf, f"{where}: leaf {display_path(leaf.path, item)!r}")
        if isinstance(target, ArrayMetadata):
            return _Want(leaf, leaf.dtype, None)
        sharding = target if _is_sharding(target) else getattr(target, "sharding", None)
        sharding = concrete_sharding(sharding, f"{where}: leaf {display_path(leaf.path, item)!r}")
        return _Want(leaf, leaf.dtype, sharding if sharding is not None else _default_sharding(), key_impl=leaf.impl)
    if leaf.kind not in ("array", "prng_key"):  # other targets of a key leaf get its uint32 key data
        return None
    if _is_sharding(target):
        return _Want(leaf, leaf.dtype, concrete_sharding(target, f"{where}: leaf {display_path(leaf.path, item)!r}"))
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
    return _Want(leaf, out_dtype, concrete_sharding(sharding, f"{where}: leaf {display_path(leaf.path, item)!r}"))


def _default_sharding() -> Any:
    import jax

    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _wrap_keys(it: _ItemLoad, where: str) -> None:
    """Typed keys back from the key data read for key targets."""
    for i, want in it.wanted.items():
        if want is not None and want.key_impl is not None:
            shown = display_path(want.leaf.path, it.name)
            it.results[i] = wrap_key(it.results[i], want.key_impl, f"{where}: leaf {shown!r}")


def _cast(host: np.ndarray, want: _Want, it: _ItemLoad, where: str) -> np.ndarray:
    """`host` in the target's dtype; a cast that would change values needs ``cast="unsafe"`` (`casts`)."""
    if host.dtype == want.dtype:
        return host
    return casts.cast(host, want.dtype, f"{where}: leaf {display_path(want.leaf.path, it.name)!r}", it.cast == "unsafe")


def _assemble(want: _Want, reads: ArrayReads, it: _ItemLoad, where: str, shape: tuple[int, ...] | None = None) -> Any:
    if want.sharding is None:
        return _cast(reads.dests[0], want, it, where)
    import jax

    assert reads.placement is not None  # read with a sharding
    hosts, devices = [], []
    for box, dest in zip(reads.boxes, reads.dests):
        host = _cast(dest, want, it, where)
        for device in reads.placement[box]:
            hosts.append(host)
            devices.append(device)
    arrays = jax.device_put(hosts, devices)  # one call for every shard (zero-copy on CPU, aligned buffers)
    return jax.make_array_from_single_device_arrays(shape or want.leaf.shape, want.sharding, arrays)


# ---------------------------------------------------------------------- load


def load(
    source: Source,
    target: Any = None,
    options: LoadOptions | None = None,
    *,
    stats: LoadStats | None = None,
    started: float | None = None,
    retried: int = 0,
    publish: bool = True,
    **changes: Any,
) -> Any:
    """Load the opened checkpoint `source` (see `cairn.load`; `_sources.registry.open_source` opens any
    path, `CairnSource.open` a cairn checkpoint) with `options` and keyword `changes` to them
    (`LoadOptions`' names).

    `stats` is reset, then filled in; `started` (a ``time.perf_counter()``
    value, default now) is when the caller's request began, `retried` the storage retries its opening
    took (counted in `stats.retries` with the load's own). With `publish`
    the stats are logged, sent to `jax.monitoring` and the listeners (`_core.stats`).
    """
    opts = options_of(options, changes)
    partial, verify, threads, bandwidths = opts.partial, opts.verify, opts.threads, opts.bandwidths
    t0 = time.perf_counter() if started is None else started
    if bandwidths is not None:
        resolve_bandwidths(bandwidths, "local", "cpu")  # a bad figure fails here, not at the first sharded leaf
    loc, manifest = source.loc, source.manifest
    retries = loc.storage.retries - retried
    release_save_buffers()  # a cache for repeated saves; the load needs the memory (its own buffers stay)
    stats = stats if stats is not None else LoadStats()
    vars(stats).update(vars(LoadStats()))  # the numbers of this load only
    requests = checkpointables(loc.path, manifest.items, manifest.root, target)
    out: dict[str, Any] = {}
    with reader_pool(max(1, threads)) as pool:
        indexes = source.indexes_of([name for name, _ in requests], pool)
        items = []
        coord = opts.coordinator or default_coordinator()
        try:
            for (name, item_target), index in zip(requests, indexes):
                reader = source.reader(name, index, verify, pool, stats)
                pp = LoadView(index.structure, name, loc.path, coord.process_index, coord.process_count)
                items.append(_ItemLoad(name, index, reader, item_target,
                                       match_target(loc, name, index, item_target, partial, pp, opts.mesh), pp,
                                       cast=opts.cast))
            # One pipeline over the leaves of every requested checkpointable, so that
            # many small checkpointables keep the readers as busy as one large one.
            activity.begin(f"loading {loc.path}")
            stats.plan_s = time.perf_counter() - t0  # _read_leaves adds its own planning
            try:
                _read_leaves(items, loc.path, opts.budget_bytes,
                             _Routing(opts.read_once, coord, opts.timeout, bandwidths, loc.storage))
            finally:
                activity.end()
        finally:
            for it in items:
                it.reader.release()
        for it in items:
            _wrap_keys(it, loc.path)
            out[it.name] = it.output()
    stats.retries = loc.storage.retries - retries
    stats.total_s = time.perf_counter() - t0
    _measure_reads(loc, items, stats)
    if publish:
        _stats.loaded(loc.path, stats)
    return out[""] if manifest.root else out


def reader_pool(threads: int) -> ThreadPoolExecutor:
    """The threads a load reads with: its share of long-lived threads of this process (`_LoadPool`),
    whatever the storage. (Typed as the pool it stands in for: the readers only submit and map.)"""
    return cast(ThreadPoolExecutor, _LoadPool(_shared_pool(threads)))


class _LoadPool(Executor):
    """One load's share of a long-lived pool: its tasks run on threads started by an earlier load.

    A pool of its own per load starts a thread for each task sent while none is idle, and
    ``Thread.start`` waits until the new thread runs: on a busy host (the benchmark VM, two cores
    shared with the emulator) 35-58 ms each, in the middle of sending the GETs (the per-GET timeline
    of a numpy load of 256 MiB from moto: the last file's GET left 120-140 ms after the first). And
    the scratch buffers its threads read into (`landing.scratch`) are held for the load, then go back
    to `buffers.load_pool` for the next one, not freed with the threads: on the TPU host a compressed
    load from local files whose threads came new, with new buffers, took 1.25 s, 0.80 s on kept ones
    (measured on the TPU host). Leaving the load waits for every
    task it sent (as leaving a pool of its own did), so none runs on after it.
    """

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._futures: list[Future[Any]] = []
        self._lock = threading.Lock()
        self._scratch: dict[Any, Any] = {}  # the reader threads' scratch buffers while they run this load's tasks

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        f = self._pool.submit(in_scope, self._scratch, fn, *args, **kwargs)
        with self._lock:
            self._futures.append(f)
        return f

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        while True:  # (a task may send more while the load waits for it)
            with self._lock:
                futures, self._futures = self._futures, []
            if not futures:
                break
            if cancel_futures:
                for f in futures:
                    f.cancel()
            if not wait:
                return
            wait_all(futures)
        self._scratch.clear()


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _shared_pool(threads: int) -> ThreadPoolExecutor:
    """This process's long-lived pool of `threads` reader threads (one per size asked for)."""
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix=f"cairn-read{threads}")
        return pool


def stop_threads() -> None:
    """Stop this process's idle load threads (readers, decoders, the prefault thread), waiting for any work
    they run; the next load starts new ones. Loads leave them running, idle, for the next load (`_LoadPool`):
    a process about to fork that wants no thread of cairn's in it (the fault tests' fork server) calls this
    first. (A forked child never uses its parent's: it starts its own, `_forget_pools`.)"""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.shutdown(wait=True)
    stop_decoders()


def _forget_pools() -> None:  # a forked child has none of its parent's threads: it starts its own
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def _measure_reads(loc: Location, items: list[_ItemLoad], stats: LoadStats) -> None:
    """Record what this load's reads reached over the storage's link, for the next saves'
    compression="auto" (`_storage.measured`): bytes read over the read time. Where any leaf read
    was compressed, its decoding ran inside the read time, so the figure is only a lower bound."""
    from .._storage.measured import MIN_SAMPLE_BYTES, link_of, main_codec, record, sample_of

    try:
        if stats.bytes_read < MIN_SAMPLE_BYTES or link_of(loc.storage) is None:
            return  # nothing to record (a local disk, a small load): no walk over the leaves
        by_codec: dict[str, int] = {}
        for it in items:
            for leaf in it.index.leaves:
                c = getattr(leaf, "codec", "none")
                if c != "none":
                    by_codec[c] = by_codec.get(c, 0) + getattr(leaf, "nbytes", 0)
        record(loc.storage, "read", sample_of(stats.bytes_read, stats.read_s, stats.read_s, bool(by_codec),
                                              main_codec(by_codec)))
    except Exception:
        logging.getLogger("cairn").warning("cairn: could not record the load's bandwidth", exc_info=True)


@dataclass
class _ItemLoad:
    """One requested checkpointable: its index, reader, target and what it wants."""

    name: str
    index: fmt.ItemIndex
    reader: ChunkReader
    target: Any
    wanted: dict[int, _Want | None]
    pp: LoadView  # its per-process values (`_perprocess`)
    results: dict[int, Any] = field(default_factory=dict)
    cast: str = "safe"  # `LoadOptions.cast`

    def output(self) -> Any:
        if self.target is None:
            return unflatten(self.index.structure, self.results, per_process=self.pp.pick)
        by_path = {leaf.path: i for i, leaf in enumerate(self.index.leaves)}
        return map_with_path(lambda path, t: self.pp.value(path, t, self.results) if path in self.pp.nodes
                             else self.results[by_path[path]], self.target, is_leaf=is_target_leaf)


def match_target(loc: Location, name: str, index: fmt.ItemIndex, target: Any, partial: bool,
                 pp: LoadView, mesh: Any = None) -> dict[int, _Want | None]:
    """Which stored leaves to load, and how: the target's leaves (all of them without a target). The one
    matcher of a target against an index: the load, the dry run and the sources' target paths use it.
    With `mesh`, an array the target gives no sharding takes its saved PartitionSpec on `mesh`."""
    where = loc.path
    wanted: dict[int, _Want | None] = {}

    def want(i: int, t: Any) -> None:
        leaf = index.leaves[i]
        if not isinstance(leaf, fmt.ArrayLeaf):
            wanted[i] = None
            return
        saved = leaf.sharding if mesh is not None and (t is None or isinstance(t, ArrayMetadata) or (
            type(t).__name__ == "ShapeDtypeStruct" and getattr(t, "sharding", None) is None)) else None
        if saved is not None:
            s = on_mesh(saved, mesh, f"{where}: leaf {display_path(leaf.path, name)!r}")
            t = s if t is None or isinstance(t, ArrayMetadata) else type(t)(t.shape, t.dtype, sharding=s)
        wanted[i] = w = _want_for(t, leaf, where, name)
        if w is not None and w.sharding is not None and w.key_impl is None and (
                why := misfit(w.sharding, w.leaf.shape)) is not None:
            whose = "its saved PartitionSpec on the mesh given" if saved is not None else "the target's sharding"
            raise MismatchError(f"{where}: leaf {display_path(leaf.path, name)!r}: {whose} does not fit "
                                f"the checkpoint's array: {why}")

    if target is None:
        every = pp.all_leaves(len(index.leaves))  # other processes' per-process values left out
        if mesh is None:
            return every
        for i, w in every.items():
            if getattr(index.leaves[i], "sharding", None) is not None:
                want(i, None)
            else:
                wanted[i] = w  # saved from numpy (or per process): numpy, as without a mesh
        return wanted
    by_path = {leaf.path: i for i, leaf in enumerate(index.leaves)}

    def note(path: str, t: Any) -> Any:
        if pp.claims(path, t, wanted):
            return t
        i = by_path.get(path)
        if i is None:
            raise MismatchError(
                f"{where}: leaf {display_path(path, name)!r} of the target is not in the checkpoint "
                "(fill_missing=True keeps the target's own value there)"
            )
        want(i, t)
        return t

    map_with_path(note, target, is_leaf=is_target_leaf)
    missing = [leaf.path for i, leaf in enumerate(index.leaves) if i not in wanted and i not in pp.covered]
    if missing and not partial:
        shown = ", ".join(repr(display_path(p, name)) for p in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise MismatchError(
            f"{where}: the checkpoint has leaves the target omits: {shown}{more}; "
            "pass partial=True to load only the target's leaves"
        )
    return wanted


def is_target_leaf(x: Any) -> bool:
    return _is_sharding(x) or type(x).__name__ == "ShapeDtypeStruct" or isinstance(x, ArrayMetadata)


@dataclass(frozen=True)
class _InFlight:
    """One array being read: whose leaf it is, how it should come back, and its reads."""

    item: _ItemLoad
    leaf: int  # its position in the item's index
    want: _Want
    reads: ArrayReads


@dataclass
class _Routing:
    read_once: bool | None
    coord: Coordinator
    timeout: float
    declared: Any = None  # load(bandwidths=...)
    storage: Any = None
    _resolved: dict[str, Bandwidths] = field(default_factory=dict)

    def bandwidths(self, sharding: Any) -> Bandwidths:
        """The figures routes onto `sharding` are priced with (per platform: one load could mix them)."""
        platform = platform_of(sharding)
        if platform not in self._resolved:
            self._resolved[platform] = bandwidths_for(self.declared, self.storage, sharding, self.coord, self.timeout)
        return self._resolved[platform]

    @property
    def max_read(self) -> int:
        return self.storage.preferred_read or MAX_READ

    @property
    def limits(self) -> Limits:
        return Limits.of(self.storage)


def _read_leaves(items: list[_ItemLoad], where: str, budget: int, routing: _Routing) -> None:
    """Fill every item's `results`, with at most about `budget` bytes of buffers in flight.

    Plan, then execute: the schedule (every sharded leaf's route, the read-once
    leaves in waves) and this process's `plan.Plan` (its direct pipeline and
    every storage request) are data, computed from metadata alone as the dry
    run computes them for every process; `_execute` carries the plan out.
    """
    t0 = time.perf_counter()
    n = routing.coord.process_count
    # Stats record the figures only where they decide the route (read_once=None).
    sched = schedule(items, n, routing.read_once,
                     lambda sharding: routing.bandwidths(sharding) if routing.read_once is None else None,
                     routing.max_read, budget)
    reads: dict[int, dict[int, Any]] = {id(it): {} for it in items}  # the sharding each leaf is read with
    for r in sched.routed:
        leaf = r.item.index.leaves[r.leaf]
        note_route(r.item.reader.stats, display_path(leaf.path, r.item.name), r.route, r.bandwidths)
        if not r.route.direct:
            reads[id(r.item)][r.leaf] = r.route.read
        elif not (leaf.nbytes <= WHOLE_PUT_BYTES and puts_whole(r.want.sharding)):
            reads[id(r.item)][r.leaf] = r.want.sharding  # (absent: read whole)
    tabled = [it for it in items if it.index.table is not None]
    if len(tabled) > 1 and tabled[0].reader.loc.storage.preferred_read:
        # Storages that charge per request: each item's records are a round trip of their own, fetched
        # together as the indexes were (local files: in turn, faster than threads taking turns at the GIL).
        list(tabled[0].reader.pool.map(lambda it: prefetch(it.index, it.wanted, reads[id(it)]), tabled))
    else:
        for it in tabled:
            prefetch(it.index, it.wanted, reads[id(it)])
    with paused():  # thousands of small objects per load: no full collection in the middle (`gcpause`)
        own = plan(items, sched, budget, routing.limits, routing.coord.process_index, own=True)
    for it in items[:1]:  # every item's reader shares the load's stats
        it.reader.stats.plan_s += time.perf_counter() - t0
    _execute(own, items, where, routing)


def _execute(own: Plan, items: list[_ItemLoad], where: str, routing: _Routing) -> None:
    """Carry out this process's plan: its direct pipeline, then its read-once waves, each behind a
    status exchange, since their collectives need every process."""
    agreement: Agreement | None = None
    waves = own.schedule.waves
    try:
        if waves:
            digest = routes_digest([(s.item.name, s.leaf, s.route.kind, len(s.pieces)) for s in own.schedule.staged])
            agreement = Agreement(routing.coord, sequence("load"), len(waves), where, routing.timeout, digest)
        _read_direct(items, where, own)
        gathers: dict[int, Gather] = {}
        for k, wave in enumerate(waves):
            assert agreement is not None
            _run_wave(k, wave, agreement, gathers)
    except BaseException as e:
        if agreement is not None:
            agreement.fail(e)
        raise


def note_route(stats: LoadStats, path: str, r: Any, bandwidths: Bandwidths | None) -> None:
    """Count the route of one array leaf in `stats`: its kind, and the interconnect bytes this
    process is predicted to receive (the route's total over its processes, an equal share each)."""
    stats.routes[r.kind] = stats.routes.get(r.kind, 0) + 1
    stats.leaf_routes[path] = r.kind
    if not r.direct:
        stats.interconnect_bytes += -(-r.interconnect // max(r.processes, 1))
    if bandwidths is not None and stats.bandwidths is None:
        stats.bandwidths = bandwidths.as_dict()


def _run_wave(k: int, wave: list[Unit], agreement: Agreement, gathers: dict[int, Gather]) -> None:
    import jax

    t_read = time.perf_counter()
    stats = wave[0][0].item.reader.stats
    before = stats.bytes_read
    regions = [s.region(j) for s, j in wave]
    reads = [s.item.reader.read_array(s.want.leaf, s.route.read, region) for (s, _), region in zip(wave, regions)]
    for s, _ in wave:
        s.item.reader.start_prefault()
    for r in reads:
        for f in r.futures:
            f.result()
    t_assemble = time.perf_counter()
    xs = [_assemble(_Want(s.want.leaf, s.want.dtype, s.route.read), r, s.item, agreement.path,
                    None if region is None else tuple(hi - lo for lo, hi in region))
          for (s, _), r, region in zip(wave, reads, regions)]
    del reads
    t0 = time.perf_counter()
    agreement.ok(k)  # every process has its blocks: the collectives below cannot strand anyone
    for depth in range(max(len(s.route.steps) for s, _ in wave)):
        moving = [j for j, (s, _) in enumerate(wave) if depth < len(s.route.steps)]
        moved = jax.device_put([xs[j] for j in moving], [wave[j][0].route.steps[depth] for j in moving])
        for j, x in zip(moving, moved):
            xs[j] = x  # the previous step's array is released here
    jax.block_until_ready(xs)
    stats.read_once_bytes_read += stats.bytes_read - before
    stats.read_s += t_assemble - t_read
    stats.transfer_s += t0 - t_assemble
    stats.reshard_s += time.perf_counter() - t0
    for (s, piece), x, region in zip(wave, xs, regions):
        if piece is None:
            s.item.results[s.leaf] = x
            stats.read_once_leaves += 1
            continue
        key = id(s)
        if key not in gathers:
            gathers[key] = Gather(s)
        gathers[key].add(x, region)
        stats.read_once_pieces += 1
        if piece == len(s.pieces) - 1:
            s.item.results[s.leaf] = gathers.pop(key).finish()
            stats.read_once_leaves += 1


#: The loading thread places the small leaves waiting for a batched put (`PutBatch`) before it waits for
#: a read that is still out, once this many of them (or `EARLY_PUT_BYTES`) wait: their transfers then
#: overlap the reads, where before they were all placed after the last read.
EARLY_PUT_ITEMS = 32
EARLY_PUT_BYTES = 4 << 20


def _read_direct(items: list[_ItemLoad], where: str, own: Plan) -> None:
    """The direct pipeline: each process reads its own target boxes, in the plan's order, completing
    arrays in flight where the plan says (its byte budget)."""
    from .._tree.shardings import PutBatch

    inflight: deque[_InFlight] = deque()
    puts = PutBatch()  # small leaves read whole, placed together
    t_start, transfer = time.perf_counter(), 0.0  # the rest of this pipeline's time is reading
    noted: deque[ChunkReader] = deque()  # readers with fresh buffers to map (not every item's: thousands)
    for it in items:
        it.reader.on_noted = noted.append

    def finish() -> None:
        nonlocal transfer
        while noted:  # the reads so far are out: map their buffers' pages while they arrive
            noted.popleft().start_prefault()
        done = inflight.popleft()
        n, nbytes = puts.pending
        try:
            if (n >= EARLY_PUT_ITEMS or nbytes >= EARLY_PUT_BYTES) and not all(f.done() for f in done.reads.futures):
                t = time.perf_counter()
                puts.flush()  # placed while this read is still out, not after the last one
                transfer += time.perf_counter() - t
            for f in done.reads.futures:
                f.result()
        except BaseException:
            for entry in inflight:
                for f in entry.reads.futures:
                    f.cancel()
            raise
        t = time.perf_counter()
        if done.reads.placement is None and done.want.sharding is not None:  # read whole: a batched put
            host = done.reads.dests[0]
            host = _cast(host, done.want, done.item, where)
            puts.add(done.item.results, done.leaf, host, done.want.sharding)
        else:
            done.item.results[done.leaf] = _assemble(done.want, done.reads, done.item, where)
        transfer += time.perf_counter() - t

    for step in own.steps:
        it, i = items[step.item], step.leaf
        leaf = it.index.leaves[i]
        if isinstance(leaf, fmt.ValueLeaf):  # step.kind "value"
            it.results[i] = leaf.value
            continue
        if step.kind == "bytes":
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
        inflight.append(_InFlight(it, i, want, it.reader.read_array(want.leaf, step.sharding, planned=step.reads)))
        for _ in range(step.finish):
            finish()
    for it in items:  # the last runs of small arrays read while the first ones are placed
        it.reader.submit_pending()
        it.reader.start_prefault()
    while inflight:
        finish()
    t = time.perf_counter()
    puts.flush()
    for it in items[:1]:  # every item's reader shares the load's stats
        it.reader.stats.read_s += t - t_start - transfer
        it.reader.stats.transfer_s += transfer + time.perf_counter() - t


# ---------------------------------------------------------------------- metadata


def metadata(source: Source, per_process: Callable[[list[Any], Callable[[Any], Any]], Any] | None = None) -> Any:
    """The stored tree of `source` with `ArrayMetadata` in place of arrays; reads no array data. A
    per-process node is the list of every saved process's value, or what ``per_process(children, build)``
    makes of it."""
    manifest = source.manifest
    out = {}
    for name, index in zip(manifest.items, source.indexes_of(list(manifest.items), None)):
        leaves = []
        for leaf in index.leaves:
            if isinstance(leaf, fmt.ArrayLeaf) and leaf.kind == "prng_key":
                dtype = key_dtype(leaf.impl or "")  # None without JAX: then the key data is described
                shape = leaf.key_shape if dtype is not None else leaf.shape
                leaves.append(ArrayMetadata(shape, dtype or leaf.dtype, leaf.nbytes, leaf.sharding, leaf.kind, leaf.impl))
            elif isinstance(leaf, fmt.ArrayLeaf):
                leaves.append(ArrayMetadata._of(leaf.shape, leaf.dtype, leaf.nbytes, leaf.sharding, leaf.kind))
            else:
                leaves.append(leaf.value)
        out[name] = unflatten(index.structure, leaves, per_process=per_process)
    return out[""] if manifest.root else out


__all__ = ["ArrayMetadata", "load", "metadata", "read_index", "read_manifest"]
