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
