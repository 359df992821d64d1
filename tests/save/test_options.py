"""One options object for a load (`cairn.load`, `plan_load`, the engine) and one for a save (save, save_async,
the manager, a recompressing copy): the same checks everywhere."""

import dataclasses

import numpy as np
import pytest

import cairn
from cairn._load.options import LoadOptions, options_of
from cairn._save.options import SaveOptions, save_options_of


@pytest.mark.parametrize("bad", [dict(threads=0), dict(threads=True), dict(budget_bytes=0), dict(budget_bytes=1.5),
                                 dict(read_once="yes"), dict(timeout=0), dict(timeout=-1.0)])
def test_bad_options_are_refused_by_load_and_by_its_plan_before_any_read(tmp_path, bad):
    cairn.save(tmp_path / "c", {"x": np.arange(4)})
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        cairn.load(tmp_path / "c", **bad)
    if name != "timeout":  # plan_load waits for nobody
        with pytest.raises(ValueError, match=name):
            cairn.plan_load(tmp_path / "c", processes=1, **bad)
    with pytest.raises(ValueError, match=name):  # before the path is even looked at
        cairn.load(tmp_path / "missing", **bad)


def test_changes_apply_to_given_options_and_unknown_names_are_a_type_error():
    base = LoadOptions(threads=2, partial=True)
    assert options_of(base, {"threads": 4}) == LoadOptions(threads=4, partial=True)
    assert options_of(None, {}) == LoadOptions()
    assert options_of(base, {}) is base
    with pytest.raises(TypeError):
        options_of(base, {"thread": 4})
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.threads = 3  # type: ignore[misc]


def test_every_public_load_keyword_is_an_option_or_says_why_not():
    """A new load option is added to LoadOptions (one place), not threaded through by hand."""
    import inspect

    options = {f.name for f in dataclasses.fields(LoadOptions)}
    # Not options of how to read: where the checkpoint is, what comes back, and what is reported.
    outside = {"path", "target", "storage_options", "framework", "report", "stats"}
    load_keywords = set(inspect.signature(cairn.load).parameters)
    assert load_keywords - outside == options
    plan_keywords = set(inspect.signature(cairn.plan_load).parameters)
    # The dry run has no coordinator and waits for nobody; it adds what it simulates.
    assert plan_keywords - outside - {"processes", "bandwidth", "platform"} == options - {"coordinator", "timeout"}


# ---------------------------------------------------------------------- saves: SaveOptions, the twin


@pytest.mark.parametrize("bad", [dict(threads=0), dict(threads=True), dict(threads=2.0), dict(timeout=0),
                                 dict(timeout="60"), dict(overwrite="yes"), dict(split_replicas=1),
                                 dict(compression="gzip"), dict(compression=1)])
def test_bad_save_options_are_refused_by_every_save_before_anything_is_written(tmp_path, bad):
    name = next(iter(bad))
    state = {"x": np.arange(4)}
    with pytest.raises(ValueError, match=rf"^{name} must be .*got {bad[name]!r}|^{name} must be .*not {bad[name]!r}"):
        cairn.save(tmp_path / "c", state, **bad)
    with pytest.raises(ValueError, match=name):
        cairn.save_async(tmp_path / "c", state, **bad)
    if name in ("threads", "compression"):  # the manager's own save options: refused when it is made
        with pytest.raises(ValueError, match=name):
            cairn.CheckpointManager(tmp_path / "run", handle_sigterm=False, **bad)
    assert not (tmp_path / "c").exists()


def test_snapshot_budget_and_a_recompressing_copy_are_checked_first(tmp_path):
    with pytest.raises(ValueError, match=r"snapshot_budget_bytes must be None or a non-negative integer, got -1"):
        cairn.save_async(tmp_path / "c", {"x": np.arange(4)}, snapshot_budget_bytes=-1)
    with pytest.raises(ValueError, match="snapshot_budget_bytes"):
        cairn.CheckpointManager(tmp_path / "run", handle_sigterm=False, snapshot_budget_bytes=1.5)
    cairn.save(tmp_path / "c", {"x": np.arange(4)})
    with pytest.raises(ValueError, match="compression must be 'auto', True, 'fast', False, 'none', 'zstd', 'planes', "
                       "'blosc2' or 'blosc2-lz4', not 'lz4'"):
        cairn.copy(tmp_path / "missing", tmp_path / "d", compression="lz4")  # before the source is looked at
    assert cairn.save_async(tmp_path / "e", {"x": np.arange(4)}, snapshot_budget_bytes=0).result().bytes_written


def test_save_option_changes_and_unknown_names():
    base = SaveOptions(threads=2, overwrite=True)
    assert save_options_of(base, {"threads": 3}) == SaveOptions(threads=3, overwrite=True)
    assert save_options_of(None, {}) == SaveOptions() and save_options_of(base, {}) is base
    with pytest.raises(TypeError):
        save_options_of(base, {"thread": 4})
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.threads = 3  # type: ignore[misc]


def test_every_public_save_keyword_is_an_option_or_says_why_not():
    """A new save option is added to SaveOptions (one place), not threaded through by hand."""
    import inspect

    options = {f.name for f in dataclasses.fields(SaveOptions)}
    # Not options of how to write: where the checkpoint goes, what it holds, and the earlier
    # checkpoint it refers to (`base`, a path resolved beside `path`).
    outside = {"path", "state", "storage_options", "user_metadata", "metadata", "base"}  # metadata: deprecated
    assert set(inspect.signature(cairn.save_async).parameters) - outside == options
    # A blocking save takes no snapshot: nothing to budget.
    assert set(inspect.signature(cairn.save).parameters) - outside == options - {"snapshot_budget_bytes"}


def test_a_save_of_many_checkpointables_says_once_what_they_cost(tmp_path, monkeypatch, caplog):
    """A flat mapping of many arrays (a state dict) is saved as one checkpointable per key, each a folder of
    three files: the save says so, once per process, and how to make it one checkpointable."""
    from cairn._save import plan as save_plan

    monkeypatch.setattr(save_plan, "MANY_CHECKPOINTABLES", 8)
    monkeypatch.setattr(save_plan, "_told_many", False)
    flat = {f"layer{i}.weight": np.full(3, i, np.float32) for i in range(9)}
    with caplog.at_level("WARNING", logger="cairn"):
        cairn.save(tmp_path / "few", dict(list(flat.items())[:8]))
        cairn.save(tmp_path / "nested", {"model": flat})
        assert not [r for r in caplog.records if "checkpointables" in r.getMessage()]
        cairn.save(tmp_path / "flat", flat)
        cairn.save(tmp_path / "flat2", flat)
    told = [r.getMessage() for r in caplog.records if "checkpointables" in r.getMessage()]
    assert len(told) == 1 and "flat: saving 9 checkpointables" in told[0] and "{'model': state}" in told[0], told
    out = cairn.load(tmp_path / "nested")["model"]  # the nested form loads back whole, as one
    assert all(np.array_equal(out[k], v) for k, v in flat.items())
    assert sorted(p.name for p in (tmp_path / "nested").iterdir() if p.is_dir()) == ["model"]


def test_a_save_is_planned_then_executed(tmp_path):
    """`plan_save` decides and writes nothing (each leaf's codec fixed, or measured on its first chunk);
    `execute` of the plan writes the checkpoint a `cairn.save` writes."""
    from cairn._save import engine
    from cairn._save.plan import MEASURE, plan_save
    from cairn._storage.location import resolve

    state = {"params": {"w": np.arange(1 << 16, dtype=np.float32), "n": np.ones(7, np.int8), "step": 5}}
    plan = plan_save(resolve(str(tmp_path / "p")), state, compression="zstd")
    assert not (tmp_path / "p").exists()
    decided = plan.codec_decisions()["params"]
    assert sorted(decided.values()) == ["zstd", "zstd"] and len(decided) == 2  # the two arrays, not the int
    assert plan.describe()["items"]["params"]["bytes"] == (1 << 16) * 4 + 7
    chosen = plan_save(resolve(str(tmp_path / "q")), state, compression=True)
    assert sorted(chosen.codec_decisions()["params"].values()) == [MEASURE, MEASURE]
    raw = plan_save(resolve(str(tmp_path / "r")), state, compression=False)
    assert sorted(raw.codec_decisions()["params"].values()) == ["none", "none"]
    stats = engine.execute(plan)
    assert stats.bytes_written > 0
    got = cairn.load(tmp_path / "p")["params"]
    assert np.array_equal(got["w"], state["params"]["w"]) and np.array_equal(got["n"], state["params"]["n"])
    assert got["step"] == 5
    assert cairn.metadata(tmp_path / "p")  # committed
