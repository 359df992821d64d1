"""An incremental save whose base this process just committed reads nothing of it back but its manifest.

`_save.basecache` keeps what a single-process commit wrote (manifest, indexes, index parts); the next
save against that checkpoint uses those bytes once the manifest found there is byte for byte the same.
A base deleted, or committed again (by this process or another writer), is read from storage.
"""

from __future__ import annotations

import shutil

import ml_dtypes
import numpy as np
import pytest

import cairn
from _trees import assert_same
from cairn._save import basecache
from cairn._storage.local import LocalStorage
from cairn._storage.memory import MemoryStorage


def _state(seed: int, head: float) -> dict:
    rng = np.random.default_rng(seed)
    return {"backbone": rng.standard_normal((1024, 1536)).astype(ml_dtypes.bfloat16),  # 3 blocks
            "head": np.full((64, 64), head, np.float32), "ids": np.arange(100, dtype=np.int64) + seed}


@pytest.fixture(autouse=True)
def _fresh():
    basecache.clear()
    yield
    basecache.clear()


def _reads(monkeypatch, run: str) -> list[str]:
    """Every key read (whole or opened for ranges) from the local and memory storages, from now on."""
    keys: list[str] = []

    def counting(f):
        def counted(self, key):
            keys.append(key)
            return f(self, key)

        return counted

    for cls in (LocalStorage, MemoryStorage):
        for name in ("read", "open_read"):
            monkeypatch.setattr(cls, name, counting(getattr(cls, name)))
    return keys


def _run(tmp_path, where: str) -> str:
    return str(tmp_path / "run") if where == "local" else f"memory://basecache-{tmp_path.name}/run"


@pytest.mark.parametrize("where", ["local", "memory"])
def test_the_base_this_process_committed_is_not_read_back_but_its_manifest(tmp_path, where, monkeypatch):
    run = _run(tmp_path, where)
    cairn.save(f"{run}/p", _state(0, 0.0))
    cairn.save(f"{run}/a", _state(0, 1.0), base=f"{run}/p")  # hashes, self-contained
    cairn.save(f"{run}/b", _state(0, 2.0), base=f"{run}/a")
    reads = _reads(monkeypatch, run)
    hits = basecache.hits
    s3 = _state(0, 3.0)
    st = cairn.save(f"{run}/c", s3, base=f"{run}/b")
    of_b = [k for k in reads if k.split("/")[0] == "b" and not k.endswith(".bin")]  # (not the deltas' bases)
    assert basecache.hits == hits + 1
    assert [k.rsplit("/", 1)[-1] for k in of_b] == ["manifest.json"], of_b  # not its indexes, not its parts
    assert st.bytes_written < s3["backbone"].nbytes  # the backbone referred to, as when read from storage
    monkeypatch.undo()
    assert_same(cairn.load(f"{run}/c"), s3)


def test_what_a_save_refers_to_is_the_same_with_the_base_kept_or_read(tmp_path, monkeypatch):
    states = [_state(0, float(h)) for h in range(4)]
    for s in states[1:]:
        s["backbone"][5, 7] += 1  # a slowly changing leaf: a delta each step
    out = {}
    for mode in ("kept", "read"):
        run = tmp_path / mode
        if mode == "read":
            monkeypatch.setattr(basecache, "remember", lambda *a, **k: None)
        cairn.save(run / "s0", states[0])
        prev, got = run / "s0", []
        for t, s in enumerate(states, 1):
            st = cairn.save(run / f"s{t}", s, base=prev)
            got.append((st.bytes_written, st.files_written,
                        sorted(p.stat().st_size for p in (run / f"s{t}").rglob("*") if p.is_file() and p.suffix != ".json")))
            prev = run / f"s{t}"
        out[mode] = got
        for t, s in enumerate(states, 1):
            assert_same(cairn.load(run / f"s{t}"), s)
    assert out["kept"] == out["read"]


def test_a_base_rewritten_by_another_writer_is_read_from_storage(tmp_path, monkeypatch):
    run = tmp_path / "run"
    cairn.save(run / "p", _state(0, 0.0))
    cairn.save(run / "a", _state(0, 1.0), base=run / "p")  # kept: this process committed it
    # Another writer deletes it and commits other bytes under its name (its commit is not kept here).
    shutil.rmtree(run / "a")
    real = basecache.remember
    monkeypatch.setattr(basecache, "remember", lambda *a, **k: None)
    other = _state(1, 5.0)
    cairn.save(run / "p1", other)
    cairn.save(run / "a", other, base=run / "p1")
    monkeypatch.setattr(basecache, "remember", real)
    hits = basecache.hits
    new = _state(1, 6.0)  # the other writer's backbone: referred to from its rewritten "a"
    st = cairn.save(run / "b", new, base=run / "a")
    assert basecache.hits == hits  # the manifest there is not the one kept: read from storage
    assert st.bytes_written < new["backbone"].nbytes
    assert_same(cairn.load(run / "b"), new)


def test_a_base_overwritten_by_this_process_is_kept_as_committed_last(tmp_path):
    run = tmp_path / "run"
    cairn.save(run / "p", _state(0, 0.0))
    cairn.save(run / "a", _state(0, 1.0), base=run / "p")
    other = _state(2, 1.0)
    cairn.save(run / "a", other, base=run / "p", overwrite=True)  # nothing refers to "a" yet: allowed
    hits = basecache.hits
    new = _state(2, 2.0)
    st = cairn.save(run / "b", new, base=run / "a")
    assert basecache.hits == hits + 1 and st.bytes_written < new["backbone"].nbytes
    assert_same(cairn.load(run / "b"), new)


def test_a_deleted_base_is_missing_whatever_was_kept(tmp_path):
    run = tmp_path / "run"
    cairn.save(run / "p", _state(0, 0.0))
    cairn.save(run / "a", _state(0, 1.0), base=run / "p")
    shutil.rmtree(run / "a")
    with pytest.raises(cairn.CheckpointError, match="not committed"):
        cairn.save(run / "b", _state(0, 2.0), base=run / "a")
    # (A manager falls back to a self-contained step: test_incremental.py's
    # test_manager_falls_back_to_a_full_save_without_its_base, which runs with the base kept too.)


def test_only_single_process_commits_are_kept_and_at_most_keep_of_them(tmp_path):
    from cairn._storage.location import resolve

    for k in range(basecache.KEEP + 2):
        cairn.save(tmp_path / f"p{k}", _state(k, 0.0))
        cairn.save(tmp_path / f"s{k}", _state(k, 1.0), base=tmp_path / f"p{k}")
    kept = [k for k in range(basecache.KEEP + 2)
            if basecache._kept.get(basecache._key(resolve(tmp_path / f"s{k}"))) is not None]
    assert kept == list(range(2, basecache.KEEP + 2))
    # A plain save (no hashes: nothing to build on) is not kept.
    assert basecache._kept.get(basecache._key(resolve(tmp_path / "p3"))) is None
