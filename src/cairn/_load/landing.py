"""Where a read's bytes land: a reader thread's scratch buffers and a destination's regions.

Shared by the chunk reader (`reader`) and the block reader of incremental
leaves (`blocks`), which both sit above it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

_local = threading.local()


def scratch(nbytes: int, which: str = "buf") -> np.ndarray:
    """This reader thread's temporary buffer, reused from read to read.

    A fresh buffer per read costs first-touch page faults on every read, which
    on some hosts is slower than the read itself. The buffer lives as long as
    the load's thread pool.
    """
    buf = getattr(_local, which, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        setattr(_local, which, buf)
    return buf[:nbytes]


def region(start: tuple[int, ...], shape: tuple[int, ...]) -> tuple[Any, ...]:
    # `...` keeps a 0-d selection a view (indexing with () would return a scalar copy).
    return tuple(slice(s, s + n) for s, n in zip(start, shape)) or (Ellipsis,)


def direct_bytes(read: Any, dests: list[np.ndarray]) -> np.ndarray | None:
    """The destination bytes `read` fills in place (its `direct` target, where that region is one
    contiguous run of memory), or None where it lands in a buffer first."""
    direct = read.direct
    if direct is None:
        return None
    target = dests[direct.dest][region(direct.dest_start, direct.shape)]
    return target.reshape(-1).view(np.uint8) if target.flags.c_contiguous else None
