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
PART_VERSION = 2
HEADER_BYTES = 64
RECORD = np.dtype([("cell", "<u8"), ("offset", "<u8"), ("crc_start", "<u8"), ("leaf", "<u4"),
                   ("file", "<u4"), ("crcs_crc", "<u4"), ("rec_crc", "<u4")])
RECORD_BYTES = RECORD.itemsize  # 40


def part_name(process: int, token: str) -> str:
    return f"index.p{process:05d}.{token}.idx"



# --------------------------------------------------------------------------- parts


def encode_part(process: int, leaf: Sequence[int], cell: Sequence[int], file: Sequence[int],
                offset: Sequence[int], crcs: Sequence[Sequence[int]]) -> bytes:
    """One process's part: header, records in the given order (sorted by (leaf, cell)), CRC column."""
    n = len(leaf)
    rec = np.zeros(n, dtype=RECORD)
    rec["leaf"], rec["cell"], rec["file"], rec["offset"] = leaf, cell, file, offset
    counts = np.fromiter((len(c) for c in crcs), dtype=np.int64, count=n)
    starts = np.cumsum(counts) - counts
    rec["crc_start"] = starts
    column = np.fromiter((v for c in crcs for v in c), dtype="<u4", count=int(counts.sum()))
    col = column.tobytes()
    for i in range(n):
        s = int(starts[i]) * 4
        rec["crcs_crc"][i] = crc32c(col[s : s + int(counts[i]) * 4])
    raw = rec.view(np.uint8).reshape(n, RECORD_BYTES)
    rec["rec_crc"] = [crc32c(raw[i, : RECORD_BYTES - 4].tobytes()) for i in range(n)]
    head = bytearray(HEADER_BYTES)
    head[0:8] = MAGIC
    np.frombuffer(head, dtype="<u4", count=2, offset=8)[:] = (PART_VERSION, RECORD_BYTES)
    np.frombuffer(head, dtype="<u8", count=4, offset=16)[:] = (process, n, len(column), HEADER_BYTES + n * RECORD_BYTES)
    np.frombuffer(head, dtype="<u4", count=1, offset=60)[:] = crc32c(bytes(head[:60]))
    return bytes(head) + rec.tobytes() + col


def check_header(head: bytes, where: object) -> tuple[int, int, int]:
    """``(process, records, crcs)`` of a part's 64-byte header, checked."""
    if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise corrupt(where, "not a cairn index part (bad magic)")
    if int.from_bytes(head[60:64], "little") != crc32c(head[:60]):
        raise corrupt(where, "index part header checksum mismatch")
    version, rsize = np.frombuffer(head, dtype="<u4", count=2, offset=8)
    process, n, m, crcs_at = (int(v) for v in np.frombuffer(head, dtype="<u8", count=4, offset=16))
    if version != PART_VERSION or rsize != RECORD_BYTES or crcs_at != HEADER_BYTES + n * RECORD_BYTES \
            or head[48:60] != bytes(12):
        raise corrupt(where, f"index part header is not version {PART_VERSION} with {RECORD_BYTES}-byte records")
    return process, n, m


def decode_part(data: bytes, where: object) -> tuple[int, np.ndarray, np.ndarray]:
    """``(process, records, crc column)`` of a whole part, every checksum verified (for tools)."""
    process, n, m = check_header(data[:HEADER_BYTES], where)
    crcs_at = HEADER_BYTES + n * RECORD_BYTES
    if len(data) != crcs_at + 4 * m:
        raise corrupt(where, f"index part of {len(data)} bytes, its header says {crcs_at + 4 * m}")
    rec = np.frombuffer(data, dtype=RECORD, count=n, offset=HEADER_BYTES)
    col = np.frombuffer(data, dtype="<u4", count=m, offset=crcs_at)
    _check_records(rec, data[HEADER_BYTES:crcs_at], where)
    return process, rec, col


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
