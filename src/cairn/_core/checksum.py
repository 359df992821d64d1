"""CRC-32C (Castagnoli), the format's checksum: hardware-accelerated, releases the GIL."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from typing import Any as Buffer  # collections.abc.Buffer is Python 3.12+

from .._errors import CorruptCheckpointError

try:
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - the dependency is required; this keeps errors readable
    _crc32c = None  # type: ignore[assignment]


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC-32C of `data` (any contiguous buffer), continuing from `value`."""
    if _crc32c is None:
        raise ImportError("cairn needs the 'crc32c' package (pip install crc32c)")
    return _crc32c(data, value)


def block_crc(stored: Buffer) -> int:
    """The check record of one stored block (raw, coded or a delta): the CRC-32C of its stored bytes.
    Every writer of a block's record computes it here (`block_crcs`: a raw chunk's, block by block), and
    every reader that checks one block's stored bytes at once (a streaming copy continues `crc32c`)."""
    return crc32c(stored)


def block_crcs(data: Buffer | Sequence[Buffer], block: int) -> list[int]:
    """The check record of a chunk's bytes: the CRC-32C of each `block`-byte block (the last may be
    shorter) of `data`, or of the concatenation of its parts without joining them.

    >>> block_crcs([b"ab", b"cd"], 3) == [crc32c(b"abc"), crc32c(b"d")]
    True
    """
    if type(data) is memoryview and data.format == "B" and len(data) <= block:  # the common small chunk
        return [crc32c(data)] if len(data) else []
    parts: Sequence[Buffer] = data if isinstance(data, (list, tuple)) else [data]
    out: list[int] = []
    crc, filled = 0, 0
    for part in parts:
        m = part if isinstance(part, memoryview) and part.format == "B" else memoryview(part).cast("B")
        pos = 0
        while pos < len(m):
            take = min(block - filled, len(m) - pos)
            crc = crc32c(m[pos : pos + take], crc)
            filled += take
            pos += take
            if filled == block:
                out.append(crc)
                crc, filled = 0, 0
    if filled:
        out.append(crc)
    return out


def mismatch(block: str, stored: int, got: int) -> str:
    """The one wording of a block whose bytes fail their check: `block` says which (file, bytes, leaf,
    chunk), e.g. ``"'p00000-0.x.bin' bytes 0..1048576 (leaf 'w')"``."""
    return f"checksum mismatch in {block}: stored {stored:#010x}, computed {got:#010x} (CRC-32C)"


def check_block(data: Buffer | int, stored: int, path: object, block: str) -> None:
    """Check one block against its stored CRC-32C: `data` is its bytes, or their CRC-32C where a
    reader computed it piece by piece. Raises the `CorruptCheckpointError` naming the checkpoint
    `path` and the `block` (see `mismatch`).

    >>> check_block(b"abc", crc32c(b"abc"), "/ckpt", "'f.bin' bytes 0..3")
    """
    got = data if isinstance(data, int) else crc32c(data)
    if got != stored:
        raise CorruptCheckpointError(f"{path}: {mismatch(block, stored, got)}")


class BlockChecks:
    """The checksum blocks of one read, verified as its parts land.

    `checks` are ``(start, end, crc)`` ranges of the object, sorted and
    disjoint; `segments` hold the object's bytes from `base` on, one after
    another. A reader that fetches a read in parallel parts (an object store's
    ranged GETs) calls `part` once each part has landed, in the thread that
    received it: the blocks wholly inside that part are verified there, while
    its bytes are still in cache and the other parts are still on the wire.
    `rest` then verifies the blocks no part held whole (those straddling two
    parts; all of them, for a reader that reports no parts). A mismatch raises
    ``fail(check, computed crc)``; a `fail` that returns None records the
    mismatch itself and lets the checks go on (`cairn verify` lists every bad block).
    `then(i, j)`, if given, runs on each stretch of consecutive blocks ``checks[i:j]``
    that passed, once the `part` (or `rest`) that checked them has checked them all,
    in the same thread: the chunk reader's `then` decodes compressed blocks from
    there, in pieces of about 1 MiB, the first in this thread and the others on
    the process's decode pool (`_load.decodepool.spread`), and returns once all are done.
    """

    def __init__(self, checks: Sequence[tuple[int, int, int]], segments: Sequence[Buffer], base: int,
                 fail: Callable[[tuple[int, int, int], int], BaseException | None],
                 then: Callable[[int, int], None] | None = None):
        self.checks, self.segments, self.base, self.fail, self.then = checks, segments, base, fail, then
        self._starts = [c[0] for c in checks]
        # Where each segment starts (relative to `base`): a block finds its first segment by
        # bisection, so a run of thousands of small arrays is not scanned from the start per block.
        self._seg_starts = list(itertools.accumulate((len(seg) for seg in segments), initial=0))
        self._done = bytearray(len(checks))  # each flag written by the one thread that verified its block

    def part(self, a: int, b: int) -> None:
        """Verify the blocks that lie wholly inside object bytes [a, b), which have landed."""
        checks = self.checks
        i = bisect.bisect_left(self._starts, a)
        passed: list[int] = []
        while i < len(checks) and checks[i][0] < b:
            if checks[i][1] <= b and not self._done[i] and self._verify(i):  # parts of a stream overlap
                passed.append(i)
            i += 1
        self._then(passed)

    def rest(self) -> None:
        """Verify every block that no `part` call verified (call once the whole read has landed)."""
        passed: list[int] = []
        for i, done in enumerate(self._done):
            if not done and self._verify(i):
                passed.append(i)
        self._then(passed)

    def _verify(self, i: int) -> bool:
        """Check block i; whether it passed (a `fail` that returns None lets a mismatch through)."""
        c = self.checks[i]
        got = self._crc(c[0] - self.base, c[1] - self.base)
        self._done[i] = 1
        if got != c[2]:
            if (error := self.fail(c, got)) is not None:
                raise error
            return False
        return True

    def _then(self, passed: list[int]) -> None:
        """`then` over each stretch of consecutive indices in `passed` (ascending)."""
        if self.then is None or not passed:
            return
        start = prev = passed[0]
        for i in passed[1:]:
            if i != prev + 1:
                self.then(start, prev + 1)
                start = i
            prev = i
        self.then(start, prev + 1)

    def _crc(self, start: int, end: int) -> int:
        """CRC-32C of bytes [start, end) of the segments, one after another (fewer where they end)."""
        starts, segs = self._seg_starts, self.segments
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        value = 0
        while start < end and i < len(segs):
            pos = starts[i]
            hi = min(end, pos + len(segs[i]))
            if start < hi:
                value = crc32c(segs[i][start - pos : hi - pos], value)
                start = hi
            i += 1
        return value
