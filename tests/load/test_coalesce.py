"""Many small leaves: reads shared between neighbours, batched puts, the GC pause.

A load reads small whole arrays whose bytes lie back to back with one request
per run (`_coalesce`), and places small fully-addressable targets with one
batched `jax.device_put`; these tests check that the values, the errors (which
leaf, which bytes) and the read counts are what the one-by-one path gives.
"""

from __future__ import annotations

import gc
import glob
import os

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from cairn._core.gcpause import paused
from cairn._load.reader import LoadStats


def _state(n: int = 50) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {f"w{i:03d}": rng.standard_normal((16, 3)).astype(np.float32) for i in range(n)}
    out["odd"] = rng.standard_normal((5, 7)).astype(np.float32)  # not split by the mesh
    out["big"] = rng.standard_normal((1 << 18, 2)).astype(np.float32)  # 2 MiB: a read of its own
    return out


def _data_file(path: str) -> str:
    (f,) = glob.glob(os.path.join(path, "*", "p00000-0.*.bin"))
    return f


@pytest.mark.parametrize("where", ["local", "memory"])
def test_many_small_leaves_round_trip(tmp_path, mesh8, where):
    host = _state()
    sh = NamedSharding(mesh8, P("x"))
    state = {k: jax.device_put(v, sh if v.shape[0] % 8 == 0 else NamedSharding(mesh8, P())) for k, v in host.items()}
    path = str(tmp_path / "ck") if where == "local" else "memory://coalesce/ck"
    cairn.save(path, {"params": state}, compression=False)  # raw arrays back to back: what coalescing reads
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}}
    stats = LoadStats()
    from cairn._load import engine as _load
    from cairn._load.source import CairnSource
    from cairn._storage.location import resolve

    out = _load.load(CairnSource.open(resolve(path)), target, stats=stats)["params"]
    for k, v in host.items():
        assert out[k].sharding == state[k].sharding, k
        np.testing.assert_array_equal(np.asarray(out[k]), v)
    # The small leaves share reads: far fewer requests than leaves (the big one reads alone).
    assert stats.reads < 10, stats
    assert stats.bytes_read == sum(v.nbytes for v in host.values())
    plain = cairn.load(path)["params"]  # numpy, no target: the same bytes
    for k, v in host.items():
        np.testing.assert_array_equal(plain[k], v)


def test_corrupt_small_leaf_is_named(tmp_path):
    host = _state()
    path = str(tmp_path / "ck")
    cairn.save(path, {"params": host})
    f = _data_file(path)
    # Bytes of leaf w010: leaves are written in order, each 16*3*4 bytes.
    offset = 10 * 16 * 3 * 4 + 5
    with open(f, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(cairn.CorruptCheckpointError, match=r"checksum mismatch.*params/w010"):
        cairn.load(path)
    out = cairn.load(path, {"params": {"w011": np.zeros((16, 3), np.float32)}}, partial=True)
    np.testing.assert_array_equal(out["params"]["w011"], host["w011"])  # its neighbour still loads


def test_truncated_file_names_a_leaf_it_cuts(tmp_path):
    host = _state(20)
    del host["big"]
    path = str(tmp_path / "ck")
    cairn.save(path, {"params": host})
    f = _data_file(path)
    size = os.path.getsize(f)
    os.truncate(f, size - 10)
    with pytest.raises(cairn.CorruptCheckpointError):
        cairn.load(path)


def test_gc_pause_nests_and_restores():
    assert gc.isenabled()
    with paused():
        assert not gc.isenabled()
        with paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused():
            pass
        assert not gc.isenabled()  # the program's own choice is kept
    finally:
        gc.enable()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 64), st.integers(0, 7), st.data())
def test_block_checks_find_blocks_across_any_segments(sizes, block, base, data):
    """`BlockChecks` verifies each block over whatever segments hold it (empty ones included), the
    same CRC as over the bytes in one piece; a flipped byte fails exactly its block."""
    from cairn._core.checksum import BlockChecks, crc32c

    raw = bytes(range(256)) * 2
    total = sum(sizes)
    blob = bytearray(raw[:total])
    checks = [(base + lo, base + min(lo + block, total), crc32c(bytes(blob[lo:lo + block])))
              for lo in range(0, total, block)]

    def segments():
        out, pos = [], 0
        for n in sizes:
            out.append(memoryview(blob)[pos:pos + n])
            pos += n
        return out

    failed = []
    BlockChecks(checks, segments(), base, lambda c, got: AssertionError(c)).rest()  # all match
    if total:
        at = data.draw(st.integers(0, total - 1))
        blob[at] ^= 1
        bc = BlockChecks(checks, segments(), base, lambda c, got: failed.append(c) or ValueError(c))
        with pytest.raises(ValueError):
            bc.rest()
        assert failed == [checks[at // block]]


def test_small_leaves_are_placed_while_a_later_read_is_still_out(tmp_path, monkeypatch):
    """Small leaves waiting for a batched put are placed once `engine.EARLY_PUT_ITEMS` of them wait and the
    next leaf's read is still out, not all after the last read: here the large leaf's read waits (up to 10 s)
    for a batched put, which comes only from that rule. The values are the same."""
    import threading

    from jax.sharding import SingleDeviceSharding

    from cairn._load import engine, reader
    from cairn._tree import shardings

    monkeypatch.setattr(engine, "EARLY_PUT_ITEMS", 8)
    rng = np.random.default_rng(1)
    state = {f"a{i:03d}": rng.standard_normal((16, 3)).astype(np.float32) for i in range(40)}
    state["z"] = rng.standard_normal((1 << 18, 2)).astype(np.float32)  # 2 MiB, last in the tree's order
    cairn.save(tmp_path / "c", state)
    placed = threading.Event()
    real_flush, real_fill = shardings.PutBatch.flush, reader.ChunkReader._fill

    def flush(self):
        had = self.pending[0]
        real_flush(self)
        if had:
            placed.set()

    waited: list[bool] = []

    def fill(self, file, start, out, leaf, checks=None):
        if leaf.shape == state["z"].shape:
            waited.append(placed.wait(10))
        return real_fill(self, file, start, out, leaf, checks)

    monkeypatch.setattr(shardings.PutBatch, "flush", flush)
    monkeypatch.setattr(reader.ChunkReader, "_fill", fill)
    one = SingleDeviceSharding(jax.devices()[0])
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one) for k, v in state.items()}
    got = cairn.load(tmp_path / "c", target)
    assert waited == [True], "the small leaves were not placed before the large leaf's read ended"
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v)


def test_a_load_of_many_checkpointables_asks_each_reader_to_map_ahead_a_bounded_number_of_times(tmp_path, monkeypatch):
    """Before each array it waits for, the loading thread asked every checkpointable's reader to map its
    fresh buffers ahead (`ChunkReader.start_prefault`): leaves times checkpointables calls, 6 million and
    1.6 s of a load of 2,449 of them. Now only the readers that noted fresh buffers are asked."""
    from cairn._load import reader

    state = _state(60)
    cairn.save(tmp_path / "c", state)
    calls: list[int] = []
    real = reader.ChunkReader.start_prefault
    monkeypatch.setattr(reader.ChunkReader, "start_prefault", lambda self: (calls.append(1), real(self))[1])
    got = cairn.load(tmp_path / "c")
    for k, v in state.items():
        np.testing.assert_array_equal(got[k], v)
    assert len(calls) <= 2 * len(state), len(calls)  # (once each at the end, and once per noting reader)
