"""Host buffers: 64-byte-aligned allocation, and the cache of async-snapshot buffers."""

from __future__ import annotations

import math
import threading

import numpy as np


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-order array whose data is `align`-byte aligned.

    XLA's CPU client adopts 64-byte-aligned host buffers without a copy, so a
    load onto CPU devices hands its read buffers straight to the arrays.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = -raw.__array_interface__["data"][0] % align  # (`.ctypes.data` costs ~5 µs)
    return raw[start : start + nbytes].view(dtype).reshape(shape)


#: At most this many async saves of a process hold snapshots at once (`_async.MAX_PENDING`).
MAX_SNAPSHOTS = 2


class _BufferPool:
    """Host buffers of finished async snapshots, kept for the next one.

    A training loop saves states of the same shapes again and again, so the
    next snapshot finds buffers of the sizes it needs. At most `limit` bytes
    are kept: the largest recent snapshot times `MAX_SNAPSHOTS`, so that a loop
    with two saves in flight reuses the same buffers over and over. Keeping
    only one snapshot's worth made every save free half its buffers and
    allocate new ones, from whichever thread's malloc arena; measured with
    benchmarks/soak.py, that churn held ~100-200 MiB more RSS than the
    buffers themselves (docs/PERFORMANCE.md, "Per-leaf and steady-state costs").
    """

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._bytes = 0
        self.limit = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._bytes -= nbytes
                return free.pop()
        return aligned_empty((nbytes,), np.dtype(np.uint8))

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._bytes + buf.nbytes <= self.limit:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._bytes += buf.nbytes

    def reserve(self, nbytes: int) -> None:
        """Note a snapshot of `nbytes`: keep up to `MAX_SNAPSHOTS` of them."""
        with self._lock:
            self.limit = max(self.limit, nbytes * MAX_SNAPSHOTS)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0
            self.limit = 0


snapshot_pool = _BufferPool()


def release_snapshot_buffers() -> None:
    """Free the host buffers cairn keeps for the next async save.

    After an async save, its snapshot's host buffers (at most two snapshots'
    worth, as many as may be in flight at once) are kept so that the next
    snapshot copies into memory already touched, at memcpy speed. `cairn.load` releases them itself, since it
    needs the memory; call this to get it back at any other time.

    Example::

        cairn.save_async(path, state).result()
        cairn.release_snapshot_buffers()
    """
    snapshot_pool.clear()
