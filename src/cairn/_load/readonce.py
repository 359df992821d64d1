"""Read-once restore: each byte of a checkpoint leaves storage once, whatever the target.

When every process reads the bytes of its own target shards (the direct
path), a target replicated over R processes reads each byte R times, and a
target cut across the saved chunks (rows saved, columns wanted) reads whole
chunks for a few strided columns each. Storage bandwidth is what a restore
at scale often waits for, where the device interconnect is far faster. So for each array
leaf every process computes, from the index and the target sharding alone
(no communication), the same *route*:

- **direct**: every process reads its own target boxes (same sharding,
  reshards along chunk boundaries, one process, or wherever re-reading is
  faster than the interconnect): nothing changes.
- **refined**: the target with its replicated mesh axes folded onto an array
  axis, so that each device holds a distinct block. Each process reads its
  blocks; one all-gather over the folded axes (`jax.device_put` to the
  target) builds the replicas.
- **staged**: the array cut into one block per device along its leading
  divisible axis (contiguous runs of the saved C-order chunks). Each process
  reads its blocks; XLA moves them to the refined sharding (an all-to-all
  between two fully tiled shardings) and then to the target (an all-gather).
  Going through the refined sharding keeps XLA from replicating the whole
  array on every device, which it does for some direct transitions.

Each route is priced in seconds (`_plan.routes`): its storage bytes and
requests at the storage's bandwidth, plus the bytes the collectives bring
in from other processes at the interconnect's, with bandwidths declared
(``load(bandwidths=...)``) or defaults per storage kind and JAX platform.
The cheapest wins; ties go to fewer collectives. ``read_once=True`` takes
the route reading the fewest storage bytes, ``False`` always the direct one.

The transport is XLA's collectives on the devices, nothing of cairn's own.
Before any collective, the processes exchange a status through the
coordinator, so a process that failed to read (a corrupt chunk, a missing
file) fails the load on every process, named, instead of leaving the others
blocked in a collective; the first exchange also compares a digest of every
process's routes, so processes given different bandwidths fail alike.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._core.memo import Memo
from .._dist.agree import sequence
from .._dist.coord import Coordinator, agree, announce, drop_keys
from .._errors import (
    CheckpointError,
    CoordinationError,
    error_from_record,
    error_record,
    first_failure,
)
from .._format import manifest as fmt
from .._format.binindex import LazyStored, cells_in
from .._plan.estimate import estimate_read_work
from .._plan.leafreads import DEFAULT_MAX_READ
from .._plan.routes import (
    DIRECT_MAX,
    Bandwidths,
    Layout,
    Plan,
    choose,
    received_elements,
    resolve_bandwidths,
)

log = logging.getLogger("cairn")

#: A device's process: ``process_index`` unless the dry run simulates others.
ProcessOf = Callable[[Any], int]

# ---------------------------------------------------------------------- JAX shardings


@dataclass(frozen=True)
class Route:
    """How one array leaf is restored: which sharding each process reads, then the reshards."""

    read: Any  # the jax sharding whose addressable boxes this process reads
    steps: tuple[Any, ...]  # jax shardings to move through with jax.device_put, ending at the target
    cost: int  # storage bytes read, summed over processes (-1: not computed)
    kind: str = "direct"  # "direct" | "refined" | "staged"
    interconnect: int = 0  # bytes the collectives bring in from other processes, summed over processes
    processes: int = 1  # processes taking part
    plan: Plan | None = None  # the choice, with every route's figures (None: no choice was made)
    why: str = ""  # why no choice was made (read_once=False, one process, ...)

    @property
    def direct(self) -> bool:
        return not self.steps


#: Planned read size when the storage names none (the reader's).
MAX_READ = DEFAULT_MAX_READ


def route(leaf: fmt.ArrayLeaf, target: Any, block_size: int, verify: bool, process_count: int,
          read_once: bool | None, process_of: ProcessOf | None = None, bandwidths: Bandwidths | None = None,
          max_read: int = MAX_READ) -> Route:
    """The route of `leaf` onto `target` (a jax Sharding); the same on every process.

    With `bandwidths` (the same on every process) and ``read_once=None`` the
    cheapest route in seconds wins (`_plan.routes.choose`); without them, or
    with ``read_once=True``, the one reading the fewest storage bytes.
    `process_of` maps a device to its process (default: its ``process_index``);
    the dry run (`_dryrun`) plans for processes that are not there by passing its own.
    """
    if read_once is False:
        return Route(target, (), -1, why="read_once=False")
    if leaf.nbytes == 0 or not _is_named(target):
        return Route(target, (), -1, why="empty" if leaf.nbytes == 0 else "not a NamedSharding")
    if read_once is None and process_count == 1:
        return Route(target, (), -1, why="one process")  # one process deduplicates its own boxes already
    if process_count > 1 and len({_process(d, process_of) for d in target.device_set}) == 1:
        return Route(target, (), -1, why="process-local target")  # no other process takes part in its collectives
    # Models repeat a few (grid, sharding) pairs over hundreds of layers: decide each once.
    # A compressed leaf's costs depend on its own stored sizes, not only on its layout: never shared.
    coded = leaf.codec != "none"
    key: Any = None if coded else (leaf.grid, leaf.dtype.itemsize, target, block_size, verify, read_once,
                                   process_of, bandwidths, max_read)
    hit = _routes.get(key) if key is not None else None  # (None for an unhashable sharding: not remembered)
    if hit is not None:
        return hit
    target_layout = layout_of(target, leaf.shape)
    shardings = {target_layout: target}

    def sharding(layout: Layout) -> Any:
        if layout not in shardings:
            shardings[layout] = sharding_of(target, layout)
        return shardings[layout]

    def cost(layout: Layout) -> tuple[int, int, int]:
        return read_cost(leaf, sharding(layout), block_size, verify, max_read=max_read, process_of=process_of)

    def moved(a: Layout, b: Layout) -> int:
        return moved_bytes(sharding(a), sharding(b), leaf.shape, leaf.dtype.itemsize, process_of)

    processes = _representative(target, leaf.shape, process_of)[0]
    # Storage bytes are stored bytes: a compressed leaf's direct read is held against its stored size,
    # estimated from the blocks the direct read touches (their stored / raw bytes), so that no process
    # fetches the records of chunks it neither reads nor prices.
    nbytes = leaf.nbytes
    if coded:
        raw = read_cost(leaf, target, block_size, True, process_of=process_of, stored=False)[0]
        nbytes = round(leaf.nbytes * cost(target_layout)[0] / max(raw, 1))
    plan = choose(target_layout, leaf.shape, nbytes, cost, forced=read_once is True, moved=moved,
                  bandwidths=bandwidths, processes=processes)
    steps = tuple(sharding(s) for s in plan.steps)
    out = Route(sharding(plan.read), steps, plan.cost, plan.kind, plan.interconnect, processes, plan)
    if key is not None:
        _routes.put(key, out)
    return out


def stored_nbytes(leaf: fmt.ArrayLeaf, block_size: int) -> int:
    """A leaf's bytes in storage: its raw bytes, or the sum of its compressed blocks' stored sizes
    (for a part-indexed leaf, its records are fetched whole on the first look, as any read of it does)."""
    if leaf.codec == "none":
        return leaf.nbytes
    return sum(sum(leaf.stored_sizes(c, block_size)) for c in range(len(leaf.chunks)))


_routes: Memo[Route] = Memo()


def read_bytes(leaf: fmt.ArrayLeaf, sharding: Any, block_size: int, verify: bool, region: Any = None,
               process_of: ProcessOf | None = None) -> int:
    """Storage bytes read, summed over processes, when each reads its boxes of `sharding`; see `read_cost`."""
    return read_cost(leaf, sharding, block_size, verify, region, process_of=process_of)[0]


def read_cost(leaf: fmt.ArrayLeaf, sharding: Any, block_size: int, verify: bool, region: Any = None,
              max_read: int = 0, process_of: ProcessOf | None = None, stored: bool = True) -> tuple[int, int, int]:
    """Storage bytes, requests and host bytes (checked when `verify`, plus those copied out strided),
    summed over processes, when each reads its boxes of `sharding` (stored bytes: for a compressed
    leaf, the stored sizes of the blocks the boxes touch, unless `stored` is False: then its raw
    bytes widened to those blocks). Decoding compressed blocks is not priced as host work.

    Estimated (`_plan.estimate_reads`, an upper bound of the planner's
    bytes) for one representative process, the one holding the sharding's
    first device, and scaled by the number of processes: under a
    NamedSharding every process holds as many boxes of the same shapes, so
    this is exact up to where boxes fall against chunk and checksum-block
    edges. It keeps the decision O(1) in the cluster size: every process
    decides every leaf, so an O(processes) rule would cost O(processes^2)
    over the cluster.
    """
    shape = leaf.shape if region is None else tuple(hi - lo for lo, hi in region)
    processes, boxes = _representative(sharding, shape, process_of)
    if region is not None:  # a piece of the leaf: its boxes sit at the piece's origin
        boxes = frozenset(tuple((lo + o, hi + o) for (lo, hi), (o, _) in zip(b, region)) for b in boxes)
    sizes = None
    if leaf.codec != "none" and stored:
        if isinstance(leaf.stored, LazyStored):  # this process's records of just those chunks, in one fetch
            leaf.stored.table.fetch({leaf.stored.leaf: cells_in(leaf.grid, sorted(boxes))})
        sizes = lambda cell: leaf.stored_sizes(cell, block_size)  # noqa: E731
    work = estimate_read_work(leaf.grid, leaf.dtype.itemsize, sorted(boxes), block_size, verify, max_read, sizes)
    host = (work.nbytes if verify else 0) + work.scattered
    return processes * work.nbytes, processes * work.requests, processes * host


def moved_bytes(src: Any, dst: Any, shape: tuple[int, ...], itemsize: int, process_of: ProcessOf | None = None) -> int:
    """Bytes the collectives bring in from other processes, summed over processes, to go from
    `src` to `dst` (NamedShardings on one mesh): for each device of a representative process,
    its box under `dst` less what that process's devices hold under `src`
    (`_plan.routes.received_elements`), times the processes."""
    processes, have = _representative(src, shape, process_of)
    want = _representative_devices(dst, shape, process_of)
    return processes * received_elements(want, sorted(have)) * itemsize


_dev_cache: Memo[tuple[Any, ...]] = Memo()


def _representative_devices(sharding: Any, shape: tuple[int, ...], process_of: ProcessOf | None = None,
                            ) -> tuple[Any, ...]:
    """The box of every device of the process holding `sharding`'s first device (repeats kept)."""
    hit = _dev_cache.get((sharding, shape, process_of))
    if hit is not None:
        return hit
    return _dev_cache.put((sharding, shape, process_of), _first_process_boxes(sharding, shape, process_of)[1])


def _first_process_boxes(sharding: Any, shape: tuple[int, ...], process_of: ProcessOf | None,
                         ) -> tuple[np.ndarray, tuple[Any, ...]]:
    """Every device's process, and the boxes of the devices of the first device's process, in device order."""
    from .._tree.shardings import device_box_array

    devices, boxes, procs = device_box_array(sharding, shape)
    if process_of is not None:
        procs = np.fromiter((process_of(d) for d in devices), np.int64, len(devices))
    mine = procs == procs[0]
    if isinstance(boxes, np.ndarray):
        return procs, tuple(tuple(map(tuple, b)) for b in boxes[mine].tolist())
    return procs, tuple(b for b, m in zip(boxes, mine.tolist()) if m)


# ---------------------------------------------------------------------- bandwidths


def storage_kind(storage: Any) -> str:
    """Which defaults of `_plan.routes.STORAGE_DEFAULTS` fit `storage`: "local", "object" or "memory",
    from what it declares (`Storage.in_process`, `Storage.kind`; a network filesystem is priced as a
    local one)."""
    if storage.in_process:
        return "memory"
    return "object" if storage.kind == "object" else "local"


def platform_of(sharding: Any) -> str:
    """The JAX platform of `sharding`'s devices ("cpu", "gpu", "tpu")."""
    try:
        return str(next(iter(sharding.device_set)).platform)
    except Exception:
        import jax

        return str(jax.devices()[0].platform)


MEASURE = "measure"


def bandwidths_for(declared: Any, storage: Any, sharding: Any, coord: Coordinator | None = None,
                   timeout: float = 60.0) -> Bandwidths:
    """The bandwidths routes are priced with: `declared` (``load(bandwidths=...)``) over the defaults
    for `storage`'s kind and the platform of `sharding`'s devices. Every input is the same on every
    process of a load (the same path, the same devices' platform, the same arguments).

    ``{"interconnect_gbps": "measure"}`` measures the interconnect with `measure_interconnect`
    over `sharding`'s mesh (with `coord`), once per mesh and cached; the primary's figure is used
    by every process. A mesh within one process keeps the default.
    """
    if isinstance(declared, dict) and declared.get("interconnect_gbps") == MEASURE:
        rest = {k: v for k, v in declared.items() if k != "interconnect_gbps"}
        base = resolve_bandwidths(rest or None, storage_kind(storage), platform_of(sharding))
        measured = measure_interconnect(sharding, coord, timeout) if coord is not None else None
        if measured is None:
            return base
        return replace(base, interconnect_gbps=measured,
                       source=f"interconnect measured ({measured:.3g} GB/s); " + base.source)
    return resolve_bandwidths(declared, storage_kind(storage), platform_of(sharding))


_measured: dict[Any, float] = {}
#: Bytes of the measuring array, all-gathered onto every device: about half a second on gloo
#: between 2 processes of 4 devices, and bounded at any mesh size.
MEASURE_BYTES = 16 << 20


def measure_interconnect(sharding: Any, coord: Coordinator, timeout: float) -> float | None:
    """Interconnect GB/s per process on `sharding`'s mesh, from one timed all-gather (after a
    warm-up that compiles it), as the route model counts bytes (`moved_bytes`); the primary's
    figure, published through `coord`, so that every process prices with the same one.

    Every process must call it at the same point (the first priced leaf of a load): it runs a
    collective. Cached per mesh; None for a mesh within one process. Bounded: about
    `MEASURE_BYTES` gathered onto every device, twice.
    """
    import time

    import jax

    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not hasattr(mesh, "devices"):
        return None
    devices = list(mesh.devices.flat)
    key = (tuple(d.id for d in devices), tuple(mesh.axis_names), tuple(mesh.devices.shape))
    if key in _measured:
        return _measured[key]
    if len({d.process_index for d in devices}) < 2:
        return None
    axes = tuple(mesh.axis_names)
    rows = len(devices) * max(1, MEASURE_BYTES // (4 * 1024) // len(devices))
    shape = (rows, 1024)
    src = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axes))
    dst = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = jax.make_array_from_callback(shape, src, lambda idx: np.zeros(
        [len(range(*s.indices(n))) for s, n in zip(idx or (), shape)], np.float32))
    jax.block_until_ready(jax.device_put(x, dst))  # compiles
    t0 = time.perf_counter()
    jax.block_until_ready(jax.device_put(x, dst))
    secs = time.perf_counter() - t0
    moved = moved_bytes(src, dst, shape, 4) / len({d.process_index for d in devices})
    mine = moved / max(secs, 1e-6) / 1e9
    seq = sequence("bandwidth")
    base = f"cairn/bandwidth/{seq}"
    if coord.process_index == 0:
        coord.publish(f"{base}/0", json.dumps({"gbps": mine}).encode())
    agreed = float(json.loads(coord.fetch(f"{base}/0", timeout))["gbps"])
    log.info("cairn: interconnect measured at %.3g GB/s per process (this process: %.3g)", agreed, mine)
    _measured[key] = agreed
    return agreed


def _is_named(sharding: Any) -> bool:
    import jax

    return isinstance(sharding, jax.sharding.NamedSharding)


def _spec_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def layout_of(sharding: Any, shape: tuple[int, ...]) -> Layout:
    mesh = sharding.mesh
    spec = [_spec_axes(e) for e in sharding.spec] + [()] * (len(shape) - len(sharding.spec))
    return Layout(tuple(mesh.axis_names), tuple(mesh.shape[a] for a in mesh.axis_names), tuple(spec))


def sharding_of(like: Any, layout: Layout) -> Any:
    """A NamedSharding on `like`'s mesh (and memory kind) with `layout`'s spec."""
    import jax

    entries: list[Any] = [None if not e else (e[0] if len(e) == 1 else e) for e in layout.spec]
    while entries and entries[-1] is None:
        entries.pop()
    return jax.sharding.NamedSharding(like.mesh, jax.sharding.PartitionSpec(*entries),
                                      memory_kind=like.memory_kind)


# ---------------------------------------------------------------------- leaves larger than the budget


def slabs(shape: tuple[int, ...], target: Layout, per_process_bytes: int, budget: int,
          cost: Callable[[int, list[tuple[int, int]]], int], nbytes: int,
          ) -> tuple[int, list[tuple[int, int]]] | None:
    """Cut a leaf whose restore would hold `per_process_bytes` of transient buffers per process
    into pieces along one axis the target does not cut, each a whole number of mesh-size
    blocks thick (so every layout of the route still divides it), few enough that a piece
    fits `budget`. None if it fits already or no axis allows it.

    Thinner pieces mean smaller reads, and a read smaller than a checksum block
    reads the whole block: `cost(axis, pieces)` (storage bytes over processes)
    must stay within `DIRECT_MAX` of `nbytes`. Piece counts that divide the
    axis evenly are tried, the fewest that fit the budget first, then fewer
    (memory above the budget rather than storage reading bytes twice).
    """
    if per_process_bytes <= budget:
        return None
    devices = target.size(target.axis_names)
    for a, n in enumerate(shape):
        if target.spec[a] or n % devices or n // devices < 2:
            continue
        units = n // devices
        need = -(-per_process_bytes // max(budget, 1))
        small = [k for k in range(1, math.isqrt(units) + 1) if units % k == 0]
        counts = sorted({*small, *(units // k for k in small)} - {1})
        order = [k for k in counts if k >= need][:8] + sorted((k for k in counts if k < need), reverse=True)[:8]
        for k in order:
            step = devices * (units // k)
            pieces = [(i * step, (i + 1) * step) for i in range(k)]
            if cost(a, pieces) <= DIRECT_MAX * nbytes:
                return a, pieces
        return None
    return None


def process_bytes(sharding: Any, shape: tuple[int, ...], itemsize: int, process_of: ProcessOf | None = None) -> int:
    """The bytes of the distinct boxes of `sharding` on one representative process (the one
    holding its first device): the same figure on every process."""
    _, boxes = _representative(sharding, shape, process_of)
    return sum(math.prod(hi - lo for lo, hi in b) for b in boxes) * itemsize


_rep_cache: Memo[tuple[int, frozenset[Any]]] = Memo()


def _representative(sharding: Any, shape: tuple[int, ...], process_of: ProcessOf | None = None,
                    ) -> tuple[int, frozenset[Any]]:
    """How many processes hold `sharding`, and the distinct boxes of the one holding its first
    device: the figures every process can compute alike, without seeing the others' boxes.

    Memoised per (sharding, shape): the route choice asks it for every leaf and candidate
    route, and each answer walks all devices (at 8,192 devices, milliseconds in Python; for a
    NamedSharding the boxes come by arithmetic, `_jaxutil.device_box_array`).
    """
    hit = _rep_cache.get((sharding, shape, process_of))
    if hit is not None:
        return hit
    procs, boxes = _first_process_boxes(sharding, shape, process_of)
    return _rep_cache.put((sharding, shape, process_of), (len(np.unique(procs)), frozenset(boxes)))


def _process(device: Any, process_of: ProcessOf | None) -> int:
    return device.process_index if process_of is None else process_of(device)


# ---------------------------------------------------------------------- agreement before collectives


def routes_digest(units: list[tuple[str, int, str, int]]) -> str:
    """A digest of a load's read-once leaves: (checkpointable, leaf, route kind, pieces) each."""
    import zlib

    return f"{zlib.crc32(json.dumps(units).encode()):08x}/{len(units)}"



class Agreement:
    """Status exchange before each wave of collectives of one load.

    A process that fails publishes its error for every wave it will not
    reach, so the others learn of it at their next exchange and raise too.
    """

    def __init__(self, coord: Coordinator, seq: int, waves: int, path: str, timeout: float, routes: str = ""):
        self.coord, self.seq, self.waves, self.path, self.timeout = coord, seq, waves, path, timeout
        self.routes = routes  # a digest of this process's read-once routes and waves (`routes_digest`)
        self.base = f"cairn/load/{seq}"
        self.done = 0  # waves this process has published a status for

    def ok(self, wave: int) -> None:
        """Publish success for `wave`, wait for the primary's decision on every process's status, and
        raise if any failed.

        The first wave's status carries the digest of this process's routes: processes that chose
        differently (different `bandwidths=` or `read_once=` on different processes) fail here,
        named, instead of entering collectives that do not match."""
        coord, me = self.coord, self.coord.process_index
        self.done = wave + 1
        mine = {"ok": True, "routes": self.routes} if wave == 0 else {"ok": True}
        try:  # through the primary: it sends back the first failure, or the groups of routes (or neither)
            decision = agree(coord, f"{self.base}/{wave}", mine, self.timeout, decide=_wave_decision)
        except CoordinationError as e:
            raise CoordinationError(f"loading {self.path}: {e}") from e
        if wave == 0 and me == 0 and self.seq > 0:
            drop_keys(coord, f"cairn/load/{self.seq - 1}")  # every process is past that load now
        if decision is None:
            return
        if decision[0] == "failed":
            raise error_from_record(decision[1], f"loading {self.path} failed: {decision[2]}")
        raise CheckpointError(
            f"loading {self.path}: the processes chose different read routes ({decision[1]} agree among "
            f"themselves); every process must pass the same read_once= and bandwidths= (process {me})")

    def fail(self, e: BaseException) -> None:
        """Tell the others this process will not take part in the remaining waves."""
        me = self.coord.process_index
        record = error_record(e, me)
        body = json.dumps({"ok": False, "error": record}).encode()
        for wave in range(self.done, self.waves):
            try:
                if me == 0:  # the others wait for the primary's decision: it is this failure
                    announce(self.coord, f"{self.base}/{wave}", [record, f"process 0: {record['message']}"])
                else:
                    self.coord.publish(f"{self.base}/{wave}/{me}", body)
            except Exception:
                break  # the coordinator is gone: the others will time out and say so


def _wave_decision(statuses: dict[int, dict[str, Any]]) -> list[Any] | None:
    """The primary's decision on a wave's statuses: ``["failed", record, message]`` for the first
    failure, ``["routes", groups]`` where the first wave's route digests differ, else None."""
    failure = first_failure(statuses)
    if failure is not None:
        return ["failed", failure[0], failure[1]]
    digests = {p: s.get("routes", "") for p, s in statuses.items()}
    if len(set(digests.values())) <= 1:
        return None
    groups: dict[str, list[int]] = {}
    for p, d in sorted(digests.items()):
        groups.setdefault(d, []).append(p)
    return ["routes", "; ".join(f"processes {ps}" for ps in groups.values())]
