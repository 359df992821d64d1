"""A large compressed chunk that decodes in place is read in parts (`landing.split_coded`): each part
whole blocks, read, checked and decoded by a reader thread of its own; the same values, one request per part
(as the dry run predicts), and every flipped stored byte a `CorruptCheckpointError` naming its block."""

from __future__ import annotations

import itertools
import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

import cairn
from cairn._load import engine as _load
from cairn._load import landing
from cairn._load.reader import LoadStats
from cairn._load.source import CairnSource
from cairn._plan.reads import Check, Copy, Read
from cairn._storage.location import resolve

MiB = 1 << 20


def _read(start: int, end: int) -> Read:
    return Read(3, start, end, (Copy(0, 0, (4,), ((end - start) // 4,), (0,), 4),), (Check(start, end, 7),))


@pytest.mark.parametrize("nbytes", [1, MiB, 12 * MiB, 12 * MiB + 1, 13 * MiB, 40 * MiB - 5, 128 * MiB])
def test_parts_are_whole_blocks_that_tile_the_read(nbytes):
    block, part = MiB, 8 * MiB
    r = _read(2 * block, 2 * block + nbytes)
    got = landing.split_coded(r, block, part)
    if nbytes <= part * 3 // 2:
        assert got == [r]  # a read up to one and a half parts stays whole, copies and checks kept
        return
    assert got[0].start == r.start and got[-1].end == r.end
    assert all(a.end == b.start for a, b in itertools.pairwise(got))  # no gap, no overlap
    assert all(p.start % block == 0 and p.file == r.file and not p.copies and not p.checks for p in got)
    sizes = [p.end - p.start for p in got]
    assert len(got) == -(-nbytes // part)  # about `part` bytes each...
    assert len(set(sizes[:-1])) == 1 and sizes[-1] <= sizes[0]  # ...equal but the last
    assert sizes[0] - sizes[-1] < len(got) * block  # spread evenly, not a stub at the end


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(38)
    w = (rng.standard_normal((2048, 1024)) * 0.02).astype(np.float32)  # 8 MiB in one chunk: 8 blocks
    return {"w": w, "small": np.arange(1000, dtype=np.float32)}


@pytest.fixture
def parts(monkeypatch):
    monkeypatch.setattr(landing, "CODED_PART", 2 * MiB)  # 8 MiB chunks in 4 parts of 2 blocks
    return 4


def _data_file(path) -> str:
    (f,) = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".bin") and not n.startswith("index.")]
    return f


@pytest.mark.parametrize("codec", ["zstd", "planes"])
def test_a_large_chunk_is_read_in_parts_as_the_plan_says(tmp_path, parts, codec):
    state = _state()
    cairn.save(tmp_path / "c", state, compression=codec)
    sharding = SingleDeviceSharding(jax.devices()[0])
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in state.items()}
    stats = LoadStats()
    got = _load.load(CairnSource.open(resolve(tmp_path / "c")), target, stats=stats)
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v)
    # Each part a request decoded straight into its slice of the leaf; and the small leaf's.
    assert stats.reads == stats.direct_reads == parts + 1
    (p,) = cairn.plan_load(tmp_path / "c", target).processes
    assert (p.requests, p.bytes_read) == (stats.reads, stats.bytes_read)


def test_every_part_checks_its_own_blocks(tmp_path, parts):
    state = _state()
    path = tmp_path / "c"
    cairn.save(path, state, compression="zstd")
    f = _data_file(path / "w")  # (a folder per leaf)
    with open(f, "rb") as src:
        original = src.read()
    sharding = SingleDeviceSharding(jax.devices()[0])
    target = {"w": jax.ShapeDtypeStruct(state["w"].shape, np.float32, sharding=sharding), "small": None}
    seen = set()
    for pos in np.linspace(0, len(original) - 1, 24).astype(int):
        bad = bytearray(original)
        bad[pos] ^= 0x10
        with open(f, "wb") as out:
            out.write(bad)
        with pytest.raises(cairn.CorruptCheckpointError) as e:
            cairn.load(path, target, partial=True)
        m = re.search(r"block (\d+) of chunk", str(e.value))
        if m:
            seen.add(int(m.group(1)))
    with open(f, "wb") as out:
        out.write(original)
    assert seen == set(range(8))  # a flip in any part names that part's block
    np.testing.assert_array_equal(np.asarray(cairn.load(path, target, partial=True)["w"]), state["w"])
