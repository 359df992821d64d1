"""cairn.load(path, mesh=...): restoring onto the saved shardings given only a mesh.

Each array saved with a NamedSharding comes back with its saved PartitionSpec
over the mesh given (same axis names, any sizes); checkpoints written by cairn
and by orbax-checkpoint itself (its ``_sharding`` file), through `cairn.load`,
`CheckpointManager.restore` and `cairn.plan_load`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn


def saved_state():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    return {
        "w": jax.device_put(rng.standard_normal((8, 16)).astype(np.float32), NamedSharding(mesh, P("data", "model"))),
        "emb": jax.device_put(rng.standard_normal((16, 4)).astype(np.float32), NamedSharding(mesh, P(("data", "model")))),
        "bias": jax.device_put(np.arange(4, dtype=np.int32), NamedSharding(mesh, P())),
        "one": jax.device_put(np.arange(3.0, dtype=np.float32), jax.devices()[5]),
        "host": np.arange(6, dtype=np.int64),
        "keys": jax.random.split(jax.random.key(1), 8),
        "data": cairn.PerProcess({"pos": np.arange(2)}),
        "step": 7,
    }


@pytest.fixture
def ckpt(tmp_path):
    state = saved_state()
    cairn.save(tmp_path / "c", state)
    return tmp_path / "c", state


def test_without_a_target_each_array_takes_its_saved_spec_on_the_mesh(ckpt):
    path, state = ckpt
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # the same axis names, other sizes
    got = cairn.load(path, mesh=mesh)
    for name, spec in (("w", P("data", "model")), ("emb", P(("data", "model"))), ("bias", P())):
        assert isinstance(got[name], jax.Array) and got[name].sharding == NamedSharding(mesh, spec), name
        assert np.asarray(got[name]).tobytes() == np.asarray(state[name]).tobytes(), name
    # A jax.Array saved on one device: replicated on the mesh; numpy and per-process values stay numpy.
    assert got["one"].sharding == NamedSharding(mesh, P()) and np.array_equal(got["one"], state["one"])
    assert type(got["host"]) is np.ndarray and np.array_equal(got["host"], state["host"])
    assert type(got["data"]["pos"]) is np.ndarray and got["step"] == 7
    assert jnp.issubdtype(got["keys"].dtype, jax.dtypes.prng_key)  # typed keys come back as keys
    assert np.array_equal(jax.random.key_data(got["keys"]), jax.random.key_data(state["keys"]))
    assert got["keys"].sharding.mesh.shape == mesh.shape


def test_a_target_s_own_sharding_wins_and_leaves_without_one_take_the_saved_spec(ckpt):
    path, state = ckpt
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices())
    mesh2 = jax.make_mesh((2, 4), ("data", "model"))
    info = cairn.metadata(path)
    target = {"w": jax.ShapeDtypeStruct((8, 16), jnp.bfloat16),  # no sharding: the saved one; its dtype: a cast
              "emb": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(mesh, P("data"))),
              "bias": info["bias"], "one": None}
    got = cairn.load(path, target, mesh=mesh2, partial=True)
    assert got["w"].sharding == NamedSharding(mesh2, P("data", "model")) and got["w"].dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(got["w"]), np.asarray(state["w"]).astype(jnp.bfloat16))
    assert got["emb"].sharding == NamedSharding(mesh, P("data"))
    assert got["bias"].sharding == NamedSharding(mesh2, P()) and got["one"].sharding == NamedSharding(mesh2, P())
    # Without mesh=, the same target keeps today's meaning: ArrayMetadata and None load numpy.
    plain = cairn.load(path, target, partial=True)
    assert type(plain["bias"]) is np.ndarray and type(plain["one"]) is np.ndarray


def test_a_mesh_without_the_saved_axes_or_sizes_that_do_not_divide_are_named(ckpt):
    path, _ = ckpt
    with pytest.raises(cairn.MismatchError) as e:
        cairn.load(path, mesh=jax.make_mesh((8,), ("fsdp",)))
    msg = str(e.value)
    assert msg.startswith(f"{path}: leaf ") and "was saved with PartitionSpec" in msg, msg
    assert "{'data': 4, 'model': 2}" in msg and "{'fsdp': 8}" in msg and "without 'data', 'model'" in msg, msg
    assert "Pass a mesh with those axis names (of any sizes), or a target with a sharding" in msg, msg
    three = jax.make_mesh((1, 3), ("data", "model"), devices=jax.devices()[:3])
    with pytest.raises(cairn.MismatchError, match=r"leaf 'w': its saved PartitionSpec on the mesh given does not "
                       r"fit the checkpoint's array: .* splits dimension 1 \(size 16, shape \(8, 16\)\) 3 ways"):
        cairn.load(path, {"w": None}, mesh=three, partial=True)
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh, got tuple"):
        cairn.load(path, mesh=(2, 4))


def test_the_manager_and_the_plan_take_the_mesh_too(tmp_path):
    state = saved_state()
    with cairn.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(5, state)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with cairn.CheckpointManager(tmp_path / "run") as mgr:
        got = mgr.restore(mesh=mesh)
    assert got["w"].sharding == NamedSharding(mesh, P("data", "model"))
    assert np.asarray(got["w"]).tobytes() == np.asarray(state["w"]).tobytes()
    plan = cairn.plan_load(tmp_path / "run" / "step_00000005", mesh=mesh, processes=2)
    assert [p.devices for p in plan.processes] == [4, 4]
    # The plan routes the arrays as sharded ones (without the mesh they load as numpy: no routes, no devices).
    assert {"w", "emb", "bias", "one"} <= {r.path for r in plan.routes}
    whole = cairn.plan_load(tmp_path / "run" / "step_00000005", processes=2)
    assert whole.routes == () and [p.devices for p in whole.processes] == [0, 0]


def test_an_orbax_checkpoint_restores_onto_its_saved_shardings(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    pytest.importorskip("tensorstore")
    state = saved_state()
    tree = {"params": {"w": state["w"], "emb": state["emb"]}, "one": state["one"], "step": 3}
    with ocp.CheckpointManager(str(tmp_path / "orbax")) as mgr:
        mgr.save(3, args=ocp.args.StandardSave(tree))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    got = cairn.load(tmp_path / "orbax" / "3" / "default", mesh=mesh)
    assert got["params"]["w"].sharding == NamedSharding(mesh, P("data", "model"))
    assert got["params"]["emb"].sharding == NamedSharding(mesh, P(("data", "model")))
    assert got["one"].sharding == NamedSharding(mesh, P()) and got["step"] == 3
    assert np.asarray(got["params"]["w"]).tobytes() == np.asarray(state["w"]).tobytes()
    with cairn.CheckpointManager(tmp_path / "orbax") as mgr:  # the Orbax run, restored by cairn's manager
        restored = mgr.restore(mesh=mesh)
    assert restored["params"]["emb"].sharding == NamedSharding(mesh, P(("data", "model")))
    with pytest.raises(cairn.MismatchError, match=r"orbax/3/default: leaf 'params/(w|emb)' was saved with "
                       r"PartitionSpec .* on a mesh with axes \{'data': 4, 'model': 2\}; the mesh given has axes "
                       r"\{'x': 8\}"):
        cairn.load(tmp_path / "orbax" / "3" / "default", mesh=jax.make_mesh((8,), ("x",)))
