"""Random pytrees of random leaves survive a save/load bit for bit (hypothesis)."""

from __future__ import annotations

import shutil
import tempfile

import jax
import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn

DTYPES = [np.float32, np.float16, np.int8, np.int32, np.uint16, np.bool_, np.complex64, ml_dtypes.bfloat16, np.float64]
MESHES = {}


def mesh(shape):
    if shape not in MESHES:
        MESHES[shape] = jax.make_mesh(shape, ("a", "b")[: len(shape)])
    return MESHES[shape]


@st.composite
def arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.sampled_from([0, 1, 2, 3, 4, 8, 16])) for _ in range(ndim))
    seed = draw(st.integers(0, 2**31))
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    x = raw.view(dtype).reshape(shape) if dtype != np.bool_ else (raw % 2 == 1).reshape(shape)
    kind = draw(st.sampled_from(["numpy", "jax"]))
    if kind == "numpy":
        return x
    m = mesh(draw(st.sampled_from([(8,), (4, 2), (2, 4)])))
    spec = []
    free = list(m.axis_names)
    for n in shape:  # shard an axis only where it divides evenly
        choice = draw(st.sampled_from([None, *free]))
        if choice is not None and n % m.shape[choice] == 0 and n > 0:
            spec.append(choice)
            free.remove(choice)
        else:
            spec.append(None)
    return jax.device_put(x, NamedSharding(m, P(*spec)))


leaves = st.one_of(
    arrays(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=8),
    st.binary(max_size=16), st.none(), st.booleans(),
)
trees = st.recursive(
    leaves,
    lambda c: st.one_of(st.lists(c, max_size=3), st.tuples(c, c), st.dictionaries(st.text(min_size=1, max_size=6), c, max_size=3)),
    max_leaves=8,
)


def same(a, b):
    if isinstance(a, (np.ndarray, jax.Array)):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(min_size=1, max_size=5), trees, min_size=1, max_size=3))
def test_random_trees_roundtrip(state):
    d = tempfile.mkdtemp()
    try:
        cairn.save(f"{d}/c", state)
        out = cairn.load(f"{d}/c")
        assert same(state, out)
        # With the state itself as the target, arrays come back with their own shardings.
        back = cairn.load(f"{d}/c", state)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
            if isinstance(a, jax.Array):
                assert isinstance(b, jax.Array) and b.sharding == a.sharding
            assert same(a, b)
    finally:
        shutil.rmtree(d)
