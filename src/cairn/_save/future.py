"""Saves on a `Location`: blocking, or async with back-pressure and no lost errors.

The engine entry points under `cairn.save` / `cairn.save_async` (which
resolve the user's path first) and `CheckpointManager` (which saves on its own
storage). An async save returns after validation and the snapshot; its write
and commit run on a background thread of its own, which first waits for the
save before it, so the saves of a process commit one at a time, in order.

- Back-pressure: at most `MAX_PENDING` async saves hold snapshots at once;
  another `save_async` first waits for the oldest.
- No lost errors: a failed background save is logged at once and kept as
  *uncollected* until its `SaveFuture`'s ``result()`` / ``exception()`` is
  called; otherwise the next `save`, `save_async` or `wait_all` of the process
  raises it instead of starting.
- At exit, the saves in flight finish (see `_exit_hook`).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .._core import stats as _stats
from .._core.buffers import MAX_SNAPSHOTS
from .._core.stats import SaveStats
from .._errors import CheckpointError
from .._storage.location import Location
from . import engine as _save
from .options import SaveOptions, save_options_of

log = logging.getLogger("cairn")


class SaveFuture:
    """The handle `save_async` returns: resolves once the checkpoint is committed.

    ``result()`` re-raises any error from the background phase; ``stats`` holds
    per-phase timings (``blocking_s``, ``queued_s``, ``write_s``, ``commit_s``)
    and byte counts, filled in as the phases finish. ``done()``,
    ``exception()`` and ``add_done_callback(fn)`` (``fn(future)`` runs on the
    background thread once the save has committed or failed) are as for a
    `concurrent.futures.Future`.

    Example:

        f = cairn.save_async("/ckpt/step_100", state)
        f.add_done_callback(lambda f: print(f.path, "failed" if f.exception() else "committed"))
        f.result(timeout=600)          # raises the save's error, if any
        print(f.stats.blocking_s, f.stats.write_s, f.stats.bytes_written)
    """

    def __init__(self, path: str, job: _save.SaveJob | None, future: Future[SaveStats]):
        self.path = path
        self._job = job
        self._future = future

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveStats:
        """Wait for the commit; returns the stats or raises the save's error."""
        try:
            return self._future.result(timeout)
        except BaseException:
            if self._future.done():
                _background.reported(self._future)
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the save; its error, or None if it committed."""
        e = self._future.exception(timeout)
        if e is not None:
            _background.reported(self._future)
        return e

    def add_done_callback(self, fn: Callable[[SaveFuture], object]) -> None:
        """Call ``fn(future)`` once the save has committed or failed.

        `fn` runs on the save's background thread (at once, on this thread, if
        the save is done already); `wait_all` returns only after it has run.
        An exception it raises is logged and otherwise ignored. Calling
        ``result()`` or ``exception()`` inside `fn` collects the save's error,
        as anywhere else: the next save then no longer raises it.

        Example:

            f = cairn.save_async("/ckpt/step_100", state)
            f.add_done_callback(lambda f: print(f.path, "failed" if f.exception() else "committed"))
        """
        self._future.add_done_callback(lambda _f: fn(self))

    @property
    def stats(self) -> SaveStats:
        """The save's `cairn.SaveStats`, filled in as it goes: ``blocking_s`` once this future exists,
        the write and commit figures once it is done (``f.result()`` returns the same object)."""
        if self._job is not None:
            return self._job.stats
        return self._future.result()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<cairn.SaveFuture {self.path!r} {state}>"


def error_of(future: SaveFuture) -> BaseException | None:
    """The error of a finished save, without collecting it (the next save still raises it)."""
    return future._future.exception()


#: At most this many async saves of a process hold snapshots at once (one
#: writing, one queued behind it); a further save_async waits for the oldest,
#: so host memory for snapshots never grows with the number of queued saves.
MAX_PENDING = MAX_SNAPSHOTS


class _Background:
    """The async saves of this process: they commit one at a time, in order.

    Each save runs on its own thread, which first waits for the save before
    it. A failed save is logged at once and kept as *unreported* until its
    error is collected (``SaveFuture.result()`` / ``exception()``); the next
    `save` or `save_async` of the process raises it instead of starting, so an
    error is never lost even when nobody looks at the future.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: list[Future[Any]] = []
        self._paths: dict[Future[Any], str] = {}  # each pending save's checkpoint path
        self._last: Future[Any] | None = None
        self._unreported: list[tuple[Future[Any], str, BaseException]] = []

    def submit(self, job: _save.SaveJob) -> Future[SaveStats]:
        fut: Future[SaveStats] = Future()
        with self._lock:
            before = self._last
            self._last = fut
            self._pending.append(fut)
            self._paths[fut] = job.loc.path

        def run() -> None:
            t0 = time.perf_counter()
            if before is not None:
                try:
                    before.result()
                except BaseException:
                    pass  # reported by its own future; this save goes on
            job.stats.queued_s = time.perf_counter() - t0
            if not fut.set_running_or_notify_cancel():
                self._finish(fut)
                return
            try:
                stats = job.run()
            except BaseException as e:
                log.error("cairn: background save to %s failed: %s", job.loc.path, e)
                with self._lock:
                    self._unreported.append((fut, job.loc.path, e))
                fut.set_exception(e)
            else:
                _stats.saved(job.loc.path, stats)  # committed: listeners run before the future resolves
                fut.set_result(stats)
            finally:
                self._finish(fut)

        threading.Thread(target=run, name="cairn-save", daemon=True).start()
        return fut

    def _finish(self, fut: Future[Any]) -> None:
        with self._cond:
            self._pending.remove(fut)
            self._paths.pop(fut, None)
            self._cond.notify_all()

    def in_flight(self) -> set[str]:
        """The paths of the async saves not finished yet."""
        with self._lock:
            return set(self._paths.values())

    def wait_for_room(self, limit: int, timeout: float | None = None) -> bool:
        """Block until fewer than `limit` saves are pending (at most `timeout` s); whether they are."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._pending) < limit, timeout)

    def reported(self, fut: Future[Any]) -> None:
        with self._lock:
            self._unreported = [u for u in self._unreported if u[0] is not fut]

    def raise_unreported(self) -> None:
        """Raise (once) the error of an earlier async save nobody has collected."""
        with self._lock:
            failed, self._unreported = self._unreported, []
        if not failed:
            return
        _, path, e = failed[0]
        more = f" ({len(failed) - 1} later async saves failed too, see the log)" if len(failed) > 1 else ""
        raise CheckpointError(
            f"an earlier async save to {path} failed: {e}{more}. Raised here because its future's "
            "result() was never collected; the save just requested was not started"
        ) from e

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait until the saves pending now are resolved and their done-callbacks have run.

        A save leaves `_pending` only after ``set_result``/``set_exception``
        returns, i.e. after its callbacks (the manager's retention) finished.
        """
        with self._cond:
            pending = list(self._pending)
            self._cond.wait_for(lambda: not any(f in self._pending for f in pending), timeout)


_background = _Background()


def _exit_hook() -> None:
    # Finish the saves in flight (their errors were logged when they failed).
    _background.wait_all()


# concurrent.futures refuses new work once interpreter shutdown begins, and
# an `atexit` hook runs after that point (and after JAX's own exit hooks), so
# a save still queued would fail. threading's exit hooks run before both; the
# module-level import of `_save` above has already loaded concurrent.futures'
# hook, and later registrations run first.
try:
    threading._register_atexit(_exit_hook)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # not CPython, or already shutting down
    atexit.register(_exit_hook)


def wait_all(timeout: float | None = None) -> None:
    """Block until every async save of this process has finished.

    Raises the error of a failed save whose future nobody collected (once),
    like the next save would.

    Example:

        cairn.save_async("/ckpt/final", state)
        cairn.wait_all()               # e.g. before leaving the training script
    """
    _background.wait_all(timeout)
    _background.raise_unreported()


def raise_unreported() -> None:
    """Raise (once) the error of an earlier async save whose future nobody collected."""
    _background.raise_unreported()


def wait_for_room(timeout: float | None = None) -> bool:
    """Wait until another async save may start without waiting (fewer than `MAX_PENDING` pending),
    at most `timeout` seconds; whether it may."""
    return _background.wait_for_room(MAX_PENDING, timeout)


def admit() -> None:
    """What an async save does before anything else: raise an uncollected error, then wait for room.

    Idempotent: `save_async` calls it again, so a caller that calls it first
    (to keep this order before work of its own) loses nothing.
    """
    _background.raise_unreported()
    _background.wait_for_room(MAX_PENDING)


def save(loc: Location, state: Any, options: SaveOptions | None = None, *,
         metadata: dict[str, Any] | None = None, incremental: dict[str, Any] | None = None,
         **changes: Any) -> SaveStats:
    """Save `state` at `loc` and return once committed (see `cairn.save`); queues behind async saves.

    `options` with keyword `changes` (`SaveOptions`' names); a snapshot budget does not apply here.
    """
    opts = save_options_of(options, changes)
    _background.raise_unreported()
    _background.wait_all()  # a blocking save queues behind async ones
    # `incremental`: `prepare`'s base, hashes and base_required (an incremental save, format 4)
    job = _save.prepare(loc, state, opts, metadata=metadata, **(incremental or {}))
    stats = job.run()
    _stats.saved(loc.path, stats)
    return stats


def save_async(loc: Location, state: Any, options: SaveOptions | None = None, *,
               metadata: dict[str, Any] | None = None, started: float | None = None,
               incremental: dict[str, Any] | None = None, **changes: Any) -> SaveFuture:
    """Start saving `state` at `loc`; return after validation and the snapshot (see `cairn.save_async`).

    `options` with keyword `changes` (`SaveOptions`' names). `started` (a
    ``time.perf_counter()`` value, default now) is when the caller's request
    began, so that ``stats.blocking_s`` counts the caller's own work before
    this call (resolving a path, its own `admit`).
    """
    t0 = time.perf_counter() if started is None else started
    opts = save_options_of(options, changes)
    admit()
    # `incremental`: `prepare`'s base, hashes and base_required (an incremental save, format 4)
    job = _save.prepare(loc, state, opts, metadata=metadata, **(incremental or {}))
    if job.inc is not None:  # a base still being saved decides nothing before the snapshot (`decide_unchanged`)
        job.inc.in_flight = _background.in_flight()
    job.snapshot(opts.snapshot_budget_bytes)
    # What the caller waited for: back-pressure, validation, planning, snapshot.
    job.stats.blocking_s = time.perf_counter() - t0
    return SaveFuture(loc.path, job, _background.submit(job))
