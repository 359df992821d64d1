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
import functools
import logging
import threading
import time
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from .._core.buffers import snapshot_pool as _snapshot_pool
from .._core.checksum import block_crcs
from .._core.gcpause import paused
from .._core.stats import SaveStats
from .._dist.agree import settle
from .._dist.coord import (
    activity,
)
from .._errors import (
    CheckpointError,
    CoordinationError,
    error_from_record,
    error_record,
)
from .._format import manifest as fmt
from .._plan.chunking import FileSlot
from .._storage.location import Location
from .._storage.measured import TransferClock, main_codec, record, sample_of
from .._tree.leaves import ArraySource
from .._tree.pytree import display_path
from .._version import __version__
from . import codecpolicy as _policy
from . import pipeline
from .assign import Concat, SaveItem, files_in_turn
from .codecpolicy import (
    CODEC_METER,
    auto_prices,
    choose_codecs,
    describe_compression,
)
from .indexparts import build_part, item_index
from .options import SaveOptions
from .plan import SavePlan, plan_save

log = logging.getLogger("cairn")


@dataclass
class SaveJob(SavePlan):
    """A `SavePlan` being executed: the plan's fields, and what the execution fills in."""

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
    def blocks(self) -> Any:
        """This save's block stage: its `incremental.Incremental` (hashes, and references to or deltas
        against a base's blocks), else `pipeline.PLAIN` (every block its own)."""
        return self.inc if self.inc is not None else pipeline.PLAIN

    @property
    def version(self) -> int:
        """The version of this save's indexes, which names their layout (2, 3 or 4)."""
        return self.blocks.version(self.compression)

    def newer_blocks(self, item: SaveItem) -> int:
        """The manifest version that this process's part of `item` needs beyond its index's layout (0 for
        none): 5 for a "blosc2" block of its own, a reference to one or a delta against one, or a sparse
        delta; 6 for such a "blosc2-lz4" block (docs/FORMAT.md §6.6)."""
        return max(fmt.codecs_version(self.codecs.get(item.name, {}).values()), self.blocks.newer_blocks(item.name))

    def manifest_version(self, statuses: dict[int, dict[str, Any]]) -> int:
        """The manifest's version: the indexes' (`version`), or the highest any process's part of any item
        needs, 5 or 6 (its status says so: `_write_parts`; True, from a cairn before version 6: 5)."""
        said = [mine.get("newer") for s in statuses.values() for mine in s.get("items", {}).values()]
        return max([self.version, *(fmt.NEWER_BLOCKS_VERSION if v is True else int(v or 0) for v in said)])

    def _write_file(self, item: SaveItem, k: int, slots: list[FileSlot], crc_pool: ThreadPoolExecutor,
                    code_pool: pipeline.CodePool | None = None, order: int = 0) -> Any:
        """Write data file `k` of `item` (`_FileWriter`); (key, size, block CRCs per chunk, moved offsets,
        stored sizes). `order`: this file's rank among the save's files (its coding tasks go before later
        files')."""
        out = _FileWriter(self, item, slots, crc_pool, code_pool, order).write(self.data_key(item, k))
        for buf in self.pooled.pop((item.name, k), ()):  # written and checksummed: the buffers serve the next save
            _snapshot_pool.give(buf)
        return out

    def write_data(self) -> dict[str, Any]:
        """Write this process's data files; returns its partial index per item."""
        t0 = time.perf_counter()
        partial: dict[str, Any] = {}
        jobs: list[tuple[SaveItem, int, Any]] = []
        self._choosing = None
        stage = self.blocks
        self._pipe = host_pipeline(self)  # before the codec choosing, which looks at its first transfers
        if self.compression is not None:
            try:
                self.codecs, self._choosing = choose_codecs(
                    self, background=CHOOSE_IN_BACKGROUND and not stage.incremental)
            except BaseException:
                self._close_pipe()
                raise
        stage.open(self.items, self.loc.path)  # incremental: the base's indexes and the records of our chunks
        # Blocks are coded (and, incremental, hashed) by a pool of their own, so that a file of large chunks
        # uses every core (a file's writer thread alone would code its blocks one after another).
        coders = stage.coders(self.compression is not None)
        writers = stage.writers(self.threads, sum(len(it.files) for it in self.items))
        # (incremental: the base files its deltas read are closed once the pools are done)
        with stage.base_files(), ThreadPoolExecutor(max(1, writers), thread_name_prefix="cairn-write") as pool, \
                ThreadPoolExecutor(2, thread_name_prefix="cairn-crc") as crc_pool, \
                pipeline.CodePool(coders) as code_pool:
            # Files start in turn across checkpointables (each one's first file, then each one's second...):
            # an incremental save's files of unchanged leaves only hash, and must not hold every writer
            # while another checkpointable's changed leaves wait
            # (docs/incremental.md). The coder pool serves files in that order too (`order`: a file's rank).
            for item, k in files_in_turn(self.items):
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
            if not size and stage.incremental:  # not written: its chunks' records name file 0 (FORMAT.md §6.5)
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
        """`pipeline.code_task`, its span and raw bytes per codec noted for the codec factor (`_measure`); its blocks'
        CRCs and places (`pipeline.checked`)."""
        t0 = time.perf_counter()
        out = pipeline.code_task(task, pipeline.coded_alloc())
        t1 = time.perf_counter()
        with self._code_lock:
            self.code_spans.append((t0, t1))
            for _, _, (codec, raw, _, _) in task:
                self.coded[codec] = self.coded.get(codec, 0) + len(raw)
        return pipeline.checked(out)  # (outside the codec's span: the codec factor times coding only)

    def _measure(self) -> None:
        """Record what this save's data writes reached over the storage's link (bytes over the
        time the link was busy, not waiting for the codec: `_storage.measured`) and how fast its
        codecs ran (`codecpolicy.CodecMeter`), for the next saves' "auto". A measurement never fails a save."""
        try:
            link_s, wall_s = self.transfers.seconds()
            record(self.loc.storage, "write", sample_of(self.stats.bytes_written, link_s, wall_s,
                                                        coded=bool(self.coded), codec=main_codec(self.coded)))
            CODEC_METER.record(self.code_spans, self.coded, _policy.coder_cores())
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
        stage = self.blocks
        for item in self.items:
            p = partial[item.name]
            mine: dict[str, Any] = {"files": [[f["name"], f["size"]] for f in p["files"]]}
            mine.update(stage.part_extras(item.name))  # incremental: the base files it refers to, its refs leaves
            part = build_part(item, me, self.token, p["chunks"], self.loc.path,
                              p["stored"] if self.compression is not None or stage.incremental else None,
                              self.block_size, stage.columns(item, len(p["files"])))
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
        self.blocks.committed(self.loc, manifest, {k[len(root) + 1 :]: v for k, v in (*self.own_parts, *puts)}, n)


class _FileWriter:
    """One data file of a save written: every chunk of its slots, in order, through one of three block
    paths into the file's batch (`pipeline.Batch`): incremental (hashes, then a reference, a delta or an
    own block: `incremental.write_chunk`), coded (the coder pool's blocks, each with its CRC:
    `pipeline.checked`) or raw (CRCs of the raw blocks). Codecs chosen in the background: each slot waits
    for its own leaf's (`codecpolicy._Choosing.wait`), so a file is coded and written from its first chunk
    on while its later leaves are still measured."""

    def __init__(self, job: SaveJob, item: SaveItem, slots: list[FileSlot], crc_pool: ThreadPoolExecutor,
                 code_pool: pipeline.CodePool | None, order: int) -> None:
        self.job, self.item, self.slots, self.crc_pool, self.code_pool = job, item, slots, crc_pool, code_pool
        self.choosing = job._choosing
        self.block = job.block_size
        self.leaf_codecs = job.codecs.get(item.name, {})
        # Per chunk, in slot order: its CRC (one block), or a list of its block CRCs or their futures.
        # Plain ints where possible: a state of thousands of small leaves makes one per chunk, and
        # objects the garbage collector tracks make it run full collections during the save.
        self.crcs: list[Any] = []
        # Compressed chunks: where each lands (stored sizes shift the chunks after it) and its blocks' sizes.
        self.moved: dict[int, int] = {}
        self.stored: dict[int, tuple[int, ...]] = {}
        # (An incremental save codes the blocks it writes itself: `incremental.write_chunk`.)
        self.stage = job.blocks
        self.coded = (pipeline.in_order(code_pool, job._timed_code_task, self.code_tasks(), order)
                      if self.leaf_codecs and not self.stage.incremental else iter(()))
        self.done: collections.deque[tuple[int, bool, list[Any], list[int], list[Any]]] = collections.deque()

    def write(self, key: str) -> tuple[str, int, list[tuple[int, ...]], dict[int, int], dict[int, tuple[int, ...]]]:
        job = self.job
        # (incremental: a file of references only is not written at all, `write_if_any`)
        size = job.transfers.transfer(self.stage.writer(job.loc.storage.write), key, self.parts())  # timed for `_measure`
        return key, size, [(c,) if type(c) is int else tuple(x if type(x) is int else x.result() for x in c)
                           for c in self.crcs], self.moved, self.stored

    def _too_short(self, slot: FileSlot, n: int) -> CheckpointError:
        return CheckpointError(
            f"{self.job.loc.path}: chunk {slot.cell} of "
            f"{display_path(self.item.leaves[slot.leaf].path, self.item.name)!r} has {n} bytes, "
            f"planned {slot.nbytes}")

    def host_raw(self, slot: FileSlot, src: Any) -> memoryview:
        host = self.job._host
        if type(src) is Concat:
            raw = memoryview(b"".join(pipeline.bytes_of(host(p)) for p in src.parts))
        else:
            raw = pipeline.bytes_of(host(src))
        if len(raw) != slot.nbytes:
            raise self._too_short(slot, len(raw))
        return raw

    def code_tasks(self) -> Any:
        """The compressed chunks' host bytes, in slot order, as coding tasks (`pipeline.code_task`): a large
        chunk in runs of `pipeline.RUN_BLOCKS` blocks, small ones together up to a run's bytes (one task
        codes many small leaves). (`_take`: a device copy made by `snapshot` is freed once its host bytes
        exist.)"""
        item, choosing, block = self.item, self.choosing, self.block
        group: list[tuple[int, bool, tuple[Any, ...]]] = []
        size, run = 0, block * pipeline.RUN_BLOCKS
        for n_slot, slot in enumerate(self.slots):
            if choosing is not None:
                if group and not choosing.ready(item.name, slot.leaf):
                    yield group  # code what is here while this leaf is still measured
                    group, size = [], 0
                choosing.wait(item.name, slot.leaf)
            codec = self.leaf_codecs.get(slot.leaf, "none")
            if codec == "none":
                continue
            raw = self.host_raw(slot, self.job._take(item, (slot.leaf, slot.cell)))
            leaf = item.leaves[slot.leaf]
            assert isinstance(leaf, ArraySource)  # (a codec other than "none" is an array leaf's)
            dtype = leaf.dtype
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

    def blocks_of(self, n_slot: int) -> Any:
        """(stored block, its CRC-32C, its place) of compressed slot `n_slot`, as its coding tasks finish."""
        done = self.done
        while True:
            if not done:
                done.extend(next(self.coded))
            got, last, blocks, block_crcs_, places = done.popleft()
            assert got == n_slot, (got, n_slot)
            yield from zip(blocks, block_crcs_, places)
            if last:
                return

    def parts(self) -> Any:
        """The file's bytes, as the writer takes them: each slot's chunk through its block path."""
        batch = pipeline.Batch()
        item, choosing = self.item, self.choosing
        shift = 0  # stored bytes minus raw bytes of the compressed chunks so far
        for n_slot, slot in enumerate(self.slots):
            if choosing is not None:
                choosing.wait(item.name, slot.leaf)
            codec = self.leaf_codecs.get(slot.leaf, "none")
            if shift:
                self.moved[n_slot] = slot.offset + shift
            if self.stage.incremental:  # incremental (format 4): hashes, references (`incremental`)
                shift += yield from self._incremental(n_slot, slot, codec, batch)
            elif codec != "none":
                shift += yield from self._coded(n_slot, slot, batch)
            else:
                yield from self._raw(slot, batch)
        yield from batch.rest()

    def _incremental(self, n_slot: int, slot: FileSlot, codec: str, batch: pipeline.Batch) -> Generator[Any, None, int]:
        item = self.item
        assert batch._span is None  # (it writes `batch.buf` itself; nothing placed is held)
        # (lazily: a chunk of an array the base holds unchanged is not read: `write_chunk`)
        raw = functools.partial(self.host_raw, slot, item.sources.pop((slot.leaf, slot.cell)))
        batch.buf, sizes, crcs, own = yield from self.stage.write_chunk(
            item, slot.leaf, slot.cell, raw, codec, getattr(item.leaves[slot.leaf], "dtype", None),
            self.code_pool, batch.buf)
        del raw
        self.stored[n_slot] = sizes
        self.crcs.append(crcs)
        activity.advance()
        return own - slot.nbytes

    def _coded(self, n_slot: int, slot: FileSlot, batch: pipeline.Batch) -> Generator[Any, None, int]:
        sizes, stored_crcs = [], []
        for enc, crc, at in self.blocks_of(n_slot):
            sizes.append(len(enc))
            stored_crcs.append(crc)  # a stored block's check record
            yield from batch.add(enc, at)
        self.stored[n_slot] = tuple(sizes)
        self.crcs.append(stored_crcs)
        activity.advance()
        return sum(sizes) - slot.nbytes

    def _raw(self, slot: FileSlot, batch: pipeline.Batch) -> Generator[Any, None, None]:
        block, host = self.block, self.job._host
        # (`_take`: a device copy made by `snapshot` is freed once its host bytes exist.)
        src = self.job._take(self.item, (slot.leaf, slot.cell))
        if type(src) is Concat:  # a merged chunk: its pieces' bytes, one after another
            mvs = [pipeline.bytes_of(host(p)) for p in src.parts]
            n = sum(len(m) for m in mvs)
            if n == slot.nbytes:
                self.crcs.append(block_crcs(mvs, block))
                for m in mvs:
                    yield from batch.add(m)
                del mvs
                activity.advance()
                return
            mv = memoryview(b"".join(mvs))
        else:
            mv = pipeline.bytes_of(host(src))
        n = len(mv)
        if n != slot.nbytes:
            raise self._too_short(slot, n)
        if n <= pipeline.SMALL_CHUNK:
            # A small chunk costs more in a thread hand-off and a write of its own than in
            # its bytes: checksum it here, and write it together with its neighbours.
            self.crcs.append(block_crcs(mv, block))
            if (yield from batch.add(mv)):  # copied now, so the host view is released at once
                activity.advance()  # storage took more: peers waiting for us see progress
            del mv
            return
        self.crcs.append([self.crc_pool.submit(pipeline.block_crc, mv[o : o + block]) for o in range(0, n, block)])
        yield from batch.add(mv)
        activity.advance()


#: Bytes of device chunks a blocking save's host-copy pipeline may have started ahead of its writers
#: (`host_pipeline`; at most `KEEP_HOST_SHARE` of the host's memory). 0: no pipeline, each chunk
#: copied to host by its writer (or the codec choosing) when it comes to it.
HOST_PIPELINE_BYTES = 1 << 30


def host_pipeline(job: SaveJob) -> Any:
    """A `snapshot.HostPipeline` for the accelerator chunks `job` writes, in the order its writers take
    them (`files_in_turn`, each file's slots in order), started up to its budget; None where there
    are none to copy (a save_async's snapshot made them host arrays already, or a numpy state), where
    the save is incremental (its writers hash as they go), or where a save_async's snapshot budget left
    chunks on device (host memory must stay within that budget: its writers copy one at a time)."""
    budget = min(HOST_PIPELINE_BYTES, _policy.keep_host_bytes())
    if budget <= 0 or job.blocks.incremental or job.stats.device_copy_bytes:
        return None
    from .snapshot import HostPipeline

    keys: list[tuple[str, tuple[int, int]]] = []
    sizes: list[int] = []
    srcs: list[Any] = []
    for item, k in files_in_turn(job.items):
        for slot in item.files[k]:
            key = (slot.leaf, slot.cell)
            src = item.sources.get(key)
            if src is None or type(src) is np.ndarray or type(src) is Concat or not _policy.fresh_copy(src):
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


# ---------------------------------------------------------------------- prepare


def prepare(loc: Location, state: Any, options: SaveOptions | None = None, **kwargs: Any) -> SaveJob:
    """The job that executes this process's `SavePlan` of saving `state` at `loc` (`plan.plan_save`'s
    arguments); `SaveJob.run` writes and commits."""
    return job_of(plan_save(loc, state, options, **kwargs))


def job_of(plan: SavePlan) -> SaveJob:
    """The `SaveJob` that executes `plan`: its items and slots, codecs, token and prices as planned; an
    incremental plan's base opened for hashing and references."""
    job = SaveJob(**{f.name: getattr(plan, f.name) for f in fields(SavePlan)})
    if plan.base is not None or plan.hashes:  # incremental (format version 4)
        from .incremental import setup

        job.inc = setup(plan.loc, plan.base, plan.hashes, plan.base_required)
        if job.inc is not None:
            job.inc.block = plan.block_size
    job.stats.blocking_s = time.perf_counter() - plan.started
    return job


def execute(plan: SavePlan) -> SaveStats:
    """Write and commit what `plan` says (a blocking save: `job_of(plan).run()`)."""
    return job_of(plan).run()
