"""A safe migration, the export and load-value side: each test follows a user's steps.

- exports that would load as random weights (several checkpointables, rename rules that match
  nothing, a converted file cairn cannot read back) are refused or named;
- casts that change values on load need ``cast="unsafe"``;
- a DCP checkpoint loaded with ``mesh=`` comes back on the mesh;
- ``cairn verify`` and ``cairn cp`` recognise Orbax and DCP folders.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn

# ---------------------------------------------------------------------- item 5: lossy casts


def test_a_float_leaf_loaded_into_an_int8_target_is_refused_not_wrapped(tmp_path):
    """The user's step: a float32 leaf holding 5610 loaded into an int8 target wrapped to -22."""
    cairn.save(tmp_path / "ck", {"params": {"w": np.array([1.0, 5610.0, 3.0], np.float32)}})
    target = {"params": {"w": np.zeros(3, np.int8)}}
    with pytest.raises(cairn.MismatchError) as e:
        cairn.load(tmp_path / "ck", target)
    msg = str(e.value)
    for part in (str(tmp_path / "ck"), "'params/w'", "float32", "int8", "5610.0 becomes -22", "cast='unsafe'"):
        assert part in msg, (part, msg)
    # onto a device (a sharded target) as well
    s = NamedSharding(jax.make_mesh((8,), ("x",)), P())
    with pytest.raises(cairn.MismatchError, match=r"'params/w' is float32 .* int8"):
        cairn.load(tmp_path / "ck", {"params": {"w": jax.ShapeDtypeStruct((3,), jnp.int8, sharding=s)}})
    # asked for, it casts as numpy does
    got = cairn.load(tmp_path / "ck", target, cast="unsafe")["params"]["w"]
    np.testing.assert_array_equal(got, np.array([1, -22, 3], np.int8))


def test_whole_floats_into_integers_still_need_the_opt_in(tmp_path):
    cairn.save(tmp_path / "ck", {"n": np.array([1.0, 2.0], np.float64)})
    with pytest.raises(cairn.MismatchError, match="only when asked.*e.g. 1.0 becomes 1"):
        cairn.load(tmp_path / "ck", {"n": np.zeros(2, np.int32)})
    assert cairn.load(tmp_path / "ck", {"n": np.zeros(2, np.int32)}, cast="unsafe")["n"].tolist() == [1, 2]


@pytest.mark.parametrize("saved, target, example", [
    (np.array([3, 2**40], np.int64), np.int32, "1099511627776 becomes 0"),   # narrower, out of range
    (np.array([5, -1], np.int8), np.uint8, "-1 becomes 255"),                # signed -> unsigned
    (np.array([2**63], np.uint64), np.int64, "9223372036854775808 becomes -9223372036854775808"),
    (np.array([1.0, 1e6], np.float32), np.float16, "1000000.0 becomes inf"),  # float overflow
    (np.array([1.0, 1e6], np.float32), ml_dtypes.float8_e4m3fn, "1000000.0 becomes nan"),
    (np.array([70000], np.int32), np.float16, "70000 becomes inf"),
    (np.array([0, 2], np.int8), np.bool_, "2 becomes True"),
    (np.array([1 + 2j], np.complex64), np.float32, "imaginary part"),
])
def test_casts_that_change_values_are_refused(tmp_path, saved, target, example):
    cairn.save(tmp_path / "ck", {"a": saved})
    with pytest.raises(cairn.MismatchError, match="would change values") as e:
        cairn.load(tmp_path / "ck", {"a": np.zeros(saved.shape, target)})
    assert example in str(e.value) and np.dtype(target).name in str(e.value)
    cairn.load(tmp_path / "ck", {"a": np.zeros(saved.shape, target)}, cast="unsafe")  # asked for: allowed


@pytest.mark.parametrize("saved, target", [
    (np.array([1.5, -2.25, 1e30], np.float32), ml_dtypes.bfloat16),  # float -> float: silent, rounds
    (np.array([1.5, 1e30], np.float64), np.float32),
    (np.array([1.5, 7.0], np.float32), np.float16),                  # narrower range, values fit
    (np.array([-3, 100], np.int8), np.int64),                        # widening
    (np.array([3, 2**31 - 1], np.int64), np.int32),                  # narrower, every value fits
    (np.array([0, 200], np.uint8), np.int16),
    (np.array([True, False]), np.float32),
    (np.array([7, -8], np.int32), np.float32),
    (np.array([np.inf, np.nan], np.float32), np.float16),           # not finite before: not an overflow
])
def test_casts_that_keep_values_stay_silent(tmp_path, saved, target):
    cairn.save(tmp_path / "ck", {"a": saved})
    got = cairn.load(tmp_path / "ck", {"a": np.zeros(saved.shape, target)})["a"]
    assert got.dtype == np.dtype(target)
    np.testing.assert_array_equal(got, saved.astype(target))


def test_manager_restore_takes_cast(tmp_path):
    with cairn.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"opt": {"count": np.array([300], np.int64)}})
        mgr.wait()
        with pytest.raises(cairn.MismatchError, match="'opt/count' is int64.*int8"):
            mgr.restore(1, {"opt": {"count": np.zeros(1, np.int8)}})
        got = mgr.restore(1, {"opt": {"count": np.zeros(1, np.int8)}}, cast="unsafe")
    assert got["opt"]["count"].tolist() == [44]
    with pytest.raises(ValueError, match="cast must be 'safe'"):
        cairn.load(tmp_path / "run", cast="lossy")


# ---------------------------------------------------------------------- item 3: exports that load as random weights

GPT2 = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=128)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(hf folder, cairn checkpoint {"params": HF tree, "opt": adam-like moments, "step": 3}, state dict)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    base = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(base / "hf")
    params = cairn.load(base / "hf")
    opt = {"mu": jax.tree.map(np.zeros_like, params), "nu": jax.tree.map(np.ones_like, params)}
    cairn.save(base / "ck", {"params": params, "opt": opt, "step": 3})
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return base / "hf", base / "ck", sd


def _from_pretrained(folder, hf, sd):
    """The exported folder loads in transformers with every weight found and equal to the model's."""
    import shutil

    import torch
    import transformers

    shutil.copy(hf / "config.json", folder / "config.json")
    model, info = transformers.GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    for name, t in model.state_dict().items():
        assert torch.equal(t, sd[name]), name


def test_export_of_params_and_opt_without_item_is_refused_naming_them(gpt2, tmp_path):
    """The user's step: export_safetensors(ckpt, out) wrote params.* and opt.* names, and
    from_pretrained built a randomly initialised model without a word."""
    hf, ck, sd = gpt2
    with pytest.raises(cairn.CheckpointError) as e:
        cairn.export_safetensors(ck, tmp_path / "out")
    msg = str(e.value)
    for part in (str(ck), "'params', 'opt'", "item='params'", "all_items=True"):
        assert part in msg, (part, msg)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")  # nothing written
    # the CLI says the same, and writes nothing
    from cairn._cli.main import main

    assert main(["-q", "convert", str(ck), str(tmp_path / "cli"), "--to", "safetensors",
                 "--max-shard-size", "50KB"]) == 1
    assert main(["-q", "convert", str(ck), str(tmp_path / "cli.safetensors"), "--to", "safetensors"]) == 1
    assert not (tmp_path / "cli.safetensors").exists()
    # item= picks the model's weights: from_pretrained finds every one
    cairn.export_safetensors(ck, tmp_path / "params", item="params", max_shard_size="50KB")
    _from_pretrained(tmp_path / "params", hf, sd)
    # all_items=True asks for the prefixed names
    from safetensors.numpy import load_file

    cairn.export_safetensors(ck, tmp_path / "all", all_items=True)
    names = set(load_file(str(tmp_path / "all" / "model.safetensors")))
    saved = set(load_file(str(hf / "model.safetensors")))  # lm_head.weight is tied: not saved
    assert names == {f"{p}{k}" for k in saved for p in ("params.", "opt.mu.", "opt.nu.")}


def test_export_rename_rule_that_matches_nothing_is_refused(gpt2, tmp_path):
    hf, ck, sd = gpt2
    # "model." is Llama's prefix, not GPT-2's: the rule renames nothing
    with pytest.raises(cairn.CheckpointError, match=r"rename rule \('\^model/', ''\) matched no tensor's key path"):
        cairn.export_safetensors(ck, tmp_path / "out", item="params", rename=[(r"^model/", ""), (r"^transformer/", "transformer/")])
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # the rules that match: written, and the renamed folder still loads
    cairn.export_safetensors(ck, tmp_path / "ok", item="params", rename=[(r"^transformer/", "transformer/")])
    _from_pretrained(tmp_path / "ok", hf, sd)


def test_load_with_a_rename_rule_that_matches_nothing_warns_and_reports_it(gpt2, caplog):
    _hf, ck, _sd = gpt2
    report = cairn.RestoreReport()
    with caplog.at_level(logging.WARNING, logger="cairn"):
        got = cairn.load(ck, {"params": None}, partial=True, report=report,
                         rename=[(r"^params/transformer/h/", "params/transformer/blocks/"), (r"/enc/", "/encoder/")])
    assert "blocks" in got["params"]["transformer"]
    assert report.unmatched_rules == ["('/enc/', '/encoder/')"]
    assert any("rename rule ('/enc/', '/encoder/') matched no key path" in r.getMessage() and str(ck) in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


def test_convert_to_safetensors_without_a_suffix_reads_back(gpt2, tmp_path, capsys):
    """The user's step: `cairn convert ck out --to safetensors` wrote a file named "out" that
    cairn could not read back. Now "out" is a folder holding out/model.safetensors."""
    from safetensors.numpy import load_file

    from cairn._cli.main import main

    hf, ck, sd = gpt2
    assert main(["convert", str(ck), str(tmp_path / "out"), "--to", "safetensors", "--item", "params"]) == 0
    assert f"wrote {tmp_path / 'out' / 'model.safetensors'}" in capsys.readouterr().out
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]
    # cairn reads it back: the folder, and as a checkpoint converted back
    back = cairn.load(tmp_path / "out")  # cairn's tree, recorded in the file: the checkpointable first
    want = cairn.load(ck, {"params": None}, partial=True)
    jax.tree.map(np.testing.assert_array_equal, back, want)
    assert main(["-q", "convert", str(tmp_path / "out"), str(tmp_path / "again"), "--to", "cairn"]) == 0
    jax.tree.map(np.testing.assert_array_equal, cairn.load(tmp_path / "again"), want)
    # the safetensors library and transformers read it too
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(load_file(str(hf / "model.safetensors")))
    for k, v in got.items():
        np.testing.assert_array_equal(v, sd[k].numpy())
    _from_pretrained(tmp_path / "out", hf, sd)
    # a .safetensors name stays one file, as before
    assert main(["-q", "convert", str(ck), str(tmp_path / "m.safetensors"), "--to", "safetensors",
                 "--item", "params"]) == 0
    assert (tmp_path / "m.safetensors").is_file()


# ---------------------------------------------------------------------- item 7: DCP onto a mesh


def test_dcp_checkpoint_loaded_with_mesh_comes_back_on_the_mesh(tmp_path):
    """The user's step: cairn.load(dcp_dir, mesh=mesh) returned numpy arrays, though the docs say
    arrays come back on the mesh. A real torch.distributed.checkpoint.save output."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.warns(UserWarning):  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"model": model.state_dict(), "step": 3}, checkpoint_id=str(tmp_path / "dcp"))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    got = cairn.load(tmp_path / "dcp", mesh=mesh)
    assert got["step"] == 3
    sd = model.state_dict()
    for name, arr in got["model"].items():
        assert isinstance(arr, jax.Array), (name, type(arr))
        assert arr.sharding == NamedSharding(mesh, P()), name  # DCP records no JAX axis names: replicated
        np.testing.assert_array_equal(np.asarray(arr), sd[name].numpy())
    # a target with shardings still splits them as asked; without mesh, numpy as before
    rows = cairn.load(tmp_path / "dcp", {"model": {"0.weight": NamedSharding(mesh, P("data"))}}, partial=True)
    assert rows["model"]["0.weight"].sharding.spec == P("data")
    assert isinstance(cairn.load(tmp_path / "dcp")["model"]["0.weight"], np.ndarray)
    # Hugging Face safetensors alike
    from safetensors.numpy import save_file

    save_file({"w": np.arange(8, dtype=np.float32)}, str(tmp_path / "m.safetensors"))
    w = cairn.load(tmp_path / "m.safetensors", mesh=mesh)["w"]
    assert isinstance(w, jax.Array) and w.sharding == NamedSharding(mesh, P())


# ---------------------------------------------------------------------- item 8: verify and cp on Orbax / DCP


def _dcp_folder(path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    with pytest.warns(UserWarning):  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"model": model.state_dict(), "step": 3}, checkpoint_id=str(path))
    return path


def _orbax_step(run):
    """An Orbax CheckpointManager step, as the user's training job wrote it: Composite(state=StandardSave,
    extra=JsonSave), params sharded on a (4, 2) mesh."""
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    s = NamedSharding(mesh, P("data", "model"))
    tree = {"params": {"w": jax.device_put(jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16), s)},
            "opt": {"mu": jnp.zeros((64, 16)), "count": jnp.int32(10)}}
    with ocp.CheckpointManager(os.path.abspath(run), item_names=("state", "extra")) as mgr:
        mgr.save(10, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                              extra=ocp.args.JsonSave({"lr": 0.1})))
        mgr.wait_until_finished()
    return run / "10"


def test_cli_verify_reads_a_dcp_checkpoint_and_names_a_broken_one(tmp_path, capsys):
    """The user's step: `cairn verify dcp_dir` said "no manifest.json", which reads as a broken checkpoint."""
    from cairn._cli.main import main

    folder = _dcp_folder(tmp_path / "dcp")
    assert main(["--plain", "verify", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"OK: {folder}: a PyTorch DCP checkpoint" in out and "every array reads" in out and "no checksums" in out
    from cairn._sources.verify import verify

    report = verify(folder)
    assert report.ok and report.format == "dcp" and report.bytes_checked == (64 * 32 + 32 + 32 * 2 + 2) * 4
    # a truncated data file: FAILED, exit 1, the file named
    data = next(f for f in os.listdir(folder) if f.endswith(".distcp"))
    with open(folder / data, "r+b") as f:
        f.truncate(os.path.getsize(folder / data) // 2)
    assert main(["--plain", "verify", str(folder)]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "truncated" in captured.err and "manifest.json" not in captured.err


def test_cli_verify_reads_an_orbax_manager_step(tmp_path, capsys):
    from cairn._cli.main import main
    from cairn._sources.verify import verify

    step = _orbax_step(tmp_path / "run")
    assert main(["--plain", "verify", str(step)]) == 0
    assert f"OK: {step}: an Orbax checkpoint" in capsys.readouterr().out
    report = verify(step)
    assert report.ok and report.format == "orbax" and report.bytes_checked >= 2 * 64 * 16 * 4
    # the data files the step's OCDBT manifest names, truncated: FAILED, with tensorstore's reason
    for f in os.listdir(step / "state" / "d"):
        with open(step / "state" / "d" / f, "r+b") as fh:
            fh.truncate(10)
    assert main(["--plain", "verify", str(step)]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "CORRUPT" in captured.err and "of item 'state'" in captured.err


@pytest.mark.parametrize("verb", ["cp", "mv"])
def test_cli_cp_and_mv_of_orbax_and_dcp_say_what_the_folder_is(tmp_path, capsys, verb):
    """The user's step: `cairn cp orbax_step dst` said "no manifest.json". Now it names the format and
    what to do, and touches nothing."""
    from cairn._cli.main import main

    for src, name in ((_dcp_folder(tmp_path / "dcp"), "a PyTorch DCP checkpoint"),
                      (_orbax_step(tmp_path / "run"), "an Orbax checkpoint")):
        before = sorted(os.listdir(src))
        assert main(["--plain", verb, str(src), str(tmp_path / f"copy_{verb}")]) == 1
        err = capsys.readouterr().err
        assert f"{src} is {name}, not a cairn one" in err and "cairn convert" in err and "cp -r" in err, err
        assert "manifest.json" not in err
        assert sorted(os.listdir(src)) == before and not (tmp_path / f"copy_{verb}").exists()
        with pytest.raises(cairn.CheckpointNotFoundError, match=f"is {name}"):
            cairn.copy(src, tmp_path / "api_copy")


def test_load_that_fails_names_the_rename_rule_that_matched_nothing(gpt2):
    """Where the load cannot succeed, the unmatched rule is the likely cause: the error says so."""
    _hf, ck, _sd = gpt2
    target = {"params": {"embed": np.zeros((128, 32), np.float32)}}
    with pytest.raises(cairn.MismatchError, match=r"'params/embed' of the target is not in the checkpoint.*"
                       r"rename rule \('\^params/model/embed_tokens/weight\$', 'params/embed'\) matched no key path"):
        cairn.load(ck, target, partial=True, rename=[(r"^params/model/embed_tokens/weight$", "params/embed")])
    got = cairn.load(ck, target, partial=True, rename=[(r"^params/transformer/wte/weight$", "params/embed")])
    assert got["params"]["embed"].shape == (128, 32)
