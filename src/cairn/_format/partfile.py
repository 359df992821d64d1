"""Pure: the bytes of one binary index part (docs/FORMAT.md §5.2): header, records, CRC column.

`encode_part` writes one; `check_header` and `decode_part` check one; the
`_binindex.ChunkTable` reads records of many in ranges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._core.checksum import crc32c
from .._errors import corrupt

MAGIC = b"CAIRNIDX"
PART_VERSION = 2  # a part of a version-2 index
PART_VERSION_SIZES = 3  # a part of a version-3 index: a stored-size column follows the CRC column
PART_VERSION_BLOCKS = 4  # a part of a version-4 index: hash and source columns follow the size column
PART_VERSIONS = (PART_VERSION, PART_VERSION_SIZES, PART_VERSION_BLOCKS)
#: Version 4's per-block source entry (docs/FORMAT.md §5.2): where a block's stored bytes are.
SOURCE = np.dtype([("file", "<u4"), ("codec", "u1"), ("pad", "V3"), ("offset", "<u8")])
SOURCE_BYTES = SOURCE.itemsize  # 16
HASH_BYTES = 16  # xxh3-128 of the block's raw bytes, little-endian
OWN = 0xFFFFFFFF  # a source entry's file for a block stored in its chunk's own bytes
HEADER_BYTES = 64
RECORD = np.dtype([("cell", "<u8"), ("offset", "<u8"), ("crc_start", "<u8"), ("leaf", "<u4"),
                   ("file", "<u4"), ("crcs_crc", "<u4"), ("rec_crc", "<u4")])
RECORD_BYTES = RECORD.itemsize  # 40


def part_name(process: int, token: str) -> str:
    return f"index.p{process:05d}.{token}.idx"



# --------------------------------------------------------------------------- parts


def encode_part(process: int, leaf: Sequence[int], cell: Sequence[int], file: Sequence[int],
                offset: Sequence[int], crcs: Sequence[Sequence[int]],
                stored: Sequence[Sequence[int]] | None = None, blocks: tuple[bytes, bytes] | None = None) -> bytes:
    """One process's part: header, records in the given order (sorted by (leaf, cell)), CRC column.

    With `stored` (per record, each block's stored size), a version-3 part: the
    size column follows the CRC column, and each record's `crcs_crc` covers its
    CRCs and then its sizes. With `blocks` too (the hash column and the source
    column, every block's 16 + 16 bytes in column order), a version-4 part, whose
    `crcs_crc` also covers the record's hashes and sources.
    """
    n = len(leaf)
    rec = np.zeros(n, dtype=RECORD)
    rec["leaf"], rec["cell"], rec["file"], rec["offset"] = leaf, cell, file, offset
    counts = np.fromiter((len(c) for c in crcs), dtype=np.int64, count=n)
    starts = np.cumsum(counts) - counts
    rec["crc_start"] = starts
    column = np.fromiter((v for c in crcs for v in c), dtype="<u4", count=int(counts.sum()))
    col = column.tobytes()
    scol = b""
    if stored is not None:
        if [len(x) for x in stored] != counts.tolist():
            raise ValueError("every block needs its stored size")
        scol = np.fromiter((v for c in stored for v in c), dtype="<u4", count=int(counts.sum())).tobytes()
    hcol, ocol = blocks if blocks is not None else (b"", b"")
    if blocks is not None and (stored is None or len(hcol) != HASH_BYTES * len(column)
                               or len(ocol) != SOURCE_BYTES * len(column)):
        raise ValueError("a version-4 part needs stored sizes, and a hash and a source per block")
    for i in range(n):
        s = int(starts[i]) * 4
        e = s + int(counts[i]) * 4
        c = crc32c(scol[s:e], crc32c(col[s:e])) if stored is not None else crc32c(col[s:e])
        if blocks is not None:
            c = crc32c(ocol[s * 4 : e * 4], crc32c(hcol[s * 4 : e * 4], c))
        rec["crcs_crc"][i] = c
    raw = rec.view(np.uint8).reshape(n, RECORD_BYTES)
    rec["rec_crc"] = [crc32c(raw[i, : RECORD_BYTES - 4].tobytes()) for i in range(n)]
    head = bytearray(HEADER_BYTES)
    head[0:8] = MAGIC
    version = PART_VERSION if stored is None else PART_VERSION_SIZES if blocks is None else PART_VERSION_BLOCKS
    np.frombuffer(head, dtype="<u4", count=2, offset=8)[:] = (version, RECORD_BYTES)
    np.frombuffer(head, dtype="<u8", count=4, offset=16)[:] = (process, n, len(column), HEADER_BYTES + n * RECORD_BYTES)
    if stored is not None:
        np.frombuffer(head, dtype="<u8", count=1, offset=48)[:] = HEADER_BYTES + n * RECORD_BYTES + 4 * len(column)
    np.frombuffer(head, dtype="<u4", count=1, offset=60)[:] = crc32c(bytes(head[:60]))
    return bytes(head) + rec.tobytes() + col + scol + hcol + ocol


def part_bytes(records: int, crcs: int, version: int = PART_VERSION) -> int:
    """The size of a part of `records` records and `crcs` checksums."""
    per_block = {PART_VERSION: 4, PART_VERSION_SIZES: 8}.get(version, 8 + HASH_BYTES + SOURCE_BYTES)
    return HEADER_BYTES + RECORD_BYTES * records + per_block * crcs


def check_header(head: bytes, where: object, expect: int = PART_VERSION) -> tuple[int, int, int]:
    """``(process, records, crcs)`` of a part's 64-byte header of part version `expect`, checked."""
    if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise corrupt(where, "not a cairn index part (bad magic)")
    if int.from_bytes(head[60:64], "little") != crc32c(head[:60]):
        raise corrupt(where, "index part header checksum mismatch")
    version, rsize = np.frombuffer(head, dtype="<u4", count=2, offset=8)
    process, n, m, crcs_at = (int(v) for v in np.frombuffer(head, dtype="<u8", count=4, offset=16))
    sizes_at = int(np.frombuffer(head, dtype="<u8", count=1, offset=48)[0])
    tail_ok = head[48:60] == bytes(12) if expect == PART_VERSION else (
        sizes_at == crcs_at + 4 * m and head[56:60] == bytes(4))
    if version != expect or rsize != RECORD_BYTES or crcs_at != HEADER_BYTES + n * RECORD_BYTES or not tail_ok:
        raise corrupt(where, f"index part header is not version {expect} with {RECORD_BYTES}-byte records")
    return process, n, m


def decode_part(data: bytes, where: object, expect: int = PART_VERSION
                ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray | None]:
    """``(process, records, crc column, size column or None)`` of a whole part, every checksum
    verified (for tools; the hash and source columns of version 4: `block_columns`)."""
    process, n, m = check_header(data[:HEADER_BYTES], where, expect)
    crcs_at = HEADER_BYTES + n * RECORD_BYTES
    total = part_bytes(n, m, expect)
    if len(data) != total:
        raise corrupt(where, f"index part of {len(data)} bytes, its header says {total}")
    rec = np.frombuffer(data, dtype=RECORD, count=n, offset=HEADER_BYTES)
    col = np.frombuffer(data, dtype="<u4", count=m, offset=crcs_at)
    sizes = np.frombuffer(data, dtype="<u4", count=m, offset=crcs_at + 4 * m) if expect != PART_VERSION else None
    _check_records(rec, data[HEADER_BYTES:crcs_at], where)
    starts, counts = rec["crc_start"].astype(np.int64), np.diff(np.append(rec["crc_start"].astype(np.int64), m))
    cb, sb = col.tobytes(), sizes.tobytes() if sizes is not None else b""
    for i in range(n):
        s, e = int(starts[i]) * 4, (int(starts[i]) + int(counts[i])) * 4
        c = crc32c(sb[s:e], crc32c(cb[s:e])) if sizes is not None else crc32c(cb[s:e])
        if expect == PART_VERSION_BLOCKS:
            at = crcs_at + 8 * m
            c = crc32c(data[at + 16 * m + 4 * s : at + 16 * m + 4 * e], crc32c(data[at + 4 * s : at + 4 * e], c))
        if s > e or e > 4 * m or c != int(rec["crcs_crc"][i]):
            raise corrupt(where, f"checksums of index record {i} do not match their checksum")
    return process, rec, col, sizes


def block_columns(data: bytes, expect: int) -> tuple[bytes, np.ndarray] | None:
    """The hash column (bytes) and the source column of a whole version-4 part checked by `decode_part`."""
    if expect != PART_VERSION_BLOCKS:
        return None
    _, n, m = check_header(data[:HEADER_BYTES], "part", expect)
    at = HEADER_BYTES + n * RECORD_BYTES + 8 * m
    return data[at : at + HASH_BYTES * m], np.frombuffer(data, dtype=SOURCE, count=m, offset=at + HASH_BYTES * m)


def _check_records(rec: np.ndarray, raw: bytes, where: object) -> None:
    for i in range(len(rec)):
        s = i * RECORD_BYTES
        if crc32c(raw[s : s + RECORD_BYTES - 4]) != int(rec["rec_crc"][i]):
            raise corrupt(where, f"index record {i} checksum mismatch")


@dataclass(frozen=True)
class PartInfo:
    """One process's part, as the index JSON names it."""

    name: str
    process: int
    records: int
    crcs: int
    file_base: int  # the part's file k is the index's file file_base + k
    files: int
