"""Compressed reads decoded on the process's decode pool (`decodepool.DECODE_THREADS`): a read's
blocks cut into pieces, the first decoded by the reader thread, the others on the pool; the same
values, the same errors, every flipped stored byte a `CorruptCheckpointError`."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import cairn
from cairn._codecs import codecs
from cairn._load import decodepool, reader

CODECS = ["zstd", "planes"] + (["blosc2"] if codecs.blosc2_available() else [])


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(38)
    w = (rng.standard_normal((1024, 1536)) * 0.02).astype(np.float32)  # 6 MiB: 6 blocks, two reads
    return {"w": w, "m": np.round(w * 64).astype(np.float32), "i": np.arange(1 << 20, dtype=np.int32)}


@pytest.fixture(params=["0", "3", "3+parts"])
def decode_threads(request, monkeypatch):
    """No decode pool, a pool of 3 (reads decoded in place stay on their reader threads), or a pool of 3
    that those reads share too (`reader.PART_POOL`)."""
    threads, *rest = request.param.split("+")
    monkeypatch.setattr(decodepool, "DECODE_THREADS", int(threads))
    monkeypatch.setattr(reader, "PART_POOL", "parts" in rest)
    return request.param


def test_pieces_are_whole_blocks_of_at_least_the_piece_size(monkeypatch):
    monkeypatch.setattr(decodepool, "DECODE_PIECE", 100)
    blocks = [(0, 60, "a"), (60, 120, "b"), (120, 180, "c"), (180, 200, "d"), (200, 300, "e")]
    assert decodepool.pieces(blocks, 0, 5) == [(0, 2), (2, 5)]
    assert decodepool.pieces(blocks, 1, 3) == [(1, 3)]
    assert decodepool.pieces(blocks, 4, 5) == [(4, 5)]
    monkeypatch.setattr(decodepool, "DECODE_PIECE", 1)
    assert decodepool.pieces(blocks, 0, 5) == [(k, k + 1) for k in range(5)]


def test_spread_runs_the_first_piece_here_and_the_rest_on_the_pool(monkeypatch):
    monkeypatch.setattr(decodepool, "DECODE_THREADS", 2)
    seen: dict[tuple[int, int], str] = {}

    def decode(a: int, b: int) -> None:
        seen[(a, b)] = threading.current_thread().name

    decodepool.spread(decode, [(0, 1), (1, 2), (2, 4)])
    assert seen[(0, 1)] == threading.current_thread().name
    assert seen[(1, 2)].startswith("cairn-decode") and seen[(2, 4)].startswith("cairn-decode")


def test_spread_raises_the_first_failure_in_block_order_after_every_piece_ran(monkeypatch):
    monkeypatch.setattr(decodepool, "DECODE_THREADS", 2)
    done: list[int] = []
    gate = threading.Event()

    def decode(a: int, b: int) -> None:
        if a == 0:
            gate.wait(10)  # the pool's pieces fail first; the error raised is still block 1's
        if a in (1, 2):
            if a == 2:
                gate.set()
            raise ValueError(f"piece {a}")
        done.append(a)

    with pytest.raises(ValueError, match="piece 1"):
        decodepool.spread(decode, [(0, 1), (1, 2), (2, 3), (3, 4)])
    assert sorted(done) == [0, 3]


def test_spread_waits_for_the_pool_when_its_own_piece_fails(monkeypatch):
    monkeypatch.setattr(decodepool, "DECODE_THREADS", 2)
    release, done = threading.Event(), []

    def decode(a: int, b: int) -> None:
        if a == 0:
            raise ValueError("mine")
        release.wait(10)
        done.append(a)

    threading.Timer(0.05, release.set).start()
    with pytest.raises(ValueError, match="mine"):
        decodepool.spread(decode, [(0, 1), (1, 2)])
    assert done == [1]  # returned only once the piece reading the caller's buffer was done


def test_no_pool_below_two_threads(monkeypatch):
    monkeypatch.setattr(decodepool, "DECODE_THREADS", 1)
    assert decodepool.decode_pool() is None
    monkeypatch.setattr(decodepool, "DECODE_THREADS", 0)
    assert decodepool.decode_pool() is None


@pytest.mark.parametrize("codec", CODECS)
def test_compressed_load_same_values(tmp_path, codec, decode_threads):
    state = _state()
    cairn.save(tmp_path / "c", state, compression=codec)
    got = cairn.load(tmp_path / "c")
    for k, v in state.items():
        np.testing.assert_array_equal(got[k], v)
    box = cairn.load(tmp_path / "c", {"w": cairn.ArrayMetadata((1024, 1536), np.float32, 0), "m": None, "i": None},
                     partial=True)
    np.testing.assert_array_equal(box["w"], state["w"])


def _data_files(path) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, ns in os.walk(path) for n in ns
                  if n.endswith(".bin") and not n.startswith("index."))


@pytest.mark.parametrize("codec", CODECS)
def test_every_sampled_flip_in_stored_blocks_is_corrupt(tmp_path, codec, decode_threads):
    state = _state()
    path = tmp_path / "c"
    cairn.save(path, state, compression=codec)
    rng = np.random.default_rng(1)
    for f in _data_files(path):
        with open(f, "rb") as src:
            original = src.read()
        for pos in sorted({0, len(original) - 1, *map(int, rng.integers(0, len(original), 12))}):
            bad = bytearray(original)
            bad[pos] ^= 1 << int(rng.integers(8))
            with open(f, "wb") as out:
                out.write(bad)
            with pytest.raises(cairn.CorruptCheckpointError):
                cairn.load(path)
        with open(f, "wb") as out:
            out.write(original)
    got = cairn.load(path)
    np.testing.assert_array_equal(got["w"], state["w"])


def _decoding_threads(path, monkeypatch, wait_for_pool: bool = False, **kwargs) -> list[str]:
    """The names of the threads that decode compressed blocks in ``cairn.load(path, **kwargs)``. With
    `wait_for_pool`, a piece decoded outside the decode pool first waits (up to 10 s) for a pool thread
    to decode one: where pieces are shared, a reader thread would otherwise often take them all before
    an idle pool thread wakes, and whether the pool was asked could not be told from the names."""
    names: list[str] = []
    real = codecs.decode_run
    pooled = threading.Event()

    def spy(*args, **kw):
        name = threading.current_thread().name
        names.append(name)
        if name.startswith("cairn-decode"):
            pooled.set()
        elif wait_for_pool:
            pooled.wait(10)
        return real(*args, **kw)

    monkeypatch.setattr(codecs, "decode_run", spy)
    cairn.load(path, **kwargs)
    monkeypatch.setattr(codecs, "decode_run", real)
    return names


def test_a_read_decoded_in_place_stays_on_its_reader_thread(tmp_path, monkeypatch):
    """A local read that decodes straight into its array (or a part of a large chunk) is decoded by the
    reader thread that read it, not shared with the decode pool (`reader.PART_POOL`); with the switch on,
    its pieces go to the pool too."""
    monkeypatch.setattr(decodepool, "DECODE_THREADS", 3)
    monkeypatch.setattr(decodepool, "DECODE_PIECE", 1 << 20)  # 1 MiB pieces: every read has several
    cairn.save(tmp_path / "c", _state(), compression="zstd")
    names = _decoding_threads(tmp_path / "c", monkeypatch)
    assert names and not any(n.startswith("cairn-decode") for n in names), names
    monkeypatch.setattr(reader, "PART_POOL", True)
    names = _decoding_threads(tmp_path / "c", monkeypatch, wait_for_pool=True)
    assert any(n.startswith("cairn-decode") for n in names), names


def test_a_read_through_a_buffer_decodes_on_the_pool(tmp_path, monkeypatch):
    """A compressed read that cannot land in place (a leaf split by columns over two devices: no box is
    one run of memory) is decoded into a buffer by its reader thread and the decode pool."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    monkeypatch.setattr(decodepool, "DECODE_THREADS", 3)
    monkeypatch.setattr(decodepool, "DECODE_PIECE", 1 << 20)
    state = _state()
    cairn.save(tmp_path / "c", state, compression="zstd")
    columns = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), PartitionSpec(None, "x"))
    target = {"w": jax.ShapeDtypeStruct((1024, 1536), np.float32, sharding=columns), "m": None, "i": None}
    names = _decoding_threads(tmp_path / "c", monkeypatch, wait_for_pool=True, target=target, partial=True)
    assert any(n.startswith("cairn-decode") for n in names), names


def test_a_compressed_load_never_waits_for_its_pieces_behind_a_busy_pool(tmp_path, monkeypatch):
    """A compressed read's pieces are shared (`reader.CODED_SHARED`): with every decode-pool thread held by
    other work, the load's reader threads decode every piece themselves and the load completes."""
    monkeypatch.setattr(reader, "PART_POOL", True)  # (else these reads never ask the pool)
    monkeypatch.setattr(decodepool, "DECODE_THREADS", 2)
    monkeypatch.setattr(decodepool, "DECODE_PIECE", 1 << 20)  # 1 MiB pieces: every read has several
    w = (np.random.default_rng(3).standard_normal((1024, 1024)) * 0.02).astype(np.float32)  # 4 MiB, 4 blocks
    cairn.save(tmp_path / "c", {"w": w}, compression="zstd")
    pool, gate = decodepool.decode_pool(), threading.Event()
    assert pool is not None
    busy = [pool.submit(gate.wait, 30) for _ in range(2)]
    try:
        done: list[object] = []
        t = threading.Thread(target=lambda: done.append(cairn.load(tmp_path / "c")))
        t.start()
        t.join(20)
        assert done, "the load waited for its pieces queued behind the busy pool"
        np.testing.assert_array_equal(done[0]["w"], w)
    finally:
        gate.set()
        for f in busy:
            f.result(timeout=10)
        t.join(30)


def test_share_takes_every_run_itself_while_the_pool_is_busy(monkeypatch):
    monkeypatch.setattr(decodepool, "DECODE_THREADS", 2)
    pool, gate = decodepool.decode_pool(), threading.Event()
    assert pool is not None
    busy = [pool.submit(gate.wait, 10) for _ in range(2)]  # other reads' work holds both pool threads
    seen: dict[tuple[int, int], str] = {}
    try:
        done = threading.Event()

        def run() -> None:
            decodepool.share(lambda a, b: seen.__setitem__((a, b), threading.current_thread().name),
                             [(0, 1), (1, 2), (2, 4)])
            done.set()

        t = threading.Thread(target=run, name="reader")
        t.start()
        assert done.wait(10)  # (`spread` would wait here for its pieces queued behind the busy threads)
        assert seen == {(0, 1): "reader", (1, 2): "reader", (2, 4): "reader"}
    finally:
        gate.set()
        for f in busy:
            f.result(timeout=10)


def test_share_runs_every_run_and_raises_the_first_failure_in_run_order(monkeypatch):
    monkeypatch.setattr(decodepool, "DECODE_THREADS", 3)
    done: list[int] = []
    lock = threading.Lock()

    def decode(a: int, b: int) -> None:
        if a in (1, 3):
            raise ValueError(f"run {a}")
        with lock:
            done.append(a)

    for _ in range(20):  # whichever thread takes which run
        done.clear()
        with pytest.raises(ValueError, match="run 1"):
            decodepool.share(decode, [(k, k + 1) for k in range(6)])
        assert sorted(done) == [0, 2, 4, 5]
    decodepool.share(lambda a, b: done.append(-1), [(0, 1)])  # one run: this thread alone
    assert done[-1] == -1


@pytest.mark.parametrize("codec", CODECS)
def test_a_run_of_small_compressed_leaves_is_decoded_on_the_pool(tmp_path, monkeypatch, codec):
    """Small compressed leaves read together in one run (`coalesce.Runs`) are decoded in pieces of several
    leaves, the first by the reader thread and the others on the decode pool (before: all by the reader)."""
    rng = np.random.default_rng(7)
    state = {f"l{i:02d}": (rng.standard_normal((64, 96)) * 0.02).astype(np.float32) for i in range(24)}  # 24 KiB
    cairn.save(tmp_path / "c", {"p": state}, compression=codec)
    monkeypatch.setattr(decodepool, "DECODE_THREADS", 3)
    monkeypatch.setattr(decodepool, "DECODE_PIECE", 64 << 10)  # about 3 leaves a piece
    threads: set[str] = set()
    real = codecs.decode_run

    def decode_run(*a, **k):
        threads.add(threading.current_thread().name)
        return real(*a, **k)

    monkeypatch.setattr(codecs, "decode_run", decode_run)
    back = cairn.load(tmp_path / "c", threads=1)["p"]
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(back[k]), v)
    assert any(t.startswith("cairn-decode") for t in threads), threads
    assert any(not t.startswith("cairn-decode") for t in threads), threads  # the reader decodes its first piece


@pytest.mark.parametrize("codec", CODECS)
def test_a_flipped_byte_in_a_run_of_small_compressed_leaves_names_its_leaf(tmp_path, monkeypatch, codec):
    rng = np.random.default_rng(8)
    state = {f"l{i:02d}": (rng.standard_normal((64, 96)) * 0.02).astype(np.float32) for i in range(24)}
    cairn.save(tmp_path / "c", {"p": state}, compression=codec)
    monkeypatch.setattr(decodepool, "DECODE_THREADS", 3)
    monkeypatch.setattr(decodepool, "DECODE_PIECE", 64 << 10)
    data = list((tmp_path / "c").rglob("*.bin"))
    assert len(data) == 1
    raw = bytearray(data[0].read_bytes())
    raw[len(raw) * 2 // 3] ^= 0x10
    data[0].write_bytes(bytes(raw))
    with pytest.raises(cairn.CorruptCheckpointError, match=r"l\d\d"):
        back = cairn.load(tmp_path / "c", threads=1)["p"]
        for v in back.values():
            np.asarray(v)
