"""The bandwidth a storage's link gave this process: measured from the real transfers of saves and loads.

`compression="auto"` weighs the codecs' speed against the storage's bandwidth (`base.bandwidth_of`):
declared by the storage or the user where known, else measured here, else the kind's default. The
save and load engines report what each save's data writes and each load's data reads moved, how
long they took and how long the link was busy with them (`record`); later saves to the same link
(same object-store endpoint and bucket, same network filesystem root) in this process price their
leaves with it.

Two figures per link and direction, because a transfer that codes is not priced like one that does
not:

- **raw**: the link's own speed, what a raw save or load gets: bytes over the link's time
  (`link_seconds`): the stretches during which at least one transfer of this process was busy,
  concurrency included (four writer threads at once are one stretch, not four), minus the stretches
  in which a writer was waiting for the bytes it sends (the codec coding them, checksums). So the
  codec's time is never taken for link time. Measured by transfers that coded nothing; before any
  such, the link figure of coded saves stands in (it is optimistic where the codec held the save:
  bytes that moved while every writer waited on the codec are not seen, so the next save may try
  the link raw, and then measures it).
- **coded**: what transfers that coded reached, end to end: bytes over wall time, their codec and
  whatever it took from the link included (on a host whose cores also serve the storage, or
  encrypt its traffic, coding slows the link). A save's "auto" prices the coded direction at
  ``max(stored / coded, raw / codec speed)``, so it predicts a coded transfer to take at least what
  the last ones took. A load's decoding runs inside its read time and cannot be told apart: its
  figure is only ever a coded one. Before any coded transfer, the raw figure stands in.

  Coded figures are kept per codec too (the codec that coded most of the transfer's raw bytes): one
  codec's end-to-end figure says little of another's, which codes 3x as fast. A codec with a figure of
  its own is priced with it; one never measured yet on a link where others were, with the link's raw
  figure (what it would reach were it never the bottleneck, as before any coded transfer), so that
  "auto" tries it and then measures it; a transfer that names no codec (as before this) feeds only
  the figures of all codecs together.

Transfers under `MIN_SAMPLE_BYTES` are ignored (request latency, not bandwidth, decides their time).
Each figure is the median of its last `KEEP` samples. A direction with no sample at all takes the
other direction's figures (a link measured one way is a better guess for the other than a
default). Local disks are not measured: their writes land in the page cache, and what the save
waits for is fsync, not a link (`MEASURED_KINDS`).
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: Transfers (one save's data writes, one load's data reads) of fewer bytes are not measured.
MIN_SAMPLE_BYTES = 8 << 20
#: Samples kept per figure (link, direction, raw or coded); the figure is their median.
KEEP = 5
#: The storage kinds whose bandwidth is measured (`base.KINDS`).
MEASURED_KINDS = ("object", "network")
DIRECTIONS = ("write", "read")


def union_seconds(spans: Iterable[tuple[float, float]]) -> float:
    """The length of the union of the intervals [a, b) of `spans`."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= a:
            continue
        if a >= end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def link_seconds(transfers: Iterable[tuple[float, float, Iterable[tuple[float, float]]]]) -> tuple[float, float]:
    """(link seconds, wall seconds) of `transfers`, each ``(start, end, waits)``: a transfer from
    `start` to `end`, during `waits` (intervals inside it) waiting for its own bytes (the codec).

    Link seconds: the union over transfers of their time minus their waits; wall seconds: the
    union of the transfers' whole spans.
    """
    busy: list[tuple[float, float]] = []
    whole: list[tuple[float, float]] = []
    for start, end, waits in transfers:
        whole.append((start, end))
        at = start
        for a, b in sorted(waits):
            a, b = max(a, start), min(b, end)
            if a > at:
                busy.append((at, a))
            at = max(at, b)
        if end > at:
            busy.append((at, end))
    return union_seconds(busy), union_seconds(whole)


@dataclass(frozen=True)
class Sample:
    """What one save's data writes or one load's data reads tell of a link, in bytes/s."""

    link: float  # bytes over the link's own time (`link_seconds`)
    wall: float  # bytes over the wall time
    coded: bool  # whether the transfer carried coded blocks (a coded save, or a load of them)
    codec: str | None = None  # the codec of most of a coded transfer's raw bytes, where known


def sample_of(nbytes: int, link_s: float, wall_s: float, coded: bool = False,
              codec: str | None = None) -> Sample | None:
    """The `Sample` of a transfer of `nbytes` that took `wall_s` seconds, of which the link was busy
    `link_s` (`link_seconds`), `coded` or not (by `codec`, most of it, where known). None for a transfer
    too small (`MIN_SAMPLE_BYTES`) or without a time."""
    if nbytes < MIN_SAMPLE_BYTES or wall_s <= 0:
        return None
    link_s = min(max(link_s, 0.0), wall_s)
    wall = nbytes / wall_s
    return Sample(nbytes / link_s if link_s > 0 else wall, wall, coded, codec if coded else None)


def main_codec(raw_by_codec: dict[str, int]) -> str | None:
    """The codec of most of a transfer's raw bytes (`raw_by_codec`: raw bytes per codec), None for none:
    what its `Sample` is kept as (`sample_of`'s `codec`)."""
    return max(raw_by_codec, key=raw_by_codec.__getitem__) if raw_by_codec else None


@dataclass
class _Direction:
    raw: deque[float] = field(default_factory=lambda: deque(maxlen=KEEP))  # link figures of raw transfers
    coded_link: deque[float] = field(default_factory=lambda: deque(maxlen=KEEP))  # ... of coded ones
    coded: deque[float] = field(default_factory=lambda: deque(maxlen=KEEP))  # wall figures of coded ones
    by_codec: dict[str, deque[float]] = field(default_factory=dict)  # ... by the codec of most of their bytes

    def add(self, s: Sample) -> None:
        if s.coded:
            self.coded.append(s.wall)
            self.coded_link.append(s.link)
            if s.codec is not None:
                self.by_codec.setdefault(s.codec, deque(maxlen=KEEP)).append(s.wall)
        else:
            self.raw.append(s.link)

    def estimate(self, coded: bool, codec: str | None = None) -> float | None:
        if coded and codec is not None and self.by_codec:
            own = self.by_codec.get(codec)
            if own:
                return statistics.median(own)
            if self.raw:  # a codec not measured here yet: the link's own figure (see the module doc)
                return statistics.median(self.raw)
        first, then = (self.coded, self.raw) if coded else (self.raw, self.coded_link)
        for figures in (first, then):
            if figures:
                return statistics.median(figures)
        return None


class LinkMeter:
    """Measured bandwidths by link, direction and whether the transfer codes, for this process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._links: dict[str, dict[str, _Direction]] = {}

    def record(self, link: str, direction: str, sample: Sample | None) -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
        if sample is None:
            return
        with self._lock:
            self._links.setdefault(link, {d: _Direction() for d in DIRECTIONS})[direction].add(sample)

    def bandwidth(self, link: str, direction: str, coded: bool = False, codec: str | None = None) -> float | None:
        """The measured bytes/s of `link` in `direction` for raw or `coded` transfers (by `codec`: its own
        figure, `_Direction.estimate`) (else the other direction's), or None."""
        with self._lock:
            dirs = self._links.get(link)
            if dirs is None:
                return None
            own = dirs[direction].estimate(coded, codec)
            if own is not None:
                return own
            other = next(d for d in DIRECTIONS if d != direction)
            return dirs[other].estimate(coded, codec)

    def clear(self) -> None:
        with self._lock:
            self._links.clear()


#: This process's measurements (`record`, `measured_bandwidth`).
METER = LinkMeter()


def link_of(storage: Any) -> str | None:
    """What identifies `storage`'s link to measure, or None where it is not measured (a local disk,
    `MEASURED_KINDS`, or ``memory://``): an object store's scheme, bucket and endpoint or account; a network
    filesystem's root folder."""
    kind = storage.kind
    if kind not in MEASURED_KINDS or storage.in_process:  # memory:// is a copy, not a link
        return None
    url = str(storage.url)
    if kind == "object":
        scheme, _, rest = url.partition("://")
        bucket = rest.split("/", 1)[0]
        config = getattr(storage, "_config", None) or {}
        where = ",".join(f"{k}={v}" for k, v in sorted(config.items())
                         if "endpoint" in k or "account" in k)
        return f"{kind}:{scheme}://{bucket}" + (f"@{where}" if where else "")
    return f"{kind}:{url}"


def record(storage: Any, direction: str, sample: Sample | None) -> None:
    """Record `sample` (`sample_of`) of a transfer to or from `storage` in `direction` ("write", "read")."""
    link = link_of(storage)
    if link is not None:
        METER.record(link, direction, sample)


def measured_bandwidth(storage: Any, direction: str = "write", coded: bool = False,
                       codec: str | None = None) -> float | None:
    """The bandwidth this process measured to or from `storage` (bytes/s) for raw or `coded`
    transfers (by `codec`, where given: `LinkMeter.bandwidth`), or None."""
    link = link_of(storage)
    return None if link is None else METER.bandwidth(link, direction, coded, codec)


class TransferClock:
    """The spans of one save's data writes and the waits inside them, from the writer threads
    (`transfer`), for `link_seconds`."""

    def __init__(self, clock: Any = None) -> None:
        import time

        self.now = clock or time.perf_counter
        self._lock = threading.Lock()
        self.transfers: list[tuple[float, float, list[tuple[float, float]]]] = []

    def feeding(self, parts: Iterable[Any], waits: list[tuple[float, float]]) -> Iterator[Any]:
        """`parts`, with the time spent producing each piece appended to `waits`."""
        it = iter(parts)
        now = self.now
        while True:
            a = now()
            try:
                piece = next(it)
            except StopIteration:
                waits.append((a, now()))
                return
            waits.append((a, now()))
            yield piece

    def transfer(self, write: Any, key: str, parts: Iterable[Any]) -> Any:
        """``write(key, parts)``, its span and its waits for `parts` recorded."""
        waits: list[tuple[float, float]] = []
        start = self.now()
        try:
            return write(key, self.feeding(parts, waits))
        finally:
            end = self.now()
            with self._lock:
                self.transfers.append((start, end, waits))

    def seconds(self) -> tuple[float, float]:
        """(link seconds, wall seconds) of the transfers so far (`link_seconds`)."""
        with self._lock:
            return link_seconds(list(self.transfers))
