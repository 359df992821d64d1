"""A load's host buffers lent from `buffers.load_pool` where the arrays go to devices
(`_load.reader.lends`): each comes back only once nothing refers to it, so a later load never writes
into memory an array of an earlier one still uses.

This machine has CPU devices only, whose backend adopts aligned host buffers as the arrays themselves
(nothing is copied): the loaded arrays hold their lent buffers for as long as they live. That is the hardest case for the pool (a buffer lent twice would change a live array), and
the one these tests check; on an accelerator the buffers come back as soon as each copy is done.
"""

from __future__ import annotations

import gc

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from cairn._core import buffers
from cairn._load import reader


@pytest.fixture
def lending(monkeypatch):
    """Lending on for every sharded read (whatever `LEND_LOAD_BUFFERS` says), from a pool of the test's
    own."""
    pool = buffers.SlabPool()
    monkeypatch.setattr(reader, "load_pool", pool)
    monkeypatch.setattr(reader, "lends", lambda sharding: sharding is not None)
    return pool


def _state(mesh8, seed):
    rng = np.random.default_rng(seed)
    sh = NamedSharding(mesh8, P("x"))
    return {
        "w": jax.device_put(rng.standard_normal((1024, 1024)).astype(np.float32), sh),  # 512 KiB shards
        "v": jax.device_put(rng.standard_normal((8, 1 << 18)).astype(np.float32), sh),  # 1 MiB shards: lent
        "b": jax.device_put(rng.standard_normal((16, 1 << 17)).astype(ml_dtypes.bfloat16), sh),  # 512 KiB shards
        "small": jax.device_put(np.arange(64, dtype=np.int32), sh),
    }


def _target(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _same(got, want):
    for k in want:
        assert np.array_equal(np.asarray(got[k]), np.asarray(want[k])), k


@pytest.mark.parametrize("compression", [False, True])
def test_a_later_load_never_writes_into_buffers_an_earlier_loads_arrays_hold(tmp_path, mesh8, lending, compression):
    a, b = _state(mesh8, 0), _state(mesh8, 1)
    cairn.save(str(tmp_path / "a"), a, compression=compression)
    cairn.save(str(tmp_path / "b"), b, compression=compression)
    got_a = cairn.load(str(tmp_path / "a"), _target(a))
    lent = lending.lent_bytes
    assert lending.made == 8 and lent == 8 << 20  # the 1 MiB shards of "v" only: the others are under LEND_MIN
    got_b = cairn.load(str(tmp_path / "b"), _target(b))
    assert lending.reused == 0 and lending.lent_bytes == 2 * lent  # a's arrays still hold theirs
    _same(got_a, a)
    _same(got_b, b)
    del got_a
    gc.collect()
    assert lending.lent_bytes == lent and lending.free_bytes == lent  # back once a's arrays are gone
    got_c = cairn.load(str(tmp_path / "a"), _target(a))
    assert lending.reused == 8 and lending.made == 16  # into a's old buffers, not b's
    _same(got_c, a)
    _same(got_b, b)


def test_a_resharded_load_lends_its_target_boxes(tmp_path, mesh8, lending):
    """Read with another sharding than the saved one (the boxes cut across the saved chunks): every box
    lent, the values right, and all of it back once the arrays are gone."""
    a = _state(mesh8, 2)
    cairn.save(str(tmp_path / "a"), a, compression=True)
    other = NamedSharding(jax.make_mesh((2, 4), ("p", "q")), P("q", "p"))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=other if x.ndim == 2 else x.sharding), a)
    got = cairn.load(str(tmp_path / "a"), target)
    assert lending.made > 0
    _same(got, a)
    del got
    gc.collect()
    assert lending.lent_bytes == 0


def test_a_save_frees_the_loads_buffers_and_a_load_keeps_them(tmp_path, mesh8, monkeypatch):
    """The process-wide pool: what a load kept (for the next load of this process) is freed when the
    process saves, and a load frees what saves kept but not its own."""
    from cairn._load import landing

    monkeypatch.setattr(reader, "lends", lambda sharding: sharding is not None)
    pool = buffers.SlabPool()  # the process's, as every user of it finds it (nothing lent by earlier tests)
    for module in (buffers, reader, landing):
        monkeypatch.setattr(module, "load_pool", pool)
    buffers.release_snapshot_buffers()
    a = _state(mesh8, 3)
    cairn.save(str(tmp_path / "a"), a, compression=True)
    assert buffers.coded_pool.free_bytes > 0  # the compressed save's coded buffers, kept
    got = cairn.load(str(tmp_path / "a"), _target(a))
    assert buffers.coded_pool.free_bytes == 0
    _same(got, a)
    del got
    gc.collect()
    kept = buffers.load_pool.free_bytes
    assert kept >= 8 << 20  # the arrays' 8 MiB of buffers, and the reader threads' scratch buffers
    reused = buffers.load_pool.reused
    got = cairn.load(str(tmp_path / "a"), _target(a))
    assert buffers.load_pool.lent_bytes == 8 << 20  # the arrays' buffers; the scratch ones are back
    assert buffers.load_pool.reused >= reused + 8  # the same buffers again
    del got
    gc.collect()
    cairn.save(str(tmp_path / "b"), a)
    assert buffers.load_pool.free_bytes == 0
    buffers.release_snapshot_buffers()


def test_device_arrays_are_lent_to_and_numpy_results_are_not(mesh8, monkeypatch):
    """Every sharded target is lent to, the CPU backend's included (its arrays hold their buffers for
    as long as they live); numpy results (no sharding) are the caller's own buffers."""
    assert reader.lends(NamedSharding(mesh8, P("x")))
    assert not reader.lends(None)
    monkeypatch.setattr(reader, "LEND_LOAD_BUFFERS", False)
    assert not reader.lends(NamedSharding(mesh8, P("x")))


def test_a_donated_loaded_array_is_never_overwritten_by_a_later_load(tmp_path, mesh8, lending):
    """A loaded array donated to a jitted step: the step's output keeps its values through later loads
    into the pool, and the donated array's buffer comes back only once nothing refers to it."""
    a, b = _state(mesh8, 6), _state(mesh8, 7)
    cairn.save(str(tmp_path / "a"), a)
    cairn.save(str(tmp_path / "b"), b)
    got = cairn.load(str(tmp_path / "a"), _target(a))
    lent = lending.lent_bytes
    assert lent == 8 << 20
    step = jax.jit(lambda t: jax.tree.map(lambda x: x * 2 + 1, t), donate_argnums=0)
    out = jax.block_until_ready(step(got))
    assert got["v"].is_deleted()
    del got
    gc.collect()
    want = jax.tree.map(lambda x: np.asarray(x) * 2 + 1, a)
    for _ in range(3):  # later loads, each of another state, into whatever the pool has back
        got_b = cairn.load(str(tmp_path / "b"), _target(b))
        _same(got_b, b)
        _same(out, want)
        del got_b
        gc.collect()
    assert lending.reused >= 8  # the later loads read into buffers that had come back
    del out
    gc.collect()
    assert lending.lent_bytes == 0


def test_an_orbax_checkpoints_arrays_are_read_into_lent_buffers(tmp_path, mesh8, lending):
    """cairn.load of a checkpoint orbax-checkpoint wrote (read through tensorstore) lends the same way: two
    checkpoints loaded one after the other, the first's arrays kept, both bit for bit."""
    ocp = pytest.importorskip("orbax.checkpoint")
    a, b = _state(mesh8, 4), _state(mesh8, 5)
    for name, st in (("a", a), ("b", b)):
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp_path / name, st)
    got_a = cairn.load(str(tmp_path / "a"), _target(a))
    got_b = cairn.load(str(tmp_path / "b"), _target(b))
    _same(got_a, a)
    _same(got_b, b)
    assert lending.made == 16  # "v"'s 1 MiB shards, each load's its own
    del got_a, got_b
    gc.collect()
    assert lending.lent_bytes == 0 and lending.free_bytes == 16 << 20
