"""What a save or a load cost, and where it goes: stats, metrics events, listeners, a log line.

`SaveStats` and `LoadStats` are filled in by the engines (`_save`, `_load` and
the readers), per process. Once a save has committed or a load has returned,
`saved` / `loaded` publish them three ways:

- one INFO line on the ``cairn`` logger;
- `jax.monitoring` events under ``/cairn/save/...`` and ``/cairn/load/...``
  (durations with ``record_event_duration_secs``, bytes and requests with
  ``record_scalar``), only when JAX is imported already: nobody can have
  registered a monitoring listener otherwise, and a numpy-only load must not
  import JAX;
- every listener added with `add_listener`, called with a `StatsEvent`.

A failing listener (or monitoring hook) is logged and otherwise ignored: a
metrics bug never fails a checkpoint.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("cairn")

_GIB = float(1 << 30)


@dataclass
class SaveStats:
    """Timings (seconds) and sizes of one save, on this process."""

    blocking_s: float = 0.0  # validation, planning and snapshot: what the caller waited for
    snapshot_s: float = 0.0  # of which: device-to-host copies
    write_s: float = 0.0  # data files written and fsync'd
    commit_s: float = 0.0  # waiting for the other processes, index merge and commit
    total_s: float = 0.0
    bytes_written: int = 0  # by this process
    files_written: int = 0
    snapshot_bytes: int = 0  # copied to host memory during the blocking phase
    device_copy_bytes: int = 0  # over the snapshot budget: protected by on-device copies instead
    device_snapshot_bytes: int = 0  # protected by on-device copies that the writers bring to host
    queued_s: float = 0.0  # async: waiting for earlier saves of this process to finish
    skipped_steps: int = 0  # a continuous CheckpointManager: steps skipped since its previous save began
    retries: int = 0
    # What compression= decided: "raw", or the mode and the codecs of the leaves this process
    # chose, e.g. "auto (object storage at 0.50 GiB/s (default), 13 cores): 3 none, 120 planes"
    compression: str = ""

    @property
    def gib_per_s(self) -> float:
        """`bytes_written` over `total_s`, in GiB/s (0 before the save has finished)."""
        return self.bytes_written / _GIB / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class LoadStats:
    """Timings (seconds) and sizes of one load, on this process; `cairn.load` fills one in.

    The phases are disjoint stretches of the loading thread, so they add up
    to at most `total_s` (the rest: building the output tree). `plan_s` is
    the manifest, the indexes (and opening a checkpoint of another format),
    matching the target and planning the reads; `read_s` submitting reads
    and waiting for them (checksums included); `transfer_s` building the
    arrays from the host buffers (dtype casts, dispatching host-to-device
    copies, which JAX may finish later); `reshard_s` the collectives that
    move read-once leaves onto their target sharding.

    Each sharded array leaf takes a route (`routes`, `leaf_routes`): "direct"
    (this process reads its own shards) or read-once ("refined", "staged":
    distinct blocks read once cluster-wide, then moved by XLA collectives).
    `read_once_bytes_read` is the storage bytes of the read-once leaves, the
    rest of `bytes_read` the direct ones; `interconnect_bytes` what the
    collectives were predicted to bring in from other processes (the cost
    model's figure, not a measurement); `bandwidths` what routes were priced with.

    Example:

        stats = cairn.LoadStats()
        state = cairn.load("/ckpt/step_100", target, stats=stats)
        print(f"{stats.bytes_read / 2**30:.1f} GiB in {stats.reads} requests, {stats.gib_per_s:.2f} GiB/s")
    """

    bytes_read: int = 0  # from storage, by this process
    reads: int = 0  # storage requests
    direct_reads: int = 0  # of which: straight into the result buffers, no copy
    read_once_leaves: int = 0  # leaves read once cluster-wide and moved by collectives
    read_once_pieces: int = 0  # pieces of read-once leaves too large for the budget, one wave each
    read_once_bytes_read: int = 0  # of bytes_read: the blocks of read-once leaves
    interconnect_bytes: int = 0  # predicted: what the read-once collectives bring in from other processes
    routes: dict[str, int] = field(default_factory=dict)  # array leaves per route: direct, refined, staged
    leaf_routes: dict[str, str] = field(default_factory=dict)  # each sharded array leaf's route, by key path
    bandwidths: dict[str, Any] | None = None  # the figures the routes were priced with (None: not priced)
    plan_s: float = 0.0
    read_s: float = 0.0
    transfer_s: float = 0.0
    reshard_s: float = 0.0  # waiting for the collectives (and the status exchange before them)
    total_s: float = 0.0
    retries: int = 0  # storage requests retried

    @property
    def gib_per_s(self) -> float:
        """`bytes_read` over `total_s`, in GiB/s (0 before the load has finished)."""
        return self.bytes_read / _GIB / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ProgressStats:
    """How far a long operation (`cairn.copy`, a move, an export) has come: what a ``"progress"`` event carries.

    `op` names the operation (``"copy"``, ``"move"``, ``"convert"``, ``"export_safetensors"``,
    ``"export_orbax"``, ``"export_torch"``); `bytes_total` is None until it is known.
    Events come at most every `PROGRESS_INTERVAL` seconds while it runs, and once at its end
    (`finished` true).

    Example:

        @cairn.add_listener
        def show(event):
            if event.kind == "progress":
                p = event.stats
                print(f"{p.op}: {p.bytes_done}/{p.bytes_total} bytes, {p.gib_per_s:.2f} GiB/s, {p.eta_s} s left")
    """

    op: str
    bytes_done: int
    bytes_total: int | None
    elapsed_s: float
    finished: bool = False

    @property
    def gib_per_s(self) -> float:
        """The rate so far, in GiB/s."""
        return self.bytes_done / _GIB / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far (None while the total or the rate is unknown)."""
        if self.bytes_total is None or self.bytes_done <= 0 or self.elapsed_s <= 0:
            return None
        return max(0.0, (self.bytes_total - self.bytes_done) * self.elapsed_s / self.bytes_done)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "gib_per_s": self.gib_per_s, "eta_s": self.eta_s}


@dataclass(frozen=True)
class StatsEvent:
    """What a listener added with `cairn.add_listener` gets after each save or load of this process.

    `kind` is ``"save"`` (after the commit; for an async save on its
    background thread, before its future resolves) or ``"load"`` (before
    `cairn.load` returns); `stats` is its `SaveStats` or `LoadStats`. A listener
    added with ``progress=True`` also gets ``"progress"`` events of long operations,
    whose `stats` is a `ProgressStats`.
    """

    kind: str
    path: str
    stats: SaveStats | LoadStats | ProgressStats


Listener = Callable[[StatsEvent], object]

_listeners: list[Listener] = []
_progress_listeners: list[Listener] = []
_lock = threading.Lock()

#: The least time between two progress events of one operation, in seconds.
PROGRESS_INTERVAL = 0.5


class Progress:
    """The progress of one long operation, published to the listeners that asked for it.

    `set_total` and `advance` have the shapes of the ``on_total`` / ``progress`` callbacks that
    `cairn.copy` and friends take; `wrap` chains a caller's callbacks with them. Cheap when nobody
    listens (one list check per call), thread-safe, and throttled to `PROGRESS_INTERVAL`.
    """

    def __init__(self, op: str, path: str) -> None:
        self.op, self.path = op, path
        self.done = 0
        self.total: int | None = None
        self._t0 = time.monotonic()
        self._last = self._t0
        self._lock = threading.Lock()

    def set_total(self, n: int) -> None:
        with self._lock:
            self.total = n

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last < PROGRESS_INTERVAL or not _progress_listeners:
                return
            self._last = now
        self._publish(False)

    def finish(self) -> None:
        """Publish the last event (`finished` true)."""
        self._publish(True)

    def _publish(self, finished: bool) -> None:
        if not _progress_listeners:
            return
        with self._lock:
            stats = ProgressStats(self.op, self.done, self.total, time.monotonic() - self._t0, finished)
        _notify(StatsEvent("progress", self.path, stats), _progress_listeners)

    def wrap(self, on_total: Callable[[int], None] | None,
             progress: Callable[[int], None] | None) -> tuple[Callable[[int], None], Callable[[int], None]]:
        """``(on_total, progress)`` that feed this and then the caller's callbacks (either may be None)."""
        def total(n: int) -> None:
            self.set_total(n)
            if on_total is not None:
                on_total(n)

        def step(n: int) -> None:
            self.advance(n)
            if progress is not None:
                progress(n)

        return total, step


def add_listener(fn: Listener, *, progress: bool = False) -> Listener:
    """Call ``fn(event)`` with a `StatsEvent` after every save and load of this process; returns `fn`.

    `fn` runs on the thread that finished the work (an async save's background
    thread); an exception it raises is logged as a warning and otherwise
    ignored. Remove it with `cairn.remove_listener`. With ``progress=True`` it
    also gets ``"progress"`` events (a `ProgressStats`) while `cairn.copy` or an export runs,
    on the thread that moved the bytes: a progress bar of the library's own.

    Example:

        @cairn.add_listener
        def to_wandb(event):
            wandb.log({f"cairn/{event.kind}/gib_per_s": event.stats.gib_per_s})
    """
    if not callable(fn):
        raise TypeError(f"a cairn listener must be callable, got {fn!r}")
    with _lock:
        _listeners.append(fn)
        if progress:
            _progress_listeners.append(fn)
    return fn


def remove_listener(fn: Listener) -> None:
    """Stop calling `fn` (added with `cairn.add_listener`); nothing happens if it is not added.

    Example:

        cairn.remove_listener(to_wandb)
    """
    with _lock:
        if fn in _listeners:
            _listeners.remove(fn)
        if fn in _progress_listeners:
            _progress_listeners.remove(fn)


def saved(path: str, stats: SaveStats) -> None:
    """Publish the stats of a committed save."""
    _publish(StatsEvent("save", path, stats), "saved %s: %.1f MiB in %d files, %.2f s (%.2f GiB/s; blocking %.2f s, "
             "write %.2f s, commit %.2f s)", (stats.bytes_written / (1 << 20), stats.files_written, stats.total_s,
             stats.gib_per_s, stats.blocking_s, stats.write_s, stats.commit_s),
             {"blocking_s": stats.blocking_s, "write_s": stats.write_s, "commit_s": stats.commit_s,
              "total_s": stats.total_s}, {"bytes": stats.bytes_written, "files": stats.files_written})


def loaded(path: str, stats: LoadStats) -> None:
    """Publish the stats of a finished load."""
    _publish(StatsEvent("load", path, stats), "loaded %s: %.1f MiB in %d requests, %.2f s (%.2f GiB/s; plan %.2f s, "
             "read %.2f s, transfer %.2f s, reshard %.2f s)", (stats.bytes_read / (1 << 20), stats.reads,
             stats.total_s, stats.gib_per_s, stats.plan_s, stats.read_s, stats.transfer_s, stats.reshard_s),
             {"plan_s": stats.plan_s, "read_s": stats.read_s, "transfer_s": stats.transfer_s,
              "reshard_s": stats.reshard_s, "total_s": stats.total_s},
             {"bytes": stats.bytes_read, "requests": stats.reads})


def _publish(event: StatsEvent, line: str, args: tuple[Any, ...], durations: dict[str, float],
             scalars: dict[str, int]) -> None:
    try:
        log.info("cairn: " + line, event.path, *args)
    except Exception:  # a user's logging filter; an async save's future must still resolve
        pass
    _monitor(event.kind, durations, scalars)
    _notify(event)


def _monitor(kind: str, durations: dict[str, float], scalars: dict[str, int]) -> None:
    """`jax.monitoring` events ``/cairn/<kind>/<name>``, if JAX is in use."""
    if "jax" not in sys.modules:
        return
    try:
        import jax.monitoring as monitoring

        for name, secs in durations.items():
            monitoring.record_event_duration_secs(f"/cairn/{kind}/{name}", secs)
        record_scalar = getattr(monitoring, "record_scalar", None)  # absent in older JAX
        for name, value in scalars.items():
            if record_scalar is not None:
                record_scalar(f"/cairn/{kind}/{name}", value)
    except Exception as e:
        log.warning("cairn: a jax.monitoring listener failed on the %s stats: %s", kind, e)


def _notify(event: StatsEvent, which: list[Listener] | None = None) -> None:
    with _lock:
        listeners = list(_listeners if which is None else which)
    for fn in listeners:
        try:
            fn(event)
        except Exception as e:
            log.warning("cairn: stats listener %r failed on the %s of %s: %s", fn, event.kind, event.path, e)


__all__ = ["LoadStats", "Progress", "ProgressStats", "SaveStats", "StatsEvent", "add_listener", "loaded",
           "remove_listener", "saved"]
