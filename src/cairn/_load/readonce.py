"""Read-once restore: each byte of a checkpoint leaves storage once, whatever the target.

When every process reads the bytes of its own target shards (the direct
path), a target replicated over R processes reads each byte R times, and a
target cut across the saved chunks (rows saved, columns wanted) reads whole
chunks for a few strided columns each. Storage bandwidth is what a restore
at scale waits for; the device interconnect is far faster. So for each array
leaf every process computes, from the index and the target sharding alone
(no communication), the same *route*:

- **direct** when the direct path costs at most `DIRECT_MAX` times the
  array's bytes, summed over processes (same sharding, reshards along chunk
  boundaries, one process): nothing changes.
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

The route whose storage bytes are smallest wins; ties go to fewer
collectives. The transport is XLA's collectives on the devices, nothing of
cairn's own. Before any collective, the processes exchange a status through
the coordinator, so a process that failed to read (a corrupt chunk, a
missing file) fails the load on every process, named, instead of leaving the
others blocked in a collective.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._core.memo import Memo
from .._dist.coord import Coordinator, agree, announce, drop_keys
from .._errors import CoordinationError, error_from_record, error_record, first_failure
from .._format import manifest as fmt
from .._plan.estimate import estimate_read_bytes

log = logging.getLogger("cairn")

#: A device's process: ``process_index`` unless the dry run simulates others.
ProcessOf = Callable[[Any], int]

#: A direct read costing at most this much more than the array's bytes is kept.
DIRECT_MAX = 1.2


@dataclass(frozen=True)
class Layout:
    """A NamedSharding described without JAX: mesh axes and, per array axis, the mesh axes it is cut over."""

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    spec: tuple[tuple[str, ...], ...]  # one entry per array axis

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.axis_sizes[self.axis_names.index(a)] for a in axes)

    def with_spec(self, spec: list[tuple[str, ...]]) -> Layout:
        return Layout(self.axis_names, self.axis_sizes, tuple(spec))


def refined_layout(target: Layout, shape: tuple[int, ...]) -> Layout | None:
    """`target` with its replicated mesh axes folded onto one array axis (each device a distinct
    block), or None when no axis divides; `target` itself when nothing is replicated."""
    used = {a for e in target.spec for a in e}
    free = tuple(a for a in target.axis_names if a not in used and target.size((a,)) > 1)
    if not free:
        return target
    extra = target.size(free)
    # Prefer the leading axis: its blocks are contiguous runs of the saved C-order chunks.
    for d, n in enumerate(shape):
        if n % (target.size(target.spec[d]) * extra) == 0:
            spec = list(target.spec)
            spec[d] = target.spec[d] + free
            return target.with_spec(spec)
    return None


def staging_layout(target: Layout, shape: tuple[int, ...]) -> Layout | None:
    """The array cut into one block per device of the mesh along the first axis that divides
    (the leading one where it can), or None."""
    axes = tuple(a for a in target.axis_names if target.size((a,)) > 1)
    for d, n in enumerate(shape):
        if n % target.size(axes) == 0:
            spec: list[tuple[str, ...]] = [()] * len(shape)
            spec[d] = axes
            return target.with_spec(spec)
    return None


@dataclass(frozen=True)
class Plan:
    """The chosen route in `Layout` terms: what each process reads, then the reshards."""

    read: Layout
    steps: tuple[Layout, ...]  # ending at the target; () = direct
    cost: int  # storage bytes read, summed over processes
    direct_cost: int
    kind: str = "direct"  # "direct" | "refined" | "staged"


def choose(target: Layout, shape: tuple[int, ...], nbytes: int, cost: Callable[[Layout], int],
           forced: bool) -> Plan:
    """The cheapest route in storage bytes (ties: fewer collectives). `cost(layout)` is the
    storage bytes summed over processes when each reads its own boxes of `layout`."""
    direct_cost = cost(target)
    best = Plan(target, (), direct_cost, direct_cost)
    if not forced and direct_cost <= DIRECT_MAX * nbytes:
        return best
    refined = refined_layout(target, shape)
    if refined is None:
        return best  # no fully tiled layout to go through: XLA could replicate the whole array
    if refined != target:
        c = cost(refined)
        if c < best.cost:
            best = Plan(refined, (target,), c, direct_cost, "refined")
    if best.cost > DIRECT_MAX * nbytes:
        stage = staging_layout(target, shape)
        if stage is not None and stage not in (target, refined):
            c = cost(stage)
            if c < best.cost:
                steps = (refined, target) if refined != target else (target,)
                best = Plan(stage, steps, c, direct_cost, "staged")
    return best


# ---------------------------------------------------------------------- JAX shardings


@dataclass(frozen=True)
class Route:
    """How one array leaf is restored: which sharding each process reads, then the reshards."""

    read: Any  # the jax sharding whose addressable boxes this process reads
    steps: tuple[Any, ...]  # jax shardings to move through with jax.device_put, ending at the target
    cost: int  # storage bytes read, summed over processes (-1: not computed)

    @property
    def direct(self) -> bool:
        return not self.steps


def route(leaf: fmt.ArrayLeaf, target: Any, block_size: int, verify: bool, process_count: int,
          read_once: bool | None, process_of: ProcessOf | None = None) -> Route:
    """The route of `leaf` onto `target` (a jax Sharding); the same on every process.

    `process_of` maps a device to its process (default: its ``process_index``); the
    dry run (`_dryrun`) plans for processes that are not there by passing its own.
    """
    direct = Route(target, (), -1)
    if read_once is False or leaf.nbytes == 0 or not _is_named(target):
        return direct
    if read_once is None and process_count == 1:
        return direct  # one process deduplicates its own boxes already
    if process_count > 1 and len({_process(d, process_of) for d in target.device_set}) == 1:
        return direct  # a process-local target: no other process takes part in its collectives
    # Models repeat a few (grid, sharding) pairs over hundreds of layers: decide each once.
    key: Any = (leaf.grid, leaf.dtype.itemsize, target, block_size, verify, read_once, process_of)
    try:
        hit = _routes.get(key)
    except TypeError:  # an unhashable sharding
        hit, key = None, None
    if hit is not None:
        return hit
    target_layout = layout_of(target, leaf.shape)

    def cost(layout: Layout) -> int:
        return read_bytes(leaf, sharding_of(target, layout), block_size, verify, process_of=process_of)

    plan = choose(target_layout, leaf.shape, leaf.nbytes, cost, forced=read_once is True)
    steps = tuple(target if s == target_layout else sharding_of(target, s) for s in plan.steps)
    read = target if plan.read == target_layout else sharding_of(target, plan.read)
    out = Route(read, steps, plan.cost)
    if key is not None:
        if len(_routes) > 4096:
            _routes.clear()
        _routes[key] = out
    return out


_routes: dict[Any, Route] = {}


def read_bytes(leaf: fmt.ArrayLeaf, sharding: Any, block_size: int, verify: bool, region: Any = None,
               process_of: ProcessOf | None = None) -> int:
    """Storage bytes read, summed over processes, when each reads its boxes of `sharding`.

    Estimated (`_plan.estimate_read_bytes`, an upper bound of the planner's
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
    return processes * estimate_read_bytes(leaf.grid, leaf.dtype.itemsize, sorted(boxes), block_size, verify)


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
    from .._tree.shardings import device_box_array

    devices, boxes, procs = device_box_array(sharding, shape)
    if process_of is not None:
        procs = np.fromiter((process_of(d) for d in devices), np.int64, len(devices))
    mine = procs == procs[0]
    if isinstance(boxes, np.ndarray):
        held = frozenset(tuple(map(tuple, b)) for b in boxes[mine].tolist())
    else:
        held = frozenset(b for b, m in zip(boxes, mine.tolist()) if m)
    return _rep_cache.put((sharding, shape, process_of), (len(np.unique(procs)), held))


def _process(device: Any, process_of: ProcessOf | None) -> int:
    return device.process_index if process_of is None else process_of(device)


# ---------------------------------------------------------------------- agreement before collectives

_seq = itertools.count()
_seq_lock = threading.Lock()


def next_seq() -> int:
    """The number of this process's next load that moves data between processes.

    Every process issues those loads in the same order (their collectives need
    it), so the numbers agree without talking.
    """
    with _seq_lock:
        return next(_seq)


class Agreement:
    """Status exchange before each wave of collectives of one load.

    A process that fails publishes its error for every wave it will not
    reach, so the others learn of it at their next exchange and raise too.
    """

    def __init__(self, coord: Coordinator, seq: int, waves: int, path: str, timeout: float):
        self.coord, self.seq, self.waves, self.path, self.timeout = coord, seq, waves, path, timeout
        self.base = f"cairn/load/{seq}"
        self.done = 0  # waves this process has published a status for

    def ok(self, wave: int) -> None:
        """Publish success for `wave`, wait for every process's status, raise if any failed."""
        coord, me = self.coord, self.coord.process_index
        self.done = wave + 1
        try:  # through the primary: it sends back the first failure (or none)
            failure = agree(coord, f"{self.base}/{wave}", {"ok": True}, self.timeout, decide=first_failure)
        except CoordinationError as e:
            raise CoordinationError(f"loading {self.path}: {e}") from e
        if wave == 0 and me == 0 and self.seq > 0:
            drop_keys(coord, f"cairn/load/{self.seq - 1}")  # every process is past that load now
        if failure is not None:
            raise error_from_record(failure[0], f"loading {self.path} failed: {failure[1]}")

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

