"""One process's load as data: the arrays it reads in order, where its pipeline waits, and every storage request.

`plan` computes, from metadata alone (indexes, target shardings, the storage's
stated read sizes), what the load engine does on one process once its
`schedule` (routes and waves) is fixed:

- the direct pipeline's leaves in order (`Step`), each read whole into one
  buffer or as the boxes of its target sharding, and how many arrays in
  flight the pipeline completes after starting it (the byte budget);
- the reads `ChunkReader.read_array` issues for each array (`array_reads`,
  which the reader itself calls);
- the storage requests those reads become (`Request`: file, offset, length;
  for a leaf with references or deltas, `blocks.fetches`' requests, some in
  its base checkpoints' files),
  once small whole arrays are gathered into runs (`coalesce.Runs`) and, on
  storages that charge per request, reads that land in place (and compressed
  reads that decode in place) into runs per file (`coalesce.Pieces`): both cut where `coalesce.Cut` says, the rule
  `Runs` and `Pieces` themselves follow, and a run also ends where the
  pipeline waits for one of its arrays;
- the host memory the process holds at its peak.

The engine executes its own process's plan (`engine._read_leaves`); the dry
run (`_sources.dryrun.plan_load`) computes the plan of every process and sums
them. A change to how reads are cut is made here, or in the functions named
above, once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .._core.boxes import Box, full_box
from .._format import manifest as fmt
from .._format.binindex import raw_blocks
from .._plan.leafreads import DEFAULT_MAX_READ, plan_leaf_reads, stored_span, whole_reads
from .._plan.readmemo import PlanMemo
from .._plan.reads import Read
from .._tree.shardings import (
    PUT_BATCH_BYTES,
    PUT_BATCH_ITEMS,
    WHOLE_PUT_BYTES,
    addressable_boxes,
    device_boxes,
    puts_whole,
)
from .blocks import block_places, fetches
from .coalesce import CODED_RUNS, Cut, refs_whole_span, run_limits, stored_whole_span, whole_span
from .landing import coded_lands, contiguous, lands_in_place, scratch_size, split_coded
from .readonce import ProcessOf
from .schedule import Schedule


class Span(NamedTuple):
    """A small whole array's bytes in storage, one run of a file: read together with its neighbours."""

    file: int
    start: int
    length: int  # bytes in storage
    coded: bool  # compressed: `length` stored bytes, decoded after the read

    @property
    def stored(self) -> int:
        """What `coalesce.Runs.add` takes: the stored bytes of a compressed array, else -1."""
        return self.length if self.coded else -1


def array_reads(leaf: fmt.ArrayLeaf, boxes: list[Box], region: Box | None, whole: bool, block: int, verify: bool,
                max_read: int, small: int, memo: PlanMemo) -> tuple[Span | None, list[Read]]:
    """How `ChunkReader.read_array` reads `boxes` of `leaf` (relative to `region`, where given): a small
    whole array as a `Span` that joins a run, anything else as its planned reads."""
    if whole and region is None and leaf.nbytes <= small:
        if leaf.refs:  # referred to (or partly its own), raw and back to back in one file
            raw = refs_whole_span(leaf, block)
            if raw is not None:
                return Span(raw[0], raw[1], leaf.nbytes, False), []
        elif leaf.codec == "none":
            raw = whole_span(leaf)
            if raw is not None:
                return Span(raw[0], raw[1], leaf.nbytes, False), []
        else:
            coded = stored_whole_span(leaf, block)
            if coded is not None:
                return Span(*coded, True), []
    absolute = boxes if region is None else [
        tuple((lo + o, hi + o) for (lo, hi), (o, _) in zip(b, region)) for b in boxes]
    if leaf.codec != "none" or leaf.refs:  # refs: blocks in raw addressing, as compressed ones
        return None, plan_leaf_reads(leaf, absolute, block, verify, max_read)
    reads = whole_reads(leaf, block, verify, max_read) if region is None and whole else None
    return None, reads if reads is not None else memo.plan(leaf, absolute, block, verify, max_read)


@dataclass(frozen=True)
class Limits:
    """What a storage states about reads, as the chunk reader uses it."""

    max_read: int  # the planner's largest read
    small: int  # the largest whole array that joins a run (`coalesce.run_limits`)
    run_bytes: int  # the largest run of small arrays
    pieces: int  # the largest run of in-place reads per file (`coalesce.Pieces`); 0: none gathered
    vectored: bool  # one request fills many buffers

    @classmethod
    def of(cls, storage: Any) -> Limits:
        small, run_bytes = run_limits(storage.preferred_read)
        return cls(storage.preferred_read or DEFAULT_MAX_READ, small, run_bytes, storage.preferred_read or 0,
                   storage.vectored_reads)


class Request(NamedTuple):
    """One storage request: `length` bytes of data file number `file` of checkpointable `item`, from `start`."""

    item: str
    file: int
    start: int
    length: int


class Step(NamedTuple):
    """One leaf of the direct pipeline, in the order the load starts them."""

    item: int  # its checkpointable's position in the load
    leaf: int  # its position in that checkpointable's index
    kind: str  # "value" (held in the index) | "bytes" (bytes and objects: read whole, then decoded) | "array"
    sharding: Any  # what the array is read with: None reads it whole into one buffer
    nbytes: int  # its host buffers
    finish: int  # arrays in flight the pipeline completes once this one is started (the budget)
    reads: tuple[Span | None, list[Read]] | None = None  # `array_reads`' answer, which the reader is handed


@dataclass(frozen=True)
class Plan:
    """One process's load: its schedule, its direct pipeline, its storage requests, its peak host memory."""

    process: int
    schedule: Schedule
    steps: tuple[Step, ...]
    requests: tuple[Request, ...]  # in the order they are sent
    peak_host_bytes: int

    @property
    def bytes_read(self) -> int:
        return sum(r.length for r in self.requests)


class _Holder:
    """Which boxes of a sharding process `p` holds: this process's own (`own`), or one of a dry run's."""

    def __init__(self, p: int, process_of: ProcessOf | None, own: bool):
        self.p, self.process_of, self.own = p, process_of, own

    def _of(self, d: Any) -> int:
        return d.process_index if self.process_of is None else self.process_of(d)

    def boxes(self, sharding: Any, shape: tuple[int, ...]) -> list[Box]:
        """Distinct boxes, in device order (as `shardings.addressable_boxes` gives the reader)."""
        if self.own:
            return addressable_boxes(sharding, shape)[0]
        devices, boxes = device_boxes(sharding, shape)
        return list(dict.fromkeys(b for d, b in zip(devices, boxes) if self._of(d) == self.p))

    def holds_all(self, sharding: Any) -> bool:
        if self.own:
            return puts_whole(sharding)
        return all(self._of(d) == self.p for d in sharding.device_set)


class _Cuts:
    """One reader's runs being gathered (`coalesce.Runs`, `coalesce.Pieces`), turned into requests.

    Each run has a number; an array holds the numbers of the runs it waits for."""

    def __init__(self, item: str, limits: Limits, out: list[Request]):
        self.item, self.limits, self.out = item, limits, out
        self.run: Cut | None = None  # small whole arrays
        self.run_no = -1
        self.pieces: dict[int, tuple[Cut, int]] = {}  # per file: reads that land in place (object stores)
        self.next = 0
        self.last = 0  # the bytes of the run the last piece joined

    def _send(self, cut: Cut) -> None:
        self.out.append(Request(self.item, cut.file, cut.start, cut.end - cut.start))

    def small(self, span: Span) -> int:
        end = span.start + span.length
        run = self.run
        if run is not None and not run.takes(span.file, span.start, end, self.limits.run_bytes):
            self._send(run)
            run = None
        if run is None:
            run = self.run = Cut(span.file, span.start, span.start)
            self.run_no, self.next = self.next, self.next + 1
        run.add(end)
        return self.run_no

    def end_small(self) -> None:
        """`read_array` of anything else sends the pending run of small arrays."""
        if self.run is not None:
            self._send(self.run)
            self.run = None

    def piece(self, file: int, start: int, end: int) -> int:
        open_ = self.pieces.get(file)
        if open_ is not None and not open_[0].takes(file, start, end, self.limits.pieces):
            self._send(self.pieces.pop(file)[0])
            open_ = None
        if open_ is None:
            open_ = self.pieces[file] = (Cut(file, start, start), self.next)
            self.next += 1
        cut, n = open_
        cut.add(end)
        self.last = end - cut.start  # the run's bytes so far
        if end - cut.start >= self.limits.pieces:  # full
            self._send(self.pieces.pop(file)[0])
        return n

    def alone(self, file: int, start: int, length: int) -> None:
        self.out.append(Request(self.item, file, start, length))

    def wait(self, runs: list[int]) -> None:
        """Waiting for an array sends the runs it is in (`coalesce._RunFuture`)."""
        if not runs:
            return
        if self.run is not None and self.run_no in runs:
            self.end_small()
        if self.pieces:
            for file in [f for f, (_, n) in self.pieces.items() if n in runs]:
                self._send(self.pieces.pop(file)[0])

    def flush(self) -> None:
        """`ChunkReader.submit_pending`."""
        self.end_small()
        for file in list(self.pieces):
            self._send(self.pieces.pop(file)[0])


class _Planner:
    def __init__(self, holder: _Holder, limits: Limits, threads: int):
        self.holder, self.limits, self.threads = holder, limits, threads
        self.requests: list[Request] = []
        self.memo = PlanMemo()
        self.peak = 0
        self.scratch_reads = self.scratch_max = 0  # reads through a thread's buffer, the largest one
        self.coded_runs = self.coded_max = 0  # compressed pieces gathered into runs, the largest run

    def scratch(self) -> int:
        """Per-thread buffers of reads that cannot land in place (lent for the load in `landing.scratch_size`
        classes, then kept in `buffers.load_pool`), and the buffers of compressed runs (`coalesce.CODED_RUNS`
        at most, as large as the largest run)."""
        coded = min(CODED_RUNS, self.coded_runs) * self.coded_max
        if not self.scratch_reads:
            return coded
        return min(self.threads, self.scratch_reads) * scratch_size(self.scratch_max) + coded

    def array(self, cuts: _Cuts, it: Any, leaf: fmt.ArrayLeaf, sharding: Any,
              region: Box | None) -> tuple[list[int], int, tuple[Span | None, list[Read]]]:
        """`ChunkReader.read_array(leaf, sharding, region)` on this process: the runs its array waits
        for, its host buffer bytes, and `array_reads`' answer."""
        if sharding is None and region is None:
            boxes, nbytes = [full_box(leaf.shape)], leaf.nbytes
        else:
            shape = leaf.shape if region is None else tuple(hi - lo for lo, hi in region)
            boxes = [full_box(shape)] if sharding is None else self.holder.boxes(sharding, shape)
            nbytes = sum(math.prod(hi - lo for lo, hi in b) for b in boxes) * leaf.dtype.itemsize
        block, lim = it.index.block_size, self.limits
        planned = array_reads(leaf, boxes, region, sharding is None, block, it.reader.verify, lim.max_read,
                              lim.small, self.memo)
        span, reads = planned
        if span is not None:
            return [cuts.small(span)], nbytes, planned
        cuts.end_small()
        shapes = [tuple(hi - lo for lo, hi in b) for b in boxes]
        runs: list[int] = []
        for r in reads:
            if leaf.refs:  # `blocks.read_blocks`: its `fetches`
                self._refs(cuts, it, leaf, r, shapes)
            elif leaf.codec != "none":  # `ChunkReader._do_read_coded`: the blocks' stored bytes, then decoded
                lands = coded_lands(r, shapes)
                if lim.pieces and lands:  # gathered per file (`Pieces.add_coded`), in the reader's buffers
                    file, first, stored = stored_span(leaf, r, block)
                    runs.append(cuts.piece(file, first, first + stored))
                    self.coded_runs += 1
                    self.coded_max = max(self.coded_max, cuts.last)
                    continue
                # Each read alone into a stored-bytes buffer; one that decodes in place in parts (`split_coded`),
                # one that does not through a raw buffer too.
                for part in split_coded(r, block) if lands else [r]:
                    file, first, stored = stored_span(leaf, part, block)
                    cuts.alone(file, first, stored)
                    self._scratch(stored + (0 if lands else r.nbytes))
            elif lim.pieces and not leaf.refs and lands_in_place(r, shapes, lim.vectored):
                runs.append(cuts.piece(r.file, r.start, r.end))
            else:
                cuts.alone(r.file, r.start, r.nbytes)
                if not lands_in_place(r, shapes, lim.vectored):
                    self._scratch(r.nbytes)
        return runs, nbytes, planned

    def _refs(self, cuts: _Cuts, it: Any, leaf: fmt.ArrayLeaf, r: Read, shapes: list[tuple[int, ...]]) -> None:
        """A read of a leaf with references or deltas: the requests `blocks.fetches` gives. A delta's base
        block is as the item's ``base_block(leaf, cell, block, (file, offset))`` says (a dry run looks it
        up in the base's index; the load reads it from the delta's header), else taken to be raw."""
        block = it.index.block_size
        places = block_places(leaf, r.file, block)
        raws = raw_blocks(leaf.chunk_nbytes(r.file), block)
        base_block = getattr(it, "base_block", None)

        def base_of(b: int) -> tuple[int, int]:
            return base_block(leaf, r.file, b, places[b][5]) if base_block is not None else (0, raws[b])

        got = fetches(places, r.start // block, -(-r.end // block), base_of)
        for fe in got:
            cuts.alone(fe.file, fe.start, fe.length)
        d = r.direct
        lands = d is not None and contiguous(shapes[d.dest], d.dest_start, d.shape)
        self._scratch(sum(fe.length for fe in got) + (0 if lands else r.nbytes))  # an upper bound

    def _scratch(self, nbytes: int) -> None:
        self.scratch_reads += 1
        self.scratch_max = max(self.scratch_max, nbytes)


def plan(items: list[Any], schedule: Schedule, budget: int, limits: Limits, process: int = 0,
         process_of: ProcessOf | None = None, *, own: bool = False, wanted: Sequence[Mapping[int, Any]] | None = None,
         threads: int = 8) -> Plan:
    """The plan of process `process` for a load of `items` (each with ``name``, ``index``, ``wanted`` and
    ``reader.verify``) under `schedule`, with at most about `budget` bytes of buffers in flight.

    `own`: the calling process plans its own load (its devices' boxes, as the
    reader asks for them); else `process_of` maps a device to its process
    (default: its ``process_index``). `wanted`: per item, that process's
    wanted leaves where they differ from ``item.wanted`` (per-process values).
    `threads` sizes the readers' scratch buffers in the peak memory figure.
    """
    pl = _Planner(_Holder(process, process_of, own), limits, threads)
    cuts = {id(it): _Cuts(it.name, limits, pl.requests) for it in items}
    skip = {(id(s.item), s.leaf) for s in schedule.staged}
    steps: list[Step] = []
    # The direct pipeline (`engine._read_direct`): arrays in flight are (bytes, reader, runs, put, cast);
    # pending batched puts hold their host arrays until flushed.
    inflight: deque[tuple[int, _Cuts, list[int], int, int]] = deque()
    held = pending = pending_n = 0

    def finish() -> None:
        nonlocal held, pending, pending_n
        nbytes, c, runs, put, cast = inflight.popleft()
        if runs:
            c.wait(runs)
        if held + pending + cast > pl.peak:  # a cast copy beside its buffer
            pl.peak = held + pending + cast
        held -= nbytes
        if put:
            pending += put
            pending_n += 1
            if pending_n >= PUT_BATCH_ITEMS or pending >= PUT_BATCH_BYTES:  # PutBatch flushes: no longer held
                pending = pending_n = 0

    for k, it in enumerate(items):
        c = cuts[id(it)]
        want_of = it.wanted if wanted is None else wanted[k]
        key = id(it)
        for i in sorted(want_of):
            if skip and (key, i) in skip:
                continue
            leaf = it.index.leaves[i]
            if isinstance(leaf, fmt.ValueLeaf):
                steps.append(Step(k, i, "value", None, 0, 0))
                continue
            if leaf.kind in ("bytes", "object"):  # `ChunkReader.read_bytes`: read whole, waited for at once
                runs, nbytes, _ = pl.array(c, it, leaf, None, None)
                c.wait(runs)
                pl.peak = max(pl.peak, held + pending + 2 * nbytes)  # the buffer, then the bytes
                steps.append(Step(k, i, "bytes", None, nbytes, 0))
                continue
            want = want_of[i]
            sharding = None if want is None else want.sharding
            whole = sharding is not None and leaf.nbytes <= WHOLE_PUT_BYTES and pl.holder.holds_all(sharding)
            read_with = None if whole else sharding
            runs, nbytes, planned = pl.array(c, it, leaf, read_with, None)
            cast = nbytes // leaf.dtype.itemsize * want.dtype.itemsize if (
                want is not None and want.dtype != leaf.dtype) else 0
            inflight.append((nbytes, c, runs, (cast or nbytes) if whole else 0, cast))
            held += nbytes
            if held + pending > pl.peak:
                pl.peak = held + pending
            done = 0
            while len(inflight) > 1 and held > budget:
                finish()
                done += 1
            steps.append(Step(k, i, "array", read_with, nbytes, done, planned))
    for c in cuts.values():  # `ChunkReader.submit_pending`, before the last arrays are waited for
        c.flush()
    while inflight:
        finish()
    # The read-once waves (`engine._run_wave`): each unit's blocks held at once, plus open gathers.
    gathers: dict[int, int] = {}
    for wave in schedule.waves:
        wave_bytes = 0
        runs_of: dict[int, list[int]] = {}
        for s, j in wave:
            leaf, region = s.want.leaf, s.region(j)
            runs, nbytes, _ = pl.array(cuts[id(s.item)], s.item, leaf, s.route.read, region)
            runs_of.setdefault(id(s.item), []).extend(runs)
            elems = nbytes // leaf.dtype.itemsize
            wave_bytes += nbytes + (elems * s.want.dtype.itemsize if s.want.dtype != leaf.dtype else 0)
            if j == 0:
                gathers[id(s)] = sum(math.prod(hi - lo for lo, hi in b)
                                     for b in pl.holder.boxes(s.want.sharding, leaf.shape)) * s.want.dtype.itemsize
        for key, runs in runs_of.items():
            cuts[key].wait(runs)
        pl.peak = max(pl.peak, wave_bytes + sum(gathers.values()))
        for s, j in wave:
            if j is not None and j == len(s.pieces) - 1:
                gathers.pop(id(s), None)
    for c in cuts.values():
        c.flush()
    return Plan(process, schedule, tuple(steps), tuple(pl.requests), pl.peak + pl.scratch())


__all__ = ["Limits", "Plan", "Request", "Span", "Step", "array_reads", "plan"]
