"""Chunk merging: a process's shards that follow each other along axis 0 are written as one chunk."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from cairn._core.checksum import block_crcs, crc32c
from cairn._plan import rowmerge as _merge
from cairn._plan.chunking import ChunkLayout


def _leaf_json(path, item):
    (name,) = [n for n in os.listdir(path / item) if n.endswith(".json")]
    return json.loads((path / item / name).read_bytes())["leaves"][0]


def test_merge_rows_joins_rows_of_one_writer_and_keeps_the_others():
    # 4 rows x 2 columns; rows 0-1 by process 0, rows 2-3 by process 1
    layout = ChunkLayout(((0, 2, 4, 6, 8), (0, 3, 6)), (0, 0, 0, 0, 1, 1, 1, 1), (0, 1, 2, 3, 4, 5, 6, 7))
    merged = _merge.merge_rows(layout, 4)
    assert merged.grid == ((0, 4, 8), (0, 3, 6)) and merged.writer == (0, 0, 1, 1)
    assert _merge.pieces(merged, 1) == ((((0, 2), (3, 6)), 1), (((2, 4), (3, 6)), 3))
    assert _merge.pieces(merged, 2) == ((((4, 6), (0, 3)), 4), (((6, 8), (0, 3)), 6))
    # a row whose columns have different writers from the row above never merges
    mixed = ChunkLayout(((0, 2, 4), (0, 3, 6)), (0, 0, 0, 1), (0, 1, 2, 3))
    assert _merge.merge_rows(mixed, 4) is mixed
    # nor past the size cap: a cell is 2 x 3 float32, 24 bytes
    assert _merge.merge_rows(layout, 4, max_bytes=100).grid[0] == (0, 4, 8)
    assert _merge.merge_rows(layout, 4, max_bytes=40).grid[0] == (0, 2, 4, 6, 8)  # a merged cell: 48 bytes


def test_block_crcs_across_pieces_equal_those_of_the_joined_bytes():
    rng = np.random.default_rng(0)
    pieces = [memoryview(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in (5000, 3, 12000, 0, 4096)]
    joined = b"".join(pieces)
    block = 4096
    assert block_crcs(pieces, block) == [crc32c(joined[o : o + block]) for o in range(0, len(joined), block)]


@pytest.mark.parametrize("async_save", [False, True])
def test_fsdp_on_one_host_is_one_chunk_and_loads_onto_any_sharding(tmp_path, mesh8, async_save):
    x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    state = {"w": jax.device_put(x, NamedSharding(mesh8, P("x")))}
    if async_save:
        cairn.save_async(tmp_path / "c", state).result()
    else:
        cairn.save(tmp_path / "c", state)
    leaf = _leaf_json(tmp_path / "c", "w")
    assert leaf["grid"] == [[[1, 64]], [[1, 8]]] and leaf["writers"] == [[1, 0, 0, 1]]  # one chunk, not 8
    for spec in (P("x"), P(None, "x"), P()):
        out = cairn.load(tmp_path / "c", {"w": NamedSharding(mesh8, spec)})["w"]
        assert out.sharding == NamedSharding(mesh8, spec) and np.array_equal(np.asarray(out), x)


def test_merged_chunks_stay_under_the_cap_and_a_flipped_seam_byte_is_caught(tmp_path, mesh8, monkeypatch):
    monkeypatch.setattr(_merge, "MERGE_MAX_BYTES", 3 * 1024)  # 3 of the 8 shards of 1 KiB each
    from cairn._save import assign as _layout

    _layout.layout_cache.clear()
    _layout._sources_cache.clear()
    x = np.arange(256 * 8, dtype=np.float32).reshape(256, 8)
    cairn.save(tmp_path / "c", {"w": jax.device_put(x, NamedSharding(mesh8, P("x")))})
    _layout.layout_cache.clear()
    _layout._sources_cache.clear()
    leaf = _leaf_json(tmp_path / "c", "w")
    assert leaf["grid"][0] == [[2, 96], [1, 64]]  # 3 + 3 + 2 shards of 32 rows
    np.testing.assert_array_equal(cairn.load(tmp_path / "c")["w"], x)
    (data,) = [n for n in os.listdir(tmp_path / "c" / "w") if n.startswith("p")]
    path = tmp_path / "c" / "w" / data
    raw = bytearray(path.read_bytes())
    raw[1024] ^= 0x01  # the first byte of the second shard, inside the first merged chunk
    path.write_bytes(bytes(raw))
    with pytest.raises(cairn.CorruptCheckpointError, match="checksum"):
        cairn.load(tmp_path / "c")


def test_two_dimensional_sharding_merges_rows(tmp_path, mesh42):
    x = np.arange(16 * 6, dtype=np.float32).reshape(16, 6)
    cairn.save(tmp_path / "c", {"w": jax.device_put(x, NamedSharding(mesh42, P("x", "y")))})
    leaf = _leaf_json(tmp_path / "c", "w")
    assert leaf["grid"] == [[[1, 16]], [[2, 3]]]  # 4 x 2 shards -> 1 x 2 chunks
    np.testing.assert_array_equal(cairn.load(tmp_path / "c")["w"], x)
    out = cairn.load(tmp_path / "c", {"w": NamedSharding(mesh42, P("y"))})["w"]
    np.testing.assert_array_equal(np.asarray(out), x)
