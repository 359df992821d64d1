"""Scenario functions run by every process of a multi-process test (see __init__.py).

Every array's global value is a pure function of its name and shape
(`expected`), so each process can build its own shards without any data
crossing processes, and check what it loaded against the same function.
"""

from __future__ import annotations

import os
import time
import zlib
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn

# name -> (shape, dtype, partition spec on a ("x", "y") mesh as saved)
LEAVES: dict[str, tuple[tuple[int, ...], str, tuple[Any, ...]]] = {
    "w": ((16, 12), "float32", ("x", "y")),  # fully sharded
    "e": ((24, 6), "int32", (None, "y")),  # replicated along x
    "b": ((12,), "float32", ()),  # replicated on every device
    "v": ((8, 4, 6), "bfloat16", (("x", "y"),)),  # axis 0 over both mesh axes
}


def expected(name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    seed = zlib.crc32(name.encode())
    x = (np.arange(int(np.prod(shape)), dtype=np.float64) * 0.5 + seed % 97).reshape(shape)
    return x.astype(jax.numpy.dtype(dtype))


def _mesh(shape: list[int]) -> jax.sharding.Mesh:
    devices = np.array(jax.devices()).reshape(shape)
    return jax.sharding.Mesh(devices, ("x", "y"))


def _spec(entry: list[Any]) -> P:
    return P(*[tuple(e) if isinstance(e, list) else e for e in entry])


def make_state(mesh_shape: list[int], specs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The test state, each array built on this process from its own shards only."""
    mesh = _mesh(mesh_shape)
    params = {}
    for name, (shape, dtype, spec) in LEAVES.items():
        s = NamedSharding(mesh, _spec((specs or {}).get(name, list(spec))))
        full = expected(name, shape, dtype)
        params[name] = jax.make_array_from_callback(shape, s, lambda idx, full=full: full[idx])
    return {"params": params, "extra": {"table": np.arange(10, dtype=np.int64), "step": 7, "tag": "mp"}}


def _files(path: str) -> dict[str, int]:
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            full = os.path.join(root, n)
            out[os.path.relpath(full, path)] = os.path.getsize(full)
    return out


def _count_published() -> list[int]:
    """Count the bytes this process hands to the coordinator (metadata only, never arrays)."""
    from cairn._dist.coord import JaxCoordinator

    sent = [0]
    real = JaxCoordinator.publish

    def publish(self, key, value):
        sent[0] += len(key) + len(value)
        return real(self, key, value)

    JaxCoordinator.publish = publish
    return sent


def save(path: str, mesh: list[int], split_replicas: bool = False, big_mb: int = 0,
         compression: Any = "auto", mountinfo: list[str] | None = None, cores: int | None = None) -> dict:
    if mountinfo:  # this process's view of the mounts (what "auto" compression looks at)
        from cairn._storage import fstype

        fstype.MOUNTINFO = mountinfo[jax.process_index()]
    if cores:  # the cores "auto" prices the codecs on, whatever this machine has
        from cairn._save import codecpolicy

        codecpolicy.coder_cores = lambda: cores
    state = make_state(mesh)
    if big_mb:  # a separate checkpointable, so that loads of the test state may leave it out
        rows = big_mb * 256
        s = NamedSharding(_mesh(mesh), P("x", "y"))
        state["big"] = jax.make_array_from_callback(
            (rows, 1024), s, lambda idx: np.ones((rows, 1024), np.float32)[idx]
        )
    sent = _count_published()
    stats = cairn.save(path, state, split_replicas=split_replicas, timeout=60, compression=compression)
    return {"bytes_written": stats.bytes_written, "files_written": stats.files_written,
            "published_bytes": sent[0]}


def coordinator_basics() -> dict:
    """The JAX client calls cairn uses, their timeouts, and what a timeout says."""
    from cairn._dist.coord import JaxCoordinator, default_coordinator

    c = default_coordinator()
    assert isinstance(c, JaxCoordinator)
    me, n = c.process_index, c.process_count
    c.publish(f"t/hello/{me}", f"from {me}".encode())
    got = c.fetch_all("t/hello", n, 30)
    c.barrier("t/all-here", 30)
    first = c.fetch("t/hello/0", 5, writer=0)
    out: dict[str, Any] = {"keys": sorted(got), "values": sorted(v.decode() for v in got.values()),
                           "first": first.decode()}
    # The last process is late for a barrier: the others time out and name it.
    if me == n - 1:
        time.sleep(3)
    try:
        c.barrier("t/late", 1.5)
        out["late"] = None
    except cairn.CoordinationTimeoutError as e:
        out["late"] = str(e)
    # Nobody publishes this key: the timeout names the process expected to.
    try:
        c.fetch("t/never", 0.5, writer=n - 1)
        out["never"] = None
    except cairn.CoordinationTimeoutError as e:
        out["never"] = str(e)
    try:
        c.fetch_all("t/hello-again", n, 0.5) if me == 0 else None
        out["partial"] = None
    except cairn.CoordinationTimeoutError as e:
        out["partial"] = str(e)
    c.barrier("t/end", 30)
    return out


def load(path: str, mesh: list[int], specs: dict[str, Any] | None = None, big: list[Any] | None = None) -> dict:
    """Load `path` onto `mesh` with `specs`; check every local shard; report bytes read."""
    from cairn._load.engine import LoadStats
    from cairn._load.engine import load as engine_load
    from cairn._load.source import CairnSource
    from cairn._storage.location import resolve

    m = _mesh(mesh)
    target = {"params": {}}
    for name, (shape, dtype, spec) in LEAVES.items():
        s = NamedSharding(m, _spec((specs or {}).get(name, list(spec))))
        target["params"][name] = jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype), sharding=s)
    stats = LoadStats()
    out = engine_load(CairnSource.open(resolve(path)), {"params": target["params"], "extra": None}, stats=stats)
    checked = 0
    for name, arr in out["params"].items():
        shape, dtype, _ = LEAVES[name]
        want = target["params"][name]
        assert arr.sharding == want.sharding, (name, arr.sharding, want.sharding)
        assert arr.dtype == want.dtype and arr.shape == want.shape
        full = expected(name, shape, dtype)
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index], err_msg=name)
            checked += 1
    assert out["extra"]["step"] == 7 and out["extra"]["tag"] == "mp"
    np.testing.assert_array_equal(out["extra"]["table"], np.arange(10))
    result = {"bytes_read": stats.bytes_read, "reads": stats.reads, "shards_checked": checked}
    if big is not None:  # the "big" checkpointable alone, to count what a resharded load reads
        meta = cairn.metadata(path)["big"]
        s = NamedSharding(m, _spec(big))
        big_stats = LoadStats()
        arr = engine_load(CairnSource.open(resolve(path)), {"big": jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=s)},
                          stats=big_stats)["big"]
        for shard in arr.addressable_shards:
            assert np.all(np.asarray(shard.data) == 1)
        result["big_bytes_read"] = big_stats.bytes_read
        result["big_bytes_needed"] = sum(
            int(np.prod(sh.data.shape)) * 4 for sh in arr.addressable_shards if sh.replica_id == 0
        )
    return result


def hello() -> dict:
    from cairn._dist.coord import default_coordinator

    c = default_coordinator()
    c.publish(f"t/hello/{c.process_index}", str(c.process_index).encode())
    got = c.fetch_all("t/hello", c.process_count, 30)
    c.barrier("t/b1", 30)
    return {"index": c.process_index, "count": c.process_count, "type": type(c).__name__,
            "keys": sorted(got), "local": jax.local_device_count(), "global": jax.device_count()}



def _fail_writes_on(process: int, action: str) -> None:
    """Make data-file writes of `process` fail ("raise") or kill it mid-file ("kill")."""
    from cairn._storage.local import LocalStorage

    if jax.process_index() != process:
        return
    real = LocalStorage.write

    def write(self, key, parts):
        if not key.endswith(".bin"):
            return real(self, key, parts)
        if action == "raise":
            raise OSError(28, "No space left on device (injected)", key)

        def fail() -> None:
            if action == "hang":  # alive (heartbeat and all) but stuck in a write
                time.sleep(3600)
            os.kill(os.getpid(), 9)

        def some_then_die():
            for k, part in enumerate(parts):
                if k == 1:  # some bytes are on disk; die with the file half written
                    fail()
                yield part
            fail()  # a file of one part (small chunks are written in batches): die before it is synced

        return real(self, key, some_then_die())

    LocalStorage.write = write


def save_twice(path: str, mesh: list[int], fail_on: int, action: str = "raise", timeout: float = 60,
               use_async: bool = True) -> dict:
    """Commit `path`/good, then attempt `path`/bad while process `fail_on` fails."""
    good, bad = os.path.join(path, "good"), os.path.join(path, "bad")
    state = make_state(mesh)
    cairn.save(good, state, timeout=timeout)
    _fail_writes_on(fail_on, action)
    t0 = time.monotonic()
    try:
        if use_async:
            cairn.save_async(bad, state, timeout=timeout).result(timeout + 30)
        else:
            cairn.save(bad, state, timeout=timeout)
    except cairn.CheckpointError as e:
        error = f"{type(e).__name__}: {e}"
    else:
        error = None
    return {"error": error, "seconds": time.monotonic() - t0, "bad_exists": os.path.exists(bad)}


def async_then_donate(path: str, mesh: list[int]) -> dict:
    """save_async, then a jitted step that donates the saved arrays; the checkpoint keeps the old values."""
    state = make_state(mesh)
    params = state["params"]
    step = jax.jit(lambda p: jax.tree.map(lambda x: x * 2 + 1, p), donate_argnums=0)
    f = cairn.save_async(path, state, timeout=60)
    new = step(params)
    jax.block_until_ready(new)
    donated = sorted(k for k, v in params.items() if v.is_deleted())
    stats = f.result(90)
    # The new values are what the step computed from the saved ones.
    full = expected("w", LEAVES["w"][0], LEAVES["w"][1])
    for shard in new["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index] * 2 + 1)
    # A later save lets the coordination service forget the first save's keys.
    cairn.save(path + "-next", {"new": new}, timeout=60)
    from cairn._dist.coord import default_coordinator

    left = len(default_coordinator()._client.key_value_dir_get_bytes("cairn/save/0"))
    return {"donated": donated, "blocking_s": stats.blocking_s, "keys_left_of_first_save": left}



def preempt_one(directory: str, mesh: list[int], signal_process: int, signal_at: int) -> dict:
    """SIGTERM reaches one process only: every process must save the same step and stop."""
    import signal as _signal

    state = make_state(mesh)
    mgr = cairn.CheckpointManager(directory, save_every=1000, async_save=True)
    stopped = None
    for step in range(1, 400):
        if step == signal_at and jax.process_index() == signal_process:
            os.kill(os.getpid(), _signal.SIGTERM)
        mgr.save(step, state)
        if mgr.reached_preemption(step):
            stopped = step
            break
        time.sleep(0.02)  # a training step; gives the preemption service time to agree
    mgr.close()
    return {"stopped": stopped, "steps": mgr.steps()}


def kill_at_op(path: str, mesh: list[int], victim: int, op: int, timeout: float = 6) -> dict:
    """Commit `path`/good, then save `path`/bad while process `victim` SIGKILLs itself
    just before its storage operation number `op` of that save (writes, puts,
    renames, fsyncs of folders, deletes). Returns how many operations it made
    when it was not killed (op beyond the end)."""
    from cairn._storage.local import LocalStorage

    good, bad = os.path.join(path, "good"), os.path.join(path, "bad")
    state = make_state(mesh)
    cairn.save(good, state, timeout=timeout)
    count = [0]
    if jax.process_index() == victim:
        for name in ("write", "put", "rename_dir", "sync_dir", "delete_prefix", "makedirs"):
            real = getattr(LocalStorage, name)

            def counted(self, *a, _real=real, **k):
                if count[0] == op:
                    os.kill(os.getpid(), 9)
                count[0] += 1
                return _real(self, *a, **k)

            setattr(LocalStorage, name, counted)
    try:
        cairn.save(bad, state, timeout=timeout)
        error = None
    except cairn.CheckpointError as e:
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "ops": count[0]}


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def save_then_load(path: str, mesh: list[int], save_spec: list[Any], load_spec: list[Any],
                   shape: list[int], read_once: bool | None = None, corrupt: bool = False,
                   cold: bool = False, storage_options: dict | None = None, budget: int = 1 << 30,
                   bandwidths: dict | None = None) -> dict:
    """Save one array with `save_spec`, load it with `load_spec`; count the bytes each process read.

    With `corrupt`, process 0 flips a byte of process 1's data file between the
    save and the load: every process must fail, naming the one that read it.
    """
    from cairn._dist.coord import default_coordinator
    from cairn._load.engine import LoadStats
    from cairn._load.engine import load as engine_load
    from cairn._load.source import CairnSource
    from cairn._storage.location import resolve

    m = _mesh(mesh)
    shp = tuple(shape)
    full = expected("a", shp, "float32")
    arr = jax.make_array_from_callback(shp, NamedSharding(m, _spec(save_spec)), lambda idx: full[idx])
    cairn.save(path, {"a": arr}, storage_options=storage_options)
    coord = default_coordinator()
    if corrupt:
        if coord.process_index == 0:
            victim = max((n for n in os.listdir(os.path.join(path, "a")) if n.startswith("p00001")),
                         key=lambda n: os.path.getsize(os.path.join(path, "a", n)))
            with open(os.path.join(path, "a", victim), "r+b") as f:
                f.seek(os.path.getsize(os.path.join(path, "a", victim)) - 5)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0xFF]))
        coord.barrier("t/corrupted", 30)
    target = NamedSharding(m, _spec(load_spec))
    want = {"a": jax.ShapeDtypeStruct(shp, np.float32, sharding=target)}
    try:
        # Once to warm up (the first load imports and compiles: rchar would count module files),
        # then the measured load.
        engine_load(CairnSource.open(resolve(path, storage_options)), want, read_once=read_once, timeout=60, budget_bytes=budget,
                    bandwidths=bandwidths)
        if cold:
            if coord.process_index == 0 and os.path.exists(path):
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
            coord.barrier("t/dropped", 60)
        stats = LoadStats()
        rss0 = _status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")  # resets the peak RSS (VmHWM) to the current RSS
        before = _rchar()
        t0 = time.perf_counter()
        out = engine_load(CairnSource.open(resolve(path, storage_options)), want, stats=stats, read_once=read_once, timeout=60,
                          budget_bytes=budget, bandwidths=bandwidths)["a"]
        load_s = time.perf_counter() - t0
        rchar = _rchar() - before
        peak = _status_bytes("VmHWM") - rss0
    except cairn.CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e)}
    assert out.sharding == target, (out.sharding, target)
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
    return {"bytes_read": stats.bytes_read, "rchar": rchar, "read_once_leaves": stats.read_once_leaves,
            "nbytes": int(full.nbytes), "shards": len(out.addressable_shards), "load_s": load_s,
            "reshard_s": stats.reshard_s, "peak_rss_growth": peak, "pieces": stats.read_once_pieces,
            "routes": stats.routes, "interconnect_bytes": stats.interconnect_bytes,
            "read_once_bytes_read": stats.read_once_bytes_read}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def save_replicated(path: str, mesh: list[int], mb: int, bandwidths: dict | None = None) -> dict:
    """Save an array replicated on every device; load it back replicated; report bytes per process."""
    from cairn._load.engine import LoadStats
    from cairn._load.engine import load as engine_load
    from cairn._load.source import CairnSource
    from cairn._storage.location import resolve

    m = _mesh(mesh)
    shp = (mb * 256, 1024)
    full = expected("r", shp, "float32")
    arr = jax.make_array_from_callback(shp, NamedSharding(m, P()), lambda idx: full[idx])
    stats = cairn.save(path, {"r": arr}, timeout=60)
    load_stats = LoadStats()
    out = engine_load(CairnSource.open(resolve(path)), {"r": jax.ShapeDtypeStruct(shp, np.float32, sharding=NamedSharding(m, P()))},
                      stats=load_stats, timeout=60, bandwidths=bandwidths)["r"]
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
    return {"bytes_written": stats.bytes_written, "bytes_read": load_stats.bytes_read, "nbytes": int(full.nbytes)}


def keys_per_host(path: str, mesh: list[int]) -> dict:
    """One typed key per device, sharded over every process; saved, then loaded as keys twice:
    onto the saved sharding, and replicated on every device (a read-once reshard)."""
    m = _mesh(mesh)
    n = int(np.prod(mesh))
    data = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(5, impl="rbg"), n)))
    sharding = NamedSharding(m, P(("x", "y")))
    # Each process builds its own shards of the key data, then wraps them as keys.
    keys = jax.random.wrap_key_data(
        jax.make_array_from_callback(data.shape, sharding, lambda idx: data[idx]), impl="rbg")
    cairn.save(path, {"rng": keys})
    out: dict[str, Any] = {}
    for name, target in (("same", sharding), ("replicated", NamedSharding(m, P()))):
        want = {"rng": jax.ShapeDtypeStruct((n,), keys.dtype, sharding=target)}
        got = cairn.load(path, want, timeout=60)["rng"]
        assert str(jax.random.key_impl(got)) == "rbg" and got.sharding.is_equivalent_to(target, 1), got.sharding
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(jax.random.key_data(shard.data)), data[shard.index])
        out[name] = len(got.addressable_shards)
    return out


def manager_agreement(directory: str, mesh: list[int]) -> dict:
    """Two steps; process 0 corrupts a chunk of step 2 that only process 1 reads; restore with
    fallback must land every process on step 1. Then process 1's own listing is hidden from
    it: `latest_step` must still be the primary's answer."""
    from cairn._dist.coord import default_coordinator
    from cairn._run import steps as _steps

    coord = default_coordinator()
    m = _mesh(mesh)
    with cairn.CheckpointManager(directory, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, make_state(mesh))
        if coord.process_index == 0:
            folder = os.path.join(directory, _steps.step_dirname(2), "params")
            victim = max((n for n in os.listdir(folder) if n.startswith("p00001")),
                         key=lambda n: os.path.getsize(os.path.join(folder, n)))
            with open(os.path.join(folder, victim), "r+b") as f:
                b = f.read(1)
                f.seek(0)
                f.write(bytes([b[0] ^ 0xFF]))
        coord.barrier("t/corrupted", 30)
        target = {"params": {}}
        for name, (shape, dtype, spec) in LEAVES.items():
            s = NamedSharding(m, _spec(list(spec)))
            target["params"][name] = jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype), sharding=s)
        mgr.restore(target=target, fallback=True, partial=True)
        restored = mgr.restored_step
        if coord.process_index == 1:
            _steps.committed_steps = lambda storage: []  # what a stale listing would say
        latest = mgr.latest_step()
    return {"restored": restored, "latest": latest}


def compare_routes(path: str, mesh: list[int], save_spec: list[Any], load_spec: list[Any], shape: list[int],
                   options: dict[str, dict], reps: int = 3, cold: bool = False) -> dict:
    """Save one array once, then load it with each of `options`, `reps` rounds in rotating order;
    per option, each round's seconds and stats.

    An option is load keywords, plus two optional keys: ``"system": "orbax"`` restores an Orbax
    checkpoint of the same array instead (saved once, beside cairn's, by orbax-checkpoint on the
    same `jax.distributed` processes), and ``"target": "saved"`` loads onto the saved sharding
    instead of `load_spec`. With `cold`, process 0 drops the page cache before every load
    (warm-ups included; needs root)."""
    from cairn._dist.coord import default_coordinator

    m = _mesh(mesh)
    shp = tuple(shape)
    full = expected("a", shp, "float32")
    saved = NamedSharding(m, _spec(save_spec))
    arr = jax.make_array_from_callback(shp, saved, lambda idx: full[idx])
    coord = default_coordinator()
    out: dict[str, Any] = {"nbytes": int(full.nbytes), "runs": {n: [] for n in options}}
    t0 = time.perf_counter()
    cairn.save(path, {"a": arr})
    out["save_s"] = time.perf_counter() - t0
    orbax = [n for n, o in options.items() if o.get("system") == "orbax"]
    ckptr = None
    if orbax:
        import logging

        import orbax.checkpoint as ocp

        logging.getLogger("absl").setLevel(logging.WARNING)
        ckptr = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True))
        coord.barrier("t/cmp/orbax-save", 120)
        t0 = time.perf_counter()
        ckptr.save(path + "-orbax", args=ocp.args.PyTreeSave({"a": arr}))
        ckptr.wait_until_finished()
        out["orbax_save_s"] = time.perf_counter() - t0
    del arr
    targets = {"saved": saved, "resharded": NamedSharding(m, _spec(load_spec))}
    seq = iter(range(1 << 30))  # barrier names are used once

    def load(name: str, stats: Any = None) -> Any:
        opt = dict(options[name])
        system = opt.pop("system", "cairn")
        target = targets[opt.pop("target", "resharded")]
        want = {"a": jax.ShapeDtypeStruct(shp, np.float32, sharding=target)}
        if cold:
            coord.barrier(f"t/cmp/drop/{next(seq)}", 120)
            if coord.process_index == 0:
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
        coord.barrier(f"t/cmp/go/{next(seq)}", 120)
        t0 = time.perf_counter()
        if system == "orbax":
            import orbax.checkpoint as ocp

            restore_args = ocp.checkpoint_utils.construct_restore_args(want)
            got = ckptr.restore(path + "-orbax", args=ocp.args.PyTreeRestore(item=want, restore_args=restore_args))
        else:
            got = cairn.load(path, want, stats=stats, **opt)
        jax.block_until_ready(got)
        return got["a"], time.perf_counter() - t0, target

    names = list(options)
    for name in names:  # once each to warm up (imports, compilation, page cache), checked
        got, _, target = load(name)
        assert got.sharding == target, (name, got.sharding, target)
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
        del got
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            stats = cairn.LoadStats()
            got, s, _ = load(name, stats)
            row: dict[str, Any] = {"load_s": s}
            if options[name].get("system") != "orbax":
                row.update({k: v for k, v in stats.as_dict().items() if isinstance(v, (int, float, str, dict))})
            out["runs"][name].append(row)
            del got
    if ckptr is not None:
        ckptr.close()
    return out


def route_choices(path: str, options: dict[str, dict]) -> dict:
    """Save arrays whose loads take different routes, load them with each of `options` (name ->
    load keywords), and report each process's routes and bytes per route."""
    m = _mesh([2, 2])
    shape = (512, 256)
    full = expected("a", shape, "float32")
    saved = NamedSharding(m, P(("x", "y")))
    arr = jax.make_array_from_callback(shape, saved, lambda idx: full[idx])
    cairn.save(path, {"replicated": arr, "columns": arr, "same": arr})
    want = {"replicated": jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(m, P())),
            "columns": jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(m, P(None, ("x", "y")))),
            "same": jax.ShapeDtypeStruct(shape, np.float32, sharding=saved)}
    out: dict[str, Any] = {"nbytes": int(full.nbytes)}
    for name, kw in options.items():
        stats = cairn.LoadStats()
        got = cairn.load(path, want, stats=stats, **kw)
        for leaf in got.values():
            for shard in leaf.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
        out[name] = {"leaf_routes": stats.leaf_routes, "routes": stats.routes, "bandwidths": stats.bandwidths,
                     "bytes_read": stats.bytes_read, "read_once_bytes_read": stats.read_once_bytes_read,
                     "interconnect_bytes": stats.interconnect_bytes, "read_once_leaves": stats.read_once_leaves}
    return out


def mismatched_routes(path: str, per_process: list[dict]) -> dict:
    """`route_choices`' arrays loaded with different keywords on each process (`per_process[i]`)."""
    m = _mesh([2, 2])
    shape = (512, 256)
    full = expected("a", shape, "float32")
    saved = NamedSharding(m, P(("x", "y")))
    arr = jax.make_array_from_callback(shape, saved, lambda idx: full[idx])
    cairn.save(path, {"replicated": arr, "columns": arr})
    want = {"replicated": jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(m, P())),
            "columns": jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(m, P(None, ("x", "y"))))}
    from cairn._dist.coord import default_coordinator

    try:
        cairn.load(path, want, timeout=60, **per_process[default_coordinator().process_index])
    except cairn.CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def continuous_agree(directory: str, mesh: list[int], slow_process: int, steps: int = 8) -> dict:
    """A continuous manager on every process while process `slow_process` writes slowly: every process
    must skip and save the same steps (the primary's view decides)."""
    from cairn._storage.local import LocalStorage

    if jax.process_index() == slow_process:
        orig = LocalStorage.write

        def slow_write(self: Any, key: str, parts: Any) -> Any:
            time.sleep(1.0)
            return orig(self, key, parts)

        LocalStorage.write = slow_write  # type: ignore[method-assign]
    state = make_state(mesh)
    saved = []
    with cairn.CheckpointManager(directory, continuous=True, handle_sigterm=False, max_to_keep=None) as mgr:
        for step in range(steps):
            if mgr.save(step, state):
                saved.append(step)
            time.sleep(0.05)  # a training step
        mgr.wait()
        stats = mgr.stats
        committed = mgr.steps()
    return {"saved": saved, "skipped": stats.skipped, "skipped_steps": stats.skipped_steps, "committed": committed}
