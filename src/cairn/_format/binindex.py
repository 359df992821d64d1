"""Pure: format version 2's binary chunk index, found by arithmetic and read in ranges.

In a version-2 index (docs/FORMAT.md §5.2) an array leaf written on a regular
chunk grid stores its grid once, as runs of cell extents, and which process
wrote each cell, as arithmetic runs. What varies per chunk (data file, offset,
block checksums) lives in one binary *part* per writing process: fixed-width
records sorted by (leaf, cell), then a column of block CRCs. The record of
(leaf, cell) sits at a position every reader can compute: the number of cells
the same process wrote in earlier leaves, plus the cell's rank among that
process's cells of its leaf. So a loader reads the records of the chunks it
reads, nothing else, and no process ever merges the others' parts.

No I/O here: a `ChunkTable` is given a function that reads byte ranges. The
bytes of one part (header, records, CRC column) are `_partfile`'s.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._core.checksum import crc32c
from .._core.memo import Memo
from .._errors import corrupt
from .blocks import DELTA
from .partfile import (
    HASH_BYTES,
    HEADER_BYTES,
    OWN,
    PART_VERSION,
    PART_VERSION_BLOCKS,
    PART_VERSION_SIZES,
    RECORD,
    RECORD_BYTES,
    SOURCE,
    SOURCE_BYTES,
    PartInfo,
    check_header,
)

#: Records (or CRCs) closer than this many bytes in one part are fetched in one range.
MERGE_GAP = 4096

Reader = Callable[[list[tuple[str, int, int]]], list[bytes]]  # (part name, start, length) -> bytes



@dataclass
class _LeafCells:
    writers: np.ndarray  # per cell: the writing process
    ncrc: np.ndarray  # per cell: its number of checksum blocks
    sizes: np.ndarray  # per cell: bytes
    rank: np.ndarray | None = None  # per cell: rank among its writer's cells of this leaf
    crc_rank: np.ndarray | None = None  # per cell: CRCs of its writer's earlier cells of this leaf


class ChunkTable:
    """Chunk places of one item's part-indexed leaves: fetched in ranges, on demand, then kept."""

    def __init__(self, parts: Sequence[PartInfo], processes: int, file_sizes: Sequence[int], where: str,
                 index_version: int = 2):
        self.parts = {p.process: p for p in parts}
        # An index of version 3 has parts of version 3: a stored-size column after the CRC column;
        # version 4 adds a hash and a source per block (incremental checkpoints, `BlockSource`).
        self.part_version = (PART_VERSION_BLOCKS if index_version >= 4 else
                             PART_VERSION_SIZES if index_version >= 3 else PART_VERSION)
        # version 4: leaf -> cell -> (hash bytes, per block (file or -1, codec id, offset))
        self._blocks: dict[int, dict[int, tuple[bytes, tuple[tuple[int, int, int], ...]]]] = {}
        self._stored: dict[int, dict[int, tuple[int, ...]]] = {}
        self._codec: dict[int, str] = {}
        self.block = 1 << 20
        self.processes = processes
        self.file_sizes = list(file_sizes)
        self.where = where
        self.leaves: dict[int, _LeafCells] = {}
        self.reader: Reader | None = None
        self.bytes_read = 0
        self.requests = 0
        self._got: dict[int, dict[int, tuple[int, int, tuple[int, ...]]]] = {}
        self._bases: tuple[np.ndarray, np.ndarray] | None = None
        self._row: dict[int, int] = {}
        self._single: tuple[np.ndarray, ...] = ()  # per row (`_base`): writer, CRCs, bytes of a one-cell leaf
        self._lock = threading.Lock()
        self._ncrc: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._rank_memo: dict[tuple[int, int], tuple[_LeafCells, np.ndarray, np.ndarray]] = {}

    def add_leaf(self, i: int, writers: np.ndarray, sizes: np.ndarray, block: int, codec: str = "none") -> None:
        self.block = block
        if codec != "none":
            self._codec[i] = codec
        # Leaves of one layout share `writers` and `sizes` (memoised by the parser): so do their counts.
        key = (id(sizes), block)
        ncrc = self._ncrc.get(key)
        if ncrc is None:
            ncrc = self._ncrc[key] = (sizes, -(-sizes // block))
        self.leaves[i] = _LeafCells(writers, ncrc[1], sizes)

    # ------------------------------------------------------------------ positions

    def _base(self) -> tuple[np.ndarray, np.ndarray]:
        """Per leaf (row `_row[leaf]`) and process: that process's records and CRCs in earlier
        leaves, i.e. where its records of the leaf start in its part. One pass over all cells."""
        if self._bases is None:
            order = sorted(self.leaves)
            self._row = {i: k for k, i in enumerate(order)}
            n, procs = len(order), self.processes
            if not n:
                self._bases = np.zeros((0, procs), np.int64), np.zeros((0, procs), np.int64)
                return self._bases
            lcs = [self.leaves[i] for i in order]
            lens = np.fromiter((len(lc.writers) for lc in lcs), dtype=np.int64, count=n)
            key = np.repeat(np.arange(n, dtype=np.int64) * procs, lens) + np.concatenate([lc.writers for lc in lcs])
            counts = np.bincount(key, minlength=n * procs).reshape(n, procs)
            ncrc = np.concatenate([lc.ncrc for lc in lcs]).astype(np.float64)
            crcs = np.rint(np.bincount(key, weights=ncrc, minlength=n * procs)).astype(np.int64).reshape(n, procs)
            self._bases = np.cumsum(counts, axis=0) - counts, np.cumsum(crcs, axis=0) - crcs
            # A one-cell leaf's writer, CRC count and size, per row (many small leaves: no walk per leaf).
            self._single = tuple(
                np.fromiter((int(getattr(lc, f)[0]) if len(lc.writers) == 1 else -1 for lc in lcs),
                            dtype=np.int64, count=n) for f in ("writers", "ncrc", "sizes"))
        return self._bases

    def _ranks(self, lc: _LeafCells) -> None:
        if lc.rank is not None:
            return
        key = (id(lc.writers), id(lc.ncrc))
        hit = self._rank_memo.get(key)
        if hit is not None and hit[0].writers is lc.writers and hit[0].ncrc is lc.ncrc:
            lc.rank, lc.crc_rank = hit[1], hit[2]
            return
        if lc.rank is None:
            w = lc.writers
            order = np.argsort(w, kind="stable")
            pos = np.empty(len(w), dtype=np.int64)
            pos[order] = np.arange(len(w))
            counts = np.bincount(w)
            start = np.cumsum(counts) - counts
            lc.rank = pos - start[w]
            sorted_ncrc = lc.ncrc[order]
            before = np.cumsum(sorted_ncrc) - sorted_ncrc  # CRCs of earlier cells in sorted order
            group_first = before[start[w[order]]] if len(w) else before
            crc_rank = np.empty(len(w), dtype=np.int64)
            crc_rank[order] = before - group_first
            lc.crc_rank = crc_rank
            self._rank_memo[key] = (lc, lc.rank, crc_rank)

    # ------------------------------------------------------------------ fetching

    def fetch(self, need: dict[int, np.ndarray]) -> None:
        """Read the records (and CRCs) of the given cells of each leaf, in as few ranges as sensible."""
        with self._lock:
            self._fetch(need)

    def _fetch(self, need: dict[int, np.ndarray]) -> None:
        rec_base, crc_base = self._base()
        # part -> rows of (leaf, cell, record no, crc no, crcs, writer, bytes)
        wanted: dict[int, list[np.ndarray]] = {}
        singles: list[int] = []  # leaves of one cell (trees of many small leaves), done together below
        for i, cells in need.items():
            lc = self.leaves[i]
            got = self._got.get(i)
            if len(lc.writers) == 1:
                if got is None or 0 not in got:
                    singles.append(i)
                continue
            if got is None:
                got = self._got[i] = {}
            row = self._row[i]
            cells = np.unique(np.asarray(cells, dtype=np.int64))
            if got:
                cells = np.array([c for c in cells.tolist() if c not in got], dtype=np.int64)
            if not len(cells):
                continue
            self._ranks(lc)
            assert lc.rank is not None and lc.crc_rank is not None
            w = lc.writers[cells]
            rows = np.stack([np.full(len(cells), i), cells, rec_base[row][w] + lc.rank[cells],
                             crc_base[row][w] + lc.crc_rank[cells], lc.ncrc[cells], w, lc.sizes[cells]], axis=1)
            for p in np.unique(w).tolist():
                wanted.setdefault(p, []).append(rows[w == p])
        if singles:
            leaf_no = np.array(singles, dtype=np.int64)
            r = np.fromiter(map(self._row.__getitem__, singles), dtype=np.int64, count=len(singles))
            w, ncrc, size = (col[r] for col in self._single)
            rows = np.stack([leaf_no, np.zeros_like(leaf_no), rec_base[r, w], crc_base[r, w], ncrc, w, size], axis=1)
            for p in np.unique(w).tolist():
                wanted.setdefault(p, []).append(rows[w == p])
        requests: list[tuple[str, int, int]] = []
        plan: list[tuple[PartInfo, np.ndarray, list[tuple[int, int, int]]]] = []
        for p, chunks in wanted.items():
            part = self.parts.get(p)
            if part is None:
                raise corrupt(self.where, f"process {p} wrote chunks but the index names no part of it")
            rows = np.concatenate(chunks)
            rows = rows[np.argsort(rows[:, 2], kind="stable")]
            if int(rows[:, 2].max()) >= part.records or int((rows[:, 3] + rows[:, 4]).max()) > part.crcs:
                raise corrupt(self.where, f"index part {part.name!r} holds fewer records than its leaves need")
            # The header too: it is small, and it pins the part's process and counts.
            crc_at = HEADER_BYTES + part.records * RECORD_BYTES
            has = rows[:, 4] > 0
            starts = np.concatenate([[0], HEADER_BYTES + rows[:, 2] * RECORD_BYTES, crc_at + rows[has, 3] * 4])
            lengths = np.concatenate([[HEADER_BYTES], np.full(len(rows), RECORD_BYTES), rows[has, 4] * 4])
            if self.part_version >= PART_VERSION_SIZES:  # and the stored sizes beside the CRCs
                starts = np.concatenate([starts, crc_at + part.crcs * 4 + rows[has, 3] * 4])
                lengths = np.concatenate([lengths, rows[has, 4] * 4])
            if self.part_version == PART_VERSION_BLOCKS:  # and the hashes and sources (version 4)
                hash_at = crc_at + part.crcs * 8
                src_at = hash_at + part.crcs * HASH_BYTES
                starts = np.concatenate([starts, hash_at + rows[has, 3] * HASH_BYTES,
                                         src_at + rows[has, 3] * SOURCE_BYTES])
                lengths = np.concatenate([lengths, rows[has, 4] * HASH_BYTES, rows[has, 4] * SOURCE_BYTES])
            order = np.argsort(starts, kind="stable")
            ranges = _ranges(starts[order], lengths[order])
            requests += [(part.name, s, e - s) for s, e, _ in ranges]
            plan.append((part, rows, ranges))
        if not requests:
            return
        if self.reader is None:
            raise corrupt(self.where, "the binary index has no reader bound")
        blobs = iter(self.reader(requests))
        self.requests += len(requests)
        self.bytes_read += sum(r[2] for r in requests)
        for part, rows, ranges in plan:
            self._decode(part, rows, ranges, [next(blobs) for _ in ranges])

    def _decode(self, part: PartInfo, rows: np.ndarray, ranges: list[tuple[int, int, int]],
                blobs: list[bytes]) -> None:
        where = f"{self.where}: index part {part.name!r}"
        for (s, e, _), b in zip(ranges, blobs):
            if len(b) != e - s:
                raise corrupt(where, f"is shorter than its index says (bytes {s}..{e})")

        def at(pos: int, n: int) -> bytes:
            k = _find(ranges, pos)
            s = ranges[k][0]
            return blobs[k][pos - s : pos - s + n]

        if check_header(at(0, HEADER_BYTES), where, self.part_version) != (part.process, part.records, part.crcs):
            raise corrupt(where, "header does not match the part the index names")
        crc_at = HEADER_BYTES + part.records * RECORD_BYTES
        # Every record (and, where each has one, every CRC) lies inside one range: gather them all at once.
        blob = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        firsts = np.array([r[0] for r in ranges], dtype=np.int64)
        into = np.cumsum([0] + [e - s for s, e, _ in ranges[:-1]])

        def gather(pos: np.ndarray, n: int) -> np.ndarray:
            k = np.searchsorted(firsts, pos, side="right") - 1
            return blob[(into[k] + pos - firsts[k])[:, None] + np.arange(n)]

        n = len(rows)
        raw = gather(HEADER_BYTES + rows[:, 2] * RECORD_BYTES, RECORD_BYTES)
        rec = raw.reshape(-1).view(RECORD)
        _check_records(where, rows, raw, rec)
        sizes = rows[:, 6]
        files = rec["file"].astype(np.int64)
        offsets = rec["offset"].astype(np.int64)
        if np.any((sizes > 0) & (files >= part.files)):
            k = int(np.flatnonzero((sizes > 0) & (files >= part.files))[0])
            raise corrupt(where, f"record {int(rows[k, 2])} names file {int(files[k])} of a part with {part.files}")
        files = np.where(sizes > 0, files + part.file_base, 0)
        offsets = np.where(sizes > 0, offsets, 0)
        v3 = self.part_version >= PART_VERSION_SIZES
        v4 = self.part_version == PART_VERSION_BLOCKS
        stored_of: list[tuple[int, ...]] = []
        crcs_of: list[tuple[int, ...]] = []
        check = rec["crcs_crc"].tolist()
        if v3:
            # Every block of every record at once (a record's columns are runs of its CRC numbers): the
            # CRCs, stored sizes and, in version 4, hashes and sources, each gathered in one call.
            ncrc = rows[:, 4]
            ends = np.cumsum(ncrc)
            firsts_of = ends - ncrc
            blockno = np.repeat(rows[:, 3] - firsts_of, ncrc) + np.arange(int(ends[-1]) if n else 0)
            size_at = crc_at + part.crcs * 4
            cb = gather(crc_at + blockno * 4, 4).reshape(-1)
            sb = gather(size_at + blockno * 4, 4).reshape(-1)
            crcs_all, sizes_all = cb.view("<u4").tolist(), sb.view("<u4").tolist()
            bounds = list(zip(firsts_of.tolist(), ends.tolist()))
            crcs_of = [tuple(crcs_all[i:j]) for i, j in bounds]
            stored_of = [tuple(sizes_all[i:j]) for i, j in bounds]
            cbb, sbb = cb.tobytes(), sb.tobytes()
            own_sizes = sb.view("<u4").astype(np.int64)
            if v4:
                hb = gather(size_at + part.crcs * 4 + blockno * HASH_BYTES, HASH_BYTES).reshape(-1)
                ob = gather(size_at + part.crcs * 20 + blockno * SOURCE_BYTES, SOURCE_BYTES).reshape(-1)
                hbb, obb = hb.tobytes(), ob.tobytes()
                src = ob.view(SOURCE)
                # A chunk's own stored bytes are those of its blocks that are not references (a delta's are own).
                own_sizes = np.where((src["file"] == OWN) | (src["codec"] == DELTA), own_sizes, 0)
            running = np.concatenate([[0], np.cumsum(own_sizes)])
            sizes = np.where(sizes > 0, running[ends] - running[firsts_of], 0)
        limits = np.asarray(self.file_sizes, dtype=np.int64)[files] if self.file_sizes else np.zeros_like(files)
        outside = np.flatnonzero((sizes > 0) & (offsets + sizes > limits))
        if len(outside):
            k = int(outside[0])
            raise corrupt(where, f"record {int(rows[k, 2])} (bytes {int(offsets[k])}..{int(offsets[k] + sizes[k])}) "
                               "lies outside its data file")
        if v3:
            for k, (i, j) in enumerate(bounds):
                got_crc = crc32c(sbb[4 * i : 4 * j], crc32c(cbb[4 * i : 4 * j]))
                if v4:
                    got_crc = crc32c(obb[16 * i : 16 * j], crc32c(hbb[16 * i : 16 * j], got_crc))
                if got_crc != check[k]:
                    raise corrupt(where, f"checksums of record {int(rows[k, 2])} do not match their checksum")
        else:
            crcs_of = _v2_crcs(where, rows, gather, at, crc_at, check)
        if v4:
            self._check_all_sources(where, rows, stored_of, src, sizes_all, part)
            self._keep_sources(rows, stored_of, bounds, hbb, src, part.file_base)
        elif v3:
            self._keep_stored(where, rows, stored_of)
        got = self._got
        for k, (leaf, cell, f, off) in enumerate(zip(rows[:, 0].tolist(), rows[:, 1].tolist(), files.tolist(),
                                                     offsets.tolist())):
            got.setdefault(leaf, {})[cell] = (f, off, crcs_of[k])

    def _keep_sources(self, rows: np.ndarray, stored_of: list[tuple[int, ...]], bounds: list[tuple[int, int]],
                      hbb: bytes, src: np.ndarray, fb: int) -> None:
        """Version 4: each record's stored sizes, and its blocks' hashes and sources (a file number of this
        part shifted by its first file `fb`; -1: the chunk's own)."""
        files_all, codecs_all, offs_all = src["file"].tolist(), src["codec"].tolist(), src["offset"].tolist()
        for k, (leaf, cell, _rno) in enumerate(rows[:, 0:3].tolist()):
            i, j = bounds[k]
            self._stored.setdefault(leaf, {})[cell] = stored_of[k]
            self._blocks.setdefault(leaf, {})[cell] = (hbb[16 * i : 16 * j], tuple(
                (-1 if f == OWN else fb + f, c, o)
                for f, c, o in zip(files_all[i:j], codecs_all[i:j], offs_all[i:j])))

    def _keep_stored(self, where: str, rows: np.ndarray, stored_of: list[tuple[int, ...]]) -> None:
        """Version 3: each record's stored sizes, checked against its leaf's codec (raw sizes for "none",
        bounded otherwise)."""
        for k, (leaf, cell, rno) in enumerate(rows[:, 0:3].tolist()):
            st = stored_of[k]
            codec = self._codec.get(leaf, "none")
            raws = raw_blocks(int(rows[k, 6]), self.block)
            if codec == "none" and list(st) != raws:
                raise corrupt(where, f"record {rno}: stored sizes of an uncompressed chunk differ from its bytes")
            if codec != "none" and any(v > stored_bound(b) for v, b in zip(st, raws)):
                raise corrupt(where, f"record {rno}: a stored block size is out of bounds")
            self._stored.setdefault(leaf, {})[cell] = st

    def _check_all_sources(self, where: str, rows: np.ndarray, stored_of: list[tuple[int, ...]], src: np.ndarray,
                           sizes: list[int], part: PartInfo) -> None:
        """`_check_sources` of every record at once: the same rules over all blocks in a few array
        operations; where any block breaks one, the records are checked one by one for the error."""
        from .blocks import CODEC_IDS, CODEC_NAMES, DELTA_HEADER

        ncrc = rows[:, 4]
        if not len(src):
            return
        firsts = np.cumsum(ncrc) - ncrc
        rec = np.repeat(np.arange(len(rows)), ncrc)
        j = np.arange(len(src)) - np.repeat(firsts, ncrc)
        v = np.asarray(sizes, dtype=np.int64)
        r = np.minimum(self.block, rows[:, 6][rec] - j * self.block)
        bound = r + r // 8 + 4096  # `stored_bound`
        f = src["file"].astype(np.int64)
        c = src["codec"].astype(np.int64)
        off = src["offset"].astype(np.int64)
        leaf_codec = np.array([CODEC_IDS[self._codec.get(leaf, "none")] for leaf in rows[:, 0].tolist()])[rec]
        inside = f < part.files
        delta = c == DELTA
        bad = r <= 0
        bad |= delta & ((f == OWN) | ~inside | (v < DELTA_HEADER.size) | (v > bound + DELTA_HEADER.size))
        bad |= ~delta & ((c >= len(CODEC_NAMES)) | (v > bound) | ((c == 0) & (v != r)))
        bad |= ~delta & (f == OWN) & (c != leaf_codec)
        bad |= ~delta & (f != OWN) & ~inside
        if self.file_sizes:
            limit = np.asarray(self.file_sizes, dtype=np.int64)[np.where(inside, part.file_base + f, 0)]
            bad |= delta & inside & (off >= limit)
            bad |= ~delta & (f != OWN) & inside & (off + v > limit)
        if bool(bad.any()):
            obs = src.tobytes()
            for k, (leaf, rno, n, nbytes) in enumerate(rows[:, [0, 2, 4, 6]].tolist()):
                i = int(firsts[k])
                self._check_sources(where, rno, stored_of[k], obs[16 * i : 16 * (i + n)], nbytes, leaf, part)

    def _check_sources(self, where: str, rno: int, st: tuple[int, ...], ob: bytes, nbytes: int, leaf: int,
                       part: PartInfo) -> None:
        """Version 4: a record's block sources: own blocks of codec "none" hold their raw size, every
        block at most `stored_bound`, every reference inside a file of the part (`incremental`)."""
        from .blocks import CODEC_NAMES, DELTA_HEADER

        src = np.frombuffer(ob, dtype=SOURCE)
        codec = self._codec.get(leaf, "none")
        for b, (v, r, f, c, off) in enumerate(zip(st, raw_blocks(nbytes, self.block), src["file"].tolist(),
                                                  src["codec"].tolist(), src["offset"].tolist())):
            if c == DELTA:  # own bytes, against a block of a base's file (its size is in the delta's header)
                if f == OWN or f >= part.files or v < DELTA_HEADER.size or v > stored_bound(r) + DELTA_HEADER.size:
                    raise corrupt(where, f"record {rno} block {b}: a bad delta")
                if self.file_sizes and off >= self.file_sizes[part.file_base + f]:
                    raise corrupt(where, f"record {rno} block {b}: a delta against bytes outside its base's file")
                continue
            if c >= len(CODEC_NAMES) or v > stored_bound(r) or (CODEC_NAMES[c] == "none" and v != r):
                raise corrupt(where, f"record {rno} block {b}: a bad codec or stored size")
            if f == OWN:
                if CODEC_NAMES[c] != codec:
                    raise corrupt(where, f"record {rno} block {b}: codec {CODEC_NAMES[c]!r}, its leaf's is {codec!r}")
                continue
            if f >= part.files:
                raise corrupt(where, f"record {rno} block {b} refers to file {f} of a part with {part.files}")
            g = part.file_base + f
            if self.file_sizes and off + v > self.file_sizes[g]:
                raise corrupt(where, f"record {rno} block {b} (bytes {off}..{off + v}) lies outside its file")

    def sources(self, leaf: int, cell: int) -> tuple[bytes, tuple[tuple[int, int, int], ...]] | None:
        """Version 4: a chunk's block hashes (16 bytes each) and, per block, ``(file, codec id, offset)``:
        a reference's file as the index's file number, -1 for a block in the chunk's own bytes."""
        self.entry(leaf, cell)
        return self._blocks.get(leaf, {}).get(cell)

    def fetch_leaf(self, leaf: int, n: int) -> None:
        """Every record of `leaf` (of `n` cells), unless all are here already (a load's checks
        walk each leaf it reads, after the prefetch)."""
        got = self._got.get(leaf)
        if got is None or len(got) < n:
            self.fetch({leaf: np.arange(n)})

    def fetch_all(self) -> None:
        """Every record of every leaf (tools that read the whole checkpoint)."""
        self.fetch({i: np.arange(len(lc.writers)) for i, lc in self.leaves.items()})

    def entry(self, leaf: int, cell: int) -> tuple[int, int, tuple[int, ...]]:
        got = self._got.get(leaf)
        hit = got.get(cell) if got is not None else None
        if hit is None:
            # Not prefetched: fetch this leaf's records whole (one range per writer).
            self.fetch({leaf: np.arange(len(self.leaves[leaf].writers))})
            hit = self._got[leaf][cell]
        return hit


    def stored(self, leaf: int, cell: int) -> tuple[int, ...]:
        """Each block's stored size for a chunk of a version-3 part (fetched with its record)."""
        self.entry(leaf, cell)
        return self._stored[leaf][cell]


def stored_bound(raw: int) -> int:
    """The most bytes a coded block of `raw` raw bytes may store (zstd's and planes' worst cases, generously)."""
    return raw + raw // 8 + 4096


def raw_blocks(nbytes: int, block: int) -> list[int]:
    """The raw size of each checksum block of a chunk of `nbytes` bytes."""
    n = -(-nbytes // block)
    return [block] * (n - 1) + [nbytes - block * (n - 1)] if n else []


def _ranges(starts: np.ndarray, lengths: Any) -> list[tuple[int, int, int]]:
    """Sorted byte ranges merged while the gap between them stays under `MERGE_GAP`: (start, end, 0)."""
    ends = starts + lengths
    out: list[tuple[int, int, int]] = []
    for s, e in zip(starts.tolist(), np.broadcast_to(ends, starts.shape).tolist()):
        if out and s - out[-1][1] <= MERGE_GAP:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e, 0)
        else:
            out.append((s, e, 0))
    return out


def _check_records(where: str, rows: np.ndarray, raw: np.ndarray, rec: np.ndarray) -> None:
    """The records `raw` (as `rec`) read for `rows`: each one's CRC, and each for the leaf, cell and first
    CRC number the row asked for."""
    raw_bytes = raw.tobytes()
    bad = np.flatnonzero((rec["leaf"] != rows[:, 0]) | (rec["cell"] != rows[:, 1]) | (rec["crc_start"] != rows[:, 3]))
    stored = rec["rec_crc"].tolist()
    for k in range(len(rows)):
        if crc32c(raw_bytes[k * RECORD_BYTES : (k + 1) * RECORD_BYTES - 4]) != stored[k]:
            raise corrupt(where, f"record {int(rows[k, 2])} checksum mismatch")
    if len(bad):
        k = int(bad[0])
        raise corrupt(where, f"record {int(rows[k, 2])} is for leaf {int(rec['leaf'][k])} cell "
                           f"{int(rec['cell'][k])}, not leaf {int(rows[k, 0])} cell {int(rows[k, 1])}")


def _v2_crcs(where: str, rows: np.ndarray, gather: Any, at: Any, crc_at: int, check: list[int]) -> list[tuple[int, ...]]:
    """Versions 2 (no stored sizes): each record's block CRCs, checked against its record's checksum of them
    (`gather`: bytes at many positions at once; `at`: bytes at one position)."""
    if bool(np.all(rows[:, 4] == 1)):  # one block per chunk, the common case: all CRCs gathered at once
        cbs = gather(crc_at + rows[:, 3] * 4, 4)
        cb_bytes = cbs.tobytes()
        for k in range(len(rows)):
            if crc32c(cb_bytes[4 * k : 4 * k + 4]) != check[k]:
                raise corrupt(where, f"checksums of record {int(rows[k, 2])} do not match their checksum")
        return [(v,) for v in cbs.reshape(-1).view("<u4").tolist()]
    crcs_of: list[tuple[int, ...]] = []
    for k, (rno, cno, ncrc_k) in enumerate(rows[:, 2:5].tolist()):
        cb1 = at(crc_at + cno * 4, ncrc_k * 4) if ncrc_k else b""
        if crc32c(cb1) != check[k]:
            raise corrupt(where, f"checksums of record {rno} do not match their checksum")
        crcs_of.append(tuple(np.frombuffer(cb1, dtype="<u4").tolist()))
    return crcs_of


def _find(ranges: list[tuple[int, int, int]], pos: int) -> int:
    lo, hi = 0, len(ranges) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ranges[mid][0] <= pos:
            lo = mid
        else:
            hi = mid - 1
    return lo


_PART_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,200}$")


def _field(x: Any, key: str, where: str, lo: int = 0, hi: int = 1 << 56) -> Any:
    v = x.get(key) if isinstance(x, dict) else None
    if key == "name":
        if type(v) is not str or not _PART_NAME.match(v):
            raise corrupt(where, f"bad index part name {v!r:.80}")
        return v
    if type(v) is not int or not lo <= v <= hi:
        raise corrupt(where, f"field {key!r} must be an integer in [{lo}, {hi}], found {v!r:.80}")
    return v


def parse_parts(d: dict[str, Any], file_sizes: list[int], where: str, version: int = 2) -> ChunkTable:
    """The `parts` of a version-2 index, checked, as a `ChunkTable` its leaves are added to."""
    parts_raw = d.get("parts", [])
    processes = _field(d, "processes", where, 1, 1 << 24) if "processes" in d else 1
    if type(parts_raw) is not list:
        raise corrupt(where, "'parts' must be a list")
    parts, seen = [], set()
    for i, x in enumerate(parts_raw):
        w = f"{where}: parts[{i}]"
        p = _field(x, "process", w, 0, processes - 1)
        base, nf = _field(x, "file_base", w), _field(x, "files", w)
        if p in seen or base + nf > len(file_sizes):
            raise corrupt(w, "repeated process, or files outside the index's file list")
        seen.add(p)
        parts.append(PartInfo(_field(x, "name", w), p, _field(x, "records", w), _field(x, "crcs", w), base, nf))
    return ChunkTable(parts, processes, file_sizes, where, version)


_cell_bytes_cache: Memo[np.ndarray] = Memo(limit=1024)


def cell_bytes(grid: tuple[tuple[int, ...], ...], itemsize: int) -> np.ndarray:
    """Bytes of every grid cell in C order, as an int64 array (memoised per grid)."""
    key = (grid, itemsize)
    hit = _cell_bytes_cache.get(key)
    if hit is None:
        hit = np.array([itemsize], dtype=np.int64)
        for b in grid:
            hit = np.multiply.outer(hit, np.diff(np.asarray(b, dtype=np.int64))).reshape(-1)
        _cell_bytes_cache.put(key, hit)
    return hit


class LazyChunks(Sequence[tuple[int, int]]):
    """A leaf's ``(file, offset)`` per cell, from its `ChunkTable` (fetched on first use)."""

    __slots__ = ("leaf", "n", "table")  # two per leaf of an index: no __dict__ each

    def __init__(self, table: ChunkTable, leaf: int, n: int):
        self.table, self.leaf, self.n = table, leaf, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, cell: Any) -> Any:
        if isinstance(cell, slice):
            return [self[c] for c in range(*cell.indices(self.n))]
        if not 0 <= cell < self.n:
            raise IndexError(cell)
        return self._cell(cell)

    def _cell(self, cell: int) -> Any:
        f, off, _ = self.table.entry(self.leaf, cell)
        return f, off

    def __iter__(self) -> Iterator[tuple[int, int]]:
        self.table.fetch_leaf(self.leaf, self.n)
        return (self[c] for c in range(self.n))

    def entries(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """``(file, offset, block CRCs)`` of every cell, in one walk (where both are needed)."""
        self.table.fetch_leaf(self.leaf, self.n)
        return [self.table.entry(self.leaf, c) for c in range(self.n)]


class LazyStored(LazyChunks):
    """A leaf's stored block sizes per cell, from its `ChunkTable` (version 3)."""

    __slots__ = ()

    def _cell(self, cell: int) -> Any:
        return self.table.stored(self.leaf, cell)


class LazyCrcs(LazyChunks):
    """A leaf's block CRCs per cell, from its `ChunkTable`."""

    __slots__ = ()

    def _cell(self, cell: int) -> Any:
        return self.table.entry(self.leaf, cell)[2]


def cells_in(grid: Sequence[Sequence[int]], boxes: Sequence[Sequence[tuple[int, int]]]) -> np.ndarray:
    """The grid cells (C-order numbers) that overlap any of `boxes`, sorted, each once."""
    shape = tuple(len(b) - 1 for b in grid)
    if not shape:
        return np.zeros(1, dtype=np.int64)
    # Bisection and cell numbers in Python: a box overlaps few cells, and numpy's cost per call
    # was most of a load's index work (a process reads 8 boxes of each of 1,137 leaves).
    strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
    small: set[int] = set()
    large: list[np.ndarray] = []
    for box in boxes:
        axes = []
        for b, (lo, hi), st, n in zip(grid, box, strides, shape):
            if hi <= lo:
                break
            first, last = bisect.bisect_right(b, lo) - 1, bisect.bisect_left(b, hi)
            if first < 0 or last > n:
                raise ValueError(f"box {box} reaches outside the grid {grid}")
            axes.append(range(first * st, last * st, st))
        else:
            if math.prod(map(len, axes)) <= 1024:
                small.update(map(sum, itertools.product(*axes)))
            else:
                large.append(functools.reduce(lambda x, y: np.add.outer(x, y).reshape(-1), map(np.asarray, axes)))
    out = np.fromiter(sorted(small), dtype=np.int64, count=len(small))
    return np.unique(np.concatenate([out, *large])) if large else out
