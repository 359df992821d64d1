"""Dry run of a load: what each process would read and hold, computed without reading array data.

`plan_load` opens the checkpoint's metadata (manifest, indexes, and in format 2
the records of the chunks the load would read), matches the target as `_load`
does, and computes the load engine's own plan for every process, from this
one: the schedule (`_load.schedule`: each leaf's read-once route and the
waves) and each process's `_load.plan.Plan` (its direct pipeline under the
budget, and every storage request it sends once small arrays and in-place
reads are gathered into runs), which is what the engine executes on that
process. The report sums those plans. They are pure functions of the index and
of each sharding's ``devices_indices_map``, so any process can compute every
other's; ``processes=N`` splits the target's devices into N processes by
device id, which is how the command line plans a multi-host load on one
machine's virtual CPU devices.

What it models and what it does not is said in `MODELLED` and `NOT_MODELLED`,
printed with every plan.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from .._core.units import human_bytes
from .._errors import CheckpointError, CorruptCheckpointError
from .._format import manifest as fmt
from .._load import engine as _load
from .._load import plan as _plan
from .._load.blocks import own_blocks
from .._load.options import LoadOptions
from .._load.readonce import MAX_READ, ProcessOf, Route, bandwidths_for, storage_kind, stored_nbytes
from .._load.schedule import schedule
from .._load.source import checkpointables
from .._plan.routes import Bandwidths, resolve_bandwidths
from .._read.metadata import read_index, read_manifest, sibling
from .._sources import registry as _sources
from .._sources.registry import Rename
from .._storage.location import resolve
from .._tree.perprocess import LoadView, leaf_numbers
from .._tree.pytree import display_path

MODELLED = (
    "storage bytes and read requests per process, from the plan the load engine executes (read-once routes "
    "and waves, direct reads, coalesced small arrays and in-place reads, checksum-block widening; "
    "incremental steps' reads in their bases' files and their deltas' base blocks)",
    "peak host memory: read buffers in flight under the budget, pending batched device puts, dtype casts, "
    "read-once waves and pieces, and per-thread scratch for reads that cannot land in place (an upper bound)",
    "time: each process's bytes at the given bandwidth, all processes in parallel",
)
NOT_MODELLED = (
    "in the time per process: request latency, checksum and copy cost, device transfers and the read-once "
    "collectives (the routes' own predicted seconds do count requests and interconnect bytes), a shared "
    "store's aggregate bandwidth limit",
    "object stores splitting a read into ranged GETs (read_part_size); Orbax arrays read through "
    "tensorstore (counted as their uncompressed boxes)",
    "the loaded arrays themselves, JAX's own buffers, and the metadata reads (manifest, indexes, records)",
    "in the peak host memory: the stored bytes of compressed small arrays read together in one run, held "
    "beside their arrays until the run is decoded (at most one run per reader thread)",
)


@dataclass(frozen=True)
class ProcessPlan:
    """One process's figures in a `LoadPlan`."""

    process: int
    devices: int  # devices of the target's shardings that it holds
    bytes_read: int
    requests: int
    peak_host_bytes: int


@dataclass(frozen=True)
class LeafRoute:
    """One array leaf's route in a `LoadPlan`: what was chosen, and every route considered.

    `alternatives` hold each route's storage bytes, interconnect bytes and
    requests summed over processes, and its predicted seconds (None when
    routes were not priced); `why` says why no choice was made (one process,
    ``read_once=False``, ...).
    """

    path: str
    shape: tuple[int, ...]
    kind: str  # "direct" | "refined" | "staged"
    by: str  # "seconds", "bytes", "forced", "shortcut", or "" (no choice made)
    alternatives: tuple[Any, ...]  # _plan.routes.RouteCost
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "shape": list(self.shape), "route": self.kind, "by": self.by, "why": self.why,
                "alternatives": [a.as_dict() for a in self.alternatives]}


@dataclass(frozen=True)
class PerProcessRead:
    """A ``cairn.PerProcess`` value in a `LoadPlan`: host-local, read by each process for itself.

    `saved_by` processes saved one value each. Each loading process reads
    ``"own"`` (its own value: as many processes load as saved) or ``"all"``
    (every saved value: another process count, for ``reshard`` or a load
    without a target).
    """

    path: str
    saved_by: int
    reads: str  # "own" | "all"

    def __str__(self) -> str:
        what = "its own" if self.reads == "own" else f"all {self.saved_by} saved values"
        return (f"per-process value {self.path!r}: saved by {self.saved_by} process"
                f"{'es' if self.saved_by != 1 else ''}, each process reads {what}")


@dataclass(frozen=True)
class LoadPlan:
    """What `cairn.load` would read and hold, per process: the result of `cairn.plan_load`.

    ``str(plan)`` is a table with what the figures model and what they do not.
    `bandwidth` is the storage's GB/s (10^9 bytes per second) per process, if one was declared
    (`plan_load(bandwidths={"storage_gbps": ...})`).

    Example:

        plan = cairn.plan_load(path, target, processes=8, bandwidths={"storage_gbps": 1.5})
        worst = max(plan.processes, key=lambda p: p.peak_host_bytes)
        print(plan.bytes_read / plan.array_bytes, worst.process, plan.seconds)
    """

    path: str
    format: str
    processes: tuple[ProcessPlan, ...]
    leaves: int  # target leaves loaded (arrays and values)
    array_bytes: int  # bytes of the arrays loaded (raw, as the arrays hold them)
    read_once_leaves: int  # leaves restored through collectives (read once cluster-wide)
    waves: int  # their waves (a leaf larger than the budget takes one wave per piece)
    budget_bytes: int
    bandwidth: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    routes: tuple[LeafRoute, ...] = ()  # each sharded array leaf's route
    route_bandwidths: dict[str, Any] | None = None  # what the routes were priced with (None: not priced)
    per_process: tuple[PerProcessRead, ...] = ()  # the cairn.PerProcess values the load reads
    stored_bytes: int = -1  # the same arrays' bytes in storage (less where compressed); -1: array_bytes
    #: The per-process plans these figures sum (`_load.plan.Plan`: each process's direct pipeline and
    #: every storage request it sends, as file, offset and length): what the load engine executes.
    plans: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    @property
    def stored(self) -> int:
        """Bytes of the loaded arrays in storage: `array_bytes`, less what their codecs saved."""
        return self.array_bytes if self.stored_bytes < 0 else self.stored_bytes

    @property
    def bytes_read(self) -> int:
        """Storage bytes read, summed over processes."""
        return sum(p.bytes_read for p in self.processes)

    @property
    def seconds(self) -> float | None:
        """Estimated read time: the slowest process's bytes at `bandwidth`."""
        return None if not self.bandwidth else max(p.bytes_read for p in self.processes) / (self.bandwidth * 1e9)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "leaves": self.leaves, "array_bytes": self.array_bytes,
                "read_once_leaves": self.read_once_leaves, "waves": self.waves, "budget_bytes": self.budget_bytes,
                "stored_bytes": self.stored,
                "bandwidth_gb_s": self.bandwidth, "seconds": self.seconds, "bytes_read": self.bytes_read,
                "processes": [vars(p) for p in self.processes], "notes": list(self.notes),
                "route_bandwidths": self.route_bandwidths, "routes": [r.to_json() for r in self.routes],
                "per_process": [vars(r) for r in self.per_process],
                "modelled": list(MODELLED), "not_modelled": list(NOT_MODELLED)}

    def __str__(self) -> str:
        bw = self.bandwidth
        rows = [[str(p.process), str(p.devices), human_bytes(p.bytes_read), str(p.requests),
                 human_bytes(p.peak_host_bytes)] + ([f"{p.bytes_read / (bw * 1e9):.3g} s"] if bw else [])
                for p in self.processes]
        head = ["process", "devices", "bytes read", "requests", "peak host"] + ([f"time @ {bw:g} GB/s"] if bw else [])
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        packed = (f" ({human_bytes(self.stored)} stored, compressed)" if self.stored != self.array_bytes else "")
        lines = [f"plan for {self.path} ({self.format}): {self.leaves} leaves, {human_bytes(self.array_bytes)} "
                 f"of arrays{packed}, budget {human_bytes(self.budget_bytes)}; {self.read_once_leaves} read once "
                 f"through collectives in {self.waves} waves",
                 "  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        total = f"total: {human_bytes(self.bytes_read)} read ({self.bytes_read / max(self.stored, 1):.2f}x the arrays' stored bytes)"
        lines.append(total + (f", about {self.seconds:.3g} s" if self.seconds is not None else ""))
        lines += self.route_lines()
        lines += [str(r) for r in self.per_process]
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"models: {m}" for m in MODELLED] + [f"does not model: {m}" for m in NOT_MODELLED]
        return "\n".join(lines)


    def route_lines(self, limit: int = 20) -> list[str]:
        """The routes, leaves with the same figures on one row: route, then each alternative's
        predicted seconds (and storage / interconnect bytes over processes)."""
        if not self.routes:
            return []
        bw = self.route_bandwidths
        head = ("routes priced at " + (f"storage {bw['storage_gbps']:g} GB/s, interconnect {bw['interconnect_gbps']:g} "
                f"GB/s, {bw['request_ms']:g} ms/request, host {bw.get('host_gbps', 0):g} GB/s per process ({bw['source']})"
                if bw else
                "storage bytes (not priced in seconds)"))
        groups: dict[Any, list[LeafRoute]] = {}
        for r in self.routes:
            key = (r.kind, r.by, r.why, r.shape, tuple((a.kind, a.storage_bytes, a.interconnect_bytes, a.requests)
                                                        for a in r.alternatives))
            groups.setdefault(key, []).append(r)
        rows = [["leaves", "route", "chosen by", "direct", "refined", "staged"]]
        for members in sorted(groups.values(), key=lambda g: -len(g))[:limit]:
            r = members[0]
            alts = {a.kind: a for a in r.alternatives}

            def cell(kind: str, alts: dict[str, Any] = alts) -> str:
                a = alts.get(kind)
                if a is None:
                    return "-"
                t = f"{a.seconds:.3g} s " if a.seconds is not None else ""
                return (f"{t}({human_bytes(a.storage_bytes)} read"
                        + (f", {human_bytes(a.interconnect_bytes)} moved)" if a.interconnect_bytes else ")"))
            name = r.path + (f" and {len(members) - 1} like it" if len(members) > 1 else "")
            rows.append([name, r.kind, r.by or r.why, cell("direct"), cell("refined"), cell("staged")])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        out = [head] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        if len(groups) > limit:
            out.append(f"... {len(groups) - limit} more kinds of leaves (all in --json)")
        return out


# ---------------------------------------------------------------------- the plan


def _one_bandwidth(bandwidths: dict[str, float] | None,
                   bandwidth: float | None) -> tuple[dict[str, float] | None, float | None]:
    """`plan_load`'s `bandwidths`, with the deprecated `bandwidth=x` folded in as its ``storage_gbps``,
    and the storage bandwidth (GB/s) the time estimate uses, if one was declared."""
    if bandwidth is not None:
        warnings.warn("plan_load(bandwidth=x) is deprecated and goes in the next release: pass "
                      "bandwidths={'storage_gbps': x}, the keyword load takes", DeprecationWarning, stacklevel=3)
        given = (bandwidths or {}).get("storage_gbps")
        if given is not None and given != bandwidth:
            raise ValueError(f"plan_load: bandwidth={bandwidth!r} and bandwidths['storage_gbps']={given!r} "
                             "disagree; pass only bandwidths")
        bandwidths = {**(bandwidths or {}), "storage_gbps": bandwidth}
    declared = (bandwidths or {}).get("storage_gbps") if isinstance(bandwidths, Mapping) else None
    return bandwidths, declared


def plan_load(
    path: Any,
    target: Any = None,
    *,
    processes: int | None = None,
    partial: bool = False,
    verify: bool = True,
    threads: int = 8,
    read_once: bool | None = None,
    budget_bytes: int = 1 << 30,
    bandwidth: float | None = None,
    bandwidths: dict[str, float] | None = None,
    platform: str | None = None,
    storage_options: dict[str, Any] | None = None,
    format: str | None = None,
    rename: Rename | None = None,
    drop: Any = None,
    fill_missing: Any = False,
    mesh: Any = None,
    cast: str = "safe",
) -> LoadPlan:
    """What ``cairn.load(path, target, ...)`` would read and hold on every process, without reading data.

    Takes `load`'s arguments, plus `processes` (plan for that many processes,
    each holding an equal share of the target's devices by device id; default:
    the devices' real processes). Only metadata is read: the manifest, indexes
    and chunk records (and, for an incremental step with deltas, the indexes
    of the bases they are against). `bandwidths` prices the read routes as `load` does (the
    same keys and defaults); its ``storage_gbps`` (GB/s per process), where
    given, also gives the time estimate `plan.seconds`. (`bandwidth=x`, the
    old spelling of ``bandwidths={"storage_gbps": x}``, still works with a
    DeprecationWarning; it goes in the next release.) `platform` ("cpu", "gpu", "tpu") choosing the interconnect's default
    (default: the target devices' platform, CPU for `cairn plan`'s virtual
    devices). `plan.routes` holds each sharded leaf's route with every
    alternative's predicted seconds. `mesh` plans `load`'s restore onto
    the saved shardings over that mesh. `cast` is checked as `load` checks it (the
    values a cast would change are known only when they are read).

    Example:

        plan = cairn.plan_load("/ckpt/step_100", {"params": abstract}, processes=64,
                               bandwidths={"storage_gbps": 2.0})
        print(plan)                 # per process: bytes, requests, peak host memory, time
        plan.processes[3].bytes_read
    """
    bandwidths, bandwidth = _one_bandwidth(bandwidths, bandwidth)
    # The same options, checked the same way, as the load this plan predicts.
    opts = LoadOptions(partial=partial, verify=verify, threads=threads, read_once=read_once,
                       budget_bytes=budget_bytes, bandwidths=bandwidths, format=format, rename=rename, drop=drop,
                       fill_missing=fill_missing, mesh=mesh, cast=cast)
    partial, verify, threads, read_once, budget_bytes = (opts.partial, opts.verify, opts.threads, opts.read_once,
                                                         opts.budget_bytes)
    loc = resolve(path, storage_options)
    src = _sources.open_source(loc, target, format=opts.format, **opts.transforms)
    found, manifest = src.format_name, src.manifest
    n = processes if processes is not None else _real_process_count()
    if n < 1:
        raise ValueError(f"processes must be at least 1, got {n}")
    items = []
    requests = checkpointables(loc.path, manifest.items, manifest.root, target)
    for (name, item_target), index in zip(requests, src.indexes_of([name for name, _ in requests], None)):
        pp = LoadView(index.structure, name, loc.path, 0, n)
        wanted = _load.match_target(loc, name, index, item_target, partial, pp, opts.mesh)
        verify_item = verify and src.verify
        items.append(_Item(name, index, item_target, wanted, SimpleNamespace(verify=verify_item), pp,
                           _base_blocks(loc, name, index)))
    process_of, devices = _process_map(items, processes)
    limits = _plan.Limits.of(loc.storage)
    for it in items:
        _fetch_records(it)

    def bandwidths_of(sharding: Any) -> Bandwidths:
        return (resolve_bandwidths(bandwidths, storage_kind(loc.storage), platform) if platform
                else bandwidths_for(bandwidths, loc.storage, sharding))

    # The engine's own schedule (`_load.schedule`) and plan (`_load.plan`), for each of these processes.
    sched = schedule(items, n, read_once, bandwidths_of, limits.max_read or MAX_READ, budget_bytes, process_of)
    leaf_routes = [_leaf_route(display_path(r.item.index.leaves[r.leaf].path, r.item.name),
                               r.item.index.leaves[r.leaf].shape, r.route, r.bandwidths) for r in sched.routed]
    priced = next((r.bandwidths for r in sched.routed if r.bandwidths is not None), None)
    plans = []
    for p in range(n):
        wants = [it.wanted if not it.pp.nodes else _load.match_target(
            loc, it.name, it.index, it.target, partial, LoadView(it.index.structure, it.name, loc.path, p, n),
            opts.mesh) for it in items]
        plans.append(_plan.plan(items, sched, budget_bytes, limits, p, process_of, wanted=wants, threads=threads))
    arrays = [it.index.leaves[i] for it in items for i in it.wanted]
    return LoadPlan(loc.path, found, tuple(ProcessPlan(pl.process, devices.get(pl.process, 0), pl.bytes_read,
                                                       len(pl.requests), pl.peak_host_bytes) for pl in plans),
                    len(arrays), sum(leaf.nbytes for leaf in arrays if isinstance(leaf, fmt.ArrayLeaf)),
                    len(sched.staged), len(sched.waves), budget_bytes, bandwidth, routes=tuple(leaf_routes),
                    route_bandwidths=priced.as_dict() if priced is not None else None,
                    per_process=tuple(_per_process_reads(items, n)),
                    stored_bytes=sum(stored_nbytes(leaf, it.index.block_size) for it in items
                                     for leaf in (it.index.leaves[i] for i in it.wanted)
                                     if isinstance(leaf, fmt.ArrayLeaf)),
                    plans=tuple(plans))


def _per_process_reads(items: list[_Item], n: int) -> list[PerProcessRead]:
    """The per-process nodes the load reads (a target may leave one out: partial=True)."""
    out = []
    for it in items:
        for path, subs in sorted(it.pp.nodes.items()):
            if any(i in it.wanted for sub in subs for i in leaf_numbers(sub)):
                out.append(PerProcessRead(display_path(path, it.name), len(subs), "own" if len(subs) == n else "all"))
    return out


def _leaf_route(path: str, shape: tuple[int, ...], r: Route, bw: Bandwidths | None) -> LeafRoute:
    if r.plan is None:
        return LeafRoute(path, shape, r.kind, "", (), r.why)
    alts = r.plan.alternatives
    if bw is not None and any(a.seconds is None for a in alts):  # chosen by bytes (read_once=True): price them
        p = max(r.processes, 1)
        alts = tuple(replace(a, seconds=bw.seconds(a.storage_bytes / p, a.interconnect_bytes / p, a.requests / p,
                                                      a.host_bytes / p))
                     for a in alts)
    return LeafRoute(path, shape, r.kind, r.plan.by, alts)


@dataclass
class _Item:
    """One requested checkpointable, shaped like the load's `_ItemLoad` where `_waves` looks."""

    name: str
    index: fmt.ItemIndex
    target: Any
    wanted: dict[int, Any]
    reader: Any  # .verify
    pp: LoadView
    #: Version 4: a delta's base block ``(codec id, stored size)`` (`_base_blocks`), as `_load.plan` asks.
    base_block: Any = None


def _base_blocks(loc: Any, name: str, index: fmt.ItemIndex) -> Any:
    """Where an item's data files include a base checkpoint's: the function `_load.plan` asks for the
    base block of a delta, ``(leaf, cell, block, (file, offset)) -> (codec id, stored size)``, from the
    base's index (the load reads the same from the delta's header, which a dry run does not read)."""
    if not any(f.base is not None for f in index.files):
        return None
    opened: dict[str, tuple[fmt.ItemIndex, dict[Any, int]]] = {}
    chunks: dict[tuple[str, Any, int], list[Any]] = {}  # (base, leaf path, cell) -> `own_blocks`

    def base_index(base: str) -> tuple[fmt.ItemIndex, dict[Any, int]]:
        got = opened.get(base)
        if got is None:
            there = sibling(loc, base)
            try:
                bidx = read_index(there, read_manifest(there).items[name])
            except (CheckpointError, KeyError) as e:
                raise CorruptCheckpointError(
                    f"{loc.path} refers to its base checkpoint {base!r} (beside it), whose index of "
                    f"{name!r} cannot be read: {e}") from None
            got = opened[base] = (bidx, {leaf.path: i for i, leaf in enumerate(bidx.leaves)})
        return got

    def own_of(base: str, path: Any, cell: int) -> list[Any]:
        got = chunks.get((base, path, cell))
        if got is None:
            bidx, numbers = base_index(base)
            i = numbers.get(path)
            leaf = None if i is None else bidx.leaves[i]
            if not isinstance(leaf, fmt.ArrayLeaf) or cell >= len(leaf.chunks):
                got = []
            else:
                if bidx.table is not None and i in bidx.table.leaves:  # format 2+: its records, all at once
                    bidx.table.fetch_leaf(i, len(bidx.table.leaves[i].writers))
                got = own_blocks(leaf, cell, bidx.block_size)
            chunks[(base, path, cell)] = got
        return got

    def base_block(leaf: fmt.ArrayLeaf, cell: int, b: int, against: tuple[int, int]) -> tuple[int, int]:
        entry = index.files[against[0]]
        if entry.base is None:  # the parser lets a delta's `against` name only a base's file
            raise CorruptCheckpointError(f"{loc.path}: leaf {display_path(leaf.path, name)!r} chunk {cell} block "
                                         f"{b} is a delta against {entry.name!r}, which is not a base's file")
        own = own_of(entry.base, leaf.path, cell)
        got = own[b] if b < len(own) else None
        if got is None or base_index(entry.base)[0].files[got[0]].name != entry.name or got[1] != against[1]:
            raise CorruptCheckpointError(
                f"{loc.path}: leaf {display_path(leaf.path, name)!r} chunk {cell} block {b} is a delta against "
                f"bytes {against[1]} of {entry.name!r} in its base checkpoint {entry.base!r}, where that "
                "checkpoint's index has no block of its own at the same position")
        return got[3], got[2]

    return base_block


def _real_process_count() -> int:
    import sys

    return sys.modules["jax"].process_count() if "jax" in sys.modules else 1


def _process_map(items: list[_Item], processes: int | None) -> tuple[ProcessOf | None, dict[int, int]]:
    """Who holds which device: the real processes, or `processes` equal shares of the target's devices."""
    devices: dict[int, Any] = {}
    for it in items:
        for want in it.wanted.values():
            if want is not None and want.sharding is not None:
                devices.update((d.id, d) for d in want.sharding.device_set)
    ordered = [devices[k] for k in sorted(devices)]
    if processes is None:
        counts: dict[int, int] = {}
        for d in ordered:
            counts[d.process_index] = counts.get(d.process_index, 0) + 1
        return None, counts
    if ordered and len(ordered) % processes:
        raise ValueError(f"{len(ordered)} devices cannot be split into {processes} processes of equal size")
    per = max(1, len(ordered) // processes)
    rank = {d.id: i // per for i, d in enumerate(ordered)}
    return (lambda d: rank[d.id]), {p: per for p in range(processes)} if ordered else {}


def _fetch_records(it: _Item) -> None:
    """Format 2: the chunk records of every wanted leaf (any process may read any chunk)."""
    table = it.index.table
    if table is None:
        return
    import numpy as np

    need = {i: np.arange(len(table.leaves[i].writers)) for i in it.wanted if i in table.leaves}
    if need:
        table.fetch(need)


__all__ = ["MODELLED", "NOT_MODELLED", "LoadPlan", "ProcessPlan", "plan_load"]
