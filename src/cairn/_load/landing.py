"""Where a read's bytes land: a reader thread's scratch buffers and a destination's regions.

Shared by the chunk reader (`reader`) and the block reader of incremental
leaves (`blocks`), which both sit above it.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from .._core.buffers import load_pool
from .._plan.reads import is_c_contiguous

_local = threading.local()


def scratch(nbytes: int, which: str = "buf") -> np.ndarray:
    """This reader thread's temporary buffer, reused from read to read.

    A fresh buffer per read costs first-touch page faults on every read, which
    on some hosts is slower than the read itself. The buffer is lent from
    `buffers.load_pool` (in `scratch_size` classes) and held as long as the load
    (`in_scope`; on a thread of a pool of its own, as long as the thread), then goes
    back to that pool: the next load's reads fill pages already mapped. Under gVisor
    (the TPU host) a compressed load whose reader threads took fresh buffers spent
    4.2 s of system time per 2.4 GiB on their first touch, 0.25 s with kept ones
    (measured on the TPU host).
    """
    scope: dict[Any, Any] | None = getattr(_local, "scope", None)
    held: dict[Any, Any] = _local.__dict__ if scope is None else scope
    key: Any = which if scope is None else (threading.get_ident(), which)
    buf = held.get(key)
    if buf is None or buf.nbytes < nbytes:
        held.pop(key, None)  # (back to the pool before a larger one is lent)
        buf = held[key] = load_pool.lend(scratch_size(nbytes))
    return buf[:nbytes]


def scratch_size(nbytes: int) -> int:
    """The size a scratch buffer for `nbytes` is lent at: at least 1 MiB, else rounded up to a quarter of
    the power of two below it (13.1 MiB: 14), so that reads of nearly the same size share buffers."""
    if nbytes <= 1 << 20:
        return 1 << 20
    step = max(1 << 20, 1 << ((nbytes - 1).bit_length() - 3))
    return -(-nbytes // step) * step


def in_scope(scope: dict[Any, Any], fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run `fn` with this thread's scratch buffers kept in `scope` (one load's dict, dropped with the
    load: its buffers go back to `buffers.load_pool`), not on the thread: long-lived threads shared by
    loads keep no buffer of their own between them."""
    before = getattr(_local, "scope", None)
    _local.scope = scope
    try:
        return fn(*args, **kwargs)
    finally:
        _local.scope = before


def current_scope() -> dict[Any, Any] | None:
    """The scope this thread's scratch buffers are kept in (`in_scope`), None where they live on the thread:
    work handed to a long-lived thread (the decode pool) runs `in_scope` of it, so its buffers go with the load."""
    return getattr(_local, "scope", None)


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


MIN_RUN = 4096  # a destination row shorter than this is cheaper to fill by a copy
MAX_PARTS = 1 << 16  # the most destination rows one vectored read fills


def contiguous(dest: tuple[int, ...], start: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether box `shape` at `start` of a C-order array of shape `dest` is one run of memory."""
    last = max((a for a in range(len(shape)) if shape[a] != dest[a]), default=-1)
    return all(shape[a] == 1 for a in range(last))


#: A compressed read that decodes in place is cut into reads of about this many raw bytes (whole blocks),
#: which the reader threads read, check and decode at once (`split_coded`).
CODED_PART = 8 << 20


def split_coded(read: Any, block: int, part: int | None = None) -> list[Any]:
    """A read of a compressed leaf (raw addressing: whole blocks of chunk ``read.file``) that decodes in
    place (`coded_lands`), cut into reads of about `part` raw bytes (default `CODED_PART`), each whole
    blocks, of equal size but the last; their copies and checks are left out (a coded read takes its
    checks from the leaf, `reader.CodedRead`, and lands in its slice of the parent's destination bytes).

    One read per chunk left a 128 MiB embedding to one reader thread, which read and checked its ~100 MiB
    of stored bytes before the first block decoded (95-190 ms on the TPU host, the other readers idle
    behind it). A read at most 1.5 parts long stays whole."""
    part = CODED_PART if part is None else part
    if read.end - read.start <= part * 3 // 2:
        return [read]
    blocks = -(-(read.end - read.start) // block)
    per = -(-blocks // -(-(read.end - read.start) // part)) * block  # whole blocks, spread evenly
    return [read._replace(start=s, end=min(s + per, read.end), copies=(), checks=())
            for s in range(read.start, read.end, per)]


def coded_lands(read: Any, shapes: list[tuple[int, ...]]) -> bool:
    """Whether a read of a compressed leaf decodes straight into destinations of `shapes`: its
    `direct` target is one run of memory (`direct_bytes`). The rule the chunk reader gathers such
    reads per file by on object stores (`reader.ChunkReader.read_array`), and the plan predicts by."""
    d = read.direct
    return d is not None and contiguous(shapes[d.dest], d.dest_start, d.shape)


def lands_in_place(read: Any, shapes: list[tuple[int, ...]], vectored: bool) -> bool:
    """Whether uncompressed `read` lands in destinations of `shapes` (C order) with no buffer: its
    `direct` target is one run of memory, or (`vectored` readers) its copies tile the read in file
    order, each a run of memory or rows of at least `MIN_RUN` bytes. The rule the chunk reader
    lands reads by (`reader._landing`, `reader._tiled_regions`) and the load's plan predicts by."""
    d = read.direct
    if d is not None and contiguous(shapes[d.dest], d.dest_start, d.shape):
        return True
    if not vectored:
        return False
    pos = parts = 0
    for c in sorted(read.copies, key=lambda c: c.src_offset):
        if c.src_offset != pos or not is_c_contiguous(c.shape, c.src_strides):
            return False
        if contiguous(shapes[c.dest], c.dest_start, c.shape):
            parts += 1
        else:
            if len(c.shape) < 2 or c.shape[-1] * c.itemsize < MIN_RUN:
                return False
            parts += math.prod(c.shape[:-1])
            if parts > MAX_PARTS:
                return False
        pos += c.nbytes
    return pos == read.nbytes
