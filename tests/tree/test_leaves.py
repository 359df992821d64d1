"""Leaf classification (`_leaves`): typed PRNG keys, and the leaves cairn refuses, by key path."""

from __future__ import annotations

import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from cairn._format import manifest as fmt

IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]


def _data(keys):
    return np.asarray(jax.random.key_data(keys))


def _like(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


@pytest.mark.parametrize("impl", IMPLS)
def test_typed_keys_roundtrip_as_keys_with_their_impl_and_sharding(tmp_path, mesh42, impl):
    sharding = NamedSharding(mesh42, P("x", "y"))
    keys = jax.device_put(jax.random.split(jax.random.key(7, impl=impl), (8, 4)), sharding)
    state = {"keys": keys, "one": jax.random.key(3, impl=impl), "raw": jax.random.PRNGKey(5)}
    cairn.save(tmp_path / "ck", state)

    back = cairn.load(tmp_path / "ck", _like(state))
    for name in ("keys", "one"):
        k = back[name]
        assert jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key), name
        assert str(jax.random.key_impl(k)) == impl
        assert k.shape == state[name].shape and k.sharding == state[name].sharding
        assert _data(k).tobytes() == _data(state[name]).tobytes()
    # The restored keys draw the same numbers as the saved ones.
    assert np.asarray(jax.random.bits(back["one"], (4,))).tobytes() == np.asarray(
        jax.random.bits(state["one"], (4,))).tobytes()
    # Raw uint32 keys stay plain uint32 arrays.
    assert back["raw"].dtype == jnp.uint32 and np.array_equal(back["raw"], state["raw"])
    # The saved state itself (concrete keys) works as a target too.
    again = cairn.load(tmp_path / "ck", state)
    assert again["keys"].dtype == keys.dtype and _data(again["keys"]).tobytes() == _data(keys).tobytes()

    index = cairn.metadata(tmp_path / "ck")
    m = index["keys"]
    assert (m.kind, m.impl, m.shape, m.dtype) == ("prng_key", impl, (8, 4), keys.dtype)
    assert m.nbytes == _data(keys).nbytes and m.sharding["spec"] == ["x", "y", None]
    assert index["raw"].kind == "array" and index["raw"].dtype == np.uint32


def test_keys_without_a_target_load_as_their_uint32_key_data(tmp_path):
    keys = jax.random.split(jax.random.key(1, impl="rbg"), 3)
    cairn.save(tmp_path / "ck", {"k": keys})
    got = cairn.load(tmp_path / "ck")["k"]
    assert isinstance(got, np.ndarray) and got.dtype == np.uint32 and got.shape == (3, 4)
    assert got.tobytes() == _data(keys).tobytes()
    # A metadata target also loads numpy: the key data.
    meta = cairn.metadata(tmp_path / "ck")
    assert cairn.load(tmp_path / "ck", meta)["k"].tobytes() == got.tobytes()
    # A uint32 target of the data's shape gets the data as a jax.Array.
    raw = cairn.load(tmp_path / "ck", {"k": jax.ShapeDtypeStruct((3, 4), jnp.uint32)})["k"]
    assert isinstance(raw, jax.Array) and raw.dtype == jnp.uint32 and np.array_equal(raw, got)


@pytest.mark.parametrize("read_once", [False, True])
def test_keys_reshard_onto_another_mesh_and_from_eval_shape(tmp_path, mesh42, mesh8, read_once):
    keys = jax.device_put(jax.random.split(jax.random.key(11), (8, 2)), NamedSharding(mesh42, P("x", "y")))
    cairn.save(tmp_path / "ck", {"rng": keys})
    target = {"rng": jax.ShapeDtypeStruct((8, 2), keys.dtype, sharding=NamedSharding(mesh8, P()))}
    back = cairn.load(tmp_path / "ck", target, read_once=read_once)["rng"]
    assert back.sharding.is_equivalent_to(target["rng"].sharding, 2) and back.dtype == keys.dtype
    assert _data(back).tobytes() == _data(keys).tobytes()
    # A target from jax.eval_shape has no sharding: one device.
    abstract = jax.eval_shape(lambda: {"rng": jax.random.split(jax.random.key(0), (8, 2))})
    back = cairn.load(tmp_path / "ck", abstract)["rng"]
    assert len(back.sharding.device_set) == 1 and _data(back).tobytes() == _data(keys).tobytes()
    # So does a bare sharding.
    back = cairn.load(tmp_path / "ck", {"rng": NamedSharding(mesh8, P("x"))})["rng"]
    # JAX spells a key array's sharding its own way (here P("x", None)); it is the same layout.
    assert back.dtype == keys.dtype and back.sharding.is_equivalent_to(NamedSharding(mesh8, P("x")), 2)
    assert _data(back).tobytes() == _data(keys).tobytes()


def test_a_key_per_device_sharded_across_all_devices(tmp_path, mesh8):
    # One key per device (per host in a multi-host job): split, then shard along the mesh.
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(mesh8, P("x")))
    cairn.save(tmp_path / "ck", {"rng": keys})
    back = cairn.load(tmp_path / "ck", _like({"rng": keys}))["rng"]
    for a, b in zip(back.addressable_shards, keys.addressable_shards):
        assert a.device == b.device and a.index == b.index
        assert _data(a.data).tobytes() == _data(b.data).tobytes()


def test_key_targets_that_do_not_fit_are_mismatches(tmp_path):
    cairn.save(tmp_path / "ck", {"rng": jax.random.split(jax.random.key(0), 4)})
    bad_shape = {"rng": jax.ShapeDtypeStruct((5,), jax.random.key(0).dtype)}
    with pytest.raises(cairn.MismatchError, match=r"'rng'.*shape \(4,\).*\(5,\)"):
        cairn.load(tmp_path / "ck", bad_shape)
    bad_impl = {"rng": jax.ShapeDtypeStruct((4,), jax.random.key(0, impl="rbg").dtype)}
    with pytest.raises(cairn.MismatchError, match=r"'rng'.*threefry2x32.*rbg"):
        cairn.load(tmp_path / "ck", bad_impl)


def test_async_save_of_keys_survives_deleting_them(tmp_path):
    keys = jax.random.split(jax.random.key(2), 16)
    want = _data(keys).tobytes()
    f = cairn.save_async(tmp_path / "ck", {"rng": keys})
    keys.delete()
    f.result(timeout=60)
    assert cairn.load(tmp_path / "ck")["rng"].tobytes() == want


def test_keys_survive_a_safetensors_round_trip(tmp_path):
    keys = jax.random.split(jax.random.key(4, impl="unsafe_rbg"), 2)
    cairn.save(tmp_path / "ck", {"rng": keys})
    from cairn._exports.safetensors import from_safetensors, to_safetensors

    to_safetensors(tmp_path / "ck", tmp_path / "m.safetensors")
    from_safetensors(tmp_path / "m.safetensors", tmp_path / "back")
    back = cairn.load(tmp_path / "back", _like({"rng": keys}))["rng"]
    assert str(jax.random.key_impl(back)) == "unsafe_rbg" and _data(back).tobytes() == _data(keys).tobytes()


def test_the_index_records_kind_impl_and_impl_shape(tmp_path):
    cairn.save(tmp_path / "ck", jax.random.split(jax.random.key(0), (2, 3)))
    (name,) = [n for n in (tmp_path / "ck" / "%root").iterdir() if n.name.startswith("index.") and n.suffix == ".json"]
    (leaf,) = json.loads(name.read_bytes())["leaves"]
    assert (leaf["kind"], leaf["dtype"], leaf["shape"]) == ("prng_key", "uint32", [2, 3, 2])
    assert (leaf["impl"], leaf["impl_shape"]) == ("threefry2x32", [2])


# ---------------------------------------------------------------------- leaves cairn cannot save


class _Opaque:
    pass


ODD_LEAVES = {
    "object": (object(), "builtins.object"),
    "instance": (_Opaque(), "_Opaque"),
    "set": ({1, 2}, "builtins.set"),
    "generator": ((i for i in range(2)), "generator"),
    "counter": (itertools.count(), "itertools.count"),
    "slice": (slice(1, 2), "slice"),
    "ellipsis": (..., "ellipsis"),
    "module": (np, "module"),
    "dtype": (np.dtype("float32"), "Float32DType"),
    "datetime": (np.datetime64("2020-01-01"), "datetime64"),
    "strings": (np.array(["a"]), "dtype <U1"),
    "objects": (np.array([None, 1]), "dtype object"),
    "float0": (np.zeros(2, dtype=jax.dtypes.float0), "float0"),
    "abstract": (jax.ShapeDtypeStruct((2,), jnp.float32), "ShapeDtypeStruct"),
    "lambda": (lambda x: x, "function"),
    "relu": (jax.nn.relu, "relu"),
    "jitted": (jnp.tanh, "tanh"),
    "partial": (functools.partial(print, 1), "functools.partial"),
    "class": (int, "class builtins.int"),
}


@pytest.mark.filterwarnings("ignore:Python iterable type 'generator'")  # JAX's, for the generator
@pytest.mark.parametrize("name", sorted(ODD_LEAVES))
def test_unsavable_leaves_raise_unsupported_type_naming_the_key_path(tmp_path, name):
    value, what = ODD_LEAVES[name]
    with pytest.raises(cairn.UnsupportedTypeError) as info:
        cairn.save(tmp_path / "ck", {"model": {"layer": [np.zeros(2), value]}})
    msg = str(info.value)
    assert str(tmp_path / "ck") in msg and "'model/layer/1'" in msg and what in msg, msg
    assert not (tmp_path / "ck").exists()


def test_dict_keys_that_are_not_str_or_int_name_their_place(tmp_path):
    with pytest.raises(cairn.UnsupportedTypeError, match=r"dict key \(1, 2\) at 'model/layer'"):
        cairn.save(tmp_path / "ck", {"model": {"layer": {(1, 2): np.zeros(2)}}})


def test_callables_point_to_the_partition_pattern(tmp_path):
    with pytest.raises(cairn.UnsupportedTypeError, match=r"'act'.*relu.*eqx\.partition\(model, eqx\.is_array\).*eqx\.combine"):
        cairn.save(tmp_path / "ck", {"w": np.ones(2), "act": jax.nn.relu})


def test_a_save_inside_jit_names_the_traced_leaf(tmp_path):
    errors = []

    def step(x):
        try:
            cairn.save(tmp_path / "ck", {"x": x})
        except cairn.CheckpointError as e:
            errors.append(e)
        return x

    jax.jit(step)(jnp.ones(2))
    (e,) = errors
    assert isinstance(e, cairn.UnsupportedTypeError) and "'x'" in str(e) and "traced" in str(e)


def test_unknown_leaf_kinds_are_refused_cleanly():
    # What a reader without prng_key support does with one: a CorruptCheckpointError, not a crash.
    doc = fmt.ItemIndex({"leaf": 0}, (fmt.ValueLeaf("", "int", 1),), ()).to_json()
    d = json.loads(doc)
    d.pop("crc32c")
    d["leaves"][0]["kind"] = "prng_key_v2"
    with pytest.raises(cairn.CorruptCheckpointError, match="unknown leaf kind 'prng_key_v2'"):
        fmt.ItemIndex.from_json(fmt.dump_checked_json(d), "idx")
