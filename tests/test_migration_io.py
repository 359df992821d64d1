"""Issue 40, the export and load-value side of a safe migration: each test follows a user's steps.

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
