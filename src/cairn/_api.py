"""The public functions: save, save_async, load, metadata."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any

from . import _load, _save
from ._coord import Coordinator
from ._errors import CheckpointError
from ._location import resolve

log = logging.getLogger("cairn")
PathLike = str | os.PathLike[str]


class SaveFuture:
    """The handle `save_async` returns: resolves once the checkpoint is committed.

    ``result()`` re-raises any error from the background phase; ``stats`` holds
    per-phase timings (``blocking_s``, ``queued_s``, ``write_s``, ``commit_s``)
    and byte counts, filled in as the phases finish.

    Example::

        f = cairn.save_async("/ckpt/step_100", state)
        f.result(timeout=600)          # raises the save's error, if any
        print(f.stats.blocking_s, f.stats.write_s, f.stats.bytes_written)
    """

    def __init__(self, path: str, job: _save.SaveJob | None, future: Future[_save.SaveStats]):
        self.path = path
        self._job = job
        self._future = future

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> _save.SaveStats:
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

    @property
    def stats(self) -> _save.SaveStats:
        if self._job is not None:
            return self._job.stats
        return self._future.result()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<cairn.SaveFuture {self.path!r} {state}>"


#: At most this many async saves of a process hold snapshots at once (one
#: writing, one queued behind it); a further save_async waits for the oldest,
#: so host memory for snapshots never grows with the number of queued saves.
MAX_PENDING = 2


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
        self._last: Future[Any] | None = None
        self._unreported: list[tuple[Future[Any], str, BaseException]] = []

    def submit(self, job: _save.SaveJob) -> Future[_save.SaveStats]:
        fut: Future[_save.SaveStats] = Future()
        with self._lock:
            before = self._last
            self._last = fut
            self._pending.append(fut)

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
                fut.set_result(stats)
            finally:
                self._finish(fut)

        threading.Thread(target=run, name="cairn-save", daemon=True).start()
        return fut

    def _finish(self, fut: Future[Any]) -> None:
        with self._cond:
            self._pending.remove(fut)
            self._cond.notify_all()

    def wait_for_room(self, limit: int, timeout: float | None = None) -> None:
        """Block until fewer than `limit` saves are pending."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._pending) < limit, timeout)

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

    Example::

        cairn.save_async("/ckpt/final", state)
        cairn.wait_all()               # e.g. before leaving the training script
    """
    _background.wait_all(timeout)
    _background.raise_unreported()


def save(
    path: PathLike,
    state: Any,
    *,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    coordinator: Coordinator | None = None,
    threads: int = 4,
    split_replicas: bool = False,
    timeout: float = 1800.0,
) -> _save.SaveStats:
    """Save `state` at `path` and return once it is committed.

    `state` is any pytree of ``jax.Array``, numpy arrays, scalars, strings,
    bytes and ``None``. When it is a mapping with string keys, each key is a
    checkpointable stored (and loadable) on its own. Every process of a
    multi-process program calls `save` with its part of the same global state;
    each writes only the shards it owns.

    Example::

        cairn.save("/ckpt/step_100", {"params": params, "opt": opt_state, "step": 100})

    Raises `CheckpointExistsError` if `path` already holds a checkpoint (unless
    `overwrite`), `UnsupportedTypeError` for a leaf cairn cannot store, and
    `CheckpointError` (without saving) if an earlier async save failed and its
    error was never collected from its future.
    """
    _background.raise_unreported()
    loc = resolve(path, storage_options)
    _background.wait_all()  # a blocking save queues behind async ones
    job = _save.prepare(
        loc, state, overwrite=overwrite, coordinator=coordinator, threads=threads,
        split_replicas=split_replicas, timeout=timeout, metadata=metadata,
    )
    return job.run()


def save_async(
    path: PathLike,
    state: Any,
    *,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    coordinator: Coordinator | None = None,
    threads: int = 4,
    split_replicas: bool = False,
    timeout: float = 1800.0,
    snapshot_budget_bytes: int | None = None,
) -> SaveFuture:
    """Start saving `state` at `path`; return after validation and the snapshot.

    The arrays may be updated, deleted or donated as soon as this returns: the
    checkpoint holds their values at the time of the call. Writing, fsync and
    the commit run in the background, one save at a time per process, in the
    order requested; ``future.result()`` waits for them and raises their error.

    `snapshot_budget_bytes` bounds the host memory of the snapshot: shards
    beyond it are protected by on-device copies and brought to host while
    writing. With two saves already pending, this call first waits for the
    oldest to finish. If an earlier async save failed and nobody collected its
    error, this call raises that error instead of starting (it is also logged
    when it happens), so a failing disk cannot go unnoticed.

    Example::

        f = cairn.save_async(f"/ckpt/step_{step}", state)
        state = train_step(state)      # may donate the saved buffers
        f.result()
    """
    t0 = time.perf_counter()
    _background.raise_unreported()
    _background.wait_for_room(MAX_PENDING)
    loc = resolve(path, storage_options)
    job = _save.prepare(
        loc, state, overwrite=overwrite, coordinator=coordinator, threads=threads,
        split_replicas=split_replicas, timeout=timeout, metadata=metadata,
    )
    job.snapshot(snapshot_budget_bytes)
    # What the caller waited for: back-pressure, validation, planning, snapshot.
    job.stats.blocking_s = time.perf_counter() - t0
    return SaveFuture(os.fspath(path), job, _background.submit(job))


def load(
    path: PathLike,
    target: Any = None,
    *,
    partial: bool = False,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    threads: int = 8,
    framework: str = "numpy",
) -> Any:
    """Load a checkpoint, whole or in part, onto any sharding.

    Without `target`, every checkpointable comes back as plain containers of
    numpy arrays and Python values. With `target` (a pytree, or for a named
    checkpoint a mapping of some checkpointable names to pytrees), leaves may
    be ``jax.ShapeDtypeStruct`` (with ``.sharding``), ``jax.Array`` or numpy
    templates, or ``jax.sharding.Sharding`` objects; each array comes back
    with that sharding and dtype (a different dtype is a cast), reading only
    the bytes its shards need.

    Example::

        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params)
        params = cairn.load("/ckpt/step_100", {"params": abstract})["params"]

    Raises `CheckpointNotFoundError` if nothing is committed at `path`,
    `CorruptCheckpointError` if a checksum or the metadata is wrong, and
    `MismatchError` if the target does not fit (leaves the checkpoint lacks,
    or leaves it has that the target omits unless `partial=True`).

    ``framework="torch"`` returns ``torch.Tensor`` in place of arrays (sharing
    their memory; bfloat16 and float8 stay as they are), so PyTorch code can
    read a checkpoint saved from JAX. Loading needs no JAX unless the target
    asks for JAX arrays::

        sd = cairn.load("/ckpt/step_100", framework="torch")["params"]
    """
    if framework not in ("numpy", "torch"):
        raise ValueError(f"framework must be 'numpy' or 'torch', got {framework!r}")
    loc = resolve(path, storage_options)
    out = _load.load(loc, target, partial=partial, verify=verify, threads=threads)
    if framework == "torch":
        from ._convert import tree_to_torch

        out = tree_to_torch(out, loc.path)
    return out


def metadata(path: PathLike, *, storage_options: dict[str, Any] | None = None) -> Any:
    """The checkpoint's tree with `ArrayMetadata` (shape, dtype, nbytes, sharding) for arrays.

    Reads only the manifest and indexes, never array data.

    Example::

        info = cairn.metadata("/ckpt/step_100")
        info["params"]["w"].shape
    """
    return _load.metadata(resolve(path, storage_options))
