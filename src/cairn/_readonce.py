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
from dataclasses import dataclass
from typing import Any

from . import _format as fmt
from ._coord import Coordinator
from ._errors import CoordinationError, error_from_record, error_record
from ._plan import Box, plan_reads

log = logging.getLogger("cairn")

#: A direct read costing at most this much more than the array's bytes is kept.
DIRECT_MAX = 1.2


@dataclass(frozen=True)
class Route:
    """How one array leaf is restored: which sharding each process reads, then the reshards."""

    read: Any  # the sharding whose addressable boxes this process reads
    steps: tuple[Any, ...]  # shardings to move through with jax.device_put, ending at the target
    cost: int  # storage bytes read, summed over processes
    direct_cost: int  # what the direct path would read

    @property
    def direct(self) -> bool:
        return not self.steps


def route(leaf: fmt.ArrayLeaf, target: Any, block_size: int, verify: bool, process_count: int,
          read_once: bool | None) -> Route:
    """The route of `leaf` onto `target` (a jax Sharding); the same on every process."""
    direct = Route(target, (), -1, -1)
    if read_once is False or leaf.nbytes == 0 or not _is_named(target):
        return direct
    if read_once is None and process_count == 1:
        return direct  # one process deduplicates its own boxes already
    if process_count > 1 and len({d.process_index for d in target.device_set}) == 1:
        return direct  # a process-local target: no other process takes part in its collectives
    direct_cost = read_bytes(leaf, target, block_size, verify)
    direct = Route(target, (), direct_cost, direct_cost)
    if read_once is None and direct_cost <= DIRECT_MAX * leaf.nbytes:
        return direct
    best = direct
    refined = refine(target, leaf.shape)
    if refined is not None and refined != target:
        cost = read_bytes(leaf, refined, block_size, verify)
        if cost < best.cost:
            best = Route(refined, (target,), cost, direct_cost)
    if best.cost > DIRECT_MAX * leaf.nbytes and refined is not None:
        stage = staging(target, leaf.shape)
        if stage is not None and stage not in (target, refined):
            cost = read_bytes(leaf, stage, block_size, verify)
            if cost < best.cost:
                steps = (refined, target) if refined != target else (target,)
                best = Route(stage, steps, cost, direct_cost)
    return best


def read_bytes(leaf: fmt.ArrayLeaf, sharding: Any, block_size: int, verify: bool) -> int:
    """Storage bytes read, summed over processes, when each reads its boxes of `sharding`."""
    from ._jaxutil import slices_to_box

    per_process: dict[int, set[Box]] = {}
    for device, index in sharding.devices_indices_map(leaf.shape).items():
        per_process.setdefault(device.process_index, set()).add(slices_to_box(index, leaf.shape))
    total = 0
    for boxes in per_process.values():
        total += sum(r.nbytes for r in plan_reads(leaf, sorted(boxes), block_size, verify))
    return total


def _is_named(sharding: Any) -> bool:
    import jax

    return isinstance(sharding, jax.sharding.NamedSharding)


def _spec_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def refine(target: Any, shape: tuple[int, ...]) -> Any:
    """`target` with its replicated mesh axes folded onto one array axis (each device a distinct
    block), or None when no axis divides; `target` itself when nothing is replicated."""
    import jax

    mesh, spec = target.mesh, target.spec
    entries = [_spec_axes(e) for e in spec] + [()] * (len(shape) - len(spec))
    used = {a for e in entries for a in e}
    free = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
    if not free:
        return target
    extra = math.prod(mesh.shape[a] for a in free)
    # Prefer the leading axis: its blocks are contiguous runs of the saved C-order chunks.
    for d, n in enumerate(shape):
        have = math.prod(mesh.shape[a] for a in entries[d])
        if n % (have * extra) == 0:
            new = list(entries)
            new[d] = entries[d] + free
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*_entries_to_spec(new)),
                                              memory_kind=target.memory_kind)
    return None


def staging(target: Any, shape: tuple[int, ...]) -> Any:
    """The array cut into one block per device of `target`'s mesh along the first axis that
    divides (the leading one where it can), or None."""
    import jax

    mesh = target.mesh
    axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    size = math.prod(mesh.shape[a] for a in axes)
    for d, n in enumerate(shape):
        if n % size == 0:
            entries: list[tuple[str, ...]] = [()] * len(shape)
            entries[d] = axes
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*_entries_to_spec(entries)),
                                              memory_kind=target.memory_kind)
    return None


def _entries_to_spec(entries: list[tuple[str, ...]]) -> list[Any]:
    out: list[Any] = [None if not e else (e[0] if len(e) == 1 else e) for e in entries]
    while out and out[-1] is None:
        out.pop()
    return out


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
        coord, me, n = self.coord, self.coord.process_index, self.coord.process_count
        coord.publish(f"{self.base}/{wave}/{me}", b'{"ok":true}')
        self.done = wave + 1
        try:
            raw = coord.fetch_all(f"{self.base}/{wave}", n, self.timeout)
        except CoordinationError as e:
            raise CoordinationError(f"loading {self.path}: {e}") from e
        if wave == 0 and me == 0 and self.seq > 0:
            coord.drop(f"cairn/load/{self.seq - 1}")  # every process is past that load now
        statuses = {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in raw.items()}
        failed = sorted(p for p, s in statuses.items() if not s["ok"])
        if failed:
            msgs = "; ".join(f"process {p}: {statuses[p]['error']['message']}" for p in failed)
            raise error_from_record(statuses[failed[0]]["error"], f"loading {self.path} failed: {msgs}")

    def fail(self, e: BaseException) -> None:
        """Tell the others this process will not take part in the remaining waves."""
        me = self.coord.process_index
        body = json.dumps({"ok": False, "error": error_record(e, me)}).encode()
        for wave in range(self.done, self.waves):
            try:
                self.coord.publish(f"{self.base}/{wave}/{me}", body)
            except Exception:
                break  # the coordinator is gone: the others will time out and say so

