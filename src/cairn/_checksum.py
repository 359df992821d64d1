"""CRC-32C (Castagnoli), the format's checksum: hardware-accelerated, releases the GIL."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any as Buffer  # collections.abc.Buffer is Python 3.12+

try:
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - the dependency is required; this keeps errors readable
    _crc32c = None  # type: ignore[assignment]


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC-32C of `data` (any contiguous buffer), continuing from `value`."""
    if _crc32c is None:
        raise ImportError("cairn needs the 'crc32c' package (pip install crc32c)")
    return _crc32c(data, value)


def crc_range(segments: Sequence[Buffer], start: int, end: int) -> int:
    """CRC-32C of bytes [start, end) of the concatenation of `segments` (byte views)."""
    value, pos = 0, 0
    for seg in segments:
        n = len(seg)
        lo, hi = max(start - pos, 0), min(end - pos, n)
        if lo < hi:
            value = crc32c(seg[lo:hi], value)
        pos += n
        if pos >= end:
            break
    return value


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
    ``fail(check, computed crc)``.
    """

    def __init__(self, checks: Sequence[tuple[int, int, int]], segments: Sequence[Buffer], base: int,
                 fail: Callable[[tuple[int, int, int], int], BaseException]):
        self.checks, self.segments, self.base, self.fail = checks, segments, base, fail
        self._starts = [c[0] for c in checks]
        self._done = bytearray(len(checks))  # each flag written by the one thread that verified its block

    def part(self, a: int, b: int) -> None:
        """Verify the blocks that lie wholly inside object bytes [a, b), which have landed."""
        checks = self.checks
        i = bisect.bisect_left(self._starts, a)
        while i < len(checks) and checks[i][0] < b:
            if checks[i][1] <= b:
                self._verify(i)
            i += 1

    def rest(self) -> None:
        """Verify every block that no `part` call verified (call once the whole read has landed)."""
        for i, done in enumerate(self._done):
            if not done:
                self._verify(i)

    def _verify(self, i: int) -> None:
        c = self.checks[i]
        got = crc_range(self.segments, c[0] - self.base, c[1] - self.base)
        if got != c[2]:
            raise self.fail(c, got)
        self._done[i] = 1
