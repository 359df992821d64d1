"""The block pipeline of a save: what every stored block passes through between the host bytes of a
chunk and the data file's writer. A compressed chunk's bytes are cut into coding tasks (`RUN_BLOCKS`
blocks) coded on the save's coder pool (`CodePool`, most urgent file first; `in_order` keeps each file's
window bounded), into buffers lent from `buffers.coded_pool` (`coded_alloc`); each stored block gets
its one CRC-32C (`block_crc`) and its place in the shared buffer (`places`) on the coder's thread
(`checked`); the writer then batches small pieces and next-door blocks into few writes (`Batch`). The
stream writer codes through the same steps (`encoded`). An incremental save's blocks are hashed and
decided (reference, delta or own) in `incremental` and join the same batch.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import threading
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .._codecs import codecs as _codecs
from .._codecs.blosc2lib import address
from .._core import buffers as _buffers
from .._core.buffers import as_view
from .._core.checksum import block_crc
from .._format import manifest as fmt
from . import codecpolicy as _policy

#: Chunks up to this size are checksummed on the writing thread and written in batches of
#: about BATCH_BYTES (a state of thousands of small leaves would otherwise pay a thread
#: hand-off per checksum and a system call per chunk).
SMALL_CHUNK = 64 << 10
BATCH_BYTES = 4 << 20


class Batch:
    """The pieces of one data file, in order: pieces up to SMALL_CHUNK are gathered and written
    together in writes of about BATCH_BYTES, larger ones alone (the batch before them first).
    Pieces placed in a buffer (`add`'s `at`: coded blocks, which the codecs join into shared
    buffers) that follow each other there as in the file are written as one view of it, not copied."""

    __slots__ = ("_span", "buf")

    def __init__(self) -> None:
        self.buf = bytearray()
        self._span: list[Any] | None = None  # [buffer, start, end]: placed pieces not yet written

    def add(self, piece: Any, at: tuple[Any, int] | None = None) -> Generator[Any, None, bool]:
        """Yield what is due for writing once `piece` is added (a small piece is copied at once);
        returns whether anything was written. `at`: (buffer, offset) where `piece` lies, if it is a
        view of `buffer` (`places`): it is held, and written with the pieces that follow it there."""
        span = self._span
        if at is not None:
            owner, start = at
            if span is not None and span[0] is owner and span[2] == start:
                span[2] = start + len(piece)
                return False
            flushed = span is not None or bool(self.buf)
            yield from self.rest()
            self._span = [owner, start, start + len(piece)]
            return flushed
        if span is not None:
            yield self._take_span()
        if len(piece) <= SMALL_CHUNK:
            self.buf += piece
            if len(self.buf) < BATCH_BYTES:
                return False
            yield self._take()
            return True
        flushed = bool(self.buf)
        if flushed:
            yield self._take()
        yield piece
        return flushed

    def rest(self) -> Iterator[Any]:
        """What is held: the last, partial batch, or the placed pieces not yet written."""
        if self._span is not None:
            yield self._take_span()
        if self.buf:
            yield self._take()

    def _take(self) -> bytearray:
        out, self.buf = self.buf, bytearray()  # a new buffer: the one yielded may still be in use
        return out

    def _take_span(self) -> memoryview:
        assert self._span is not None
        owner, start, end = self._span
        self._span = None
        return memoryview(owner).cast("B")[start:end]


def places(blocks: list[Any]) -> list[tuple[Any, int] | None]:
    """Where each of `blocks` lies: (the buffer it is a view of, its offset there), or None where it is
    not a view of a one-dimensional byte buffer (the codecs join a batch's stored blocks into shared
    buffers: `codecs._joined`, `_flush_blosc2`). Offsets are read from the blocks' addresses: whether
    two blocks lie back to back is found in memory, not assumed from how a codec joined them."""
    out: list[tuple[Any, int] | None] = []
    bases: dict[int, tuple[int, int]] = {}  # id(buffer) -> (address, bytes)
    for b in blocks:
        owner = b.obj if type(b) is memoryview else None
        if owner is None or not len(b) or not b.contiguous or b.ndim != 1 or b.itemsize != 1:
            out.append(None)
            continue
        try:
            base = bases.get(id(owner))
            if base is None:
                whole = memoryview(owner)
                if not whole.contiguous:
                    out.append(None)
                    continue
                base = bases[id(owner)] = (address(whole.cast("B"))[0], whole.nbytes)
            off = address(b)[0] - base[0]
        except (TypeError, ValueError):
            out.append(None)
            continue
        out.append((owner, off) if off >= 0 and off + len(b) <= base[1] else None)
    return out


#: Blocks per coding task of a compressed save: a large chunk is coded in runs of this many blocks,
#: small chunks together up to as many bytes (`code_task`). Measured on the TPU host's 13 cores
#: (docs/compression.md, "On many cores"): 16 MiB a task keeps a task's GIL-holding steps (Python, the
#: join of its stored blocks) a small share of its GIL-free ones, while a chunk of 64 MiB still
#: spreads over 4 coders.
RUN_BLOCKS = 16
#: Coding tasks code into buffers lent from `buffers.coded_pool` (False: a new buffer per task;
#: docs/compression.md, "On many cores").
LEND_CODED_BUFFERS = True


def coded_alloc() -> Any:
    """Where coding tasks' stored blocks go (`codecs.encode_runs`' `alloc`): buffers lent from the process's
    `buffers.coded_pool`, each taken back once its blocks are written, so that a later task (of this save
    or the next) codes into pages already mapped; None (a new buffer per task) without
    `LEND_CODED_BUFFERS`."""
    return _buffers.coded_pool.lend if LEND_CODED_BUFFERS else None


def code_task(task: list[tuple[int, bool, tuple[Any, ...]]], alloc: Any = None) -> list[tuple[int, bool, list[Any]]]:
    """Code one task of `code_tasks`: (slot, last run of the slot, run) -> (slot, last, stored blocks), into
    buffers from `alloc` (`codecs.encode_runs`)."""
    coded = _codecs.encode_runs([run for _, _, run in task], coders=_policy.coder_cores(), alloc=alloc)
    return [(n_slot, last, blocks) for (n_slot, last, _), blocks in zip(task, coded)]


def stored_block(codec: str, piece: Any, dtype: Any) -> tuple[Any, int]:
    """One block as it is stored, coded on its own by `codec` (its raw bytes for "none"), and its one
    CRC-32C: an incremental save's own blocks (`incremental._run`), where a run's blocks are decided one by
    one (a reference, a delta or this)."""
    stored = piece if codec == "none" else _codecs.encode(codec, piece, dtype)
    return stored, block_crc(stored)


def checked(coded: list[tuple[int, bool, list[Any]]]) -> list[tuple[int, bool, list[Any], list[int], list[Any]]]:
    """A coded task's blocks with each one's CRC-32C (its check record) and place (`places`), found on
    the coder's thread: the writer of a file then only writes, and next-door blocks go to it as one
    view (on the TPU host the writers fell behind the coders with 2,449 small leaves: a CRC call and a
    write call a block, each taking the GIL back from 13 coders; docs/compression.md)."""
    return [(n_slot, last, blocks, [block_crc(b) for b in blocks], places(blocks)) for n_slot, last, blocks in coded]


class CodePool:
    """The coder threads of one save, taking the most urgent queued task first: the lowest
    ``priority`` (a save gives each data file its number), then the oldest.

    A `ThreadPoolExecutor` takes tasks first come, first served, so the files written at once were
    coded in lockstep and all reached their final fsync together, after the last block was coded:
    a compressed save cost the coding plus the flush of every file. Served by file, the first files
    are coded (and written) first and flush to disk while the later ones are coded: coding and
    the disk's flush overlap, and only the last file's flush is left after the coding
    (docs/compression.md, "Where it runs"). Each file still has at most a window of
    tasks queued (`in_order`), so memory stays as bounded as before; tasks of other files fill
    the workers that the first file's window leaves idle. `submit` and `_max_workers` as
    `ThreadPoolExecutor`'s, so code that takes either (incremental saves) takes this one."""

    def __init__(self, workers: int, name: str = "cairn-code") -> None:
        self._max_workers = max(1, workers)
        self._heap: list[tuple[Any, int, Future[Any], Any, tuple[Any, ...]]] = []
        self._cv = threading.Condition()
        self._order = itertools.count()
        self._closed = False
        self._name = name
        self._threads: list[threading.Thread] = []  # started by the first tasks (a raw save starts none)

    def submit(self, fn: Any, /, *args: Any, priority: Any = 0) -> Future[Any]:
        f: Future[Any] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("cannot schedule new coding tasks after the save's coder pool was shut down")
            heapq.heappush(self._heap, (priority, next(self._order), f, fn, args))
            if len(self._threads) < self._max_workers:
                t = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._cv.notify()
        return f

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                _, _, f, fn, args = heapq.heappop(self._heap)
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn(*args))
            except BaseException as e:  # the consumer's result() raises it
                f.set_exception(e)
            del f, fn, args  # (not kept alive until the next task)

    def shutdown(self) -> None:
        """Run what is queued, then stop the workers and wait for them."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()

    def __enter__(self) -> CodePool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def in_order(pool: Any, fn: Any, tasks: Any, priority: Any = None) -> Any:
    """fn(task) for each of `tasks`, in order: on `pool`, at most one task per worker plus one ahead of
    the consumer (memory stays bounded by the window, not the file), or here without a pool. On a
    `CodePool`, `priority` (not None) ranks these tasks against other consumers' (lower first)."""
    if pool is None:
        yield from map(fn, tasks)
        return
    window = max(2, getattr(pool, "_max_workers", 2) + 1)
    ahead: collections.deque[Any] = collections.deque()
    for task in tasks:
        ahead.append(pool.submit(fn, task) if priority is None else pool.submit(fn, task, priority=priority))
        if len(ahead) >= window:
            yield ahead.popleft().result()
    while ahead:
        yield ahead.popleft().result()


def encoded(pool: ThreadPoolExecutor | None, codec: str, raw: memoryview, block: int, dtype: Any) -> Any:
    """The stored forms of `raw`'s blocks, in order, each with its CRC-32C, coded in runs of `RUN_BLOCKS` on
    `pool` (see `in_order`). (The stream writer's coding: recompressing copies. Its runs are coded as a
    save's tasks are, `code_task`: with as many coders as code at once, so that python-blosc2's "blosc2"
    chunks are gathered into shared buffers from `BLOSC2_JOIN_MIN_CODERS` on (C-Blosc2 called directly
    codes a run into one buffer anyway); and the CRCs found on the coder's thread, as `checked` finds a
    save's, not on the writer's; into buffers lent as a save's are, `LEND_CODED_BUFFERS`.)"""
    run = block * RUN_BLOCKS
    alloc = coded_alloc()

    def code(o: int) -> list[tuple[Any, int]]:
        blocks = _codecs.encode_runs([(codec, raw[o : o + run], block, dtype)], coders=coders, alloc=alloc)[0]
        return [(b, block_crc(b)) for b in blocks]

    on = pool if len(raw) > run else None
    coders = getattr(on, "_max_workers", 1) if on is not None else 1
    for blocks in in_order(on, code, range(0, len(raw), run)):
        yield from blocks


def bytes_of(arr: np.ndarray) -> memoryview:
    """The C-order bytes of `arr`, without a copy where it is contiguous."""
    try:
        return as_view(arr).cast("B")  # the fast path: a contiguous array of a buffer-exporting dtype
    except (TypeError, ValueError):  # not contiguous, or a dtype numpy cannot export (ml_dtypes')
        return as_view(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


class PlainBlocks:
    """The block stage of a save without hashes or a base (format version 2, or 3 compressed): every block
    the chunk's own, coded or raw. `incremental.Incremental` is the other stage (hashes, and references to
    or deltas against a base's blocks); `engine.SaveJob.blocks` is the one a save runs, and the engine asks
    it, not whether the save is incremental."""

    incremental = False

    def version(self, compression: str | None) -> int:
        """The version of the save's indexes, which names their layout."""
        return fmt.FORMAT_VERSION if compression is None else fmt.COMPRESSED_VERSION

    def open(self, items: Any, where: str) -> None:
        """Nothing to read before writing (an incremental save reads its base's indexes here)."""

    def base_files(self) -> Any:
        return contextlib.nullcontext()

    def coders(self, compressed: bool) -> int:
        """The coder pool's threads: every usable core for a compressed save, none for a raw one."""
        return _policy.coder_cores() if compressed else 0

    def writers(self, threads: int, files: int) -> int:
        return threads

    def writer(self, write: Any) -> Any:
        """How a data file is written: by `write` (storage's), even where it is empty."""
        return write

    def newer_blocks(self, item: str) -> int:
        return 0

    def part_extras(self, item: str) -> dict[str, Any]:
        """What the process's status says of its part beside its files (an incremental save: `ext`, `refs`)."""
        return {}

    def columns(self, item: Any, own_files: int) -> Any:
        """The part's extra columns (an incremental save's hashes and sources): none."""
        return None

    def committed(self, loc: Any, manifest: bytes, files: dict[str, bytes], processes: int) -> None:
        """After the commit (an incremental save keeps what it wrote for the next one, `basecache`)."""


#: The one `PlainBlocks`.
PLAIN = PlainBlocks()
