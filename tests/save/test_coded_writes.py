"""How a compressed save hands its coded blocks to the storage.

The coders find each stored block's CRC-32C and where it lies (`pipeline.checked`): the file's writer
only writes, and blocks that follow each other in a buffer the codecs joined them into go to the storage
as one view of it (`Batch.add`'s `at`), not one write each. The checkpoint is the same: it loads
bitwise, and a flipped stored byte is still a `CorruptCheckpointError`.
"""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

import cairn
from _parts import count_data_writes
from cairn._errors import CorruptCheckpointError
from cairn._save import codecpolicy, pipeline
from cairn._save.pipeline import SMALL_CHUNK, Batch, places

MiB = 1 << 20


def _trained(shape, dtype=ml_dtypes.bfloat16, seed=0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 0.02).astype(dtype)


def _crc_threads(monkeypatch) -> list[str]:
    names: list[str] = []
    real = pipeline.block_crc

    def crc(b, *a):
        names.append(threading.current_thread().name)
        return real(b, *a)

    monkeypatch.setattr(pipeline, "block_crc", crc)
    return names


@pytest.mark.parametrize("codec", ["planes", "zstd", "blosc2"])
def test_a_large_leafs_coded_blocks_are_written_together(tmp_path, monkeypatch, codec):
    if codec == "blosc2":
        pytest.importorskip("blosc2")
    monkeypatch.setattr(codecpolicy, "coder_cores", lambda: 4)  # (blosc2 joins its chunks from 4 coders on)
    parts = count_data_writes(monkeypatch)
    crcs = _crc_threads(monkeypatch)
    w = _trained((8 * MiB // 2,))  # 8 blocks of 1 MiB, one coding task
    cairn.save(tmp_path / "c", {"w": w}, compression=codec, threads=1)
    blocks = 8
    assert sum(parts) < 8 * MiB
    assert len(parts) < blocks / 1.5, parts  # one write per joined buffer, not one per block
    # every stored block's CRC is found by a coder, none by the writer
    assert sum(n.startswith("cairn-code") for n in crcs) == blocks, crcs
    np.testing.assert_array_equal(np.asarray(cairn.load(tmp_path / "c")["w"]), w)


def test_small_blosc2_leaves_of_one_checkpointable_are_written_in_spans(tmp_path, monkeypatch):
    pytest.importorskip("blosc2")
    monkeypatch.setattr(codecpolicy, "coder_cores", lambda: 4)
    parts = count_data_writes(monkeypatch)
    state = {f"l{i:03d}": _trained((256, 200), np.float32, seed=i) for i in range(40)}  # 200 KiB each
    cairn.save(tmp_path / "c", {"params": state}, compression="blosc2", threads=1)  # one checkpointable
    assert all(p > SMALL_CHUNK for p in parts)
    assert len(parts) <= 40 // 3, parts  # joined about 1 MiB at a time: several leaves a write
    back = cairn.load(tmp_path / "c")["params"]
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(back[k]), v)


def test_a_flipped_byte_inside_a_span_is_named(tmp_path, monkeypatch):
    pytest.importorskip("blosc2")
    monkeypatch.setattr(codecpolicy, "coder_cores", lambda: 4)
    state = {f"l{i}": _trained((256, 200), np.float32, seed=i) for i in range(8)}
    cairn.save(tmp_path / "c", {"params": state}, compression="blosc2", threads=1)
    data = [p for p in (tmp_path / "c").rglob("*.bin")]
    assert len(data) == 1
    raw = bytearray(data[0].read_bytes())
    raw[len(raw) // 2] ^= 0x01  # inside some leaf past the first, written in the same view as its neighbours
    data[0].write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=r"l\d"):
        back = cairn.load(tmp_path / "c")["params"]
        for v in back.values():
            np.asarray(v)


def _written(pieces, places) -> list[bytes]:
    batch = Batch()

    def run():
        for p, at in zip(pieces, places):
            yield from batch.add(p, at)
        yield from batch.rest()

    return [bytes(w) for w in run()]


def test_a_batch_writes_next_door_views_as_one_and_keeps_the_order():
    a = np.arange(200, dtype=np.uint8)
    b = np.arange(50, dtype=np.uint8) + 100
    va, vb = memoryview(a), memoryview(b)
    big = bytes(range(256)) * ((SMALL_CHUNK // 256) + 2)  # a plain piece past SMALL_CHUNK
    pieces = [va[0:10], va[10:40], b"xy", va[40:60], va[70:80], vb[0:5], vb[5:9], big, va[80:90], b"z"]
    at = places(pieces)
    assert [p and p[1] for p in at] == [0, 10, None, 40, 70, 0, 5, None, 80, None]
    writes = _written(pieces, at)
    assert b"".join(writes) == b"".join(bytes(p) for p in pieces)  # the file's bytes, in order
    assert writes == [a[0:40].tobytes(), b"xy", a[40:60].tobytes(), a[70:80].tobytes(), b[0:9].tobytes(),
                      big, a[80:90].tobytes(), b"z"]


def test_places_are_none_where_a_piece_is_no_plain_view():
    a = np.arange(64, dtype=np.uint8)
    two = np.arange(64, dtype=np.uint16)
    pieces = [b"abc", memoryview(a)[::2], memoryview(two), memoryview(a)[0:0], memoryview(bytearray(8))]
    assert places(pieces)[:4] == [None, None, None, None]
    assert places(pieces)[4][1] == 0
