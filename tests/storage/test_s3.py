"""Full save / load / resharding / manager scenarios on object stores: S3 (moto's server) and
Azure Blob (Azurite), both on 127.0.0.1. (GCS: tests/storage/test_gcs.py, reads only.)

Faults (S3 only) come from `FaultProxy`, an HTTP proxy between cairn and the
server: it answers chosen requests with 5xx/429 errors, or stops answering at
all (the server is gone, from the client's side), while moto's state stays
inspectable through the server itself.
"""

from __future__ import annotations

import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from _s3server import FaultProxy
from cairn._save import engine as _save
from cairn._storage.location import resolve

MiB = 1 << 20


@pytest.fixture(params=["s3", "azure"])
def store(request):
    """Each server that takes cairn's writes, in turn."""
    return request.getfixturevalue(request.param)


@pytest.fixture
def bucket(store):
    return store.new_bucket()


@pytest.fixture
def opts(store):
    # Small parts so modest test arrays exercise multipart uploads and split reads.
    return store.options(part_size=5 * MiB, read_part_size=1 * MiB)


@pytest.fixture
def s3_bucket(s3):
    return s3.new_bucket()


@pytest.fixture
def s3_opts(s3):
    return s3.options(part_size=5 * MiB, read_part_size=1 * MiB)


@pytest.fixture
def proxy(s3):
    p = FaultProxy(s3.port).start()
    yield p
    p.stop()


def fast_retries(options, **extra):
    """Quick, few retries: error tests should fail in well under a second."""
    return {**options, "max_retries": 2, "retry_backoff": 0.01, "max_backoff": 0.05,
            "connect_timeout": "2s", "timeout": "10s", **extra}


def sharded(mesh, shape, spec, dtype=jnp.float32, seed=0):
    x = jax.random.normal(jax.random.key(seed), shape, dtype=jnp.float32).astype(dtype)
    return jax.device_put(x, NamedSharding(mesh, spec))


# ---------------------------------------------------------------------- round trips


def test_save_load_metadata_roundtrip(store, bucket, opts, mesh8):
    path = store.url(bucket, "runs/a/step_1")
    w = sharded(mesh8, (64, 32), P("x"))
    state = {"params": {"w": w, "b": np.arange(5, dtype=np.int64)},
             "meta": {"step": 1, "name": "run a", "none": None, "blob": b"\x00\x01"}}
    stats = cairn.save(path, state, storage_options=opts, compression=False)  # raw: sizes below are exact
    assert stats.bytes_written >= w.nbytes + 40 and stats.retries == 0
    keys = store.keys(bucket, "runs/a/step_1/")
    assert "runs/a/step_1/manifest.json" in keys
    assert not any("cairn-tmp" in k for k in keys)  # object stores commit in place, no rename
    out = cairn.load(path, storage_options=opts)
    np.testing.assert_array_equal(out["params"]["w"], np.asarray(w))
    np.testing.assert_array_equal(out["params"]["b"], np.arange(5))
    assert out["meta"] == state["meta"]
    info = cairn.metadata(path, storage_options=opts)
    assert info["params"]["w"].shape == (64, 32) and info["params"]["w"].dtype == np.float32


def test_reshard_on_load_and_partial(store, bucket, opts, mesh8, mesh42):
    path = store.url(bucket, "reshard")
    w = sharded(mesh8, (128, 64), P("x", None), seed=1)
    v = sharded(mesh8, (8, 256), P(None, "x"), dtype=jnp.bfloat16, seed=2)
    cairn.save(path, {"params": {"w": w, "v": v}, "opt": {"m": np.ones((3, 3))}}, storage_options=opts)
    target = {"params": {
        "w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh42, P("y", "x"))),
        "v": NamedSharding(mesh42, P("x", "y")),
    }}
    out = cairn.load(path, target, storage_options=opts)  # reads only "params"
    assert out["params"]["w"].sharding == target["params"]["w"].sharding
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(out["params"]["v"]), np.asarray(v))
    assert set(out) == {"params"}


def test_multipart_upload_and_split_reads(store, bucket, opts):
    """Data files bigger than several parts go up as multipart uploads and load bitwise."""
    rng = np.random.default_rng(3)
    big = rng.standard_normal((3 * MiB + 7,), dtype=np.float32)  # 12 MiB: three 5 MiB parts
    path = store.url(bucket, "big")
    cairn.save(path, {"x": big}, storage_options=opts)
    data = [k for k in store.keys(bucket, "big/") if k.endswith(".bin")]
    assert store.parts(bucket, data[0]) == 3
    assert store.open_uploads(bucket) == 0
    np.testing.assert_array_equal(cairn.load(path, storage_options=opts)["x"], big)


def test_whole_arrays_back_to_back_share_requests_up_to_plan_read_size(store, bucket, opts):
    """A numpy load of medium leaves reads runs of whole arrays, each up to `plan_read_size`, not a leaf each."""
    rng = np.random.default_rng(5)
    tree = {f"w{i:02d}": rng.standard_normal((512, 1024), dtype=np.float32) for i in range(12)}  # 2 MiB each
    path = store.url(bucket, "medium")
    cairn.save(path, {"params": tree}, storage_options=opts, compression=False)  # raw whole arrays, in runs
    data = [k for k in store.keys(bucket, "medium/") if k.endswith(".bin")]
    reads = {}
    for size in (4 * MiB, 8 * MiB):
        stats = cairn.LoadStats()
        got = cairn.load(path, storage_options={**opts, "plan_read_size": size}, stats=stats)["params"]
        assert all(np.array_equal(got[k], v) for k, v in tree.items())
        assert stats.bytes_read == 12 * 2 * MiB
        reads[size] = stats.reads
    # Runs never span data files, and each holds at most size / 2 MiB arrays.
    assert reads[8 * MiB] <= len(data) + 12 // 4, (reads, len(data))
    assert reads[4 * MiB] <= len(data) + 12 // 2 and reads[8 * MiB] < reads[4 * MiB] < 12, reads
    # And the dry run counts the same requests.
    plan = cairn.plan_load(path, storage_options={**opts, "plan_read_size": 8 * MiB})
    assert sum(p.requests for p in plan.processes) == reads[8 * MiB]


def test_a_stated_read_size_is_what_the_plan_and_the_gets_use(s3_bucket, s3, proxy):
    """`read_size` is one figure the storage states (`preferred_read`): the load plans runs up to it and
    sends each as one GET (`read_part_size` and `plan_read_size` follow it unless given apart)."""
    from cairn._storage.obsettings import Tuning
    from cairn._storage.obstore import ObjectStorage

    t = Tuning(read_size=8 * MiB)
    assert (t.read_part_size, t.plan_read_size) == (8 * MiB, 8 * MiB)
    assert Tuning(read_size=8 * MiB, plan_read_size=2 * MiB).read_part_size == 8 * MiB
    with pytest.raises(ValueError, match="read_size"):
        Tuning(read_size=0)
    assert ObjectStorage(f"s3://{s3_bucket}", s3.options(read_size=3 * MiB)).preferred_read == 3 * MiB
    rng = np.random.default_rng(7)
    tree = {f"w{i}": rng.standard_normal((1024, 1024), dtype=np.float32) for i in range(6)}  # 4 MiB each
    path = f"s3://{s3_bucket}/read-size"
    cairn.save(path, {"p": tree}, storage_options=s3.options(), compression=False, threads=1)  # one 24 MiB file
    gets = {}
    for size in (32 * MiB, 4 * MiB):
        proxy.requests.clear()
        got = cairn.load(path, storage_options={**proxy.options(), "read_size": size})["p"]
        assert all(np.array_equal(got[k], v) for k, v in tree.items())
        gets[size] = sum(1 for m, p, _ in proxy.requests if m == "GET" and p.split("?")[0].endswith(".bin"))
    assert gets == {32 * MiB: 1, 4 * MiB: 6}, gets


def test_save_async(store, bucket, opts, mesh8):
    path = store.url(bucket, "async")
    x = sharded(mesh8, (32, 8), P("x"), seed=4)
    expect = np.asarray(x)
    f = cairn.save_async(path, {"x": x}, storage_options=opts)
    x = x + 1  # the snapshot was taken: later updates do not reach the checkpoint
    stats = f.result(timeout=120)
    assert stats.retries == 0
    np.testing.assert_array_equal(cairn.load(path, storage_options=opts)["x"], expect)


def test_uncommitted_prefix_is_not_a_checkpoint(store, bucket, opts):
    store.put_object(bucket, "half/%root/p00000-0.abc.bin", b"\x00" * 16)
    with pytest.raises(cairn.CheckpointNotFoundError, match="no committed checkpoint"):
        cairn.load(store.url(bucket, "half"), storage_options=opts)
    with pytest.raises(cairn.CheckpointNotFoundError, match="no checkpoint at"):
        cairn.load(store.url(bucket, "absent"), storage_options=opts)
    # Saving over the leftovers of an interrupted attempt is allowed: they are invisible.
    cairn.save(store.url(bucket, "half"), {"a": np.ones(4)}, storage_options=opts)
    np.testing.assert_array_equal(cairn.load(store.url(bucket, "half"), storage_options=opts)["a"], np.ones(4))


def test_exists_and_overwrite(store, bucket, opts):
    path = store.url(bucket, "ow")
    cairn.save(path, {"a": np.zeros(8)}, storage_options=opts)
    with pytest.raises(cairn.CheckpointExistsError, match="already holds a checkpoint"):
        cairn.save(path, {"a": np.ones(8)}, storage_options=opts)
    old = set(store.keys(bucket, "ow/"))
    cairn.save(path, {"a": np.full(8, 2.0)}, overwrite=True, storage_options=opts)
    np.testing.assert_array_equal(cairn.load(path, storage_options=opts)["a"], np.full(8, 2.0))
    new = set(store.keys(bucket, "ow/"))
    assert old & new == {"ow/manifest.json"}  # the replaced checkpoint's files are gone


def test_missing_or_truncated_data_object_is_corruption(store, bucket, opts):
    path = store.url(bucket, "damaged")
    cairn.save(path, {"a": np.arange(1000, dtype=np.int64), "b": np.ones(10)}, storage_options=opts)
    keys = store.keys(bucket, "damaged/")
    a_bin = next(k for k in keys if k.startswith("damaged/a/") and k.endswith(".bin"))
    b_bin = next(k for k in keys if k.startswith("damaged/b/") and k.endswith(".bin"))
    store.put_object(bucket, a_bin, store.get_object(bucket, a_bin)[:100])
    store.delete_object(bucket, b_bin)
    with pytest.raises(cairn.CorruptCheckpointError, match="truncated"):
        cairn.load(path, {"a": None}, storage_options=opts)
    with pytest.raises(cairn.CorruptCheckpointError, match="missing"):
        cairn.load(path, {"b": None}, storage_options=opts)


def _replicated(mesh, x):
    return {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))}


@pytest.mark.parametrize("part", [3 * MiB // 2, 768 << 10], ids=["1.5MiB", "768KiB"])
def test_corrupt_byte_inside_a_part_or_straddling_two_fails_naming_it(store, bucket, opts, mesh8, part):
    """Blocks are verified as the parts of a read land (a part holding a block whole) or after the
    read (a block across two parts): a flipped byte either way fails the load, naming the bytes."""
    from cairn._core.checksum import crc32c

    x = np.random.default_rng(6).standard_normal(3 * MiB // 4, dtype=np.float32)  # 3 MiB: three blocks
    path = store.url(bucket, "flip")
    cairn.save(path, {"x": x}, storage_options=opts, compression=False)  # raw: the byte positions below
    key = next(k for k in store.keys(bucket, "flip/") if k.startswith("flip/x/") and k.endswith(".bin"))
    data = store.get_object(bucket, key)
    assert data == x.tobytes()  # the array's only chunk, from byte 0
    o = {**opts, "read_part_size": part}
    # with 1.5 MiB parts block 0 lies in the first, block 1 across both; with 768 KiB all straddle
    for where in (MiB // 2 + 3, MiB + MiB // 4):
        lo = where // MiB * MiB
        bad = bytearray(data)
        bad[where] ^= 0x10
        store.put_object(bucket, key, bytes(bad))
        stored, computed = crc32c(data[lo : lo + MiB]), crc32c(bytes(bad[lo : lo + MiB]))
        expect = (rf"{path}: checksum mismatch in '[^']+\.bin' bytes {lo}\.\.{lo + MiB} \(leaf 'x'\): "
                  rf"stored {stored:#010x}, computed {computed:#010x}")
        for target in (None, _replicated(mesh8, x)):  # a run of whole arrays; a planned direct read
            with pytest.raises(cairn.CorruptCheckpointError, match=expect):
                cairn.load(path, target, storage_options=o)
    store.put_object(bucket, key, data)
    for target in (None, _replicated(mesh8, x)):
        np.testing.assert_array_equal(np.asarray(cairn.load(path, target, storage_options=o)["x"]), x)


def test_every_block_verified_once_inside_parts_where_they_land(store, bucket, opts, mesh8, monkeypatch):
    """Blocks wholly inside a part are verified in the read-pool thread that received it; blocks
    across parts once the read is done; none twice, none skipped, with any part size."""
    from cairn._core import checksum as _checksum

    x = np.random.default_rng(8).standard_normal(3 * MiB // 4, dtype=np.float32)
    path = store.url(bucket, "once")
    cairn.save(path, {"x": x}, storage_options=opts, compression=False)  # raw 1 MiB blocks
    verified: list[tuple[int, str]] = []
    real = _checksum.BlockChecks._verify

    def record(self, i):
        verified.append((self.checks[i][0], threading.current_thread().name))
        return real(self, i)

    monkeypatch.setattr(_checksum.BlockChecks, "_verify", record)
    for target in (None, _replicated(mesh8, x)):
        verified.clear()
        got = cairn.load(path, target, storage_options={**opts, "read_part_size": 3 * MiB // 2})
        np.testing.assert_array_equal(np.asarray(got["x"]), x)
        where = dict(verified)
        assert sorted(s for s, _ in verified) == [0, MiB, 2 * MiB]
        assert where[0].startswith("cairn-get") and where[2 * MiB].startswith("cairn-get")
        assert not where[MiB].startswith("cairn-get")
        for part in (300_001, MiB - 1, 5 * MiB):  # smaller than a block and not aligned to it; one part
            verified.clear()
            got = cairn.load(path, target, storage_options={**opts, "read_part_size": part})
            np.testing.assert_array_equal(np.asarray(got["x"]), x)
            assert sorted(s for s, _ in verified) == [0, MiB, 2 * MiB]


# ---------------------------------------------------------------------- racing writers


def test_two_writers_racing_to_commit_one_wins(store, bucket, opts, mesh8):
    """Both writers pass the destination check, write their data, then race on the manifest."""
    path = store.url(bucket, "race/step_7")
    states = [{"w": sharded(mesh8, (64, 16), P("x"), seed=s), "who": s} for s in (10, 11)]
    loc = resolve(path, opts)
    jobs = [_save.prepare(loc, st) for st in states]  # both checked: nothing committed yet
    barrier = threading.Barrier(2, timeout=30)
    outcome: dict[int, object] = {}

    def run(i):
        barrier.wait()
        try:
            outcome[i] = jobs[i].run()
        except BaseException as e:
            outcome[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    won = [i for i, r in outcome.items() if isinstance(r, _save.SaveStats)]
    lost = [i for i, r in outcome.items() if isinstance(r, cairn.CheckpointExistsError)]
    assert len(won) == 1 and len(lost) == 1, outcome
    out = cairn.load(path, storage_options=opts)
    assert out["who"] == states[won[0]]["who"]
    np.testing.assert_array_equal(out["w"], np.asarray(states[won[0]]["w"]))
    # The loser removed what it wrote: only the winner's token remains.
    tokens = {k.rsplit("/", 1)[1].split(".")[1] for k in store.keys(bucket, "race/step_7/") if k.endswith(".bin")}
    assert tokens == {jobs[won[0]].token}


def test_many_threads_saving_the_same_path(store, bucket, opts):
    path = store.url(bucket, "crowd")
    n = 4
    barrier = threading.Barrier(n, timeout=30)
    results: list[object] = [None] * n

    def go(i):
        barrier.wait()
        try:
            cairn.save(path, {"v": np.full(1000, i, dtype=np.int32)}, storage_options=opts)
            results[i] = "ok"
        except cairn.CheckpointExistsError as e:
            results[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results.count("ok") == 1, results
    winner = results.index("ok")
    np.testing.assert_array_equal(cairn.load(path, storage_options=opts)["v"], np.full(1000, winner))


# ---------------------------------------------------------------------- faults (S3: the proxy speaks S3's errors)


def test_server_gone_mid_save_fails_cleanly_and_leaves_nothing(s3, s3_bucket, s3_opts, proxy):
    """The server disappears during a multipart upload: a clear error, no manifest, old steps intact."""
    good = f"s3://{s3_bucket}/run/step_1"
    cairn.save(good, {"a": np.arange(10)}, storage_options=s3_opts)
    seen = threading.Event()

    def cut(method, path):
        if method == "PUT" and "uploadId=" in path:  # the first part of a multipart upload
            seen.set()
            proxy.down = True

    proxy.on_request = cut
    state = {"x": np.random.default_rng(5).standard_normal(4 * MiB, dtype=np.float32)}  # 16 MiB
    with pytest.raises(cairn.CheckpointError) as info:
        cairn.save(f"s3://{s3_bucket}/run/step_2", state, storage_options=fast_retries(proxy.options(part_size=5 * MiB)))
    assert seen.is_set()
    msg = str(info.value)
    assert f"s3://{s3_bucket}/run/step_2" in msg and ".bin" in msg, msg  # names the checkpoint and the object
    assert not any(k.endswith("manifest.json") for k in s3.keys(s3_bucket, "run/step_2"))
    with pytest.raises(cairn.CheckpointNotFoundError):
        cairn.load(f"s3://{s3_bucket}/run/step_2", storage_options=s3_opts)
    np.testing.assert_array_equal(cairn.load(good, storage_options=s3_opts)["a"], np.arange(10))


def test_transient_errors_are_retried_and_counted(s3_bucket, s3_opts, proxy):
    path = f"s3://{s3_bucket}/flaky"
    o = fast_retries(proxy.options(part_size=5 * MiB, read_part_size=1 * MiB))
    proxy.fail(503, times=2, method="PUT", path_contains="manifest.json")
    proxy.fail(500, times=1, method="PUT", path_contains="index.")
    proxy.fail(429, times=1, method="GET", query_contains="list-type")  # listing (the destination check)
    value = np.arange(3 * MiB, dtype=np.int32)  # 12 MiB: a multipart upload
    proxy.fail(503, times=2, method="PUT", query_contains="uploadId=")  # parts: retried inside obstore
    stats = cairn.save(path, {"v": value}, storage_options=o, compression=False)  # raw: 12 MiB, multipart
    assert proxy.injected() == 6
    assert stats.retries >= 3  # manifest x2, index x1 (plus the listing when it fell in the save)
    proxy.fail(503, times=2, method="GET", path_contains=".bin")
    np.testing.assert_array_equal(cairn.load(path, storage_options=o)["v"], value)
    assert proxy.injected() == 8


def test_commit_whose_answer_was_lost_is_not_mistaken_for_a_rival(s3_bucket, s3_opts, proxy):
    """The manifest's create-if-absent put lands but its answer is lost; the retry sees 412."""
    path = f"s3://{s3_bucket}/lost-answer"
    proxy.fail(503, times=1, method="PUT", path_contains="manifest.json", after_forward=True)
    stats = cairn.save(path, {"v": np.arange(7)}, storage_options=fast_retries(proxy.options()))
    assert proxy.injected() == 1 and stats.retries >= 1
    puts = [s for m, p, s in proxy.requests if m == "PUT" and "manifest.json" in p]
    assert puts == [503, 412]  # landed, then the retry found it: our own bytes, so success
    np.testing.assert_array_equal(cairn.load(path, storage_options=s3_opts)["v"], np.arange(7))


def test_persistent_errors_give_up_and_name_the_object(s3_bucket, s3_opts, proxy):
    o = fast_retries(proxy.options())
    proxy.fail(503, times=1000, method="PUT", path_contains="manifest.json")
    with pytest.raises(cairn.CheckpointError) as info:
        cairn.save(f"s3://{s3_bucket}/down", {"v": np.ones(10)}, storage_options=o)
    msg = str(info.value)
    assert "manifest.json" in msg and "503" in msg and "after 3 attempts" in msg, msg
    assert proxy.faults[0].hits == 3  # the first try and max_retries=2 retries, no more
    proxy.faults.clear()
    with pytest.raises(cairn.CheckpointNotFoundError):
        cairn.load(f"s3://{s3_bucket}/down", storage_options=s3_opts)
    # Loads: a data object that keeps failing is named in the error.
    cairn.save(f"s3://{s3_bucket}/up", {"v": np.ones(10)}, storage_options=o)
    proxy.fail(500, times=1000, method="GET", path_contains=".bin")
    with pytest.raises(cairn.CheckpointError, match=r"\.bin.*500|500.*\.bin"):
        cairn.load(f"s3://{s3_bucket}/up", storage_options=o)


def test_access_denied_is_not_retried(s3_bucket, s3_opts, proxy):
    o = fast_retries(proxy.options())
    proxy.fail(403, times=1000, method="PUT")
    with pytest.raises(cairn.CheckpointError, match="refused"):
        cairn.save(f"s3://{s3_bucket}/denied", {"v": np.ones(10)}, storage_options=o)
    assert proxy.faults[0].hits == 1


# ---------------------------------------------------------------------- the manager


def test_manager_over_object_store(store, bucket, opts):
    directory = store.url(bucket, "mgr")
    # Leftovers of an interrupted save (no manifest) must be neither listed nor kept.
    store.put_object(bucket, "mgr/step_00000099/%root/p00000-0.dead.bin", b"x")
    states = {s: {"w": np.full((4, 4), s, dtype=np.float32), "step": s} for s in range(1, 6)}
    with cairn.CheckpointManager(directory, max_to_keep=2, storage_options=opts) as mgr:
        assert mgr.steps() == []
        for s, st in states.items():
            mgr.save(s, st)
        mgr.wait()
        assert mgr.steps() == [4, 5]
        out = mgr.restore()
        assert mgr.restored_step == 5 and out["step"] == 5
        np.testing.assert_array_equal(out["w"], states[5]["w"])
    prefixes = {k.split("/")[1] for k in store.keys(bucket, "mgr/")}
    assert prefixes == {"step_00000004", "step_00000005"}
    # A retention delete cut off after the manifest went: the step is no longer listed.
    store.delete_object(bucket, "mgr/step_00000004/manifest.json")
    with cairn.CheckpointManager(directory, storage_options=opts) as mgr:
        assert mgr.steps() == [5]
        np.testing.assert_array_equal(mgr.restore()["w"], states[5]["w"])


# ---------------------------------------------------------------------- several processes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multiprocess_save_and_load(store, bucket, opts, monkeypatch):
    """Two JAX processes save one checkpoint (settings from the environment), two load it."""
    from _mp import run, scenarios

    for k, v in store.env().items():
        monkeypatch.setenv(k, v)  # the harness's processes inherit the environment
    path = store.url(bucket, "mp/step_3")
    saved = run(2, "save", {"path": path, "mesh": [2, 2]}, timeout=240)
    assert all(r["files_written"] >= 1 for r in saved)
    keys = store.keys(bucket, "mp/step_3/")
    assert {k.rsplit("/", 1)[1].split("-")[0] for k in keys if k.endswith(".bin")} == {"p00000", "p00001"}
    assert not any("_index.p" in k for k in keys)  # per-process index parts are merged, then removed
    loaded = run(2, "load", {"path": path, "mesh": [2, 2], "specs": {"w": ["y", "x"]}}, timeout=240)
    assert all(r["shards_checked"] > 0 for r in loaded)
    out = cairn.load(path, storage_options=opts)
    for name, (shape, dtype, _) in scenarios.LEAVES.items():
        np.testing.assert_array_equal(out["params"][name], scenarios.expected(name, shape, dtype), err_msg=name)


def test_compressed_blocks_checked_and_decoded_as_parts_land(s3, s3_bucket, s3_opts, mesh8, monkeypatch):
    """A compressed leaf on S3: each stored block wholly inside a ranged part is checked and decoded in
    the thread that received the part (read whole in a run, or planned); a corrupt block fails the load
    naming it, and with one part in flight no part after the corrupt one is fetched."""
    import ml_dtypes

    from cairn._codecs import codecs as _codecs
    from cairn._core import checksum as _checksum
    from cairn._load.source import open_checkpoint
    from cairn._storage import obstore as _obstore

    x = np.random.default_rng(9).normal(0, 0.02, (512, 2048)).astype(ml_dtypes.bfloat16)  # 2 MiB
    path = s3.url(s3_bucket, "coded")
    _save.prepare(resolve(path, s3_opts), {"x": x}, block_size=64 << 10, compression="planes").run()
    ck = open_checkpoint(path, s3_opts)
    index = ck.indexes[next(iter(ck.indexes))]
    (leaf,) = [lf for lf in index.leaves if getattr(lf, "codec", None) == "planes"]
    sizes = leaf.stored_sizes(0, index.block_size)
    file, off = leaf.chunks[0]
    assert len(sizes) == 32 and sum(sizes) < 0.75 * x.nbytes
    key = next(k for k in s3.keys(s3_bucket, "coded/") if k.endswith(index.files[file].name))
    part = 256 << 10
    o = {**s3_opts, "read_part_size": part, "read_concurrency": 1}
    verified: list[tuple[int, str]] = []
    gets: list[tuple[str, int, int]] = []
    real_verify, real_get = _checksum.BlockChecks._verify, _obstore._ObjectReader._get

    def verify(self, i):
        verified.append((self.checks[i][0], threading.current_thread().name))
        return real_verify(self, i)

    def get(self, a, b, *rest):
        gets.append((self.key, a, b))
        return real_get(self, a, b, *rest)

    decoded: list[str] = []  # per block decoded: the thread
    real_decode_run = _codecs.decode_run

    def decode_run(codec, stored, *args, **kwargs):  # a stretch of checked blocks, by one call
        decoded.extend([threading.current_thread().name] * len(stored))
        return real_decode_run(codec, stored, *args, **kwargs)

    monkeypatch.setattr(_checksum.BlockChecks, "_verify", verify)
    monkeypatch.setattr(_obstore._ObjectReader, "_get", get)
    monkeypatch.setattr(_codecs, "decode_run", decode_run)
    for target in (None, _replicated(mesh8, x)):  # a run of whole arrays; a planned direct read
        verified.clear()
        decoded.clear()
        np.testing.assert_array_equal(np.asarray(cairn.load(path, target, storage_options=o)["x"]), x)
        starts = list(itertools.accumulate(sizes[:-1], initial=off))
        assert sorted(s for s, _ in verified) == starts  # every block once
        ends = [*starts[1:], off + sum(sizes)]
        inside = [s for s, e in zip(starts, ends) if (s - off) // part == (e - off - 1) // part]
        where = dict(verified)
        assert inside and all(where[s].startswith("cairn-get") for s in inside)
        # each block decoded once, those inside a part by the thread that received it
        assert len(decoded) == len(sizes) and sum(t.startswith("cairn-get") for t in decoded) == len(inside)
    # A flipped byte in block 1 (inside the first part): the load fails naming the block, after one part.
    data = s3.get_object(s3_bucket, key)
    bad = bytearray(data)
    bad[off + sizes[0] + 5] ^= 0x40
    s3.put_object(s3_bucket, key, bytes(bad))
    assert sizes[0] + sizes[1] < part
    for target in (None, _replicated(mesh8, x)):
        gets.clear()
        with pytest.raises(cairn.CorruptCheckpointError, match=rf"{path}: checksum mismatch in .* block 1 of chunk 0"):
            cairn.load(path, target, storage_options=o)
        # Read whole (None), x joins a run of small arrays, whose failure is read again on the planned
        # path to name the block: the first part twice, never a later one.
        fetched = [g for g in gets if g[0] == key]
        assert set(fetched) == {(key, off, off + part)} and len(fetched) == (2 if target is None else 1)


def test_plan_of_a_compressed_load_is_what_the_load_reads(store, bucket, opts, mesh8):
    """On S3 and Azure, where small arrays (up to the planned read size) are read in runs, the dry run
    of a load of a compressed checkpoint predicts its requests and stored bytes exactly."""
    import ml_dtypes

    rng = np.random.default_rng(11)
    state = {"w": jax.device_put(rng.normal(0, 0.02, (1024, 1024)).astype(ml_dtypes.bfloat16),
                                 NamedSharding(mesh8, P("x"))),
             "small": [rng.normal(0, 0.02, (64, 32)).astype(np.float32) for _ in range(10)]}
    path = store.url(bucket, "planned")
    cairn.save(path, state, storage_options=opts, compression=True)
    columns = {"w": jax.ShapeDtypeStruct((1024, 1024), ml_dtypes.bfloat16, sharding=NamedSharding(mesh8, P(None, "x"))),
               "small": [None] * 10}
    for target in (None, columns):
        stats = cairn.LoadStats()
        got = cairn.load(path, target, storage_options=opts, stats=stats)
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(state["w"]))
        (p,) = cairn.plan_load(path, target, storage_options=opts).processes
        assert (p.bytes_read, p.requests) == (stats.bytes_read, stats.reads)
        assert stats.bytes_read < 0.8 * (2 << 20)


def test_save_without_credentials_names_the_missing_settings_and_writes_nothing(s3, s3_bucket, monkeypatch):
    """No credentials in the settings or the environment: the client falls back on the instance-metadata
    service (pointed here at a closed loopback port, so nothing beyond 127.0.0.1 is asked); the save
    fails with a CheckpointError that names the path and the missing settings, before writing anything."""
    from _s3server import free_port

    for k in [k for k in __import__("os").environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    path = f"s3://{s3_bucket}/nocreds"
    opts = {"endpoint": s3.endpoint, "allow_http": True, "metadata_endpoint": f"http://127.0.0.1:{free_port()}"}
    with pytest.raises(cairn.CheckpointError, match=rf"{path}.*no credentials for s3://: missing storage_options "
                       r"'access_key_id' and 'secret_access_key' \(or the environment's AWS_ACCESS_KEY_ID"):
        cairn.save(path, {"x": np.arange(4)}, storage_options=opts)
    assert s3.keys(s3_bucket, "nocreds") == []
    # without an endpoint too, the message says that it is missing as well
    with pytest.raises(cairn.CheckpointError, match=r"no 'endpoint' is set either"):
        cairn.save(path, {"x": np.arange(4)}, storage_options={"metadata_endpoint": opts["metadata_endpoint"],
                                                               "region": "us-east-1"})
    assert s3.keys(s3_bucket, "nocreds") == []
    # a load names them the same way
    with pytest.raises(cairn.CheckpointError, match=rf"{path}.*no credentials"):
        cairn.load(path, storage_options=opts)


def test_target_boxes_of_many_leaves_share_requests(s3, s3_bucket, mesh8):
    """A load onto a sharding reads each data file's consecutive boxes, across leaves, as one run:
    a request per run of up to `plan_read_size` bytes, not one per box; the values are exact, and
    the link's log shows the same number of data GETs as the load's stats."""
    from _shapedlink import ShapedLink

    sharding = NamedSharding(mesh8, P("x"))
    host = {f"w{i}": np.random.default_rng(i).standard_normal((8, 1 << 16), dtype=np.float32) for i in range(6)}
    path = s3.url(s3_bucket, "runs")
    cairn.save(path, {"params": {k: jax.device_put(v, sharding) for k, v in host.items()}}, storage_options=s3.options(),
               compression=False)
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in host.items()}}
    files = [k for k in s3.keys(s3_bucket, "runs/") if k.endswith(".bin")]
    with ShapedLink(s3.port) as link:
        stats = cairn.LoadStats()
        got = cairn.load(path, target, storage_options={**s3.options(), "endpoint": link.endpoint}, stats=stats)
        data_gets = [r for r in link.log if r.method == "GET" and r.target.split("?")[0].endswith(".bin")]
    for k, v in host.items():
        np.testing.assert_array_equal(np.asarray(got["params"][k]), v)
    assert len(files) < len(host)  # leaves share files: the runs cross leaves
    assert stats.direct_reads >= len(host)  # every planned read landed in place...
    assert stats.reads == len(data_gets) == len(files)  # ...in one request per file (12 MiB in all)
    # with runs capped at 2 MiB (one leaf), a request per leaf
    stats = cairn.LoadStats()
    cairn.load(path, target, storage_options=s3.options(plan_read_size=2 * MiB), stats=stats)
    assert stats.reads == len(host)


def test_corrupt_block_in_a_run_of_boxes_names_its_leaf(s3, s3_bucket, mesh8):
    """A flipped byte inside one leaf's box, read in a run with other leaves' boxes, fails the load
    naming that leaf and the bytes of its block."""
    from cairn._read.metadata import read_index, read_manifest

    sharding = NamedSharding(mesh8, P("x"))
    host = {f"w{i}": np.random.default_rng(i).standard_normal((8, 1 << 16), dtype=np.float32) for i in range(4)}
    path = s3.url(s3_bucket, "runflip")
    cairn.save(path, {"params": {k: jax.device_put(v, sharding) for k, v in host.items()}}, storage_options=s3.options(),
               compression=False)
    loc = resolve(path, s3.options())
    index = read_index(loc, read_manifest(loc).items["params"])
    leaf = next(lf for lf in index.leaves if getattr(lf, "path", None) and "w2" in str(lf.path))
    file, first = leaf.chunks[0]  # its rows, merged into one chunk or not, lie back to back from here
    off = first + MiB  # its second 1 MiB checksum block
    key = next(k for k in s3.keys(s3_bucket, "runflip/") if k.endswith(index.files[file].name))
    data = bytearray(s3.get_object(s3_bucket, key))
    data[off + 100] ^= 0x01
    s3.put_object(s3_bucket, key, bytes(data))
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in host.items()}}
    with pytest.raises(cairn.CorruptCheckpointError, match=rf"checksum mismatch in '[^']+' bytes {off}\.\.{off + MiB} "
                       r"\(leaf 'params/w2'\)"):
        cairn.load(path, target, storage_options=s3.options())


def test_compressed_boxes_gather_per_file_and_a_corrupt_block_names_its_leaf(s3, s3_bucket, mesh8):
    """A sharded load of compressed leaves from S3: the boxes that decode in place share one GET per
    run of consecutive stored bytes (not one GET per box), as the plan predicts; a flipped byte in
    one leaf's block, read in a run with other leaves' blocks, fails the load naming that block and leaf."""
    from cairn._read.metadata import read_index, read_manifest

    sharding = NamedSharding(mesh8, P("x"))
    rng = np.random.default_rng(3)
    host = {f"w{i}": (rng.standard_normal((8, 1 << 18)) * 0.01).astype(np.float32) for i in range(4)}  # 1 MiB rows
    path = s3.url(s3_bucket, "codedrun")
    opts = s3.options()
    cairn.save(path, {"params": {k: jax.device_put(v, sharding) for k, v in host.items()}}, storage_options=opts,
               compression="zstd")
    # Onto 2 devices: each box is 4 rows, one saved chunk (rows merge into chunks of up to 4 MiB), decoded in place.
    halves = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",)), P("x"))
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=halves) for k, v in host.items()}}
    stats = cairn.LoadStats()
    got = cairn.load(path, target, storage_options=opts, stats=stats)["params"]
    for k, v in host.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v)
    loc = resolve(path, opts)
    index = read_index(loc, read_manifest(loc).items["params"])
    assert {lf.codec for lf in index.leaves if hasattr(lf, "codec")} == {"zstd"}
    assert all(len(lf.chunks) == 2 for lf in index.leaves if hasattr(lf, "codec"))
    assert stats.reads == len(index.files) < 4 * 2  # a GET per file, not per box
    (p,) = cairn.plan_load(path, target, storage_options=opts).processes
    assert (p.requests, p.bytes_read) == (stats.reads, stats.bytes_read)
    leaf = next(lf for lf in index.leaves if getattr(lf, "path", None) and "w2" in str(lf.path))
    file, off = leaf.chunks[1]  # its second chunk (rows 4..7), 4 stored blocks
    key = next(k for k in s3.keys(s3_bucket, "codedrun/") if k.endswith(index.files[file].name))
    data = bytearray(s3.get_object(s3_bucket, key))
    data[off + 10] ^= 0x04
    s3.put_object(s3_bucket, key, bytes(data))
    with pytest.raises(cairn.CorruptCheckpointError, match=r"checksum mismatch in '[^']+' block 0 of chunk 1 "
                       rf"\(stored bytes {off}\.\.\d+, leaf 'params/w2'\)"):
        cairn.load(path, target, storage_options=opts)


def test_a_missing_bucket_is_named(store, bucket, opts):
    """A path whose bucket (S3) or container (Azure) does not exist: a CheckpointError naming it, from a
    save (before anything is written) and from a load, not the client's raw HTTP error."""
    missing = bucket + "-absent"
    path = store.url(missing, "run/step_1")
    for call in (lambda: cairn.save(path, {"a": np.arange(4.0)}, storage_options=opts),
                 lambda: cairn.load(path, storage_options=opts)):
        with pytest.raises(cairn.CheckpointError, match=f"{missing}.*does not exist on this store"):
            call()
    assert store.keys(bucket) == []  # the neighbouring bucket got nothing either


# ---------------------------------------------------------------------- the commit's requests


def _small_requests(proxy, bucket, name):
    """The requests to the checkpoint `name` that are not data uploads, as (method, what, status)."""
    out = []
    for method, path, status in proxy.requests:
        where, _, query = path.partition("?")
        if method == "GET" and "list-type" in query:
            out.append((method, "list", status))
        elif method == "POST" and query.startswith("delete"):
            out.append((method, "delete", status))
        elif where.startswith(f"/{bucket}/{name}/") and not where.endswith(".bin"):
            out.append((method, where.rsplit("/", 1)[-1].split(".")[0], status))
    return out


def test_commit_sends_only_the_requests_the_protocol_needs(s3_bucket, s3_opts, proxy):
    """A fresh save: one listing before the data, then index part and index (at once: the next test),
    the listing that proves the files are there, and the manifest last (no listing or delete after
    it). An overwrite also lists the folder the checkpoint is in before writing (a checkpoint there
    that names it as its base refuses the overwrite: tests/save/test_replace_base.py; none here, so
    no manifest is read), and deletes the old checkpoint's files by one batched request after its
    manifest, taken from the same listing as the commit's."""
    o = proxy.options()
    path = f"s3://{s3_bucket}/fresh"
    cairn.save(path, {"a": np.arange(1000)}, storage_options=o)
    assert _small_requests(proxy, s3_bucket, "fresh") == [
        ("GET", "list", 200), ("PUT", "index", 200), ("PUT", "index", 200), ("GET", "list", 200),
        ("PUT", "manifest", 200)]
    proxy.requests.clear()
    cairn.save(path, {"a": np.arange(1000) + 1}, storage_options=o, overwrite=True)
    got = _small_requests(proxy, s3_bucket, "fresh")
    assert got[:2] == [("GET", "list", 200), ("GET", "list", 200)]  # the checkpoint's folder, its parent
    got = got[2:]
    assert got[:4] == [("PUT", "index", 200), ("PUT", "index", 200), ("GET", "list", 200), ("PUT", "manifest", 200)]
    assert got[4:] == [("POST", "delete", 200)]
    np.testing.assert_array_equal(cairn.load(path, storage_options=s3_opts)["a"], np.arange(1000) + 1)
    assert [k.rsplit("/", 1)[-1].split(".")[0] for k in s3_keys(s3_opts, s3_bucket, "fresh/")].count("manifest") == 1


def test_a_single_process_puts_its_index_part_and_index_at_once(s3_bucket, s3_opts, proxy):
    """One process builds its checkpointable's index from its part's records before the part is put,
    so the commit sends both PUTs together: one round trip, not two. Each waits at a barrier of two
    (one after another, the first would wait out the barrier's timeout and break it)."""
    barrier = threading.Barrier(2, timeout=20)
    met: list[str] = []

    def meet(method, where):
        if method == "PUT" and "/a/index." in where:  # the part (index.p00000.T.idx) and the index (index.T.json)
            try:
                barrier.wait()
                met.append(where.rsplit(".", 1)[-1])
            except threading.BrokenBarrierError:
                met.append("alone")

    proxy.on_request = meet
    path = f"s3://{s3_bucket}/together"
    try:
        cairn.save(path, {"a": {"w": np.arange(3000, dtype=np.float32)}}, storage_options=proxy.options())
    finally:
        proxy.on_request = None
    assert sorted(met) == ["idx", "json"]
    np.testing.assert_array_equal(cairn.load(path, storage_options=s3_opts)["a"]["w"], np.arange(3000, dtype=np.float32))


def test_the_parts_of_many_checkpointables_are_put_at_once(s3_bucket, s3_opts, proxy):
    """Each checkpointable's index part is a round trip of its own: a save of several sends them at once
    (as it sends their indexes), not one after another. Each part's PUT waits at a barrier of two: only
    PUTs in flight together pass it (one after another, the first would wait out the timeout)."""
    import threading

    barrier = threading.Barrier(2, timeout=30)
    met: list[bool] = []

    def meet(method, where):
        if method == "PUT" and "/index.p" in where:  # a binary index part (index.pNNNNN.TOKEN.idx)
            try:
                barrier.wait()
                met.append(True)
            except threading.BrokenBarrierError:
                met.append(False)

    proxy.on_request = meet
    state = {name: {"w": np.arange(2000, dtype=np.float32) * i} for i, name in enumerate("abcd")}
    path = f"s3://{s3_bucket}/parts"
    try:
        cairn.save(path, state, storage_options=proxy.options())
    finally:
        proxy.on_request = None
    assert met == [True] * 4
    got = cairn.load(path, storage_options=s3_opts)
    for i, name in enumerate("abcd"):
        np.testing.assert_array_equal(got[name]["w"], np.arange(2000, dtype=np.float32) * i)


def s3_keys(opts, bucket, prefix):
    from cairn._storage.obstore import ObjectStorage

    return ObjectStorage(f"s3://{bucket}", opts).list(prefix.rstrip("/"))


@pytest.mark.parametrize("fail", ["index", "list", "manifest"])
def test_a_failure_between_commit_requests_leaves_no_checkpoint(s3_bucket, s3_opts, proxy, fail):
    """Whichever of the commit's requests fails for good, nothing is visible (the manifest comes
    last), the error names the checkpoint, and a later save to the same path commits."""
    path = f"s3://{s3_bucket}/broken-{fail}"
    if fail == "list":  # the commit's listing, not the destination check before the data
        def arm(method, where):
            if method == "PUT" and "/a/index." in where and not proxy.faults:
                proxy.fail(500, times=100, method="GET", query_contains="list-type")

        proxy.on_request = arm
    else:
        proxy.fail(500, times=100, method="PUT", path_contains=f"broken-{fail}/" + ("manifest" if fail == "manifest"
                                                                                        else "a/index."))
    with pytest.raises(cairn.CheckpointError, match=f"broken-{fail}"):
        cairn.save(path, {"a": np.arange(10)}, storage_options=fast_retries(proxy.options()))
    assert not any(k.endswith("manifest.json") for k in s3_keys(s3_opts, s3_bucket, f"broken-{fail}/"))
    with pytest.raises(cairn.CheckpointNotFoundError):
        cairn.load(path, storage_options=s3_opts)
    assert proxy.injected() >= 1
    proxy.on_request = None
    proxy.faults.clear()
    cairn.save(path, {"a": np.arange(10)}, storage_options=s3_opts)
    np.testing.assert_array_equal(cairn.load(path, storage_options=s3_opts)["a"], np.arange(10))


def test_a_failed_cleanup_after_an_overwrite_keeps_the_new_checkpoint(s3_bucket, s3_opts, proxy):
    """The batched delete of the old files fails after the new manifest: the save still succeeds,
    the new checkpoint loads, and the old files are invisible leftovers."""
    path = f"s3://{s3_bucket}/ow-cleanup"
    cairn.save(path, {"a": np.zeros(16)}, storage_options=s3_opts)
    proxy.fail(500, times=100, method="POST", query_contains="delete")
    cairn.save(path, {"a": np.ones(16)}, storage_options=fast_retries(proxy.options()), overwrite=True)
    assert proxy.injected() >= 1
    np.testing.assert_array_equal(cairn.load(path, storage_options=s3_opts)["a"], np.ones(16))


def test_loads_at_once_share_the_reader_threads(store, bucket, opts):
    """Object-store loads read on long-lived threads shared by the process's loads: several at once,
    from threads of their own, each gets its own bytes."""
    paths = [store.url(bucket, f"many/{i}") for i in range(3)]
    states = [{"a": np.arange(300_000, dtype=np.float32) * (i + 1), "b": np.full(5000, i)} for i in range(3)]
    for path, state in zip(paths, states):
        cairn.save(path, state, storage_options=opts)
    got: dict[int, dict] = {}

    def load(i):
        for _ in range(3):
            got[i] = cairn.load(paths[i % 3], storage_options=opts)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for i in range(6):
        for k, v in states[i % 3].items():
            np.testing.assert_array_equal(got[i][k], v)


def test_many_checkpointables_fetch_their_records_together(s3_bucket, s3_opts, tmp_path, monkeypatch):
    """A load of many checkpointables fetches each one's chunk records (`prefetch`) on the reader threads
    together where the storage charges per request (through a 10 ms link: 0.41x the load's time for 400
    of them, docs/PERFORMANCE.md), and in turn on the loading thread from local files; the same values."""
    from cairn._load import engine as _load

    rng = np.random.default_rng(5)
    state = {f"k{i:02d}": rng.standard_normal((8, 4)).astype(np.float32) for i in range(12)}
    threads: list[str] = []
    real = _load.prefetch

    def spy(index, wanted, reads):
        threads.append(threading.current_thread().name)
        return real(index, wanted, reads)

    monkeypatch.setattr(_load, "prefetch", spy)
    for url, opts, on_readers in ((f"s3://{s3_bucket}/many", s3_opts, True), (str(tmp_path / "many"), None, False)):
        cairn.save(url, state, storage_options=opts)
        threads.clear()
        got = cairn.load(url, storage_options=opts)
        for k, v in state.items():
            np.testing.assert_array_equal(got[k], v)
        assert len(threads) == len(state)
        assert all(t.startswith("cairn-read") == on_readers for t in threads), threads
