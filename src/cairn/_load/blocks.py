"""Reading a leaf whose blocks may be references (format version 4, docs/FORMAT.md §6.5).

A leaf marked ``refs`` has chunks some of whose checksum blocks are not in
the chunk's own bytes but in a data file of a base checkpoint (a sibling
folder or prefix). Its reads are planned in raw addressing, like a
compressed leaf's (`reader.plan_leaf_reads`): each read is whole blocks of
one chunk. Here each block is mapped to its source, blocks whose stored
bytes lie back to back in one file are read as one range (a ranged read in
the base's file for references, so an unchanged block costs what it costs
in the base), every block's CRC-32C is checked on its stored bytes, and each
is decoded by its own codec into the destination (or into a buffer the
copies take from). A delta block (codec `DELTA`) is the chunk's own bytes
(a header and a zstd frame of an XOR) against a block of a base's file: the
base block is read (one more ranged read), checked against the CRC-32C its
header records, decoded, and XORed with the decoded delta.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.checksum import check_block, crc32c, mismatch
from .._errors import CorruptCheckpointError
from .._format import codecs as _codecs
from .._format import manifest as fmt
from .._format.binindex import raw_blocks, stored_bound
from .._format.blocks import CODEC_NAMES, DELTA, DELTA_HEADER
from .._plan.reads import Read
from .._tree.pytree import display_path


def block_places(leaf: fmt.ArrayLeaf, cell: int, block: int) -> list[tuple[int, int, int, int, int, Any]]:
    """Per block of chunk `cell`: ``(file, offset, stored size, CRC, codec id, against)`` (a reference's
    file is the index's entry of the base's file; a delta's stored bytes are own, and `against` is the
    ``(file, offset)`` of the base block it is against, else None)."""
    table = leaf.chunks.table  # type: ignore[attr-defined]  # a refs leaf is part-indexed (parser checks)
    n = leaf.chunks.leaf  # type: ignore[attr-defined]
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


def undelta(stored: Any, raw_size: int, dtype: Any, read_base: Any, out: np.ndarray, where: str) -> None:
    """Rebuild a delta block into `out` (`raw_size` bytes): `stored` its checked stored bytes,
    ``read_base(size, codec)`` the `size` stored bytes of the base block it is against (coded by `codec`;
    a raw base MAY be read straight into `out` and `out` returned: no copy then)."""
    from .landing import scratch

    if len(stored) < DELTA_HEADER.size:
        raise CorruptCheckpointError(f"{where}: a delta block of {len(stored)} bytes, shorter than its header")
    codec, crc, size = DELTA_HEADER.unpack_from(stored)
    if codec >= len(CODEC_NAMES) or size > stored_bound(raw_size):
        raise CorruptCheckpointError(f"{where}: a delta's header names codec {codec} and {size} stored bytes")
    if codec == 0 and size != raw_size:
        raise CorruptCheckpointError(f"{where}: the base block of a delta stores {size} bytes, not {raw_size}")
    base = read_base(size, codec)
    check_block(base, crc, where, "the base block of a delta (stored: what its header records)")
    if codec == 0:
        if base is not out:
            out[:] = np.frombuffer(base, np.uint8)
    else:
        _codecs.decode(CODEC_NAMES[codec], base, dtype, raw_size, out, where=where)
    # The XOR into this thread's scratch (no fresh pages per block), then onto the base's bytes in place.
    xor = _codecs.decode("zstd", memoryview(stored)[DELTA_HEADER.size :], np.uint8, raw_size,
                         scratch(raw_size, "xor"), where=where)
    np.bitwise_xor(out, xor, out=out)


def read_blocks(reader: Any, read: Read, leaf: fmt.ArrayLeaf, dests: list[np.ndarray]) -> None:
    """`ChunkReader.do_read` for a leaf with references (``read`` in raw addressing: ``read.file`` is
    the chunk, ``[start, end)`` whole blocks of its raw bytes)."""
    from .landing import direct_bytes
    from .landing import region as _region
    from .landing import scratch as _scratch

    cell, block = read.file, reader.index.block_size
    places = block_places(leaf, cell, block)
    raws = raw_blocks(leaf.chunk_nbytes(cell), block)
    b0, b1 = read.start // block, -(-read.end // block)
    out = direct_bytes(read, dests)
    raw = out if out is not None else _scratch(read.nbytes)
    # Consecutive blocks whose stored bytes follow each other in one file: one ranged read.
    groups: list[list[int]] = []
    for b in range(b0, b1):
        f, off, size = places[b][:3]
        if groups:
            pf, poff, psize = places[groups[-1][-1]][:3]
            if pf == f and poff + psize == off:
                groups[-1].append(b)
                continue
        groups.append([b])
    for g in groups:
        f, first = places[g[0]][0], places[g[0]][1]
        n = sum(places[b][2] for b in g)
        raw_group = all(places[b][4] == 0 for b in g)
        if raw_group:  # stored raw: straight into place (the blocks are consecutive raw bytes of the read)
            lo = g[0] * block - read.start
            view = memoryview(raw[lo : lo + n].data)  # type: ignore[arg-type]
        else:
            view = memoryview(_scratch(n, "stored").data)  # type: ignore[arg-type]
        try:
            reader._fill(f, first, view, leaf)
        except CorruptCheckpointError as e:
            raise _named(reader, f, e) from None
        pos = 0
        for b in g:
            _f, off, size, crc, codec, against = places[b]
            piece = view[pos : pos + size]
            pos += size
            got = crc32c(piece)
            if got != crc:
                entry = reader.index.files[f]
                where = (f"its base checkpoint {entry.base!r} " if entry.base is not None else "")
                check_block(got, crc, reader.loc.path, f"{where}data file {entry.name!r} bytes {off}..{off + size} "
                            f"(leaf {display_path(leaf.path, reader.item)!r}, chunk {cell} block {b})")
            lo = b * block - read.start
            hi = lo + raws[b]
            if codec == DELTA:
                bf, boff = against

                def read_base(n: int, codec: int, bf: int = bf, boff: int = boff,
                              into: np.ndarray = raw[lo:hi]) -> np.ndarray:
                    # A raw base block lands where the rebuilt block goes; a coded one in a buffer.
                    buf = into if codec == 0 else np.empty(n, dtype=np.uint8)
                    try:
                        reader._fill(bf, boff, memoryview(buf.data), leaf)  # type: ignore[arg-type]
                    except CorruptCheckpointError as e:
                        raise _named(reader, bf, e) from None
                    return buf

                base_entry = reader.index.files[bf]
                undelta(piece, raws[b], leaf.dtype, read_base, raw[lo:hi],
                        where=f"{reader.loc.path}: leaf {display_path(leaf.path, reader.item)!r} chunk {cell} block "
                              f"{b} (a delta against its base checkpoint {base_entry.base!r}, file "
                              f"{base_entry.name!r} bytes from {boff})")
                continue
            if codec >= len(CODEC_NAMES):
                raise CorruptCheckpointError(f"{reader.loc.path}: leaf {leaf.path!r} chunk {cell} block {b}: "
                                             f"unknown codec id {codec}")
            if codec == 0:  # stored raw (any dtype)
                if size != raws[b]:
                    raise CorruptCheckpointError(f"{reader.loc.path}: leaf {leaf.path!r} chunk {cell} block {b} "
                                                 f"stores {size} bytes, its raw size is {raws[b]}")
                if not raw_group:
                    raw[lo:hi] = np.frombuffer(piece, np.uint8)
                continue
            _codecs.decode(CODEC_NAMES[codec], piece, leaf.dtype, raws[b], raw[lo:hi],
                           where=f"{reader.loc.path}: leaf {leaf.path!r} block {b} of chunk {cell}")
    if out is None:
        for c in read.copies:
            src = np.ndarray(c.shape, dtype=leaf.dtype, buffer=raw, offset=c.src_offset, strides=c.src_strides)
            dests[c.dest][_region(c.dest_start, c.shape)] = src
    else:
        with reader._lock:
            reader.stats.direct_reads += 1


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

    table = leaf.chunks.table  # type: ignore[attr-defined]
    got = table.sources(leaf.chunks.leaf, cell)  # type: ignore[attr-defined]
    if got is None:
        return ["the index records no block hashes or sources for it"]
    hashes = got[0]
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
            r.read_into(off, memoryview(buf))  # type: ignore[arg-type]
        except EOFError:
            bad.append(f"block {b} ({where}) lies past the end of the file")
            continue
        except OSError as e:
            bad.append(f"block {b} ({where}): reading failed: {e}")
            continue
        got = crc32c(buf)
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
                        rb.read_into(boff, memoryview(out.data))  # type: ignore[arg-type]
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
    table = getattr(leaf.chunks, "table", None)
    if table is None or not leaf.refs:
        return out
    for cell in range(len(leaf.chunks)):
        got = table.sources(leaf.chunks.leaf, cell)  # type: ignore[attr-defined]
        if got is None:
            continue
        sizes = table.stored(leaf.chunks.leaf, cell)  # type: ignore[attr-defined]
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
    table = getattr(leaf.chunks, "table", None)
    if table is None:
        return leaf.nbytes, 0
    for cell in range(len(leaf.chunks)):
        got = table.sources(leaf.chunks.leaf, cell)  # type: ignore[attr-defined]
        sizes = table.stored(leaf.chunks.leaf, cell)  # type: ignore[attr-defined]
        if got is None:
            continue
        for (f, _codec, _off), size in zip(got[1], sizes):
            if f < 0 or _codec == DELTA:
                own += size
            else:
                ref += size
    return own, ref
