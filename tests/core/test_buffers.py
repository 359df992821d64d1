"""Host buffers: `prefault` maps pages without changing a byte, alone or beside a copy; `SlabPool` lends
buffers and takes each back only once nothing refers to it."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from cairn._core.buffers import SlabPool, aligned_empty, prefault


def test_prefault_keeps_every_byte() -> None:
    for n in (0, 1, 4095, 4096, 3 * 4096 + 17, 9 << 20):
        a = aligned_empty((n,), np.dtype(np.uint8), huge_pages=False)
        a[:] = np.arange(n, dtype=np.uint64).astype(np.uint8)
        prefault(a[1:])  # an unaligned start and end: only whole pages inside are mapped
        prefault(a)
        assert np.array_equal(a, np.arange(n, dtype=np.uint64).astype(np.uint8))


def test_prefault_beside_a_copy_into_the_same_pages() -> None:
    src = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8)
    for _ in range(3):
        dest = aligned_empty(src.shape, src.dtype, huge_pages=False)
        t = threading.Thread(target=prefault, args=(dest,))
        t.start()
        for lo in range(0, src.nbytes, 1 << 20):  # the copy races the mapping, page by page
            dest[lo : lo + (1 << 20)] = src[lo : lo + (1 << 20)]
        t.join(timeout=60)
        assert not t.is_alive()
        assert np.array_equal(dest, src)


def _at(a) -> int:
    """The address of `a`'s first byte."""
    return np.frombuffer(memoryview(a).cast("B"), np.uint8).__array_interface__["data"][0]


def test_a_lent_buffer_comes_back_only_once_its_last_view_is_gone() -> None:
    """Whatever still refers to a lent buffer (a numpy slice, a memoryview, a slice of either) keeps it lent:
    a later lend gets other memory; once the last view is gone, the next lend of that size reuses it."""
    pool = SlabPool()
    a = pool.lend(1000)
    assert a.dtype == np.uint8 and a.shape == (1000,) and a.flags.writeable and _at(a) % 64 == 0
    first = _at(a)
    a[:] = 7
    keep = [a[10:20], memoryview(a)[100:300], memoryview(a[500:])[1:2], np.frombuffer(memoryview(a), np.uint8)[3:]]
    del a
    for _ in range(len(keep)):
        b = pool.lend(1000)
        assert _at(b) != first  # something still refers to the first buffer
        b[:] = 1  # (written: were it the first buffer, the views below would see it)
        del b
        assert bytes(memoryview(keep[-1]).cast("B")[:1]) == b"\x07"
        keep.pop()
    assert _at(pool.lend(1000)) == first
    assert pool.made >= 2 and pool.reused >= 1


def test_lends_are_whole_mib_and_take_a_free_buffer_up_to_a_quarter_larger() -> None:
    pool = SlabPool()
    a = pool.lend(5 << 20)  # 5 MiB
    at = _at(a)
    del a
    b = pool.lend((4 << 20) + 1)
    assert _at(b) == at  # 4 MiB and a byte: the 5 MiB buffer (a quarter more at most)
    c = pool.lend(8 << 20)
    at8 = _at(c)
    del c
    assert _at(pool.lend(4 << 20)) != at8  # twice as large: not lent for 4 MiB, a new one
    assert pool.made == 3 and pool.reused == 1
    z = pool.lend(0)
    assert z.shape == (0,)


def test_buffers_are_kept_up_to_the_most_ever_lent_at_once_and_cleared_on_release() -> None:
    """What comes back is kept for the next lends only up to the most bytes that were lent at once (what
    one save held in flight), and `release_snapshot_buffers` (which a load calls) frees what is kept."""
    from cairn._core import buffers

    pool = SlabPool()
    held = [pool.lend(1 << 20) for _ in range(3)]
    assert pool.peak == 3 << 20 and pool.lent_bytes == 3 << 20
    del held
    assert pool.free_bytes == 3 << 20 and pool.lent_bytes == 0
    again = [pool.lend(1 << 20) for _ in range(3)]
    assert pool.reused == 3 and pool.made == 3  # the next "save" reuses them all
    big = pool.lend(2 << 20)  # a fourth buffer, larger: lent at once, so the cap grows with it
    assert pool.peak == 5 << 20
    del again, big
    assert pool.free_bytes == 5 << 20
    pool.clear()
    assert pool.free_bytes == 0 and not pool._free and pool.peak == 0
    a = pool.lend(1 << 20)
    del a
    assert pool.free_bytes == 1 << 20  # the cap learnt again: one buffer's worth
    b, c = pool.lend(1 << 20), pool.lend(1 << 20)
    pool.clear()  # cleared while lent: the cap is what is out, and they are kept when they come back
    del b, c
    assert pool.free_bytes == 2 << 20
    buffers.coded_pool.lend(1 << 20)  # (a temporary: back at once)
    assert buffers.coded_pool.free_bytes >= 1 << 20
    buffers.release_snapshot_buffers()
    assert buffers.coded_pool.free_bytes == 0


def test_threads_lending_at_once_never_share_a_buffer() -> None:
    """Eight threads lend, fill with their own pattern, hold a few, check and drop, over and over: no lent
    buffer is ever handed to another thread while one still holds it."""
    pool = SlabPool()
    errors: list[str] = []

    def work(t: int) -> None:
        held: list[tuple[np.ndarray, int]] = []
        for i in range(200):
            n = (1 + (i * 7 + t) % 3) << 19  # 0.5-1.5 MiB: one size class and the next
            a = pool.lend(n)
            v = (t * 31 + i) % 251
            a[:] = v
            held.append((memoryview(a)[: n // 2], v))  # a view alone holds the buffer
            del a
            if len(held) > 3:
                view, v0 = held.pop(0)
                if not (np.frombuffer(view, np.uint8) == v0).all():
                    errors.append(f"thread {t}, lend {i}: a held buffer was lent again")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert pool.reused > 0


def test_a_buffer_given_back_while_its_thread_holds_the_pool_does_not_deadlock() -> None:
    """The last view of a lent buffer can go while the same thread is inside the pool (a garbage collection
    that an allocation there runs, collecting a cycle that holds a view): taking it back must not wait for
    the lock that thread holds."""
    pool = SlabPool()
    a = pool.lend(1000)
    done = threading.Event()

    def drop_inside() -> None:
        nonlocal a
        with pool._lock:  # as `lend` / `_take_back` hold it when a collection runs
            del a
        done.set()

    t = threading.Thread(target=drop_inside, daemon=True)
    t.start()
    t.join(timeout=30)
    assert done.is_set() and pool.free_bytes == 1 << 20


def test_a_forked_child_lends_even_if_a_parent_thread_held_the_pool() -> None:
    """A process forked while another of its threads held a pool's lock (a save coding in the background, a
    load reading) gets pools of its own in the child: lending there does not wait forever."""
    import subprocess
    import sys

    script = """
import os, sys
from cairn._core import buffers
for pool in (buffers.coded_pool, buffers.load_pool):
    pool._lock.acquire()  # as a coder (or loading) thread of the parent would hold it, at the fork
pid = os.fork()
if pid == 0:
    for pool in (buffers.coded_pool, buffers.load_pool):
        a = pool.lend(1 << 20)
        a[:] = 1
        del a
        if pool.free_bytes != 1 << 20:
            os._exit(3)
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""
    if not hasattr(os, "fork"):
        pytest.skip("no os.fork here")
    done = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert done.returncode == 0


def test_a_lend_that_cannot_allocate_lends_nothing(monkeypatch) -> None:
    """Out of memory: the error reaches the caller (a load names the leaf) and the pool counts nothing lent,
    so its cap does not grow by a buffer that never was."""
    from cairn._core import buffers

    pool = SlabPool()
    kept = pool.lend(1 << 20)

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(buffers, "aligned_empty", no_memory)
    with pytest.raises(MemoryError):
        pool.lend(8 << 20)
    assert pool.lent_bytes == 1 << 20 and pool.made == 1 and pool.peak == 1 << 20
    del kept
    assert pool.free_bytes == 1 << 20
