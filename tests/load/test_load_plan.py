"""The load's plan (`_load/plan.py`) is what the load does: the dry run's predicted storage requests equal
a real load's, request for request (file, offset, length), on a local disk and on S3 (moto)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from cairn._load import engine as _load
from cairn._load import plan as _plan
from cairn._load.metadata import read_index, read_manifest
from cairn._load.reader import LoadStats
from cairn._load.source import CairnSource
from cairn._storage.location import resolve

SHAPE = (1024, 512)  # 2 MiB of float32: several chunks on 8 devices, partial chunks when resharded
LAYER = (640, 512)  # 1.25 MiB: above the size read whole and placed at once
KiB = 1 << 10


def _state(mesh8, mesh42):
    return {
        "params": {
            "w": jax.device_put(jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE),
                                NamedSharding(mesh8, P("x"))),
            "v": jax.device_put(jnp.ones((512, 256), jnp.bfloat16), NamedSharding(mesh42, P("x", "y"))),
            "many": [np.arange(100 + 7 * i, dtype=np.float32) for i in range(40)],  # coalesced small arrays
            "b": jax.device_put(jnp.ones(64, jnp.float32), NamedSharding(mesh8, P("x"))),
            # Medium leaves, back to back: on object stores their in-place reads are gathered per file.
            "layers": [jax.device_put(jnp.full(LAYER, i, jnp.float32), NamedSharding(mesh8, P("x"))) for i in range(4)],
        },
        "blob": b"x" * 3000,
        "step": 3,
    }


def _target(case, mesh8, mesh42):
    """(target, partial) of each kind of load."""
    if case == "numpy":
        return None, False
    if case == "partial":  # w resharded, and nothing else but the step
        return {"params": {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=NamedSharding(mesh42, P("y", "x")))},
                "step": None}, True
    w, v = {
        "same": (NamedSharding(mesh8, P("x")), NamedSharding(mesh42, P("x", "y"))),
        "resharded": (NamedSharding(mesh8, P(None, "x")), NamedSharding(mesh8, P("x"))),
    }[case]
    return {"params": {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=w),
                       "v": jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=v),  # a cast from bfloat16
                       "many": [None] * 40,
                       "b": jax.ShapeDtypeStruct((64,), jnp.float32, sharding=NamedSharding(mesh8, P())),
                       "layers": [jax.ShapeDtypeStruct(LAYER, jnp.float32, sharding=w)] * 4},
            "blob": None, "step": None}, False


class _Recorded:
    """A storage reader that notes each request it is asked for: (key, offset, length)."""

    def __init__(self, reader, key, log):
        self._r, self._key, self._log = reader, key, log

    def __getattr__(self, name):
        return getattr(self._r, name)

    def read_into(self, offset, out):
        self._log.append((self._key, offset, len(out)))
        return self._r.read_into(offset, out)

    def read_into_many(self, offset, outs, **kw):
        self._log.append((self._key, offset, sum(len(o) for o in outs)))
        return self._r.read_into_many(offset, outs, **kw)


def real_requests(path, target, storage_options=None, **kw):
    """The requests a real load sends to the storage's readers, and its stats."""
    loc = resolve(path, storage_options)
    log: list[tuple[str, int, int]] = []
    open_read = loc.storage.open_read
    loc.storage.open_read = lambda key: _Recorded(open_read(key), key, log)
    stats = LoadStats()
    _load.load(CairnSource.open(loc), target, stats=stats, **kw)
    return log, stats


def data_keys(path, storage_options=None):
    """The storage key of each data file: (checkpointable, file number) -> key."""
    loc = resolve(path, storage_options)
    manifest = read_manifest(loc)
    return {(name, f): loc.key(info.dir, file.name)
            for name, info in manifest.items.items() for f, file in enumerate(read_index(loc, info).files)}


def predicted(plan, keys):
    """The one process's planned requests, as (key, offset, length)."""
    (pl,) = plan.plans
    return [(keys[r.item, r.file], r.start, r.length) for r in pl.requests]


def check(path, case, mesh8, mesh42, storage_options=None, budget=1 << 30):
    """Compare a real load's requests with the dry run's; return both, for further checks."""
    keys = data_keys(path, storage_options)
    t, partial = _target(case, mesh8, mesh42)
    real, stats = real_requests(path, t, storage_options, budget_bytes=budget, partial=partial)
    real = [r for r in real if r[0] in set(keys.values())]  # the manifest and indexes are not the plan's
    plan = cairn.plan_load(path, t, budget_bytes=budget, partial=partial, storage_options=storage_options)
    guess = predicted(plan, keys)
    assert len(real) == stats.reads and sum(n for _, _, n in real) == stats.bytes_read  # the recorder saw all
    assert Counter(guess) == Counter(real), (sorted(set(guess) - set(real))[:5], sorted(set(real) - set(guess))[:5])
    assert (plan.processes[0].requests, plan.processes[0].bytes_read) == (stats.reads, stats.bytes_read)
    return real, keys, t, partial


@pytest.fixture(params=["raw", "zstd"])
def saved(request, tmp_path, mesh8, mesh42):
    """A local checkpoint, its leaves stored raw or compressed (small compressed leaves join runs too)."""
    path = tmp_path / "ck"
    cairn.save(path, _state(mesh8, mesh42), compression=request.param == "zstd" and "zstd")
    if request.param == "zstd":
        codecs = {leaf.codec for info in read_manifest(resolve(path)).items.values()
                  for leaf in read_index(resolve(path), info).leaves if hasattr(leaf, "codec")}
        assert "zstd" in codecs
    return path


@pytest.mark.parametrize("case", ["same", "resharded", "partial", "numpy"])
@pytest.mark.parametrize("budget", [1 << 30, 256 * KiB])
def test_local_requests_are_the_plans(saved, case, budget, mesh8, mesh42):
    real, _, _, _ = check(saved, case, mesh8, mesh42, budget=budget)
    if case == "numpy":  # the 40 small arrays (and more) went out in fewer requests than arrays
        assert len(real) < 40


@pytest.mark.parametrize("case", ["same", "resharded", "partial", "numpy"])
@pytest.mark.parametrize("compression", [False, "auto"])  # "auto" compresses these arrays on an object store
def test_s3_requests_are_the_plans(s3, mesh8, mesh42, case, compression, monkeypatch):
    bucket = s3.new_bucket()
    # Planned reads and runs of 4 MiB: the layers' in-place reads gather into requests of up to three.
    opts = s3.options(read_part_size=1024 * KiB, plan_read_size=4096 * KiB)
    path = f"s3://{bucket}/ck"
    cairn.save(path, _state(mesh8, mesh42), storage_options=opts, compression=compression)
    real, _, _, _ = check(path, case, mesh8, mesh42, storage_options=opts)
    if case in ("same", "resharded") and not compression:
        assert len(real) < 40  # small arrays gathered into runs
    if case == "same" and not compression:  # the layers' reads land in place: gathered per file
        # A plan that does not gather in-place reads (as the dry run's copy of the engine did not) is caught.
        of = _plan.Limits.of
        monkeypatch.setattr(_plan.Limits, "of", classmethod(lambda cls, storage: dataclasses.replace(of(storage),
                                                                                                     pieces=0)))
        t, partial = _target(case, mesh8, mesh42)
        other = predicted(cairn.plan_load(path, t, partial=partial, storage_options=opts), data_keys(path, opts))
        assert Counter(other) != Counter(real) and len(other) > len(real)


def test_a_different_cut_is_caught(saved, mesh8, mesh42, monkeypatch):
    """The comparison can fail: a plan that cuts runs of small arrays at 4 KiB, where the load cuts
    them at 4 MiB, predicts other requests, and the same comparison tells them apart."""
    real, keys, t, partial = check(saved, "numpy", mesh8, mesh42)
    of = _plan.Limits.of
    monkeypatch.setattr(_plan.Limits, "of", classmethod(
        lambda cls, storage: dataclasses.replace(of(storage), run_bytes=4 * KiB)))
    other = predicted(cairn.plan_load(saved, t, partial=partial), keys)
    assert sum(n for _, _, n in other) == sum(n for _, _, n in real)  # the same bytes, cut elsewhere
    assert Counter(other) != Counter(real) and len(other) > len(real)
