"""Exports of `cairn.PerProcess` values: each saving process's value under ``process_<p>``.

The checkpoint is saved by 3 real processes (tests/_mp, `export_scenarios:save_per_process`);
this process (one) and 2 real processes export it, and safetensors and
orbax-checkpoint themselves read the results back.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import cairn
from _mp import run
from cairn._cli.main import main as cli

safetensors_numpy = pytest.importorskip("safetensors.numpy")
ocp = pytest.importorskip("orbax.checkpoint")


def _window(p: int) -> np.ndarray:
    return np.full((2, p + 1), p, np.int32)  # as export_scenarios.save_per_process writes it


@pytest.fixture(scope="module")
def saved_on_3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pp") / "ck")
    run(3, "export_scenarios:save_per_process", {"path": path}, devices_per_process=1, timeout=180)
    return path


def _st_tensors(folder) -> dict[str, np.ndarray]:
    index = os.path.join(folder, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update(safetensors_numpy.load_file(os.path.join(folder, f)))
    return out


def test_safetensors_export_names_each_saving_process(saved_on_3, tmp_path):
    cairn.export_safetensors(saved_on_3, tmp_path / "hf", all_items=True)
    got = _st_tensors(tmp_path / "hf")
    assert sorted(got) == ["data.process_0.window", "data.process_1.window", "data.process_2.window", "params.w"]
    for p in range(3):
        np.testing.assert_array_equal(got[f"data.process_{p}.window"], _window(p))
    np.testing.assert_array_equal(got["params.w"], np.arange(12, dtype=np.float32))
    # rename sees the exported key path; drop leaves them out; error names the leaf and the ways out.
    cairn.export_safetensors(saved_on_3, tmp_path / "renamed", rename=[(r"^data/process_(\d)/", r"iter/\1/")],
                             all_items=True)
    assert "iter.2.window" in _st_tensors(tmp_path / "renamed")
    # Dropped, "params" is the one checkpointable holding arrays: its names are bare, as Hugging Face's.
    cairn.export_safetensors(saved_on_3, tmp_path / "dropped", per_process="drop")
    assert sorted(_st_tensors(tmp_path / "dropped")) == ["w"]
    with pytest.raises(cairn.UnsupportedTypeError, match=r"ck: 'data' holds per-process values \(cairn.PerProcess, "
                       r"saved by 3 processes\).*per_process='keys'.*'drop'"):
        cairn.export_safetensors(saved_on_3, tmp_path / "refused", per_process="error")
    with pytest.raises(ValueError, match="per_process must be one of keys, drop, error, got 'all'"):
        cairn.export_safetensors(saved_on_3, tmp_path / "bad", per_process="all")


def test_safetensors_export_from_two_processes_names_the_same(saved_on_3, tmp_path):
    """Two processes share the files out: the names depend on who saved, not on who exports."""
    out = run(2, "export_scenarios:export", {"ckpt": saved_on_3, "dst": str(tmp_path / "hf"),
                                             "max_shard_size": "40B", "all_items": True}, devices_per_process=1, timeout=120)
    assert sorted(f for r in out for f in r["written"]) == out[0]["files"][:-1]  # each file written once
    got = _st_tensors(tmp_path / "hf")
    for p in range(3):
        np.testing.assert_array_equal(got[f"data.process_{p}.window"], _window(p))


def test_convert_to_safetensors_names_processes_and_converts_back_per_process(saved_on_3, tmp_path, capsys):
    st = str(tmp_path / "one.safetensors")
    assert cli(["convert", saved_on_3, st, "--to", "safetensors", "--all-items"]) == 0
    got = safetensors_numpy.load_file(st)
    assert sorted(got) == ["data.process_0.window", "data.process_1.window", "data.process_2.window", "params.w"]
    assert cli(["convert", st, str(tmp_path / "back"), "--to", "cairn"]) == 0
    back = cairn.load(tmp_path / "back")  # per-process again: one process loading gets all three
    assert [v["pos"] for v in back["data"]] == [1, 11, 21]
    for p, v in enumerate(back["data"]):
        np.testing.assert_array_equal(v["window"], _window(p))
    assert cli(["convert", saved_on_3, str(tmp_path / "hf"), "--to", "safetensors", "--max-shard-size", "1GB",
                "--per-process", "drop"]) == 0
    assert sorted(_st_tensors(tmp_path / "hf")) == ["w"]


def test_orbax_export_keys_each_saving_process(saved_on_3, tmp_path):
    out = cairn.export_orbax(saved_on_3, tmp_path / "ob")
    got = ocp.PyTreeCheckpointer().restore(out)
    assert sorted(got["data"]) == ["process_0", "process_1", "process_2"]
    for p in range(3):
        assert got["data"][f"process_{p}"]["pos"] == 10 * p + 1
        np.testing.assert_array_equal(got["data"][f"process_{p}"]["window"], _window(p))
    np.testing.assert_array_equal(got["params"]["w"], np.arange(12, dtype=np.float32))
    assert got["step"] == 7
    assert cli(["convert", saved_on_3, str(tmp_path / "dropped"), "--to", "orbax", "--per-process", "drop"]) == 0
    dropped = ocp.PyTreeCheckpointer().restore(str(tmp_path / "dropped"))
    assert dropped.get("data") is None and dropped["step"] == 7
    with pytest.raises(cairn.UnsupportedTypeError, match="'data' holds per-process values"):
        cairn.export_orbax(saved_on_3, tmp_path / "refused", per_process="error")
    assert not os.path.exists(tmp_path / "refused")


def test_one_saving_process_is_named_too_and_bytes_inside_say_drop(tmp_path):
    """Saved by one process, the value is still under process_0: the layout names processes alike."""
    cairn.save(tmp_path / "c", {"params": {"w": np.ones(3, np.float32)},
                                "opt": {"lr": 0.1, "data": cairn.PerProcess({"pos": 4, "rng": np.arange(2)})}})
    out = cairn.export_orbax(tmp_path / "c", tmp_path / "ob")  # a step folder: one Orbax item per checkpointable
    opt = ocp.PyTreeCheckpointer().restore(os.path.join(out, "opt"))
    assert opt["data"]["process_0"]["pos"] == 4 and opt["lr"] == 0.1
    np.testing.assert_array_equal(opt["data"]["process_0"]["rng"], np.arange(2))
    cairn.export_safetensors(tmp_path / "c", tmp_path / "hf", all_items=True)
    assert sorted(_st_tensors(tmp_path / "hf")) == ["opt.data.process_0.rng", "params.w"]
    cairn.save(tmp_path / "b", {"w": np.ones(2), "data": cairn.PerProcess({"state": b"\x00it"})})
    with pytest.raises(cairn.UnsupportedTypeError, match=r"leaf 'data/process_0/state' is bytes.*per_process='drop'"):
        cairn.export_orbax(tmp_path / "b", tmp_path / "ob2")
    got = ocp.PyTreeCheckpointer().restore(cairn.export_orbax(tmp_path / "b", tmp_path / "ob2", per_process="drop"))
    assert got.get("data") is None
    np.testing.assert_array_equal(got["w"], np.ones(2))


def test_a_recompressing_copy_keeps_every_processs_value(saved_on_3, tmp_path):
    """`copy(compression=...)` carries per-process values over as saved (3 processes' windows), with the
    saving process count, and a target-less load of the copy returns all of them as of the source."""
    from cairn._load.source import open_checkpoint

    cairn.copy(saved_on_3, tmp_path / "z", compression=True)
    ck = open_checkpoint(tmp_path / "z")
    blosc2 = any(getattr(leaf, "codec", "none") == "blosc2" for index in ck.indexes.values() for leaf in index.leaves)
    assert ck.manifest.version == (5 if blosc2 else 3) and ck.manifest.process_count == open_checkpoint(saved_on_3).manifest.process_count
    src, got = cairn.load(saved_on_3), cairn.load(tmp_path / "z")
    assert len(got["data"]) == 3
    for p in range(3):
        np.testing.assert_array_equal(got["data"][p]["window"], _window(p))
        np.testing.assert_array_equal(got["data"][p]["window"], src["data"][p]["window"])
    np.testing.assert_array_equal(got["params"]["w"], src["params"]["w"])
