"""The save engine: validate and plan, snapshot, write, commit.

A save runs in two phases. `prepare` (on the caller's thread) validates the
state, plans which chunks this process writes, agrees on an attempt token
with the other processes and, for an async save, snapshots this process's
chunks into host memory. `SaveJob.run` (on the caller's thread for a blocking
save, on a background thread for an async one) writes the data files,
publishes this process's status, and on the primary merges the indexes and
commits. See docs/ARCHITECTURE.md for the protocol.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import heapq
import itertools
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._core import buffers as _buffers
from .._core.buffers import snapshot_pool as _snapshot_pool
from .._core.checksum import block_crcs, crc32c
from .._core.gcpause import paused
from .._core.host import usable_cores
from .._core.stats import SaveStats
from .._dist.agree import sequence, settle
from .._dist.coord import (
    Coordinator,
    activity,
    default_coordinator,
    fetch_from,
)
from .._errors import (
    CheckpointError,
    CoordinationError,
    UnsupportedTypeError,
    error_from_record,
    error_record,
)
from .._format import codecs as _codecs
from .._format import manifest as fmt
from .._format.blosc2lib import address
from .._plan.chunking import FileSlot
from .._storage.base import bandwidth_of, bandwidth_source
from .._storage.location import Location
from .._storage.measured import TransferClock, main_codec, record, sample_of
from .._tree.leaves import classify
from .._tree.perprocess import HostValues, is_per_process
from .._tree.pytree import display_path, flatten
from .._version import __version__
from . import basecache
from .assign import Concat, SaveItem, plan_item
from .commit import CommitStrategy, strategy_for
from .incremental import write_if_any
from .indexparts import build_part, item_index
from .options import (
    CHOOSING,
    CODEC_METER,
    CODEC_SPEEDS,
    SaveOptions,
    bad_compression,
    blosc2_faster,
    compression_can_pay,
    compression_pays,
    predicted_seconds,
    save_options_of,
    usable_codecs,
)

log = logging.getLogger("cairn")


#: Chunks up to this size are checksummed on the writing thread and written in batches of
#: about BATCH_BYTES (a state of thousands of small leaves would otherwise pay a thread
#: hand-off per checksum and a system call per chunk).
SMALL_CHUNK = 64 << 10
BATCH_BYTES = 4 << 20


class _Batch:
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
        view of `buffer` (`_places`): it is held, and written with the pieces that follow it there."""
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


def _places(blocks: list[Any]) -> list[tuple[Any, int] | None]:
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


@dataclass
class SaveJob:
    loc: Location
    items: list[SaveItem]
    root: bool
    token: str
    seq: int
    coord: Coordinator
    overwrite: bool
    block_size: int
    timeout: float
    threads: int
    metadata: dict[str, Any]
    strategy: CommitStrategy
    # None: blocks stored raw (format version 2); "choose": a codec per leaf measured on a sample;
    # else the one codec every array leaf gets (`codecs.CODECS`). Any but None writes version 3.
    compression: str | None = None
    # What "auto" prices each leaf with, as the primary sees it (`auto_prices`: the storage's bandwidth
    # each way, raw and coded, where it came from, the codec factor); empty: this process's own.
    prices: dict[str, Any] = field(default_factory=dict)
    stats: SaveStats = field(default_factory=SaveStats)
    # item name -> leaf number -> codec, for the leaves this process writes (set by `write_data`)
    codecs: dict[str, dict[int, str]] = field(default_factory=dict)
    # (item, file number) -> the snapshot buffers holding that file's chunks, for the next snapshot
    pooled: dict[tuple[str, int], list[np.ndarray]] = field(default_factory=dict)
    # Incremental saves (format version 4): block hashes and references to a base (`incremental`).
    inc: Any = None
    # What the data writes and the coding took, measured for the next saves' "auto" (`_measure`).
    transfers: TransferClock = field(default_factory=TransferClock, repr=False)
    code_spans: list[tuple[float, float]] = field(default_factory=list, repr=False)
    coded: dict[str, int] = field(default_factory=dict, repr=False)
    _code_lock: Any = field(default_factory=threading.Lock, repr=False)
    # Codecs being chosen while the first files are written (`_Choosing`; None: all chosen before).
    _choosing: Any = field(default=None, repr=False)
    # A blocking save's device-to-host copies, started ahead of the writers (`host_pipeline`; None: none).
    _pipe: Any = field(default=None, repr=False)
    # The primary's own index parts, (key, bytes): put with the indexes, in the commit (`_write_parts`).
    own_parts: list[tuple[str, bytes]] = field(default_factory=list, repr=False)

    # ------------------------------------------------------------------ layout

    @property
    def write_root(self) -> str:
        """Where this attempt's files go: a temporary sibling folder, or in place."""
        return self.strategy.attempt_root(self.loc.name, self.token)

    def data_key(self, item: SaveItem, k: int) -> str:
        return f"{self.write_root}/{item.dir}/{fmt.data_file_name(self.coord.process_index, k, self.token)}"

    # ------------------------------------------------------------------ snapshot

    def snapshot(self, budget_bytes: int | None = None) -> None:
        """Protect every chunk this process writes from later changes (async saves; see `_snapshot`)."""
        from .snapshot import snapshot

        snapshot(self, budget_bytes)

    # ------------------------------------------------------------------ write

    def _host(self, src: Any) -> np.ndarray:
        if type(src) is np.ndarray:
            return src
        from .._tree.shardings import host_view

        return host_view(src)

    def _take(self, item: SaveItem, key: tuple[int, int]) -> Any:
        """Chunk `key` of `item` for its writer, removed from the sources: its transfer where the host-copy
        pipeline started one (`snapshot.HostPipeline`), else the source itself (`_host` brings it over)."""
        src = item.sources.pop(key)
        pipe = self._pipe
        if pipe is not None and (item.name, key) in pipe:
            got = pipe.take((item.name, key))
            if got is not None:
                return got
        return src

    @property
    def version(self) -> int:
        """The version of this save's indexes, which names their layout (2, 3 or 4)."""
        if self.inc is not None:
            return fmt.INCREMENTAL_VERSION
        return fmt.FORMAT_VERSION if self.compression is None else fmt.COMPRESSED_VERSION

    def newer_blocks(self, item: SaveItem) -> int:
        """The manifest version that this process's part of `item` needs beyond its index's layout (0 for
        none): 5 for a "blosc2" block of its own, a reference to one or a delta against one, or a sparse
        delta; 6 for such a "blosc2-lz4" block (docs/FORMAT.md §6.6)."""
        return max(fmt.codecs_version(self.codecs.get(item.name, {}).values()),
                   self.inc.newer_blocks(item.name) if self.inc is not None else 0)

    def manifest_version(self, statuses: dict[int, dict[str, Any]]) -> int:
        """The manifest's version: the indexes' (`version`), or the highest any process's part of any item
        needs, 5 or 6 (its status says so: `_write_parts`; True, from a cairn before version 6: 5)."""
        said = [mine.get("newer") for s in statuses.values() for mine in s.get("items", {}).values()]
        return max([self.version, *(fmt.NEWER_BLOCKS_VERSION if v is True else int(v or 0) for v in said)])

    def _write_file(self, item: SaveItem, k: int, slots: list[FileSlot], crc_pool: ThreadPoolExecutor,
                    code_pool: CodePool | None = None, order: int = 0):
        # `order`: this file's rank among the save's files (its coding tasks go before later files').
        # Codecs chosen in the background: each slot waits for its own leaf's (`_Choosing.wait`), so a file
        # is coded and written from its first chunk on while its later leaves are still measured.
        choosing = self._choosing
        # Per chunk, in slot order: its CRC (one block), or a list of its block CRCs or their futures.
        # Plain ints where possible: a state of thousands of small leaves makes one per chunk, and
        # objects the garbage collector tracks make it run full collections during the save.
        crcs: list[Any] = []
        block = self.block_size
        leaf_codecs = self.codecs.get(item.name, {})
        # Compressed chunks: where each lands (stored sizes shift the chunks after it) and its blocks' sizes.
        moved: dict[int, int] = {}
        stored: dict[int, tuple[int, ...]] = {}

        def host_raw(slot: FileSlot, src: Any) -> memoryview:
            if type(src) is Concat:
                raw = memoryview(b"".join(_bytes_of(self._host(p)) for p in src.parts))
            else:
                raw = _bytes_of(self._host(src))
            if len(raw) != slot.nbytes:
                raise CheckpointError(
                    f"{self.loc.path}: chunk {slot.cell} of "
                    f"{display_path(item.leaves[slot.leaf].path, item.name)!r} has {len(raw)} bytes, "
                    f"planned {slot.nbytes}")
            return raw

        def code_tasks() -> Any:
            # The compressed chunks' host bytes, in slot order, as coding tasks (`_code_task`): a large
            # chunk in runs of RUN_BLOCKS blocks, small ones together up to a run's bytes (one task
            # codes many small leaves). (pop: a device copy made by `snapshot` is freed once its host
            # bytes exist.)
            group: list[tuple[int, bool, tuple[Any, ...]]] = []
            size, run = 0, block * RUN_BLOCKS
            for n_slot, slot in enumerate(slots):
                if choosing is not None:
                    if group and not choosing.ready(item.name, slot.leaf):
                        yield group  # code what is here while this leaf is still measured
                        group, size = [], 0
                    choosing.wait(item.name, slot.leaf)
                codec = leaf_codecs.get(slot.leaf, "none")
                if codec == "none":
                    continue
                raw = host_raw(slot, self._take(item, (slot.leaf, slot.cell)))
                dtype = item.leaves[slot.leaf].dtype  # type: ignore[union-attr]  # slots are arrays
                if len(raw) > run:
                    if group:
                        yield group
                        group, size = [], 0
                    for o in range(0, len(raw), run):
                        yield [(n_slot, o + run >= len(raw), (codec, raw[o:o + run], block, dtype))]
                    continue
                group.append((n_slot, True, (codec, raw, block, dtype)))
                size += len(raw)
                if size >= run:
                    yield group
                    group, size = [], 0
            if group:
                yield group

        # (An incremental save codes the blocks it writes itself: `incremental.write_chunk`.)
        coded = (_in_order(code_pool, self._timed_code_task, code_tasks(), order) if leaf_codecs and self.inc is None
                 else iter(()))
        done: collections.deque[tuple[int, bool, list[Any], list[int], list[Any]]] = collections.deque()

        def blocks_of(n_slot: int) -> Any:
            """(stored block, its CRC-32C, its place) of compressed slot `n_slot`, as its coding tasks finish."""
            while True:
                if not done:
                    done.extend(next(coded))
                got, last, blocks, block_crcs_, places = done.popleft()
                assert got == n_slot, (got, n_slot)
                yield from zip(blocks, block_crcs_, places)
                if last:
                    return

        def parts():
            batch = _Batch()
            pop = item.sources.pop
            shift = 0  # stored bytes minus raw bytes of the compressed chunks so far
            for n_slot, slot in enumerate(slots):
                if choosing is not None:
                    choosing.wait(item.name, slot.leaf)
                codec = leaf_codecs.get(slot.leaf, "none")
                if shift:
                    moved[n_slot] = slot.offset + shift
                if self.inc is not None:  # incremental (format 4): hashes, references (`incremental`)
                    assert batch._span is None  # (it writes `batch.buf` itself; nothing placed is held)
                    # (lazily: a chunk of an array the base holds unchanged is not read: `write_chunk`)
                    raw = functools.partial(host_raw, slot, pop((slot.leaf, slot.cell)))
                    batch.buf, sizes_, crcs_, own = yield from self.inc.write_chunk(
                        item, slot.leaf, slot.cell, raw, codec, getattr(item.leaves[slot.leaf], "dtype", None),
                        code_pool, batch.buf)
                    del raw
                    stored[n_slot] = sizes_
                    crcs.append(crcs_)
                    shift += own - slot.nbytes
                    activity.advance()
                    continue
                if codec != "none":
                    sizes, stored_crcs = [], []
                    for enc, crc, at in blocks_of(n_slot):
                        sizes.append(len(enc))
                        stored_crcs.append(crc)  # a stored block's check record
                        yield from batch.add(enc, at)
                    stored[n_slot] = tuple(sizes)
                    crcs.append(stored_crcs)
                    shift += sum(sizes) - slot.nbytes
                    activity.advance()
                    continue
                # pop: a device copy made by `snapshot` is freed once its host bytes exist.
                src = self._take(item, (slot.leaf, slot.cell))
                if type(src) is Concat:  # a merged chunk: its pieces' bytes, one after another
                    mvs = [_bytes_of(self._host(p)) for p in src.parts]
                    n = sum(len(m) for m in mvs)
                    if n == slot.nbytes:
                        crcs.append(block_crcs(mvs, block))
                        for m in mvs:
                            yield from batch.add(m)
                        del mvs
                        activity.advance()
                        continue
                    mv = memoryview(b"".join(mvs))
                else:
                    mv = _bytes_of(self._host(src))
                n = len(mv)
                if n != slot.nbytes:
                    raise CheckpointError(
                        f"{self.loc.path}: chunk {slot.cell} of {display_path(item.leaves[slot.leaf].path, item.name)!r} "
                        f"has {n} bytes, planned {slot.nbytes}"
                    )
                if n <= SMALL_CHUNK:
                    # A small chunk costs more in a thread hand-off and a write of its own than in
                    # its bytes: checksum it here, and write it together with its neighbours.
                    crcs.append(block_crcs(mv, block))
                    if (yield from batch.add(mv)):  # copied now, so the host view is released at once
                        activity.advance()  # storage took more: peers waiting for us see progress
                    del mv
                    continue
                crcs.append([crc_pool.submit(crc32c, mv[o : o + block]) for o in range(0, n, block)])
                yield from batch.add(mv)
                activity.advance()
            yield from batch.rest()

        key = self.data_key(item, k)
        # (incremental: a file of references only is not written at all, `write_if_any`)
        write = self.loc.storage.write if self.inc is None else functools.partial(write_if_any, self.loc.storage.write)
        size = self.transfers.transfer(write, key, parts())  # timed for `_measure`
        out = key, size, [(c,) if type(c) is int else tuple(x if type(x) is int else x.result() for x in c)
                          for c in crcs], moved, stored
        for buf in self.pooled.pop((item.name, k), ()):  # written and checksummed: the buffers serve the next save
            _snapshot_pool.give(buf)
        return out

    def write_data(self) -> dict[str, Any]:
        """Write this process's data files; returns its partial index per item."""
        t0 = time.perf_counter()
        partial: dict[str, Any] = {}
        jobs: list[tuple[SaveItem, int, Any]] = []
        self._choosing = None
        self._pipe = host_pipeline(self)  # before the codec choosing, which looks at its first transfers
        if self.compression is not None:
            try:
                self.codecs, self._choosing = choose_codecs(self, background=CHOOSE_IN_BACKGROUND and self.inc is None)
            except BaseException:
                self._close_pipe()
                raise
        if self.inc is not None:  # incremental: the base's indexes and the records of our chunks
            self.inc.open(self.items, self.loc.path)
        # Compressed blocks are encoded by a pool of their own, so that a file of large chunks uses
        # every core (a file's writer thread alone would code its blocks one after another).
        coders = _cores() if self.compression is not None else 0
        if self.inc is not None:  # incremental: blocks are hashed on that pool too
            coders = max(2, _cores())
        # An incremental save's writers mostly wait for hashes: one per file (up to 2x `threads`: each holds
        # a window of coded runs), so that a file of changed leaves is written (and fsync'd) while files of
        # unchanged ones are still hashed.
        files = sum(len(it.files) for it in self.items)
        writers = self.threads if self.inc is None else max(self.threads, min(files, 2 * self.threads))
        # (incremental: the base files its deltas read are closed once the pools are done)
        base_files = self.inc.base_files() if self.inc is not None else contextlib.nullcontext()
        with base_files, ThreadPoolExecutor(max(1, writers), thread_name_prefix="cairn-write") as pool, \
                ThreadPoolExecutor(2, thread_name_prefix="cairn-crc") as crc_pool, \
                CodePool(coders) as code_pool:
            # Files start in turn across checkpointables (each one's first file, then each one's second...):
            # an incremental save's files of unchanged leaves only hash, and must not hold every writer
            # while another checkpointable's changed leaves wait
            # (docs/incremental.md). The coder pool serves files in that order too (`order`: a file's rank).
            for item, k in _files_in_turn(self.items):
                jobs.append((item, k, pool.submit(self._write_file, item, k, item.files[k], crc_pool,
                                                  code_pool if coders > 1 else None, len(jobs))))
            try:
                results = [(item, k, f.result()) for item, k, f in jobs]
            finally:
                try:
                    if self._choosing is not None:
                        self._choosing.close()
                finally:
                    self._close_pipe()
        self.stats.compression = describe_compression(self.compression, self.loc.storage, self.codecs,
                                                      self.priced())
        for item in self.items:
            partial[item.name] = {"files": [], "chunks": [], "stored": {}}
        for item, k, (key, size, chunks, moved, stored) in results:
            p = partial[item.name]
            if not size and self.inc is not None:  # not written: its chunks' records name file 0 (FORMAT.md §6.5)
                p["chunks"].extend((slot.leaf, slot.cell, 0, 0, *crc) for slot, crc in zip(item.files[k], chunks))
                for j, sizes in stored.items():
                    slot = item.files[k][j]
                    p["stored"][(slot.leaf, slot.cell)] = sizes
                continue
            file_no = len(p["files"])
            p["files"].append({"name": key.rsplit("/", 1)[1], "size": size})
            # Tuples of ints: the collector stops tracking them (lists it would track to the end).
            p["chunks"].extend((slot.leaf, slot.cell, file_no, moved.get(j, slot.offset), *crc)
                               for j, (slot, crc) in enumerate(zip(item.files[k], chunks)))
            for j, sizes in stored.items():
                slot = item.files[k][j]
                p["stored"][(slot.leaf, slot.cell)] = sizes
            self.stats.bytes_written += size
            self.stats.files_written += 1
        # Drop host copies and device references as soon as they are written.
        for item in self.items:
            item.sources.clear()
        self.stats.write_s = time.perf_counter() - t0
        self._measure()
        return partial

    def _close_pipe(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None

    def priced(self) -> dict[str, Any]:
        """What "auto" prices this save's leaves with (`prices`, else this process's `auto_prices`)."""
        return self.prices or auto_prices(self.loc.storage)

    def _timed_code_task(self, task: list[tuple[int, bool, tuple[Any, ...]]]
                         ) -> list[tuple[int, bool, list[Any], list[int], list[Any]]]:
        """`_code_task`, its span and raw bytes per codec noted for the codec factor (`_measure`); its blocks'
        CRCs and places (`_checked`)."""
        t0 = time.perf_counter()
        out = _code_task(task, _coded_alloc())
        t1 = time.perf_counter()
        with self._code_lock:
            self.code_spans.append((t0, t1))
            for _, _, (codec, raw, _, _) in task:
                self.coded[codec] = self.coded.get(codec, 0) + len(raw)
        return _checked(out)  # (outside the codec's span: the codec factor times coding only)

    def _measure(self) -> None:
        """Record what this save's data writes reached over the storage's link (bytes over the
        time the link was busy, not waiting for the codec: `_storage.measured`) and how fast its
        codecs ran (`options.CodecMeter`), for the next saves' "auto". A measurement never fails a save."""
        try:
            link_s, wall_s = self.transfers.seconds()
            record(self.loc.storage, "write", sample_of(self.stats.bytes_written, link_s, wall_s,
                                                        coded=bool(self.coded), codec=main_codec(self.coded)))
            CODEC_METER.record(self.code_spans, self.coded, _cores())
        except Exception:
            log.warning("cairn: could not record the save's bandwidth for compression='auto'", exc_info=True)

    # ------------------------------------------------------------------ commit

    def run(self) -> SaveStats:
        """Phase 2: write, exchange status, commit on the primary; raise on any failure."""
        activity.begin(f"saving {self.loc.path}")
        try:
            return self._run()
        finally:
            activity.end()

    def _run(self) -> SaveStats:
        t_start = time.perf_counter()
        retries_before = self.loc.storage.retries
        coord, me = self.coord, self.coord.process_index
        base = f"cairn/save/{self.seq}"
        status: dict[str, Any] = {"ok": True}
        own_error: BaseException | None = None
        try:
            status["items"] = self._write_parts(self.write_data())
        except BaseException as e:
            own_error = e
            status = {"ok": False, "error": error_record(e, me)}
        t_written = time.perf_counter()
        try:
            outcome = settle(coord, f"{base}/status", status, self.timeout, finish=self._commit,
                             abort=lambda: self.strategy.abort(self.loc, self.token),
                             forget=f"cairn/save/{self.seq - 1}" if self.seq > 0 else None)
        except CoordinationError as e:
            if own_error is not None:
                raise own_error from e
            raise type(e)(f"saving {self.loc.path}: {e}") from e
        self.stats.commit_s = time.perf_counter() - t_written
        self.stats.retries = self.loc.storage.retries - retries_before
        self.stats.total_s = self.stats.blocking_s + time.perf_counter() - t_start
        if outcome.get("ok"):
            return self.stats
        error = error_from_record(outcome["error"], f"saving {self.loc.path} failed: {outcome['message']}")
        if own_error is not None:
            raise error from own_error
        raise error

    def _write_parts(self, partial: dict[str, Any]) -> dict[str, Any]:
        """Write this process's binary index part of each item; what the primary needs to know of them."""
        out: dict[str, Any] = {}
        me = self.coord.process_index
        puts: list[tuple[str, bytes]] = []
        for item in self.items:
            p = partial[item.name]
            mine: dict[str, Any] = {"files": [[f["name"], f["size"]] for f in p["files"]]}
            inc = self.inc
            if inc is not None:  # incremental: the base files the part refers to, after its own
                mine["ext"] = [list(x) for x in inc.ext_files(item.name)]
                mine["refs"] = inc.leaves_with_refs(item.name)
            part = build_part(item, me, self.token, p["chunks"], self.loc.path,
                              p["stored"] if self.compression is not None or inc is not None else None,
                              self.block_size,
                              inc.columns(item, len(p["files"])) if inc is not None else None)
            if self.compression is not None:  # the codecs of the leaves whose first cell this process wrote
                mine["codecs"] = {str(i): c for i, c in self.codecs.get(item.name, {}).items()
                                  if item.layouts[i].writer[0] == me and c != "none"}
            newer = self.newer_blocks(item)
            if newer:  # the manifest then says version 5 or 6 (`manifest_version`)
                mine["newer"] = newer
            if part is not None:
                name, data, records, crcs = part
                puts.append((f"{self.write_root}/{item.dir}/{name}", data))
                mine["part"] = [name, records, crcs]
            out[item.name] = mine
        # One durable put per checkpointable's part, all at once: on an object store each is a round trip.
        # The primary's go with its indexes in the commit (`_commit`), one round trip for both.
        if me == 0:
            self.own_parts = puts
        else:
            self.strategy.put_all(puts, "cairn-part")
        return out

    def _commit(self, statuses: dict[int, dict[str, Any]]) -> None:
        root = self.write_root
        items: dict[str, fmt.ItemInfo] = {}
        needed: list[str] = []
        n = self.coord.process_count

        with paused():
            indexes = [item_index(item, statuses, n, self.block_size) for item in self.items]
            puts = [(f"{root}/{item.dir}/{fmt.index_name(self.token)}", index.to_json(self.version))
                    for item, index in zip(self.items, indexes)]
        # Each checkpointable's index and each part of the primary's own (`_write_parts`) written durably
        # (`put_all`: one request each on an object store; on a local disk each file fsync'd, then each
        # folder once), all at once: the indexes need only what the parts' records were (in the statuses),
        # not the parts in place, so a single process's commit waits one round trip for both, not two. A
        # failed write fails the commit before its listing: nothing is visible.
        self.strategy.put_all([*self.own_parts, *puts], "cairn-index")
        for item, index in zip(self.items, indexes):
            nbytes = sum(leaf.nbytes for leaf in index.leaves if isinstance(leaf, fmt.ArrayLeaf))
            items[item.name] = fmt.ItemInfo(item.dir, fmt.index_name(self.token), nbytes, len(index.leaves))
            needed += [f"{root}/{item.dir}/{f}" for f in
                       (fmt.index_name(self.token), *(x.name for x in index.files if x.base is None),
                        *(x.name for x in index.parts))]
        bases = sorted({x.base for index in indexes for x in index.files if x.base is not None})  # incremental
        manifest = fmt.Manifest(
            items=items, root=self.root, process_count=self.coord.process_count, cairn_version=__version__,
            created_unix=time.time(), metadata=self.metadata, bases=tuple(bases),
        ).to_json(self.manifest_version(statuses))
        self.strategy.commit(self.loc, self.token, manifest, needed, overwrite=self.overwrite)
        if self.inc is not None and n == 1:  # committed: the next incremental save may build on it (`basecache`)
            basecache.remember(self.loc, manifest, {k[len(root) + 1 :]: v for k, v in (*self.own_parts, *puts)})


def _files_in_turn(items: list[SaveItem]) -> list[tuple[SaveItem, int]]:
    """The data files of a save in the order its writers start them: each checkpointable's first file,
    then each one's second... (`write_data`; the codec choosing and the host-copy pipeline follow it)."""
    most = max((len(item.files) for item in items), default=0)
    return [(item, k) for k in range(most) for item in items if k < len(item.files)]


#: Bytes of device chunks a blocking save's host-copy pipeline may have started ahead of its writers
#: (`host_pipeline`; at most `KEEP_HOST_SHARE` of the host's memory). 0: no pipeline, each chunk
#: copied to host by its writer (or the codec choosing) when it comes to it.
HOST_PIPELINE_BYTES = 1 << 30


def host_pipeline(job: SaveJob) -> Any:
    """A `snapshot.HostPipeline` for the accelerator chunks `job` writes, in the order its writers take
    them (`_files_in_turn`, each file's slots in order), started up to its budget; None where there
    are none to copy (a save_async's snapshot made them host arrays already, or a numpy state), where
    the save is incremental (its writers hash as they go), or where a save_async's snapshot budget left
    chunks on device (host memory must stay within that budget: its writers copy one at a time)."""
    budget = min(HOST_PIPELINE_BYTES, _keep_host_bytes())
    if budget <= 0 or job.inc is not None or job.stats.device_copy_bytes:
        return None
    from .snapshot import HostPipeline

    keys: list[tuple[str, tuple[int, int]]] = []
    sizes: list[int] = []
    srcs: list[Any] = []
    for item, k in _files_in_turn(job.items):
        for slot in item.files[k]:
            key = (slot.leaf, slot.cell)
            src = item.sources.get(key)
            if src is None or type(src) is np.ndarray or type(src) is Concat or not _fresh_copy(src):
                continue
            keys.append((item.name, key))
            sizes.append(slot.nbytes)
            srcs.append(src)
    if not keys:
        return None
    # The snapshot's own on-device copies go to host by the fastest way, freed as they arrive.
    own = job.stats.device_snapshot_bytes > 0
    pipe = HostPipeline(keys, sizes, srcs, budget, start=_own_to_host if own else None)
    pipe.fill()
    return pipe


def _own_to_host(arrays: list[Any]) -> list[Any]:
    from .._tree.shardings import start_to_host

    return start_to_host(arrays, "own")


#: A single process's compressed save measures its leaves' codecs while its first files are written
#: (`_Choosing`); False: all of them before any file (benchmarks compare both).
CHOOSE_IN_BACKGROUND = True

#: Blocks per coding task of a compressed save: a large chunk is coded in runs of this many blocks,
#: small chunks together up to as many bytes (`_code_task`). Measured on the TPU host's 13 cores
#: (docs/compression.md, "On many cores"): 16 MiB a task keeps a task's GIL-holding steps (Python, the
#: join of its stored blocks) a small share of its GIL-free ones, while a chunk of 64 MiB still
#: spreads over 4 coders.
RUN_BLOCKS = 16
#: Coding tasks code into buffers lent from `buffers.coded_pool` (False: a new buffer per task;
#: docs/compression.md, "On many cores").
LEND_CODED_BUFFERS = True


def _cores() -> int:
    """The cores this process may run on: a compressed save codes on all of them (the writer threads,
    `threads`, bound how many files are written at once, not how many cores code)."""
    return usable_cores()


def _coded_alloc() -> Any:
    """Where coding tasks' stored blocks go (`codecs.encode_runs`' `alloc`): buffers lent from the process's
    `buffers.coded_pool`, each taken back once its blocks are written, so that a later task (of this save
    or the next) codes into pages already mapped; None (a new buffer per task) without
    `LEND_CODED_BUFFERS`."""
    return _buffers.coded_pool.lend if LEND_CODED_BUFFERS else None


def _code_task(task: list[tuple[int, bool, tuple[Any, ...]]], alloc: Any = None) -> list[tuple[int, bool, list[Any]]]:
    """Code one task of `code_tasks`: (slot, last run of the slot, run) -> (slot, last, stored blocks), into
    buffers from `alloc` (`codecs.encode_runs`)."""
    coded = _codecs.encode_runs([run for _, _, run in task], coders=_cores(), alloc=alloc)
    return [(n_slot, last, blocks) for (n_slot, last, _), blocks in zip(task, coded)]


def _checked(coded: list[tuple[int, bool, list[Any]]]) -> list[tuple[int, bool, list[Any], list[int], list[Any]]]:
    """A coded task's blocks with each one's CRC-32C (its check record) and place (`_places`), found on
    the coder's thread: the writer of a file then only writes, and next-door blocks go to it as one
    view (on the TPU host the writers fell behind the coders with 2,449 small leaves: a CRC call and a
    write call a block, each taking the GIL back from 13 coders; docs/compression.md)."""
    return [(n_slot, last, blocks, [crc32c(b) for b in blocks], _places(blocks)) for n_slot, last, blocks in coded]


class CodePool:
    """The coder threads of one save, taking the most urgent queued task first: the lowest
    ``priority`` (a save gives each data file its number), then the oldest.

    A `ThreadPoolExecutor` takes tasks first come, first served, so the files written at once were
    coded in lockstep and all reached their final fsync together, after the last block was coded:
    a compressed save cost the coding plus the flush of every file. Served by file, the first files
    are coded (and written) first and flush to disk while the later ones are coded: coding and
    the disk's flush overlap, and only the last file's flush is left after the coding
    (docs/compression.md, "Where it runs"). Each file still has at most a window of
    tasks queued (`_in_order`), so memory stays as bounded as before; tasks of other files fill
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


def _in_order(pool: Any, fn: Any, tasks: Any, priority: Any = None) -> Any:
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


def _encoded(pool: ThreadPoolExecutor | None, codec: str, raw: memoryview, block: int, dtype: Any) -> Any:
    """The stored forms of `raw`'s blocks, in order, each with its CRC-32C, coded in runs of `RUN_BLOCKS` on
    `pool` (see `_in_order`). (The stream writer's coding: recompressing copies. Its runs are coded as a
    save's tasks are, `_code_task`: with as many coders as code at once, so that python-blosc2's "blosc2"
    chunks are gathered into shared buffers from `BLOSC2_JOIN_MIN_CODERS` on (C-Blosc2 called directly
    codes a run into one buffer anyway); and the CRCs found on the coder's thread, as `_checked` finds a
    save's, not on the writer's; into buffers lent as a save's are, `LEND_CODED_BUFFERS`.)"""
    run = block * RUN_BLOCKS
    alloc = _coded_alloc()

    def code(o: int) -> list[tuple[Any, int]]:
        blocks = _codecs.encode_runs([(codec, raw[o : o + run], block, dtype)], coders=coders, alloc=alloc)[0]
        return [(b, crc32c(b)) for b in blocks]

    on = pool if len(raw) > run else None
    coders = getattr(on, "_max_workers", 1) if on is not None else 1
    for blocks in _in_order(on, code, range(0, len(raw), run)):
        yield from blocks


def resolve_compression(compression: str | bool | None, storage: Any) -> str | None:
    """What a save's `compression=` means: None (blocks stored raw), "choose" (a codec per leaf),
    "auto" (a codec per leaf where it pays), "fast" ("choose" with the C-Blosc2 codecs among the
    candidates: `decide_leaf`), or one codec.

    "auto" (the default) decides by predicted time (`options.compression_pays`): the codecs'
    speed on this platform's cores (scaled by what earlier saves measured, `options.CodecMeter`)
    against the storage's bandwidth each way (declared, measured on earlier transfers, or its
    kind's default: `_storage.base.bandwidth_of`). Where no leaf could pay, not even one
    that codes to nothing (`options.compression_can_pay`: a local disk, faster than the codecs),
    None; else "auto", and each leaf is coded only if its sample's ratio pays
    (`leaf_codec`). True chooses per leaf by size alone; both pick only "zstd" and "planes", which
    every install reads. "fast" and the C-Blosc2 codecs need python-blosc2 (a ValueError naming the
    extra where it is missing). False, None and "none" store raw bytes.
    In a save, the primary's answer holds for every process.
    """
    if compression == "auto":
        p = auto_prices(storage)
        return "auto" if compression_can_pay(p["bandwidth"], _cores(), **_formula_args(p)) else None
    if compression is True:
        return "choose"
    if compression == "fast":
        if not _codecs.blosc2_available():
            raise ValueError(f"compression='fast' needs python-blosc2, which is not installed: "
                             f"pip install '{_codecs.BLOSC2_EXTRA}'")
        return "fast"
    if compression in (False, None, "none"):
        return None
    if compression in ("zstd", "planes"):
        return str(compression)
    if compression in _codecs.BLOSC2_CODECS:
        if not _codecs.blosc2_available():
            raise ValueError(f"compression={compression!r} needs python-blosc2, which is not installed: "
                             f"pip install '{_codecs.BLOSC2_EXTRA}'")
        return str(compression)
    raise bad_compression(compression)


#: The codec "auto" weighs against the leaf's codec by predicted time: it stores more and codes faster.
FAST_CODEC = "blosc2-lz4"


@dataclass(frozen=True)
class LeafDecision:
    """What `compression=` decides for one leaf, from a sample of its bytes, and why."""

    codec: str  # what the leaf is stored with ("none": raw)
    chosen: str  # `codecs.choose_sized`'s codec for the sample ("none": no codec shrinks it enough)
    raw: int  # the sample's raw bytes
    stored: int  # their size under `chosen`


def decide_leaf(mode: str, dtype: Any, host: Any, bandwidth: float, prices: dict[str, Any] | None = None,
                cores: int | None = None) -> LeafDecision:
    """`leaf_codec`'s decision with its reasons; `cores` (default: this process's) as "auto" counts them.
    The codec is chosen on `sample_bytes` of `host`, with "blosc2" a candidate only where it codes the
    leaf's element size faster than "planes" on those cores (`options.blosc2_faster`); "auto" then
    takes `FAST_CODEC` instead where `options.predicted_seconds` says it saves and loads the leaf
    sooner, and codes the leaf only where that pays (`options.compression_pays`)."""
    n = cores or _cores()
    c_blosc2 = mode == "fast"  # True and "auto" pick only codecs every install reads (no C-Blosc2)
    try:
        sample = _codecs.sample(host, sample_bytes(getattr(host, "nbytes", 0)))
        # "blosc2" is a candidate only where it codes this leaf's elements faster on n cores
        codec, raw, stored = _codecs.choose_sized(dtype, sample,
                                                  blosc2=c_blosc2 and blosc2_faster(n, np.dtype(dtype).itemsize))
        args = _formula_args(prices or {}, codec)
        if c_blosc2 and codec != "none" and FAST_CODEC in usable_codecs():
            # the faster C-Blosc2 codec, where it is predicted to save and load the leaf sooner, its
            # 3-10% more bytes and all (a fast link, many cores), each priced with its own coded figures
            fast, fast_args = _codecs.stored_size(FAST_CODEC, dtype, sample), _formula_args(prices or {}, FAST_CODEC)
            if (predicted_seconds(raw, fast, FAST_CODEC, bandwidth, n, **fast_args)[1]
                    < predicted_seconds(raw, stored, codec, bandwidth, n, **args)[1]):
                codec, stored, args = FAST_CODEC, fast, fast_args
    except ValueError:  # a dtype no codec knows
        return LeafDecision("none", "none", 0, 0)
    if mode == "auto" and not compression_pays(raw, stored, codec, bandwidth, n, **args):
        return LeafDecision("none", codec, raw, stored)
    return LeafDecision(codec, codec, raw, stored)


#: A leaf's sample is at most 1 / SAMPLE_SHARE of its first chunk (`sample_bytes`), so that choosing
#: codes a fraction of a state of small leaves, not all of it three times over (a leaf under
#: `codecs.SAMPLE_BYTES` was sampled whole: 2,449 leaves of 256x256 spent more time choosing than
#: coding).
SAMPLE_SHARE = 4
#: ... and at least this many bytes (or the whole chunk, if smaller).
SAMPLE_MIN_BYTES = 16 << 10


def sample_bytes(nbytes: int) -> int:
    """How many bytes of a leaf's first chunk of `nbytes` bytes its codec is chosen on."""
    return min(_codecs.SAMPLE_BYTES, max(SAMPLE_MIN_BYTES, nbytes // SAMPLE_SHARE))


def _formula_args(prices: dict[str, Any], codec: str | None = None) -> dict[str, Any]:
    """`auto_prices`' figures as `options.predicted_seconds`' optional arguments (the codec factor:
    this host's measured one where `prices` has none), with `codec`'s own coded figures where it has
    them."""
    f = prices.get("codec_factor")
    own = (prices.get("coded_by_codec") or {}).get(codec) if codec is not None else None
    cw, cr = own if own else (prices.get("coded_bandwidth"), prices.get("coded_read_bandwidth"))
    return {"read_bandwidth": prices.get("read_bandwidth") or None,
            "coded_bandwidth": cw or None, "coded_read_bandwidth": cr or None,
            "factor": CODEC_METER.factor() if f is None else f}


def leaf_codec(mode: str, dtype: Any, host: Any, bandwidth: float, prices: dict[str, Any] | None = None) -> str:
    """The codec of a leaf under `mode` ("choose", "auto" or "fast", as `resolve_compression` gives), measured
    on a sample of `host` (its first chunk's host bytes): `codecs.choose`'s codec, which "auto" keeps
    only where its sample's ratio pays writing raw at `bandwidth` bytes/s, against the rest of
    `prices` (`auto_prices`: reads, coded transfers, the codec factor; by default the same bandwidth
    each way and this host's measured codec factor): `options.compression_pays`. (`decide_leaf`
    gives the reasons too.)"""
    return decide_leaf(mode, dtype, host, bandwidth, prices).codec


def describe_compression(mode: str | None, storage: Any, codecs: dict[str, dict[int, str]],
                         prices: dict[str, Any]) -> str:
    """One line for `SaveStats.compression`: the setting, what it priced (`describe_prices`), the
    leaves' codecs. E.g. ``auto (object storage at 0.50 GiB/s (default), 13 cores): 1 none, 120 planes``."""
    if mode is None:
        return "raw"
    counts: dict[str, int] = {}
    for per_item in codecs.values():
        for c in per_item.values():
            counts[c] = counts.get(c, 0) + 1
    leaves = ", ".join(f"{n} {c}" for c, n in sorted(counts.items()))
    if mode != "auto":
        return f"{mode}: {leaves}"
    return f"auto ({describe_prices(storage.kind, prices, _cores())}): {leaves}"


def describe_prices(kind: str, prices: dict[str, Any], cores: int) -> str:
    """What "auto" priced, in words: ``object storage at 0.50 GiB/s (default), 13 cores``, or
    ``object storage at 0.14 GiB/s write, 0.74 read, coded 0.09 / 0.31 (measured), 2 cores, codecs
    at 0.74x`` (raw writes and reads; coded ones, end to end; the codec factor)."""
    gib = float(1 << 30)
    w = prices["bandwidth"]
    r = prices.get("read_bandwidth") or w
    cw = prices.get("coded_bandwidth") or w
    cr = prices.get("coded_read_bandwidth") or r
    text = f"{kind} storage at {w / gib:.2f} GiB/s"
    if abs(r - w) > 0.005 * gib:
        text += f" write, {r / gib:.2f} read"
    if abs(cw - w) > 0.005 * gib or abs(cr - r) > 0.005 * gib:
        text += f", coded {cw / gib:.2f} / {cr / gib:.2f}"
    source = prices.get("bandwidth_source")
    text += f" ({source})" if source else ""
    text += f", {cores} cores"
    factor = prices.get("codec_factor", 1.0)
    if abs(factor - 1.0) > 0.005:
        text += f", codecs at {factor:.2f}x"
    return text


def choose_codecs(job: SaveJob, background: bool = False) -> tuple[dict[str, dict[int, str]], _Choosing | None]:
    """The codec of each array leaf this process writes a chunk of, alike on every process.

    A fixed codec applies to every leaf. With "choose", the writer of a leaf's
    first cell measures `codecs.choose` on a sample of that chunk's host bytes;
    with several processes, the others learn its choice through the coordinator
    (a background step, with the save's timeout), before any of them writes.

    With `background` and a single process, the leaves are measured on a pool of their own in the
    order of the files that hold them, and a `_Choosing` is returned with the (still filling)
    codecs: a file's writer waits only for its own leaves (`_Choosing.wait`), so the first files
    are coded and written while later leaves are still measured (and, from a device, copied to
    host). Else (None) every codec is known on return.
    """
    from .._tree.leaves import ArraySource
    from .incremental import UNCHANGED

    coord, me = job.coord, job.coord.process_index
    fixed = job.compression
    assert fixed is not None, "leaf codecs are chosen only for a compressed save"
    out: dict[str, dict[int, str]] = {}
    need: dict[int, list[tuple[str, int]]] = {}  # owner -> (item, leaf) this process writes and does not own
    todo: list[tuple[dict[int, str], int, Any, Any, SaveItem]] = []  # leaves this process measures
    for item in job.items:
        mine = out[item.name] = {}
        written = {leaf for leaf, _cell in item.sources}
        for i, layout in item.layouts.items():
            src = item.leaves[i]
            if not isinstance(src, ArraySource):
                continue
            owner = layout.writer[0]
            if fixed not in CHOOSING:
                mine[i] = fixed if i in written or owner == me else "none"
            elif owner == me:
                first = item.sources.get((i, 0))
                if first is not None and first is not UNCHANGED:  # (never read by an async incremental save)
                    mine[i] = "none"
                    todo.append((mine, i, first, src.dtype, item))
                else:
                    mine[i] = "none"
            elif i in written:
                need.setdefault(owner, []).append((item.name, i))
    # (No kept host copies where a save_async's snapshot budget left chunks on device: its writers bring
    # them to host one at a time, and host memory must stay within that budget.)
    keep = 0 if job.stats.device_copy_bytes else _keep_host_bytes()
    if todo:  # each owned leaf measured on a sample, on every core (a state may have thousands)
        choosing = _Choosing(job, todo, keep)
        if background and coord.process_count == 1:
            return out, choosing
        choosing.close()  # every codec known before any file is written
    if job.compression in CHOOSING and coord.process_count > 1:
        base = f"cairn/save/{job.seq}/codecs"
        coord.publish(f"{base}/{me}", json.dumps({name: {str(i): c for i, c in m.items()}
                                                  for name, m in out.items()}).encode())
        for owner, wanted in need.items():
            theirs = json.loads(fetch_from(coord, f"{base}/{owner}", job.timeout, writer=owner))
            for name, i in wanted:
                out[name][i] = theirs.get(name, {}).get(str(i), "none")
    return out, None


class _Choosing:
    """The codecs of this process's leaves, measured on a pool of their own (`close` waits for all; with
    `choose_codecs`' `background`, a single process's files are written meanwhile): leaves in the order
    of the first file holding them, each leaf released to its writers (`wait`) once it has its codec.
    Small leaves are measured in groups (`_groups`): one decision for a run of leaves alike. A
    failure is raised to every writer waiting. The host copy a leaf was measured on replaces its
    device chunk among the save's sources within `keep` bytes (as `choose_codecs` does), before the
    leaf is released, so its writer never copies that chunk again; where the save's host-copy
    pipeline (`SaveJob._pipe`) had started that chunk's transfer, the leaf is measured on it and
    the writer takes the same transfer."""

    def __init__(self, job: SaveJob, todo: list[tuple[dict[int, str], int, Any, Any, SaveItem]], keep: int):
        self._job, self._keep = job, keep
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._ready = {(t[4].name, t[1]): threading.Event() for t in todo}
        first_file: dict[tuple[str, int], int] = {}  # (item, leaf) -> rank of the first file holding a chunk
        ranked = _files_in_turn(job.items)
        for rank, (item, k) in enumerate(ranked):
            for s in item.files[k]:
                first_file.setdefault((item.name, s.leaf), rank)
        todo = sorted(todo, key=lambda t: first_file.get((t[4].name, t[1]), len(ranked)))
        groups = _groups(todo)
        self._pool = ThreadPoolExecutor(min(_cores(), len(groups)), thread_name_prefix="cairn-choose")
        self._futures = [self._pool.submit(self._measure, g) for g in groups]

    def _measure(self, group: list[tuple[dict[int, str], int, Any, Any, SaveItem]]) -> None:
        if self._error is not None:
            return
        job, pipe = self._job, self._job._pipe
        try:
            # The members sampled (all of a group of one); a started transfer where the pipeline has one.
            picks = _picked(len(group))
            firsts, peeked = [], []
            for n in picks:
                _, i, first, _, item = group[n]
                got = pipe.peek((item.name, (i, 0))) if pipe is not None and (item.name, (i, 0)) in pipe else None
                firsts.append(first if got is None else got)
                peeked.append(got is not None)
            dtype = group[0][3]
            if len(group) == 1:
                codec, host = _choose_leaf(job, firsts[0], dtype)
                hosts = [host]
            else:
                codec, hosts = _choose_group(job, firsts, dtype)
        except BaseException as e:  # every waiting writer raises it
            with self._lock:
                self._error = self._error or e
                for ev in self._ready.values():
                    ev.set()
            return
        with self._lock:
            for mine, i, _, _, _ in group:
                mine[i] = codec
            # The host copy a sample was taken from (a device chunk's, made for this) serves the writer
            # too: a device chunk is not copied to host twice (held within `keep` bytes until written).
            for n, host, was_peeked in zip(picks, hosts, peeked):
                _, i, _, _, item = group[n]
                if host is not None and not was_peeked and host.nbytes <= self._keep:
                    item.sources[(i, 0)] = host
                    self._keep -= host.nbytes
            for _, i, _, _, item in group:
                self._ready[(item.name, i)].set()

    def ready(self, item: str, leaf: int) -> bool:
        """Whether leaf `leaf` of `item` has its codec (or measuring failed: `wait` raises)."""
        ev = self._ready.get((item, leaf))
        return ev is None or ev.is_set()

    def wait(self, item: str, leaf: int) -> None:
        """Return once leaf `leaf` of `item` has its codec (at once for a leaf not measured here); raise
        what measuring raised."""
        ev = self._ready.get((item, leaf))
        if ev is not None:
            ev.wait()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Wait for the measuring pool (every leaf measured, or the save failed)."""
        self._pool.shutdown(wait=True)
        if self._error is not None:
            raise self._error


#: Small leaves are measured in groups (`_groups`): a run of consecutive leaves (in the order of the
#: files holding them, so mostly of one array, or one kind of leaf, of the pytree) whose first chunks
#: hold at most GROUP_MAX_BYTES, of one dtype and one size class (the same power of two), up to
#: GROUP_LEAVES of them. One decision serves the whole group, measured on GROUP_SAMPLES of its leaves
#: spread over it (`_choose_group`). Measured one by one, 2,449 leaves of 256x256 spent ~1.1 ms each on
#: the TPU host choosing (three encoders each, python-blosc2's fixed ~0.18 ms a call): more than coding
#: them. 1: every leaf measured on its own.
GROUP_MAX_BYTES = 1 << 20
GROUP_LEAVES = 64
GROUP_SAMPLES = 4


def _groups(todo: list[Any]) -> list[list[Any]]:
    """`todo` (`_Choosing`'s leaves, in order) cut into the groups measured together: runs of small leaves
    alike (`GROUP_MAX_BYTES`), each other leaf alone."""
    out: list[list[Any]] = []
    run_key: Any = None
    for t in todo:
        n = _first_bytes(t[2])
        key = (np.dtype(t[3]), n.bit_length()) if GROUP_LEAVES > 1 and 0 < n <= GROUP_MAX_BYTES else None
        if key is not None and key == run_key and len(out[-1]) < GROUP_LEAVES:
            out[-1].append(t)
        else:
            out.append([t])
        run_key = key
    return out


def _first_bytes(first: Any) -> int:
    try:
        return sum(int(p.nbytes) for p in first.parts) if type(first) is Concat else int(first.nbytes)
    except (AttributeError, TypeError):
        return 0


def _picked(n: int) -> list[int]:
    """Which of a group's `n` leaves are sampled: GROUP_SAMPLES of them spread evenly, first and last included."""
    m = min(n, max(1, GROUP_SAMPLES))
    return sorted({round(j * (n - 1) / max(1, m - 1)) for j in range(m)})


def _choose_group(job: SaveJob, firsts: list[Any], dtype: Any) -> tuple[str, list[np.ndarray | None]]:
    """The codec of a group of small leaves (`_groups`), decided once as `_choose_leaf` decides one leaf's,
    on the first chunks `firsts` of its sampled leaves laid end to end (`decide_leaf` then samples that
    run in pieces spread over it, so over the sampled leaves); the host copies made, as `_choose_leaf`'s."""
    sampled = [_sample_host(job, first) for first in firsts]
    assert job.compression is not None
    prices = job.priced()
    joined = np.concatenate([np.ascontiguousarray(h).reshape(-1) for h, _ in sampled])
    return leaf_codec(job.compression, dtype, joined, prices["bandwidth"], prices), [made for _, made in sampled]


def _choose_leaf(job: SaveJob, first: Any, dtype: Any) -> tuple[str, np.ndarray | None]:
    """The codec of a leaf whose first chunk is `first`, and that chunk's host copy where measuring
    made one (a device chunk's, which the writer can use instead of copying it again), else None."""
    host, made = _sample_host(job, first)
    assert job.compression is not None
    prices = job.priced()
    return leaf_codec(job.compression, dtype, host, prices["bandwidth"], prices), made


def _sample_host(job: SaveJob, first: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """The host bytes a leaf whose first chunk is `first` is measured on (a merged chunk's first
    piece), and that host copy again where it is a fresh copy of the whole chunk from an accelerator
    (which the writer can use instead of copying the chunk again), else None."""
    whole = type(first) is not Concat
    part = first if whole else first.parts[0]
    host = job._host(part)
    return host, (host if whole and type(part) is not np.ndarray and _fresh_copy(part) else None)


def _fresh_copy(src: Any) -> bool:
    """Whether `SaveJob._host` of `src` copies it from an accelerator (not a view of host memory)."""
    from .._tree.shardings import on_cpu

    try:
        return not on_cpu(src) and getattr(src.sharding, "memory_kind", None) not in ("pinned_host", "unpinned_host")
    except AttributeError:
        return False


#: Host copies made while choosing codecs that a blocking save keeps for its writers: at most this
#: share of the host's physical memory (a save_async's snapshot holds its chunks on host already).
KEEP_HOST_SHARE = 0.25


def _keep_host_bytes() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * KEEP_HOST_SHARE)
    except (ValueError, OSError, AttributeError):
        return 1 << 30


def _bytes_of(arr: np.ndarray) -> memoryview:
    """The C-order bytes of `arr`, without a copy where it is contiguous."""
    try:
        return memoryview(arr).cast("B")  # type: ignore[arg-type]  # the fast path: a contiguous array of a buffer-exporting dtype
    except (TypeError, ValueError):  # not contiguous, or a dtype numpy cannot export (ml_dtypes')
        return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- prepare


#: A save of more checkpointables than this says, once per process, what they cost (`_split_items`).
MANY_CHECKPOINTABLES = 256
_told_many = False


def _split_items(state: Any, where: str = "") -> tuple[bool, list[tuple[str, Any]]]:
    """(root, [(name, tree)]): a non-empty mapping with string keys is saved as named checkpointables,
    one per key, anything else as one root tree (docs/FORMAT.md §1)."""
    from collections.abc import Mapping

    global _told_many
    if isinstance(state, Mapping) and state and all(isinstance(k, str) for k in state):
        if len(state) > MANY_CHECKPOINTABLES and not _told_many:
            _told_many = True
            log.warning(
                "cairn: %s: saving %d checkpointables, one per key of the state's top-level mapping, each its own "
                "folder of up to three files written durably (an index, an index part, a data file). A flat mapping of "
                "many arrays (a state dict) saves and loads several times faster as one checkpointable: nest it "
                "under one key, e.g. {'model': state} (docs/PERFORMANCE.md, \"Thousands of checkpointables\"). "
                "Said once per process.", where or "a save", len(state))
        return False, list(state.items())
    return True, [("", state)]


def prepare(
    loc: Location,
    state: Any,
    options: SaveOptions | None = None,
    *,
    block_size: int = fmt.DEFAULT_BLOCK_SIZE,
    min_file_bytes: int = 32 << 20,
    metadata: dict[str, Any] | None = None,
    base: Any = None,
    hashes: bool = False,
    base_required: bool = True,
    **changes: Any,
) -> SaveJob:
    """Validate `state`, plan this process's chunks and agree on an attempt token.

    `options` with keyword `changes` to them (`SaveOptions`' names) say how to
    save; `block_size` and `min_file_bytes` are the format's knobs, for tests.
    `base` (a sibling checkpoint's path or `Location`) or `hashes` make the save
    incremental (format version 4, `incremental`); with `base_required` False a
    base that is not committed when the save runs gives a self-contained save.
    """
    t0 = time.perf_counter()
    opts = save_options_of(options, changes)
    _buffers.load_pool.clear()  # kept for a process's next load; a saving process needs the memory (as `cairn.load`)
    overwrite, threads, split_replicas, timeout = opts.overwrite, opts.threads, opts.split_replicas, opts.timeout
    coord = opts.coordinator or default_coordinator()
    me = coord.process_index
    if not fmt.MIN_BLOCK <= block_size <= fmt.MAX_BLOCK:
        raise ValueError(f"block_size must be in [{fmt.MIN_BLOCK}, {fmt.MAX_BLOCK}], got {block_size}")
    if metadata is not None:
        try:
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise UnsupportedTypeError(f"{loc.path}: metadata must be JSON-serializable ({e})") from None
    root, pairs = _split_items(state, loc.path)
    items = []
    seq = sequence("save")
    hosts = HostValues(coord, seq, loc.path)  # per-process values; the check that other host values agree
    with paused(), hosts.reporting():  # thousands of leaves make tens of thousands of live objects, none garbage
        for name, tree in pairs:
            where = loc.path
            try:
                structure, flat = flatten(tree, item=name, is_leaf=is_per_process)
            except ValueError as e:
                raise UnsupportedTypeError(f"{where}: {e}") from None
            structure, flat = hosts.split(name, structure, flat)
            leaves = [classify(path, x, where, name) for path, x in flat]
            item = SaveItem(name, fmt.ROOT_ITEM_DIR if root else fmt.item_dirname(name), structure, leaves)
            plan_item(item, me, split_replicas, threads, min_file_bytes, where)
            hosts.add(item)
            items.append(item)
    strategy = strategy_for(loc.storage)
    compression = resolve_compression(opts.compression, loc.storage)
    token, compression, prices = _agree_token(loc, strategy, coord, seq, overwrite, timeout, hosts, compression)
    for item in items:
        if item.name in hosts.own:  # its per-process leaves have their numbers now
            plan_item(item, me, split_replicas, threads, min_file_bytes, loc.path)
    job = SaveJob(
        loc=loc, items=items, root=root, token=token, seq=seq, coord=coord, overwrite=overwrite,
        block_size=block_size, timeout=timeout, threads=threads, metadata=metadata or {}, strategy=strategy,
        compression=compression, prices=prices,
    )
    if base is not None or hashes:  # incremental (format version 4)
        from .incremental import setup

        job.inc = setup(loc, base, hashes, base_required)
        if job.inc is not None:
            job.inc.block = block_size
    job.stats.blocking_s = time.perf_counter() - t0
    return job


def auto_prices(storage: Any) -> dict[str, Any]:
    """What "auto" prices leaves with on this process, as `SaveJob`'s fields: the storage's
    bandwidth each way, where it came from, and the codec factor (`options.CodecMeter`)."""
    return {"bandwidth": bandwidth_of(storage), "read_bandwidth": bandwidth_of(storage, "read"),
            "coded_bandwidth": bandwidth_of(storage, "write", coded=True),
            "coded_read_bandwidth": bandwidth_of(storage, "read", coded=True),
            # each codec's own coded figures, write and read (`_storage.measured`: an end-to-end figure of
            # one codec says little of another's)
            "coded_by_codec": {c: [bandwidth_of(storage, "write", True, c), bandwidth_of(storage, "read", True, c)]
                               for c in CODEC_SPEEDS},
            "codec_factor": CODEC_METER.factor(), "bandwidth_source": bandwidth_source(storage)}


def _agree_token(loc: Location, strategy: CommitStrategy, coord: Coordinator, seq: int, overwrite: bool,
                 timeout: float, hosts: HostValues, compression: str | None) -> tuple[str, str | None, dict[str, Any]]:
    """The primary checks the destination and the processes' host values, and picks the attempt token,
    the compression and what "auto" prices leaves with (`auto_prices`: the storage's bandwidth, as
    declared or measured by the primary, and its codec factor; what "auto" means can depend on a
    process's mounts and measurements); all processes learn them."""
    key = f"cairn/save/{seq}/token"
    if coord.process_index == 0:
        msg: dict[str, Any] = {"token": secrets.token_hex(6), "compression": compression,
                               "prices": auto_prices(loc.storage)}
        try:
            strategy.check_destination(loc, overwrite)
            msg.update(hosts.gather(timeout))
        except CheckpointError as e:
            msg = {"error": error_record(e, 0), "message": str(e)}
        coord.publish(key, json.dumps(msg).encode())
    else:
        hosts.publish()
        msg = json.loads(fetch_from(coord, key, timeout, writer=0))
    if "error" in msg:
        raise error_from_record(msg["error"], msg["message"])
    hosts.place(msg)
    return msg["token"], msg.get("compression", compression), msg.get("prices") or auto_prices(loc.storage)
