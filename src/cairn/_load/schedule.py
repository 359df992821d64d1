"""The load's schedule: every sharded array leaf's route, and the read-once leaves in waves.

It is computed from metadata alone (indexes, target shardings, the priced
bandwidths), identically on every process, by one function that the engine
runs and the dry run (`_sources.dryrun.plan_load`) evaluates for processes that
are not there: the dry run predicts the load the engine would make, not a
copy of its loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._format import manifest as fmt
from .readonce import Bandwidths, ProcessOf, Route, route
from .waves import Staged, Unit, cut_in_pieces, plan_waves


@dataclass(frozen=True)
class Routed:
    """One sharded array leaf of one item and the route it takes (`bandwidths`: the figures that priced
    it, or None where it was chosen by bytes or forced)."""

    item: Any
    leaf: int
    want: Any
    route: Route
    bandwidths: Bandwidths | None


@dataclass(frozen=True)
class Schedule:
    routed: tuple[Routed, ...]  # every sharded array leaf, in item and leaf order
    staged: tuple[Staged, ...]  # the read-once ones, cut in pieces where the budget needs
    waves: tuple[list[Unit], ...]  # the read-once ones grouped so each process's share fits the budget


def schedule(items: Sequence[Any], processes: int, read_once: bool | None,
             bandwidths_of: Callable[[Any], Bandwidths | None], max_read: int, budget: int,
             process_of: ProcessOf | None = None) -> Schedule:
    """The routes and waves of a load of `items` (each with ``wanted``, ``index`` and ``reader.verify``)
    by `processes` processes. `bandwidths_of(sharding)` gives the figures routes onto that sharding
    are priced with; they decide the route only where `read_once` is None."""
    routed: list[Routed] = []
    staged: list[Staged] = []
    for it in items:
        for i in sorted(it.wanted):
            want, leaf = it.wanted[i], it.index.leaves[i]
            if want is None or want.sharding is None or not isinstance(leaf, fmt.ArrayLeaf):
                continue
            bw = bandwidths_of(want.sharding) if read_once is not False and processes > 1 else None
            r = route(leaf, want.sharding, it.index.block_size, it.reader.verify, processes, read_once, process_of,
                      bandwidths=bw if read_once is None else None, max_read=max_read)
            routed.append(Routed(it, i, want, r, bw))
            if not r.direct:
                staged.append(cut_in_pieces(Staged(it, i, want, r), budget, processes, process_of))
    return Schedule(tuple(routed), tuple(staged), tuple(plan_waves(staged, budget, processes)))
