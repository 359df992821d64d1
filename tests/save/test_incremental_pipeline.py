"""How an incremental save codes its changed blocks and hands them to the storage.

Own raw blocks next to each other go to the storage as one buffer of up to `OWN_SPAN` bytes, not one
per block; spans break at references and deltas, and the checkpoint is the same. A bf16 block with few
elements changed is stored as a sparse delta without its XOR frame coded first (`SPARSE_FIRST`); where
the XOR frame stores far less, it is still compared and kept (test_incremental.py's
test_xor_deltas_stay_where_they_store_far_less).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import cairn
from _parts import count_data_writes, delta_kinds
from cairn._save import incremental as inc
from cairn._storage import local as _local

MiB = 1 << 20


def _hashed(path, state: dict) -> None:
    """A self-contained save with block hashes at `path` (against a plain save beside it), to be a base."""
    cairn.save(str(path) + "_plain", state, compression=False)
    cairn.save(path, state, compression=False, base=str(path) + "_plain")


def test_own_raw_blocks_are_written_in_spans(tmp_path, monkeypatch):
    base = str(tmp_path / "base")
    cairn.save(base, {"w": np.zeros(16 * MiB // 4, np.float32)}, compression=False, threads=1)
    parts = count_data_writes(monkeypatch)
    state = {"w": np.random.default_rng(2).standard_normal(16 * MiB // 4).astype(np.float32)}
    stats = cairn.save(str(tmp_path / "next"), state, compression=False, base=base, threads=1)
    assert sum(parts) == 16 * MiB and stats.bytes_written >= 16 * MiB
    assert len(parts) == 16 * MiB // inc.OWN_SPAN, parts  # one per span, not one per 1 MiB block
    assert np.asarray(cairn.load(str(tmp_path / "next"))["w"]).tobytes() == state["w"].tobytes()


@pytest.mark.parametrize("changed", [(0,), (2,), (3,), (0, 3), (0, 2, 3)])
def test_spans_break_at_references_and_deltas(tmp_path, changed):
    # A 4-block leaf whose blocks `changed` differ from the base (the rest are references): the spans
    # of own blocks break around them, and the step loads bitwise.
    rng = np.random.default_rng(3)
    old = rng.standard_normal(4 * MiB // 4).astype(np.float32)
    base = str(tmp_path / "base")
    _hashed(base, {"w": old})
    new = old.copy()
    per = MiB // 4
    for b in changed:
        new[b * per : (b + 1) * per] = rng.standard_normal(per).astype(np.float32)
    new[1 * per + 5] += 1.0  # block 1 changed by one element: a delta, where it is the first changed block
    cairn.save(str(tmp_path / "next"), {"w": new}, compression=False, base=base)
    kinds = delta_kinds(tmp_path / "next")
    # (the first changed block samples whether deltas pay in the chunk: block 0 changed everywhere says no)
    assert len(kinds) == (0 not in changed)
    assert np.asarray(cairn.load(str(tmp_path / "next"))["w"]).tobytes() == new.tobytes()


def test_a_block_with_few_changes_is_stored_sparse_without_coding_its_xor(tmp_path, monkeypatch):
    import ml_dtypes

    rng = np.random.default_rng(4)
    w0 = (rng.standard_normal(2 * MiB // 2) * 0.02).astype(ml_dtypes.bfloat16)  # 2 blocks of 1 MiB
    w1 = w0.copy()
    u = w1.view(np.uint16)
    pos = rng.choice(w1.size, w1.size // 100, replace=False)  # 1% of the elements, an ulp each
    u[pos] += 1
    _hashed(tmp_path / "s0", {"w": w0})
    coded: list[int] = []
    real = inc._codecs.encode

    def encode(codec, raw, dtype):
        coded.append(memoryview(raw).nbytes)
        return real(codec, raw, dtype)

    monkeypatch.setattr(inc._codecs, "encode", encode)
    cairn.save(tmp_path / "s1", {"w": w1}, compression=False, base=tmp_path / "s0")
    assert set(delta_kinds(tmp_path / "s1")) == {1}  # sparse
    assert MiB not in coded, coded  # no XOR frame of a whole block was coded to compare
    assert np.asarray(cairn.load(tmp_path / "s1")["w"]).tobytes() == w1.tobytes()


def test_a_base_file_is_opened_once_per_save_for_its_deltas_and_closed_after(tmp_path, monkeypatch):
    import os

    import ml_dtypes

    rng = np.random.default_rng(5)
    w0 = (rng.standard_normal(6 * MiB // 2) * 0.02).astype(ml_dtypes.bfloat16)  # 6 blocks, one file
    w1 = w0.copy()
    u = w1.view(np.uint16)
    u[rng.choice(w1.size, w1.size // 200, replace=False)] += 1  # every block: a few elements, an ulp each
    _hashed(tmp_path / "s0", {"w": w0})
    opened: list[str] = []
    real = _local.LocalStorage.open_read

    def open_read(self, key):
        if key.endswith(".bin"):
            opened.append(key)
            time.sleep(0.05)  # a slow open (a sandboxed disk's round trip): threads wanting it meanwhile wait
        return real(self, key)

    monkeypatch.setattr(_local.LocalStorage, "open_read", open_read)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    cairn.save(tmp_path / "s1", {"w": w1}, compression=False, base=tmp_path / "s0", threads=1)
    assert len(delta_kinds(tmp_path / "s1")) == 6
    assert len(opened) == len(set(opened)) == 1, opened  # one base file, opened once for its six deltas
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds  # and closed once the save is done
    assert np.asarray(cairn.load(tmp_path / "s1")["w"]).tobytes() == w1.tobytes()
