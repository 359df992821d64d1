"""Many small arrays, one request: coalesced reads of whole arrays that lie back to back.

A save packs the chunks of many small leaves into one file, in leaf order, so
a load of a tree of thousands of small leaves finds their bytes side by side.
Read one by one, each would cost a task on the reader pool, a system call
(or, on an object store, a round trip) and its bookkeeping, which is far more
than its bytes. `Runs` gathers the direct reads of whole small arrays into
runs of consecutive file bytes and reads each run with one vectored read
(local files, object stores) or one ranged read plus copies (other stores),
then verifies every array's checksums as before (an object store's parts as
they land). A compressed leaf joins a run the same way when its stored blocks
lie back to back (`stored_whole_span`): the run reads its stored bytes into a
buffer of their own, checks each block's CRC on them, and decodes the blocks
into the array (on object stores, one request for many small compressed
leaves instead of one each).

A run is sent to the pool when it is full, when a read of another kind is
planned, or as soon as anyone waits for one of its arrays: the futures handed
out submit their run on `result()`, so no caller can wait for a read that was
never started.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._codecs import codecs as _codecs
from .._core.boxes import full_box
from .._core.buffers import as_view
from .._core.checksum import BlockChecks, check_block
from .._errors import CorruptCheckpointError
from .._format.binindex import LazyChunks
from .._plan.leafreads import plan_leaf_reads
from .._tree.pytree import display_path
from .decodepool import pieces, spread

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


class _RunFuture(Future):
    """The future of one run; waiting for it first makes sure the run was submitted."""

    def __init__(self, runs: Runs | Pieces) -> None:
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


def stored_whole_span(leaf: Any, block: int) -> tuple[int, int, int] | None:
    """``(file, first byte, stored bytes)`` when the whole of compressed `leaf` is one run of stored
    blocks in one file: cut along its first axis only, its chunks' stored blocks back to back."""
    shape, grid, chunks = leaf.shape, leaf.grid, leaf.chunks
    if not shape or 0 in shape or any(len(b) != 2 for b in grid[1:]):
        return None
    file, start = chunks[0]
    pos = start
    for c in range(len(chunks)):
        if c and chunks[c] != (file, pos):
            return None
        pos += sum(leaf.stored_sizes(c, block))
    return file, start, pos - start


def refs_whole_span(leaf: Any, block: int) -> tuple[int, int] | None:
    """``(file, first byte)`` when the whole of `leaf`, a leaf with references (format version 4), is
    one run of raw bytes in one file, in C order: cut along its first axis only, every block raw (its
    own or a reference to a raw block, no delta), the blocks back to back in one file (a base's, where
    all are references: a small leaf the base wrote beside its neighbours). It then joins a run of small
    arrays like a `whole_span` leaf, its blocks checked where they lie (`_blocks`)."""
    from .blocks import block_places

    shape, grid = leaf.shape, leaf.grid
    if getattr(leaf, "codec", "none") != "none" or not shape or 0 in shape or any(len(b) != 2 for b in grid[1:]):
        return None
    row = leaf.nbytes // shape[0]
    rows = grid[0]
    first: tuple[int, int] | None = None
    pos = -1
    for c in range(len(leaf.chunks)):
        places = block_places(leaf, c, block)
        if sum(p[2] for p in places) != (rows[c + 1] - rows[c]) * row:
            return None
        for f, off, _size, _crc, codec, against in places:
            if codec != 0 or against is not None:
                return None
            if first is None:
                first, pos = (f, off), off
            elif f != first[0] or off != pos:
                return None
            pos += _size
    return first


@dataclass
class Cut:
    """A run being gathered: bytes ``[start, end)`` of one file, in `parts` pieces.

    `takes` is the one rule of where runs end, which `Runs`, `Pieces` and the
    load's plan (`plan.plan`, which predicts every request) all follow.
    """

    file: int
    start: int
    end: int
    parts: int = 0

    def takes(self, file: int, start: int, end: int, max_bytes: int) -> bool:
        """Whether bytes ``[start, end)`` of `file` join this run: they follow it, and it stays within limits."""
        return (file == self.file and start == self.end and self.parts < MAX_RUN_PARTS
                and end - self.start <= max_bytes)

    def add(self, end: int) -> None:
        self.end = end
        self.parts += 1


def _coded(leaf: Any) -> bool:
    return getattr(leaf, "codec", "none") != "none"


class Runs:
    """The pending run of one `ChunkReader` (which it calls back for reads and checks)."""

    def __init__(self, reader: Any, max_bytes: int = _MAX_RUN_BYTES) -> None:
        self._reader = reader
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._parts: list[tuple[Any, int, np.ndarray]] = []  # (leaf, its first byte, its buffer)
        self._cut: Cut | None = None
        self._future: _RunFuture | None = None

    def add(self, leaf: Any, file: int, start: int, dest: np.ndarray, stored: int = -1) -> Future[None]:
        """Queue reading all of `leaf` (bytes `start`.. of `file`) into `dest`; resolves once verified.
        A compressed leaf passes its `stored` bytes (`stored_whole_span`), which are read and decoded."""
        n = dest.nbytes if stored < 0 else stored
        with self._lock:
            if self._cut is not None and not self._cut.takes(file, start, start + n, self.max_bytes):
                self._submit_locked()
            if self._cut is None:
                self._cut = Cut(file, start, start)
                self._future = _RunFuture(self)
            self._parts.append((leaf, start, dest))
            self._cut.add(start + n)
            assert self._future is not None
            return self._future

    def submit(self, future: Future[None] | None = None) -> None:
        """Send the pending run to the pool (only if it is `future`'s, when given)."""
        with self._lock:
            if self._future is not None and (future is None or future is self._future):
                self._submit_locked()

    def _submit_locked(self) -> None:
        parts, future, cut = self._parts, self._future, self._cut
        self._parts, self._future, self._cut = [], None, None
        if parts and future is not None and cut is not None:
            self._reader.pool.submit(self._run, cut.file, parts, future)

    def _run(self, file: int, parts: list[tuple[Any, int, np.ndarray]], future: Future[None]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        reader = self._reader
        block = reader.index.block_size
        try:
            # A compressed leaf's stored bytes land in a buffer of their own, then are decoded.
            views = [memoryview(np.empty(_stored_total(leaf, block), np.uint8).data) if _coded(leaf)
                     else _byte_view(dest) for leaf, _, dest in parts]
            coded = any(_coded(leaf) for leaf, _, _ in parts)
            start = parts[0][1]
            where = f"{reader.loc.path}: leaf "
            decoded = False  # every compressed block decoded as its check passed
            try:
                if reader._reader(file).vectored:
                    # Checked part by part as they land (object stores), a compressed block decoded right
                    # after its check; a mismatch fails the run. (Compressed blocks are always checked:
                    # they are decoded, not copied.)
                    checks = (_run_checks(parts, views, block, lambda leaf: where + repr(
                        display_path(leaf.path, reader.item))) if reader.verify or coded else None)
                    reader._fill(file, start, views, parts[0][0], checks)
                    if checks is not None:
                        checks.rest()
                        decoded = True
                    bad = []
                else:  # one ranged request, then a copy per array
                    raw = np.empty(sum(len(v) for v in views), dtype=np.uint8)
                    reader._fill(file, start, as_view(raw), parts[0][0])
                    pos = 0
                    for view in views:
                        view[:] = as_view(raw)[pos : pos + len(view)]
                        pos += len(view)
                    bad = [] if not (reader.verify or coded) else [
                        (leaf, dest) for (leaf, first, dest), view in zip(parts, views)
                        if not _verified(leaf, first, view, reader.index.block_size)]
            except _Mismatch:  # the arrays that do not match (or, the read cut short, did not land)
                bad = [(leaf, dest) for (leaf, first, dest), view in zip(parts, views)
                       if not _verified(leaf, first, view, reader.index.block_size)]
            except Exception:
                bad = [(leaf, dest) for leaf, _, dest in parts]
            failed = {id(dest) for _, dest in bad}
            for (leaf, _, dest), view in zip(parts, views):
                if _coded(leaf) and id(dest) not in failed and not decoded:
                    _decode_whole(leaf, view, dest, block, where + repr(display_path(leaf.path, reader.item)))
            # Read again on the planned path, array by array, so that the error names the leaf
            # and the bytes that fail (a read that now succeeds leaves its array correct).
            for leaf, dest in bad:
                for read in plan_leaf_reads(leaf, [full_box(leaf.shape)], block, reader.verify):
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
        return as_view(a).cast("B")
    return as_view(a.reshape(-1).view(np.uint8))


class _Mismatch(Exception):
    """A checksum of a run failed; the planned re-read of its arrays names the leaf and the bytes."""


def _run_checks(parts: list[tuple[Any, int, np.ndarray]], views: list[memoryview], block: int,
                where: Callable[[Any], str]) -> BlockChecks:
    """The checksum blocks of a run's arrays (all `whole_span` or `stored_whole_span` leaves, back to
    back in one file); each compressed block is decoded into its array once its check passes."""
    # per block: (file start, end, crc, None or (leaf, stored bytes, the leaf's raw bytes, name, raw start, end))
    rows: list[tuple[int, int, int, Any]] = []
    for (leaf, first, dest), view in zip(parts, views):
        blocks = _blocks(leaf, block)
        if not _coded(leaf):
            rows.extend((*c, None) for c in blocks)
            continue
        raw = dest.reshape(-1).view(np.uint8)
        for (lo, hi, crc), (a, b, name) in zip(blocks, _raw_blocks(leaf, block)):
            rows.append((lo, hi, crc, (leaf, view[lo - first : hi - first], raw, f"{where(leaf)}, {name}", a, b)))
    rows.sort(key=lambda r: r[0])
    decode = [r[3] for r in rows]

    def groups(i: int, j: int) -> list[tuple[int, int]]:
        # Blocks i..j-1 cut into each leaf's consecutive blocks (one `decode_run` call each).
        out: list[tuple[int, int]] = []
        k = i
        while k < j:
            d = decode[k]
            if d is None:
                k += 1
                continue
            end = k + 1
            while end < j and (e := decode[end]) is not None and e[0] is d[0] and e[4] == decode[end - 1][5]:
                end += 1
            out.append((k, end))
            k = end
        return out

    def decode_groups(found: list[tuple[int, int]], a: int, b: int) -> None:
        for k, end in found[a:b]:
            group = decode[k:end]
            leaf, dest = group[0][0], group[0][2]
            _codecs.decode_run(leaf.codec, [g[1] for g in group], leaf.dtype, [g[5] - g[4] for g in group],
                               dest[group[0][4] : group[-1][5]], [g[3] for g in group])

    def then(i: int, j: int) -> None:
        # Blocks i..j-1 passed: decoded leaf by leaf, in pieces of about DECODE_PIECE raw bytes (many small
        # leaves each), the first in this reader thread and the others on the decode pool (`spread`), so a
        # run of small compressed leaves is decoded on as many cores as are free, not on its reader alone.
        found = groups(i, j)
        if not found:
            return
        at = list(itertools.accumulate((decode[end - 1][5] - decode[k][4] for k, end in found), initial=0))
        spread(functools.partial(decode_groups, found), pieces([(at[n], at[n + 1], "") for n in range(len(found))],
                                                               0, len(found)))

    return BlockChecks([r[:3] for r in rows], views, parts[0][1], lambda c, got: _Mismatch(), then)


def _verified(leaf: Any, first: int, view: memoryview, block: int) -> bool:
    """Whether every checksum block of `leaf` (a `whole_span` leaf whose first byte is `first`) matches `view`."""
    try:
        for lo, hi, crc in _blocks(leaf, block):
            check_block(view[lo - first : hi - first], crc, "", "")  # (the re-read names the leaf and bytes)
    except CorruptCheckpointError:
        return False
    return True


def _entries(leaf: Any) -> list[tuple[int, int, tuple[int, ...]]]:
    return (leaf.chunks.entries() if isinstance(leaf.chunks, LazyChunks)
            else [(f, off, crcs) for (f, off), crcs in zip(leaf.chunks, leaf.crcs)])


def _blocks(leaf: Any, block: int) -> list[tuple[int, int, int]]:
    """The ``(start, end, crc)`` file ranges of the checksum blocks of `leaf` (a `whole_span` or
    `refs_whole_span` leaf, or a compressed `stored_whole_span` one: its stored blocks)."""
    if leaf.refs:  # a `refs_whole_span` leaf: each block where it lies (its own file or a base's)
        from .blocks import block_places

        return [(off, off + size, crc) for c in range(len(leaf.chunks))
                for _f, off, size, crc, _codec, _against in block_places(leaf, c, block)]
    row = leaf.nbytes // leaf.shape[0]
    rows = leaf.grid[0]
    out: list[tuple[int, int, int]] = []
    for c, (_, off, crcs) in enumerate(_entries(leaf)):
        if _coded(leaf):
            for size, crc in zip(leaf.stored_sizes(c, block), crcs):
                out.append((off, off + size, crc))
                off += size
            continue
        end = off + (rows[c + 1] - rows[c]) * row
        out.extend((off + k * block, min(off + (k + 1) * block, end), crc) for k, crc in enumerate(crcs))
    return out


def _stored_total(leaf: Any, block: int) -> int:
    return sum(sum(leaf.stored_sizes(c, block)) for c in range(len(leaf.chunks)))


def _raw_blocks(leaf: Any, block: int) -> list[tuple[int, int, str]]:
    """Where each block of compressed `leaf` (a `stored_whole_span` one) decodes to in the whole
    array's bytes, in stored order: ``(start, end, "block k of chunk c")``."""
    row = leaf.nbytes // leaf.shape[0]
    rows = leaf.grid[0]
    out = []
    for c in range(len(leaf.chunks)):
        lo, hi = rows[c] * row, rows[c + 1] * row
        for k in range(len(leaf.stored_sizes(c, block))):
            a = lo + k * block
            out.append((a, min(a + block, hi), f"block {k} of chunk {c}"))
    return out


def _decode_whole(leaf: Any, stored: memoryview, dest: np.ndarray, block: int, where: str) -> None:
    """Decode every stored block of compressed `leaf` (its stored bytes, back to back) into `dest`."""
    raw = dest.reshape(-1).view(np.uint8)
    pos = 0
    for (a, b, name), (lo, hi, _) in zip(_raw_blocks(leaf, block), _blocks(leaf, block)):
        _codecs.decode(leaf.codec, stored[pos : pos + hi - lo], leaf.dtype, b - a, raw[a:b], where=f"{where}, {name}")
        pos += hi - lo


class Pieces:
    """Direct reads, any boxes, merged per file into runs of consecutive bytes.

    On an object store every request costs a round trip (and some servers, moto among them, a pass
    over the whole object), so the reads that land straight in their destinations (a target box, or
    consecutive whole regions of one) are not sent one by one: each file gathers the pieces that
    follow one another in it, across boxes and leaves, into one read of up to `max_bytes`, sent as
    soon as it is full, when a piece that does not follow comes, or when anyone waits for one of
    its arrays (`_RunFuture`). The read lands each piece in its destination and verifies every
    piece's checksum blocks as the bytes arrive; a mismatch names the leaf that holds the block.

    A compressed read that decodes straight into its destination (`reader.CodedRead`) is a piece of
    its stored blocks: they land in one of at most `CODED_RUNS` buffers of the reader's, each stretch
    checked and decoded into the destination as its part lands.
    """

    def __init__(self, reader: Any, max_bytes: int) -> None:
        self._reader = reader
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # per file: (its run, pieces, future); a piece is (views, checks, leaf) or a `CodedRead`
        self._open: dict[int, tuple[Cut, list[Any], _RunFuture]] = {}
        self._buffers = _Buffers(CODED_RUNS)

    def add(self, file: int, start: int, end: int, views: list[memoryview], checks: Any, leaf: Any) -> Future[None]:
        """Queue reading file bytes [start, end) into `views` (consecutive), verifying `checks`."""
        return self._add(file, start, end, (views, checks, leaf))

    def add_coded(self, coded: Any) -> Future[None]:
        """Queue a `reader.CodedRead`: its stored blocks read, checked and decoded into its destination."""
        return self._add(coded.file, coded.first, coded.first + coded.nbytes, coded)

    def _add(self, file: int, start: int, end: int, piece: Any) -> Future[None]:
        with self._lock:
            run = self._open.get(file)
            if run is not None and not run[0].takes(file, start, end, self.max_bytes):
                self._submit_locked(file)
                run = None
            if run is None:
                run = self._open[file] = (Cut(file, start, start), [], _RunFuture(self))
            run[1].append(piece)
            run[0].add(end)
            if end - run[0].start >= self.max_bytes:  # full: nothing more can join
                self._submit_locked(file)
            return run[2]

    def submit(self, future: Future[None] | None = None) -> None:
        """Send the runs being gathered to the pool (only `future`'s, when given)."""
        with self._lock:
            for file in [f for f, run in self._open.items() if future is None or run[2] is future]:
                self._submit_locked(file)

    def _submit_locked(self, file: int) -> None:
        cut, pieces, future = self._open.pop(file)
        self._reader.pool.submit(self._run, file, cut.start, cut.end, pieces, future)

    def _run(self, file: int, start: int, end: int, pieces: list[Any], future: Future[None]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        reader = self._reader
        buf = None
        try:
            coded = sum(p.nbytes for p in pieces if not isinstance(p, tuple))
            buf = self._buffers.take(coded) if coded else None
            stored = memoryview(buf.data)[:coded] if buf is not None else None
            views: list[memoryview] = []
            checks: list[tuple[int, int, int]] = []
            fails: list[Callable[[tuple[int, int, int], int], BaseException]] = []
            decoders: list[tuple[int, int, Callable[[int, int], None]]] = []  # (first check, end, decode)
            pos = 0
            for p in pieces:  # in file order, back to back
                if isinstance(p, tuple):
                    pviews, pchecks, leaf = p
                    views.extend(pviews)
                    fail = functools.partial(_raw_fail, reader, file, views, start, leaf)
                else:
                    assert stored is not None
                    view = stored[pos : pos + p.nbytes]
                    pos += p.nbytes
                    views.append(view)
                    pchecks, fail = p.checks, p.fail
                    decoders.append((len(checks), len(checks) + len(pchecks), p.decoder(view)))
                checks.extend(sorted(tuple(c) for c in pchecks))
                fails.extend([fail] * len(pchecks))

            def then(i: int, j: int) -> None:  # checks i..j-1 passed: decode the compressed pieces' among them
                for a, b, decode in decoders:
                    if a < j and i < b:
                        decode(max(i, a) - a, min(j, b) - a)

            if checks:
                number = {c[0]: k for k, c in enumerate(checks)}
                bc = BlockChecks(checks, views, start, lambda c, got: fails[number[c[0]]](c, got),
                                 then if decoders else None)
                reader._fill(file, start, views, _leaf(pieces[0]), bc)
                bc.rest()
            else:
                reader._fill(file, start, views, _leaf(pieces[0]))
            with reader._lock:
                reader.stats.direct_reads += len(pieces)
        except BaseException as e:
            future.set_exception(e)
        else:
            future.set_result(None)
        finally:
            if buf is not None:
                self._buffers.give(buf)


#: Runs of compressed pieces holding their stored bytes at once, per checkpointable being loaded: each
#: holds a buffer of up to the run's size (`Pieces.max_bytes`), so at most this many of them are resident.
CODED_RUNS = 4


class _Buffers:
    """At most `count` buffers for the stored bytes of compressed runs, reused from run to run; a run
    that finds none free waits for one (the runs holding them wait on nothing of the load's pool)."""

    def __init__(self, count: int) -> None:
        self._free: list[np.ndarray] = []
        self._made = 0
        self._count = count
        self._cond = threading.Condition()

    def take(self, nbytes: int) -> np.ndarray:
        with self._cond:
            while not self._free and self._made >= self._count:
                self._cond.wait()
            if self._free:
                buf = self._free.pop()
                if buf.nbytes >= nbytes:
                    return buf
                self._made -= 1  # too small: replaced by a larger one below
            self._made += 1
        return np.empty(nbytes, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


def _leaf(piece: Any) -> Any:
    return piece[2] if isinstance(piece, tuple) else piece.leaf


def _raw_fail(reader: Any, file: int, views: list[memoryview], start: int, leaf: Any, c: tuple[int, int, int],
              got: int) -> BaseException:
    """The error of an uncompressed piece's block `c` whose CRC-32C came out `got`: it names the leaf."""
    return reader._block_checks(file, [c], views, start, leaf).fail(c, got)
