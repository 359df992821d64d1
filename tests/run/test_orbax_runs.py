"""An Orbax run directory as a cairn run, written by orbax-checkpoint itself.

The manager and ``cairn ls`` see Orbax's step folders, restore them onto
another mesh (an adam TrainState whose ``EmptyState`` Orbax stores as None),
and continue the run in cairn's format, under cairn's or Orbax's folder names.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from cairn._cli.main import main as cli

ocp = pytest.importorskip("orbax.checkpoint")
optax = pytest.importorskip("optax")
train_state = pytest.importorskip("flax.training.train_state")


def make_state(mesh, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "dense": {"kernel": jax.device_put(rng.standard_normal((64, 32)).astype(np.float32),
                                           NamedSharding(mesh, P("x", "y"))),
                  "bias": jnp.asarray(rng.standard_normal(32).astype(np.float32))},
    }
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    grads = jax.tree.map(jnp.ones_like, params)
    return state.apply_gradients(grads=grads)  # nonzero moments and count


def abstract(state, mesh):
    """The target a user builds: jax.eval_shape of the state, placed on `mesh`."""
    shapes = jax.eval_shape(lambda: state)

    def place(x):
        spec = P("y", "x") if x.ndim == 2 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree.map(place, shapes)


def same(got, want):
    assert type(got) is type(want)
    gl, _ = jax.tree_util.tree_flatten_with_path(got)
    wl, _ = jax.tree_util.tree_flatten_with_path(want)
    assert [p for p, _ in gl] == [p for p, _ in wl]
    assert jax.tree.structure(got.opt_state) == jax.tree.structure(want.opt_state)
    for (_, g), (_, w) in zip(gl, wl):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes()


def orbax_run(path, mesh, steps=(100, 200), item=None):
    """Steps written by Orbax's CheckpointManager (a default item, or one named `item`)."""
    states = {}
    names = (item,) if item else None
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(os.path.abspath(path), item_names=names, options=options) as mgr:
        for i, step in enumerate(steps):
            st = make_state(mesh, seed=i)
            states[step] = st
            args = ocp.args.StandardSave(st)
            mgr.save(step, args=ocp.args.Composite(**{item: args}) if item else args,
                     metrics={"loss": 1.0 / (i + 1)})
        mgr.wait_until_finished()
    return states


def test_readme_orbax_example_on_an_adam_train_state(tmp_path, mesh42):
    states = orbax_run(tmp_path / "run", mesh42, steps=(1000,), item="state")
    want = states[1000]
    target_state = abstract(want, jax.make_mesh((2, 4), ("x", "y")))
    state = cairn.load(tmp_path / "run" / "1000", {"state": target_state})["state"]
    assert isinstance(state.opt_state[1], optax.EmptyState)
    assert state.params["dense"]["kernel"].sharding.spec == P("y", "x")
    same(state, want)
    # Without a target the None is a None; a target with a leaf there still fails loudly.
    assert cairn.load(tmp_path / "run" / "1000")["state"]["opt_state"][1] is None
    with pytest.raises(cairn.MismatchError, match="opt_state/0/mu/dense/bias"):
        bad = target_state.replace(opt_state=(target_state.opt_state[0]._replace(mu={"dense": {}}),
                                              target_state.opt_state[1]))
        cairn.load(tmp_path / "run" / "1000", {"state": bad})


def test_manager_lists_restores_and_continues_an_orbax_run(tmp_path, mesh42, capsys):
    run = tmp_path / "run"
    states = orbax_run(run, mesh42)
    other = jax.make_mesh((2, 4), ("x", "y"))
    target = abstract(states[200], other)
    with cairn.CheckpointManager(run, handle_sigterm=False, max_to_keep=2) as mgr:
        assert mgr.steps() == [100, 200] and mgr.latest_step() == 200
        assert mgr.metrics(100) == {"loss": 1.0} and mgr.path(200) == f"{run}/200"
        same(mgr.restore(target=target), states[200])
        assert mgr.restored_step == 200
        same(mgr.restore(100, target=target), states[100])
        with pytest.raises(cairn.CheckpointExistsError, match="already saved there by Orbax"):
            mgr.save(200, mgr.restore(target=target))
        nxt = make_state(mesh42, seed=7)
        assert mgr.save(300, nxt, metrics={"loss": 0.1})
        mgr.wait()
        assert mgr.steps() == [100, 200, 300]  # retention deletes cairn's steps only: Orbax's are the way back
        assert sorted(os.listdir(run)) == ["100", "200", "300"]  # named as Orbax names its steps
        same(mgr.restore(target=target), nxt)
        assert mgr.latest_step() == 300
    assert cli(["ls", str(run), "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert [(e["step"], e["name"], e["format"], e["status"]) for e in entries] == [
        (100, "100", "orbax", "committed"), (200, "200", "orbax", "committed"),
        (300, "300", "cairn", "committed")]
    assert entries[1]["metrics"] == {"loss": 0.5}
    assert cli(["ls", str(run)]) == 0
    out = capsys.readouterr().out
    assert "orbax" in out and "3 committed" in out and "leftover" not in out


def test_step_format_keeps_orbax_names(tmp_path, mesh42, capsys):
    run = tmp_path / "run"
    states = orbax_run(run, mesh42)
    with cairn.CheckpointManager(run, handle_sigterm=False, step_format="{step}", async_save=False) as mgr:
        assert mgr.steps() == [100, 200]
        state = mgr.restore(target=abstract(states[200], mesh42))
        mgr.save(300, state, user_metadata={"data_epoch": 3})
        assert mgr.steps() == [100, 200, 300] and mgr.path(300) == f"{run}/300"
        assert os.path.exists(run / "300" / "manifest.json")
        assert mgr.user_metadata(300) == {"data_epoch": 3} and mgr.user_metadata(100) == {}
        same(cairn.load(run / "300", abstract(states[200], mesh42)), states[200])
    # Reopened, nothing of Orbax's is mistaken for an interrupted save of ours.
    with cairn.CheckpointManager(run, handle_sigterm=False, step_format="{step}") as mgr:
        assert mgr.steps() == [100, 200, 300]
        assert mgr.wait_for_step(after=200, timeout=0) == 300
        assert mgr.wait_for_step(after=100, timeout=0) == 300
        for step in mgr.new_steps(after=250, timeout=0, poll_s=0.1):
            assert step == 300
    assert cli(["ls", str(run), "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert [(e["name"], e["format"]) for e in entries] == [("100", "orbax"), ("200", "orbax"), ("300", "cairn")]


def test_evaluator_leases_an_orbax_step(tmp_path, mesh42):
    run = tmp_path / "run"
    states = orbax_run(run, mesh42, steps=(5,))
    ev = cairn.CheckpointManager(run, read_only=True)
    got = [(s, ev.restore(s, target=abstract(states[5], mesh42))) for s in ev.new_steps(timeout=0, poll_s=0.1)]
    assert [s for s, _ in got] == [5]
    same(got[0][1], states[5])
    with ev.reading(5, target=abstract(states[5], mesh42)) as st:
        same(st, states[5])


def test_step_format_is_checked():
    for bad in ("step", "a/{step}", "{step}_{step}", ".{step}", "{stp}"):
        with pytest.raises(ValueError, match="step_format"):
            cairn.CheckpointManager("memory://fmt/run", step_format=bad, handle_sigterm=False)


def test_what_an_orbax_user_looks_for(tmp_path, mesh42):
    """Per-step user metadata, best_step and delete, on cairn's steps and Orbax's alike."""
    run = tmp_path / "run"
    with ocp.CheckpointManager(os.path.abspath(run)) as omgr:
        omgr.save(1, args=ocp.args.StandardSave({"w": np.ones(4, np.float32)}), custom_metadata={"epoch": 0})
        omgr.wait_until_finished()
    with cairn.CheckpointManager(run, handle_sigterm=False, keep_best=1, best_metric="loss",
                                 max_to_keep=1) as mgr:
        assert mgr.user_metadata(1) == {"epoch": 0}
        assert cairn.user_metadata(run / "1") == {"epoch": 0}  # an Orbax step folder: its custom_metadata
        for step, loss in ((2, 0.5), (3, 0.9), (4, 0.7)):
            mgr.save(step, {"w": np.full(4, step, np.float32)}, metrics={"loss": loss},
                     user_metadata={"epoch": step, "tags": ["a"]})
        mgr.wait()
        # keep_best and max_to_keep are a union: the best (2) and the newest (4) survive, and Orbax's 1.
        assert mgr.steps() == [1, 2, 4] and mgr.best_step() == 2
        assert mgr.best_step("loss", "max") == 4
        assert mgr.user_metadata() == {"epoch": 4, "tags": ["a"]} and mgr.user_metadata(2)["epoch"] == 2
        assert cairn.user_metadata(mgr.path(4)) == {"epoch": 4, "tags": ["a"]}  # not the manager's metrics
        mgr.delete(2)
        assert mgr.steps() == [1, 4] and mgr.best_step() == 4
        with pytest.raises(cairn.CheckpointNotFoundError, match="step 2 has no committed checkpoint"):
            mgr.delete(2)
        with pytest.raises(TypeError, match="JSON-able"):
            mgr.save(5, {"w": np.ones(4)}, user_metadata={"x": object()})
    with cairn.CheckpointManager(run, handle_sigterm=False) as mgr, \
            pytest.raises(ValueError, match="best_step needs a metric"):
        mgr.best_step()


def test_ls_lists_dcp_step_folders(tmp_path, capsys):
    import warnings

    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    for step in (10, 20):  # torchtitan's spelling; DCP itself has no convention for a run
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.ones(3) * step}, checkpoint_id=str(tmp_path / f"step-{step}"))
    assert cli(["ls", str(tmp_path), "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert [(e["step"], e["format"], e["status"]) for e in entries] == [(10, "dcp", "committed"),
                                                                        (20, "dcp", "committed")]
    np.testing.assert_array_equal(cairn.load(tmp_path / "step-20")["w"], np.full(3, 20, np.float32))


# ---------------------------------------------------------------------- back to Orbax


def test_export_back_to_orbax_restores_exactly(tmp_path, mesh42):
    """cairn save -> export_orbax -> orbax-checkpoint restores it, bitwise, typed keys included."""
    st = make_state(mesh42)
    extra = {"rng": jax.random.key(3), "epoch": 7, "name": "run-a", "nothing": None}
    cairn.save(tmp_path / "ck", {"state": st, "extra": extra})
    # Named checkpointables: a step folder of an Orbax run, restored by Orbax's own manager.
    assert cairn.export_orbax(tmp_path / "ck", tmp_path / "run" / "300") == str(tmp_path / "run" / "300")
    other = jax.make_mesh((2, 4), ("x", "y"))
    with ocp.CheckpointManager(os.path.abspath(tmp_path / "run")) as omgr:
        assert omgr.all_steps() == [300]
        got = omgr.restore(300, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract(st, other)), extra=ocp.args.PyTreeRestore()))
    same(got["state"], st)
    assert got["state"].params["dense"]["kernel"].sharding.spec == P("y", "x")
    assert got["extra"]["epoch"] == 7 and got["extra"]["name"] == "run-a" and got["extra"]["nothing"] is None
    assert jax.dtypes.issubdtype(got["extra"]["rng"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(got["extra"]["rng"]), jax.random.key_data(extra["rng"]))
    # ... and cairn's manager sees the exported step as part of the Orbax run.
    with cairn.CheckpointManager(tmp_path / "run", handle_sigterm=False) as mgr:
        assert mgr.steps() == [300]
        same(mgr.restore(300, target={"state": abstract(st, mesh42), "extra": None}, partial=True)["state"], st)

    # A plain tree: an item folder, as StandardCheckpointer writes it; the CLI, and --overwrite.
    cairn.save(tmp_path / "plain", [np.arange(6, dtype=np.int16).reshape(2, 3), 2.5])
    assert cli(["-q", "convert", str(tmp_path / "plain"), str(tmp_path / "o"), "--to", "orbax"]) == 0
    got = ocp.PyTreeCheckpointer().restore(os.path.abspath(tmp_path / "o"))
    np.testing.assert_array_equal(got[0], np.arange(6, dtype=np.int16).reshape(2, 3))
    assert got[0].dtype == np.int16 and got[1] == 2.5
    with pytest.raises(cairn.CheckpointExistsError, match="overwrite"):
        cairn.export_orbax(tmp_path / "plain", tmp_path / "o")
    assert cli(["-q", "convert", str(tmp_path / "plain"), str(tmp_path / "o"), "--to", "orbax", "--overwrite"]) == 0

    cairn.save(tmp_path / "blob", {"w": np.ones(2), "raw": b"\x00\x01"})
    with pytest.raises(cairn.UnsupportedTypeError, match="'raw' is bytes, which Orbax cannot store"):
        cairn.export_orbax(tmp_path / "blob", tmp_path / "o2")


# ---------------------------------------------------------------------- CLI edges


def test_cp_of_a_run_directory_copies_every_committed_step(tmp_path, mesh42, capsys):
    run, dst = tmp_path / "run", tmp_path / "copy"
    orbax_run(run, mesh42, steps=(1,))  # Orbax's step: named as skipped, not copied
    with cairn.CheckpointManager(run, handle_sigterm=False, async_save=False) as mgr:
        for step in (2, 3):
            mgr.save(step, {"w": np.full(4, step, np.float32)}, metrics={"loss": 1.0 / step})  # named "2", "3"
    os.makedirs(run / "step_00000004" / "w")  # an interrupted save: left behind
    (run / "step_00000004" / "w" / "p00000-0.abcdef.bin").write_bytes(b"x")
    assert cli(["cp", str(run), str(dst)]) == 0
    out = capsys.readouterr().out
    assert "copied 2 committed steps" in out and "skipped 1 orbax checkpoints (1)" in out and "1 leftovers" in out
    assert sorted(os.listdir(dst)) == ["2", "3"]
    assert cairn.CheckpointManager(dst, read_only=True).metrics(3) == {"loss": 1.0 / 3}
    assert cli(["cp", str(run), str(dst)]) == 0  # again: a finished copy is only checked
    capsys.readouterr()
    # Onto another checkpoint: the CLI's own flag is named.
    cairn.save(tmp_path / "other", {"w": np.zeros(4, np.float32)})
    assert cli(["cp", str(tmp_path / "other"), str(dst / "2")]) == 1
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err
    assert cli(["cp", str(tmp_path / "other"), str(dst / "2"), "--overwrite"]) == 0
    # What SRC is, when it is not a checkpoint.
    (tmp_path / "notes.txt").write_text("hi")
    os.makedirs(tmp_path / "empty" / "x")
    (tmp_path / "empty" / "x" / "y.txt").write_text("hi")
    for src, said in (("notes.txt", "holds no committed checkpoint: it is a file or an empty folder"),
                      ("empty", "no manifest.json, and no files of a cairn save")):
        assert cli(["cp", str(tmp_path / src), str(tmp_path / "z")]) == 1
        assert said in capsys.readouterr().err
    only_orbax = tmp_path / "orbax_only"
    orbax_run(only_orbax, mesh42, steps=(7,))
    assert cli(["cp", str(only_orbax), str(tmp_path / "z")]) == 1
    assert "holds only orbax checkpoints (7)" in capsys.readouterr().err
    assert cli(["mv", str(run), str(tmp_path / "moved")]) == 0
    assert sorted(os.listdir(tmp_path / "moved")) == ["2", "3"]
    assert sorted(os.listdir(run)) == ["1", "step_00000004"]


def test_diff_of_an_orbax_step_and_the_same_state_saved_by_cairn(tmp_path, mesh42, capsys):
    """An adam TrainState saved by Orbax's CheckpointManager and by cairn: Orbax stores optax's EmptyState as
    a None leaf, cairn as an empty node; `cairn diff` matches the two (as `cairn.load` does): all equal."""
    states = orbax_run(tmp_path / "run", mesh42, steps=(5,))
    cairn.save(tmp_path / "same", states[5])
    assert cli(["--plain", "diff", str(tmp_path / "run" / "5"), str(tmp_path / "same"), "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert entries and {e["status"] for e in entries} == {"equal"}, [e for e in entries if e["status"] != "equal"]
    assert any("empty node" in e.get("detail", "") for e in entries)
    assert cli(["--plain", "diff", str(tmp_path / "same"), str(tmp_path / "run" / "5")]) == 0  # either way round
    assert "only in" not in capsys.readouterr().out
    # A None that stands for nothing on the other side is still named.
    cairn.save(tmp_path / "n1", {"a": np.zeros(2), "x": None})
    cairn.save(tmp_path / "n2", {"a": np.zeros(2)})
    assert cli(["--plain", "diff", str(tmp_path / "n1"), str(tmp_path / "n2")]) == 1
    assert "only in A" in capsys.readouterr().out


def test_save_onto_an_orbax_step_folder_says_it_is_one(tmp_path, mesh42):
    """`cairn.save` onto an Orbax step folder: the refusal says the folder is an Orbax checkpoint, which
    overwrite=True would delete; nothing of it is touched."""
    orbax_run(tmp_path / "run", mesh42, steps=(5,))
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(cairn.CheckpointExistsError, match=r"run/5 is an Orbax checkpoint.*_CHECKPOINT_METADATA.*"
                                                          r"overwrite=True would delete it"):
        cairn.save(tmp_path / "run" / "5", {"w": np.zeros(3)})
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*")) == before
    os.makedirs(tmp_path / "other")
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(cairn.CheckpointExistsError, match="is not a committed cairn checkpoint; pass overwrite=True"):
        cairn.save(tmp_path / "other", {"w": np.zeros(3)})


def test_diff_of_an_orbax_and_a_cairn_checkpoint(tmp_path, capsys):
    params = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.zeros(3, np.float32)}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(tmp_path / "orbax"), {"params": params})
    cairn.save(tmp_path / "same", {"params": params})
    assert cli(["--plain", "diff", str(tmp_path / "orbax"), str(tmp_path / "same")]) == 0
    assert "2 equal" in capsys.readouterr().out
    changed = {"w": params["w"].copy(), "b": params["b"]}
    changed["w"][1, 2] = -1
    cairn.save(tmp_path / "changed", {"params": changed, "step": 3})
    assert cli(["--plain", "diff", str(tmp_path / "orbax"), str(tmp_path / "changed"), "--json"]) == 1
    got = {(e["path"], e["status"]) for e in json.loads(capsys.readouterr().out)["entries"]}
    assert got == {("params/w", "values changed"), ("params/b", "equal"), ("", "only in B")}
    assert cli(["diff", str(tmp_path), str(tmp_path / "same")]) == 1
    assert "it is a directory of checkpoints" in capsys.readouterr().err


def test_orbax_step_prefix_and_ls_of_one_step(tmp_path, capsys):
    run = tmp_path / "run"
    options = ocp.CheckpointManagerOptions(step_prefix="checkpoint")
    with ocp.CheckpointManager(os.path.abspath(run), options=options) as omgr:
        omgr.save(40, args=ocp.args.StandardSave({"w": np.arange(4, dtype=np.float32)}))
        omgr.wait_until_finished()
    assert os.listdir(run) == ["checkpoint_40"]
    # What an Orbax save in progress looks like on a local disk: neither a step nor a leftover of ours.
    shutil.copytree(run / "checkpoint_40", run / "checkpoint_50.orbax-checkpoint-tmp-1234")
    assert cli(["ls", str(run), "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert [(e["step"], e["name"], e["format"]) for e in entries] == [(40, "checkpoint_40", "orbax")]
    with cairn.CheckpointManager(run, step_format="checkpoint_{step}", handle_sigterm=False) as mgr:
        assert mgr.steps() == [40]
        np.testing.assert_array_equal(mgr.restore()["w"], np.arange(4, dtype=np.float32))
    assert sorted(os.listdir(run)) == ["checkpoint_40", "checkpoint_50.orbax-checkpoint-tmp-1234"]
    assert cli(["ls", str(run / "checkpoint_40")]) == 0
    assert "is a checkpoint in orbax format itself" in capsys.readouterr().out


def test_save_onto_an_orbax_prefix_of_an_object_store_says_it_is_one():
    """On an object store (a commit marker, no rename) the save writes into the prefix itself: a save onto
    an Orbax checkpoint's prefix is refused from the same one listing, before anything is written, and
    would otherwise mix cairn's files with Orbax's."""
    from cairn._storage.location import resolve

    url = f"memory://orbax-{uuid.uuid4().hex[:8]}/run/7"
    loc = resolve(url)
    loc.storage.put(loc.key("_CHECKPOINT_METADATA"), b"{}")
    loc.storage.put(loc.key("default/manifest.ocdbt"), b"x")
    before = sorted(loc.storage.list_dir(loc.name))
    with pytest.raises(cairn.CheckpointExistsError, match=r"run/7 is an Orbax checkpoint.*_CHECKPOINT_METADATA.*"
                                                          r"overwrite=True would delete it"):
        cairn.save(url, {"w": np.zeros(3)})
    assert sorted(loc.storage.list_dir(loc.name)) == before
    cairn.save(f"{url}-elsewhere", {"w": np.zeros(3)})  # a plain new prefix saves as ever
