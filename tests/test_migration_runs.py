"""Issue 40, the run side: moving an Orbax training job to cairn and back, with Orbax itself.

Each test replays what a user did with a real orbax-checkpoint CheckpointManager
(step_prefix names, fixed-length numbers, Composite items with JSON) and checks
that every case that used to be silent is now right or a clear error.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

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
    # Orbax itself, with its own options, still sees its steps (cairn's step 30 is not its format).
    with ocp.CheckpointManager(os.path.abspath(run), options=ocp.CheckpointManagerOptions(**options)) as omgr:
        assert omgr.all_steps() == [10, 20]


def test_a_run_of_unknown_step_folders_raises_unless_start_fresh(tmp_path, mesh42):
    run = tmp_path / "run"
    cairn.save(run / "checkpoint_5", state_of(mesh42, 5))  # a cairn checkpoint, named otherwise
    os.makedirs(run / "step-3")
    (run / "step-3" / ".metadata").write_bytes(b"dcp")  # what PyTorch DCP leaves
    (run / "notes.txt").write_text("not a step")
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
    with caplog.at_level(logging.WARNING, logger="cairn"), mgr_of(run) as mgr:
        assert mgr.steps() == [10]
    assert "old_3 (cairn" in caplog.text


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
                                                    "step_00000020 \\(cairn"):
        mgr_of(run, step_format="{step}")  # cairn's own step under another spelling
    with mgr_of(run, step_format="{step}", start_fresh=True) as mgr:  # even then, no second folder
        with pytest.raises(cairn.CheckpointExistsError, match=r"step_00000020: step 20 is already saved there"):
            mgr.save(20, state_of(mesh42, 20))
    assert sorted(os.listdir(run)) == ["ckpt_10", "step_00000020"]
    assert cli(["ls", str(run), "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert [(e["step"], e["format"]) for e in entries] == [(10, "orbax"), (20, "cairn")]


def test_a_step_saved_twice_by_hand_is_no_step_until_one_goes(tmp_path, mesh42):
    run = tmp_path / "run"
    orbax_job(run, mesh42, (10,))
    cairn.save(run / "step_00000010", {"state": state_of(mesh42, 99)})  # made beside Orbax's, by hand
    with pytest.raises(cairn.CheckpointError, match=r"step 10 is saved in 2 folders \(step_00000010, 10\)"):
        mgr_of(run)
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
    assert sorted(os.listdir(run)) == ["ckpt_10", "ckpt_20", "step_00000050"]
    with mgr_of(run, max_to_keep=1, delete_orbax_steps=True) as mgr:
        mgr.save(60, {"state": state_of(mesh42, 60)})
        assert mgr.steps() == [60]
    assert sorted(os.listdir(run)) == ["step_00000060"]


# ---------------------------------------------------------------------- 9. restore(abstract) positionally


def test_restore_with_the_tree_as_first_argument_says_what_to_do(tmp_path, mesh42):
    run = tmp_path / "run"
    with mgr_of(run) as mgr:
        mgr.save(1, state_of(mesh42, 1))
        with pytest.raises(TypeError, match=r"the first argument is the step.*pass the tree as target="):
            mgr.restore(target_of(mesh42))
        got = mgr.restore(1, target_of(mesh42))
        assert got["params"]["w"].sharding == NamedSharding(mesh42, P("x", "y"))
