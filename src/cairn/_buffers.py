"""Host buffers: 64-byte-aligned allocation, and the cache of async-snapshot buffers."""

from __future__ import annotations

import threading

import numpy as np


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-order array whose data is `align`-byte aligned.

    XLA's CPU client adopts 64-byte-aligned host buffers without a copy, so a
    load onto CPU devices hands its read buffers straight to the arrays.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class _BufferPool:
    """Host buffers of finished async snapshots, kept for the next one.

    A training loop saves states of the same shapes again and again, so the
    next snapshot finds buffers of the sizes it needs. At most `limit` bytes
    are kept (the size of the largest recent snapshot), never more than one
    snapshot's worth.
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
        with self._lock:
            self.limit = max(self.limit, nbytes)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0
            self.limit = 0


snapshot_pool = _BufferPool()


def release_snapshot_buffers() -> None:
    """Free the host buffers cairn keeps for the next async save.

    After an async save, its snapshot's host buffers (at most one snapshot's
    worth) are kept so that the next snapshot copies into memory already
    touched, at memcpy speed. `cairn.load` releases them itself, since it
    needs the memory; call this to get it back at any other time.

    Example::

        cairn.save_async(path, state).result()
        cairn.release_snapshot_buffers()
    """
    snapshot_pool.clear()
