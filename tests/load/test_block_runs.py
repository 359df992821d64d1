"""A leaf with references (format version 4) decodes its coded blocks in runs (`blocks.read_blocks`):
each run of consecutive checked blocks of one codec, own or referred to, is one `codecs.decode_run` call per
piece of `blocks.RUN_PIECE` raw bytes, not one `codecs.decode` call a block; the values are bitwise the saved
ones, every block's CRC-32C is checked before any decoding, and a corrupt block is named."""

from __future__ import annotations

import glob
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import cairn
from _parts import delta_kinds
from cairn._codecs import codecs
from cairn._errors import CorruptCheckpointError
from cairn._format.blocks import CODEC_IDS
from cairn._load import blocks, decodepool

CODECS = ["zstd", "planes"] + (["blosc2"] if codecs.blosc2_available() else [])
MiB = 1 << 20


def _w(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.round(rng.standard_normal((2048, 2048)) * 64).astype(np.float32)  # 16 MiB: 16 blocks


def _chain(tmp_path: Path, codec: str) -> tuple[Path, np.ndarray]:
    """s2 refers to s1's blocks where the leaf did not change (rows 0..1023: blocks 0..7) and stores the rest."""
    w0 = _w(0)
    cairn.save(tmp_path / "s0", {"w": w0}, compression=codec)
    cairn.save(tmp_path / "s1", {"w": w0}, base=tmp_path / "s0", compression=codec)  # every block, with hashes
    w2 = w0.copy()
    w2[1024:] = _w(2)[1024:]
    cairn.save(tmp_path / "s2", {"w": w2}, base=tmp_path / "s1", compression=codec)
    shutil.rmtree(tmp_path / "s0")
    return tmp_path / "s2", w2


class _Calls:
    """`codecs.decode` calls made by `read_blocks` itself, and the blocks of each `decode_run` call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decode_in_read_blocks = 0
        self.runs: list[int] = []
        decode, decode_run = codecs.decode, codecs.decode_run

        def counted_decode(*a, **k):
            if sys._getframe(1).f_code.co_name == "read_blocks":
                self.decode_in_read_blocks += 1
            return decode(*a, **k)

        def counted_run(codec, stored, *a, **k):
            self.runs.append(len(stored))
            return decode_run(codec, stored, *a, **k)

        monkeypatch.setattr(codecs, "decode", counted_decode)
        monkeypatch.setattr(codecs, "decode_run", counted_run)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("threads", [0, 3])
def test_referred_and_own_coded_blocks_decode_in_runs(tmp_path, monkeypatch, codec, threads):
    monkeypatch.setattr(decodepool, "DECODE_THREADS", threads)
    path, w2 = _chain(tmp_path, codec)
    calls = _Calls(monkeypatch)
    got = cairn.load(path)["w"]
    assert got.tobytes() == w2.tobytes()
    assert calls.decode_in_read_blocks == 0  # one call a block would make 16
    assert sum(calls.runs) == 16
    # Pieces of RUN_PIECE (4 blocks of 1 MiB); runs cross from s1's file (the references) into s2's own.
    assert all(n >= 2 for n in calls.runs), calls.runs
    assert len(calls.runs) <= 16 // 2


def test_runs_break_where_the_codec_or_the_block_number_changes():
    coded = [(0, 2, b""), (1, 2, b""), (3, 2, b""), (4, 3, b""), (5, 3, b""), (6, 2, b"")]
    assert blocks.coded_runs(coded) == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert blocks.coded_runs([]) == []
    spans = [(0, 60, "a"), (60, 120, "b"), (120, 180, "c"), (180, 200, "d"), (200, 300, "e")]
    assert decodepool.pieces(spans, 0, 5, 100) == [(0, 2), (2, 5)]
    assert decodepool.pieces(spans, 1, 3, 100) == [(1, 3)]
    assert decodepool.pieces(spans, 0, 5, 1) == [(k, k + 1) for k in range(5)]


@pytest.mark.parametrize("codec", CODECS)
def test_a_block_that_does_not_decode_is_named_in_its_run(codec):
    w = _w(5).reshape(-1).view(np.uint8)
    block = 1 << 16
    stored = [codecs.encode(codec, w[b * block : (b + 1) * block], np.float32) for b in range(6)]
    bad = bytearray(stored[4])
    bad[len(bad) // 2 :] = bytes(len(bad) - len(bad) // 2)  # its second half zeroed
    stored[4] = bytes(bad)
    coded = [(b, CODEC_IDS[codec], s) for b, s in enumerate(stored)]
    raw = np.zeros(6 * block, np.uint8)
    with pytest.raises(CorruptCheckpointError, match="leaf 'w' block 4 of chunk 7"):
        blocks._decode_coded(coded, [block] * 6, block, 0, raw, np.float32, lambda b: f"leaf 'w' block {b} of chunk 7")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("which", ["own", "referred to"])
def test_a_flipped_stored_byte_is_named_before_anything_decodes(tmp_path, monkeypatch, codec, which):
    path, _ = _chain(tmp_path, codec)
    (f,) = glob.glob(str((path if which == "own" else tmp_path / "s1") / "*" / "*.bin"))
    data = bytearray(Path(f).read_bytes())
    data[len(data) // 4] ^= 0x04  # in an own block of s2 (its file holds blocks 8..15), or in block 2 of s1's
    Path(f).write_bytes(bytes(data))
    calls = _Calls(monkeypatch)
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch.*leaf 'w', chunk 0 block \d+") as e:
        cairn.load(path)
    assert ("base checkpoint 's1'" in str(e.value)) == (which == "referred to")
    assert calls.runs == []  # the read's blocks are checked before any of them decodes


def test_deltas_between_coded_blocks_split_the_runs(tmp_path, monkeypatch):
    """A leaf whose changed blocks are deltas: the deltas are rebuilt as before, the coded blocks around
    them still decoded in runs, the values bitwise."""
    import ml_dtypes

    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((2048, 2048)).astype(ml_dtypes.bfloat16)  # 8 MiB: 8 blocks
    cairn.save(tmp_path / "s0", {"w": w0}, compression="zstd")
    cairn.save(tmp_path / "s1", {"w": w0}, base=tmp_path / "s0", compression="zstd")
    w2 = w0.copy()
    bits = w2.view(np.uint16)
    bits[512:1024, ::97] += 1  # a few elements of blocks 2 and 3 changed: deltas
    cairn.save(tmp_path / "s2", {"w": w2}, base=tmp_path / "s1", compression="zstd")
    assert len(delta_kinds(tmp_path / "s2")) == 2
    calls = _Calls(monkeypatch)
    got = cairn.load(tmp_path / "s2")["w"]
    assert got.tobytes() == w2.tobytes()
    assert calls.decode_in_read_blocks == 0
    assert sum(calls.runs) == 6 and all(n >= 2 for n in calls.runs), calls.runs  # 0-1, 4-7 (2, 3: `apply_delta`)


@pytest.mark.parametrize("threads", [0, 3])
def test_a_reads_deltas_are_rebuilt_by_its_thread_and_the_decode_pool(tmp_path, monkeypatch, threads):
    """A read's deltas are rebuilt in pieces (`blocks.DELTA_PIECE`), each taken by the reader thread or a free
    thread of the decode pool (`decodepool.share`): every delta rebuilt once, the values bitwise; a damaged
    base block is named, whichever thread met it."""
    import threading

    import ml_dtypes

    monkeypatch.setattr(decodepool, "DECODE_THREADS", threads)
    rng = np.random.default_rng(4)
    w0 = rng.standard_normal((4096, 2048)).astype(ml_dtypes.bfloat16)  # 16 MiB: 16 blocks
    cairn.save(tmp_path / "s0", {"w": w0})
    cairn.save(tmp_path / "s1", {"w": w0}, base=tmp_path / "s0")
    w2 = w0.copy()
    w2.view(np.uint16)[:, ::211] += 1  # every block changed a little: 16 deltas
    cairn.save(tmp_path / "s2", {"w": w2}, base=tmp_path / "s1")
    assert len(delta_kinds(tmp_path / "s2")) == 16
    rebuilt: list[str] = []
    real = blocks.apply_delta

    def counted(*a, **k):
        rebuilt.append(threading.current_thread().name)
        return real(*a, **k)

    monkeypatch.setattr(blocks, "apply_delta", counted)
    assert cairn.load(tmp_path / "s2")["w"].tobytes() == w2.tobytes()
    assert len(rebuilt) == 16
    if threads == 0:
        assert not any(n.startswith("cairn-decode") for n in rebuilt)
    # A flipped byte in the base block of the 12th delta: named, wherever it was rebuilt.
    (base_file,) = glob.glob(str(tmp_path / "s1" / "*" / "*.bin"))
    with open(base_file, "r+b") as f:
        f.seek(11 * MiB + 5)
        byte = f.read(1)
        f.seek(11 * MiB + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError, match="base block of a delta"):
        cairn.load(tmp_path / "s2")


def test_deltas_rebuilt_on_the_decode_pool_leave_no_buffer_on_its_threads(tmp_path, monkeypatch):
    """The decode pool outlives loads: the scratch buffers its threads take to rebuild deltas are the load's
    (`landing.in_scope`), dropped with it, not kept on the threads."""
    import threading

    import ml_dtypes

    from cairn._load import landing

    monkeypatch.setattr(decodepool, "DECODE_THREADS", 3)
    monkeypatch.setattr(blocks, "DELTA_PIECE", 1)  # every delta its own piece: the pool takes some
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal((4096, 2048)).astype(ml_dtypes.bfloat16)
    cairn.save(tmp_path / "s0", {"w": w0})
    cairn.save(tmp_path / "s1", {"w": w0}, base=tmp_path / "s0")
    w2 = w0.copy()
    w2.view(np.uint16)[:, ::3] += 1  # a third of the elements: XOR deltas (their scratch is a whole block)
    cairn.save(tmp_path / "s2", {"w": w2}, base=tmp_path / "s1")
    for _ in range(3):
        assert cairn.load(tmp_path / "s2")["w"].tobytes() == w2.tobytes()
    pool = decodepool.decode_pool()
    assert pool is not None
    gate = threading.Barrier(3, timeout=10)

    def held() -> list[str]:
        gate.wait()  # all three threads at once: each reports its own
        return sorted(k for k in landing._local.__dict__ if k != "scope")

    assert [f.result(timeout=10) for f in [pool.submit(held) for _ in range(3)]] == [[], [], []]
