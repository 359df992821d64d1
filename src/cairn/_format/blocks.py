"""Pure: what format version 4 records per checksum block (docs/FORMAT.md §6.5).

Every block of a version-4 chunk carries, beside its CRC-32C and stored size,
the 128-bit hash of its raw bytes and its *source*: the chunk's own bytes, or
a reference to a block of an earlier checkpoint of the same run (a data file
of the index whose entry names that checkpoint in `base`). An incremental
save compares hashes to decide which blocks it can refer to instead of
writing (`_save.incremental`); a reader follows sources (`_load.blocks`).

The hash is xxh3-128 (the `xxhash` package): non-cryptographic, 128 bits, so
an accidental collision between two different blocks at the same position
is out of reach (about 2^-128 per comparison), and it runs faster than the
CRC-32C the format already computes (5.9 GiB/s against 3.6 GiB/s on one
core of the development machine): a save that changes everything pays for
it no more than for one more checksum pass.
"""

from __future__ import annotations

import struct
from typing import Any

#: Version 4's per-block codec ids (the byte in a block's source): id i is codec CODEC_NAMES[i]. Id 3 is
#: a delta (`DELTA`, not a codec a leaf can have: decoding a block by the name "delta" is an unknown codec,
#: so a delta named as a base block's codec is rejected as corrupt); "blosc2" (id 4) came after it.
CODEC_NAMES = ("none", "zstd", "planes", "delta", "blosc2")
CODEC_IDS = {name: i for i, name in enumerate(CODEC_NAMES)}
HASH_BYTES = 16

#: The codec id of a **delta** block (docs/FORMAT.md §6.5): its stored bytes, in the chunk's own data file,
#: are `DELTA_HEADER` (the base block's codec id, CRC-32C and stored size) then one zstd frame of the XOR of
#: its raw bytes with the base block's raw bytes; its source's file and offset name the base block.
DELTA = 3
DELTA_HEADER = struct.Struct("<B3xIQ")

try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - a dependency; this keeps the error readable
    _xxhash = None  # type: ignore[assignment]


def block_hash(data: Any) -> bytes:
    """The 16-byte xxh3-128 digest of a block's raw bytes (any contiguous buffer), as the format stores it."""
    if _xxhash is None:
        raise ImportError("incremental checkpoints need the 'xxhash' package (pip install xxhash)")
    return _xxhash.xxh3_128_digest(data)
