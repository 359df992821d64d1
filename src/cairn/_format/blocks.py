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

import numpy as np

from .._errors import CorruptCheckpointError

#: Version 4's per-block codec ids (the byte in a block's source): id i is codec CODEC_NAMES[i]. Id 3 is
#: a delta (`DELTA`, not a codec a leaf can have: decoding a block by the name "delta" is an unknown codec,
#: so a delta named as a base block's codec is rejected as corrupt); "blosc2" (id 4) and "blosc2-lz4" (id 5)
#: came after it.
CODEC_NAMES = ("none", "zstd", "planes", "delta", "blosc2", "blosc2-lz4")
CODEC_IDS = {name: i for i, name in enumerate(CODEC_NAMES)}
HASH_BYTES = 16

#: The codec id of a **delta** block (docs/FORMAT.md §6.5): its stored bytes, in the chunk's own data file,
#: are `DELTA_HEADER` (the base block's codec id, the delta's kind, two zero bytes, the base block's CRC-32C
#: and stored size) then one zstd frame, whose content the kind says; its source's file and offset name the
#: base block.
DELTA = 3
DELTA_HEADER = struct.Struct("<BBHIQ")
#: Delta kinds (the header's second byte). `DELTA_XOR`: the frame is the XOR of the block's raw bytes with
#: the base block's. `DELTA_SPARSE`: the frame is `sparse_payload`'s bytes, the changed elements alone.
DELTA_XOR = 0
DELTA_SPARSE = 1
DELTA_KINDS = ("xor", "sparse")
#: The element sizes a sparse delta can have (its elements are viewed as unsigned integers of this size).
SPARSE_ITEMSIZES = (1, 2, 4, 8)
_UINT: dict[int, np.dtype] = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def uint_of(k: int) -> np.dtype:
    """The little-endian unsigned integer type of k bytes, k in `SPARSE_ITEMSIZES`."""
    return _UINT[k]


def sparse_payload(idx: np.ndarray, values: np.ndarray, k: int) -> bytes:
    """A sparse delta's content before zstd: uint32 n, n uint32 gaps between the changed elements'
    indices (strictly increasing `idx`; the first gap is the first index), then their n new values
    (k bytes each), little-endian."""
    gaps = np.diff(idx, prepend=0).astype("<u4")
    return b"".join((np.uint32(len(idx)).astype("<u4").tobytes(), gaps.tobytes(),
                     np.asarray(values, dtype=_UINT[k]).tobytes()))


def sparse_size(n: int, k: int) -> int:
    """The content size of a sparse delta of n changed k-byte elements."""
    return 4 + n * (4 + k)


def sparse_parse(content: np.ndarray, count: int, k: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A sparse delta's decoded content (uint8, `sparse_payload`) as ``(element indices, new values)``,
    checked against a block of `count` k-byte elements: its size is `sparse_size` of its n, n <= count,
    the indices strictly increasing and below count. Raises CorruptCheckpointError naming `where`."""
    if len(content) < 4:
        raise CorruptCheckpointError(f"{where}: a sparse delta of {len(content)} bytes, shorter than its count")
    n = int(content[:4].view("<u4")[0])
    if n > count or len(content) != sparse_size(n, k):
        raise CorruptCheckpointError(f"{where}: a sparse delta of {len(content)} bytes names {n} changed "
                                     f"elements of {k} bytes (of {count}): it would hold {sparse_size(n, k)}")
    gaps = content[4 : 4 + 4 * n].view("<u4")
    idx = np.cumsum(gaps, dtype=np.int64)
    if n and (idx[-1] >= count or (n > 1 and not bool(gaps[1:].all()))):
        raise CorruptCheckpointError(f"{where}: a sparse delta's element indices are not strictly increasing "
                                     f"below {count}")
    return idx, content[4 + 4 * n :].view(_UINT[k])


try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - a dependency; this keeps the error readable
    _xxhash = None  # type: ignore[assignment]


#: Blocks larger than this are hashed through a hasher object, whose `update` releases the GIL (the one-call
#: `xxh3_128_digest` holds it throughout); smaller ones in one call, which costs less per call.
_GIL_FREE = 64 << 10


def block_hash(data: Any) -> bytes:
    """The 16-byte xxh3-128 digest of a block's raw bytes (any contiguous buffer), as the format stores it.

    A large block is hashed without holding the GIL, so that a save's hashing threads run beside each
    other and beside its writers. python-xxhash's one-call digest holds the GIL for the whole block: two
    threads hashing cached 1 MiB blocks took 19 ms where one took 17 ms, against 14 ms and 27 ms through
    `update`. Alone on one core and from memory `update` is no faster (256 MiB: 26-45 ms one call,
    45-60 ms `update`, on the shared 2-core VM), but incremental saves of a frozen backbone, whose hashing
    runs beside the writes of the changed leaves, took 0.90x and 0.96x the time in two runs of 12 saves
    alternated with the one-call hash."""
    if _xxhash is None:
        raise ImportError("incremental checkpoints need the 'xxhash' package (pip install xxhash)")
    n = data.nbytes if isinstance(data, (memoryview, np.ndarray)) else len(data)
    if n <= _GIL_FREE:
        return _xxhash.xxh3_128_digest(data)
    h = _xxhash.xxh3_128()
    h.update(data)
    return h.digest()
