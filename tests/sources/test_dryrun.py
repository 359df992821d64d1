"""The dry run of a load (cairn.plan_load, `cairn plan`): its figures are the real load's, and it reads no data."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from cairn._cli import main as _cli
from cairn._load import engine as _load
from cairn._load.reader import LoadStats
from cairn._load.source import CairnSource
from cairn._storage.location import resolve

SHAPE = (2048, 1024)  # 8 MiB of float32: several chunks, reads of whole and partial chunks


@pytest.fixture
def ckpt(tmp_path, mesh8, mesh42):
    state = {
        "params": {
            "w": jax.device_put(jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE),
                                NamedSharding(mesh8, P("x"))),
            "v": jax.device_put(jnp.ones((1024, 512), jnp.bfloat16), NamedSharding(mesh42, P("x", "y"))),
            "many": [np.full(100 + i, i, np.float32) for i in range(40)],  # coalesced into one read
            "b": jax.device_put(jnp.ones(64, jnp.float32), NamedSharding(mesh8, P("x"))),
        },
        "blob": b"x" * 3000,
        "step": 3,
    }
    cairn.save(tmp_path / "ck", state)
    return tmp_path / "ck"


def target(w, v, dtype=jnp.float32):
    return {"params": {"w": jax.ShapeDtypeStruct(SHAPE, dtype, sharding=w),
                       "v": jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=v),  # a cast from bfloat16
                       "many": [None] * 40,
                       "b": jax.ShapeDtypeStruct((64,), jnp.float32, sharding=NamedSharding(w.mesh, P()))},
            "blob": None, "step": None}


def real_load(path, t, **kw):
    stats = LoadStats()
    _load.load(CairnSource.open(resolve(path)), t, stats=stats, **kw)
    return stats


@pytest.mark.parametrize("case", ["same", "columns", "mesh42", "numpy"])
@pytest.mark.parametrize("budget", [1 << 30, 1 << 20])
def test_plan_matches_a_real_load(ckpt, mesh8, mesh42, case, budget):
    t = {
        "same": lambda: target(NamedSharding(mesh8, P("x")), NamedSharding(mesh42, P("x", "y"))),
        "columns": lambda: target(NamedSharding(mesh8, P(None, "x")), NamedSharding(mesh8, P("x"))),  # resharding
        "mesh42": lambda: target(NamedSharding(mesh42, P("y", "x")), NamedSharding(mesh42, P(None, ("x", "y")))),
        "numpy": lambda: None,
    }[case]()
    stats = real_load(ckpt, t, budget_bytes=budget)
    plan = cairn.plan_load(ckpt, t, budget_bytes=budget, bandwidths={"storage_gbps": 2.0})
    (p,) = plan.processes
    assert (p.bytes_read, p.requests) == (stats.bytes_read, stats.reads)
    assert stats.bytes_read >= plan.array_bytes == 4 * np.prod(SHAPE) + 2 * 1024 * 512 + 64 * 4 + sum(
        4 * (100 + i) for i in range(40)) + 3000
    assert plan.leaves == 45 and plan.read_once_leaves == 0  # one process: nothing to read once
    assert plan.seconds == pytest.approx(p.bytes_read / 2e9)
    # At least the buffers of the largest leaf; a smaller budget never holds more.
    assert p.peak_host_bytes >= 4 * np.prod(SHAPE)  # one process holds all of w
    if budget == 1 << 20:
        assert p.peak_host_bytes <= cairn.plan_load(ckpt, t).processes[0].peak_host_bytes
    text = str(plan)
    assert "does not model" in text and "request latency" in text and "peak host" in text


def test_one_spelling_of_the_storage_bandwidth(ckpt, mesh8, mesh42):
    """`bandwidths={"storage_gbps": x}` (load's keyword) prices the routes and gives the time estimate;
    the old `bandwidth=x` means the same, with a DeprecationWarning, for one release."""
    t = target(NamedSharding(mesh8, P(None, "x")), NamedSharding(mesh42, P()))
    new = cairn.plan_load(ckpt, t, processes=2, bandwidths={"storage_gbps": 3.0})
    assert new.bandwidth == 3.0 and new.route_bandwidths["storage_gbps"] == 3.0
    assert new.seconds == pytest.approx(max(p.bytes_read for p in new.processes) / 3e9)
    with pytest.warns(DeprecationWarning, match=r"bandwidths=\{'storage_gbps': x\}"):
        old = cairn.plan_load(ckpt, t, processes=2, bandwidth=3.0)
    assert old == new
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="disagree"):
        cairn.plan_load(ckpt, t, bandwidth=3.0, bandwidths={"storage_gbps": 1.0})
    assert cairn.plan_load(ckpt, t, processes=2).seconds is None  # no storage bandwidth declared


def test_no_data_file_is_opened(ckpt, mesh8, mesh42, capsys):
    t = target(NamedSharding(mesh8, P(None, "x")), NamedSharding(mesh42, P()))
    before = cairn.plan_load(ckpt, t, processes=2)
    data = [os.path.join(d, n) for d, _, ns in os.walk(ckpt) for n in ns if n.endswith(".bin")]
    assert data
    for f in data:
        os.remove(f)
    with pytest.raises(cairn.CorruptCheckpointError, match="is missing"):
        cairn.load(ckpt, t)
    after = cairn.plan_load(ckpt, t, processes=2)
    assert after == before and after.bytes_read > 0
    assert _cli.main(["plan", str(ckpt), "--mesh", "8", "--processes", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_read"] > 0


OBJECT_STORE = {"storage_gbps": 2.0, "interconnect_gbps": 100.0, "request_ms": 2.0}


def test_simulated_processes_follow_the_read_once_routes(tmp_path, mesh8):
    w = jax.device_put(jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE), NamedSharding(mesh8, P("x")))
    cairn.save(tmp_path / "ck", {"w": w})
    nbytes = w.nbytes
    repl = {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=NamedSharding(mesh8, P()))}
    # Replicated over 4 processes, storage slower than the interconnect: read once and all-gathered,
    # each process a quarter.
    plan = cairn.plan_load(tmp_path / "ck", repl, processes=4, bandwidths=OBJECT_STORE)
    assert plan.read_once_leaves == 1 and plan.waves == 1
    assert [(r.kind, r.by) for r in plan.routes] == [("refined", "seconds")]
    # On the CPU defaults (collectives over gloo, slower than a local disk), read directly.
    cpu = cairn.plan_load(tmp_path / "ck", repl, processes=4)
    assert cpu.read_once_leaves == 0 and [(r.kind, r.by) for r in cpu.routes] == [("direct", "seconds")]
    alts = {a.kind: a for a in cpu.routes[0].alternatives}
    assert alts["direct"].seconds < alts["refined"].seconds and alts["refined"].interconnect_bytes > 0
    assert [p.devices for p in plan.processes] == [2, 2, 2, 2]
    assert plan.bytes_read <= 1.1 * nbytes and all(p.bytes_read <= 0.3 * nbytes for p in plan.processes)
    # Without read-once, every process reads the whole array.
    direct = cairn.plan_load(tmp_path / "ck", repl, processes=4, read_once=False)
    assert direct.read_once_leaves == 0 and all(p.bytes_read >= nbytes for p in direct.processes)
    # The same sharding as saved: each process its own eighth(s), directly.
    same = cairn.plan_load(tmp_path / "ck", {"w": w.sharding}, processes=4)
    assert same.read_once_leaves == 0 and [p.bytes_read for p in same.processes] == [nbytes // 4] * 4
    # Whole, a process holds its quarter of the reads on host; the replicated result is on its devices.
    assert all(nbytes // 4 <= p.peak_host_bytes < nbytes for p in plan.processes)
    # A budget below the leaf: restored in pieces, one wave each, gathered into host buffers of the
    # process's target shards (the whole array, replicated), which the plan counts.
    small = cairn.plan_load(tmp_path / "ck", repl, processes=4, budget_bytes=1 << 20, bandwidths=OBJECT_STORE)
    assert small.waves > 1 and small.bytes_read <= 1.2 * nbytes
    assert all(nbytes <= p.peak_host_bytes <= nbytes + (2 << 20) for p in small.processes)
    with pytest.raises(ValueError, match="cannot be split into 3 processes"):
        cairn.plan_load(tmp_path / "ck", repl, processes=3)


def test_cli_plan(ckpt, capsys):
    assert _cli.main(["plan", str(ckpt), "--mesh", "data=4,model=2", "--sharding", "fsdp", "--processes", "2",
                      "--bandwidth", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [p["devices"] for p in got["processes"]] == [4, 4]
    assert got["seconds"] == pytest.approx(max(p["bytes_read"] for p in got["processes"]) / 4e9)
    assert got["bytes_read"] == sum(p["bytes_read"] for p in got["processes"]) >= got["array_bytes"] - 3000 - 2 * 3000
    assert any("virtual CPU devices" in n for n in got["notes"]) and got["not_modelled"]
    # every array but the odd-sized ones is sharded: 'many' (100..139 elements) and 'b' do not divide by 8
    assert any("replicated, the sharding does not fit" in n for n in got["notes"])
    assert _cli.main(["--plain", "plan", str(ckpt), "--mesh", "8", "--sharding", "P(None, 'data')"]) == 0
    text = capsys.readouterr().out
    assert "process" in text and "bytes read" in text and "does not model" in text
    # Host work priced as declared (0 leaves it out), shown with the other figures.
    assert _cli.main(["plan", str(ckpt), "--mesh", "8", "--sharding", "P(None, 'data')", "--processes", "2",
                      "--host-gbps", "0", "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert priced["route_bandwidths"]["host_gbps"] == 0.0 and priced["routes"]
    assert all(a["host_bytes"] >= a["storage_bytes"] for r in priced["routes"] for a in r["alternatives"])
    assert _cli.main(["--plain", "plan", str(ckpt), "--mesh", "8", "--sharding", "P(None, 'data')",
                      "--processes", "2"]) == 0
    assert "host 4 GB/s per process" in capsys.readouterr().out
    assert _cli.main(["plan", str(ckpt), "--mesh", "8", "--sharding", "model"]) == 1
    assert "not axes of the mesh" in capsys.readouterr().err
    assert _cli.main(["plan", str(ckpt), "--mesh", "data:8"]) == 1
    assert "--mesh" in capsys.readouterr().err


def test_plan_with_transforms_and_foreign_sources(tmp_path, mesh8):
    st = pytest.importorskip("safetensors.numpy")
    tensors = {"enc.w": np.ones((64, 32), np.float32), "opt.mu": np.ones(4096, np.float32)}
    st.save_file(tensors, str(tmp_path / "m.safetensors"))
    t = {"encoder": {"w": NamedSharding(mesh8, P("x"))}, "new": np.zeros(3)}
    kw = dict(rename=[(r"^enc/", "encoder/")], drop="^opt/", fill_missing=["^new$"])
    stats = LoadStats()
    from cairn._sources import registry as _sources

    _load.load(_sources.open_source(resolve(tmp_path / "m.safetensors"), t, **kw), t, stats=stats)
    plan = cairn.plan_load(tmp_path / "m.safetensors", t, **kw)
    assert plan.format == "safetensors" and plan.processes[0].bytes_read == stats.bytes_read == 64 * 32 * 4
    assert plan.processes[0].requests == stats.reads


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("load_spec", [[["x", "y"]], [], [None, ["x", "y"]]])
def test_plan_from_one_process_matches_each_process_of_a_real_load(tmp_path, load_spec):
    """Two real processes save and load; one plan here gives each one's bytes."""
    from _mp import run

    out = run(2, "save_then_load", {"path": str(tmp_path / "ck"), "mesh": [2, 2], "save_spec": [["x", "y"]],
                                    "load_spec": load_spec, "shape": [1024, 1024]}, devices_per_process=2)
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)[:4]).reshape(2, 2), ("x", "y"))
    spec = P(*[tuple(e) if isinstance(e, list) else e for e in load_spec])
    t = {"a": jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, spec))}
    plan = cairn.plan_load(tmp_path / "ck", t, processes=2)
    assert [p.bytes_read for p in plan.processes] == [r["bytes_read"] for r in out]
    assert plan.read_once_leaves == out[0]["read_once_leaves"]


def test_cli_plan_onto_the_saved_shardings(tmp_path, capsys):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    w = jax.device_put(np.zeros((1024, 512), np.float32), NamedSharding(mesh, P("data", "model")))  # 2 MiB
    cairn.save(tmp_path / "ck", {"params": {"w": w, "host": np.arange(4)}})
    assert _cli.main(["plan", str(tmp_path / "ck"), "--mesh", "data=2,model=4", "--sharding", "saved",
                      "--processes", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    # w is planned as a sharded array on the mesh's 2 x 4 devices (the host array as numpy: no route).
    assert [p["devices"] for p in got["processes"]] == [4, 4]
    assert all(p["bytes_read"] >= w.nbytes // 2 for p in got["processes"]), got["processes"]
    assert [(r["path"], r["shape"]) for r in got["routes"]] == [("params/w", [1024, 512])]
    assert _cli.main(["plan", str(tmp_path / "ck"), "--mesh", "x=8", "--sharding", "saved"]) == 1
    err = capsys.readouterr().err
    assert "leaf 'params/w' was saved with PartitionSpec" in err and "without 'data', 'model'" in err, err
