"""Overwriting a checkpoint that incremental saves beside it refer to is refused, before anything is written.

References resolve by name beside the referrer (docs/FORMAT.md §6.5), so replacing the base would leave
its referrers naming data that is gone: their loads would fail. `overwrite=True` on anything else, and
on a base once nothing refers to it, goes on as before.
"""

from __future__ import annotations

import numpy as np
import pytest

import cairn
from _trees import assert_same
from cairn._save.commit import referrers
from cairn._storage.location import resolve


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(1 << 18).astype(np.float32), "b": np.arange(4096, dtype=np.int64) + seed}


def run_dir(tmp_path, where: str) -> str:
    return str(tmp_path / "run") if where == "local" else f"memory://replace-base-{tmp_path.name}/run"


@pytest.mark.parametrize("where", ["local", "memory"])
def test_overwriting_a_base_is_refused_naming_its_referrers(tmp_path, where):
    run = run_dir(tmp_path, where)
    s0, s1 = state(0), state(1)
    s1["b"] = s0["b"]  # (b's blocks stay the base's: the second step refers to them)
    cairn.save(f"{run}/a", s0)
    cairn.save(f"{run}/b", s0, base=f"{run}/a")  # (a has no hashes: b writes everything, refers to nothing)
    cairn.save(f"{run}/c", s1, base=f"{run}/b")
    assert referrers(resolve(f"{run}/b")) == ["c"] and referrers(resolve(f"{run}/a")) == []
    with pytest.raises(cairn.CheckpointError, match=r"run/b is the base of c \(incremental saves.*overwriting"):
        cairn.save(f"{run}/b", state(2), overwrite=True)
    with pytest.raises(cairn.CheckpointError, match=r"run/b is the base of c"):
        cairn.save_async(f"{run}/b", state(2), overwrite=True).result()
    with pytest.raises(cairn.CheckpointError, match=r"run/b is the base of c"):  # a copy over it, too
        cairn.copy(f"{run}/a", f"{run}/b", overwrite=True)
    # Nothing was lost: all three still load, bit for bit.
    assert_same(cairn.load(f"{run}/b"), s0)
    assert_same(cairn.load(f"{run}/c"), s1)
    cairn.save(f"{run}/a", state(3), overwrite=True)  # nothing refers to a
    assert_same(cairn.load(f"{run}/a"), state(3))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_overwriting_what_nothing_refers_to_goes_on(tmp_path, where):
    run = run_dir(tmp_path, where)
    s0, s1, s2 = state(0), state(1), state(2)
    cairn.save(f"{run}/a", s0)
    cairn.save(f"{run}/b", s0, base=f"{run}/a")
    cairn.save(f"{run}/c", s1, base=f"{run}/b")
    cairn.save(f"{run}/d", {"x": np.arange(3)})
    cairn.save(f"{run}/d", s2, overwrite=True)  # beside a chain, referred to by nothing
    cairn.save(f"{run}/c", s2, overwrite=True)  # the referrer itself may be replaced
    assert_same(cairn.load(f"{run}/c"), s2)
    assert_same(cairn.load(f"{run}/d"), s2)
    # c no longer refers to b: b may now be replaced too.
    assert referrers(resolve(f"{run}/b")) == []
    cairn.save(f"{run}/b", s1, overwrite=True)
    assert_same(cairn.load(f"{run}/b"), s1)
    assert_same(cairn.load(f"{run}/c"), s2)
