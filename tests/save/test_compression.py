"""Format version 3: compressed blocks through save and load (docs/FORMAT.md §6.4).

Round trips of every codec on local disk and the in-memory object store,
multi-device meshes, resharded and partial loads that read only the stored
blocks they need (counted with LoadStats), async saves, the compression
switch ("auto" on object stores only), and what tools make of compressed leaves.
Corruption of compressed checkpoints is in test_corruption.py and test_hostile.py.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from cairn._codecs import choose as _choose
from cairn._codecs import codecs as _codecs
from cairn._format import manifest as fmt
from cairn._load.source import open_checkpoint
from cairn._save import codecpolicy, pipeline

BLOCK = 4096
def fast(dtype=ml_dtypes.bfloat16) -> str:
    """What `compression=True` (and "auto", where it compresses) picks for trained floats of `dtype`:
    "planes", whether or not python-blosc2 is installed: they pick only codecs every install reads
    (`compression="fast"` adds the C-Blosc2 codecs)."""
    return "planes"


def compressed_version(leaves) -> int:
    """The manifest's version of a compressed save with these leaves (`leaves_of`): 6 where any leaf is
    "blosc2-lz4" ("auto" picks it by predicted time), else 5 where any is "blosc2" (docs/FORMAT.md §6.6;
    True picks it by each leaf's element size and the host's cores), else 3."""
    codecs = {leaf.codec for leaf, _ in leaves.values()}
    return 6 if "blosc2-lz4" in codecs else 5 if "blosc2" in codecs else 3
NEEDS_BLOSC2 = pytest.mark.skipif(not _codecs.blosc2_available(), reason="python-blosc2 is not installed")


@pytest.fixture
def mesh():
    return jax.make_mesh((4, 2), ("x", "y"))


def trained(shape, dtype=ml_dtypes.bfloat16, seed=0):
    """Values like a trained layer's: normal with std 0.02, so the exponent planes compress."""
    return np.random.default_rng(seed).normal(0, 0.02, shape).astype(dtype)


def state_of(mesh=None):
    w = trained((256, 512))
    if mesh is not None:
        w = jax.device_put(w, NamedSharding(mesh, P("x", "y")))
    return {
        "params": {"w": w, "b": trained((512,), np.float32, 1), "ids": np.arange(3000, dtype=np.int32) % 5,
                   "zeros": np.zeros((100, 70), np.float32), "noise": np.random.default_rng(2).integers(
                       0, 256, 5000, dtype=np.uint8), "empty": np.zeros((0, 4), np.float32), "step": 7},
    }


def where_of(kind, tmp_path, name="c"):
    return str(tmp_path / name) if kind == "local" else f"memory://cmp-{uuid.uuid4().hex}/{name}"


def assert_same(got, want):
    for k, v in want["params"].items():
        g = got["params"][k]
        if isinstance(v, int):
            assert g == v
            continue
        g = np.asarray(g)
        assert g.dtype == np.asarray(v).dtype and g.shape == v.shape, k
        assert np.asarray(g).tobytes() == np.asarray(v).tobytes(), k


class Opaque:
    """A user type, saved through `cairn.register_type`."""

    def __init__(self, n):
        self.n = n


cairn.register_type(Opaque, save=lambda o: str(o.n).encode(), load=lambda b: Opaque(int(b)),
                    name="test_compression.Opaque")


def leaves_of(path):
    ck = open_checkpoint(path)
    out = {}
    for item, index in ck.indexes.items():
        if index.table is not None:
            index.table.fetch_all()
        for leaf in index.leaves:
            if isinstance(leaf, fmt.ArrayLeaf):
                out[leaf.path or item] = (leaf, index.block_size)
    return ck, out


@pytest.mark.parametrize("kind", ["local", "memory"])
@pytest.mark.parametrize("compression", ["zstd", "planes", pytest.param("blosc2", marks=NEEDS_BLOSC2),
                                         pytest.param("blosc2-lz4", marks=NEEDS_BLOSC2), True])
def test_round_trip_every_codec(tmp_path, kind, compression, mesh):
    state = state_of(mesh)
    path = where_of(kind, tmp_path)
    stats = cairn.save(path, state, compression=compression)
    ck, leaves = leaves_of(path)
    want = {"blosc2": 5, "blosc2-lz4": 6, True: compressed_version(leaves)}.get(compression, 3)
    assert ck.manifest.version == want
    codecs = {p: leaf.codec for p, (leaf, _) in leaves.items()}
    if compression is True:
        assert codecs["w"] == fast() and codecs["noise"] == "none" and codecs["zeros"] != "none"
    else:
        assert set(codecs.values()) == {compression}
    raw = sum(leaf.nbytes for leaf, _ in leaves.values())
    assert stats.bytes_written < 0.85 * raw  # bf16 weights, zeros and small ints all shrink
    assert_same(cairn.load(path), state)
    from cairn._sources.verify import verify

    assert verify(path).ok


def test_auto_is_off_on_local_disk_and_on_for_object_stores(tmp_path, monkeypatch):
    """By the one formula (`codecpolicy.compression_pays`), with this platform's codec speeds on 12 cores:
    a local disk (8 GiB/s) is faster than the codecs, an object store (0.5 GiB/s) is not."""

    monkeypatch.setattr(codecpolicy, "coder_cores", lambda: 12)
    state = state_of()
    local = tmp_path / "local"
    cairn.save(local, state)
    assert json.loads((local / "manifest.json").read_bytes())["version"] == 2
    mem = where_of("memory", tmp_path)
    cairn.save(mem, state)
    ck, leaves = leaves_of(mem)
    assert ck.manifest.version == compressed_version(leaves) and leaves["w"][0].codec == fast()
    off = where_of("memory", tmp_path)
    for value in (False, "none"):
        cairn.save(off, state, compression=value, overwrite=True)
        assert open_checkpoint(off).manifest.version == 2
    with pytest.raises(ValueError, match="compression"):
        cairn.save(tmp_path / "bad", state, compression="lz4")


def test_uncompressed_save_is_version_2_byte_for_byte(tmp_path):
    """compression off writes exactly what cairn wrote before version 3 (same files, same index)."""
    state = state_of()
    cairn.save(tmp_path / "a", state, compression=False)
    ck = open_checkpoint(tmp_path / "a")
    for index in ck.indexes.values():
        assert index.version == 2
        assert all(leaf.codec == "none" for leaf in index.leaves if isinstance(leaf, fmt.ArrayLeaf))


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_resharded_load_reads_only_the_blocks_it_needs(tmp_path, kind, mesh):
    """A load onto another sharding reads at most 1.1x the stored bytes of the blocks its boxes touch."""
    rng = np.random.default_rng(5)
    full = rng.normal(0, 0.02, (512, 1024)).astype(ml_dtypes.bfloat16)
    path = where_of(kind, tmp_path)
    saved = jax.device_put(full, NamedSharding(jax.make_mesh((8,), ("x",)), P("x")))  # 8 row chunks of 128 KiB
    from cairn._save import engine

    job = engine.prepare(cairn._storage.location.resolve(path), {"w": saved}, block_size=BLOCK,
                         compression="planes")
    job.run()
    _, leaves = leaves_of(path)
    leaf, block = leaves["w"]
    assert leaf.codec == "planes"
    # One process's share of a (2, 4) mesh, as column blocks: rows 0..255 x columns 0..255 on device 0, ...
    target_mesh = jax.make_mesh((2, 4), ("a", "b"))
    sharding = NamedSharding(target_mesh, P("a", "b"))
    stats = cairn.LoadStats()
    got = cairn.load(path, {"w": jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=sharding)}, stats=stats,
                     read_once=False)
    assert np.asarray(got["w"]).tobytes() == full.tobytes()
    assert got["w"].sharding == sharding
    total = sum(sum(leaf.stored_sizes(c, block)) for c in range(len(leaf.chunks)))
    assert stats.bytes_read <= 1.1 * total  # every block needed: read once, not once per box
    # Partial: one box of 64 rows x 128 columns reads only the blocks holding those rows' bytes.
    small = NamedSharding(jax.make_mesh((8, 1), ("a", "b")), P("a", "b"))
    stats = cairn.LoadStats()
    got = cairn.load(path, {"w": jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=small)}, stats=stats,
                     read_once=False)
    assert np.asarray(got["w"]).tobytes() == full.tobytes()
    assert stats.bytes_read <= 1.1 * total


def test_a_region_reads_only_its_blocks(tmp_path):
    """Reading one box of a compressed leaf touches only the stored blocks that hold its raw bytes."""
    from concurrent.futures import ThreadPoolExecutor

    from cairn._load.reader import make_reader, read_box
    from cairn._save import engine

    full = trained((256, 1024))  # one chunk of 512 KiB: 128 blocks of 4 KiB (2 rows each)
    path = tmp_path / "c"
    engine.prepare(cairn._storage.location.resolve(str(path)), {"w": full}, block_size=BLOCK,
                   compression="planes").run()
    ck, leaves = leaves_of(path)
    leaf, block = leaves["w"]
    sizes = leaf.stored_sizes(0, block)
    assert len(sizes) == 128
    with ThreadPoolExecutor(2) as pool:
        reader = make_reader(ck, "w", pool)
        box = ((10, 30), (0, 1024))  # rows 10..29: blocks 5..14
        out = read_box(reader, leaf, box, pool)
        assert out.tobytes() == full[10:30].tobytes()
        assert reader.stats.bytes_read == sum(sizes[5:15])
        reader.close()


def test_async_save_compresses_in_the_background(tmp_path, mesh):
    state = state_of(mesh)
    path = where_of("memory", tmp_path)
    f = cairn.save_async(path, state, compression=True)
    # The saved values are those at the call, whatever happens to the arrays after it.
    state["params"]["b"][:] = 1.0
    stats = f.result(timeout=120)
    assert stats.bytes_written > 0
    want = state_of(mesh)
    assert_same(cairn.load(path), want)


def test_manager_and_copy_keep_compressed_checkpoints(tmp_path):
    state = state_of()
    mgr = cairn.CheckpointManager(tmp_path / "run", async_save=False, handle_sigterm=False, compression="zstd")
    try:
        mgr.save(1, state)
        mgr.wait()
        got = mgr.restore(1)
    finally:
        mgr.close()
    assert_same(got, state)
    step = next((tmp_path / "run").iterdir())
    assert json.loads((step / "manifest.json").read_bytes())["version"] == 3
    dst = f"memory://cmp-{uuid.uuid4().hex}/copy"
    cairn.copy(step, dst)
    assert_same(cairn.load(dst), state)
    assert open_checkpoint(dst).manifest.version == 3


def test_copy_recompresses_when_asked(tmp_path, capsys):
    from cairn._cli.main import main

    state = state_of()
    cairn.save(tmp_path / "raw", state, compression=False, user_metadata={"note": 1})
    stats = cairn.copy(tmp_path / "raw", tmp_path / "planes", compression="planes")
    ck, leaves = leaves_of(tmp_path / "planes")
    assert ck.manifest.version == 3 and ck.manifest.metadata == {"note": 1}
    assert {leaf.codec for leaf, _ in leaves.values()} == {"planes"}
    assert stats.bytes_copied < sum(leaf.nbytes for leaf, _ in leaves.values())
    assert_same(cairn.load(tmp_path / "planes"), state)
    assert main(["cp", str(tmp_path / "planes"), str(tmp_path / "back"), "--compression", "false"]) == 0
    assert open_checkpoint(tmp_path / "back").manifest.version == 2
    assert_same(cairn.load(tmp_path / "back"), state)
    keys = jax.random.split(jax.random.key(0), 5)
    w = state["params"]["w"]
    cairn.save(tmp_path / "keys", {"k": keys, "w": w}, compression=False)
    cairn.copy(tmp_path / "keys", tmp_path / "keys2", compression=True)  # typed keys keep their implementation
    _, src = leaves_of(tmp_path / "keys")
    _, dst = leaves_of(tmp_path / "keys2")
    assert (dst["k"][0].kind, dst["k"][0].impl, dst["k"][0].impl_shape) == (
        "prng_key", src["k"][0].impl, src["k"][0].impl_shape)
    got = cairn.load(tmp_path / "keys2", {"k": keys, "w": w})
    assert jax.dtypes.issubdtype(got["k"].dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(got["k"]), jax.random.key_data(keys))
    assert np.asarray(got["w"]).tobytes() == np.asarray(w).tobytes()
    cairn.copy(tmp_path / "keys", tmp_path / "keys3")  # stored bytes as they are
    got = cairn.load(tmp_path / "keys3", {"k": keys, "w": w})
    assert np.array_equal(jax.random.key_data(got["k"]), jax.random.key_data(keys))
    cairn.save(tmp_path / "obj", {"o": Opaque(3), "pp": cairn.PerProcess({"pos": 4})}, compression=False)
    cairn.copy(tmp_path / "obj", tmp_path / "obj2", compression=True)  # user objects and per-process values
    got = cairn.load(tmp_path / "obj2")
    assert type(got["o"]) is Opaque and got["o"].n == 3 and got["pp"] == {"pos": 4}


def test_recompressing_copy_keeps_chunks_and_shardings(tmp_path, mesh8):
    """A recompressed copy differs from its source only in how blocks are stored: the same grid of
    chunks (a load onto the saved sharding reads one run per shard, not the whole array per shard),
    the same sharding record (a load given only a mesh restores the saved shardings)."""
    w = trained((64, 256), seed=7)
    s = NamedSharding(mesh8, P(None, "x"))  # column shards: each a strided region of the whole array
    state = {"w": jax.device_put(w, s), "b": jax.device_put(trained((256,), seed=8), NamedSharding(mesh8, P("x")))}
    cairn.save(tmp_path / "raw", state, compression=False)
    cairn.copy(tmp_path / "raw", tmp_path / "z", compression="planes")
    _, src = leaves_of(tmp_path / "raw")
    ck, dst = leaves_of(tmp_path / "z")
    assert ck.manifest.version == 3
    for name in ("w", "b"):
        a, b = src[name][0], dst[name][0]
        assert b.codec == "planes" and b.grid == a.grid and b.sharding == a.sharding and b.sharding is not None
    assert len(dst["w"][0].grid[1]) == 9  # 8 column chunks, kept
    got = cairn.load(tmp_path / "z", mesh=mesh8)
    assert got["w"].sharding.spec == s.spec
    assert np.asarray(got["w"]).tobytes() == w.tobytes()


def test_inspect_shows_codec_and_stored_bytes(tmp_path):
    from cairn._cli.main import inspect_data

    cairn.save(tmp_path / "c", state_of(), compression=True)
    data = inspect_data(str(tmp_path / "c"))
    leaves = {leaf["path"]: leaf for leaf in data["items"]["params"]["leaves"] if "codec" in leaf}
    assert leaves["w"]["codec"] == fast() and leaves["w"]["stored_bytes"] < leaves["w"]["nbytes"]
    assert leaves["noise"]["codec"] == "none" and leaves["noise"]["stored_bytes"] == leaves["noise"]["nbytes"]


def test_export_to_safetensors_reads_through_the_codecs(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file

    state = state_of()
    cairn.save(tmp_path / "c", state, compression=True)
    cairn.export_safetensors(tmp_path / "c", tmp_path / "out", item="params")
    files = sorted((tmp_path / "out").rglob("*.safetensors")) if (tmp_path / "out").is_dir() else [tmp_path / "out"]
    got = {}
    for f in files:
        got.update(load_file(str(f)))
    got = {k.rsplit("/", 1)[-1]: v for k, v in got.items()}
    assert got["ids"].tobytes() == state["params"]["ids"].tobytes()
    assert got["zeros"].tobytes() == state["params"]["zeros"].tobytes()


def test_read_once_and_dry_run_on_a_compressed_checkpoint(tmp_path):
    """A replicated target read once (then moved by collectives) decodes through the same reader; the
    dry run of a load plans a compressed checkpoint without failing."""
    full = trained((256, 512))
    path = where_of("memory", tmp_path)
    m8 = jax.make_mesh((8,), ("x",))
    cairn.save(path, {"w": jax.device_put(full, NamedSharding(m8, P("x")))}, compression="planes")
    _, leaves = leaves_of(path)
    leaf, block = leaves["w"]
    stored = sum(sum(leaf.stored_sizes(c, block)) for c in range(len(leaf.chunks)))
    replicated = NamedSharding(m8, P())
    stats = cairn.LoadStats()
    got = cairn.load(path, {"w": jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=replicated)},
                     read_once=True, stats=stats)
    assert np.asarray(got["w"]).tobytes() == full.tobytes() and got["w"].sharding == replicated
    assert stats.bytes_read == stored  # each stored byte once, whatever the replication
    plan = cairn.plan_load(path, {"w": jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=replicated)})
    assert plan is not None


@pytest.mark.parametrize("kind", ["local", "memory"])
@pytest.mark.parametrize("case", ["numpy", "same", "columns", "mesh42", "replicated"])
def test_plan_predicts_the_stored_bytes_a_load_reads(tmp_path, kind, case, mesh):
    """`cairn.plan_load` counts what a load of a compressed checkpoint reads from storage: the stored
    (compressed) bytes of the blocks it needs, equal to the real load's `LoadStats.bytes_read`, as the
    same, a resharded and a read-once (route-estimated) load."""
    from cairn._load import engine as _load
    from cairn._load.readonce import stored_nbytes
    from cairn._load.source import CairnSource
    from cairn._storage.location import resolve

    full = trained((512, 1024))  # 1 MiB of bf16 in 8 row chunks, 32 blocks of 4 KiB each
    m8 = jax.make_mesh((8,), ("x",))
    path = where_of(kind, tmp_path)
    state = {"w": jax.device_put(full, NamedSharding(m8, P("x"))), "b": trained((4096,), np.float32, 1),
             "ids": np.arange(50_000, dtype=np.int32) % 7}
    from cairn._save import engine

    engine.prepare(resolve(path), state, block_size=BLOCK, compression=True).run()
    _, leaves = leaves_of(path)
    stored = {k: stored_nbytes(leaf, block) for k, (leaf, block) in leaves.items()}
    assert leaves["w"][0].codec == fast() and stored["w"] < 0.75 * full.nbytes
    sharding = {"same": NamedSharding(m8, P("x")), "columns": NamedSharding(m8, P(None, "x")),
                "mesh42": NamedSharding(mesh, P("y", "x")), "replicated": NamedSharding(m8, P()),
                "numpy": None}[case]
    target = None if sharding is None else {
        "w": jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=sharding), "b": None, "ids": None}
    read_once = True if case == "replicated" else None
    stats = cairn.LoadStats()
    got = _load.load(CairnSource.open(resolve(path)), target, stats=stats, read_once=read_once)
    assert np.asarray(got["w"]).tobytes() == full.tobytes()
    plan = cairn.plan_load(path, target, read_once=read_once)
    (p,) = plan.processes
    assert (p.bytes_read, p.requests) == (stats.bytes_read, stats.reads)
    assert plan.array_bytes == full.nbytes + 4 * 4096 + 4 * 50_000
    assert plan.stored == sum(stored.values()) < 0.8 * plan.array_bytes
    # Each stored block read once, except a reshard's: every column box needs a piece of every block.
    assert stats.bytes_read == plan.stored  # each stored block once (one process merges its boxes' reads)
    if case == "replicated":  # one process: the read-once route is the direct one, priced in stored bytes
        (r,) = plan.routes
        assert r.kind == "direct" and r.by == "forced"
        assert [a.storage_bytes for a in r.alternatives if a.kind == "direct"] == [stored["w"]]


def test_routes_count_stored_bytes(tmp_path):
    """The read routes' estimates of a compressed leaf are its stored bytes: with four (simulated)
    processes on an object store, the replicated target is read once, and the chosen route's estimate
    is what the planned reads of all processes add up to: the leaf's stored bytes, not its raw ones."""
    from cairn._load.readonce import stored_nbytes

    full = trained((512, 1024))
    m8 = jax.make_mesh((8,), ("x",))
    from cairn._save import engine
    from cairn._storage.location import resolve

    path = where_of("memory", tmp_path)
    engine.prepare(resolve(path), {"w": jax.device_put(full, NamedSharding(m8, P("x")))}, block_size=BLOCK,
                   compression="planes").run()
    _, leaves = leaves_of(path)
    stored = stored_nbytes(*leaves["w"])
    assert stored < 0.75 * full.nbytes
    repl = {"w": jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=NamedSharding(m8, P()))}
    bw = {"storage_gbps": 2.0, "interconnect_gbps": 100.0, "request_ms": 2.0}
    plan = cairn.plan_load(path, repl, processes=4, bandwidths=bw)
    (r,) = plan.routes
    alts = {a.kind: a for a in r.alternatives}
    assert r.kind == "refined" and plan.read_once_leaves == 1
    assert plan.bytes_read == stored  # the planned reads: each stored block once, cluster-wide
    # The estimate scales one process's stored bytes by the processes (blocks compress unequally).
    assert alts["refined"].storage_bytes == pytest.approx(stored, rel=0.01)
    assert alts["direct"].storage_bytes == 4 * stored  # each process would read all of it
    assert all(p.bytes_read <= 0.3 * stored for p in plan.processes)
    # The dry run of the direct route reads what the direct route's estimate says.
    direct = cairn.plan_load(path, repl, processes=4, read_once=False)
    assert direct.bytes_read == alts["direct"].storage_bytes


def test_small_compressed_leaves_share_reads(tmp_path):
    """Whole small compressed leaves whose stored blocks lie back to back are read together, as raw ones
    are (one request for many on an object store), checked block by block and decoded; the dry run
    counts the same reads; a flipped stored byte fails the load naming the leaf and its block."""
    from cairn._load.readonce import stored_nbytes

    state = {"p": [trained((64, 64), seed=i) for i in range(40)]}  # 8 KiB each
    path = tmp_path / "c"
    cairn.save(path, state, compression="planes")
    _, leaves = leaves_of(path)
    assert {leaf.codec for leaf, _ in leaves.values()} == {"planes"}
    stored = sum(stored_nbytes(leaf, block) for leaf, block in leaves.values())
    stats = cairn.LoadStats()
    got = cairn.load(path, stats=stats)
    assert all(np.asarray(g).tobytes() == w.tobytes() for g, w in zip(got["p"], state["p"]))
    assert stats.reads == 1 and stats.bytes_read == stored  # one run of every leaf's stored blocks
    (p,) = cairn.plan_load(path).processes
    assert (p.bytes_read, p.requests) == (stats.bytes_read, stats.reads)
    leaf, _ = leaves["7"]  # item "p", leaf 7
    _, off = leaf.chunks[0]
    (data,) = (path / "p").glob("p*.bin")
    raw = bytearray(data.read_bytes())
    raw[off + 10] ^= 0x08
    data.write_bytes(bytes(raw))
    with pytest.raises(cairn.CorruptCheckpointError, match=rf"{path}: checksum mismatch .* block 0 of chunk 0 .*"
                                                           r"leaf 'p/7'"):
        cairn.load(path)


def test_recompressing_copy_streams_within_its_budget(tmp_path):
    """`copy(..., compression=...)` reads and writes slab by slab: a 24 MiB array recompressed with a
    4 MiB budget never has the array (or the state) in memory at once, and comes back the same."""
    import tracemalloc

    from cairn._load.readonce import stored_nbytes

    big = trained((3 << 20, 4), seed=4)  # 24 MiB of bf16
    state = {"big": big, "small": trained((100, 7), np.float32, 5), "step": 3, "blob": b"abc"}
    cairn.save(tmp_path / "raw", state, compression=False)
    tracemalloc.start()
    try:
        stats = cairn.copy(tmp_path / "raw", tmp_path / "packed", compression=True, budget_bytes=4 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, peak  # slabs of 1 MiB, a few in flight; the array is 24 MiB
    ck, leaves = leaves_of(tmp_path / "packed")
    assert ck.manifest.version == compressed_version(leaves) and leaves["big"][0].codec == fast()
    assert stats.bytes_copied == sum(stored_nbytes(leaf, block) for leaf, block in leaves.values()) < 0.75 * big.nbytes
    got = cairn.load(tmp_path / "packed")
    assert np.asarray(got["big"]).tobytes() == big.tobytes() and got["step"] == 3 and got["blob"] == b"abc"
    assert np.asarray(got["small"]).tobytes() == state["small"].tobytes()


def test_a_compressed_route_fetches_only_the_records_it_prices(tmp_path):
    """Pricing a compressed leaf's route reads the stored sizes of the chunks the representative process
    touches, not the records of the whole leaf (metadata work proportional to a process's reads)."""
    from cairn._load.readonce import route
    from cairn._load.source import open_checkpoint

    full = trained((512, 1024))
    m8 = jax.make_mesh((8,), ("x",))
    path = where_of("memory", tmp_path)
    from cairn._save import engine
    from cairn._storage.location import resolve

    columns = NamedSharding(m8, P(None, "x"))  # 8 column chunks: no two merge into one
    engine.prepare(resolve(path), {"w": jax.device_put(full, columns)}, block_size=BLOCK,
                   compression="planes").run()
    ck = open_checkpoint(path)
    index = next(iter(ck.indexes.values()))
    (i, leaf), = [(i, lf) for i, lf in enumerate(index.leaves) if isinstance(lf, fmt.ArrayLeaf)]
    assert index.table is not None and len(leaf.chunks) == 8 and leaf.codec == "planes"
    rank = {d.id: k // 2 for k, d in enumerate(sorted(m8.devices.flat, key=lambda d: d.id))}  # 4 processes
    r = route(leaf, columns, index.block_size, True, 4, True, process_of=lambda d: rank[d.id])
    assert r.kind == "direct" and r.plan is not None
    got = index.table._got.get(i, {})
    assert sorted(got) == [0, 1]  # process 0's two chunks
    assert r.cost == 4 * sum(sum(leaf.stored_sizes(c, index.block_size)) for c in (0, 1))


MOUNTINFO = """\
22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw
30 22 0:40 / /mnt/lustre rw,relatime shared:5 - lustre 10.0.0.1@tcp:/fs rw,flock
31 30 259:2 / /mnt/lustre/scratch rw shared:6 - xfs /dev/nvme1n1 rw
32 22 0:41 / /mnt/my\\040bucket rw,nosuid,nodev shared:7 master:2 - fuse.gcsfuse my-bucket rw,user_id=0
33 22 0:42 / /media/usb rw - fuseblk /dev/sdb1 rw
34 22 0:43 / /srv/nfs rw - nfs4 server:/export rw,vers=4.2
"""


@pytest.mark.parametrize("path, fstype, network", [
    ("/home/me/ckpt", "ext4", False),
    ("/mnt/lustre/run1/step_10", "lustre", True),  # below the mount, not yet created
    ("/mnt/lustre/scratch/x", "xfs", False),  # a local disk mounted inside the network one
    ("/mnt/lustre2/x", "ext4", False),  # a name that only starts like a mount point
    ("/mnt/my bucket/ckpt", "fuse.gcsfuse", True),  # an escaped space in the mount point
    ("/media/usb/ckpt", "fuseblk", False),  # FUSE over a local block device
    ("/srv/nfs", "nfs4", True),
])
def test_the_filesystem_of_a_path_is_read_from_mountinfo(path, fstype, network):
    from cairn._storage.fstype import is_network, mount_type

    assert mount_type(path, MOUNTINFO) == fstype
    assert is_network(fstype) is network
    assert mount_type(path, "") is None and not is_network(None)


@pytest.mark.parametrize("fstype, version", [("nfs4", 3), ("fuse.gcsfuse", 3), ("lustre", 3), ("fuseblk", 2),
                                             ("ext4", 2)])
def test_auto_compresses_on_network_filesystems(tmp_path, monkeypatch, fstype, version):
    """A local path on NFS, Lustre or a FUSE mount of a bucket is storage of kind "network" (1 GiB/s by
    default), where "auto" compresses on a host of 12 cores; a local disk's kind is "local"."""
    from cairn._storage import LocalStorage
    from cairn._storage import fstype as fs

    monkeypatch.setattr(codecpolicy, "coder_cores", lambda: 12)

    real = os.path.realpath(tmp_path)
    info = tmp_path / "mountinfo"
    info.write_text(f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n40 22 0:50 / {real} rw - {fstype} srv:/x rw\n")
    monkeypatch.setattr(fs, "MOUNTINFO", str(info))
    assert LocalStorage(str(tmp_path)).kind == ("network" if version == 3 else "local")
    state = state_of()
    cairn.save(tmp_path / "ck", state)
    written = json.loads((tmp_path / "ck" / "manifest.json").read_bytes())["version"]
    if version == 3:
        _, leaves = leaves_of(tmp_path / "ck")
        assert leaves["w"][0].codec == fast() and written == compressed_version(leaves)
    else:
        assert written == version
    assert_same(cairn.load(tmp_path / "ck"), state)
    cairn.save(tmp_path / "off", state, compression=False)  # an explicit setting still holds there
    assert json.loads((tmp_path / "off" / "manifest.json").read_bytes())["version"] == 2


def test_the_auto_formula():
    """`compression_pays`: each direction takes the longer of the transfer of the stored bytes and the
    codec's work on the raw ones (the two overlap), against the raw transfer both ways."""
    from cairn._save.codecpolicy import (
        CODEC_SPEEDS,
        compression_can_pay,
        compression_pays,
        predicted_seconds,
    )

    gib = float(1 << 30)
    enc, dec = CODEC_SPEEDS["planes"].on(12)
    assert enc > CODEC_SPEEDS["planes"].encode and CODEC_SPEEDS["planes"].on(1) == (
        CODEC_SPEEDS["planes"].encode, CODEC_SPEEDS["planes"].decode)
    plain, coded = predicted_seconds(gib, gib / 2, "planes", 0.1 * gib, 12)
    assert plain == pytest.approx(20.0) and coded == pytest.approx(10.0)  # a slow link: the bytes decide
    plain, coded = predicted_seconds(gib, gib / 2, "planes", 100 * gib, 12)
    assert coded == pytest.approx(gib / enc + gib / dec)  # a fast one: the codec decides
    assert compression_pays(gib, gib / 2, "planes", 0.1 * gib, 12)
    assert not compression_pays(gib, gib / 2, "planes", 100 * gib, 12)
    assert not compression_pays(gib, 0.97 * gib, "planes", 0.1 * gib, 12)  # saves under AUTO_MIN_GAIN
    assert not compression_pays(gib, 0.0, "none", 0.1 * gib, 12)
    # the local-disk rule is the same formula: not even a leaf that codes to nothing pays at 8 GiB/s
    assert not compression_can_pay(8 * gib, 12) and compression_can_pay(0.5 * gib, 1)


def test_the_auto_formula_each_way_and_at_the_measured_codec_speed():
    """Writes and reads priced at their own bandwidths; the codecs at the factor the host measured."""
    from cairn._save.codecpolicy import CODEC_SPEEDS, compression_pays, predicted_seconds

    gib = float(1 << 30)
    enc, dec = CODEC_SPEEDS["planes"].on(4)
    plain, coded = predicted_seconds(gib, gib / 2, "planes", 0.1 * gib, 4, read_bandwidth=1000 * gib)
    assert plain == pytest.approx(10.0 + 0.001) and coded == pytest.approx(5.0 + gib / dec)
    plain, coded = predicted_seconds(gib, gib / 2, "planes", 1000 * gib, 4, factor=0.5)
    assert coded == pytest.approx(2 * gib / enc + 2 * gib / dec)
    # the same leaf pays on an idle host and not where the codecs get a tenth of their speed
    assert compression_pays(gib, gib / 2, "planes", 0.5 * gib, 4)
    assert not compression_pays(gib, gib / 2, "planes", 0.5 * gib, 4, factor=0.1)
    # coded transfers priced at what they reached: a link that slows to a third while the host codes
    plain, coded = predicted_seconds(gib, gib / 2, "planes", 0.1 * gib, 4, coded_bandwidth=0.03 * gib,
                                     coded_read_bandwidth=0.05 * gib)
    assert plain == pytest.approx(20.0) and coded == pytest.approx(0.5 / 0.03 + 0.5 / 0.05)
    assert not compression_pays(gib, gib / 2, "planes", 0.1 * gib, 4, coded_bandwidth=0.03 * gib,
                                coded_read_bandwidth=0.05 * gib)


def test_the_codec_factor_from_known_spans():
    """`CodecMeter`: the time the per-platform figures predict, at the concurrency the tasks had, over
    the time the coder pool was busy; the median of the last saves; 1.0 before any."""
    from cairn._save.codecpolicy import CODEC_SPEEDS, FACTOR_RANGE, MIN_CODED_SAMPLE, CodecMeter

    m = CodecMeter()
    assert m.factor() == 1.0
    one = CODEC_SPEEDS["planes"].on(1)[0]
    n = 64 << 20
    assert m.record([(0.0, 1.0)], {"planes": MIN_CODED_SAMPLE - 1}, cores=4) is None  # too little coded
    # one task at a time, at twice the figure's time: 0.5
    assert m.record([(0.0, n / one), (n / one, 2 * n / one)], {"planes": n}, cores=4) == pytest.approx(0.5)
    # two tasks at once, the pool busy as long as two cores' figure says: 1.0
    two = CODEC_SPEEDS["planes"].on(2)[0]
    assert m.record([(0.0, n / two), (0.0, n / two)], {"planes": n}, cores=4) == pytest.approx(1.0)
    assert m.factor() == pytest.approx(0.75)
    assert m.record([(0.0, 1e6)], {"planes": n}, cores=4) == FACTOR_RANGE[0]  # clamped
    m.clear()
    assert m.factor() == 1.0


def test_auto_prices_with_what_was_measured(tmp_path, monkeypatch):
    """On a network filesystem (a kind whose link is measured), "auto" prices with the default until
    something was measured, then with the measurement; a declared figure would win (see
    tests/storage/test_measured.py). SaveStats says which."""
    from cairn._save.codecpolicy import CODEC_METER
    from cairn._storage.local import LocalStorage
    from cairn._storage.location import resolve
    from cairn._storage.measured import METER, record, sample_of

    monkeypatch.setattr(codecpolicy, "coder_cores", lambda: 12)
    monkeypatch.setattr(LocalStorage, "network", property(lambda self: True))
    # "planes" only: the thresholds below are its speeds' ("blosc2", faster, would still pay at 0.02x)
    monkeypatch.setattr(_codecs, "_blosc2_found", False)
    state = state_of()
    path = str(tmp_path / "nfs" / "c")
    stats = cairn.save(path, state)  # 1 GiB/s, a network filesystem's default: weights pay
    assert stats.compression.startswith("auto (network storage at 1.00 GiB/s (default), 12 cores): ")
    assert leaves_of(path)[1]["w"][0].codec == "planes"
    storage = resolve(path).storage
    gib = 1 << 30
    for direction in ("write", "read"):  # measured at 16 GiB/s each way: no codec keeps up
        record(storage, direction, sample_of(gib, 1 / 16, 1 / 16))
    stats = cairn.save(path, state, overwrite=True)
    assert stats.compression == "raw"
    METER.clear()
    record(storage, "write", sample_of(gib, 20.0, 20.0))  # 50 MiB/s (reads: the same, unmeasured)
    stats = cairn.save(path, state, overwrite=True)
    assert stats.compression.startswith("auto (network storage at 0.05 GiB/s (measured), 12 cores): ")
    assert leaves_of(path)[1]["w"][0].codec == "planes"
    CODEC_METER.record([(0.0, 1e6)], {"planes": 64 << 20}, cores=1)  # a host whose codecs crawl (0.02x)
    stats = cairn.save(path, state, overwrite=True)
    assert "codecs at 0.02x" in stats.compression
    assert leaves_of(path)[1]["w"][0].codec == "none"  # weights no longer pay; zeros still do
    assert leaves_of(path)[1]["zeros"][0].codec == "zstd"
    assert_same(cairn.load(path), state)


def test_auto_prices_each_leaf(tmp_path, monkeypatch):
    """On a fast object store (4 GiB/s declared, 12 cores) "auto" codes a leaf only where it pays:
    zeros (zstd codes them to almost nothing, faster than the link) yes, trained bf16 weights
    (1.5x, but planes decode slower than 4 GiB/s) no where only cairn's own codecs are there, and
    "blosc2-lz4" where python-blosc2 is (it codes and decodes faster than the link by its figures on
    12 cores, `codecpolicy.CODEC_SPEEDS`); random bytes no. At 16 GiB/s no codec keeps up but on zeros.
    SaveStats says so."""
    from cairn._storage import MemoryStorage

    monkeypatch.setattr(codecpolicy, "coder_cores", lambda: 12)
    monkeypatch.setattr(MemoryStorage, "bandwidth", 4.0 * (1 << 30))
    state = state_of()
    path = where_of("memory", tmp_path)
    with monkeypatch.context() as m:
        m.setattr(_codecs, "_blosc2_found", False)  # cairn's own codecs only
        stats = cairn.save(path, state)
    ck, leaves = leaves_of(path)
    assert ck.manifest.version == 3
    assert leaves["zeros"][0].codec == "zstd"
    assert leaves["w"][0].codec == "none" and leaves["noise"][0].codec == "none"
    assert stats.compression.startswith("auto (object storage at 4.00 GiB/s (declared), 12 cores): ")
    assert "zstd" in stats.compression and "none" in stats.compression
    assert_same(cairn.load(path), state)
    if _codecs.blosc2_available():
        # Installed, python-blosc2 changes nothing "auto" writes: a default install reads it.
        cairn.save(path, state, overwrite=True)
        ck, leaves = leaves_of(path)
        assert ck.manifest.version == 3 and {leaf.codec for leaf, _ in leaves.values()} <= {"zstd", "planes", "none"}
        assert leaves["w"][0].codec == "none"
        # "fast" takes "blosc2-lz4" for the weights, predicted to save and load them sooner than "planes".
        stats = cairn.save(path, state, overwrite=True, compression="fast")
        ck, leaves = leaves_of(path)
        assert leaves["w"][0].codec == "blosc2-lz4" and leaves["noise"][0].codec == "none"
        assert ck.manifest.version == 6 and "blosc2-lz4" in stats.compression
        assert_same(cairn.load(path), state)
    monkeypatch.setattr(MemoryStorage, "bandwidth", 16.0 * (1 << 30))
    stats = cairn.save(path, state, overwrite=True)
    _, leaves = leaves_of(path)
    assert leaves["w"][0].codec == "none" and leaves["b"][0].codec == "none"
    monkeypatch.setattr(MemoryStorage, "bandwidth", None)  # the kind's default, 0.5 GiB/s: weights pay
    stats = cairn.save(path, state, overwrite=True)
    _, leaves = leaves_of(path)
    assert leaves["w"][0].codec == fast() and leaves["noise"][0].codec == "none"
    assert cairn.save(tmp_path / "raw", state).compression == "raw"  # a local disk


def test_a_device_chunk_measured_for_its_codec_is_copied_to_host_once(tmp_path, monkeypatch):
    """`compression=True` samples each leaf's first chunk from a host copy; where that copy is a fresh
    device-to-host copy (an accelerator's chunk: `codecpolicy.fresh_copy`, forced here on CPU arrays) the
    writer uses it instead of copying the chunk again, within `KEEP_HOST_SHARE` of the host's memory
    (0: copied again, as before), and not in a save_async whose snapshot budget left chunks on device.
    The bytes written are the same either way. (Without the host-copy pipeline, which starts those
    copies ahead itself: tests/save/test_host_pipeline.py.)"""
    from cairn._save import engine

    state = {"params": {"w": jax.numpy.asarray(trained((256, 512))),
                        "mu": jax.numpy.asarray(trained((128, 256), np.float32, 1))}}
    monkeypatch.setattr(codecpolicy, "fresh_copy", lambda src: True)
    monkeypatch.setattr(engine, "HOST_PIPELINE_BYTES", 0)
    host = engine.SaveJob._host
    stored = {}
    for share in (0.0, 0.25):
        copies: list[Any] = []

        def counted(self, src, copies=copies):
            if not isinstance(src, np.ndarray):
                copies.append(src)
            return host(self, src)

        monkeypatch.setattr(engine.SaveJob, "_host", counted)
        monkeypatch.setattr(codecpolicy, "KEEP_HOST_SHARE", share)
        path = tmp_path / f"keep{share}"
        cairn.save(path, state, compression=True)
        assert len(copies) == (2 if share else 4), share  # one per chunk, or two without keeping
        stored[share] = sorted(p.read_bytes() for p in path.glob("params/*.bin"))
        assert_same(cairn.load(path), state)
    assert stored[0.0] and stored[0.0] == stored[0.25]
    # a save_async whose snapshot budget left the chunks on device keeps no host copy (its budget holds)
    copies.clear()
    cairn.save_async(tmp_path / "budget", state, compression=True, snapshot_budget_bytes=0).result(timeout=60)
    assert len(copies) == 4
    assert_same(cairn.load(tmp_path / "budget"), state)


@NEEDS_BLOSC2
def test_fast_takes_blosc2_codecs_and_true_never_does(tmp_path, monkeypatch):
    """`compression="fast"` weighs the C-Blosc2 codecs: "blosc2" is a candidate for a leaf only where it codes
    that leaf's elements faster than "planes" on the host's cores (`codecpolicy.blosc2_faster`, a function of
    the count, not of timings), and "blosc2-lz4" is taken where it is predicted to save and load the leaf
    sooner (`codecpolicy.decide_leaf`). The values come back. `True`, with python-blosc2 installed, takes
    "planes" for both on any host: what it writes, every install reads."""
    from cairn._save.codecpolicy import blosc2_faster

    assert not blosc2_faster(2, 2) and blosc2_faster(2, 4) and blosc2_faster(12, 2) and blosc2_faster(12, 4)
    state = {"params": {"w": trained((256, 1024)), "mu": trained((256, 1024), np.float32, 1)}}
    for cores, want in ((2, {"w": "planes", "mu": "blosc2"}), (12, {"w": "blosc2", "mu": "blosc2"})):
        # what "fast" chooses among "planes", "zstd" and "blosc2", before weighing "blosc2-lz4"
        for k, chosen in want.items():
            arr = np.asarray(state["params"][k])
            got = _choose.choose_sized(arr.dtype, arr, blosc2=blosc2_faster(cores, arr.dtype.itemsize))[0]
            assert got == chosen, (cores, k)
        monkeypatch.setattr(codecpolicy, "coder_cores", lambda cores=cores: cores)
        path = tmp_path / f"c{cores}"
        cairn.save(path, state, compression="fast")
        _, leaves = leaves_of(str(path))
        assert {leaves[k][0].codec for k in want} <= {"planes", "blosc2", "blosc2-lz4"}, cores
        assert {leaves[k][0].codec for k in want} & {"blosc2", "blosc2-lz4"}, cores
        assert_same(cairn.load(path), state)
        cairn.save(tmp_path / f"t{cores}", state, compression=True)
        ck, leaves = leaves_of(str(tmp_path / f"t{cores}"))
        assert {k: leaves[k][0].codec for k in want} == {"w": "planes", "mu": "planes"}, cores
        assert ck.manifest.version == 3
    monkeypatch.setattr(_codecs, "_blosc2_found", False)  # not importable: "fast" says what it needs
    with pytest.raises(ValueError, match=r"compression='fast' needs python-blosc2.*cairn-ckpt\[fast\]"):
        cairn.save(tmp_path / "none", state, compression="fast")


def test_true_writes_what_a_default_install_reads(tmp_path, monkeypatch):
    """A save with compression=True where python-blosc2 is importable (the `fast` extra) loads where it is
    not (a default install): True never picks a C-Blosc2 codec."""

    monkeypatch.setattr(codecpolicy, "coder_cores", lambda: 12)
    state = {"params": {f"w{i}": trained((64, 256), np.float32 if i % 2 else ml_dtypes.bfloat16, i)
                        for i in range(6)}}
    cairn.save(tmp_path / "c", state, compression=True)
    ck, leaves = leaves_of(str(tmp_path / "c"))
    assert ck.manifest.version == 3 and {leaf.codec for leaf, _ in leaves.values()} <= {"zstd", "planes", "none"}
    monkeypatch.setattr(_codecs, "_blosc2_found", False)  # the evaluation machine: no python-blosc2
    assert_same(cairn.load(tmp_path / "c"), state)


@NEEDS_BLOSC2
def test_incremental_saves_refer_to_and_delta_against_blosc2_blocks(tmp_path):
    """Version 4 records a "blosc2" block's codec id (4) in its source; an incremental save refers to
    unchanged blosc2 blocks of its base and stores changed ones as deltas against them (the base block
    decoded by "blosc2"), and all of it loads back bit for bit."""
    from cairn._format.blocks import CODEC_IDS, DELTA
    from cairn._format.partfile import PART_VERSION_BLOCKS, block_columns

    def ids(step):
        out = []
        for part in step.glob("*/index.p*.idx"):
            out += block_columns(part.read_bytes(), PART_VERSION_BLOCKS)[1]["codec"].tolist()
        return out

    rng = np.random.default_rng(21)
    w0 = rng.standard_normal((1024, 2048)).astype(ml_dtypes.bfloat16)  # 4 MiB: 4 blocks of 1 MiB
    w1 = w0.copy()
    bits = w1.view(np.uint16).reshape(-1)
    bits[rng.choice(bits.size // 4, 2000, replace=False)] += 1  # the first block changes, a little
    cairn.save(tmp_path / "plain", {"w": w0}, compression="blosc2")
    cairn.save(tmp_path / "s0", {"w": w0}, base=tmp_path / "plain", compression="blosc2")
    st = cairn.save(tmp_path / "s1", {"w": w1}, base=tmp_path / "s0", compression="blosc2")
    assert CODEC_IDS["blosc2"] == 4 and set(ids(tmp_path / "s0")) == {4}
    got = ids(tmp_path / "s1")
    assert got.count(4) == 3 and got.count(DELTA) == 1, got
    assert st.bytes_written < 0.1 * w1.nbytes
    assert np.asarray(cairn.load(tmp_path / "s1")["w"]).tobytes() == w1.tobytes()
    assert np.asarray(cairn.load(tmp_path / "s0")["w"]).tobytes() == w0.tobytes()


def test_compression_blosc2_without_the_library_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(_codecs, "_blosc2_found", False)
    with pytest.raises(ValueError, match=r"cairn-ckpt\[fast\]"):
        cairn.save(tmp_path / "c", {"w": np.zeros(16, np.float32)}, compression="blosc2")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("held", [False, True], ids=["written-as-coded", "all-held-until-the-end"])
def test_coded_buffers_are_lent_again_only_once_written(tmp_path, monkeypatch, held):
    """A compressed save's coders code into buffers lent from the process's `buffers.coded_pool`, each taken
    back for a later task (of this save or the next) once its blocks are written. Written as they are
    coded, buffers are reused within the save and by the next one, and the data files are byte for byte
    those of saves with a new buffer per task; with a storage that holds every part it is given until the
    end (as a client that gathers a file's parts before it sends them), no buffer is lent again while
    held, and the checkpoint loads back bit for bit."""
    from cairn._core import buffers
    from cairn._load import engine as load_engine
    from cairn._storage.local import LocalStorage

    monkeypatch.setattr(codecpolicy, "coder_cores", lambda: 4)  # a coder pool, whatever the test host has
    # The loads keep the buffers kept for the next save (`cairn.load` frees them: `release_save_buffers`).
    monkeypatch.setattr(load_engine, "release_save_buffers", lambda: None)
    # Tasks of about a block's bytes (1 MiB), a dozen in the one data file (threads=1): the writer is done
    # with task k before task k + 6 is submitted (`_in_order`'s window: 4 coders and one), so reuse is
    # certain when written as coded, whatever the threads' timing.
    monkeypatch.setattr(pipeline, "RUN_BLOCKS", 1)
    state = {"params": {f"w{i}": trained((256, 256), ml_dtypes.bfloat16 if i % 2 else np.float32, seed=i)
                        for i in range(64)}}
    pool = buffers.SlabPool()
    monkeypatch.setattr(buffers, "coded_pool", pool)
    if held:
        write = LocalStorage.write

        def write_at_the_end(self, key, parts):
            return write(self, key, iter(list(parts)))

        monkeypatch.setattr(LocalStorage, "write", write_at_the_end)
    files = {}
    for n, lend in enumerate((False, True, True)):
        monkeypatch.setattr(pipeline, "LEND_CODED_BUFFERS", lend)
        path = tmp_path / f"c{n}"
        cairn.save(path, state, compression=True, threads=1)
        files[n] = sorted(p.read_bytes() for p in (path / "params").glob("*.bin"))
        assert_same(cairn.load(path), state)
        if n == 1:
            first = (pool.made, pool.reused)
    assert files[0] == files[1] == files[2]
    made, reused = first
    assert made > 0 and pool.lent_bytes == 0
    if held:
        assert reused == 0  # every buffer of the save was held at once: none was lent twice
        # ...and all were kept (the cap is what was lent at once), so the next save's first lend finds
        # the buffer of its size that the first save's first task had
        assert pool.reused > 0
    else:
        assert reused > 0  # within the save


@NEEDS_BLOSC2
def test_small_blosc2_leaves_of_one_checkpointable_write_the_same_bytes_gathered(tmp_path, monkeypatch):
    """Many small "blosc2" leaves of one checkpointable are coded in batches whose stored chunks are gathered
    into shared buffers (`codecs.BLOSC2_JOIN_BYTES`): the data files are byte for byte those of chunks kept
    one by one, the load gives the leaves back, and a flipped stored byte anywhere in a leaf's blocks (the
    header of a block in the middle of a gathered buffer too) fails the load naming that leaf."""

    monkeypatch.setattr(codecpolicy, "coder_cores", lambda: 4)  # a coder pool, whatever the test host has
    state = {"params": {f"w{i}": trained((128, 96 + 32 * (i % 3)), ml_dtypes.bfloat16 if i % 2 else np.float32,
                                         seed=i) for i in range(48)}}
    files = {}
    for join in (0, _codecs.BLOSC2_JOIN_BYTES, 5000):
        monkeypatch.setattr(_codecs, "BLOSC2_JOIN_BYTES", join)
        path = tmp_path / f"c{join}"
        cairn.save(path, state, compression="blosc2", threads=1)  # one data file
        files[join] = sorted(p.read_bytes() for p in (path / "params").glob("*.bin"))
        got = cairn.load(path)
        assert all(np.asarray(got["params"][k]).tobytes() == v.tobytes() for k, v in state["params"].items())
    assert files[0] == files[_codecs.BLOSC2_JOIN_BYTES] == files[5000]
    _, leaves = leaves_of(path)
    assert {leaf.codec for leaf, _ in leaves.values()} == {"blosc2"}
    (data,) = (path / "params").glob("*.bin")
    good = data.read_bytes()
    for name in ("w9", "w30"):
        leaf, _ = leaves[name]
        _, off = leaf.chunks[0]
        for at in (0, 3, 12, 40, 200):  # the chunk header (flags, typesize, sizes), then its streams
            raw = bytearray(good)
            raw[off + at] ^= 0x10
            data.write_bytes(bytes(raw))
            with pytest.raises(cairn.CorruptCheckpointError, match=rf"{path}.*'params/{name}'"):
                cairn.load(path)
    data.write_bytes(good)
