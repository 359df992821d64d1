"""The stream writer's coding (`pipeline.encoded`: recompressing copies) codes its runs as a save's tasks
are: with the pool's coders counted, so that "blosc2" chunks are gathered into shared buffers
where several threads code at once; the stored blocks are byte for byte what `codecs.encode` gives."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import numpy as np
import pytest

from cairn._codecs import blosc2lib, codecs
from cairn._core.checksum import crc32c
from cairn._save import pipeline

BLOCK = 1 << 20


def _raw() -> np.ndarray:
    rng = np.random.default_rng(38)
    return np.round(rng.standard_normal(5 << 20) * 64).astype(np.float32)  # 20 MiB: more than one run


@pytest.mark.parametrize("codec", ["zstd", "planes", "blosc2"])
@pytest.mark.parametrize("workers", [0, 2, 4])
def test_stream_runs_are_byte_for_byte_each_blocks_own_coding(codec, workers):
    if codec == "blosc2" and not codecs.blosc2_available():
        pytest.skip("python-blosc2 is not installed")
    raw = _raw()
    u8 = raw.view(np.uint8)
    with ThreadPoolExecutor(workers) if workers else nullcontext() as pool:
        got = [(bytes(b), crc) for b, crc in pipeline.encoded(pool, codec, memoryview(u8), BLOCK, np.float32)]
    want = [codecs.encode(codec, u8[o : o + BLOCK], np.float32) for o in range(0, u8.nbytes, BLOCK)]
    assert got == [(w, crc32c(w)) for w in want]


def test_blosc2_chunks_are_gathered_where_enough_threads_code(monkeypatch):
    """Through python-blosc2's compress2 (where C-Blosc2 cannot be called directly): chunks gathered into
    shared buffers with enough coders, python-blosc2's own bytes with fewer."""
    if not codecs.blosc2_available():
        pytest.skip("python-blosc2 is not installed")
    monkeypatch.setattr(blosc2lib, "_loaded", [None])
    u8 = _raw().view(np.uint8)
    with ThreadPoolExecutor(codecs.BLOSC2_JOIN_MIN_CODERS) as pool:
        stored = [b for b, _ in pipeline.encoded(pool, "blosc2", memoryview(u8), BLOCK, np.float32)]
    # Views of shared numpy buffers (`codecs._flush_blosc2`), not each chunk python-blosc2 returned.
    assert all(isinstance(s, memoryview) and isinstance(s.obj, np.ndarray) for s in stored)
    with ThreadPoolExecutor(codecs.BLOSC2_JOIN_MIN_CODERS - 1) as pool:
        fewer = [b for b, _ in pipeline.encoded(pool, "blosc2", memoryview(u8), BLOCK, np.float32)]
    assert not any(isinstance(s, memoryview) for s in fewer)



def test_blosc2_chunks_are_coded_into_shared_buffers_directly():
    """Called directly (`blosc2lib`), C-Blosc2 codes each run's chunks into one buffer, however many coders."""
    if not codecs.blosc2_available():
        pytest.skip("python-blosc2 is not installed")
    assert blosc2lib.load(codecs._blosc2()) is not None
    u8 = _raw().view(np.uint8)
    for workers in (1, codecs.BLOSC2_JOIN_MIN_CODERS):
        with ThreadPoolExecutor(workers) as pool:
            stored = [b for b, _ in pipeline.encoded(pool, "blosc2", memoryview(u8), BLOCK, np.float32)]
        assert all(isinstance(s, memoryview) and isinstance(s.obj, np.ndarray) for s in stored)
        assert len({id(s.obj) for s in stored}) < len(stored)  # runs of blocks share a buffer


def test_stream_crcs_are_found_on_the_coders(monkeypatch):
    """A recompressing copy's coded blocks get their CRC-32C on the coder threads, not on the thread that
    writes them (as a save's do: `pipeline.checked`)."""
    import threading

    seen: list[str] = []
    real = pipeline.block_crc

    def noting(b):
        seen.append(threading.current_thread().name)
        return real(b)

    u8 = _raw().view(np.uint8)
    monkeypatch.setattr(pipeline, "block_crc", noting)
    with ThreadPoolExecutor(2, thread_name_prefix="coder") as pool:
        out = list(pipeline.encoded(pool, "zstd", memoryview(u8), BLOCK, np.float32))
    assert len(seen) == len(out) and all(name.startswith("coder") for name in seen)
    assert all(crc == real(b) for b, crc in out)


@pytest.mark.parametrize("codec", ["zstd", "planes", "blosc2"])
def test_stream_blocks_are_coded_into_lent_buffers(monkeypatch, codec):
    """The stream writer codes into buffers lent from `buffers.coded_pool`, as a save does: the blocks are
    the same bytes whether each is dropped at once (its buffer lent again for a later run) or all are held
    to the end (no buffer lent twice)."""
    from cairn._core import buffers

    if codec == "blosc2" and not codecs.blosc2_available():
        pytest.skip("python-blosc2 is not installed")
    monkeypatch.setattr(pipeline, "RUN_BLOCKS", 1)  # 20 runs of one block: buffers of one size, lent again
    u8 = _raw().view(np.uint8)
    want = [codecs.encode(codec, u8[o : o + BLOCK], np.float32) for o in range(0, u8.nbytes, BLOCK)]
    for hold in (False, True):
        pool = buffers.SlabPool()
        monkeypatch.setattr(buffers, "coded_pool", pool)
        with ThreadPoolExecutor(2) as workers:
            got = list(pipeline.encoded(workers, codec, memoryview(u8), BLOCK, np.float32)) if hold else [
                (bytes(b), crc) for b, crc in pipeline.encoded(workers, codec, memoryview(u8), BLOCK, np.float32)]
        assert [(bytes(b), crc) for b, crc in got] == [(w, crc32c(w)) for w in want]
        assert pool.made > 0
        if not hold:
            assert pool.reused > 0
