"""CRC-32C (Castagnoli), the format's checksum: hardware-accelerated, releases the GIL."""

from __future__ import annotations

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
