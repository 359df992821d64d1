"""Safe copies of committed checkpoints between stores: `cairn.copy` and ``cairn cp`` / ``cairn mv``.

A copy takes exactly the files the source's manifest names, directly or
through an index: the manifest, one index per checkpointable, its data files
and (format 2) its binary index parts. Leftovers of other attempts stay
behind. Everything reaches the destination through its commit strategy
(`_commit.strategy_for`), the same protocol as a save: on POSIX the files go
under the hidden attempt folder, which is renamed into place; on an object
store they are written in place and the manifest is put last,
create-if-absent. Until that last step nothing is visible at the destination.

* **Verified.** Metadata is read whole (as a load reads it) and checked by
  its own checksums; data files stream through in pieces, every checksum
  block's CRC-32C checked as its bytes pass, so what is written is what was
  verified. A move also reads the committed destination back before it
  deletes the source.
* **Within a budget.** At most ``budget_bytes`` of data-file pieces are held
  at once (`CopyStats.peak_piece_bytes`): one piece per file in flight, never
  a whole file. An object-store destination's multipart upload buffers up to
  ``part_size * (upload_concurrency + 1)`` more per file (its storage options).
* **Resumable.** The attempt is named by the source's own token (every file
  name carries it), so a copy that was interrupted finds what it wrote: a file
  already there with its size (and, when verifying, its checksums) is kept,
  anything else is written again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from .._core.buffers import as_view
from .._core.checksum import check_block, crc32c
from .._core.stats import Progress
from .._errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from .._format import manifest as fmt
from .._format.partfile import (
    PART_VERSION,
    PART_VERSION_BLOCKS,
    PART_VERSION_SIZES,
    decode_part,
    part_bytes,
)
from .._load.reader import DEFAULT_BUDGET
from .._load.source import CairnSource
from .._read.metadata import index_bytes, manifest_bytes, parse_index, read_manifest, sibling
from .._save.commit import CommitStrategy, refuse_replacing_a_base, strategy_for
from .._save.options import SaveOptions
from .._sources.verify import describe_chunk
from .._storage.location import Location, resolve

PIECE_BYTES = 16 << 20  # the largest piece of a data file read and written at once
MIN_PIECE = 64 << 10
_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


@dataclass
class CopyStats:
    """What a copy did. `files_kept` / `bytes_kept`: already complete at the destination (a resumed copy)."""

    src: str
    dst: str
    files_copied: int = 0
    bytes_copied: int = 0
    files_kept: int = 0
    bytes_kept: int = 0
    peak_piece_bytes: int = 0  # the most data-file bytes this copy held at once
    moved: bool = False  # the source was deleted (a move)
    bases: tuple[str, ...] = ()  # keep_references: the base checkpoints copied (or found copied) beside it
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _File:
    """One file the manifest names: its key below the checkpoint, its size, how to check it."""

    rel: str
    size: int
    kind: str  # "index" (bytes held), "part" (read whole, decoded), "data" (streamed) or "manifest"
    data: bytes = b""
    # data: (offset, stored bytes, leaf, cell, each block's stored size) by offset
    chunks: tuple[tuple[int, int, Any, int, tuple[int, ...]], ...] = ()
    block: int = fmt.DEFAULT_BLOCK_SIZE
    item: str = ""
    part_version: int = PART_VERSION  # part: the version its index's version implies


@dataclass
class _Run:
    src: Location
    dst: Location
    root: str  # where the destination's files go (relative to its storage root)
    verify: bool
    piece: int
    stats: CopyStats
    progress: Callable[[int], None] | None
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: int = 0

    def hold(self, n: int) -> None:
        with self.lock:
            self.held += n
            self.stats.peak_piece_bytes = max(self.stats.peak_piece_bytes, self.held)

    def count(self, f: _File, kept: bool) -> None:
        with self.lock:
            if kept:
                self.stats.files_kept += 1
                self.stats.bytes_kept += f.size
            else:
                self.stats.files_copied += 1
                self.stats.bytes_copied += f.size
        if self.progress is not None:
            self.progress(f.size)


class _Stopped(Exception):
    """Another file of the copy failed: stop this one."""


# ---------------------------------------------------------------------- what to copy


def _plan(src: Location, raw_manifest: bytes) -> tuple[str, list[_File]]:
    """The attempt token and every file the manifest names, its metadata checked."""
    manifest = fmt.Manifest.from_json(raw_manifest, src.storage.describe(src.key(fmt.MANIFEST)))
    files: list[_File] = []
    for name, info in manifest.items.items():
        raw = index_bytes(src, info)
        index = parse_index(src, info, raw)
        files.append(_File(f"{info.dir}/{info.index}", len(raw), "index", data=raw))
        if index.table is not None:
            index.table.fetch_all()  # every record, checked; data checks need their offsets and CRCs
        by_file: dict[int, list[tuple[int, int, Any, int, tuple[int, ...]]]] = {}
        for leaf in index.leaves:
            if isinstance(leaf, fmt.ArrayLeaf):
                own = _own_blocks(leaf, index.block_size) if leaf.refs else None
                for cell, (fi, off) in enumerate(leaf.chunks):
                    if leaf.chunk_nbytes(cell):
                        sizes = leaf.stored_sizes(cell, index.block_size) if own is None else own[1][cell]
                        if sizes:  # (a chunk of references only has no bytes of its own)
                            by_file.setdefault(fi, []).append(
                                (off, sum(sizes), leaf if own is None else own[0], cell, sizes))
        for fi, f in enumerate(index.files):
            if f.base is not None:  # a base checkpoint's file (kept references): copied with that checkpoint
                continue
            chunks = tuple(sorted(by_file.get(fi, ()), key=lambda c: c[0]))
            files.append(_File(f"{info.dir}/{f.name}", f.size, "data", chunks=chunks, block=index.block_size,
                               item=name))
        pv = (PART_VERSION_BLOCKS if index.version >= fmt.INCREMENTAL_VERSION else
              PART_VERSION_SIZES if index.version >= 3 else PART_VERSION)
        for p in index.parts:
            files.append(_File(f"{info.dir}/{p.name}", part_bytes(p.records, p.crcs, pv), "part", part_version=pv))
    if not manifest.items:
        return "empty", files
    first = next(iter(manifest.items.values())).index
    token = first[len("index."):-len(".json")] if first.startswith("index.") and first.endswith(".json") else ""
    odd = [f.rel for f in files if not token or f".{token}." not in f.rel.rsplit("/", 1)[-1]]
    if odd:
        # The destination's commit tells attempts apart by the token in file names (`_commit`):
        # a file without it would count as another attempt's leftover there.
        raise CheckpointError(f"{src.path}: cannot copy safely: its files do not all carry one save token "
                              f"(e.g. {odd[0]!r}); was it written by cairn?")
    return token, files


def _own_blocks(leaf: fmt.ArrayLeaf, block: int) -> tuple[fmt.ArrayLeaf, list[tuple[int, ...]]]:
    """A version-4 ``refs`` leaf as its data files hold it (a copy kept as is checks those bytes): each
    chunk's own blocks and deltas only, back to back, with their sizes and CRCs (references take no room)."""
    from .._format.blocks import DELTA

    parts = leaf.part_table
    sizes: list[tuple[int, ...]] = []
    crcs: list[tuple[int, ...]] = []
    for cell in range(len(leaf.chunks)):
        got = parts[0].sources(parts[1], cell) if parts is not None else None
        # The record's stored sizes: a delta's differ from its block's raw size even in a leaf of codec "none".
        all_sizes = (parts[0].stored(parts[1], cell) if got is not None and parts is not None
                     else leaf.stored_sizes(cell, block))
        all_crcs = leaf.crcs[cell]
        mine = range(len(all_sizes)) if got is None else [b for b, (f, codec, _o) in enumerate(got[1])
                                                           if f < 0 or codec == DELTA]
        sizes.append(tuple(all_sizes[b] for b in mine))
        crcs.append(tuple(all_crcs[b] for b in mine))
    return replace(leaf, crcs=crcs), sizes


class _Checker:
    """Checks the block CRCs of a data file fed to it in consecutive pieces (any sizes)."""

    def __init__(self, where: str, f: _File):
        self.where, self.f = where, f
        self.i, self.b, self.crc = 0, 0, 0  # chunk, block of it, running CRC of that block
        self.at = 0  # where block b starts in its chunk (stored bytes)

    def feed(self, pos: int, buf: Any) -> None:
        chunks, end = self.f.chunks, pos + len(buf)
        while self.i < len(chunks):
            off, _n, leaf, cell, sizes = chunks[self.i]
            bs, be = off + self.at, off + self.at + sizes[self.b]
            if bs >= end:
                return
            lo, hi = max(bs, pos), min(be, end)
            if hi > lo:
                self.crc = crc32c(buf[lo - pos : hi - pos], self.crc)
            if be > end:
                return
            want = leaf.crcs[cell][self.b]
            if self.crc != want:
                check_block(self.crc, want, f"{self.where}{'' if not self.f.item else f' [{self.f.item}]'}",
                            f"{describe_chunk(leaf, cell)} of {self.f.rel!r}, block {self.b} (file bytes {bs}..{be})")
            self.crc, self.at, self.b = 0, self.at + sizes[self.b], self.b + 1
            if self.b >= len(sizes):
                self.i, self.b, self.at = self.i + 1, 0, 0


# ---------------------------------------------------------------------- one file


def _pieces(run: _Run, loc: Location, root: str, f: _File) -> Iterator[np.ndarray]:
    """The bytes of data file `f` under `root` of `loc`'s storage, piece by piece, each checked before
    it is yielded."""
    key, counted = f"{root}/{f.rel}", []
    try:
        reader = loc.storage.open_read(key)
        size = reader.size if reader.size is not None else loc.storage.size(key)
    except _MISSING:
        raise CorruptCheckpointError(f"{loc.path}: data file {f.rel!r} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{loc.path}: reading {f.rel!r} failed: {e}") from e
    try:
        if size != f.size:
            raise CorruptCheckpointError(f"{loc.path}: data file {f.rel!r} has {size} bytes, the index records {f.size}")
        checker = _Checker(loc.path, f) if run.verify else None
        for lo in range(0, f.size, run.piece):
            if run.stop.is_set():
                raise _Stopped
            n = min(run.piece, f.size - lo)
            run.hold(n)
            counted.append(n)
            buf = np.empty(n, np.uint8)
            try:
                reader.read_into(lo, as_view(buf))
            except EOFError:
                raise CorruptCheckpointError(f"{loc.path}: data file {f.rel!r} is truncated") from None
            except OSError as e:
                raise CheckpointError(f"{loc.path}: reading {f.rel!r} failed: {e}") from e
            if checker is not None:
                checker.feed(lo, buf)
            yield buf  # a fresh buffer for the next piece: the writer may still hold this one
            del buf
            if len(counted) > 1:  # the writer asked for this piece: it has let go of the one before
                run.hold(-counted.pop(0))
    finally:
        run.hold(-sum(counted))
        reader.close()


def _intact(run: _Run, f: _File, want: bytes | None) -> bool:
    """Whether the destination already holds file `f`, complete (and, verifying, intact)."""
    storage, key = run.dst.storage, f"{run.root}/{f.rel}"
    try:
        if storage.size(key) != f.size:
            return False
        if want is not None:
            return storage.read(key) == want
        if run.verify:
            for _ in _pieces(run, run.dst, run.root, f):
                pass
    except (CorruptCheckpointError, *_MISSING):
        return False
    return True


def _source_part(run: _Run, f: _File) -> bytes:
    loc, key = run.src, run.src.key(f.rel)
    try:
        data = loc.storage.read(key)
    except _MISSING:
        raise CorruptCheckpointError(f"{loc.path}: the index part {f.rel!r} named by the index is missing") from None
    except OSError as e:
        raise CheckpointError(f"{loc.path}: reading {f.rel!r} failed: {e}") from e
    decode_part(data, loc.storage.describe(key), f.part_version)  # every checksum of the part
    return data


def _copy_file(run: _Run, f: _File, strategy: CommitStrategy) -> None:
    key = f"{run.root}/{f.rel}"
    whole = f.data if f.kind == "index" else _source_part(run, f) if f.kind == "part" else None
    storage = run.dst.storage
    try:
        if _intact(run, f, whole):
            run.count(f, kept=True)
            return
        # Every file appears at its name only once complete (`write_whole`), so a copy running
        # at the same time, or killed, never leaves a partial file under a name a commit counts.
        if f.kind == "index":
            storage.put(key, f.data)
        else:
            strategy.write_whole(key, [whole] if whole is not None else _pieces(run, run.src, run.src.name, f))
        if storage.size(key) != f.size:
            raise CheckpointError(f"{run.dst.path}: {f.rel!r} has {storage.size(key)} bytes after its copy, "
                                  f"expected {f.size}")
    except (CheckpointError, _Stopped):
        raise
    except OSError as e:
        raise CheckpointError(f"copying {run.src.path} to {run.dst.path}: {f.rel!r} at the destination: {e}") from e
    run.count(f, kept=False)


def _each(run: _Run, files: list[_File], threads: int, fn: Callable[[_File], None]) -> None:
    """`fn` on every file, `threads` at a time; the first failure stops the rest and is raised."""
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="cairn-copy") as pool:
        futures = [pool.submit(fn, f) for f in files]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((x for x in futures if x in done and x.exception() is not None), None)
        if failed is not None:
            run.stop.set()
            for x in futures:
                x.cancel()
            wait(futures)
            raise failed.exception()  # type: ignore[misc]


# ---------------------------------------------------------------------- the copy

_FORMAT_NAMES = {"dcp": "PyTorch DCP", "orbax": "Orbax", "safetensors": "safetensors"}


def refuse_foreign(loc: Location, verb: str = "cp") -> None:
    """Raise a `CheckpointNotFoundError` that says what `loc` is when it is another format's checkpoint
    (Orbax, DCP, safetensors: `ls` and `inspect` read them; a copy, which checks cairn's checksums and
    commits with cairn's manifest, cannot)."""
    from .._sources.registry import detect

    found = detect(loc)
    if found not in (None, "cairn"):
        raise _refusal(loc, found, verb)


def _opened(loc: Location, verb: str) -> CairnSource:
    """The cairn checkpoint at `loc`, opened as every load opens one; another format's is refused."""
    from .._sources.registry import open_source

    src = open_source(loc)
    if isinstance(src, CairnSource):
        return src
    raise _refusal(loc, src.format_name, verb)


def _refusal(loc: Location, found: str, verb: str) -> CheckpointNotFoundError:
    name = _FORMAT_NAMES.get(found, found)
    return CheckpointNotFoundError(
        f"{loc.path} is a{'n' if name[0] in 'AEIOU' else ''} {name} checkpoint, not a cairn one: cairn {verb} "
        f"{'moves' if verb == 'mv' else 'copies'} cairn checkpoints (manifest, checksums, atomic commit). To "
        f"{'move' if verb == 'mv' else 'copy'} it as it is, use your storage's "
        f"tools (cp -r, aws s3 cp --recursive, gsutil cp -r); to make a cairn checkpoint of it, "
        f"`cairn convert {loc.path} DST --to cairn` (then `cairn {verb}` works on DST)")


def copy(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    move: bool = False,
    verify: bool = True,
    budget_bytes: int = DEFAULT_BUDGET,
    threads: int = 8,
    storage_options: dict | None = None,
    dst_storage_options: dict | None = None,
    on_total: Callable[[int], None] | None = None,
    progress: Callable[[int], None] | None = None,
    compression: str | bool | None = None,
    keep_references: bool = False,
) -> CopyStats:
    """Copy the committed checkpoint at `src` to `dst` (any two stores), streamed, verified, resumable.

    Nothing is visible at `dst` until every file is there; the manifest is
    written last, through the destination's commit protocol. A copy that was
    interrupted resumes when called again: complete files are kept. An
    identical checkpoint already committed at `dst` (a finished copy) is only
    checked. Anything else committed there is kept unless `overwrite`.

    `move=True` then reads the destination back, checks it and deletes the
    source. A checkpoint that others beside it name as their base (incremental
    saves) is not moved: that would break them; the error names them. `verify` checks every block checksum of the data copied (off:
    sizes only). At most `budget_bytes` of data are held at once, in pieces
    of up to 16 MiB, `threads` files at a time. `storage_options` are the
    source's (and, unless `dst_storage_options`, the destination's).

    `compression` None (the default) copies the stored bytes as they are,
    compressed or not, except from an incremental checkpoint (one saved with
    a `base`): that copy is self-contained, every array read through its
    references and written anew, raw (unless `keep_references`). Anything else (as for `cairn.save`: "auto", True,
    "fast", False, "zstd", "planes", "blosc2", "blosc2-lz4") recompresses: every array is read (every
    checksum verified) and written anew at `dst` with that setting, chunk by
    chunk in slabs of a quarter of `budget_bytes`, keeping each array's
    chunks, sharding record and key implementation, user objects,
    per-process values and the metadata. That does not resume.

    `keep_references=True` copies an incremental checkpoint as it is, with
    its references, and so first copies (as they are) the base checkpoints it
    refers to, directly or through each other, beside `dst` under their own
    names, bases first: every copy, once committed, loads. A base already
    copied there is only checked; another checkpoint under a base's name, or
    a base missing beside `src`, is refused before that base is written
    (`CopyStats.bases` names the bases).

    Raises `CheckpointNotFoundError` (nothing committed at `src`; an Orbax,
    DCP or safetensors checkpoint there is named as such, with what to do),
    `CheckpointExistsError` (`dst` holds another checkpoint),
    `CorruptCheckpointError` (the source fails a check; the partial copy is
    removed) or `CheckpointError` (a read or write failed; calling again
    resumes). The source is never changed, except deleted by a move that succeeded.

        cairn.copy("/ckpt/run1/step_00001000", "s3://bucket/run1/step_00001000")
        cairn.copy("/ckpt/run1/step_00001005", "/backup/run1/step_00001005", keep_references=True)
    """
    settled = _settled.get()
    settled = set() if settled is None else settled
    t0 = time.perf_counter()
    tracker = Progress("move" if move else "copy", str(dst))  # "progress" events for listeners that ask
    on_total, progress = tracker.wrap(on_total, progress)
    # A recompressing copy is a save: its options are checked before anything is read.
    recompress = SaveOptions(overwrite=overwrite, compression=compression) if compression is not None else None
    s = resolve(src, storage_options)
    d = resolve(dst, storage_options if dst_storage_options is None else dst_storage_options)
    if (s.storage.url, s.name) == (d.storage.url, d.name):
        raise CheckpointError(f"{d.path}: the source and the destination are the same checkpoint")
    if recompress is not None and move:
        raise ValueError("move=True copies stored bytes as they are: pass no compression")
    source = _opened(s, "mv" if move else "cp")
    if recompress is not None:
        if keep_references:
            raise ValueError("keep_references=True copies stored bytes as they are: pass no compression")
        done = _recompress(source, d, compression, overwrite, t0, budget_bytes, threads, progress)
        tracker.finish()
        return done
    # Incremental (format 4): blocks in a base's files are read through their references, and the copy
    # is self-contained (raw blocks): its bytes copied as they are would refer to files beside `src`.
    bases = source.manifest.bases
    if keep_references and move:
        raise ValueError("keep_references=True copies a chain; a move (which deletes its source) takes none")
    if move and _settled.get() is None:  # (a run's move, `cairn mv DIR`, checks its steps at once first)
        refuse_replacing_a_base(s, "moving", "copy it (cairn cp), move the whole folder (cairn mv DIR)")
    chain: list[tuple[Location, Location]] = []
    named: tuple[str, ...] = ()  # every base beside the copy, settled ones included
    if bases and keep_references:
        whole_chain = _chain(s, d)
        named = tuple(bd.name for _, bd in whole_chain)
        chain = [(bs, bd) for bs, bd in whole_chain if bd.name not in settled]
    elif bases:
        if move:
            raise CheckpointError(f"{s.path} refers to its base checkpoints (an incremental save): move=True "
                                  "would copy references; copy it (a self-contained copy), then delete it")
        done = _recompress(source, d, False, overwrite, t0, budget_bytes, threads, progress)
        tracker.finish()
        return done
    if not chain:
        done = _copy_as_is(s, d, overwrite, move, verify, budget_bytes, threads, on_total, progress, t0, source.raw)
        settled.add(d.name)
        done.bases = named
        tracker.finish()
        return done
    # Bases first, each committed before any checkpoint that refers to it (the commit rule of §6.5).
    copied: list[str] = []
    totals: list[int] = []

    def whole(n: int) -> None:  # one total for the chain: each checkpoint's copy adds its own
        totals.append(n)
        if on_total is not None:
            on_total(sum(totals))

    files = nbytes = kept_files = kept_bytes = 0
    for bs, bd in chain:
        try:
            one = _copy_as_is(bs, bd, False, False, verify, budget_bytes, threads, whole, progress, t0)
        except CheckpointExistsError:
            raise CheckpointExistsError(
                f"{bd.path} holds another checkpoint than {bs.path}, which {s.path} refers to (a base of "
                f"the chain copied with keep_references=True): references resolve by name beside the copy, "
                "so it cannot be copied there; copy into another folder, or without keep_references "
                "(a self-contained copy)") from None
        copied.append(bd.name)
        files, nbytes = files + one.files_copied, nbytes + one.bytes_copied
        kept_files, kept_bytes = kept_files + one.files_kept, kept_bytes + one.bytes_kept
    done = _copy_as_is(s, d, overwrite, False, verify, budget_bytes, threads, whole, progress, t0, source.raw)
    settled.update((*copied, d.name))
    done.bases = named
    done.files_copied, done.bytes_copied = done.files_copied + files, done.bytes_copied + nbytes
    done.files_kept, done.bytes_kept = done.files_kept + kept_files, done.bytes_kept + kept_bytes
    tracker.finish()
    return done


#: The checkpoints the copies of one run (`one_run`) have copied and checked so far, by name beside their
#: destinations; None outside a run.
_settled: ContextVar[set[str] | None] = ContextVar("cairn_copy_settled", default=None)


@contextmanager
def one_run() -> Iterator[None]:
    """Copies made inside (a run's steps, copied in order by ``cairn cp --keep-references``) share what
    they copied: a later copy's chain skips the bases an earlier one already copied and checked, rather
    than read each of them again."""
    token = _settled.set(set())
    try:
        yield
    finally:
        _settled.reset(token)


def _chain(s: Location, d: Location) -> list[tuple[Location, Location]]:
    """Every base checkpoint `s` refers to, directly or through its bases, as (source, destination) pairs
    in an order that puts each base before the checkpoints that refer to it. Checkpoints already where
    they would be copied to (`d` beside `s`) are left out. A base missing at the source is refused."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1: being visited, 2: done

    def visit(name: str, referrer: Location) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise CorruptCheckpointError(f"{referrer.path}: its bases refer to each other in a cycle "
                                         f"through {name!r}")
        state[name] = 1
        here = sibling(s, name)
        try:
            bases = read_manifest(here).bases
        except CheckpointNotFoundError:
            raise CorruptCheckpointError(
                f"{referrer.path} refers to the base checkpoint {name!r}, which is not committed at "
                f"{here.path}: the chain cannot be copied with its references (keep_references=True) "
                "without it") from None
        for b in bases:
            visit(b, here)
        state[name] = 2
        order.append(name)

    for b in read_manifest(s).bases:
        visit(b, s)
    if d.name in order:
        raise CheckpointError(f"{d.path}: {s.path} refers to a base checkpoint of that name "
                              f"({d.name!r}): a copy with its references needs it beside the copy")
    same_folder = s.storage.url == d.storage.url
    return [(sibling(s, n), sibling(d, n)) for n in order if not same_folder]


def _copy_as_is(s: Location, d: Location, overwrite: bool, move: bool, verify: bool, budget_bytes: int,
                threads: int, on_total: Callable[[int], None] | None, progress: Callable[[int], None] | None,
                t0: float, raw: bytes | None = None) -> CopyStats:
    """`copy` of the stored bytes as they are (every file the manifest names, streamed and checked);
    `raw`: the source's manifest bytes, when read already."""
    if budget_bytes < 2 * MIN_PIECE:
        raise ValueError(f"budget_bytes={budget_bytes} is below the minimum of {2 * MIN_PIECE}")
    # Two pieces per file in flight: the one the writer is taking, the next one being read.
    threads = max(1, threads)
    piece = min(PIECE_BYTES, max(MIN_PIECE, budget_bytes // (2 * threads)))
    threads = max(1, min(threads, budget_bytes // (2 * piece)))
    raw = raw if raw is not None else manifest_bytes(s)
    token, files = _plan(s, raw)
    stats = CopyStats(s.path, d.path)
    strategy = strategy_for(d.storage)
    try:
        there: bytes | None = manifest_bytes(d)
    except CheckpointError:
        there = None
    finished = there == raw and not overwrite
    if on_total is not None:
        on_total(sum(f.size for f in files) * (2 if move and verify and not finished else 1))
    if finished:
        # A finished copy (a move interrupted before it deleted its source): check it, copy nothing.
        _check_copy(_Run(s, d, d.name, verify, piece, stats, progress), files, threads)
        stats.files_kept, stats.bytes_kept = stats.files_kept + 1, stats.bytes_kept + len(raw)
    else:
        if there is not None and not overwrite:
            raise CheckpointExistsError(f"{d.path} already holds a checkpoint; pass overwrite=True to replace it")
        strategy.check_destination(d, overwrite)
        root = strategy.attempt_root(d.name, token)
        run = _Run(s, d, root, verify, piece, stats, progress)
        try:
            _each(run, files, threads, lambda f: _copy_file(run, f, strategy))
        except CorruptCheckpointError:
            # Never remove files that the checkpoint committed there (same save, copied before) may share.
            if strategy.name == "rename" or there is None or fmt.index_name(token).encode() not in there:
                strategy.abort(d, token)
            raise
        needed = [f"{root}/{f.rel}" for f in files]
        # Stray files of an earlier attempt (a temporary file of an interrupted put) stay out of the checkpoint.
        strays = sorted(set(d.storage.list(root)) - {*needed, f"{root}/{fmt.MANIFEST}"}) if strategy.name == "rename" else []
        strategy.commit(d, token, raw, needed, overwrite=overwrite, discard=strays)
        run.count(_File(fmt.MANIFEST, len(raw), "manifest"), kept=False)
        if move and verify:
            _check_copy(_Run(s, d, d.name, verify, piece, CopyStats(s.path, d.path), progress), files, threads)
    if move:
        strategy_for(s.storage).delete(s.name)
        stats.moved = True
    stats.seconds = time.perf_counter() - t0
    return stats


def _recompress(src: CairnSource, d: Location, compression: str | bool | None, overwrite: bool, t0: float,
                budget_bytes: int = DEFAULT_BUDGET, threads: int = 8,
                progress: Callable[[int], None] | None = None) -> CopyStats:
    """`copy` with another `compression`: each chunk of each array read (checked) slab by slab and written
    anew at `d` (`_save.stream.StreamWriter`), never a whole state in memory. The copy keeps each array's
    grid of chunks, its sharding record, a typed key's implementation, user objects and per-process values
    (the structure is the source's): it differs from the source only in how its blocks are stored (and in
    having one data file per item)."""
    from .._exports.convert import exact_slabs
    from .._load.reader import make_reader, read_box, slab_boxes, slab_bytes
    from .._save.codecpolicy import resolve_compression
    from .._save.stream import Chunked, StreamWriter

    codec = resolve_compression(compression, d.storage)
    ck = src.opened()
    s, manifest = ck.loc, ck.manifest
    class _Cell:  # one chunk of a source array, as a `SlabSource`: C-order slabs read through the load's reader
        def __init__(self, reader: Any, leaf: fmt.ArrayLeaf, box: tuple[tuple[int, int], ...]):
            self.reader, self.leaf, self.box, self.dtype = reader, leaf, box, leaf.dtype
            self.shape = tuple(hi - lo for lo, hi in box)
            self.nbytes = math.prod(self.shape) * leaf.dtype.itemsize

        def slabs(self, slab: int) -> Iterator[np.ndarray]:
            def pieces() -> Iterator[np.ndarray]:
                for sub in slab_boxes(self.shape, self.dtype.itemsize, slab):
                    at = tuple((lo + o, hi + o) for (lo, hi), (o, _) in zip(sub, self.box))
                    yield read_box(self.reader, self.leaf, at, pool)
            return exact_slabs(pieces(), self.nbytes, slab)

    def source(reader: Any, leaf: fmt.ArrayLeaf) -> tuple[Any, dict[str, Any]]:
        cells: list[Any] = [_Cell(reader, leaf, leaf.chunk_box(c)) for c in range(math.prod(leaf.grid_shape))]
        extra = {"sharding": leaf.sharding, "handler": leaf.handler, "impl": leaf.impl, "impl_shape": leaf.impl_shape}
        return Chunked(leaf.dtype, leaf.shape, leaf.grid, cells), extra

    slab = slab_bytes(budget_bytes)
    stats = CopyStats(s.path, d.path)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="cairn-recompress") as pool, \
            ThreadPoolExecutor(max(1, min(threads, os.cpu_count() or 1)), thread_name_prefix="cairn-code") as coders:
        writer = StreamWriter(d, fmt.DEFAULT_BLOCK_SIZE, codec, overwrite=overwrite, pool=coders)
        try:
            for name, index in ck.indexes.items():
                reader = make_reader(ck, name, pool)
                try:
                    leaves: list[Any] = [
                        leaf if isinstance(leaf, fmt.ValueLeaf) else (leaf.kind, leaf.path, *source(reader, leaf))
                        for leaf in index.leaves
                    ]
                    writer.write_item(name, manifest.root, index.structure, leaves, slab, progress)
                finally:
                    reader.close()
            writer.commit(manifest.root, manifest.metadata, manifest.process_count)
        except BaseException:
            writer.abort()
            raise
    stats.files_copied, stats.bytes_copied = len(writer.needed) + 1, writer.bytes_written  # + the manifest
    stats.seconds = time.perf_counter() - t0
    return stats


def _check_copy(run: _Run, files: list[_File], threads: int) -> None:
    """Read the committed copy at `run.dst` back; `CorruptCheckpointError` names what is wrong."""
    bad: list[str] = []

    def one(f: _File) -> None:
        whole = f.data if f.kind == "index" else _source_part(run, f) if f.kind == "part" else None
        if not _intact(run, f, whole):
            bad.append(f.rel)
        run.count(f, kept=True)

    _each(run, files, threads, one)
    if bad:
        raise CorruptCheckpointError(f"{run.dst.path}: the committed copy there does not match its source "
                                     f"{run.src.path}: {sorted(bad)[0]!r} ({len(bad)} files in all); the source "
                                     "is kept (copy again with overwrite=True)")


# ---------------------------------------------------------------------- command line


def add_commands(sub: Any, parse_bytes: Callable[[str], int]) -> None:
    """Register ``cairn cp`` and ``cairn mv`` on the CLI's subparsers."""
    for name, move, what in (("cp", False, "copy"), ("mv", True, "move")):
        s = sub.add_parser(name, help=f"{what} a committed checkpoint to another path or store (streamed, "
                                      "verified; resumes an interrupted " + what + ")")
        s.add_argument("src")
        s.add_argument("dst")
        s.add_argument("--overwrite", action="store_true", help="replace a checkpoint committed at DST")
        s.add_argument("--no-verify", action="store_true", help="check sizes only, not every block checksum")
        s.add_argument("--budget", type=parse_bytes, default=DEFAULT_BUDGET,
                       help="memory budget for data in flight (default 256M)")
        s.add_argument("--threads", type=int, default=8, help="files copied at once (default 8)")
        if not move:
            s.add_argument("--compression", default=None,
                           choices=["auto", "true", "fast", "false", "none", "zstd", "planes", "blosc2", "blosc2-lz4"],
                           help="recompress (every array read and written anew, slab by slab): auto, true (a "
                                "codec per leaf), fast (true with the blosc2 codecs: readers need the fast extra), false/none, "
                                "zstd, planes, blosc2, blosc2-lz4. Default: copy stored "
                                "bytes as they are")
            s.add_argument("--keep-references", action="store_true",
                           help="an incremental checkpoint: copy it as it is, with the base checkpoints it refers "
                                "to (copied beside DST under their names, bases first). Default: a self-contained "
                                "copy")
        s.add_argument("--json", action="store_true")
        s.set_defaults(fn=run_copy, move=move)


def run_copy(args: argparse.Namespace, out: Any) -> int:
    with out.progress("moving" if args.move else "copying", None) as (set_total, advance):
        comp = getattr(args, "compression", None)
        comp = {"true": True, "false": False}.get(comp, comp) if comp is not None else None
        stats = copy(args.src, args.dst, overwrite=args.overwrite, move=args.move, verify=not args.no_verify,
                     budget_bytes=args.budget, threads=args.threads, on_total=set_total, progress=advance,
                     compression=comp, keep_references=getattr(args, "keep_references", False))
    if args.json:
        print(json.dumps(stats.as_dict(), indent=2))
        return 0
    kept = f", {stats.files_kept} already there" if stats.files_kept else ""
    kept += f"; with its bases {', '.join(stats.bases)}" if stats.bases else ""
    out.line(f"{'moved' if stats.moved else 'copied'} {stats.src} -> {stats.dst}: {stats.files_copied} files, "
             f"{stats.bytes_copied / (1 << 20):.1f} MiB{kept}{'; checksums verified' if not args.no_verify else ''}")
    return 0
