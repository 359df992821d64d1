"""The zstd frames inside cairn's "zstd" and "planes" blocks and sparse deltas, checked before anything is
allocated (docs/FORMAT.md §6.4): one frame, its content size declared and bounded by what the index says,
no dictionary, nothing after it. Pure header arithmetic; the decompression is `codecs`'."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import CorruptCheckpointError

_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame's first 4 bytes


def corrupt(where: str, codec: str, what: str) -> CorruptCheckpointError:
    at = f"{where}: " if where else ""
    return CorruptCheckpointError(f"{at}a {codec!r} block {what}")


def frame_content_size(stored: Any, limit: int, where: str, codec: str) -> int:
    """The content size that the single zstd frame `stored` declares, at most `limit` (checked as `decode`
    checks a frame, before anything is allocated): for a frame whose size its content tells (a delta's)."""
    src = memoryview(stored).cast("B") if not isinstance(stored, np.ndarray) else stored.reshape(-1).view(np.uint8).data
    n = frame_size(src, None, where, codec)
    if n > limit:
        raise corrupt(where, codec, f"declares {n} decompressed bytes, more than the {limit} it can hold")
    check_frame(src, n, where, codec)
    return n


def frame_size(buf: memoryview, n: int | None, where: str, codec: str) -> int:
    """The length of the zstd frame at the start of `buf`, checking it declares n content bytes (with n
    None: the content size it declares, its header alone checked)."""
    if len(buf) < 6 or bytes(buf[:4]) != _MAGIC:
        raise corrupt(where, codec, "does not start with a zstd frame")
    fhd = buf[4]
    fcs_flag, single, did_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    if fhd & 0x08:
        raise corrupt(where, codec, "has a zstd frame header with the reserved bit set")
    if did_flag:
        raise corrupt(where, codec, "names a zstd dictionary (cairn uses none)")
    fcs_size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if fcs_size == 0:
        raise corrupt(where, codec, "has a zstd frame without its content size")
    pos = 5 + (0 if single else 1)
    if len(buf) < pos + fcs_size + 3:
        raise corrupt(where, codec, "is truncated inside a zstd frame header")
    fcs = int.from_bytes(buf[pos:pos + fcs_size], "little") + (256 if fcs_size == 2 else 0)
    if n is None:
        return fcs
    if fcs != n:
        raise corrupt(where, codec, f"declares {fcs} decompressed bytes where the index says {n}")
    pos += fcs_size
    while True:
        if len(buf) < pos + 3:
            raise corrupt(where, codec, "is truncated inside a zstd frame")
        bh = int.from_bytes(buf[pos:pos + 3], "little")
        btype, bsize = (bh >> 1) & 3, bh >> 3
        if btype == 3:
            raise corrupt(where, codec, "has a zstd block of the reserved type")
        pos += 3 + (1 if btype == 1 else bsize)
        if bh & 1:
            break
    pos += 4 if fhd & 0x04 else 0
    if pos > len(buf):
        raise corrupt(where, codec, "is truncated inside a zstd frame")
    return pos


def check_frame(stored: memoryview, n: int, where: str, codec: str) -> None:
    """`stored` is exactly one zstd frame declaring n content bytes (checked before allocating n)."""
    if frame_size(stored, n, where, codec) != len(stored):
        raise corrupt(where, codec, "has bytes after its zstd frame")
