"""cairn.PerProcess: values each process saves for itself, and the refusal of undeclared differing ones.

Multi-process cases run real JAX processes on 127.0.0.1 (tests/_mp; scenarios in
tests/_mp/perprocess_scenarios.py): 3 processes save, 2 processes and this one load.
"""

from __future__ import annotations

import json
import os
from collections import namedtuple

import numpy as np
import pytest

import cairn
from _mp import run

SCENARIOS = "perprocess_scenarios"


def _value(p: int) -> dict:
    return {"state": f"iterator state of process {p}".encode(), "pos": 10 * p + 1, "name": f"p{p}",
            "window": np.full((2, p + 1), p, np.int32), "seen": [b"x" * i for i in range(p)]}


def _check(got: dict, p: int) -> None:
    want = _value(p)
    assert got.keys() == want.keys()
    assert got["state"] == want["state"] and got["pos"] == want["pos"] and got["name"] == want["name"]
    np.testing.assert_array_equal(got["window"], want["window"])
    assert got["seen"] == want["seen"]  # a different number of leaves on each process
    assert got["window"].dtype == np.int32


@pytest.fixture(scope="module")
def saved_on_3(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("pp"))
    out = run(3, f"{SCENARIOS}:save_and_restore", {"directory": directory}, devices_per_process=1, timeout=180)
    return directory, out


# ------------------------------------------------------------------------- one process


def test_single_process_round_trip(tmp_path):
    Pos = namedtuple("Pos", ["epoch", "index"])
    state = {"w": np.arange(6.0), "data": cairn.PerProcess({"it": b"\x00state", "pos": Pos(2, 7)}),
             "mixed": {"lr": 0.1, "rng": cairn.PerProcess(np.arange(3, dtype=np.uint32))}}
    cairn.save(tmp_path / "c", state)
    plain = cairn.load(tmp_path / "c")
    assert plain["data"] == {"it": b"\x00state", "pos": {"epoch": 2, "index": 7}}
    np.testing.assert_array_equal(plain["mixed"]["rng"], np.arange(3))
    # A PerProcess in the target: a PerProcess back; its template gives the containers.
    got = cairn.load(tmp_path / "c", {"data": cairn.PerProcess(state["data"].value), "mixed": {
        "lr": None, "rng": cairn.PerProcess()}})
    assert isinstance(got["data"], cairn.PerProcess) and got["data"].value == {"it": b"\x00state", "pos": Pos(2, 7)}
    assert type(got["data"].value["pos"]) is Pos and got["mixed"]["lr"] == 0.1
    # ...so that the restored state saves again, declared as it was.
    cairn.save(tmp_path / "again", got)
    assert cairn.load(tmp_path / "again")["data"]["pos"] == {"epoch": 2, "index": 7}
    # metadata: one entry per saving process.
    info = cairn.metadata(tmp_path / "c")["data"]
    assert isinstance(info, list) and len(info) == 1 and info[0]["it"].kind == "bytes"


def test_empty_and_none_values_and_a_root_per_process_state(tmp_path):
    cairn.save(tmp_path / "c", {"empty": cairn.PerProcess({}), "none": cairn.PerProcess(None), "n": 1})
    assert cairn.load(tmp_path / "c") == {"empty": {}, "none": None, "n": 1}
    cairn.save(tmp_path / "root", cairn.PerProcess({"pos": 4}))
    assert cairn.load(tmp_path / "root") == {"pos": 4}
    assert cairn.load(tmp_path / "root", cairn.PerProcess()) == cairn.PerProcess({"pos": 4})


def test_on_disk_form_is_the_documented_node(tmp_path):
    cairn.save(tmp_path / "c", {"data": cairn.PerProcess({"pos": 3, "buf": b"abc"}), "step": 1})
    (index,) = [n for n in os.listdir(tmp_path / "c" / "data") if n.startswith("index.") and n.endswith(".json")]
    doc = json.loads((tmp_path / "c" / "data" / index).read_bytes())
    assert doc["structure"] == {"per_process": [{"dict": [["pos", {"leaf": 0}], ["buf", {"leaf": 1}]]}]}
    assert [(x["path"], x["kind"]) for x in doc["leaves"]] == [("0/pos", "int"), ("0/buf", "bytes")]


def test_the_spec_reader_with_section_7_1_reads_it(tmp_path, monkeypatch):
    # tests/format/test_nojax.py's reader (json and numpy only), given the one node form §7.1 adds.
    nojax = pytest.importorskip("test_nojax")
    build = nojax._build

    def with_per_process(node, values):
        if "per_process" in node:
            return [with_per_process(child, values) for child in node["per_process"]]
        return build(node, values)

    monkeypatch.setattr(nojax, "_build", with_per_process)
    cairn.save(tmp_path / "c", {"data": cairn.PerProcess({"pos": 3, "buf": b"abc", "w": np.arange(3.0)}), "n": 1})
    got = nojax.spec_reader(str(tmp_path / "c"))
    assert got["n"] == 1 and got["data"][0]["pos"] == 3 and got["data"][0]["buf"] == b"abc"
    np.testing.assert_array_equal(got["data"][0]["w"], np.arange(3.0))


def test_target_mismatches_are_named(tmp_path):
    cairn.save(tmp_path / "c", {"data": cairn.PerProcess({"pos": 3}), "plain": {"pos": 3}})
    with pytest.raises(cairn.MismatchError, match=r"'data' was saved per process \(cairn.PerProcess\)"):
        cairn.load(tmp_path / "c", {"data": {"pos": None}})
    with pytest.raises(cairn.MismatchError, match=r"PerProcess at 'plain'.*saved without cairn.PerProcess"):
        cairn.load(tmp_path / "c", {"plain": cairn.PerProcess()})


def test_what_a_per_process_value_cannot_hold(tmp_path):
    import jax.numpy as jnp

    with pytest.raises(cairn.UnsupportedTypeError, match=r"'data/0/x' of a cairn.PerProcess is a jax.Array"):
        cairn.save(tmp_path / "a", {"data": cairn.PerProcess({"x": jnp.zeros(2)})})
    with pytest.raises(cairn.UnsupportedTypeError, match="cairn.PerProcess inside cairn.PerProcess"):
        cairn.save(tmp_path / "b", {"data": cairn.PerProcess([cairn.PerProcess(1)])})
    assert not os.listdir(tmp_path)


# ------------------------------------------------------------------------- real processes


def test_declared_values_round_trip_per_process(saved_on_3):
    _, out = saved_on_3
    for p, r in enumerate(out):
        assert r["declared"] and r["plain"] and r["async"], (p, r)
        assert r["manager"] == [2, {"step": 2, "p": p}], (p, r)


def test_undeclared_differing_values_are_refused_on_every_process(saved_on_3):
    _, out = saved_on_3
    assert len(out) == 3
    for r in out:
        kind, msg = r["refused"]
        assert kind == "CheckpointError", r
        assert "'data' (process 0 has one value, 1 another, 2 another)" in msg, msg
        assert "'cfg/x' (processes 0, 2 have one value, 1 another)" in msg, msg
        assert "'same'" not in msg and "cairn.PerProcess(iterator.get_state())" in msg, msg
        assert "process 2 saves another tree than process 0 in 'cfg'" in r["trees"], r["trees"]
        assert "trees" not in r["refused_left"]
        assert "refused" not in r["refused_left"] and not [n for n in r["refused_left"] if "refused" in n], r


def test_a_leaf_one_process_cannot_store_fails_every_process_at_once(saved_on_3):
    _, out = saved_on_3
    for p, r in enumerate(out):
        kind, msg, took = r["unstorable"]
        assert kind == "UnsupportedTypeError" and "'x' has type builtins.object" in msg, (p, msg)
        assert p == 1 or "process 1: " in msg, (p, msg)
        assert took < 30, took  # told, not timed out


def test_restore_on_fewer_processes_needs_the_hook(saved_on_3):
    directory, _ = saved_on_3
    path = os.path.join(directory, "declared")
    hooked = run(2, f"{SCENARIOS}:load_other_count", {"path": path, "kind": "hook"}, devices_per_process=1,
                 timeout=120)
    # Old processes 0, 1, 2 (positions 1, 11, 21) dealt round-robin over two: 0 gets 0 and 2, 1 gets 1.
    assert [r["value"] for r in hooked] == [[1, 21], [11]]
    bare = run(2, f"{SCENARIOS}:load_other_count", {"path": path, "kind": "bare"}, devices_per_process=1,
               timeout=120)
    for r in bare:
        kind, msg = r["error"]
        assert kind == "MismatchError" and "saved by 3 processes, and 2 are loading" in msg, msg
        assert "cairn.PerProcess(reshard=fn)" in msg, msg


def test_a_load_without_a_target_on_another_count_returns_every_saved_value(saved_on_3):
    directory, _ = saved_on_3
    path = os.path.join(directory, "declared")
    out = run(2, f"{SCENARIOS}:load_other_count", {"path": path, "kind": "targetless"}, devices_per_process=1,
              timeout=120)
    for p, r in enumerate(out):
        assert r["pos"] == [1, 11, 21] and r["config"] == {"lr": 0.5}, r  # old processes 0, 1, 2, on both
        assert r["same"] == [True, True, True, True], r
        assert r["mine"]["pos"] == 10 * p + 1 and r["mine"]["name"] == f"p{p}", r  # indexed by the saving process
        # load(mesh=) across real processes: the saved P("x") over 2 processes' devices (24 elements: 12 each).
        assert r["spec"] in ("P('x',)", "PartitionSpec('x',)") and r["index"] == [[12 * p, 12 * p + 12]], r
        assert r["shard"] == [float(x) for x in range(12 * p, 12 * p + 12)], r


def test_restore_in_one_process_of_a_three_process_checkpoint(saved_on_3):
    directory, _ = saved_on_3
    path = os.path.join(directory, "declared")
    whole = cairn.load(path)  # without a target: the list of the three saved values
    assert isinstance(whole["data"], list) and len(whole["data"]) == 3
    for p, v in enumerate(whole["data"]):
        _check(v, p)
    assert whole["config"] == {"lr": 0.5}
    # A PerProcess() target asks for this process's own value, which no process saved for a count of 1.
    with pytest.raises(cairn.MismatchError, match=r"declared: 'data' holds per-process values saved by 3 processes, "
                       r"and 1 is loading; give the target cairn.PerProcess\(reshard=fn\) there"):
        cairn.load(path, {"data": cairn.PerProcess(), "config": None})
    got = cairn.load(path, {"data": cairn.PerProcess(reshard=lambda saved, i, n: saved), "config": None})
    for p, v in enumerate(got["data"].value):
        _check(v, p)
    assert got["config"] == {"lr": 0.5}


def test_cairn_plan_plans_per_process_values_as_per_process_reads(saved_on_3, capsys):
    from cairn._cli.main import main

    directory, _ = saved_on_3
    path = os.path.join(directory, "declared")
    plans = {}
    for n in (3, 2, 1):
        assert main(["plan", path, "--mesh", str(n), "--processes", str(n), "--json"]) == 0
        plans[n] = json.loads(capsys.readouterr().out)
    assert plans[3]["per_process"] == [{"path": "data", "saved_by": 3, "reads": "own"}]
    assert plans[2]["per_process"] == [{"path": "data", "saved_by": 3, "reads": "all"}]
    assert plans[1]["per_process"] == [{"path": "data", "saved_by": 3, "reads": "all"}]
    read = {n: [p["bytes_read"] for p in plans[n]["processes"]] for n in plans}
    assert read[3][0] < read[3][1] < read[3][2], read  # each its own value: process p's window holds p + 1 rows
    assert read[2][0] == read[2][1] > read[3][2], read  # each every saved value
    assert plans[2]["array_bytes"] > plans[3]["array_bytes"], plans
    assert main(["--plain", "plan", path, "--mesh", "2", "--processes", "2"]) == 0
    text = capsys.readouterr().out
    assert "per-process value 'data': saved by 3 processes, each process reads all 3 saved values" in text, text
