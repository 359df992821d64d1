"""The chunk hashes of the `jax.Array` leaves this process hashed, kept while each array lives: a later
incremental save given the same array object refers to its base's blocks without hashing them again
(`incremental.Incremental._unchanged`), where a chunk in host memory still matches its fingerprint
(`sample`)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from .._tree.leaves import ArraySource

#: Chunk hashes of the `jax.Array` leaves this process hashed, by array: id -> (a weak reference to
#: it, {(grid, block size, cell): (the chunk's block hashes, joined; its `sample` or None)}). A
#: jax.Array's bytes never change (an update makes a new array; a donation deletes it), so where a
#: later save is given the same array object and its base records those very hashes at that
#: position, the base's blocks hold the array's bytes: the chunk is referred to without hashing
#: its bytes (a frozen backbone passed through training unchanged). A numpy array can change in
#: place: never kept here. Nor, against JAX's contract, can a jax.Array over memory that another
#: library shares and changes (`jax.dlpack.from_dlpack` of a numpy array aliases it on CPU): a
#: chunk in host memory must also match its `sample`, which any change to more than a few percent
#: of its elements, or to a run of 4 KiB, alters.
_HASHED: dict[int, tuple[Any, dict[tuple[Any, int, int], tuple[bytes, bytes | None]]]] = {}
_HASHED_LOCK = threading.RLock()  # (reentrant: a collection inside it may run `_forget`)


def hashed_of(value: Any) -> dict[tuple[Any, int, int], tuple[bytes, bytes | None]] | None:
    """The chunk hashes kept for jax.Array `value`, or None (another array, or none kept)."""
    with _HASHED_LOCK:
        got = _HASHED.get(id(value))
    if got is None or got[0]() is not value:
        return None
    return got[1]


#: `sample` takes this many bytes of every `SAMPLE_EVERY`.
SAMPLE_BYTES = 64
SAMPLE_EVERY = 4096


def sample(raw: Any) -> bytes:
    """A fingerprint of a chunk's host bytes: the hash of `SAMPLE_BYTES` of every `SAMPLE_EVERY`
    (1.6% of them) and of its last bytes (of a small chunk, of all), for `_HASHED`'s chunks in host
    memory."""
    import xxhash  # (present: `block_hash` needs it)

    a = np.frombuffer(raw, np.uint8)
    if len(a) <= 16 * SAMPLE_EVERY:  # small: all of it
        return xxhash.xxh3_64_digest(a.data)
    n = len(a) // SAMPLE_EVERY
    picked = np.ascontiguousarray(a[: n * SAMPLE_EVERY].reshape(n, SAMPLE_EVERY)[:, :SAMPLE_BYTES])
    return xxhash.xxh3_64_digest(picked.data) + xxhash.xxh3_64_digest(a[-SAMPLE_BYTES:].tobytes())


def sample_parts(parts: list[Any]) -> bytes:
    """`sample` of the bytes of `parts` (uint8 arrays) one after another, without joining them where every
    part but the last is a whole number of `SAMPLE_EVERY` bytes (a merged chunk's shards)."""
    import xxhash  # (present: `block_hash` needs it)

    total = sum(len(p) for p in parts)
    if total <= 16 * SAMPLE_EVERY or any(len(p) % SAMPLE_EVERY for p in parts[:-1]) or len(parts[-1]) < SAMPLE_BYTES:
        return sample(np.concatenate(parts) if parts else b"")
    picked = np.concatenate([np.ascontiguousarray(
        p[: len(p) // SAMPLE_EVERY * SAMPLE_EVERY].reshape(-1, SAMPLE_EVERY)[:, :SAMPLE_BYTES]).reshape(-1)
        for p in parts])
    return xxhash.xxh3_64_digest(picked.data) + xxhash.xxh3_64_digest(parts[-1][-SAMPLE_BYTES:].tobytes())


def in_host_memory(value: Any) -> bool:
    return any(d.platform == "cpu" for d in value.sharding.device_set)


def remember(value: Any, key: tuple[Any, int, int], hashes: bytes, sample: bytes | None) -> None:
    """Keep the chunk hashes of jax.Array `value` at `key` (grid, block size, cell) while it lives,
    with the chunk's `sample` where it lies in host memory."""
    vid = id(value)
    with _HASHED_LOCK:
        got = _HASHED.get(vid)
        if got is None or got[0]() is not value:
            def gone(r: Any, vid: int = vid) -> None:
                _forget(vid, r)

            try:
                ref = weakref.ref(value, gone)
            except TypeError:
                return
            got = _HASHED[vid] = (ref, {})
        got[1][key] = (hashes, sample)


def _forget(vid: int, ref: Any) -> None:
    with _HASHED_LOCK:
        got = _HASHED.get(vid)
        if got is not None and got[0] is ref:
            del _HASHED[vid]


def same_array(src: Any) -> Any:
    """`src`'s jax.Array where its hashes may be kept (`_HASHED`): a live array leaf, else None."""
    if not isinstance(src, ArraySource) or not src.is_jax or src.kind != "array":
        return None
    value = src.value
    try:
        if value.is_deleted():  # (its save fails on reading it; nothing to skip)
            return None
    except AttributeError:
        return None
    return value
