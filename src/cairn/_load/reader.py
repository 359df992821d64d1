"""Reading stored arrays: the chunk reader that load, verify, diff and convert share.

`ChunkReader` runs the reads that `_plan.plan_reads` plans for one
checkpointable, on a pool of threads. Every byte read is checked against its
block checksum (unless the caller turns verification off) before it is
copied anywhere; where the storage fetches a read in parallel parts (object
stores), each part's blocks are verified in the thread that received it, as
it lands, and only blocks that straddle two parts once the whole read is
done. A read whose bytes are exactly one contiguous region of a
destination buffer lands there directly; other reads go through a small
temporary buffer and a strided copy. On object stores, the reads that land
in place are gathered per file into runs of consecutive bytes, across boxes
and leaves (`coalesce.Pieces`): one request per run instead of one per box.

The slab helpers below read an array in bounded C-order pieces, for the
tools that stream whole arrays (conversion, diff) without ever holding one.
"""

from __future__ import annotations

import errno
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from .._codecs import codecs as _codecs
from .._core.boxes import Box, full_box
from .._core.buffers import aligned_empty, as_view, lent_empty, load_pool, prefault
from .._core.checksum import BlockChecks, mismatch
from .._core.stats import LoadStats
from .._dist.coord import activity
from .._errors import CheckpointError, CorruptCheckpointError
from .._format import manifest as fmt
from .._plan.leafreads import (
    DEFAULT_MAX_READ,
    block_range,
    plan_leaf_reads,
    stored_span,
)
from .._plan.readmemo import PlanMemo
from .._plan.reads import Read, is_c_contiguous
from .._read.metadata import Opened
from .._storage import PartReader, RandomReader
from .._storage.location import Location
from .._tree.pytree import display_path
from .coalesce import Pieces, Runs, run_limits
from .decodepool import pieces, prefault_thread, share, spread
from .landing import MAX_PARTS, MIN_RUN, coded_lands, direct_bytes, lands_in_place, split_coded
from .landing import region as _region
from .landing import scratch as _scratch
from .plan import array_reads

DEFAULT_BUDGET = 256 << 20  # the memory budget of a streaming conversion, by default
_PREFAULT_BATCH = 256 << 20  # fresh buffers noted beyond this are mapped without waiting for the caller
_PREFAULT_MIN = 1 << 20  # smaller buffers are not mapped ahead

#: Destination buffers of a load onto devices are lent from `buffers.load_pool` (False: new ones).
LEND_LOAD_BUFFERS = True
#: A compressed read's pieces are taken by its reader thread and free decode-pool threads (`decodepool.share`),
#: so a read never waits for pieces queued behind other reads' on a busy pool; False: `decodepool.spread`,
#: every piece but the first queued on the pool and waited for. On the TPU host a load whose first leaf is
#: a 128 MiB embedding queued 32 pieces at once, and the reads behind it waited for theirs: its readers
#: ran 4 reads for its first 70 ms (on the TPU host).
CODED_SHARED = True
#: A compressed read decoded in place on a reader thread, whole or a part of a large chunk (`_do_read_part`),
#: is decoded by that thread alone, not shared with the decode pool: the parts already keep every reader
#: decoding, and on the TPU host the pool's threads beside them slowed a warm load (0.93-0.94x without
#: them, in three calls). True: shared with the pool.
PART_POOL = False
#: Destinations smaller than this are new buffers (the pool lends whole MiB; small ones come from memory
#: the allocator has mapped already).
LEND_MIN = 1 << 20


def lends(sharding: Any) -> bool:
    """Whether a load's host buffers for `sharding` are lent from `buffers.load_pool`: wherever the arrays go
    to devices (numpy results, `sharding` None, are new buffers the caller owns).

    On an accelerator each buffer is copied to the device and let go of once the copy is done, so the next
    buffers (of this load, and of a later one in this process) fill pages already mapped rather than fresh
    ones, whose first touch is a page fault (dear under a sandbox such as gVisor: the TPU host). The CPU
    backend adopts the buffers as the arrays themselves: each comes back only once no reference to it is left
    (JAX holds one for as long as any device buffer uses the memory, a donated array's included), so a process that loads again after dropping the last
    state it loaded (an evaluator, a rollback) reads into the same pages: measured on the benchmark VM,
    1.5 GiB on 8 CPU devices loaded again in 0.19 s against 0.58 s into fresh pages (medians; 4 KiB page
    faults), benchmarks/results/vm-repeated-load.md."""
    return LEND_LOAD_BUFFERS and sharding is not None


def host_buffer(shape: tuple[int, ...], dtype: np.dtype, lend: bool) -> np.ndarray:
    """A load's destination buffer, lent (`lends`) or new."""
    if lend and math.prod(shape) * dtype.itemsize >= LEND_MIN:
        return lent_empty(load_pool, shape, dtype)
    # Filled once, by a copy: without huge-page advice, whose compaction on first touch costs more than
    # the copy (see `aligned_empty`).
    return aligned_empty(shape, dtype, huge_pages=False)


@dataclass(frozen=True)
class ArrayReads:
    """The reads of one array, submitted to the pool, and the host buffers they fill."""

    futures: list[Future[None]]
    dests: list[np.ndarray]  # one per box, C order, of the stored dtype
    boxes: list[Box]  # distinct target boxes
    placement: dict[Box, list[Any]] | None  # per box: the devices that get it; None for a numpy result

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.dests)


@dataclass(frozen=True)
class CodedRead:
    """A read of a compressed leaf as storage sees it: stored bytes ``[first, first + nbytes)`` of data
    file `file`, one check per stored block, decoded into `raw` (the read's raw bytes)."""

    file: int
    first: int
    nbytes: int
    checks: list[tuple[int, int, int]]  # (file start, end, CRC-32C) of each stored block
    fail: Callable[[tuple[int, int, int], int], BaseException]
    leaf: fmt.ArrayLeaf
    raw: Any  # writable bytes, ``read.nbytes`` of them
    blocks: list[tuple[int, int, str]]  # per block: where it decodes to in `raw`, and its name in errors

    @classmethod
    def of(cls, reader: ChunkReader, read: Read, leaf: fmt.ArrayLeaf, raw: Any) -> CodedRead:
        cell, block = read.file, reader.index.block_size
        file, first, n = stored_span(leaf, read, block)
        sizes, crcs = leaf.stored_sizes(cell, block), leaf.crcs[cell]
        name = reader.index.files[file].name
        where = f"{reader.loc.path}: leaf {display_path(leaf.path, reader.item)!r}, {name!r}"
        checks, blocks = [], []
        pos = first
        for b in block_range(read, block):
            checks.append((pos, pos + sizes[b], crcs[b]))
            pos += sizes[b]
            lo = b * block - read.start
            blocks.append((lo, min(lo + block, read.nbytes), f"{where} block {b} of chunk {cell}"))
        number = {c[0]: k for k, c in enumerate(checks)}

        def fail(c: tuple[int, int, int], got: int) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{reader.loc.path}: " + mismatch(
                f"{name!r} block {read.start // block + number[c[0]]} of chunk {cell} (stored bytes "
                f"{c[0]}..{c[1]}, leaf {display_path(leaf.path, reader.item)!r})", c[2], got))

        return cls(file, first, n, checks, fail, leaf, raw, blocks)

    def decoder(self, stored: memoryview, pooled: bool = True) -> Callable[[int, int], None]:
        """`BlockChecks`' ``then`` for blocks landed in `stored` (the stored bytes from `first` on): each
        stretch of checked blocks decoded into `raw`, in pieces of about `DECODE_PIECE` raw bytes taken by
        this thread and free threads of the decode pool (`share`; `spread` where `CODED_SHARED` is off;
        this thread alone without `pooled`), each piece by one call (`codecs.decode_run`). Returns once
        every piece is decoded: `stored` may be reused then."""
        first, checks, blocks, leaf = self.first, self.checks, self.blocks, self.leaf

        def decode(i: int, j: int) -> None:
            _codecs.decode_run(leaf.codec, [stored[c[0] - first : c[1] - first] for c in checks[i:j]], leaf.dtype,
                               [hi - lo for lo, hi, _ in blocks[i:j]], self.raw[blocks[i][0] : blocks[j - 1][1]],
                               [at for _, _, at in blocks[i:j]])

        def in_pieces(i: int, j: int) -> None:
            runs = pieces(blocks, i, j)
            if not pooled:
                for a, b in runs:
                    decode(a, b)
                return
            (share if CODED_SHARED else spread)(decode, runs)
        return in_pieces


def base_problem(storage: Any, path: str, base: str, item_dir: str) -> str | None:
    """Why the checkpoint at `path` may not read blocks of its sibling base checkpoint `base` (the
    checkpointable in folder `item_dir`), or None: the base must be a committed checkpoint whose index of
    that checkpointable is there. A folder without them is no checkpoint (`cairn gc` would remove it), and
    serving its bytes would hide that `path` depends on it."""
    refers = f"{path} refers to its base checkpoint {base!r} (beside it)"
    try:
        raw = storage.read(f"{base}/{fmt.MANIFEST}")
    except (FileNotFoundError, NotADirectoryError):
        return (f"{refers}, which is not a committed checkpoint: its {fmt.MANIFEST} is missing (deleted?); "
                f"{path} cannot load without it")
    except OSError as e:
        return f"{refers}: reading its {fmt.MANIFEST} failed: {e}"
    try:
        manifest = fmt.Manifest.from_json(raw, storage.describe(f"{base}/{fmt.MANIFEST}"))
    except CheckpointError as e:
        return f"{refers}, whose manifest is unreadable: {e}"
    info = next((i for i in manifest.items.values() if i.dir == item_dir), None)
    if info is None or not storage.exists(f"{base}/{info.dir}/{info.index}"):
        what = (f"it has no checkpointable in folder {item_dir!r}" if info is None
                else f"the index {info.dir}/{info.index} of its checkpointable is missing")
        return f"{refers}, which is not a committed checkpoint of it: {what} (deleted?); {path} cannot load without it"
    return None


class ChunkReader:
    """Runs the reads of one checkpointable with a pool of threads."""

    def __init__(self, loc: Location, name: str, info: fmt.ItemInfo, index: fmt.ItemIndex, verify: bool,
                 pool: ThreadPoolExecutor, stats: LoadStats):
        self.loc, self.info, self.index, self.verify, self.pool, self.stats = loc, info, index, verify, pool, stats
        self.item = name
        self._readers: dict[int, RandomReader] = {}
        self._lock = threading.Lock()
        self._max_read = loc.storage.preferred_read or DEFAULT_MAX_READ
        self._small, run_bytes = run_limits(loc.storage.preferred_read)
        self._runs = Runs(self, run_bytes)  # small whole arrays, read together
        # Storages that charge per request (object stores): direct reads that follow one another in a
        # file, across boxes and leaves, go out as one read.
        self._pieces = Pieces(self, loc.storage.preferred_read) if loc.storage.preferred_read else None
        self._plans = PlanMemo()  # leaves of one layout share a read plan
        self._unmapped: list[np.ndarray] = []  # fresh buffers to map ahead of their bytes (`start_prefault`)
        # Told this reader once it notes fresh buffers where it had none (the loading thread's list of the
        # readers to call `start_prefault` on: a load of thousands of checkpointables asks only those).
        self.on_noted: Callable[[ChunkReader], None] | None = None
        self._unmapped_bytes = 0
        # The scratch buffers of the decode pool's threads rebuilding this reader's deltas (`blocks.read_blocks`),
        # where its reads keep theirs on their threads: dropped with the reader, not kept on the pool's.
        self.delta_scratch: dict[Any, Any] = {}
        self._bases_checked: set[str] = set()  # base checkpoints found committed (`_check_base`)

    def _check_base(self, base: str) -> None:
        """Refuse a reference into `base` unless it is a committed checkpoint (`base_problem`), once per
        base (caller holds `_lock`)."""
        if base in self._bases_checked:
            return
        problem = base_problem(self.loc.storage, self.loc.path, base, self.info.dir)
        if problem is not None:
            raise CorruptCheckpointError(problem)
        self._bases_checked.add(base)

    def _key(self, file: int) -> str:
        f = self.index.files[file]
        if f.base is not None:  # incremental (format 4): a data file of a sibling base checkpoint
            return "/".join((f.base, self.info.dir, f.name))
        return self.loc.key(self.info.dir, f.name)

    def _missing(self, file: int) -> CorruptCheckpointError:
        f = self.index.files[file]
        if f.base is not None:  # incremental: a base's file (small referred-to leaves join runs in it)
            return CorruptCheckpointError(f"{self.loc.path} refers to its base checkpoint {f.base!r} (beside it), "
                                          f"whose data file {f.name!r} is missing")
        return CorruptCheckpointError(f"{self.loc.path}: data file {f.name!r} is missing")

    def _reader(self, file: int) -> RandomReader:
        r = self._readers.get(file)  # opened already: no lock (a reader thread may hold it through a GIL switch)
        if r is not None:
            return r
        with self._lock:
            r = self._readers.get(file)
            if r is None:
                name = self.index.files[file].name
                if self.index.files[file].base is not None:
                    self._check_base(self.index.files[file].base)  # type: ignore[arg-type]
                try:
                    r = self.loc.storage.open_read(self._key(file))
                except FileNotFoundError:
                    raise self._missing(file) from None
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        raise CorruptCheckpointError(
                            f"{self.loc.path}: data file {name!r} is a symbolic link (or lies under one); "
                            "cairn never follows links inside a checkpoint"
                        ) from None
                    raise CheckpointError(f"{self.loc.path}: opening data file {name!r} failed: {e}") from e
                # Local files know their size for free (object stores would need a request):
                # a file shorter than its index claims is refused before any buffer is allocated.
                size, claimed = r.size, self.index.files[file].size
                if size is not None and size < claimed:
                    r.close()
                    raise CorruptCheckpointError(
                        f"{self.loc.path}: data file {name!r} has {size} bytes, its index claims {claimed}"
                    )
                self._readers[file] = r
            return r

    def submit_pending(self) -> None:
        """Send the run of small arrays still being gathered to the pool (the caller queued its last read)."""
        self._runs.submit()
        if self._pieces is not None:
            self._pieces.submit()

    def release(self) -> None:
        """Close, and drop the runs being gathered (they point back at this reader): a load's reader
        is then freed, with all it holds, when the load lets go of it, not by the next collection of
        the cyclic garbage collector in whatever runs next (the next load of a 256 MiB state from
        moto spent 10-55 ms in it, holding up its first GETs). Not for use afterwards."""
        self.close()
        self._pieces = None
        self._runs = None  # type: ignore[assignment]
        self._plans = None  # type: ignore[assignment]

    def close(self) -> None:
        with self._lock:
            for r in self._readers.values():
                try:
                    r.close()
                except Exception:
                    pass
            self._readers.clear()

    def _fill(self, file: int, start: int, out: memoryview | list[memoryview], leaf: fmt.ArrayLeaf,
              checks: BlockChecks | None = None) -> None:
        """Read file bytes from `start` into `out` (one buffer, or consecutive buffers).

        With `checks`, a reader that reads in parts (`reports_parts`) verifies
        each part's blocks as it lands; the caller verifies the rest.
        """
        n = len(out) if isinstance(out, memoryview) else sum(len(o) for o in out)
        try:
            r = self._reader(file)
            if checks is not None and getattr(r, "reports_parts", False):
                cast(PartReader, r).read_into_many(start, [out] if isinstance(out, memoryview) else out,
                                                   on_part=checks.part)
            elif isinstance(out, memoryview):
                r.read_into(start, out)
            else:
                r.read_into_many(start, out)
        except CheckpointError:  # a part's checksum failed: its error already says where
            raise
        except EOFError:
            raise CorruptCheckpointError(
                f"{self.loc.path}: data file {self.index.files[file].name!r} is truncated "
                f"(leaf {display_path(leaf.path, self.item)!r} needs bytes {start}..{start + n})"
            ) from None
        except FileNotFoundError:  # object stores learn of a missing object on the first read
            raise self._missing(file) from None
        except OSError as e:
            raise CheckpointError(
                f"{self.loc.path}: reading {self.index.files[file].name!r} for leaf "
                f"{display_path(leaf.path, self.item)!r} failed: {e}"
            ) from e
        with self._lock:
            self.stats.bytes_read += n
            self.stats.reads += 1
        activity.advance()  # peers waiting for this process see it moving

    def _block_checks(self, file: int, checks: Sequence[tuple[int, int, int]], segments: list[memoryview],
                      base: int, leaf: fmt.ArrayLeaf) -> BlockChecks:
        """The verification of `checks` (file bytes) over `segments`, which hold the file from `base` on."""
        def fail(c: tuple[int, int, int], got: int) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{self.loc.path}: " + mismatch(
                f"{self.index.files[file].name!r} bytes {c[0]}..{c[1]} (leaf {display_path(leaf.path, self.item)!r})",
                c[2], got))

        return BlockChecks(checks, segments, base, fail)

    def _fill_checked(self, read: Read, buf: memoryview | list[memoryview], leaf: fmt.ArrayLeaf) -> None:
        """Read `read`'s bytes into `buf` and verify its checksum blocks (part by part, where the reader can)."""
        if not read.checks:
            self._fill(read.file, read.start, buf, leaf)
            return
        checks = self._block_checks(read.file, read.checks, [buf] if isinstance(buf, memoryview) else buf,
                                    read.start, leaf)
        self._fill(read.file, read.start, buf, leaf, checks)
        checks.rest()

    def do_read(self, read: Read, leaf: fmt.ArrayLeaf, dests: list[np.ndarray]) -> None:
        if leaf.refs:  # incremental (format 4): blocks that may be references (`blocks`)
            from .blocks import read_blocks

            read_blocks(self, read, leaf, dests)
            return
        if leaf.codec != "none":
            self._do_read_coded(read, leaf, dests)
            return
        direct = read.direct
        if direct is not None:
            region = dests[direct.dest][_region(direct.dest_start, direct.shape)]
            if region.flags.c_contiguous:
                self._fill_checked(read, memoryview(region.reshape(-1).view(np.uint8)), leaf)
                with self._lock:
                    self.stats.direct_reads += 1
                return
        if self._reader(read.file).vectored:
            parts = _tiled_regions(read, dests)
            if parts is not None:  # consecutive whole regions: one vectored read, no copy
                self._fill_checked(read, parts, leaf)
                with self._lock:
                    self.stats.direct_reads += 1
                return
        raw = _scratch(read.nbytes)
        self._fill_checked(read, as_view(raw), leaf)
        for c in read.copies:
            src = np.ndarray(c.shape, dtype=leaf.dtype, buffer=raw, offset=c.src_offset, strides=c.src_strides)
            dests[c.dest][_region(c.dest_start, c.shape)] = src

    def _do_read_coded(self, read: Read, leaf: fmt.ArrayLeaf, dests: list[np.ndarray]) -> None:
        """A read of a compressed leaf, planned in raw addressing (`plan_leaf_reads`): ``read.file`` is the
        chunk, ``[start, end)`` whole blocks of its raw bytes. Reads those blocks' stored bytes (one
        range), checks each block's CRC-32C on them, and decodes them into the destination where the
        read is one contiguous region of it, else into a buffer the copies take from.

        Where the storage fetches the range in parts (object stores), the blocks wholly inside a part
        are checked in the thread that received the part, as it lands, and decoded by it and the decode
        pool (`CodedRead.decoder`): a corrupt block fails the read while later parts are still on the wire,
        and decoding overlaps the transfer. From a local file, the blocks are checked once read, then
        decoded by this reader thread and the decode pool, on as many cores as are free. Blocks
        across two parts are checked and decoded once the whole range has landed. (`read_array` sends a read
        that decodes straight into its destination elsewhere: on object stores gathered per file, `Pieces`,
        else in parts, `_do_read_part`, each decoded by its reader alone; with the same checks, `CodedRead`.)
        """
        out = direct_bytes(read, dests)
        raw = out if out is not None else _scratch(read.nbytes)
        self._decode_into(read, leaf, raw)
        with self._lock:
            self.stats.direct_reads += out is not None
        if out is None:
            for c in read.copies:
                src = np.ndarray(c.shape, dtype=leaf.dtype, buffer=raw, offset=c.src_offset, strides=c.src_strides)
                dests[c.dest][_region(c.dest_start, c.shape)] = src

    def _decode_into(self, read: Read, leaf: fmt.ArrayLeaf, raw: Any, pooled: bool = True) -> None:
        """The stored blocks of `read` (raw addressing) read as one range, checked and decoded into `raw`
        (with the decode pool where `pooled`, `CodedRead.decoder`)."""
        coded = CodedRead.of(self, read, leaf, raw)
        stored = _scratch(coded.nbytes, "stored")
        view = memoryview(stored.data)
        # Each stretch of blocks decoded by one call once checked: from an object store, the blocks of
        # each streamed part as it lands; from a reader that reports no parts, all of them at the end.
        bc = BlockChecks(coded.checks, [view], coded.first, coded.fail, then=coded.decoder(view, pooled))
        self._fill(coded.file, coded.first, view, leaf, bc)
        bc.rest()

    def _do_read_part(self, part: Read, leaf: fmt.ArrayLeaf, raw: Any) -> None:
        """A compressed read that decodes in place, or a part of one (`split_coded`), decoded into `raw`, its
        destination bytes, by this thread (`PART_POOL`)."""
        self._decode_into(part, leaf, raw, PART_POOL)
        with self._lock:
            self.stats.direct_reads += 1

    def read_array(self, leaf: fmt.ArrayLeaf, sharding: Any = None, region: Box | None = None,
                   planned: tuple[Any, list[Read]] | None = None) -> ArrayReads:
        """Start reading `leaf`: whole into one buffer, or the boxes `sharding` puts on this process.

        With `region`, the array read is that box of the leaf (a slab of a leaf
        restored in pieces); boxes and placement are relative to it. `planned`:
        `plan.array_reads`' answer for these boxes, from the load's plan.
        """
        placement = None
        shape = leaf.shape if region is None else tuple(hi - lo for lo, hi in region)
        if sharding is None:
            boxes: list[Box] = [full_box(shape)]
        else:
            from .._tree.shardings import addressable_boxes

            boxes, placement = addressable_boxes(sharding, shape)
        span, reads = planned if planned is not None else array_reads(
            leaf, boxes, region, sharding is None, self.index.block_size, self.verify, self._max_read, self._small,
            self._plans)
        if span is not None:  # small, whole, one run of bytes: read together with its neighbours
            self._reader(span.file)  # checks the file first: a false size claim allocates nothing
            dest = aligned_empty(leaf.shape, leaf.dtype, huge_pages=False)  # filled once, as below
            self._note_fresh([dest])
            reads_ = ArrayReads([self._runs.add(leaf, span.file, span.start, dest, span.stored)], [dest], boxes,
                                placement)
            self._prefault_if_many()
            return reads_
        files = {leaf.chunks[r.file][0] for r in reads} if leaf.codec != "none" or leaf.refs else {
            r.file for r in reads}
        for file in sorted(files):
            self._reader(file)  # checks the files first: a false size claim allocates nothing
        lend = lends(sharding)
        try:
            dests = [host_buffer(tuple(hi - lo for lo, hi in b), leaf.dtype, lend) for b in boxes]
        except MemoryError:
            nbytes = sum(math.prod(hi - lo for lo, hi in b) for b in boxes) * leaf.dtype.itemsize
            raise CheckpointError(
                f"{self.loc.path}: cannot allocate {nbytes} bytes for leaf "
                f"{display_path(leaf.path, self.item)!r} of shape {leaf.shape}"
            ) from None
        self._note_fresh(dests)  # (a lent buffer's pages may be mapped already: then mapping them is quick)
        self._runs.submit()
        futures: list[Future[None]] = []
        shapes = [d.shape for d in dests]
        for r in reads:
            if leaf.codec != "none" and not leaf.refs and coded_lands(r, shapes):  # decodes in place
                out = direct_bytes(r, dests)
                assert out is not None  # (`coded_lands`)
                if self._pieces is not None:  # its stored blocks join the file's run
                    futures.append(self._pieces.add_coded(CodedRead.of(self, r, leaf, out)))
                    continue
                # (a large chunk in parts, read, checked and decoded on several readers)
                futures.extend(self.pool.submit(self._do_read_part, p, leaf, out[p.start - r.start : p.end - r.start])
                               for p in split_coded(r, self.index.block_size))
                continue
            views = self._landing(r, leaf, dests) if self._pieces is not None else None
            if views is not None:  # lands in place: joins the file's run of such reads
                futures.append(self._pieces.add(r.file, r.start, r.end, views, r.checks, leaf))  # type: ignore[union-attr]
            else:
                futures.append(self.pool.submit(self.do_read, r, leaf, dests))
        self._prefault_if_many()
        return ArrayReads(futures, dests, boxes, placement)

    def _note_fresh(self, dests: list[np.ndarray]) -> None:
        """On storages that price requests (whose reads wait on the network), note fresh destination
        buffers whose pages `start_prefault` maps while the requests are in flight."""
        if self._pieces is not None:
            had = bool(self._unmapped)
            for d in dests:
                if d.nbytes >= _PREFAULT_MIN:  # (smaller ones come from memory the allocator has mapped)
                    self._unmapped.append(d)
                    self._unmapped_bytes += d.nbytes
            if self._unmapped and not had and self.on_noted is not None:
                self.on_noted(self)

    def _prefault_if_many(self) -> None:
        """Start mapping once many bytes are noted, without waiting for the caller. Called after the
        array's reads are queued, never before: a mapping that starts while the loading thread still has
        a request to send holds that request up (the per-GET timeline of a 256 MiB moto load: the last
        file's GET left 80-100 ms late in two loads of three, when the 256 MiB mark fell on its array)."""
        if self._unmapped_bytes >= _PREFAULT_BATCH:
            self.start_prefault()

    def start_prefault(self) -> None:
        """Map the pages of the buffers noted so far, in one pool thread, in the order they were
        allocated (the order their bytes are requested), not in the copy (`buffers.prefault`). The
        loading thread calls it once it has sent its reads, or before it waits for one: mapping
        pages while it is still allocating and sending holds it up (both need the process's
        memory map), so the first GETs would go out later. The task holds the buffers until it ends."""
        if self._unmapped:
            prefault_thread().submit(_prefault_all, self._unmapped)
            self._unmapped, self._unmapped_bytes = [], 0

    def _landing(self, read: Read, leaf: fmt.ArrayLeaf, dests: list[np.ndarray]) -> list[memoryview] | None:
        """The destination bytes an uncompressed read lands in without a copy (as `do_read` lands
        it), in file order; None where it needs a buffer (or its blocks may be references: `do_read`)."""
        if leaf.codec != "none" or leaf.refs:
            return None
        vectored = self._reader(read.file).vectored
        if not lands_in_place(read, [d.shape for d in dests], vectored):  # the rule the load's plan follows
            return None
        direct = read.direct
        if direct is not None:
            region = dests[direct.dest][_region(direct.dest_start, direct.shape)]
            if region.flags.c_contiguous:
                return [memoryview(region.reshape(-1).view(np.uint8))]
        return _tiled_regions(read, dests) if vectored else None

    def read_bytes(self, leaf: fmt.ArrayLeaf) -> bytes:
        reads = self.read_array(leaf)
        for f in reads.futures:
            f.result()
        return reads.dests[0].tobytes()


def _prefault_all(dests: list[np.ndarray]) -> None:
    for d in dests:
        prefault(d)


def _tiled_regions(read: Read, dests: list[np.ndarray]) -> list[memoryview] | None:
    """Destination byte views that a vectored read can fill in place, in file order.

    The copies, in source order, must cover the read exactly, each contiguous in
    the file. A destination region that is not contiguous (a block of columns of
    the target shard, as when resharding) is split into its rows, provided rows
    are long enough for a vectored read to beat a read into a buffer plus a
    copy. Returns None when that does not apply.
    """
    out: list[memoryview] = []
    pos = 0
    for c in sorted(read.copies, key=lambda c: c.src_offset):
        if c.src_offset != pos or not is_c_contiguous(c.shape, c.src_strides):
            return None
        region = dests[c.dest][_region(c.dest_start, c.shape)]
        if region.flags.c_contiguous:
            out.append(memoryview(region.reshape(-1).view(np.uint8)))
        else:
            if region.ndim < 2 or region.strides[-1] != region.itemsize:
                return None
            if region.shape[-1] * region.itemsize < MIN_RUN:
                return None
            if len(out) + int(np.prod(region.shape[:-1])) > MAX_PARTS:
                return None
            for idx in np.ndindex(*region.shape[:-1]):
                out.append(memoryview(region[idx].view(np.uint8)))
        pos += c.nbytes
    return out if pos == read.nbytes else None


# ---------------------------------------------------------------------- whole arrays, in slabs


def make_reader(ck: Opened, item: str, pool: ThreadPoolExecutor, stats: LoadStats | None = None) -> ChunkReader:
    """The reader for one checkpointable of `ck` (all reads verify their checksums)."""
    return ChunkReader(ck.loc, item, ck.manifest.items[item], ck.indexes[item], True, pool, stats or LoadStats())


def slab_boxes(shape: tuple[int, ...], itemsize: int, max_bytes: int) -> Iterator[Box]:
    """Boxes that tile `shape` in C order, each a contiguous run of at most `max_bytes`.

    A box fixes single indices on the leading axes, takes a range of the
    next one, and all of the trailing ones; the smallest array piece it can
    be is one element.
    """
    if any(s == 0 for s in shape):
        return
    if not shape:
        yield ()
        return
    # The first axis whose trailing block fits: slabs are ranges along it.
    axis, inner = len(shape) - 1, itemsize
    for a in range(len(shape)):
        tail = math.prod(shape[a + 1 :]) * itemsize
        if tail <= max_bytes:
            axis, inner = a, tail
            break
    step = max(1, max_bytes // inner)
    for prefix in np.ndindex(*shape[:axis]):
        for lo in range(0, shape[axis], step):
            hi = min(lo + step, shape[axis])
            lead = tuple((int(i), int(i) + 1) for i in prefix)
            yield (*lead, (lo, hi), *((0, n) for n in shape[axis + 1 :]))


def read_box(reader: ChunkReader, leaf: fmt.ArrayLeaf, box: Box, pool: ThreadPoolExecutor,
             verify: bool = True) -> np.ndarray:
    """Read one box of a stored array into a new numpy array (checksums verified)."""
    dest = np.empty(tuple(hi - lo for lo, hi in box), dtype=leaf.dtype)
    reads = plan_leaf_reads(leaf, [box], reader.index.block_size, verify)
    for f in [pool.submit(reader.do_read, r, leaf, [dest]) for r in reads]:
        f.result()
    return dest


def iter_array(reader: ChunkReader, leaf: fmt.ArrayLeaf, max_bytes: int,
               pool: ThreadPoolExecutor) -> Iterator[np.ndarray]:
    """A stored array's values, as C-order slabs of at most `max_bytes` each."""
    for box in slab_boxes(leaf.shape, leaf.dtype.itemsize, max_bytes):
        yield read_box(reader, leaf, box, pool)


def slab_bytes(budget: int, block: int = fmt.DEFAULT_BLOCK_SIZE) -> int:
    """The slab size that keeps a streaming tool within `budget` bytes (whole blocks)."""
    # Up to three slabs can be alive at once: the one being written (a
    # storage backend may hold it until it asks for the next), the one being
    # read, and the temporary buffers of reads that cannot land in place. A
    # quarter of the budget each leaves room for everything else.
    return max(block, budget // 4 // block * block)
