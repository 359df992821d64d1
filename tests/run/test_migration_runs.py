"""A safe migration, the run side: moving an Orbax training job to cairn and back, with Orbax itself.

Each test replays what a user did with a real orbax-checkpoint CheckpointManager
(step_prefix names, fixed-length numbers, Composite items with JSON) and checks
that every case that used to be silent is now right or a clear error.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from cairn._cli.main import main as cli

ocp = pytest.importorskip("orbax.checkpoint")


def state_of(mesh, step):
    w = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8) + step, NamedSharding(mesh, P("x", "y")))
    return {"params": {"w": w, "b": jnp.full((4,), float(step))}}


def target_of(mesh):
    return {"params": {"w": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P("x", "y"))),
                       "b": jax.ShapeDtypeStruct((4,), np.float32, sharding=NamedSharding(mesh, P()))}}


def orbax_job(run, mesh, steps, **options):
    """The user's Orbax script: Composite(state=StandardSave, extra=JsonSave), metrics, a naming option."""
    opts = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min", **options)
    with ocp.CheckpointManager(os.path.abspath(run), options=opts) as omgr:
        for step in steps:
            omgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state_of(mesh, step)),
                                                    extra=ocp.args.JsonSave({"epoch": step // 10, "seen": step})),
                      metrics={"loss": 1.0 / (step + 1)})
        omgr.wait_until_finished()


def mgr_of(run, **kw):
    return cairn.CheckpointManager(run, handle_sigterm=False, async_save=False, **kw)


# ---------------------------------------------------------------------- 1. a run that looks empty


@pytest.mark.parametrize("options, names", [
    ({"step_prefix": "ckpt"}, ["ckpt_10", "ckpt_20"]),
    ({"step_prefix": "step", "step_format_fixed_length": 6}, ["step_000010", "step_000020"]),
    ({"step_format_fixed_length": 4}, ["0010", "0020"]),
])
def test_prefixed_orbax_steps_are_steps_of_the_run(tmp_path, mesh42, options, names):
    run = tmp_path / "run"
    orbax_job(run, mesh42, (10, 20), **options)
    assert sorted(os.listdir(run)) == names
    with mgr_of(run) as mgr:  # no step_format needed: Orbax's naming is recognised
        assert mgr.steps() == [10, 20] and mgr.latest_step() == 20
        assert mgr.metrics(10) == {"loss": pytest.approx(1 / 11)}
        got = mgr.restore(target={"state": target_of(mesh42), "extra": None}, partial=True)
        np.testing.assert_array_equal(np.asarray(got["state"]["params"]["w"]),
                                      np.asarray(state_of(mesh42, 20)["params"]["w"]))
        assert got["extra"] == {"epoch": 2, "seen": 20}
        assert mgr.path(20) == f"{run}/{names[1]}"
        mgr.save(30, {"state": state_of(mesh42, 30), "extra": {"epoch": 3, "seen": 30}})
        assert mgr.steps() == [10, 20, 30]
    # Orbax itself, with its own options, lists cairn's step 30 too (named as Orbax names its steps), and
    # fails to restore it rather than resume from its own older step 20.
    with ocp.CheckpointManager(os.path.abspath(run), options=ocp.CheckpointManagerOptions(**options)) as omgr:
        assert omgr.all_steps() == [10, 20, 30] and omgr.latest_step() == 30
        with pytest.raises(FileNotFoundError):
            omgr.restore(30, args=composite_restore(mesh42))


def test_orbax_metrics_are_listed_only_where_orbax_wrote_them(tmp_path, mesh42):
    """Orbax writes a step's metrics only when its options set `best_fn` (docs/howto/from-orbax.md says so):
    without it, the manager lists the step with no metrics."""
    with_best, without = tmp_path / "with", tmp_path / "without"
    orbax_job(with_best, mesh42, (10,))  # best_fn set
    with ocp.CheckpointManager(os.path.abspath(without)) as omgr:  # no best_fn: metrics passed, not written
        omgr.save(10, args=ocp.args.Composite(state=ocp.args.StandardSave(state_of(mesh42, 10))),
                  metrics={"loss": 0.5})
        omgr.wait_until_finished()
    with mgr_of(with_best, read_only=True) as mgr:
        assert mgr.metrics(10) == {"loss": pytest.approx(1 / 11)}
    with mgr_of(without, read_only=True) as mgr:
        assert mgr.steps() == [10] and mgr.metrics(10) == {}
    page = (Path(__file__).resolve().parents[2] / "docs" / "howto" / "from-orbax.md").read_text()
    assert "only when its `CheckpointManagerOptions` set `best_fn`" in " ".join(page.split())


def test_a_run_of_unknown_step_folders_raises_unless_start_fresh(tmp_path, mesh42):
    run = tmp_path / "run"
    cairn.save(run / "checkpoint_5", state_of(mesh42, 5))  # a cairn checkpoint, named otherwise
    os.makedirs(run / "step-3")
    (run / "step-3" / ".metadata").write_bytes(b"dcp")  # what PyTorch DCP leaves
    (run / "notes.txt").write_text("not a step")
    os.makedirs(run / "eval_100")
    (run / "eval_100" / "scores.json").write_text("{}")  # a folder of something else: not a step
    with pytest.raises(cairn.CheckpointError, match=r"no step it counts, but folders that look like steps: checkpoint_5 \(cairn.*step-3 \(dcp.*"
                                                    r"start_fresh=True"):
        mgr_of(run)
    with mgr_of(run, step_format="checkpoint_{step}") as mgr:  # naming the run's steps resolves it...
        assert mgr.steps() == [5]
    with mgr_of(run, start_fresh=True) as mgr:  # ... or starting fresh, said out loud
        assert mgr.latest_step() is None
        mgr.save(1, state_of(mesh42, 1))
        assert mgr.steps() == [1]
    # Now step 1 is the run's newest, and the folders that look like newer steps still stop a resume.
    with pytest.raises(cairn.CheckpointError, match="steps up to 1, but folders that look like newer steps"):
        mgr_of(run)


def test_older_strays_are_named_in_a_warning(tmp_path, mesh42, caplog):
    run = tmp_path / "run"
    cairn.save(run / "old_3", state_of(mesh42, 3))
    with mgr_of(run, start_fresh=True) as mgr:
        mgr.save(10, state_of(mesh42, 10))
    os.makedirs(run / "ckpt_4")
    (run / "ckpt_4" / "weights.pkl").write_bytes(b"?")  # named as a step, holding nothing cairn knows
    with caplog.at_level(logging.WARNING, logger="cairn"), mgr_of(run) as mgr:
        assert mgr.steps() == [10]
    assert "old_3 (cairn" in caplog.text and "ckpt_4 (unknown: no checkpoint cairn recognizes)" in caplog.text


def test_two_orbax_namings_are_not_guessed(tmp_path, mesh42):
    run = tmp_path / "run"
    orbax_job(run, mesh42, (10,), step_prefix="a")
    orbax_job(run, mesh42, (20,), step_prefix="b")
    with pytest.raises(cairn.CheckpointError, match="several step_prefix namings"):
        mgr_of(run)
    with mgr_of(run, step_format="b_{step}") as mgr:  # the spelling picks one naming
        assert mgr.steps() == [20]


# ---------------------------------------------------------------------- 2. one step, one folder


def test_a_step_is_never_saved_in_a_second_naming(tmp_path, mesh42, capsys):
    run = tmp_path / "run"
    orbax_job(run, mesh42, (10,), step_prefix="ckpt")
    with mgr_of(run) as mgr:
        with pytest.raises(cairn.CheckpointExistsError, match=r"ckpt_10: step 10 is already saved there by Orbax"):
            mgr.save(10, state_of(mesh42, 10))
        mgr.save(20, state_of(mesh42, 20))
    with pytest.raises(cairn.CheckpointError, match="steps up to 10, but folders that look like newer steps: "
                                                    "ckpt_20 \\(cairn"):
        mgr_of(run, step_format="{step}")  # cairn's own step under another spelling
    with mgr_of(run, step_format="{step}", start_fresh=True) as mgr, \
            pytest.raises(cairn.CheckpointExistsError, match=r"ckpt_20: step 20 is already saved there"):
        mgr.save(20, state_of(mesh42, 20))  # even then, no second folder
    assert sorted(os.listdir(run)) == ["ckpt_10", "ckpt_20"]
    assert cli(["ls", str(run), "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert [(e["step"], e["format"]) for e in entries] == [(10, "orbax"), (20, "cairn")]


def test_a_step_saved_twice_by_hand_is_no_step_until_one_goes(tmp_path, mesh42):
    run = tmp_path / "run"
    orbax_job(run, mesh42, (10,))
    cairn.save(run / "step_00000010", {"state": state_of(mesh42, 99)})  # made beside Orbax's, by hand
    with pytest.raises(cairn.CheckpointError, match=r"step 10 is saved in 2 folders \(step_00000010, 10\)"):
        mgr_of(run)
    with mgr_of(run, start_fresh=True) as mgr:  # told to go on: still no folder is picked by chance
        assert mgr.steps() == []
        with pytest.raises(cairn.CheckpointError, match=r"step 10 has 2 folders \(10, step_00000010\)"):
            mgr.path(10)
    shutil.rmtree(run / "step_00000010")
    with mgr_of(run) as mgr:
        assert mgr.steps() == [10] and mgr.path(10) == f"{run}/10"


# ---------------------------------------------------------------------- 4. retention keeps the way back


def test_retention_never_deletes_orbax_steps_unless_asked(tmp_path, mesh42):
    run = tmp_path / "run"
    orbax_job(run, mesh42, (10, 20), step_prefix="ckpt")
    with mgr_of(run, max_to_keep=1, keep_best=1, best_metric="loss") as mgr:
        for step in (30, 40, 50):
            mgr.save(step, {"state": state_of(mesh42, step)}, metrics={"loss": 1.0})
        assert mgr.steps() == [10, 20, 50]  # Orbax's best (10) would win KeepBest: it is not counted
    assert sorted(os.listdir(run)) == ["ckpt_10", "ckpt_20", "ckpt_50"]
    with mgr_of(run, max_to_keep=1, delete_orbax_steps=True) as mgr:
        mgr.save(60, {"state": state_of(mesh42, 60)})
        assert mgr.steps() == [60]
    assert sorted(os.listdir(run)) == ["ckpt_60"]
    # No Orbax step is left: the run keeps the naming its manager gave its steps (their manifests say so).
    with mgr_of(run, max_to_keep=1) as mgr:
        assert mgr.steps() == [60]
        mgr.save(70, {"state": state_of(mesh42, 70)})
    assert sorted(os.listdir(run)) == ["ckpt_70"]


# ---------------------------------------------------------------------- 9. restore(abstract) positionally


def test_restore_with_the_tree_as_first_argument_restores_onto_it(tmp_path, mesh42):
    run = tmp_path / "run"
    with mgr_of(run) as mgr:
        mgr.save(1, state_of(mesh42, 1))
        mgr.save(2, state_of(mesh42, 2))
        got = mgr.restore(target_of(mesh42))  # the newest step, onto the tree's shardings
        assert mgr.restored_step == 2
        assert got["params"]["w"].sharding == NamedSharding(mesh42, P("x", "y"))
        with pytest.raises(TypeError, match=r"the first argument is the step.*pass the tree as target="):
            mgr.restore(target_of(mesh42), target_of(mesh42))
        got = mgr.restore(1, target_of(mesh42))
        assert got["params"]["w"].sharding == NamedSharding(mesh42, P("x", "y"))


# ---------------------------------------------------------------------- 2 and 6. the way back to Orbax


def composite_restore(mesh):
    return ocp.args.Composite(state=ocp.args.StandardRestore(target_of(mesh)), extra=ocp.args.JsonRestore())


def test_orbax_to_cairn_and_back_in_place_keeps_every_step_in_order(tmp_path, mesh42, capsys):
    run = tmp_path / "run"
    orbax_job(run, mesh42, (10, 20), step_prefix="ckpt")
    # cairn continues the run: its own steps beside Orbax's, with metrics and metadata.
    with cairn.CheckpointManager(run, handle_sigterm=False, max_to_keep=2) as mgr:
        got = mgr.restore(target={"state": target_of(mesh42), "extra": None})
        assert mgr.restored_step == 20 and got["extra"] == {"epoch": 2, "seen": 20}
        for step in (30, 40, 50):
            mgr.save(step, {"state": state_of(mesh42, step), "extra": {"epoch": step // 10, "seen": step}},
                     metrics={"loss": 1.0 / (step + 1)}, user_metadata={"git": "abc"})
        mgr.wait()
        assert mgr.steps() == [10, 20, 40, 50]
    # Back: the run's cairn steps become Orbax steps under the run's own naming, in place.
    written = cairn.export_orbax_run(run)
    assert written == [f"{run}/ckpt_40", f"{run}/ckpt_50"]
    assert sorted(os.listdir(run)) == ["ckpt_10", "ckpt_20", "ckpt_40", "ckpt_50"]
    # The user's original Orbax script resumes from cairn's newest step, items and metrics intact.
    opts = ocp.CheckpointManagerOptions(step_prefix="ckpt", best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(os.path.abspath(run), options=opts) as omgr:
        assert omgr.all_steps() == [10, 20, 40, 50] and omgr.latest_step() == 50
        back = omgr.restore(50, args=composite_restore(mesh42))
        np.testing.assert_array_equal(np.asarray(back["state"]["params"]["w"]),
                                      np.asarray(state_of(mesh42, 50)["params"]["w"]))
        assert back["state"]["params"]["w"].sharding.spec == P("x", "y")
        assert back["extra"] == {"epoch": 5, "seen": 50}  # a JSON item again, as JsonRestore wants
        assert omgr.metrics(50) == {"loss": pytest.approx(1 / 51)}
        assert omgr.best_step() == 50
        meta = omgr.item_metadata(50)["state"]["params"]["w"]
        assert tuple(meta.sharding.partition_spec) == ("x", "y") and tuple(meta.sharding.axis_names) == ("x", "y")
        assert omgr.metadata(50).custom_metadata == {"git": "abc"}
        omgr.save(60, args=ocp.args.Composite(state=ocp.args.StandardSave(state_of(mesh42, 60)),
                                              extra=ocp.args.JsonSave({"epoch": 6, "seen": 60})),
                  metrics={"loss": 0.001})
        omgr.wait_until_finished()
    assert cli(["ls", str(run), "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert [(e["step"], e["format"]) for e in entries] == [(s, "orbax") for s in (10, 20, 40, 50, 60)]


def test_an_unchanged_orbax_script_never_resumes_an_older_step_in_silence(tmp_path, mesh42, caplog):
    """Orbax steps 6, 9, 10, 11; cairn continues with 12 and 13. The user's Orbax script, unchanged, lists
    cairn's steps (named as Orbax names its own) and fails on the newest instead of resuming from 11;
    after `export_orbax_run` in place it resumes from 13."""
    run = tmp_path / "run"
    orbax_job(run, mesh42, (6, 9, 10, 11))
    with mgr_of(run) as mgr:
        assert mgr.latest_step() == 11
        for step in (12, 13):
            mgr.save(step, {"state": state_of(mesh42, step), "extra": {"epoch": 1, "seen": step}})
    assert sorted(os.listdir(run), key=int) == ["6", "9", "10", "11", "12", "13"]
    assert os.path.exists(run / "13" / "manifest.json")
    opts = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(os.path.abspath(run), options=opts) as omgr:
        assert omgr.all_steps() == [6, 9, 10, 11, 12, 13] and omgr.latest_step() == 13
        with pytest.raises(FileNotFoundError, match="13"):
            omgr.restore(omgr.latest_step(), args=composite_restore(mesh42))
    assert cairn.export_orbax_run(run) == [f"{run}/12", f"{run}/13"]
    with ocp.CheckpointManager(os.path.abspath(run), options=opts) as omgr:
        assert omgr.latest_step() == 13
        assert omgr.restore(13, args=composite_restore(mesh42))["extra"] == {"epoch": 1, "seen": 13}

    # A run whose cairn steps are named otherwise (an explicit step_format): Orbax does not list them, and
    # the manager says so, naming them and the step Orbax would resume from.
    other = tmp_path / "other"
    orbax_job(other, mesh42, (1,))
    with mgr_of(other, step_format="step_{step:08d}") as mgr:
        mgr.save(2, {"state": state_of(mesh42, 2)})
    with caplog.at_level(logging.WARNING, logger="cairn"), mgr_of(other) as mgr:
        assert mgr.steps() == [1, 2]  # still a step of the run
        mgr.save(3, {"state": state_of(mesh42, 3)})  # named as Orbax's: "3"
        assert mgr.steps() == [1, 2, 3]
    assert "step_00000002" in caplog.text and "would resume from step 1" in caplog.text
    assert sorted(os.listdir(other)) == ["1", "3", "step_00000002"]


def test_export_in_place_under_the_same_name_swaps_atomically(tmp_path, mesh42):
    run = tmp_path / "run"
    orbax_job(run, mesh42, (10,))
    with mgr_of(run, step_format="{step}") as mgr:
        mgr.save(20, {"state": state_of(mesh42, 20), "extra": {"epoch": 2, "seen": 20}})
    assert os.path.exists(run / "20" / "manifest.json")
    assert cairn.export_orbax_run(run, step_format="{step}") == [f"{run}/20"]
    assert sorted(os.listdir(run)) == ["10", "20"] and not os.path.exists(run / "20" / "manifest.json")
    with ocp.CheckpointManager(os.path.abspath(run)) as omgr:
        assert omgr.all_steps() == [10, 20]
        assert omgr.restore(20, args=composite_restore(mesh42))["extra"] == {"epoch": 2, "seen": 20}
    os.makedirs(tmp_path / "empty")
    with pytest.raises(cairn.CheckpointNotFoundError, match="holds no committed step"):
        cairn.export_orbax_run(tmp_path / "empty")


def test_export_a_whole_run_into_a_new_directory(tmp_path, mesh42):
    run, out = tmp_path / "run", tmp_path / "orbax_run"
    orbax_job(run, mesh42, (10,), step_prefix="step", step_format_fixed_length=6)
    with mgr_of(run) as mgr:
        for step in (20, 30):
            mgr.save(step, {"state": state_of(mesh42, step), "extra": {"epoch": step // 10, "seen": step}})
    before = sorted(os.listdir(run))
    cairn.export_orbax_run(run, out)
    assert sorted(os.listdir(run)) == before == ["step_000010", "step_000020", "step_000030"]
    assert sorted(os.listdir(out)) == ["step_000010", "step_000020", "step_000030"]
    opts = ocp.CheckpointManagerOptions(step_prefix="step", step_format_fixed_length=6)
    with ocp.CheckpointManager(os.path.abspath(out), options=opts) as omgr:
        assert omgr.all_steps() == [10, 20, 30]
        for step in (10, 30):
            assert omgr.restore(step, args=composite_restore(mesh42))["extra"]["seen"] == step
    with pytest.raises(cairn.CheckpointExistsError, match="is not empty"):
        cairn.export_orbax_run(run, out)


def test_export_orbax_keeps_item_kinds_and_says_what_cannot_be_json(tmp_path):
    cairn.save(tmp_path / "ck", {"params": {"w": np.ones(3, np.float32)}, "config": {"lr": 0.1, "name": "a"},
                                 "loader": {"epoch": 3, "files": ["x", "y"]}}, user_metadata={"note": "n"})
    out = cairn.export_orbax(tmp_path / "ck", tmp_path / "o")
    handlers = json.loads((tmp_path / "o" / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    assert "JsonCheckpointHandler" in handlers["config"] and "JsonCheckpointHandler" in handlers["loader"]
    assert "PyTreeCheckpointHandler" in handlers["params"]
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ck:
        got = ck.restore(out, args=ocp.args.Composite(config=ocp.args.JsonRestore(),
                                                      loader=ocp.args.JsonRestore()))
        assert got["config"] == {"lr": 0.1, "name": "a"} and got["loader"] == {"epoch": 3, "files": ["x", "y"]}
        assert ck.metadata(out).custom_metadata == {"note": "n"}
    # Named otherwise: json_items=() keeps every item a PyTree; a leaf JSON cannot hold is refused.
    cairn.export_orbax(tmp_path / "ck", tmp_path / "o2", json_items=())
    handlers = json.loads((tmp_path / "o2" / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    assert "PyTreeCheckpointHandler" in handlers["config"]
    with pytest.raises(cairn.UnsupportedTypeError, match="'params' cannot be a JSON item: leaf 'params/w'"):
        cairn.export_orbax(tmp_path / "ck", tmp_path / "o3", json_items=["params"])
    with pytest.raises(ValueError, match=r"json_items names \['nope'\]"):
        cairn.export_orbax(tmp_path / "ck", tmp_path / "o3", json_items=["nope"])


def test_the_manager_key_export_reads_is_the_managers():
    from cairn._exports.orbax import MANAGER_KEY
    from cairn._run.steps import META_KEY

    assert MANAGER_KEY == META_KEY


# ---------------------------------------------------------------------- 6. per process


@pytest.mark.timeout(240)
def test_export_per_process_writes_each_processs_shards_through_orbax(tmp_path):
    from _mp import run

    path, out = str(tmp_path / "ck"), str(tmp_path / "orbax")
    results = run(2, "migration_scenarios:save_and_export", {"path": path, "out": out}, timeout=200)
    assert sorted(r["process"] for r in results) == [0, 1]
    # Orbax's per-process OCDBT folders: each process wrote its own shards.
    assert {d for d in os.listdir(os.path.join(out, "state")) if d.startswith("ocdbt.process_")} == {
        "ocdbt.process_0", "ocdbt.process_1"}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ck:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=one)}
        got = ck.restore(out, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                      extra=ocp.args.JsonRestore()))
    np.testing.assert_array_equal(np.asarray(got["state"]["w"]), np.arange(32, dtype=np.float32).reshape(8, 4))
    assert got["extra"] == {"seen": 3}
    with open(os.path.join(out, "state", "_sharding")) as f:
        sharding = json.load(f)
    assert [json.loads(v)["partition_spec"] for v in sharding.values()] == [["x", "y"]]


# ---------------------------------------------------------------------- what an Orbax user looks for


def test_time_based_save_policy_and_should_save_fn(tmp_path, monkeypatch):
    import cairn._manager.manager as manager_module

    now = [1000.0]
    monkeypatch.setattr(manager_module.time, "monotonic", lambda: now[0])
    w = {"w": np.ones(2, np.float32)}
    with mgr_of(tmp_path / "a", save_interval_s=60) as mgr:
        assert mgr.save(1, w) and not mgr.should_save(2) and not mgr.save(2, w)
        now[0] += 59.9
        assert not mgr.save(3, w)
        assert mgr.save(4, w, force=True)  # force still saves, and restarts the clock
        now[0] += 60
        assert mgr.should_save(5) and mgr.save(5, w)
        assert mgr.steps() == [1, 4, 5]
    seen = []

    def hook(step, last):
        seen.append((step, last))
        return step % 3 == 0

    with mgr_of(tmp_path / "b", should_save_fn=hook, save_every=1) as mgr:
        for step in range(1, 8):
            mgr.save(step, w)
        assert mgr.steps() == [3, 6]
    assert seen == [(1, None), (2, None), (3, None), (4, 3), (5, 3), (6, 3), (7, 6)]
    with mgr_of(tmp_path / "b", should_save_fn=hook) as mgr:  # reopened: the last saved step is the newest
        assert not mgr.save(8, w) and seen[-1] == (8, 6)
    with pytest.raises(ValueError, match="save_interval_s must be a finite number"):
        mgr_of(tmp_path / "c", save_interval_s=-1)


def test_is_saving_in_progress_until_commit_and_retention(tmp_path, monkeypatch):
    import threading

    import cairn._manager.manager as manager_module

    gate, entered = threading.Event(), threading.Event()
    real = manager_module._steps.survey

    def held(*a, **k):  # retention after the commit waits here, on the background thread only
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            assert gate.wait(60)
        return real(*a, **k)

    with cairn.CheckpointManager(tmp_path / "run", handle_sigterm=False, max_to_keep=1) as mgr:
        assert not mgr.is_saving_in_progress()
        monkeypatch.setattr(manager_module._steps, "survey", held)
        mgr.save(1, {"w": np.ones(2, np.float32)})
        assert entered.wait(60)
        assert mgr.is_saving_in_progress()
        gate.set()
        mgr.wait(timeout=60)
        assert not mgr.is_saving_in_progress() and mgr.steps() == [1]


def test_reload_looks_again(tmp_path, mesh42):
    run = tmp_path / "run"
    with mgr_of(run) as mgr:
        mgr.save(1, {"w": np.ones(2, np.float32)})
        orbax_job(run, mesh42, (5,), step_prefix="step", step_format_fixed_length=8)  # Orbax writes beside it
        # step_00000005 holds _CHECKPOINT_METADATA: Orbax's step 5 under the manager's own spelling.
        mgr.reload()
        assert mgr.steps() == [1, 5] and mgr.metrics(5) == {"loss": pytest.approx(1 / 6)}
        os.makedirs(run / "step-9")
        (run / "step-9" / ".metadata").write_bytes(b"dcp")
        with pytest.raises(cairn.CheckpointError, match=r"steps up to 5, but folders that look like newer steps: "
                                                        r"step-9 \(dcp"):
            mgr.reload()


def test_cast_on_save_is_explicit_and_checked(tmp_path):
    state = {"params": {"w": jnp.ones((4,), jnp.float32), "n": jnp.arange(3)}, "opt": {"mu": np.zeros(4, np.float32)}}
    with mgr_of(tmp_path / "run") as mgr:
        mgr.save(1, state, cast={"params": jnp.bfloat16})
        meta = cairn.metadata(mgr.path(1))
        assert meta["params"]["w"].dtype == jnp.bfloat16 and meta["params"]["n"].dtype == state["params"]["n"].dtype
        assert meta["opt"]["mu"].dtype == np.float32
        mgr.save(2, state, cast=jnp.float16)  # every floating-point array
        assert cairn.metadata(mgr.path(2))["opt"]["mu"].dtype == np.float16
        with pytest.raises(ValueError, match="only floating-point casts"):
            mgr.save(3, state, cast=jnp.int8)
        with pytest.raises(ValueError, match=r"cast names \['nope'\], which match no array"):
            mgr.save(3, state, cast={"nope": jnp.bfloat16})
        assert mgr.steps() == [1, 2]


def test_trash_dir_moves_deleted_steps_instead_of_deleting(tmp_path, mesh42):
    run = tmp_path / "run"
    orbax_job(run, mesh42, (1,))
    with mgr_of(run, max_to_keep=1, trash_dir=".trash", delete_orbax_steps=True) as mgr:
        for step in (2, 3):
            mgr.save(step, {"w": np.full(2, step, np.float32)})
        assert mgr.steps() == [3]
        mgr.save(4, {"w": np.full(2, 4, np.float32)})
    assert sorted(os.listdir(run / ".trash")) == ["1", "2", "3"]  # cairn's steps named as Orbax's were
    np.testing.assert_array_equal(cairn.load(run / ".trash" / "2")["w"], np.full(2, 2, np.float32))
    with pytest.raises(ValueError, match="looks like a step folder"):
        mgr_of(run, trash_dir="step_7")
    with pytest.raises(ValueError, match="trash_dir needs a local directory"):
        cairn.CheckpointManager("memory://trash-test", handle_sigterm=False, trash_dir=".trash")
