"""Pure: the load routes of one array leaf, and what each costs in seconds.

A multi-process load can restore an array two ways (`_load.readonce` runs them):

- **direct**: every process reads the bytes of its own target shards from storage;
- **read-once** (`refined` or `staged`): every process reads distinct blocks of
  a fully tiled layout, then XLA's collectives move them to the target.

Each route has storage bytes, interconnect bytes (what the collectives bring
to each device from devices of other processes), storage requests and host
bytes (what the processes' CPUs check and place: every byte read is checked
against its CRC-32C, and the reads that cannot land in place are copied out
strided), all summed over processes. With `Bandwidths` (per process, GB/s) a
route's time is

    seconds = (storage / storage_bw + requests * request_s + interconnect / interconnect_bw
               + host / host_bw) / processes

(processes work in parallel, each on an equal share), and the cheapest route
wins. Bytes alone were the measure before: right when storage is the
bottleneck (an object store at 1-2 GB/s next to a 100 GB/s interconnect),
wrong when the interconnect is the slower path (CPU hosts over gloo, a page
cache or local NVMe faster than the network).

Every process must choose the same route, or the collectives hang: every input
here is a global figure (the index, the shardings, the declared or default
bandwidths, or one measured figure that every process takes from the primary),
never a process's own measurement.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .._core.boxes import Box

#: A direct read costing at most this much more than the array's bytes is kept when
#: routes are chosen by bytes (``read_once=True``, or no bandwidths).
DIRECT_MAX = 1.2

_GB = 1e9


# ---------------------------------------------------------------------- bandwidths


@dataclass(frozen=True)
class Bandwidths:
    """What one process can move, in GB/s (10^9 bytes per second), and the time per storage request.

    `request_ms` is the effective time one request adds with the reader's
    threads working in parallel (a round trip divided by the requests in
    flight), not a single request's latency. `host_gbps` is the rate at which
    a process's CPUs check (CRC-32C) and place bytes read; 0 leaves host work
    out. `source` says where the figures came from, for the plan and the stats.
    """

    storage_gbps: float
    interconnect_gbps: float
    request_ms: float = 0.0
    source: str = "declared"
    host_gbps: float = 0.0

    def seconds(self, storage: float, interconnect: float, requests: float, host: float = 0.0) -> float:
        """Seconds for one process to read `storage` bytes in `requests`, receive `interconnect` bytes
        and check and place `host` bytes."""
        return (storage / (self.storage_gbps * _GB) + requests * self.request_ms / 1e3
                + (interconnect / (self.interconnect_gbps * _GB) if interconnect else 0.0)
                + (host / (self.host_gbps * _GB) if host and self.host_gbps else 0.0))

    def as_dict(self) -> dict[str, Any]:
        return {"storage_gbps": self.storage_gbps, "interconnect_gbps": self.interconnect_gbps,
                "request_ms": self.request_ms, "host_gbps": self.host_gbps, "source": self.source}


#: Storage read bandwidth (GB/s per process) and effective time per request (ms), per backend kind.
#: "local": NVMe or the page cache behind CRC32C checks; "object": S3/GCS-like stores, 1-2 GB/s per
#: host, tens of ms per GET spread over the reader's threads; "memory": the in-process test store.
STORAGE_DEFAULTS: dict[str, tuple[float, float]] = {
    "local": (2.0, 0.02),
    "object": (1.5, 2.0),
    "memory": (10.0, 0.0),
}

#: Interconnect bandwidth (GB/s per process) per JAX platform. "cpu": XLA's CPU collectives over
#: gloo (TCP), measured at tens to a few hundred MB/s per process on loopback
#: (docs/performance-routes.md); "gpu": NVLink within a host and InfiniBand/RoCE between hosts;
#: "tpu": ICI. Accelerator figures are conservative per-host numbers, meant to be declared
#: (`bandwidths=`) where they are known.
INTERCONNECT_DEFAULTS: dict[str, float] = {
    "cpu": 0.15,
    "gpu": 50.0,
    "cuda": 50.0,
    "rocm": 50.0,
    "tpu": 100.0,
}

#: Host bytes (CRC-32C checked, or copied out strided) per second per process, GB/s, per JAX
#: platform. One reader thread on this project's 2-core VM checks 11 GB/s of cached bytes and copies
#: 2 KiB strided runs at 1.6-3.3 GB/s (into fresh or touched memory; docs/performance-routes.md).
#: "cpu": about two such threads' worth, what the 2-core VM gives a process. Accelerator hosts have
#: tens of cores per process, and a load runs 8 reader threads: 16 GB/s is 8 threads at the VM's
#: strided-copy rate. Neither is measured at load time; declare `host_gbps` where it is known.
HOST_DEFAULTS: dict[str, float] = {"cpu": 4.0, "gpu": 16.0, "cuda": 16.0, "rocm": 16.0, "tpu": 16.0}

_KEYS = ("storage_gbps", "interconnect_gbps", "request_ms", "host_gbps")


def default_bandwidths(storage_kind: str, platform: str) -> Bandwidths:
    """The defaults for a storage backend kind ("local", "object", "memory") and a JAX platform."""
    storage, request = STORAGE_DEFAULTS.get(storage_kind, STORAGE_DEFAULTS["local"])
    interconnect = INTERCONNECT_DEFAULTS.get(platform.lower(), INTERCONNECT_DEFAULTS["gpu"])
    host = HOST_DEFAULTS.get(platform.lower(), HOST_DEFAULTS["gpu"])
    return Bandwidths(storage, interconnect, request,
                      f"default: {storage_kind} storage, {platform.lower()} interconnect", host)


def resolve_bandwidths(declared: Bandwidths | Mapping[str, float] | None, storage_kind: str,
                       platform: str) -> Bandwidths:
    """`declared` (a `Bandwidths`, or a mapping with some of ``storage_gbps``, ``interconnect_gbps``,
    ``request_ms``, ``host_gbps``) over the defaults; raises ValueError on unknown keys or non-positive
    figures (``request_ms`` may be 0, and ``host_gbps`` 0 leaves host work out)."""
    base = default_bandwidths(storage_kind, platform)
    if declared is None:
        return base
    if isinstance(declared, Bandwidths):
        given = {k: getattr(declared, k) for k in _KEYS}
    elif isinstance(declared, Mapping):
        unknown = sorted(set(declared) - set(_KEYS))
        if unknown:
            raise ValueError(f"bandwidths: unknown keys {unknown}; expected some of {list(_KEYS)}")
        # "measure": the interconnect measured by the caller (`_load.readonce.bandwidths_for`), or defaulted
        given = {k: v for k, v in declared.items() if not (k == "interconnect_gbps" and v == "measure")}
    else:
        raise ValueError(f"bandwidths must be a mapping such as {{'storage_gbps': 2, 'interconnect_gbps': 100}}, "
                         f"got {declared!r}")
    for k, v in given.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0 or (
                v == 0 and k not in ("request_ms", "host_gbps")):
            raise ValueError(f"bandwidths: {k} must be a positive number, got {v!r}")
    declared_keys = ", ".join(k for k in _KEYS if k in given)
    return replace(base, **{k: float(v) for k, v in given.items()},
                   source=f"declared {declared_keys}; " + base.source if len(given) < len(_KEYS) else "declared")


# ---------------------------------------------------------------------- layouts


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


# ---------------------------------------------------------------------- costs and the choice


@dataclass(frozen=True)
class RouteCost:
    """One route's figures, summed over processes, and its predicted seconds (None without bandwidths)."""

    kind: str  # "direct" | "refined" | "staged"
    storage_bytes: int
    interconnect_bytes: int
    requests: int
    seconds: float | None = None
    host_bytes: int = 0  # bytes checked and bytes copied out strided by the processes' CPUs

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "storage_bytes": self.storage_bytes,
                "interconnect_bytes": self.interconnect_bytes, "requests": self.requests,
                "host_bytes": self.host_bytes, "seconds": self.seconds}


@dataclass(frozen=True)
class Plan:
    """The chosen route in `Layout` terms: what each process reads, then the reshards."""

    read: Layout
    steps: tuple[Layout, ...]  # ending at the target; () = direct
    cost: int  # storage bytes read, summed over processes
    direct_cost: int
    kind: str = "direct"  # "direct" | "refined" | "staged"
    interconnect: int = 0  # bytes the collectives bring in from other processes, summed over processes
    alternatives: tuple[RouteCost, ...] = field(default=(), compare=False)  # every route considered
    by: str = "bytes"  # what decided: "bytes", "seconds", "forced" (read_once=True) or "shortcut"

    @property
    def seconds(self) -> float | None:
        return next((a.seconds for a in self.alternatives if a.kind == self.kind), None)


#: Storage bytes of a layout (summed over processes), or (bytes, requests), or (bytes, requests, host bytes).
CostFn = Callable[[Layout], "int | tuple[int, int] | tuple[int, int, int]"]
#: Interconnect bytes (summed over processes) of moving from one layout to the next.
MovedFn = Callable[[Layout, Layout], int]


def _io(cost: CostFn, layout: Layout) -> tuple[int, int, int]:
    c = cost(layout)
    if isinstance(c, int):
        return c, 0, 0
    return int(c[0]), int(c[1]), int(c[2]) if len(c) > 2 else 0


def choose(target: Layout, shape: tuple[int, ...], nbytes: int, cost: CostFn, forced: bool,
           moved: MovedFn | None = None, bandwidths: Bandwidths | None = None, processes: int = 1) -> Plan:
    """The route of one leaf onto `target`, the same on every process given the same inputs.

    `cost(layout)` is the storage bytes (or ``(bytes, requests)``, or
    ``(bytes, requests, host bytes)``) summed over processes when each reads
    its own boxes of `layout`; `moved(a, b)` the
    interconnect bytes of resharding from `a` to `b`. With `bandwidths` (and
    not `forced`) every route is priced in seconds and the cheapest wins (ties:
    fewer collectives). Without them, or with `forced` (``read_once=True``), the
    route reading the fewest storage bytes wins, and a direct read within
    `DIRECT_MAX` of the array's bytes is kept unless forced.
    """
    by_time = bandwidths is not None and not forced
    direct_bytes, direct_requests, direct_host = _io(cost, target)
    options: list[_Option] = [("direct", target, (), direct_bytes, direct_requests, direct_host)]
    if not forced and not by_time and direct_bytes <= DIRECT_MAX * nbytes:
        return _pick(options, moved, bandwidths, processes, nbytes, "shortcut")
    refined = refined_layout(target, shape)
    if refined is not None:  # else no fully tiled layout to go through: XLA could replicate the whole array
        if refined != target:
            options.append(("refined", refined, (target,), *_io(cost, refined)))
        # Staged reads contiguous runs of the saved chunks; bytes alone try it only when no cheaper route exists.
        best_bytes = min(o[3] for o in options)
        if by_time or best_bytes > DIRECT_MAX * nbytes:
            stage = staging_layout(target, shape)
            if stage is not None and stage not in (target, refined):
                steps = (refined, target) if refined != target else (target,)
                options.append(("staged", stage, steps, *_io(cost, stage)))
    return _pick(options, moved, bandwidths, processes, nbytes,
                 "forced" if forced else "seconds" if by_time else "bytes", forced)


#: (kind, layout read, reshard steps, storage bytes, requests, host bytes)
_Option = tuple[str, Layout, tuple[Layout, ...], int, int, int]


def _pick(options: list[_Option], moved: MovedFn | None,
          bandwidths: Bandwidths | None, processes: int, nbytes: int, by: str, forced: bool = False) -> Plan:
    costs = []
    for kind, read, steps, sbytes, requests, host in options:
        inter = 0
        if moved is not None and steps:
            inter = sum(moved(a, b) for a, b in zip((read, *steps), steps))
        secs = None
        if bandwidths is not None:
            p = max(processes, 1)
            secs = bandwidths.seconds(sbytes / p, inter / p, requests / p, host / p)
        costs.append(RouteCost(kind, sbytes, inter, requests, secs, host))
    if by == "seconds":
        score = [(c.seconds, len(o[2])) for c, o in zip(costs, options)]
    else:
        score = [(c.storage_bytes, len(o[2])) for c, o in zip(costs, options)]
    candidates: Sequence[int] = range(len(options))
    if forced and len(options) > 1:  # read_once=True: a collective route wherever one reads fewer bytes
        fewer = [i for i in candidates if i > 0 and costs[i].storage_bytes < costs[0].storage_bytes]
        candidates = fewer or [0]
    best = min(candidates, key=lambda i: score[i])
    kind, read, steps, sbytes = options[best][:4]
    return Plan(read, steps, sbytes, options[0][3], kind, costs[best].interconnect_bytes, tuple(costs), by)


# ---------------------------------------------------------------------- interconnect bytes


def received_elements(want: Sequence[Box], have: Sequence[Box]) -> int:
    """Elements of the boxes in `want` (one per device of a process, repeats counted per device)
    not covered by `have` (the distinct, disjoint boxes that process's devices already hold):
    what the collectives must bring to that process's devices from other processes."""
    total = 0
    for w in want:
        size = math.prod(hi - lo for lo, hi in w)
        for h in have:
            inter = 1
            for (a, b), (c, d) in zip(w, h):
                inter *= max(0, min(b, d) - max(a, c))
                if not inter:
                    break
            size -= inter
        total += size
    return total


__all__ = ["DIRECT_MAX", "HOST_DEFAULTS", "INTERCONNECT_DEFAULTS", "STORAGE_DEFAULTS", "Bandwidths", "Layout", "Plan", "RouteCost",
           "choose", "default_bandwidths", "received_elements", "refined_layout", "resolve_bandwidths",
           "staging_layout"]
