"""Pausing CPython's cyclic garbage collector over bulk bookkeeping.

Parsing the index of a checkpoint of thousands of leaves, or planning a save
of them, makes tens of thousands of containers that all stay alive until the
step ends. Every 700 net allocations the collector walks the young ones again,
and every few such walks it walks every object of the process: with JAX
loaded that full collection took ~100 ms on the benchmark machine, and about
half of `cairn.save`, `cairn.load` and `cairn.metadata` of 2,000 small leaves
went to such walks. None of what
those steps build is garbage, so they pause the collector.

The collector has only a process-wide switch, so the pause covers only a
step's own CPU work (never a wait for storage, devices or other processes),
nests, is thread-safe, and leaves a collector the program disabled disabled.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_resume = False


@contextmanager
def paused() -> Iterator[None]:
    """No automatic garbage collection inside the block (collected objects are freed later, as usual)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
