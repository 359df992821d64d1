"""Read-once restore across real processes: each byte leaves storage once.

Every case saves one float32 array on a 2- or 4-process cluster and loads it
onto another sharding. The bytes each process read (LoadStats, and rchar from
/proc/self/io, which counts every byte a read() returned, index included) are
summed over processes and compared with the array's bytes; every shard is
checked against the expected values.
"""

from __future__ import annotations

import os

import pytest

from _mp import run

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SHAPE = [1024, 1024]  # 4 MiB of float32
# Storage slower than the interconnect (an object store next to an accelerator interconnect): routes
# priced in seconds choose read-once where it reads fewer bytes. The CPU defaults (gloo) would not.
OBJECT_STORE = {"storage_gbps": 2.0, "interconnect_gbps": 100.0, "request_ms": 2.0}


def _load(tmp_path, n, mesh, save_spec, load_spec, devices=2, shape=SHAPE, **kw):
    kw.setdefault("bandwidths", OBJECT_STORE)
    out = run(n, "save_then_load", {"path": str(tmp_path / "ck"), "mesh": mesh, "save_spec": save_spec,
                                    "load_spec": load_spec, "shape": shape, **kw},
              devices_per_process=devices)
    nbytes = out[0]["nbytes"]
    return out, sum(r["bytes_read"] for r in out) / nbytes, sum(r["rchar"] for r in out) / nbytes


def test_replicas_read_each_byte_once(tmp_path):
    # Every process holds a full replica: the direct path reads the array twice.
    out, ratio, rchar = _load(tmp_path, 2, [2, 2], [["x", "y"]], [])
    assert ratio <= 1.1 and rchar <= 1.1, (ratio, rchar, out)
    assert all(r["read_once_leaves"] == 1 for r in out)


def test_replicas_without_read_once_read_twice(tmp_path):
    out, ratio, _ = _load(tmp_path, 2, [2, 2], [["x", "y"]], [], read_once=False)
    assert ratio >= 1.9, out
    assert all(r["read_once_leaves"] == 0 for r in out)


def test_rows_saved_columns_loaded(tmp_path):
    out, ratio, rchar = _load(tmp_path, 2, [2, 2], [["x", "y"]], [None, ["x", "y"]])
    assert ratio <= 1.1 and rchar <= 1.1, (ratio, rchar, out)


def test_2x2_mesh_reshard_across_4_processes(tmp_path):
    out, ratio, rchar = _load(tmp_path, 4, [2, 2], ["x", "y"], ["y", "x"], devices=1)
    assert ratio <= 1.1 and rchar <= 1.1, (ratio, rchar, out)


def test_same_sharding_reads_directly(tmp_path):
    out, ratio, rchar = _load(tmp_path, 2, [2, 2], ["x", "y"], ["x", "y"])
    assert ratio == 1.0 and rchar <= 1.1, (ratio, rchar, out)
    assert all(r["read_once_leaves"] == 0 for r in out)


def test_replicated_fsdp_to_tp_on_4_processes(tmp_path):
    # Saved row-sharded over 4 processes; loaded onto a tp axis within each process,
    # replicated over the data axis: the direct path would read the array twice.
    out, ratio, rchar = _load(tmp_path, 4, [2, 4], [["x", "y"]], [None, "y"], devices=2)
    assert ratio <= 1.1 and rchar <= 1.1, (ratio, rchar, out)


def test_a_corrupt_chunk_fails_every_process_naming_the_reader(tmp_path):
    out = run(2, "save_then_load", {"path": str(tmp_path / "ck"), "mesh": [2, 2], "save_spec": [["x", "y"]],
                                    "load_spec": [], "shape": SHAPE, "corrupt": True, "bandwidths": OBJECT_STORE})
    for me, r in enumerate(out):
        assert r.get("error") == "CorruptCheckpointError", r
        assert "checksum mismatch" in r["message"], r
        if me == 0:  # it read nothing bad itself: it names the process that did
            assert "process 1" in r["message"], r


def test_a_replicated_array_is_written_by_all_its_holders(tmp_path):
    # 16 MiB on every device of 2 processes: each process writes half, each byte once,
    # and the replicated load reads each byte once too.
    out = run(2, "save_replicated", {"path": str(tmp_path / "ck"), "mesh": [2, 2], "mb": 16,
                                     "bandwidths": OBJECT_STORE})
    nbytes = out[0]["nbytes"]
    assert sum(r["bytes_written"] for r in out) == nbytes
    assert all(r["bytes_written"] == nbytes // 2 for r in out), out
    assert sum(r["bytes_read"] for r in out) <= 1.1 * nbytes, out


@pytest.mark.parametrize("load_spec", [[], [None, ["x", "y"]]], ids=["replicas", "rows-to-columns"])
def test_a_leaf_larger_than_the_budget_is_restored_in_pieces(tmp_path, load_spec):
    # 16 MiB saved in 4 row chunks (4 MiB each, 1 MiB checksum blocks), 4 MiB budget: the
    # leaf goes in pieces, one wave each, and still reads each byte once (pieces stay whole
    # checksum blocks per device).
    out, ratio, rchar = _load(tmp_path, 2, [2, 2], [["x", "y"]], load_spec, budget=4 << 20, shape=[4096, 1024])
    assert ratio <= 1.1 and rchar <= 1.1, (ratio, rchar, out)
    assert all(r["pieces"] >= 2 and r["read_once_leaves"] == 1 for r in out), out


def test_pieces_never_cost_extra_storage_reads(tmp_path):
    # 4 MiB in 1 MiB chunks with a 1 MiB budget: pieces that thin would read each checksum
    # block several times, so the leaf is not cut and reads each byte once.
    out, ratio, _ = _load(tmp_path, 2, [2, 2], [["x", "y"]], [], budget=1 << 20)
    assert ratio <= 1.1, (ratio, out)


def test_routes_are_priced_and_agreed_on_every_process(tmp_path):
    # Three leaves, three routes under an object store's figures; all direct on the CPU defaults (gloo
    # slower than a local disk); forced either way by read_once. Every process takes the same route
    # for every leaf, and read-once leaves read each byte once.
    options = {"object store": {"bandwidths": OBJECT_STORE}, "cpu defaults": {},
               "forced on": {"read_once": True}, "forced off": {"read_once": False},
               "measured": {"bandwidths": {"interconnect_gbps": "measure"}}}
    out = run(2, "route_choices", {"path": str(tmp_path / "ck"), "options": options}, devices_per_process=2)
    nbytes = out[0]["nbytes"]
    for name in options:
        assert out[0][name]["leaf_routes"] == out[1][name]["leaf_routes"], (name, out)
        assert out[0][name]["bandwidths"] == out[1][name]["bandwidths"], (name, out)
    routes = {name: out[0][name]["leaf_routes"] for name in options}
    assert routes["object store"] == {"replicated": "refined", "columns": "staged", "same": "direct"}, routes
    assert routes["forced on"] == routes["object store"], routes
    assert set(routes["cpu defaults"].values()) == {"direct"} and set(routes["forced off"].values()) == {"direct"}
    assert out[0]["cpu defaults"]["bandwidths"]["source"] == "default: local storage, cpu interconnect"
    assert out[0]["forced off"]["bandwidths"] is None
    ro = out[0]["object store"]
    assert ro["read_once_leaves"] == 2 and ro["routes"] == {"refined": 1, "staged": 1, "direct": 1}
    # Read-once leaves: 1.00x storage reads cluster-wide; the collectives' share is predicted.
    assert sum(r["object store"]["read_once_bytes_read"] for r in out) == 2 * nbytes, out
    assert ro["interconnect_bytes"] > 0 and out[0]["cpu defaults"]["interconnect_bytes"] == 0
    # Measured: one figure (the primary's) on every process, whatever the routes it gives.
    measured = out[0]["measured"]["bandwidths"]
    assert measured["source"].startswith("interconnect measured") and measured["interconnect_gbps"] > 0, out
    # Direct everything: the replicated leaf is read by both processes, the columns reread whole chunks.
    assert sum(r["cpu defaults"]["bytes_read"] for r in out) > sum(r["object store"]["bytes_read"] for r in out)


def test_processes_that_choose_different_routes_fail_named_instead_of_hanging(tmp_path):
    # Process 0 prices an object store (both leaves read once); process 1 a storage as fast as its
    # interconnect (the replicated leaf direct, the columns read once): the first status exchange
    # finds the routes differ, and both fail before any collective.
    same_speed = {"storage_gbps": 1.0, "interconnect_gbps": 1.0, "request_ms": 0.0}
    out = run(2, "mismatched_routes", {"path": str(tmp_path / "ck"),
                                       "per_process": [{"bandwidths": OBJECT_STORE}, {"bandwidths": same_speed}]},
              devices_per_process=2)
    for r in out:
        assert r["error"] == "CheckpointError" and "different read routes" in r["message"], out
        assert "same read_once= and bandwidths=" in r["message"], out


def test_the_routes_benchmark_runs_cairn_and_orbax_on_the_same_processes(tmp_path):
    # benchmarks.probes.read_once --routes, small: one save by each library, every option loaded (and its
    # warm-up checked against the expected values in the scenario), rounds timed on every process.
    pytest.importorskip("orbax.checkpoint")
    options = {"default": {}, "read_once=True": {"read_once": True}, "orbax": {"system": "orbax"},
               "same: default": {"target": "saved"}, "same: orbax": {"system": "orbax", "target": "saved"}}
    out = run(2, "compare_routes", {"path": str(tmp_path / "ck"), "mesh": [2, 2], "save_spec": [["x", "y"]],
                                    "load_spec": [None, ["x", "y"]], "shape": [512, 256], "options": options,
                                    "reps": 1}, devices_per_process=2)
    for o in out:
        assert o["orbax_save_s"] > 0 and os.path.isdir(tmp_path / "ck-orbax")
        assert all(len(o["runs"][name]) == 1 and o["runs"][name][0]["load_s"] > 0 for name in options), o
        assert o["runs"]["default"][0]["leaf_routes"] == {"a": "direct"}  # the CPU defaults
        assert o["runs"]["read_once=True"][0]["leaf_routes"] == {"a": "staged"}
        assert o["runs"]["same: default"][0]["leaf_routes"] == {"a": "direct"}
        assert "leaf_routes" not in o["runs"]["orbax"][0]
