"""The load's plan (`_load/plan.py`) is what the load does: the dry run's predicted storage requests equal
a real load's, request for request (file, offset, length), on a local disk and on S3 (moto); for
incremental steps too, whose reads go to their bases' files (references, and the base blocks of deltas)."""

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
from cairn._load.reader import LoadStats
from cairn._load.source import CairnSource
from cairn._read.metadata import read_index, read_manifest
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


# ---------------------------------------------------------------------- incremental (format 4) chains

W = (1024, 2048)  # 4 MiB of bfloat16: four 1 MiB blocks in one chunk when saved whole


def _nudged(x, frac, seed):
    """`x` (bfloat16) with `frac` of its elements moved to the next value: a change stored as deltas."""
    y = np.array(x, copy=True)
    bits = y.view(np.uint16).reshape(-1)
    bits[np.random.default_rng(seed).choice(bits.size, size=int(bits.size * frac), replace=False)] += 1
    return y


def _chain_states(mesh8, mesh42):
    """Three steps: `w` (whole) and `ws` (sharded) nudged each step (deltas, against step 0's blocks),
    `frozen` and the small arrays unchanged (references), `m` changed everywhere (its own bytes)."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(W).astype(ml_dtypes.bfloat16)
    ws0 = rng.standard_normal(W).astype(ml_dtypes.bfloat16)
    frozen = jax.device_put(jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE), NamedSharding(mesh8, P("x")))
    many = [np.arange(100 + 7 * i, dtype=np.float32) for i in range(10)]
    states = []
    for t in range(3):
        w = w0 if t == 0 else _nudged(w0, 0.005 * t, t)
        ws = ws0 if t == 0 else _nudged(ws0, 0.005 * t, 10 + t)
        states.append({"params": {"w": w, "ws": jax.device_put(ws, NamedSharding(mesh42, P("x", "y"))),
                                  "frozen": frozen, "many": many,
                                  "m": jax.device_put(jnp.full((512, 256), t, jnp.float32), NamedSharding(mesh8, P("x")))},
                       "step": t})
    return states


def _chain_target(case, mesh8, mesh42):
    import ml_dtypes

    if case == "numpy":
        return None, False
    bf = jnp.dtype(ml_dtypes.bfloat16)
    if case == "partial":  # ws resharded, and nothing else but the step
        return {"params": {"ws": jax.ShapeDtypeStruct(W, bf, sharding=NamedSharding(mesh42, P("y", "x")))},
                "step": None}, True
    ws, frozen = {
        "same": (NamedSharding(mesh42, P("x", "y")), NamedSharding(mesh8, P("x"))),
        "resharded": (NamedSharding(mesh8, P(None, "x")), NamedSharding(mesh42, P("y", "x"))),
    }[case]
    return {"params": {"w": jax.ShapeDtypeStruct(W, bf, sharding=ws),
                       "ws": jax.ShapeDtypeStruct(W, bf, sharding=ws),
                       "frozen": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=frozen),
                       "many": [None] * 10,
                       "m": jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=NamedSharding(mesh8, P()))},
            "step": None}, False


def chain_keys(path, storage_options=None):
    """`data_keys` with a base checkpoint's files: their keys beside the checkpoint (docs/FORMAT.md §6.5)."""
    loc = resolve(path, storage_options)
    manifest = read_manifest(loc)
    return {(name, f): ("/".join((file.base, info.dir, file.name)) if file.base is not None
                        else loc.key(info.dir, file.name))
            for name, info in manifest.items.items() for f, file in enumerate(read_index(loc, info).files)}


def _save_chain(root, mesh8, mesh42, storage_options=None, first=False):
    """Steps s0 (self-contained, with hashes: against a plain save; compressed by `first`), s1 and s2
    (raw, each against the one before)."""
    states = _chain_states(mesh8, mesh42)
    join = (lambda n: f"{root}/{n}") if isinstance(root, str) else (lambda n: root / n)
    cairn.save(join("plain"), states[0], storage_options=storage_options, compression=first)
    cairn.save(join("s0"), states[0], base=join("plain"), storage_options=storage_options, compression=first)
    cairn.save(join("s1"), states[1], base=join("s0"), storage_options=storage_options, compression=False)
    cairn.save(join("s2"), states[2], base=join("s1"), storage_options=storage_options, compression=False)
    return join("s2"), states[2]


def check_chain(path, case, mesh8, mesh42, storage_options=None, budget=1 << 30):
    """`check` for a checkpoint whose reads go to its bases' files too; the loaded values are checked."""
    keys = chain_keys(path, storage_options)
    t, partial = _chain_target(case, mesh8, mesh42)
    log: list[tuple[str, int, int]] = []
    loc = resolve(path, storage_options)
    open_read = loc.storage.open_read
    loc.storage.open_read = lambda key: _Recorded(open_read(key), key, log)
    stats = LoadStats()
    got = _load.load(CairnSource.open(loc), t, stats=stats, budget_bytes=budget, partial=partial)
    real = [r for r in log if r[0] in set(keys.values())]
    plan = cairn.plan_load(path, t, budget_bytes=budget, partial=partial, storage_options=storage_options)
    guess = predicted(plan, keys)
    assert len(real) == stats.reads and sum(n for _, _, n in real) == stats.bytes_read
    assert Counter(guess) == Counter(real), (sorted(set(guess) - set(real))[:5], sorted(set(real) - set(guess))[:5])
    assert (plan.processes[0].requests, plan.processes[0].bytes_read) == (stats.reads, stats.bytes_read)
    return real, keys, t, partial, got


@pytest.fixture(scope="module", params=["raw", "zstd"])
def chain(request, tmp_path_factory):
    """A local chain s0 <- s1 <- s2 (saved once for the module's tests), and s2's state. With "zstd", s0
    is compressed: the deltas' base blocks are coded, their sizes known to a dry run from s0's index."""
    root = tmp_path_factory.mktemp("chain")
    path, state = _save_chain(root, jax.make_mesh((8,), ("x",)), jax.make_mesh((4, 2), ("x", "y")),
                              first=request.param == "zstd" and "zstd")
    from cairn._format.blocks import DELTA

    codecs = Counter()
    for part in (root / "s2").glob("*/index.p*.idx"):
        from cairn._format.partfile import PART_VERSION_BLOCKS, block_columns

        cols = block_columns(part.read_bytes(), PART_VERSION_BLOCKS)[1]
        codecs.update(zip(cols["file"].tolist(), cols["codec"].tolist()))
    assert any(c == DELTA for _, c in codecs) and any(f != 0xFFFFFFFF and c != DELTA for f, c in codecs)
    return path, state


@pytest.mark.parametrize("case", ["same", "resharded", "partial", "numpy"])
@pytest.mark.parametrize("budget", [1 << 30, 256 * KiB])
def test_incremental_requests_are_the_plans(chain, case, budget, mesh8, mesh42):
    path, state = chain
    real, keys, _, _, got = check_chain(path, case, mesh8, mesh42, budget=budget)
    bases = {k for k in keys.values() if not k.startswith(path.name + "/")}
    assert bases and any(k in bases for k, _, _ in real)  # reads in the bases' files, predicted as they are
    want = state["params"]["ws"]
    assert np.asarray(got["params"]["ws"]).tobytes() == np.asarray(want).tobytes()
    if case != "partial":
        assert np.asarray(got["params"]["w"]).tobytes() == state["params"]["w"].tobytes()


def test_incremental_base_reads_joined_are_caught(chain, mesh8, mesh42, monkeypatch):
    """The comparison can fail: a plan that reads each delta's base block alone (as the dry run did,
    one request per read, before) predicts other requests than the load, which joins consecutive ones."""
    path, _ = chain
    real, keys, t, partial, _ = check_chain(path, "numpy", mesh8, mesh42)
    from cairn._load import blocks

    def alone(places, b0, b1, base_of):
        return blocks.stored_fetches(places, b0, b1) + [
            blocks.Fetch(*places[b][5], base_of(b)[1], (b,)) for b in range(b0, b1) if places[b][4] == blocks.DELTA]

    monkeypatch.setattr(_plan, "fetches", alone)
    other = predicted(cairn.plan_load(path, t, partial=partial), keys)
    assert sum(n for _, _, n in other) == sum(n for _, _, n in real)  # the same bytes, cut elsewhere
    assert Counter(other) != Counter(real) and len(other) > len(real)


@pytest.mark.parametrize("case", ["same", "partial"])
def test_s3_incremental_requests_are_the_plans(s3, mesh8, mesh42, case):
    bucket = s3.new_bucket()
    opts = s3.options(read_part_size=1024 * KiB, plan_read_size=4096 * KiB)
    path, state = _save_chain(f"s3://{bucket}", mesh8, mesh42, storage_options=opts)
    real, _, _, _, got = check_chain(path, case, mesh8, mesh42, storage_options=opts)
    assert any(k.startswith("s0/") or k.startswith("s1/") for k, _, _ in real)
    assert np.asarray(got["params"]["ws"]).tobytes() == np.asarray(state["params"]["ws"]).tobytes()


def test_a_coded_base_block_is_looked_up_in_the_base(chain, mesh8, mesh42, monkeypatch, request):
    """Where the deltas' base blocks are compressed, a dry run that took them to be raw (not looking them
    up in the base's index) predicts other lengths, and the comparison tells."""
    from cairn._sources import dryrun

    path, _ = chain
    check_chain(path, "numpy", mesh8, mesh42)
    monkeypatch.setattr(dryrun, "_base_blocks", lambda *a: None)
    if request.node.callspec.params["chain"] == "zstd":
        with pytest.raises(AssertionError):
            check_chain(path, "numpy", mesh8, mesh42)
    else:
        check_chain(path, "numpy", mesh8, mesh42)


def test_a_missing_base_is_named(tmp_path, mesh8, mesh42):
    """A dry run of a step whose deltas' base is gone fails as the load does, naming the base."""
    path, _ = _save_chain(tmp_path, mesh8, mesh42)
    import shutil

    shutil.rmtree(tmp_path / "s0")
    with pytest.raises(cairn.CorruptCheckpointError, match="'s0'"):
        cairn.plan_load(path)
    with pytest.raises(cairn.CorruptCheckpointError, match="s0"):
        cairn.load(path)
