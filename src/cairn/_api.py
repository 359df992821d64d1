"""The public functions: save, save_async, load, metadata."""

from __future__ import annotations

import atexit
import logging
import os
import threading
from concurrent.futures import Future
from typing import Any

from . import _load, _save
from ._coord import Coordinator
from ._location import resolve

log = logging.getLogger("cairn")
PathLike = str | os.PathLike[str]


class SaveFuture:
    """The handle `save_async` returns: resolves once the checkpoint is committed.

    ``result()`` re-raises any error from the background phase; ``stats`` holds
    per-phase timings and byte counts.
    """

    def __init__(self, path: str, job: _save.SaveJob | None, future: Future[_save.SaveStats]):
        self.path = path
        self._job = job
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> _save.SaveStats:
        """Wait for the commit; returns the stats or raises the save's error."""
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    @property
    def stats(self) -> _save.SaveStats:
        if self._job is not None:
            return self._job.stats
        return self._future.result()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<cairn.SaveFuture {self.path!r} {state}>"


class _Background:
    """One worker thread per process: async saves commit one at a time, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Future[Any]] = []
        self._last: Future[Any] | None = None

    def submit(self, job: _save.SaveJob) -> Future[_save.SaveStats]:
        fut: Future[_save.SaveStats] = Future()
        with self._lock:
            before = self._last
            self._last = fut
            self._pending.append(fut)

        def run() -> None:
            if before is not None:
                try:
                    before.result()
                except BaseException:
                    pass  # reported by its own future; this save goes on
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(job.run())
            except BaseException as e:  # noqa: BLE001
                log.error("cairn: background save to %s failed: %s", job.loc.path, e)
                fut.set_exception(e)
            finally:
                with self._lock:
                    self._pending.remove(fut)

        threading.Thread(target=run, name="cairn-save", daemon=True).start()
        return fut

    def wait_all(self, timeout: float | None = None) -> None:
        with self._lock:
            pending = list(self._pending)
        for f in pending:
            try:
                f.result(timeout)
            except BaseException:
                pass


_background = _Background()
atexit.register(_background.wait_all)


def wait_all(timeout: float | None = None) -> None:
    """Block until every async save of this process has finished (committed or failed)."""
    _background.wait_all(timeout)


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
    `overwrite`), `UnsupportedTypeError` for a leaf cairn cannot store.
    """
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
) -> SaveFuture:
    """Start saving `state` at `path`; return after validation and the host snapshot.

    The arrays may be updated, deleted or donated as soon as this returns: the
    checkpoint holds their values at the time of the call. Writing, fsync and
    the commit run in the background; ``future.result()`` waits for them and
    raises their error, if any.

    Example::

        f = cairn.save_async(f"/ckpt/step_{step}", state)
        state = train_step(state)      # may donate the saved buffers
        f.result()
    """
    loc = resolve(path, storage_options)
    job = _save.prepare(
        loc, state, overwrite=overwrite, coordinator=coordinator, threads=threads,
        split_replicas=split_replicas, timeout=timeout, metadata=metadata,
    )
    import time

    t0 = time.perf_counter()
    job.snapshot()
    job.stats.blocking_s += time.perf_counter() - t0
    return SaveFuture(os.fspath(path), job, _background.submit(job))


def load(
    path: PathLike,
    target: Any = None,
    *,
    partial: bool = False,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    threads: int = 8,
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
    """
    loc = resolve(path, storage_options)
    return _load.load(loc, target, partial=partial, verify=verify, threads=threads)


def metadata(path: PathLike, *, storage_options: dict[str, Any] | None = None) -> Any:
    """The checkpoint's tree with `ArrayMetadata` (shape, dtype, nbytes, sharding) for arrays.

    Reads only the manifest and indexes, never array data.

    Example::

        info = cairn.metadata("/ckpt/step_100")
        info["params"]["w"].shape
    """
    return _load.metadata(resolve(path, storage_options))
