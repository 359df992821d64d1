"""Host buffers: 64-byte-aligned allocation, and the cache of async-snapshot buffers."""

from __future__ import annotations

import ctypes
import math
import os
import threading
from collections.abc import Callable
from typing import Any, cast

import numpy as np


def as_view(a: np.ndarray) -> memoryview:
    """A memoryview of array `a`'s buffer (``memoryview(a)``). numpy exports its buffer on every Python,
    but its type stubs declare that only from Python 3.12 on: the one place that says so."""
    return memoryview(cast(Any, a))


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64, huge_pages: bool = True) -> np.ndarray:
    """An uninitialised C-order array whose data is `align`-byte aligned.

    XLA's CPU client adopts 64-byte-aligned host buffers without a copy, so a
    load onto CPU devices hands its read buffers straight to the arrays.

    numpy advises the kernel to back allocations of 4 MiB and more with
    transparent huge pages (``madvise(MADV_HUGEPAGE)``); where the kernel then
    compacts memory on the first touch (``defrag`` set to ``madvise``, a common
    default), filling fresh memory gets several times slower: measured on the
    benchmark VM, 165 fresh 12 MiB buffers filled at 0.45-0.83 GiB/s with the
    advice, 1.5-1.9 GiB/s without. `huge_pages=False` allocates without it.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if huge_pages or _thp_toggle is None or nbytes < 4 << 20:
        raw = np.empty(nbytes + align, dtype=np.uint8)
    else:
        with _thp_lock:  # numpy's switch is process-wide: off only for this allocation
            before = _thp_toggle(False)
            try:
                raw = np.empty(nbytes + align, dtype=np.uint8)
            finally:
                _thp_toggle(before)
    start = -raw.__array_interface__["data"][0] % align  # (`.ctypes.data` costs ~5 µs)
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def prefault(a: np.ndarray) -> None:
    """Map the pages of fresh buffer `a` writable now (Linux's ``MADV_POPULATE_WRITE``), without
    touching its bytes; elsewhere, or on a kernel without it (before 5.14), nothing.

    A load's buffers are filled once, by a copy from the network; in fresh memory that copy pays a
    page fault per 4 KiB page on the way (measured on the benchmark VM: 256 MiB copied in 0.13 s
    fresh, 0.035 s once mapped; mapping it ahead took 0.07 s). Run in another thread while the
    requests are in flight, the faults leave the copy's path. The bytes are never written, so it
    may run while a copy fills the same pages.
    """
    madvise = _madvise()
    if madvise is None or a.nbytes < _PAGE:
        return
    p = a.__array_interface__["data"][0]
    lo, hi = -(-p // _PAGE) * _PAGE, (p + a.nbytes) // _PAGE * _PAGE
    # A piece at a time: the kernel holds the process's memory-map lock through each call, and an
    # allocation elsewhere (mmap) waits for it, so one call over a large buffer can hold up another
    # thread's allocation for as long as the whole mapping takes.
    for start in range(lo, hi, _PREFAULT_STEP):
        if madvise(start, min(_PREFAULT_STEP, hi - start), _MADV_POPULATE_WRITE) != 0:
            global _madvise_fn
            _madvise_fn = False  # refused (an older kernel): not asked again
            return


_PAGE = 4096
_PREFAULT_STEP = 1 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14 on
_madvise_fn: Callable[[int, int, int], int] | bool | None = None  # None: not looked up; False: unavailable


def _madvise() -> Callable[[int, int, int], int] | None:
    global _madvise_fn
    if _madvise_fn is None:
        _madvise_fn = False
        import sys

        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _madvise_fn = fn
            except (OSError, AttributeError):
                pass
    return _madvise_fn if callable(_madvise_fn) else None


# numpy's process-wide switch for its huge-page advice (private; absent in some versions).
_thp_toggle = getattr(getattr(getattr(np, "_core", None), "multiarray", None), "_set_madvise_hugepage", None)
_thp_lock = threading.Lock()


class SlabPool:
    """Byte buffers lent out, each taken back for later lends once nothing refers to it any more: the
    buffers saves' coders code into (`coded_pool`) and those loads onto devices read into
    (`load_pool`).

    A coding task codes into a buffer with room for its blocks' worst case, and its blocks are held until
    a writer has written them; a load's buffer is held until JAX has copied it to the device (on the CPU
    backend, for as long as the array it became lives). New buffers
    are fresh pages, and the first touch of each is a page fault; under a sandbox such as gVisor (the TPU
    host) those faults are slow and contended (fresh memory fills there at 0.9 GB/s on one thread and
    3.3 GB/s on 12, memory already touched at 55 GB/s). Lent from here, a buffer comes back when its last
    view is gone (a reference held anywhere keeps it lent: a storage client's part, a transfer in
    flight), and later lends, of this save or load and of the next ones, fill pages already mapped
    (docs/compression.md, "On many cores").

    Sizes are whole MiB (`STEP`); a lend takes a free buffer of its size or up to a quarter larger, else
    a new one. Buffers that come back are kept only up to `peak` bytes, the most that were ever lent at
    once: a training loop's saves reuse the same buffers, and what is kept between them is at most what
    one save (or load) held at once. `clear` frees them (`release_snapshot_buffers`; a load clears the
    coded pool, a save the load pool).
    """

    STEP = 1 << 20

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        # Re-entrant: a buffer's last view may be dropped, and its finaliser take it back, in this thread
        # while it holds the lock (a garbage collection run by an allocation in `lend` or `_take_back`,
        # collecting a cycle that holds a view: an exception's traceback, say).
        self._lock = threading.RLock()
        self.free_bytes = 0
        self.lent_bytes = 0
        self.peak = 0  # the most bytes lent at once since made or cleared
        self.made = 0  # buffers allocated
        self.reused = 0  # lends served by a buffer taken back

    def lend(self, nbytes: int) -> np.ndarray:
        """A writable, 64-byte-aligned uint8 array of `nbytes` bytes, uninitialised (pages already touched
        where it is reused). Its memory returns to this pool once neither the array nor any view of it
        (numpy slice, memoryview, anything whose buffer it is) is left."""
        size = -(-max(nbytes, 1) // self.STEP) * self.STEP
        slab = None
        with self._lock:
            for s in range(size, size + size // 4 + self.STEP, self.STEP):
                free = self._free.get(s)
                if free:
                    slab = free.pop()
                    self.free_bytes -= s
                    self.reused += 1
                    break
            else:
                self.made += 1
            taken = size if slab is None else slab.nbytes
            self.lent_bytes += taken
            peak, self.peak = self.peak, max(self.peak, self.lent_bytes)
        if slab is None:
            try:
                slab = aligned_empty((size,), np.dtype(np.uint8), huge_pages=False)
            except BaseException:  # (MemoryError): nothing was lent
                with self._lock:
                    self.lent_bytes -= taken
                    self.made -= 1
                    self.peak = max(peak, self.lent_bytes)
                raise
        # The array handed out is a view of a ctypes object over the slab, made for this lend: numpy keeps
        # it as the base of every view taken from the array, and its finaliser (`_lent_back`) runs when the
        # last of them is gone. (A numpy view of the slab would not do: numpy collapses a view's base to
        # the array that owns the memory, so slices would outlive the array handed out.)
        lent = _lent_type(size).from_buffer(slab)
        lent.pool, lent.slab = self, slab
        return np.frombuffer(lent, np.uint8, count=nbytes)

    def _take_back(self, slab: np.ndarray) -> None:
        with self._lock:
            self.lent_bytes -= slab.nbytes
            if self.free_bytes + slab.nbytes <= self.peak:
                self._free.setdefault(slab.nbytes, []).append(slab)
                self.free_bytes += slab.nbytes

    def clear(self) -> None:
        """Free the buffers on hand; the cap is learnt again from the next lends."""
        with self._lock:
            self._free.clear()
            self.free_bytes = 0
            self.peak = self.lent_bytes

    def _forget(self) -> None:
        """In a forked child: a fresh lock (another thread of the parent may have held this one) and nothing
        kept (the child's saves learn their own cap)."""
        self._lock = threading.RLock()
        self._free = {}
        self.free_bytes = self.peak = 0


#: The buffers saves' coders code into (`SlabPool`).
coded_pool = SlabPool()

#: The host buffers loads onto devices read and decode into (`SlabPool`; `_load.reader.lends`): each comes back
#: once JAX lets go of it (on an accelerator once its transfer to the device is done; on the CPU backend, which
#: adopts it as the array, once the array is gone); and
#: every load's reader-thread scratch buffers (`_load.landing.scratch`), back once the load is over.
load_pool = SlabPool()


def lent_empty(pool: SlabPool, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-order array of `shape` and `dtype` in a buffer lent from `pool` (64-byte aligned,
    as `aligned_empty`'s): its memory goes back to `pool` once no view of it is left."""
    return pool.lend(math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)


def _lent_back(lent: Any) -> None:  # (a `_lent_type` instance's finaliser)
    """`SlabPool`'s lent buffer is gone: its slab goes back to the pool."""
    pool = getattr(lent, "pool", None)
    if pool is not None:
        pool._take_back(lent.slab)


_lent_types: dict[int, Any] = {}


def _lent_type(size: int) -> Any:
    """A ctypes byte array type of `size` bytes whose instances give their slab back when finalised."""
    t = _lent_types.get(size)
    if t is None:
        t = _lent_types.setdefault(size, type("_Lent", (ctypes.c_ubyte * size,), {"__del__": _lent_back}))
    return t


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
    benchmarks/probes/soak.py, that churn held ~100-200 MiB more RSS than the
    buffers themselves.
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
        return aligned_empty((nbytes,), np.dtype(np.uint8), huge_pages=False)  # filled once per save: see there

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
    """Free the host buffers cairn keeps for the next save or load.

    After an async save, its snapshot's host buffers (at most two snapshots'
    worth, as many as may be in flight at once) are kept so that the next
    snapshot copies into memory already touched, at memcpy speed; after a
    compressed save, the buffers its coders coded into (at most as many bytes
    as its coded blocks in flight held at once), so that the next one codes
    into pages already mapped; after a load onto accelerators, the host
    buffers it read into (at most as many bytes as it held at once, about its
    ``budget_bytes``); after a load onto CPU devices, whose arrays are the
    buffers it read into, those buffers once the arrays are gone (at most the
    most bytes the process's loaded arrays held at once); and after any load its reader threads' scratch buffers
    (a compressed read's stored bytes: up to ``threads`` times the largest
    read's), so that the next load fills pages already mapped.
    `cairn.load` releases the saves' buffers itself, and a save the load's,
    since each needs the memory; call this to get it all back at any other time.

    Example:

        cairn.save_async(path, state).result()
        cairn.release_snapshot_buffers()
    """
    release_save_buffers()
    load_pool.clear()


def release_save_buffers() -> None:
    """Free the buffers kept for the next save (what `cairn.load` frees; `release_snapshot_buffers` frees
    the load's too)."""
    snapshot_pool.clear()
    coded_pool.clear()


def _forget_pools() -> None:
    coded_pool._forget()
    load_pool._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)
