"""Whole-checkpoint reads for tools: full verification and comparison.

`verify` reads every byte of every chunk and checks every block checksum
(in parallel, a few MiB per task, so memory stays small whatever the size),
and also checks what the metadata promises about the files: that each data
file exists and has its recorded size, and that the manifest's totals match
the indexes. It reports every problem it finds instead of stopping at the
first, so one run names every corrupt chunk.

`diff` compares two checkpoints leaf by leaf, streaming both arrays in
matching slabs, and never holds more than two slabs of each leaf at once.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from .._core.buffers import as_view
from .._core.checksum import BlockChecks, crc32c, mismatch
from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .._format import manifest as fmt
from .._format import values
from .._load.reader import base_problem, make_reader, read_box, slab_boxes, slab_bytes
from .._load.source import CairnSource
from .._read.metadata import read_index
from .._storage.location import Location, resolve
from .._tree.pytree import display_path
from .base import FormatSource

PIECE_BYTES = 8 << 20  # bytes read and checked per task


@dataclass
class Problem:
    """One thing wrong with a checkpoint, located as precisely as possible."""

    message: str
    item: str | None = None
    leaf: str | None = None
    file: str | None = None
    chunk: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class VerifyReport:
    path: str
    problems: list[Problem] = field(default_factory=list)
    bytes_checked: int = 0
    chunks_checked: int = 0
    files: int = 0
    leaves: int = 0
    format: str = "cairn"  # another format's checkpoint (Orbax, DCP, safetensors): read whole, no checksums

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class _Task:
    """One verification task: chunk bytes ``lo..hi`` (whole checksum blocks) of one leaf."""

    item: str
    index: fmt.ItemIndex
    leaf: fmt.ArrayLeaf
    cell: int
    lo: int
    hi: int
    reader: Any


def bad_blocks(buf: Any, lo: int, hi: int, off: int, crcs: Sequence[int], block: int) -> list[str]:
    """What is wrong with chunk bytes ``lo..hi`` (whole checksum blocks, held in `buf`): one message per
    block whose CRC-32C is not the stored one in `crcs`. `off` is the chunk's offset in its file."""
    bad: list[str] = []

    def note(c: tuple[int, int, int], got: int) -> None:
        bad.append(mismatch(f"block {c[0] // block} (file bytes {off + c[0]}..{off + c[1]})", c[2], got))

    checks = [(b * block, min((b + 1) * block, hi), crcs[b]) for b in range(lo // block, -(-hi // block))]
    BlockChecks(checks, [buf], lo, note).rest()
    return bad


def _check_coded(leaf: fmt.ArrayLeaf, cell: int, off: int, block: int, reader: Any) -> list[str]:
    """What is wrong with compressed chunk `cell`: each stored block's CRC-32C, then that it decodes to its
    raw size (format version 3)."""
    from .._codecs import codecs

    sizes = leaf.stored_sizes(cell, block)
    buf = np.empty(sum(sizes), dtype=np.uint8)
    try:
        reader.read_into(off, as_view(buf))
    except EOFError:
        return [f"stored bytes {off}..{off + buf.nbytes} lie past the end of the file"]
    except OSError as e:
        return [f"reading stored bytes {off}..{off + buf.nbytes} failed: {e}"]
    bad = []
    pos, raw_left = 0, leaf.chunk_nbytes(cell)
    for b, n in enumerate(sizes):
        sb = buf[pos : pos + n]
        got = crc32c(sb)
        if got != leaf.crcs[cell][b]:
            bad.append(mismatch(f"block {b} (stored file bytes {off + pos}..{off + pos + n})", leaf.crcs[cell][b], got))
        else:
            try:
                codecs.decode(leaf.codec, sb, leaf.dtype, min(block, raw_left))
            except CorruptCheckpointError as e:
                bad.append(f"block {b}: {e}")
        pos += n
        raw_left -= block
    return bad


def describe_chunk(leaf: fmt.ArrayLeaf, cell: int) -> str:
    """``leaf 'w' chunk 3 [0:2, 0:4]``: a chunk as messages name it."""
    region = "[" + ", ".join(f"{a}:{b}" for a, b in leaf.chunk_box(cell)) + "]"
    return f"leaf {display_path(leaf.path)!r} chunk {cell} {region}"


def _where(item: str, root: bool) -> str:
    return "" if root else f" [{item}]"


def _foreign(loc: Location) -> str | None:
    """The format of the checkpoint at `loc` when it is not cairn's (None: cairn's, or nothing known)."""
    from .._sources.registry import detect

    found = detect(loc)
    return None if found in (None, "cairn") else found


def verify_foreign(src: FormatSource, threads: int = 8, on_total: Callable[[int], None] | None = None,
                   progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Read every array of an Orbax, DCP or safetensors checkpoint through the reader a load uses.

    These formats carry no checksums, so this shows that the checkpoint is
    complete and readable (its metadata parses, every file holds the bytes
    it should, every array decodes), not that its values are the ones saved;
    converting once (``cairn convert SRC DST --to cairn``) gives checksums.
    Problems are collected per leaf, as for a cairn checkpoint.
    """
    from .._load.reader import LoadStats

    f, loc, format = src.format, src.loc, src.format_name
    report = VerifyReport(loc.path, format=format)
    if format == "orbax":  # its arrays are zarr folders, read through tensorstore below
        report.files = len(f.files)
    for fi in f.files if format != "orbax" else ():
        report.files += 1
        try:
            size = f.loc.storage.size(f.loc.key(fi.name))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            report.problems.append(Problem(f"{loc.path}: data file {fi.name!r} is missing", file=fi.name))
            continue
        if size < fi.size:
            report.problems.append(Problem(f"{loc.path}: data file {fi.name!r} is truncated: {size} bytes, its "
                                           f"tensors need {fi.size}", file=fi.name))
    arrays = [(name, leaf) for name, index in src.indexes.items() for leaf in index.leaves
              if isinstance(leaf, fmt.ArrayLeaf)]
    if on_total is not None:
        on_total(sum(leaf.nbytes for _, leaf in arrays))
    slab = slab_bytes(4 * PIECE_BYTES)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="cairn-verify") as pool:
        for name, index in src.indexes.items():
            report.leaves += len(index.leaves)
            reader = src.reader(name, index, False, pool, LoadStats())
            try:
                for leaf in index.leaves:
                    if not isinstance(leaf, fmt.ArrayLeaf):
                        continue
                    shown = display_path(leaf.path, name)
                    try:
                        if leaf.kind == "bytes":
                            n = len(reader.read_bytes(leaf))
                            report.bytes_checked += n
                            if progress is not None:
                                progress(n)
                            continue
                        for arr in src.slabs(reader, leaf, slab, pool):
                            report.bytes_checked += arr.nbytes
                            if progress is not None:
                                progress(arr.nbytes)
                        report.chunks_checked += len(leaf.chunks)
                    except (CheckpointError, OSError, EOFError, ValueError) as e:
                        report.problems.append(Problem(f"{loc.path}: leaf {shown!r} cannot be read: {e}",
                                                       item=name or None, leaf=leaf.path))
            finally:
                reader.close()
    return report


def plan_verify(src: CairnSource) -> tuple[fmt.Manifest, dict[str, fmt.ItemIndex], list[Problem]]:
    """Read every index of the opened checkpoint `src`, collecting metadata problems."""
    loc, manifest = src.loc, src.manifest
    indexes: dict[str, fmt.ItemIndex] = {}
    problems: list[Problem] = []
    for name, info in manifest.items.items():
        try:
            index = read_index(loc, info)
        except CorruptCheckpointError as e:
            problems.append(Problem(str(e), item=name))
            continue
        indexes[name] = index
        nbytes = sum(leaf.nbytes for leaf in index.leaves if isinstance(leaf, fmt.ArrayLeaf))
        if nbytes != info.nbytes or len(index.leaves) != info.num_leaves:
            problems.append(Problem(
                f"{loc.path}{_where(name, manifest.root)}: the manifest promises {info.num_leaves} leaves of "
                f"{info.nbytes} bytes, the index holds {len(index.leaves)} leaves of {nbytes} bytes", item=name,
            ))
    return manifest, indexes, problems


def _open_files(loc: Any, info: fmt.ItemInfo, index: fmt.ItemIndex, where: str, name: str, report: VerifyReport,
                problems: list[Problem]) -> dict[int, Any]:
    """A reader of each data file of `index` that is there (file number -> reader); each missing or
    mis-sized file a problem, and each base whose references a load refuses (`base_problem`)."""
    opened: dict[int, Any] = {}
    bad_bases = {b: p for b in {f.base for f in index.files if f.base is not None}
                 if (p := base_problem(loc.storage, loc.path, b, info.dir)) is not None}
    for _b, p in sorted(bad_bases.items()):
        problems.append(Problem(p, item=name))
    for fi, f in enumerate(index.files):
        key = loc.key(info.dir, f.name)
        if f.base is not None:  # incremental (format 4): a file of a sibling base checkpoint
            if f.base in bad_bases:
                continue  # its references are refused (named above), as a load refuses them
            key = "/".join((f.base, info.dir, f.name))
        report.files += 1
        try:
            size = loc.storage.size(key)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            of = f" of its base checkpoint {f.base!r}" if f.base is not None else ""
            problems.append(Problem(f"{where}: data file {f.name!r}{of} is missing", item=name, file=f.name))
            continue
        if size < f.size:
            problems.append(Problem(
                f"{where}: data file {f.name!r} is truncated: {size} bytes, the index records {f.size}",
                item=name, file=f.name,
            ))
        elif size > f.size:
            problems.append(Problem(
                f"{where}: data file {f.name!r} has {size} bytes, the index records {f.size}",
                item=name, file=f.name,
            ))
        opened[fi] = loc.storage.open_read(key)
    return opened


def _chunk_tasks(name: str, index: fmt.ItemIndex, opened: dict[int, Any]) -> list[_Task]:
    """The checking tasks of every chunk of `index` whose file is open: a version-4 chunk whole (every
    block, references too, hashed), a coded chunk whole, a raw one in pieces of whole blocks."""
    tasks: list[_Task] = []
    for leaf in index.leaves:
        if not isinstance(leaf, fmt.ArrayLeaf):
            continue
        for cell, (fi, _off) in enumerate(leaf.chunks):
            size = leaf.chunk_nbytes(cell)
            if size and index.version >= fmt.INCREMENTAL_VERSION:  # every block, references too, hashed
                tasks.append(_Task(name, index, leaf, cell, 0, size, opened))
                continue
            if size == 0 or fi not in opened:
                continue
            if leaf.codec != "none":  # one task per chunk: its stored blocks, checked and decoded
                tasks.append(_Task(name, index, leaf, cell, 0, size, opened[fi]))
                continue
            # Pieces are whole blocks, so each block's CRC is checked within one task.
            step = max(index.block_size, PIECE_BYTES // index.block_size * index.block_size)
            for lo in range(0, size, step):
                tasks.append(_Task(name, index, leaf, cell, lo, min(size, lo + step), opened[fi]))
    return tasks


def verify(
    path: str | os.PathLike[str],
    *,
    threads: int = 8,
    storage_options: dict | None = None,
    on_total: Callable[[int], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Read the whole checkpoint at `path` and check every checksum; never raises for corruption.

    Raises `CheckpointNotFoundError` if nothing is committed at `path` and
    `CorruptCheckpointError` if its manifest cannot be parsed; every other
    problem is collected into the report. `on_total(bytes)` is called once
    with the number of bytes to check, `progress(bytes)` as they are checked.
    A checkpoint of another format (Orbax, PyTorch DCP, safetensors) is
    checked as `verify_foreign` says.
    """
    from .._sources.registry import open_source

    loc = resolve(path, storage_options)
    try:
        src = open_source(loc)
    except CheckpointNotFoundError:
        raise  # nothing to verify: the caller reports it
    except (CorruptCheckpointError, OSError, EOFError) as e:
        found = _foreign(loc)  # another format's broken metadata or file layout is a problem of its report
        if found is None:
            raise
        return VerifyReport(loc.path, [Problem(f"{loc.path}: {found} checkpoint: {e}")], format=found)
    if isinstance(src, FormatSource):  # another format's: no checksums, every array read
        return verify_foreign(src, threads, on_total, progress)
    manifest, indexes, problems = plan_verify(cast(CairnSource, src))
    report = VerifyReport(loc.path, problems)
    lock = threading.Lock()
    tasks: list[_Task] = []
    readers: list[Any] = []
    for name, index in indexes.items():
        info = manifest.items[name]
        where = f"{loc.path}{_where(name, manifest.root)}"
        opened = _open_files(loc, info, index, where, name, report, problems)
        readers.extend(opened.values())
        if index.table is not None:  # format 2: every record of the binary index parts, checked
            try:
                index.table.fetch_all()
            except CheckpointError as e:
                problems.append(Problem(str(e), item=name))
                continue
        report.leaves += len(index.leaves)
        tasks.extend(_chunk_tasks(name, index, opened))
    if on_total is not None:
        on_total(sum(t.hi - t.lo for t in tasks))
    bad_chunks: dict[tuple[str, str, int], list[str]] = {}

    def check(task: _Task) -> None:
        name, index, leaf, cell, lo, hi, reader = (
            task.item, task.index, task.leaf, task.cell, task.lo, task.hi, task.reader)
        _fi, off = leaf.chunks[cell]
        block = index.block_size
        bad: list[str] = []
        if index.version >= fmt.INCREMENTAL_VERSION:  # format 4: `_load.blocks.check_chunk`
            from .._load.blocks import check_chunk

            bad = check_chunk(leaf, cell, block, list(index.files), reader)
        elif leaf.codec != "none":
            bad = _check_coded(leaf, cell, off, block, reader)
        else:
            buf = np.empty(hi - lo, dtype=np.uint8)
            try:
                reader.read_into(off + lo, as_view(buf))
            except EOFError:
                bad.append(f"bytes {off + lo}..{off + hi} lie past the end of the file")
            except OSError as e:
                bad.append(f"reading bytes {off + lo}..{off + hi} failed: {e}")
            else:
                bad.extend(bad_blocks(buf, lo, hi, off, leaf.crcs[cell], block))
        with lock:
            report.bytes_checked += hi - lo
            if bad:
                bad_chunks.setdefault((name, leaf.path, cell), []).extend(bad)
        if progress is not None:
            progress(hi - lo)

    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="cairn-verify") as pool:
            list(pool.map(check, tasks))
    finally:
        for r in readers:
            with contextlib.suppress(Exception):
                r.close()
    report.chunks_checked = len({(t.item, t.leaf.path, t.cell) for t in tasks})
    for (name, lpath, cell), bad in sorted(bad_chunks.items()):
        index = indexes[name]
        leaf = next(x for x in index.leaves if x.path == lpath)
        assert isinstance(leaf, fmt.ArrayLeaf)
        fname = index.files[leaf.chunks[cell][0]].name
        problems.append(Problem(
            f"{loc.path}{_where(name, manifest.root)}: {describe_chunk(leaf, cell)} in {fname!r} is corrupt: "
            + "; ".join(bad[:3]) + (f"; and {len(bad) - 3} more blocks" if len(bad) > 3 else ""),
            item=name, leaf=lpath, file=fname, chunk=cell,
        ))
    return report


# ---------------------------------------------------------------------- diff


@dataclass
class DiffEntry:
    item: str
    path: str
    status: str  # "equal" | "only in A" | "only in B" | "changed type" | "values changed"
    detail: str = ""
    max_abs_diff: float | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"item": self.item, "path": self.path, "status": self.status}
        if self.detail:
            out["detail"] = self.detail
        if self.max_abs_diff is not None:
            out["max_abs_diff"] = self.max_abs_diff
        return out


def _describe_leaf(leaf: fmt.Leaf) -> str:
    if isinstance(leaf, fmt.ArrayLeaf):
        if leaf.kind == "prng_key":
            return f"key<{leaf.impl}>[{','.join(map(str, leaf.key_shape))}]"
        if leaf.kind != "array":
            return f"{leaf.kind}[{leaf.nbytes}]"
        return f"{values.dtype_name(leaf.dtype)}[{','.join(map(str, leaf.shape))}]"
    text = repr(leaf.value)
    return f"{leaf.kind} {text if len(text) <= 40 else text[:37] + '...'}"


class _Side:
    """One checkpoint of a diff, of any format `cairn.load` reads: its leaves by full key path, and its bytes.

    A cairn checkpoint's reads verify their checksums; another format's are read
    as a load reads them (a `Source`: byte ranges, or tensorstore for Orbax).
    Full key paths (the checkpointable's name first) let a checkpoint of named
    checkpointables be compared with one tree holding the same keys (Orbax's
    ``StandardCheckpointer`` output against ``cairn.save(p, {"params": ...})``).
    """

    def __init__(self, path: str | os.PathLike[str], storage_options: dict | None):
        from .._sources.registry import open_source

        src = open_source(resolve(path, storage_options))
        self.src: Any = None
        if isinstance(src, CairnSource):
            self.ck: Any = src.opened()
            indexes = self.ck.indexes
        else:
            self.src = src
            indexes = self.src.indexes
        self.format = src.format_name
        self.leaves: dict[str, tuple[str, fmt.Leaf]] = {}
        for name, index in indexes.items():
            for leaf in index.leaves:
                self.leaves[display_path(leaf.path, name)] = (name, leaf)
        self._indexes = indexes
        self._readers: dict[str, Any] = {}
        # The full key paths of empty nodes of the tree (optax's ``EmptyState()``, ``{}``, ``()``), which
        # Orbax stores as a None leaf: `diff` matches the two, as `cairn.load` does.
        self.hollows: set[str] = set()
        for name, index in indexes.items():
            self._walk_hollows(getattr(index, "structure", None), "", name)

    def _walk_hollows(self, node: Any, path: str, item: str) -> None:
        from .._format.structure import child_path, children

        if not isinstance(node, dict) or "leaf" in node or "per_process" in node:
            return
        pairs = children(node)
        if not pairs:
            self.hollows.add(display_path(path, item))
        for k, v in pairs:
            self._walk_hollows(v, child_path(path, k), item)

    def read(self, item: str, leaf: fmt.ArrayLeaf, box: Any, pool: ThreadPoolExecutor) -> np.ndarray:
        r = self._readers.get(item)
        if r is None:
            from .._load.reader import LoadStats

            r = self._readers[item] = (make_reader(self.ck, item, pool) if self.src is None else
                                       self.src.reader(item, self._indexes[item], False, pool, LoadStats()))
        return read_box(r, leaf, box, pool) if self.src is None else self.src.format.read_box(r, leaf, box, pool)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    budget_bytes: int = 256 << 20,
    threads: int = 4,
    storage_options: dict | None = None,
) -> list[DiffEntry]:
    """Compare checkpoints `a` and `b` per key path (values compared bitwise).

    Either may be of any format `cairn.load` reads (Orbax, DCP, safetensors);
    leaves are matched by their full key path, the checkpointable's name first.
    """
    sa, sb = _Side(a, storage_options), _Side(b, storage_options)
    out: list[DiffEntry] = []
    # Two slabs from each side, plus their read buffers, fit in the budget.
    slab = slab_bytes(budget_bytes // 2)
    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="cairn-diff") as pool:
            for full in list(sa.leaves) + [p for p in sb.leaves if p not in sa.leaves]:
                x, y = sa.leaves.get(full), sb.leaves.get(full)
                either = x if x is not None else y
                assert either is not None  # (`full` is a leaf of one side at least)
                name, path = either[0], either[1].path
                if y is None and x is not None and _none(x[1]) and full in sb.hollows:
                    out.append(DiffEntry(name, path, "equal", "None in A, an empty node in B (Orbax stores one so)"))
                elif x is None and y is not None and _none(y[1]) and full in sa.hollows:
                    out.append(DiffEntry(name, path, "equal", "an empty node in A, None in B (Orbax stores one so)"))
                elif y is None:
                    out.append(DiffEntry(name, path, "only in A", _describe_leaf(either[1])))
                elif x is None:
                    out.append(DiffEntry(name, path, "only in B", _describe_leaf(y[1])))
                else:
                    out.append(_compare(name, path, x[1], y[1], lambda leaf, box, it=x[0]: sa.read(it, leaf, box, pool),
                                        lambda leaf, box, it=y[0]: sb.read(it, leaf, box, pool), slab))
    finally:
        sa.close()
        sb.close()
    return out


def _none(leaf: fmt.Leaf) -> bool:
    return isinstance(leaf, fmt.ValueLeaf) and leaf.kind == "none"


def _compare(name: str, path: str, x: fmt.Leaf, y: fmt.Leaf, ra: Callable[..., np.ndarray],
             rb: Callable[..., np.ndarray], slab: int) -> DiffEntry:
    dx, dy = _describe_leaf(x), _describe_leaf(y)
    if isinstance(x, fmt.ValueLeaf) or isinstance(y, fmt.ValueLeaf):
        if isinstance(x, fmt.ValueLeaf) and isinstance(y, fmt.ValueLeaf) and x.kind == y.kind:
            # Compared through their exact encodings, so 0.0 != -0.0 and NaN == the same NaN.
            same = values.encode_value(x.kind, x.value) == values.encode_value(y.kind, y.value)
            return DiffEntry(name, path, "equal" if same else "values changed", "" if same else f"{dx} -> {dy}")
        return DiffEntry(name, path, "changed type", f"{dx} -> {dy}")
    if x.kind != y.kind or x.dtype != y.dtype or x.shape != y.shape:
        return DiffEntry(name, path, "changed type", f"{dx} -> {dy}")
    n_diff, max_abs, nan_mismatch = 0, 0.0, False
    numeric = x.kind == "array" and x.dtype.kind in "biufcV"
    for box in slab_boxes(x.shape, x.dtype.itemsize, slab):
        sa, sb = ra(x, box), rb(y, box)
        # Element-wise bitwise comparison (exact, whatever the dtype).
        ua = sa.reshape(-1).view(np.uint8).reshape(-1, x.dtype.itemsize)
        ub = sb.reshape(-1).view(np.uint8).reshape(-1, x.dtype.itemsize)
        differs = (ua != ub).any(axis=1)
        k = int(differs.sum())
        if not k:
            continue
        n_diff += k
        if numeric:
            fa, fb = _as_float(sa.reshape(-1)[differs]), _as_float(sb.reshape(-1)[differs])
            d = np.abs(fa - fb)
            finite = ~np.isnan(d)
            nan_mismatch |= bool((~finite & ~(np.isnan(fa) & np.isnan(fb))).any())
            if finite.any():
                max_abs = max(max_abs, float(d[finite].max()))
    if n_diff == 0:
        return DiffEntry(name, path, "equal", dx)
    total = math.prod(x.shape)
    unit = "elements" if x.kind in ("array", "prng_key") else "bytes"
    detail = f"{dx}: {n_diff} of {total} {unit} differ"
    if not numeric:
        return DiffEntry(name, path, "values changed", detail)
    if nan_mismatch:
        detail += " (some NaN on one side only)"
    return DiffEntry(name, path, "values changed", detail, max_abs)


def _as_float(a: np.ndarray) -> np.ndarray:
    # float64 (complex128) so that integer differences cannot overflow.
    return a.astype(np.complex128 if a.dtype.kind == "c" else np.float64)
