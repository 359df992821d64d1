"""Reading a leaf whose blocks may be references (format version 4, docs/FORMAT.md §6.5).

A leaf marked ``refs`` has chunks some of whose checksum blocks are not in
the chunk's own bytes but in a data file of a base checkpoint (a sibling
folder or prefix). Its reads are planned in raw addressing, like a
compressed leaf's (`reader.plan_leaf_reads`): each read is whole blocks of
one chunk. Here each block is mapped to its source, blocks whose stored
bytes lie back to back in one file are read as one range (a ranged read in
the base's file for references, so an unchanged block costs what it costs
in the base), every block's CRC-32C is checked on its stored bytes (a raw
block's only where the load verifies, as for a plain leaf), and each
is decoded by its own codec into the destination (or into a buffer the
copies take from). A delta block (codec `DELTA`) is the chunk's own bytes
(a header and a zstd frame: of an XOR, or of the changed elements' positions
and values, by the header's kind) against a block of a base's file: the
base block is read (one more ranged read; the base blocks of consecutive
deltas that lie back to back in one file as one), checked against the
CRC-32C its header records, decoded, and XORed with the decoded delta or
its changed elements overwritten.
`fetches` is the rule for which requests a read sends, which the load's
plan and its dry run follow too.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .._codecs import codecs as _codecs
from .._core.buffers import as_view
from .._core.checksum import block_crc, check_block, mismatch
from .._errors import CorruptCheckpointError
from .._format import manifest as fmt
from .._format.binindex import raw_blocks, stored_bound
from .._format.blocks import (
    CODEC_IDS,
    CODEC_NAMES,
    DELTA,
    DELTA_HEADER,
    DELTA_KINDS,
    DELTA_SPARSE,
    DELTA_XOR,
    SPARSE_ITEMSIZES,
    sparse_parse,
    sparse_size,
    uint_of,
)
from .._plan.reads import Read
from .._tree.pytree import display_path
from .decodepool import pieces, share, spread

#: The checked coded blocks of a read are decoded in runs of consecutive blocks of one codec, cut into pieces
#: of at least this many raw bytes (whole blocks), each piece one `codecs.decode_run` call: the read's reader
#: thread decodes the first, the decode pool the others (`decodepool.spread`). Pieces of 4 blocks keep what a run
#: saves ("planes": one zstd call for all their planes; fewer Python calls a block, each holding the GIL the
#: other decoding threads wait for), and a long read still spreads over the pool.
RUN_PIECE = 4 << 20
#: The deltas of a read are rebuilt (base block checked and decoded, delta decoded and applied) in pieces of
#: at least this many raw bytes (whole blocks), each taken by the read's reader thread or a free thread of the
#: decode pool (`decodepool.share`), as coded blocks are decoded in pieces of `RUN_PIECE`. A 1 MiB sparse
#: delta's rebuild costs 0.1-0.2 ms of CPU alone (its base block's CRC-32C 40 us, zstd 26 us, parse and
#: scatter 21 us, and its Python, on the 2-core VM), in several calls that
#: each take the GIL: pieces of 4 blocks hand over a quarter as many tasks as one a block. On the 2-core VM (no
#: free core: no gain possible there) loads took 0.97-1.02x the time of the reader thread alone with 4 MiB
#: pieces, 1.01-1.04x with 1 MiB ones (in-process alternations).
DELTA_PIECE = 4 << 20
#: False: a read's deltas are rebuilt by its reader thread alone, one after another.
DELTAS_SHARED = True


def block_places(leaf: fmt.ArrayLeaf, cell: int, block: int) -> list[tuple[int, int, int, int, int, Any]]:
    """Per block of chunk `cell`: ``(file, offset, stored size, CRC, codec id, against)`` (a reference's
    file is the index's entry of the base's file; a delta's stored bytes are own, and `against` is the
    ``(file, offset)`` of the base block it is against, else None)."""
    table, n = leaf.parts()
    file, offset, crcs = table.entry(n, cell)
    sizes = table.stored(n, cell)
    got = table.sources(n, cell)
    if got is None:
        raise CorruptCheckpointError(f"{table.where}: leaf {leaf.path!r} chunk {cell} has no block sources")
    out: list[tuple[int, int, int, int, int, Any]] = []
    pos = offset
    for b, (f, codec, off) in enumerate(got[1]):
        if f < 0 or codec == DELTA:
            out.append((file, pos, sizes[b], crcs[b], codec, (f, off) if codec == DELTA else None))
            pos += sizes[b]
        else:
            out.append((f, off, sizes[b], crcs[b], codec, None))
    return out


class Fetch(NamedTuple):
    """One storage request of a `refs` leaf's read: `length` bytes of index file `file` from `start`,
    the stored bytes of `blocks` (block numbers of the chunk, in order) back to back."""

    file: int
    start: int
    length: int
    blocks: tuple[int, ...]


def _joined(pieces: list[tuple[int, int, int, int]]) -> list[Fetch]:
    """``(block, file, offset, size)`` pieces in block order, each run of consecutive blocks whose bytes
    follow each other in one file joined into one `Fetch`."""
    out: list[Fetch] = []
    for b, f, off, size in pieces:
        if out:
            last = out[-1]
            if last.file == f and last.start + last.length == off and last.blocks[-1] + 1 == b:
                out[-1] = Fetch(f, last.start, last.length + size, (*last.blocks, b))
                continue
        out.append(Fetch(f, off, size, (b,)))
    return out


def stored_fetches(places: list[tuple[int, int, int, int, int, Any]], b0: int, b1: int) -> list[Fetch]:
    """The requests that read the stored bytes of blocks ``[b0, b1)`` (`block_places`): own blocks,
    deltas' own bytes and references, consecutive blocks back to back in one file as one request."""
    return _joined([(b, *places[b][:3]) for b in range(b0, b1)])


def base_fetches(places: list[tuple[int, int, int, int, int, Any]], bases: dict[int, tuple[int, int]],
                 ) -> list[Fetch]:
    """The requests that read the base blocks of the deltas among `places`: `bases` maps a delta's block
    number to its base block's ``(codec, stored size)`` (its header's, `delta_header`); the base blocks
    of consecutive deltas that lie back to back in one file are one request."""
    return _joined([(b, *places[b][5], bases[b][1]) for b in sorted(bases)])


def fetches(places: list[tuple[int, int, int, int, int, Any]], b0: int, b1: int,
            base_of: Any) -> list[Fetch]:
    """Every request `read_blocks` sends for blocks ``[b0, b1)``: `stored_fetches`, then `base_fetches`,
    with ``base_of(b)`` the ``(codec, stored size)`` of delta block b's base block. The load learns those
    from the deltas' headers; a dry run from the base checkpoint's index (`own_blocks`)."""
    bases = {b: base_of(b) for b in range(b0, b1) if places[b][4] == DELTA}
    return stored_fetches(places, b0, b1) + base_fetches(places, bases)


def own_blocks(leaf: fmt.ArrayLeaf, cell: int, block: int) -> list[tuple[int, int, int, int] | None]:
    """Where each block of chunk `cell` of `leaf` is stored as its own: ``(file, offset, stored size,
    codec id)``, or None for a reference or a delta (a dry run's view of the blocks deltas are against)."""
    if leaf.refs:
        table, n = leaf.parts()
        file = table.entry(n, cell)[0]
        return [(f, off, size, codec) if f == file and against is None else None
                for f, off, size, _crc, codec, against in block_places(leaf, cell, block)]
    file, off = leaf.chunks[cell]
    out: list[tuple[int, int, int, int] | None] = []
    for size in leaf.stored_sizes(cell, block):
        out.append((file, off, size, CODEC_IDS[leaf.codec]))
        off += size
    return out


def delta_header(stored: Any, raw_size: int, where: str | Callable[[], str]) -> tuple[int, int, int, int]:
    """A delta block's header, checked: its base block's ``(codec id, CRC-32C, stored size)`` and the
    delta's kind (`DELTA_XOR` or `DELTA_SPARSE`). `where` names the block in errors (a function giving
    the name, called only for an error: a load reads many headers and raises for none)."""
    if len(stored) < DELTA_HEADER.size:
        raise CorruptCheckpointError(f"{_at(where)}: a delta block of {len(stored)} bytes, shorter than its header")
    codec, kind, pad, crc, size = DELTA_HEADER.unpack_from(stored)
    if codec >= len(CODEC_NAMES) or codec == DELTA or size > stored_bound(raw_size):
        raise CorruptCheckpointError(f"{_at(where)}: a delta's header names codec {codec} and {size} stored bytes")
    if kind >= len(DELTA_KINDS) or pad:
        raise CorruptCheckpointError(f"{_at(where)}: a delta's header names kind {kind} (known: "
                                     f"{', '.join(f'{i} {n}' for i, n in enumerate(DELTA_KINDS))}) and pad "
                                     f"bytes {pad:#06x} (must be zero)")
    if codec == 0 and size != raw_size:
        raise CorruptCheckpointError(f"{_at(where)}: the base block of a delta stores {size} bytes, not {raw_size}")
    return codec, crc, size, kind


def _at(where: str | Callable[[], str]) -> str:
    return where() if callable(where) else where


def apply_delta(stored: Any, base: Any, codec: int, crc: int, dtype: Any, out: np.ndarray, where: str,
                in_place: bool = False, kind: int = DELTA_XOR) -> None:
    """Rebuild a delta block of `kind` into `out` (its raw bytes): `stored` its checked stored bytes,
    `base` the stored bytes of its base block (coded by `codec`), checked here against `crc`. `in_place`:
    `base` is a raw base block read straight into `out` (no copy then)."""
    from .landing import scratch

    check_block(base, crc, where, "the base block of a delta (stored: what its header records)")
    frame = memoryview(stored)[DELTA_HEADER.size :]
    if kind == DELTA_SPARSE:  # its changed elements, checked before the base lands in `out`
        k = np.dtype(dtype).itemsize
        if k not in SPARSE_ITEMSIZES or out.nbytes % k:
            raise CorruptCheckpointError(f"{where}: a sparse delta of a {np.dtype(dtype)} block of {out.nbytes} "
                                         "bytes (sparse deltas have elements of 1, 2, 4 or 8 bytes)")
        count = out.nbytes // k
        n = _codecs.frame_content_size(frame, sparse_size(count, k), where, "sparse delta")
        content = _codecs.decode("zstd", frame, np.uint8, n, scratch(n, "sparse"), where=where)
        idx, values = sparse_parse(content, count, k, where)
    if codec == 0:
        if not in_place:
            out[:] = np.frombuffer(base, np.uint8)
    else:
        _codecs.decode(CODEC_NAMES[codec], base, dtype, out.nbytes, out, where=where)
    if kind == DELTA_SPARSE:
        out.view(uint_of(k))[idx] = values
        return
    # The XOR into this thread's scratch (no fresh pages per block), then onto the base's bytes in place.
    xor = _codecs.decode("zstd", frame, np.uint8, out.nbytes, scratch(out.nbytes, "xor"), where=where)
    np.bitwise_xor(out, xor, out=out)


def undelta(stored: Any, raw_size: int, dtype: Any, read_base: Any, out: np.ndarray, where: str) -> None:
    """Rebuild a delta block into `out` (`raw_size` bytes): `stored` its checked stored bytes,
    ``read_base(size, codec)`` the `size` stored bytes of the base block it is against (coded by `codec`)."""
    codec, crc, size, kind = delta_header(stored, raw_size, where)
    apply_delta(stored, read_base(size, codec), codec, crc, dtype, out, where, kind=kind)


def _rebuild_deltas(reader: Any, leaf: fmt.ArrayLeaf, cell: int, places: list[Any], raws: list[int],
                    deltas: dict[int, tuple[Any, int, int, int, int]], fill: Any, slot: Any) -> None:
    """`read_blocks`' second step: the base blocks of chunk `cell`'s `deltas` read (`fill`), each checked,
    decoded and XORed with its delta into its block's place (`slot`), by this thread and the decode pool's
    free ones (`DELTAS_SHARED`)."""
    from .landing import current_scope as _current_scope
    from .landing import in_scope as _in_scope

    block = reader.index.block_size
    name = display_path(leaf.path, reader.item)
    bases = base_fetches(places, {b: (d[1], d[3]) for b, d in deltas.items()})
    work: list[tuple[int, Any, bool]] = []  # (block, its base block's stored bytes, read into place)
    for fe, view, in_place in fill(bases, lambda b: deltas[b][1], "base"):
        pos = 0
        for b in fe.blocks:
            size = deltas[b][3]
            work.append((b, view[pos : pos + size], in_place))
            pos += size

    def rebuild(i: int, j: int) -> None:
        for b, base, in_place in work[i:j]:
            stored, codec, crc, _size, kind = deltas[b]
            apply_delta(stored, base, codec, crc, leaf.dtype, slot(b),
                        _delta_where(reader, name, cell, b, places[b][5]), in_place, kind)

    if DELTAS_SHARED:  # by this thread and the decode pool's free threads (`share`)
        # The pool outlives the load: its threads' scratch buffers go with the load's (or the reader's).
        scope = _current_scope()
        if scope is None:
            scope = reader.delta_scratch
        here = threading.get_ident()
        spans = [(b * block, b * block + raws[b], "") for b, _, _ in work]
        share(lambda i, j: rebuild(i, j) if threading.get_ident() == here else _in_scope(scope, rebuild, i, j),
              pieces(spans, 0, len(work), DELTA_PIECE))
    else:
        rebuild(0, len(work))


def read_blocks(reader: Any, read: Read, leaf: fmt.ArrayLeaf, dests: list[np.ndarray]) -> None:
    """`ChunkReader.do_read` for a leaf with references (``read`` in raw addressing: ``read.file`` is
    the chunk, ``[start, end)`` whole blocks of its raw bytes).

    Its requests are `fetches`' (what the load's plan predicts): first the blocks' stored bytes (raw
    runs straight into place, the rest into one buffer), each block checked (a raw one only where the
    load verifies, as for a plain leaf), own coded blocks decoded
    and the deltas' headers read; then the deltas' base blocks (raw runs straight into place, where the
    rebuilt blocks go, the rest into a second buffer), each checked, decoded and XORed with its delta."""
    from .landing import direct_bytes
    from .landing import region as _region
    from .landing import scratch as _scratch

    cell, block = read.file, reader.index.block_size
    places = block_places(leaf, cell, block)
    raws = raw_blocks(leaf.chunk_nbytes(cell), block)
    b0, b1 = read.start // block, -(-read.end // block)
    out = direct_bytes(read, dests)
    raw = out if out is not None else _scratch(read.nbytes)
    name = display_path(leaf.path, reader.item)

    def slot(b: int) -> np.ndarray:  # block b's raw bytes in `raw`
        lo = b * block - read.start
        return raw[lo : lo + raws[b]]

    def fill(fes: list[Fetch], codec_of: Any, which: str) -> list[tuple[Fetch, memoryview, bool]]:
        """Read each of `fes`: all its blocks stored raw, straight into place (consecutive raw blocks of
        the read), else into buffer `which` (one for all of them): ``(fetch, its bytes, in place)``."""
        in_place = [all(codec_of(b) == 0 for b in fe.blocks) for fe in fes]
        buf = _scratch(sum(fe.length for fe, p in zip(fes, in_place) if not p), which)
        got, pos = [], 0
        for fe, p in zip(fes, in_place):
            if p:
                lo = fe.blocks[0] * block - read.start
                view = memoryview(raw[lo : lo + fe.length].data)
            else:
                view = memoryview(buf[pos : pos + fe.length].data)
                pos += fe.length
            try:
                reader._fill(fe.file, fe.start, view, leaf)
            except CorruptCheckpointError as e:
                raise _named(reader, fe.file, e) from None
            got.append((fe, view, p))
        return got

    deltas: dict[int, tuple[Any, int, int, int, int]] = {}  # block -> (stored bytes, base codec, CRC, size, kind)
    coded: list[tuple[int, int, Any]] = []  # (block, codec id, stored bytes) of each checked coded block, in order
    for fe, view, in_place in fill(stored_fetches(places, b0, b1), lambda b: places[b][4], "stored"):
        pos = 0
        for b in fe.blocks:
            _f, off, size, crc, codec, against = places[b]
            piece = view[pos : pos + size]
            pos += size
            # Raw blocks, own or referred to, are checked as a plain leaf's are: unless the load was asked not
            # to verify. Coded blocks and deltas always are (they are decoded, not copied), and so is a delta's
            # base block (`apply_delta`): its CRC is what ties the delta to the block it was made against.
            got = crc if codec == 0 and not reader.verify else block_crc(piece)
            if got != crc:
                entry = reader.index.files[fe.file]
                where = (f"its base checkpoint {entry.base!r} " if entry.base is not None else "")
                check_block(got, crc, reader.loc.path, f"{where}data file {entry.name!r} bytes {off}..{off + size} "
                            f"(leaf {name!r}, chunk {cell} block {b})")
            if codec == DELTA:
                deltas[b] = (piece, *delta_header(piece, raws[b], functools.partial(
                    _delta_where, reader, name, cell, b, against)))
                continue
            if codec >= len(CODEC_NAMES):
                raise CorruptCheckpointError(f"{reader.loc.path}: leaf {leaf.path!r} chunk {cell} block {b}: "
                                             f"unknown codec id {codec}")
            if codec == 0:  # stored raw (any dtype)
                if size != raws[b]:
                    raise CorruptCheckpointError(f"{reader.loc.path}: leaf {leaf.path!r} chunk {cell} block {b} "
                                                 f"stores {size} bytes, its raw size is {raws[b]}")
                if not in_place:
                    slot(b)[:] = np.frombuffer(piece, np.uint8)
                continue
            coded.append((b, codec, piece))
    if coded:  # every block checked: the coded ones decoded in runs (`_decode_coded`)
        _decode_coded(coded, raws, block, read.start, raw, leaf.dtype,
                      lambda b: f"{reader.loc.path}: leaf {leaf.path!r} block {b} of chunk {cell}")
    if deltas:
        _rebuild_deltas(reader, leaf, cell, places, raws, deltas, fill, slot)
    if out is None:
        for c in read.copies:
            src = np.ndarray(c.shape, dtype=leaf.dtype, buffer=raw, offset=c.src_offset, strides=c.src_strides)
            dests[c.dest][_region(c.dest_start, c.shape)] = src
    else:
        with reader._lock:
            reader.stats.direct_reads += 1


def coded_runs(coded: list[tuple[int, int, Any]]) -> list[tuple[int, int]]:
    """``(i, j)`` of each run of `coded` (``(block, codec id, stored bytes)`` in block order): consecutive
    blocks of one codec, wherever their stored bytes lie (own blocks, references into a base's file)."""
    runs: list[tuple[int, int]] = []
    for k, (b, codec, _) in enumerate(coded):
        if runs and coded[k - 1][1] == codec and coded[k - 1][0] + 1 == b:
            runs[-1] = (runs[-1][0], k + 1)
        else:
            runs.append((k, k + 1))
    return runs


def _decode_coded(coded: list[tuple[int, int, Any]], raws: list[int], block: int, start: int, raw: np.ndarray,
                  dtype: Any, where: Callable[[int], str]) -> None:
    """Decode checked coded blocks (``(block, codec id, stored bytes)``, in block order) into `raw` (the
    read's raw bytes, from raw byte `start` of the chunk): each run of consecutive blocks of one codec
    (`coded_runs`) cut into pieces of at least `RUN_PIECE` raw bytes, each piece one `codecs.decode_run`
    call, spread over the decode pool (`decodepool.spread`). (A block at a time, one `decode` call each, the
    Python and numpy work of each call held decoding on the TPU host's 12 threads to 1.58 GiB/s, against
    2.20 for runs of a read's blocks.) ``where(b)`` names block b in errors."""
    spans = [(b * block - start, b * block - start + raws[b], where(b)) for b, _, _ in coded]
    work = [p for i, j in coded_runs(coded) for p in pieces(spans, i, j, RUN_PIECE)]

    def decode(i: int, j: int) -> None:
        _codecs.decode_run(CODEC_NAMES[coded[i][1]], [c[2] for c in coded[i:j]], dtype,
                           [hi - lo for lo, hi, _ in spans[i:j]], raw[spans[i][0] : spans[j - 1][1]],
                           [at for _, _, at in spans[i:j]])

    spread(decode, work)


def _delta_where(reader: Any, name: str, cell: int, b: int, against: tuple[int, int]) -> str:
    entry = reader.index.files[against[0]]
    return (f"{reader.loc.path}: leaf {name!r} chunk {cell} block {b} (a delta against its base checkpoint "
            f"{entry.base!r}, file {entry.name!r} bytes from {against[1]})")


def _named(reader: Any, file: int, e: CorruptCheckpointError) -> CorruptCheckpointError:
    """A read of a base's file failed: the error names both checkpoints."""
    entry = reader.index.files[file]
    if entry.base is None:
        return e
    return CorruptCheckpointError(
        f"{reader.loc.path} refers to its base checkpoint {entry.base!r} (beside it), whose data file "
        f"{entry.name!r} cannot be read: {e}")


def check_chunk(leaf: fmt.ArrayLeaf, cell: int, block: int, files: list[fmt.FileInfo], opened: dict[int, Any],
                ) -> list[str]:
    """What is wrong with chunk `cell` of a version-4 leaf, block by block: each block's stored bytes
    (own, or a reference into a base's file) against its CRC-32C, its decoding, and the xxh3-128 of the
    decoded bytes against the hash the index records (`cairn verify`). `opened`: file number -> reader."""
    from .._format.blocks import block_hash

    table, n = leaf.parts()
    sources = table.sources(n, cell)
    if sources is None:
        return ["the index records no block hashes or sources for it"]
    hashes = sources[0]
    raws = raw_blocks(leaf.chunk_nbytes(cell), block)
    bad: list[str] = []
    for b, (f, off, size, crc, codec, against) in enumerate(block_places(leaf, cell, block)):
        entry = files[f]
        where = f"{'base ' + repr(entry.base) + ' ' if entry.base else ''}file {entry.name!r} bytes {off}..{off + size}"
        r = opened.get(f)
        if r is None:
            bad.append(f"block {b} ({where}): its data file is missing")
            continue
        buf = np.empty(size, dtype=np.uint8)
        try:
            r.read_into(off, as_view(buf))
        except EOFError:
            bad.append(f"block {b} ({where}) lies past the end of the file")
            continue
        except OSError as e:
            bad.append(f"block {b} ({where}): reading failed: {e}")
            continue
        got = block_crc(buf)
        if got != crc:
            bad.append(mismatch(f"block {b} ({where})", crc, got))
            continue
        try:
            if codec == DELTA:
                bf, boff = against
                base_entry = files[bf]
                where = f"{where}, a delta against base {base_entry.base!r} file {base_entry.name!r} at {boff}"
                rb = opened.get(bf)
                if rb is None:
                    raise CorruptCheckpointError("the data file of its base block is missing")

                def read_base(n: int, _codec: int, rb: Any = rb, boff: int = boff) -> np.ndarray:
                    out = np.empty(n, dtype=np.uint8)
                    try:
                        rb.read_into(boff, memoryview(out.data))
                    except EOFError:
                        raise CorruptCheckpointError("its base block lies past the end of its file") from None
                    return out

                rebuilt = np.empty(raws[b], dtype=np.uint8)
                undelta(buf, raws[b], leaf.dtype, read_base, rebuilt, where="")
                raw = rebuilt.tobytes()
            else:
                raw = bytes(buf) if codec == 0 else _codecs.decode(CODEC_NAMES[codec], buf, leaf.dtype, raws[b])
        except (CorruptCheckpointError, IndexError, OSError) as e:
            bad.append(f"block {b} ({where}) does not decode: {e}")
            continue
        if block_hash(raw) != hashes[b * 16 : (b + 1) * 16]:
            bad.append(f"block {b} ({where}): its bytes' xxh3-128 is not the recorded hash")
    return bad


def by_base_file(leaf: fmt.ArrayLeaf, block: int) -> dict[int, list[int]]:
    """A version-4 leaf's blocks in other files, per file of its index: ``[bytes referred to there, blocks
    stored as deltas against blocks there, those deltas' own stored bytes]`` (`cairn inspect`)."""
    out: dict[int, list[int]] = {}
    parts = leaf.part_table
    if parts is None or not leaf.refs:
        return out
    table, n = parts
    for cell in range(len(leaf.chunks)):
        got = table.sources(n, cell)
        if got is None:
            continue
        sizes = table.stored(n, cell)
        for (f, codec, _off), size in zip(got[1], sizes):
            if f >= 0:
                row = out.setdefault(f, [0, 0, 0])
                if codec == DELTA:
                    row[1] += 1
                    row[2] += size
                else:
                    row[0] += size
    return out


def own_and_referenced(leaf: fmt.ArrayLeaf, block: int) -> tuple[int, int]:
    """A version-4 leaf's stored bytes in its own files and in its bases' files (`cairn inspect`)."""
    own = ref = 0
    parts = leaf.part_table
    if parts is None:
        return leaf.nbytes, 0
    table, n = parts
    for cell in range(len(leaf.chunks)):
        got = table.sources(n, cell)
        sizes = table.stored(n, cell)
        if got is None:
            continue
        for (f, _codec, _off), size in zip(got[1], sizes):
            if f < 0 or _codec == DELTA:
                own += size
            else:
                ref += size
    return own, ref
