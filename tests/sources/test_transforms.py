"""Restore transforms: rename, drop and fill_missing, with the report of what they did."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from cairn._load.options import LoadOptions
from cairn._load.reader import LoadStats
from cairn._sources import registry as _sources
from cairn._storage.location import resolve


def old_model(mesh):
    """Version 1 of a model: an encoder called "enc", a head, and a large leaf the new one lacks."""
    s = NamedSharding(mesh, P("x"))
    return {
        "params": {
            "enc": {"w": jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(16, 4), s),
                    "b": jnp.linspace(-1, 1, 16, dtype=jnp.float32)},
            "head": {"w": jax.device_put(jnp.arange(32, dtype=jnp.int32).reshape(8, 4), s)},
            "old_stats": np.arange(1 << 18, dtype=np.float32),  # 1 MiB
        },
        "step": 7,
    }


def new_target(mesh):
    """Version 2: "enc" renamed "encoder", a new bias initialised by the new code, no old_stats."""
    s = NamedSharding(mesh, P("x"))
    return {
        "params": {
            "encoder": {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=s),
                        "b": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=NamedSharding(mesh, P()))},
            "head": {"w": jax.ShapeDtypeStruct((8, 4), jnp.int32, sharding=s)},
            "new_bias": jax.device_put(jnp.full((8,), 0.5, jnp.float32), s),
        },
        "step": None,
    }


RENAME = [(r"^params/enc/", "params/encoder/")]


def test_old_checkpoint_into_a_renamed_module_with_fill_and_report(tmp_path, mesh8, caplog):
    saved = old_model(mesh8)
    cairn.save(tmp_path / "v1", saved)
    target = new_target(mesh8)
    report = cairn.RestoreReport()
    with caplog.at_level(logging.INFO, logger="cairn"):
        got = cairn.load(tmp_path / "v1", target, rename=RENAME, drop=r"/old_stats$", fill_missing=True, report=report)
    p = got["params"]
    for new, old in (("w", "w"), ("b", "b")):
        assert np.asarray(p["encoder"][new]).tobytes() == np.asarray(saved["params"]["enc"][old]).tobytes()
    assert np.asarray(p["head"]["w"]).tobytes() == np.asarray(saved["params"]["head"]["w"]).tobytes()
    assert p["encoder"]["w"].sharding == target["params"]["encoder"]["w"].sharding
    assert p["new_bias"] is target["params"]["new_bias"]  # the target's own array, untouched
    assert got["step"] == 7
    assert report.renamed == [("params/enc/w", "params/encoder/w"), ("params/enc/b", "params/encoder/b")]
    assert report.dropped == ["params/old_stats"]
    assert report.filled == ["params/new_bias"]
    logged = [r.getMessage() for r in caplog.records if r.name == "cairn"]
    assert any("renamed 2" in m and "dropped 1" in m and "filled 1 from the target (params/new_bias)" in m
               for m in logged), logged


def test_strict_by_default(tmp_path, mesh8):
    cairn.save(tmp_path / "v1", old_model(mesh8))
    target = new_target(mesh8)
    # The renamed module alone: the new bias is missing, and old_stats is left over.
    with pytest.raises(cairn.MismatchError, match=r"'params/new_bias' of the target is not in the checkpoint.*fill_missing"):
        cairn.load(tmp_path / "v1", target, rename=RENAME, drop="old_stats")
    with pytest.raises(cairn.MismatchError, match=r"target omits: 'params/old_stats'"):
        cairn.load(tmp_path / "v1", target, rename=RENAME, fill_missing=True)
    # Without the rename, fill_missing must not quietly fill the whole encoder with its templates.
    with pytest.raises(cairn.MismatchError, match=r"'params/encoder/w'.*cannot be filled: its target is a ShapeDtypeStruct"):
        cairn.load(tmp_path / "v1", target, drop="old_stats", fill_missing=True)
    # Regexes choose which leaves may be filled: another missing leaf still fails.
    target["params"]["other"] = np.zeros(3, np.float32)
    with pytest.raises(cairn.MismatchError, match=r"'params/other' of the target is not in the checkpoint"):
        cairn.load(tmp_path / "v1", target, rename=RENAME, drop="old_stats", fill_missing=[r"/new_bias$"])
    report = cairn.RestoreReport()
    got = cairn.load(tmp_path / "v1", target, rename=RENAME, drop="old_stats",
                     fill_missing=[r"/new_bias$", r"^params/other$"], report=report)
    assert got["params"]["other"] is target["params"]["other"]
    assert report.filled == ["params/new_bias", "params/other"]


def test_fill_with_a_shape_dtype_struct_names_the_path(tmp_path, mesh8):
    cairn.save(tmp_path / "ck", {"params": {"w": np.ones((4, 2), np.float32)}})
    target = {"params": {"w": np.zeros((4, 2), np.float32),
              "extra": {"k": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh8, P("x")))}}}
    with pytest.raises(cairn.MismatchError, match=r"'params/extra/k' of the target is not in the checkpoint and "
                                                  r"cannot be filled: its target is a ShapeDtypeStruct"):
        cairn.load(tmp_path / "ck", target, fill_missing=True)
    with pytest.raises(cairn.MismatchError, match="'s' .* cannot be filled: its target is a NamedSharding"):
        cairn.load(tmp_path / "ck", {"params": {"w": None}, "s": NamedSharding(mesh8, P())}, fill_missing=True)


def test_dropped_leaves_are_not_read(tmp_path, mesh8):
    cairn.save(tmp_path / "v1", old_model(mesh8))
    loc = resolve(tmp_path / "v1")
    target = new_target(mesh8)
    for leaf in ("encoder", "head"):  # numpy templates: each array read whole, exactly its bytes
        target["params"][leaf] = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), target["params"][leaf])
    stats, report = LoadStats(), cairn.RestoreReport()
    got = _sources.load(loc, target, LoadOptions(rename=RENAME, drop=[r"old_stats"], fill_missing=True),
                        report=report, stats=stats)
    read = sum(x.nbytes for x in jax.tree.leaves([got["params"]["encoder"], got["params"]["head"]]))
    assert read == 64 * 4 + 16 * 4 + 32 * 4
    assert stats.bytes_read == read  # not one byte of the 1 MiB leaf that was dropped
    assert report.dropped == ["params/old_stats"]
    # The same load without drop but partial reads as little, and reports no drop.
    stats, report = LoadStats(), cairn.RestoreReport()
    _sources.load(loc, target, LoadOptions(rename=RENAME, fill_missing=True, partial=True), report=report, stats=stats)
    assert stats.bytes_read == read and report.dropped == [] and report.filled == ["params/new_bias"]


def test_rename_to_none_is_reported_as_dropped_and_no_transform_reports_nothing(tmp_path, mesh8):
    cairn.save(tmp_path / "ck", [np.arange(4), {"b": np.arange(3)}])  # a root tree, not checkpointables
    report = cairn.RestoreReport(filled=["stale"])
    got = cairn.load(tmp_path / "ck", rename=[("^1/b$", None)], report=report)
    assert list(got) == ["0"] and np.array_equal(got["0"], np.arange(4))  # a renamed tree is made of dicts
    assert report.dropped == ["1/b"] and report.renamed == [] and report.filled == []
    assert str(report) == "dropped 1 (1/b)"
    report = cairn.RestoreReport(dropped=["stale"])
    cairn.load(tmp_path / "ck", report=report)
    assert not report and str(report) == "nothing renamed, dropped or filled"
    with pytest.raises(TypeError, match="drop must be a regex"):
        cairn.load(tmp_path / "ck", drop=[3])
    with pytest.raises(TypeError, match="fill_missing must be a bool"):
        cairn.load(tmp_path / "ck", [None, {"b": None}], fill_missing=[None])


def test_a_new_checkpointable_is_filled_whole(tmp_path, mesh8):
    cairn.save(tmp_path / "ck", {"params": {"w": np.ones(4)}, "step": 2})
    ema = {"w": np.full(4, 3.0), "count": np.zeros((), np.int32)}
    report = cairn.RestoreReport()
    got = cairn.load(tmp_path / "ck", {"params": {"w": None}, "ema": ema}, fill_missing=["^ema/"], report=report)
    assert got["ema"]["w"] is ema["w"] and got["ema"]["count"] is ema["count"]
    assert np.array_equal(got["params"]["w"], np.ones(4))
    assert report.filled == ["ema/w", "ema/count"]
    with pytest.raises(cairn.MismatchError, match=r"asks for checkpointables \['ema'\]"):
        cairn.load(tmp_path / "ck", {"params": {"w": None}, "ema": ema}, fill_missing=["^params/"])


def test_checkpoint_manager_restore_takes_the_transforms(tmp_path, mesh8):
    saved = old_model(mesh8)
    with cairn.CheckpointManager(tmp_path / "run", save_every=1, async_save=False) as mgr:
        mgr.save(3, saved)
        target = new_target(mesh8)
        report = cairn.RestoreReport()
        got = mgr.restore(target=target, rename=RENAME, drop="old_stats", fill_missing=True, report=report)
        assert mgr.restored_step == 3
        assert np.asarray(got["params"]["encoder"]["w"]).tobytes() == np.asarray(saved["params"]["enc"]["w"]).tobytes()
        assert got["params"]["new_bias"] is target["params"]["new_bias"]
        assert report.filled == ["params/new_bias"] and report.dropped == ["params/old_stats"]
        with pytest.raises(cairn.MismatchError, match="'params/new_bias' of the target is not in the checkpoint"):
            mgr.restore(target=target, rename=RENAME, drop="old_stats")
        with pytest.raises(TypeError):
            mgr.restore(target=target, fill_misssing=True)  # a typo is not silently ignored


def test_foreign_source_rename_drop_fill(tmp_path, mesh8):
    st = pytest.importorskip("safetensors.numpy")
    tensors = {"enc.w": np.arange(32.0, dtype=np.float32).reshape(8, 4),
               "head.w": np.arange(8, dtype=np.int64), "optimizer.mu": np.ones(1024, np.float32)}
    st.save_file(tensors, str(tmp_path / "m.safetensors"))
    s = NamedSharding(mesh8, P("x"))
    target = {"encoder": {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=s)},
              "head": {"w": np.zeros(8, np.int64)}, "new": np.full(2, 9.0)}
    report = cairn.RestoreReport()
    got = cairn.load(tmp_path / "m.safetensors", target, rename=[(r"^enc/", "encoder/")], drop=r"^optimizer/",
                     fill_missing=["^new$"], report=report)
    assert np.asarray(got["encoder"]["w"]).tobytes() == tensors["enc.w"].tobytes()
    assert got["encoder"]["w"].sharding == s
    assert np.array_equal(got["head"]["w"], tensors["head.w"]) and got["new"] is target["new"]
    assert report.renamed == [("enc/w", "encoder/w")]
    assert report.dropped == ["optimizer/mu"] and report.filled == ["new"]
