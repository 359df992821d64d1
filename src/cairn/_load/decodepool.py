"""The process's decode pool: threads that decode a compressed read's blocks beside its reader thread,
and the one thread that maps fresh load buffers ahead of their bytes.

Shared by the chunk reader (`reader`) and the block reader of incremental leaves (`blocks`), which both
sit above it (a module of its own so that neither imports the other).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all

from .._core.host import usable_cores

#: Threads that decode compressed blocks: one pool per process, shared by loads, whatever their reader
#: ``threads``. None: one per core this process may run on; 0: no pool, each read's blocks decoded by the
#: reader thread that read them (a load's 8 reader threads then are all that decode, on hosts of
#: 13 cores and more).
DECODE_THREADS: int | None = None
#: A read's checked blocks are decoded in pieces of at least this many raw bytes (whole blocks), one
#: `codecs.decode_run` call each: one 1 MiB block takes about 1.5 ms to decode on one core, a piece's
#: task about 20 us to hand over, but each call's Python holds the GIL, which 12 decoding threads
#: share. On the TPU host (13 cores) a 2.38 GiB compressed trained state loaded onto the chip in
#: 1.46 s with 1 MiB pieces, 1.36 s with 4 and 1.26 s with 8 (medians of 5, alternated), and a 1 GiB
#: load from ``memory://`` 0.86-0.88x as long with 4 as with 1.
#: 4 MiB: most of the gain, and a 32 MiB read still spreads over 8 threads.
DECODE_PIECE = 4 << 20

_decode_pools: dict[int, ThreadPoolExecutor] = {}
_prefaulter: ThreadPoolExecutor | None = None
_decode_lock = threading.Lock()


def decode_pool() -> ThreadPoolExecutor | None:
    """This process's decode pool (`DECODE_THREADS`), started on first use; None where reads decode alone."""
    n = usable_cores() if DECODE_THREADS is None else DECODE_THREADS
    if n < 2:
        return None
    pool = _decode_pools.get(n)
    if pool is None:
        with _decode_lock:
            pool = _decode_pools.get(n)
            if pool is None:
                pool = _decode_pools[n] = ThreadPoolExecutor(n, thread_name_prefix="cairn-decode")
    return pool


def prefault_thread() -> ThreadPoolExecutor:
    """The one thread that maps fresh load buffers ahead of their bytes (`ChunkReader.start_prefault`),
    started on first use. Not a thread of the load's pool: a mapping there held up the GET queued
    behind it (a 1 GiB load through a 1 GB/s link: the 8th of 8 GETs left 100-250 ms late)."""
    global _prefaulter
    with _decode_lock:
        if _prefaulter is None:
            _prefaulter = ThreadPoolExecutor(1, thread_name_prefix="cairn-prefault")
        return _prefaulter


def stop_threads() -> None:
    """Stop the decode pools' and the prefault thread's idle threads, waiting for any work they run; the
    next load that needs them starts new ones."""
    global _prefaulter
    with _decode_lock:
        pools = [*_decode_pools.values(), *([_prefaulter] if _prefaulter is not None else [])]
        _decode_pools.clear()
        _prefaulter = None
    for pool in pools:
        pool.shutdown(wait=True)


def _forget_decode_pools() -> None:  # a forked child has none of its parent's threads
    global _decode_lock, _prefaulter
    _decode_pools.clear()
    _prefaulter = None
    _decode_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_decode_pools)


def pieces(blocks: Sequence[tuple[int, int, str]], i: int, j: int, size: int | None = None) -> list[tuple[int, int]]:
    """Blocks ``[i, j)`` (``(raw start, raw end, name)`` each) cut into runs ``(a, b)`` of at least
    `size` raw bytes (default `DECODE_PIECE`; the last may be less)."""
    size = DECODE_PIECE if size is None else size
    out: list[tuple[int, int]] = []
    a = i
    for k in range(i, j):
        if blocks[k][1] - blocks[a][0] >= size:
            out.append((a, k + 1))
            a = k + 1
    if a < j:
        out.append((a, j))
    return out


def spread(decode: Callable[[int, int], None], runs: list[tuple[int, int]]) -> None:
    """``decode(a, b)`` of every run: the first in this thread, the others on the decode pool at once,
    so a read's blocks are decoded on as many cores as are free, not only on its reader thread. Returns
    once every run is done (the caller's stored bytes may be reused then); the first run's error, in
    block order, is raised."""
    pool = decode_pool() if len(runs) > 1 else None
    if pool is None:
        for a, b in runs:
            decode(a, b)
        return
    futures = [pool.submit(decode, a, b) for a, b in runs[1:]]
    try:
        decode(*runs[0])
    finally:
        wait_all(futures)  # (even where the first run failed: the others read the caller's buffer)
    for f in futures:
        f.result()


def share(decode: Callable[[int, int], None], runs: list[tuple[int, int]]) -> None:
    """``decode(a, b)`` of every run, each taken by whichever is free first: this thread or a thread of the
    decode pool (as many as there are runs beyond the first). Unlike `spread`, this thread never waits for
    a run queued behind other reads' work on a busy pool: it takes that run itself, and a pool task that
    has not started when every run is taken is cancelled. Returns once every run is done; the first
    failed run's error, in run order, is raised."""
    pool = decode_pool() if len(runs) > 1 else None
    if pool is None:
        for a, b in runs:
            decode(a, b)
        return
    todo = iter(range(len(runs)))
    take = threading.Lock()
    errors: dict[int, BaseException] = {}

    def work() -> None:
        while True:
            with take:
                k = next(todo, None)
            if k is None:
                return
            try:
                decode(*runs[k])
            except BaseException as e:  # (raised below, in run order, once every run is done)
                errors[k] = e

    futures = [pool.submit(work) for _ in range(min(len(runs) - 1, pool._max_workers))]
    work()
    for f in futures:
        f.cancel()  # not started: nothing left for it
    wait_all([f for f in futures if not f.cancelled()])
    if errors:
        raise errors[min(errors)]
