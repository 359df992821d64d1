"""Host buffers: `prefault` maps pages without changing a byte, alone or beside a copy."""

from __future__ import annotations

import threading

import numpy as np

from cairn._core.buffers import aligned_empty, prefault


def test_prefault_keeps_every_byte() -> None:
    for n in (0, 1, 4095, 4096, 3 * 4096 + 17, 9 << 20):
        a = aligned_empty((n,), np.dtype(np.uint8), huge_pages=False)
        a[:] = np.arange(n, dtype=np.uint64).astype(np.uint8)
        prefault(a[1:])  # an unaligned start and end: only whole pages inside are mapped
        prefault(a)
        assert np.array_equal(a, np.arange(n, dtype=np.uint64).astype(np.uint8))


def test_prefault_beside_a_copy_into_the_same_pages() -> None:
    src = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8)
    for _ in range(3):
        dest = aligned_empty(src.shape, src.dtype, huge_pages=False)
        t = threading.Thread(target=prefault, args=(dest,))
        t.start()
        for lo in range(0, src.nbytes, 1 << 20):  # the copy races the mapping, page by page
            dest[lo : lo + (1 << 20)] = src[lo : lo + (1 << 20)]
        t.join(timeout=60)
        assert not t.is_alive()
        assert np.array_equal(dest, src)
