"""The save's coder pool (`pipeline.CodePool`): most urgent file first, errors to the caller, bounded windows."""

from __future__ import annotations

import threading

import pytest

from cairn._save.pipeline import CodePool, in_order


def test_tasks_run_lowest_priority_first_then_oldest():
    started = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def block() -> None:
        started.set()
        assert release.wait(10)

    with CodePool(1) as pool:
        first = pool.submit(block)
        assert started.wait(10)  # the one worker is busy: what follows queues
        futures = [pool.submit(order.append, name, priority=p)
                   for name, p in (("file2-a", 2), ("file0-a", 0), ("file1-a", 1), ("file0-b", 0), ("file2-b", 2))]
        release.set()
        for f in [first, *futures]:
            f.result(timeout=10)
    assert order == ["file0-a", "file0-b", "file1-a", "file2-a", "file2-b"]


def test_errors_reach_the_caller_and_a_closed_pool_takes_nothing():
    def boom(x: int) -> int:
        raise ValueError(f"bad {x}")

    pool = CodePool(2)
    f = pool.submit(boom, 3, priority=1)
    with pytest.raises(ValueError, match="bad 3"):
        f.result(timeout=10)
    assert pool.submit(lambda: 7).result(timeout=10) == 7
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: 1)


def test_in_order_keeps_a_window_and_the_order_of_its_tasks():
    """`in_order` on a CodePool: results in task order, at most one task per worker plus one ahead
    of the consumer in flight (memory bounded by the window, not by the file)."""
    lock = threading.Lock()
    live = [0, 0]  # in flight now, most seen

    def work(x: int) -> int:
        with lock:
            live[0] += 1
            live[1] = max(live[1], live[0])
        with lock:
            live[0] -= 1
        return x * x

    with CodePool(3) as pool:
        got = list(in_order(pool, work, iter(range(50)), priority=0))
        assert got == [x * x for x in range(50)]
        with pytest.raises(ZeroDivisionError):
            list(in_order(pool, lambda x: 1 // (x - 7), iter(range(10)), priority=1))
    assert live[1] <= 3
    assert list(in_order(None, work, iter(range(5)))) == [0, 1, 4, 9, 16]
