"""cairn.load of Orbax checkpoints written by orbax-checkpoint itself, read with tensorstore alone.

Variants: PyTree and Standard handlers, OCDBT with zarr3 or zarr2, compressed
or not, one folder per array (no OCDBT), and a CheckpointManager step folder
with a pytree item and a JSON item. Each is saved from arrays sharded on one
mesh and loaded onto another sharding, compared bitwise.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn

ocp = pytest.importorskip("orbax.checkpoint")
ts = pytest.importorskip("tensorstore")


def state(mesh):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    e = rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16)
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))),
            "emb": jax.device_put(e, NamedSharding(mesh, P(None, "y"))),
            "layers": [{"b": jnp.arange(8, dtype=jnp.int32)}, {"b": jnp.arange(8, 16, dtype=jnp.int32)}],
        },
        "host": np.arange(12, dtype=np.int64).reshape(3, 4),
        "step": 42,
    }


def numpy_of(tree):
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, (jax.Array, np.ndarray)) else x, tree)


def check(got, want):
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (got, want)
        for k in want:
            check(got[k], want[k])
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want):
            check(g, w)
    elif isinstance(want, np.ndarray):
        g = np.asarray(got)
        assert g.dtype == want.dtype and g.shape == want.shape and g.tobytes() == want.tobytes()
    else:
        assert got == want and type(got) is type(want), (got, want)


def other_target(mesh, want):
    def leaf(x):
        if not isinstance(x, np.ndarray):
            return None
        spec = P("y", "x") if x.ndim == 2 and x.shape[0] % 2 == 0 and x.shape[1] % 4 == 0 else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree.map(leaf, want, is_leaf=lambda x: x is None or isinstance(x, (int, float, str)))


def save_pytree(path, tree, **handler):
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**handler))
    ckptr.save(os.path.abspath(path), args=ocp.args.PyTreeSave(tree))


VARIANTS = {
    "ocdbt-zarr3": dict(use_zarr3=True),
    "ocdbt-zarr2": dict(use_zarr3=False),
    "ocdbt-zarr2-uncompressed": dict(use_zarr3=False, use_compression=False),
    "no-ocdbt-zarr3": dict(use_ocdbt=False, use_zarr3=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pytree_variants_load_onto_another_sharding(tmp_path, mesh42, variant):
    tree = state(mesh42)
    save_pytree(tmp_path / "ck", tree, **VARIANTS[variant])
    want = numpy_of(tree)
    got = cairn.load(tmp_path / "ck", other_target(mesh42, want))
    assert got["params"]["w"].sharding.spec == P("y", "x")
    check(numpy_of(got), want)
    check(cairn.load(tmp_path / "ck"), want)  # numpy, no target


def test_standard_checkpointer_and_partial_rename(tmp_path, mesh8):
    tree = state(jax.make_mesh((4, 2), ("x", "y")))
    del tree["step"]  # StandardCheckpointer holds arrays
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(tmp_path / "std"), tree)
    want = numpy_of(tree)
    sh = NamedSharding(mesh8, P("x"))
    got = cairn.load(tmp_path / "std", {"kernel": sh}, rename=[(r"^params/w$", "kernel")], partial=True)
    np.testing.assert_array_equal(np.asarray(got["kernel"]), want["params"]["w"])
    with pytest.raises(cairn.MismatchError, match="'params/w' has shape"):
        cairn.load(tmp_path / "std", {"params": {"w": np.zeros((2, 2), np.float32)}}, partial=True)
    with pytest.raises(cairn.MismatchError, match="the target omits"):
        cairn.load(tmp_path / "std", {"params": {"w": sh}})
    info = cairn.metadata(tmp_path / "std")
    assert info["params"]["emb"].dtype == ml_dtypes.bfloat16 and info["host"].shape == (3, 4)


def test_partial_load_reads_only_that_arrays_chunks(tmp_path, mesh8):
    rng = np.random.default_rng(1)
    mesh = jax.make_mesh((8,), ("x",))
    big = {f"a{i}": jax.device_put(rng.standard_normal((1024, 256)).astype(np.float32),
                                   NamedSharding(mesh, P("x"))) for i in range(4)}
    save_pytree(tmp_path / "ck", big, use_zarr3=True)

    def file_bytes_read() -> int:
        m = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
        return int(m[0]["values"][0]["value"]) if m else 0

    before = file_bytes_read()
    got = cairn.load(tmp_path / "ck", {"a2": NamedSharding(mesh8, P("x"))}, partial=True)
    read = file_bytes_read() - before
    np.testing.assert_array_equal(np.asarray(got["a2"]), np.asarray(big["a2"]))
    one = 1024 * 256 * 4
    assert read < 1.2 * one, (read, one)  # its (compressed) chunks and OCDBT's small nodes, no other array


def test_checkpoint_manager_step_folder(tmp_path, mesh42):
    tree = state(mesh42)
    del tree["step"]
    with ocp.CheckpointManager(os.path.abspath(tmp_path / "run"), item_names=("state", "extra")) as mgr:
        for step in (1, 2):
            mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                   extra=ocp.args.JsonSave({"lr": 0.1, "tags": ["a", "b"]})))
        mgr.wait_until_finished()
    want = numpy_of(tree)
    got = cairn.load(tmp_path / "run" / "2", {"state": other_target(mesh42, want), "extra": None}, partial=True)
    check(numpy_of(got["state"]), want)
    got = cairn.load(tmp_path / "run" / "2")
    assert got["extra"] == {"lr": 0.1, "tags": ["a", "b"]}
    with pytest.raises(cairn.CheckpointNotFoundError, match="CheckpointManager directory.*run/2"):
        cairn.load(tmp_path / "run")
    with pytest.raises(cairn.MismatchError, match=r"does not hold \(it holds \['extra', 'state'\]\)"):
        cairn.load(tmp_path / "run" / "2", {"params": None})
    with pytest.raises(cairn.MismatchError, match="named checkpointables"):
        cairn.load(tmp_path / "run" / "2", [None])


def test_cli_inspect_and_convert_orbax(tmp_path, mesh42, capsys):
    from cairn._cli.main import main

    tree = state(mesh42)
    save_pytree(tmp_path / "ck", tree, use_zarr3=True)
    assert main(["--plain", "inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "params/w" in out and "a checkpoint in orbax format" in out
    assert main(["-q", "convert", str(tmp_path / "ck"), str(tmp_path / "cairn"), "--to", "cairn", "--budget", "1M"]) == 0
    check(cairn.load(tmp_path / "cairn"), numpy_of(tree))
    assert main(["verify", str(tmp_path / "cairn")]) == 0
    manifest = json.loads((tmp_path / "cairn" / "manifest.json").read_text())
    # A cairn checkpoint converted from Orbax says so, and claims no other format.
    assert manifest["metadata"]["converted_from"] == "orbax" and "format" not in manifest["metadata"]
