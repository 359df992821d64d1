"""Many small arrays, one request: coalesced reads of whole arrays that lie back to back.

A save packs the chunks of many small leaves into one file, in leaf order, so
a load of a tree of thousands of small leaves finds their bytes side by side.
Read one by one, each would cost a task on the reader pool, a system call
(or, on an object store, a round trip) and its bookkeeping, which is far more
than its bytes. `Runs` gathers the direct reads of whole small arrays into
runs of consecutive file bytes and reads each run with one vectored read
(local files, object stores) or one ranged read plus copies (other stores),
then verifies every array's checksums as before (an object store's parts as
they land).

A run is sent to the pool when it is full, when a read of another kind is
planned, or as soon as anyone waits for one of its arrays: the futures handed
out submit their run on `result()`, so no caller can wait for a read that was
never started.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import numpy as np

from .._core.boxes import full_box
from .._core.checksum import BlockChecks, crc32c
from .._format.binindex import LazyChunks
from .._plan.reads import plan_reads

#: A whole array up to this size may share a read with its neighbours.
SMALL_ARRAY = 1 << 20
_MAX_RUN_BYTES = 4 << 20
MAX_RUN_PARTS = 1024


def run_limits(preferred_read: int | None) -> tuple[int, int]:
    """``(largest array that joins a run, largest run)`` for a storage that prefers reads of `preferred_read`.

    Local files: arrays up to `SMALL_ARRAY` in runs up to 4 MiB. A storage
    that charges per request (object stores state a `preferred_read`) takes
    whole arrays up to that size, back to back, in runs up to that size: a
    tree of medium leaves costs a request per run, not one per leaf.
    """
    if not preferred_read:
        return SMALL_ARRAY, _MAX_RUN_BYTES
    return max(SMALL_ARRAY, preferred_read), max(_MAX_RUN_BYTES, preferred_read)


class _RunFuture(Future):  # type: ignore[type-arg]
    """The future of one run; waiting for it first makes sure the run was submitted."""

    def __init__(self, runs: Runs) -> None:
        super().__init__()
        self._runs = runs

    def result(self, timeout: float | None = None) -> Any:
        self._runs.submit(self)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._runs.submit(self)
        return super().exception(timeout)


def whole_span(leaf: Any) -> tuple[int, int] | None:
    """``(file, first byte)`` when the whole of `leaf` is one run of bytes in one file, in C order.

    True of an array cut along its first axis only (sharded on it, or not at
    all) whose chunks were written back to back, as a save writes them.
    """
    shape, grid, chunks = leaf.shape, leaf.grid, leaf.chunks
    if getattr(leaf, "codec", "none") != "none":  # compressed blocks: read (and decoded) on their own
        return None
    if not shape or 0 in shape or any(len(b) != 2 for b in grid[1:]):
        return None
    file, start = chunks[0]
    if len(chunks) > 1:
        row = leaf.nbytes // shape[0]
        rows = grid[0]
        for c in range(1, len(chunks)):
            if chunks[c] != (file, start + rows[c] * row):
                return None
    return file, start


class Runs:
    """The pending run of one `ChunkReader` (which it calls back for reads and checks)."""

    def __init__(self, reader: Any, max_bytes: int = _MAX_RUN_BYTES) -> None:
        self._reader = reader
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._parts: list[tuple[Any, int, np.ndarray]] = []  # (leaf, its first byte, its buffer)
        self._file = self._end = 0
        self._bytes = 0
        self._future: _RunFuture | None = None

    def add(self, leaf: Any, file: int, start: int, dest: np.ndarray) -> Future[None]:
        """Queue reading all of `leaf` (bytes `start`.. of `file`) into `dest`; resolves once verified."""
        with self._lock:
            if self._parts and (file != self._file or start != self._end or len(self._parts) >= MAX_RUN_PARTS
                                or self._bytes + dest.nbytes > self.max_bytes):
                self._submit_locked()
            if self._future is None:
                self._future = _RunFuture(self)
                self._file = file
            self._parts.append((leaf, start, dest))
            self._end = start + dest.nbytes
            self._bytes += dest.nbytes
            return self._future

    def submit(self, future: Future[None] | None = None) -> None:
        """Send the pending run to the pool (only if it is `future`'s, when given)."""
        with self._lock:
            if self._future is not None and (future is None or future is self._future):
                self._submit_locked()

    def _submit_locked(self) -> None:
        parts, future = self._parts, self._future
        self._parts, self._future, self._bytes = [], None, 0
        if parts and future is not None:
            self._reader.pool.submit(self._run, self._file, parts, future)

    def _run(self, file: int, parts: list[tuple[Any, int, np.ndarray]], future: Future[None]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        reader = self._reader
        try:
            views = [_byte_view(dest) for _, _, dest in parts]
            start = parts[0][1]
            try:
                if reader._reader(file).vectored:
                    # Checked part by part as they land (object stores); a mismatch fails the run.
                    checks = _run_checks(parts, views, reader.index.block_size) if reader.verify else None
                    reader._fill(file, start, views, parts[0][0], checks)
                    if checks is not None:
                        checks.rest()
                    bad = []
                else:  # one ranged request, then a copy per array
                    raw = np.empty(sum(len(v) for v in views), dtype=np.uint8)
                    reader._fill(file, start, memoryview(raw), parts[0][0])  # type: ignore[arg-type]
                    pos = 0
                    for view in views:
                        view[:] = memoryview(raw)[pos : pos + len(view)]  # type: ignore[arg-type]
                        pos += len(view)
                    bad = [] if not reader.verify else [
                        (leaf, dest) for (leaf, first, dest), view in zip(parts, views)
                        if not _verified(leaf, first, view, reader.index.block_size)]
            except _Mismatch:  # the arrays that do not match (or, the read cut short, did not land)
                bad = [(leaf, dest) for (leaf, first, dest), view in zip(parts, views)
                       if not _verified(leaf, first, view, reader.index.block_size)]
            except Exception:
                bad = [(leaf, dest) for leaf, _, dest in parts]
            # Read again on the planned path, array by array, so that the error names the leaf
            # and the bytes that fail (a read that now succeeds leaves its array correct).
            for leaf, dest in bad:
                reads = plan_reads(leaf, [full_box(leaf.shape)], reader.index.block_size, reader.verify)
                for read in reads:
                    reader.do_read(read, leaf, [dest])
            with reader._lock:
                reader.stats.direct_reads += 1
        except BaseException as e:
            future.set_exception(e)
        else:
            future.set_result(None)


def _byte_view(a: np.ndarray) -> memoryview:
    """The bytes of C-contiguous `a`, flat (for numpy's own dtypes without three numpy calls)."""
    if a.dtype.isbuiltin == 1 and a.dtype.kind != "c":  # native numpy, single-character format (no ml_dtypes)
        return memoryview(a).cast("B")  # type: ignore[arg-type]
    return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


class _Mismatch(Exception):
    """A checksum of a run failed; the planned re-read of its arrays names the leaf and the bytes."""


def _run_checks(parts: list[tuple[Any, int, np.ndarray]], views: list[memoryview], block: int) -> BlockChecks:
    """The checksum blocks of a run's arrays (all `whole_span` leaves, back to back in one file)."""
    checks = sorted(c for leaf, _, _ in parts for c in _blocks(leaf, block))
    return BlockChecks(checks, views, parts[0][1], lambda c, got: _Mismatch())


def _verified(leaf: Any, first: int, view: memoryview, block: int) -> bool:
    """Whether every checksum block of `leaf` (a `whole_span` leaf whose first byte is `first`) matches `view`."""
    return all(crc32c(view[lo - first : hi - first]) == crc for lo, hi, crc in _blocks(leaf, block))


def _blocks(leaf: Any, block: int) -> list[tuple[int, int, int]]:
    """The ``(start, end, crc)`` file ranges of the checksum blocks of `leaf` (a `whole_span` leaf)."""
    row = leaf.nbytes // leaf.shape[0]
    rows = leaf.grid[0]
    out: list[tuple[int, int, int]] = []
    entries = (leaf.chunks.entries() if isinstance(leaf.chunks, LazyChunks)
               else [(f, off, crcs) for (f, off), crcs in zip(leaf.chunks, leaf.crcs)])
    for c, (_, off, crcs) in enumerate(entries):
        end = off + (rows[c + 1] - rows[c]) * row
        out.extend((off + k * block, min(off + (k + 1) * block, end), crc) for k, crc in enumerate(crcs))
    return out
