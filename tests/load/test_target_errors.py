"""A target sharding that cannot hold the checkpoint's array is cairn's MismatchError, naming the path.

JAX's own errors (IndivisibleError for a split that does not divide a
dimension, an IndexError for a PartitionSpec on a scalar) name neither the
checkpoint nor the key path. Checked on a checkpoint cairn wrote and on one
Orbax wrote.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn


def state():
    return {"params": {"w": np.ones((6, 4), np.float32), "scale": np.array(3.0, np.float32)}}


def written_by(tmp_path, writer):
    path = tmp_path / writer
    if writer == "cairn":
        cairn.save(path, state())
    else:
        ocp = pytest.importorskip("orbax.checkpoint")
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.abspath(path), state())
    return path


@pytest.mark.parametrize("writer", ["cairn", "orbax"])
def test_a_sharding_that_does_not_fit_names_checkpoint_and_leaf(tmp_path, writer):
    path = written_by(tmp_path, writer)
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    fine = NamedSharding(mesh, P("y"))
    with pytest.raises(cairn.MismatchError, match=rf"{path}: leaf 'params/w'.*splits dimension 0 \(size 6.*4 ways"):
        cairn.load(path, {"params": {"w": NamedSharding(mesh, P("x")), "scale": None}})
    with pytest.raises(cairn.MismatchError, match=rf"{path}: leaf 'params/w'.*dimension 1 \(size 4.*8 ways"):
        cairn.load(path, {"params": {"w": jax.ShapeDtypeStruct((6, 4), np.float32, sharding=NamedSharding(
            mesh, P(None, ("x", "y")))), "scale": None}})
    with pytest.raises(cairn.MismatchError, match=rf"{path}: leaf 'params/scale'.*names 1 dimension, but the "
                                                  r"array has 0"):
        cairn.load(path, {"params": {"w": fine, "scale": NamedSharding(mesh, P("x"))}})
    got = cairn.load(path, {"params": {"w": fine, "scale": NamedSharding(mesh, P())}})
    assert got["params"]["w"].sharding == fine
    np.testing.assert_array_equal(np.asarray(got["params"]["w"]), state()["params"]["w"])
