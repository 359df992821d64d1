"""How an incremental save hands its own blocks to the storage (`_save.incremental.OWN_SPAN`).

Own raw blocks next to each other go to the storage as one buffer of up to `OWN_SPAN` bytes, not one
per block; spans break at references and deltas, and the checkpoint is the same.
"""

from __future__ import annotations

import numpy as np
import pytest

import cairn
from cairn._save import incremental as inc
from cairn._storage import local as _local

MiB = 1 << 20


def test_own_raw_blocks_are_written_in_spans(tmp_path, monkeypatch):
    base = str(tmp_path / "base")
    cairn.save(base, {"w": np.zeros(16 * MiB // 4, np.float32)}, compression=False, threads=1)
    parts: list[int] = []
    real = _local.LocalStorage.write

    def write(self, key, it):
        def counted():
            for p in it:
                if key.endswith(".bin"):
                    parts.append(memoryview(p).nbytes)
                yield p
        return real(self, key, counted())

    monkeypatch.setattr(_local.LocalStorage, "write", write)
    state = {"w": np.random.default_rng(2).standard_normal(16 * MiB // 4).astype(np.float32)}
    stats = cairn.save(str(tmp_path / "next"), state, compression=False, base=base, threads=1)
    assert sum(parts) == 16 * MiB and stats.bytes_written >= 16 * MiB
    assert len(parts) == 16 * MiB // inc.OWN_SPAN, parts  # one per span, not one per 1 MiB block
    assert np.asarray(cairn.load(str(tmp_path / "next"))["w"]).tobytes() == state["w"].tobytes()


@pytest.mark.parametrize("changed", [(0,), (1, 2), (0, 3), (0, 1, 2, 3)])
def test_spans_break_at_references_and_deltas(tmp_path, changed):
    # A 4-block leaf whose blocks `changed` differ from the base (the rest are references): the spans
    # of own blocks break around them, and the step loads bitwise.
    rng = np.random.default_rng(3)
    old = rng.standard_normal(4 * MiB // 4).astype(np.float32)
    base = str(tmp_path / "base")
    cairn.save(base, {"w": old}, compression=False)
    new = old.copy()
    per = MiB // 4
    for b in changed:
        new[b * per : (b + 1) * per] = rng.standard_normal(per).astype(np.float32)
    new[1 * per + 5] += 1.0 if 1 not in changed else 0.0  # block 1 changed by one element: a delta
    cairn.save(str(tmp_path / "next"), {"w": new}, compression=False, base=base)
    assert np.asarray(cairn.load(str(tmp_path / "next"))["w"]).tobytes() == new.tobytes()
