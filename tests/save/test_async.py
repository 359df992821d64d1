"""Two-phase async save: donation safety, snapshot budget, error surfacing, queueing, exit."""

import collections
import logging
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tests._hold import hold_writes

import cairn
from cairn._save import future as _async
from cairn._storage.local import LocalStorage
from cairn._storage.memory import MemoryStorage
from cairn._tree import shardings

_PROCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_procs")


def _sharded(mesh8, n=8 * 4096, offset=0.0):
    x = jnp.arange(n, dtype=jnp.float32).reshape(8, -1) + offset
    return jax.device_put(x, NamedSharding(mesh8, P("x")))



def _fail_writes(monkeypatch, cls, marker):
    """Make `cls.write` fail for keys containing `marker`, as a full disk would (a marker that is no
    hex string: save tokens in file names are hex, and one may contain "bad")."""
    orig = cls.write

    def write(self, key, parts):
        if marker in key:
            raise OSError(28, "No space left on device (injected)")
        return orig(self, key, parts)

    monkeypatch.setattr(cls, "write", write)


# ---------------------------------------------------------------------- donation safety


@pytest.mark.parametrize("to_host", [None, "pinned", "device"])
@pytest.mark.parametrize("budget", [None, 0, 3 * 8 * 4096])
def test_donating_step_right_after_save_async(tmp_path, mesh8, monkeypatch, budget, to_host):
    """The checkpoint holds the values at save time although the step donates them.

    budget None: everything is copied to host; 0: every shard is protected by
    an on-device copy; in between: some of each. The writes are held back
    until the donating steps have run, so they cannot win a race by luck.
    to_host: None takes the CPU path (host views copied into slabs);
    "pinned" treats the CPU devices as an accelerator's, so the snapshot's
    device-to-host transfers into pinned host memory (`start_to_host`) are
    what protects the values. (Its "cpu" method cannot be tried here: onto
    the CPU backend from a CPU device, JAX aliases the buffer.) "device": the
    same, with the snapshot's on-device copies (`device_snapshot`), not waited
    for, brought to host by the writers' pipeline.
    """
    if to_host is not None:
        monkeypatch.setattr(shardings, "on_cpu", lambda a: False)
        monkeypatch.setattr(shardings, "TO_HOST", to_host if to_host != "device" else None)
        monkeypatch.setattr(shardings, "DEVICE_SNAPSHOT", "always" if to_host == "device" else "never")
    step = jax.jit(lambda w, b: (w * 2.0 + 1.0, b - 1), donate_argnums=(0, 1))
    w, b = _sharded(mesh8), _sharded(mesh8, offset=7.0).astype(jnp.int32)
    jax.block_until_ready(step(w.copy(), b.copy()))  # compile before the save
    w_before, b_before = np.asarray(w).copy(), np.asarray(b).copy()
    go = hold_writes(monkeypatch)
    f = cairn.save_async(tmp_path / "c", {"w": w, "b": b}, snapshot_budget_bytes=budget)
    w2, b2 = step(w, b)
    w3, b3 = step(w2, b2)  # and again, so freed buffers are reused
    jax.block_until_ready((w3, b3))
    assert w.is_deleted() and b.is_deleted(), "the step really donated the saved arrays"
    assert not f.done()
    go.set()
    f.result(timeout=60)
    out = cairn.load(tmp_path / "c")
    np.testing.assert_array_equal(out["w"], w_before)
    np.testing.assert_array_equal(out["b"], b_before)
    total = w_before.nbytes + b_before.nbytes
    if budget is None and to_host == "device":
        assert (f.stats.snapshot_bytes, f.stats.device_copy_bytes, f.stats.device_snapshot_bytes) == (0, 0, total)
    elif budget is None:
        assert (f.stats.snapshot_bytes, f.stats.device_copy_bytes) == (total, 0)
    else:
        assert f.stats.snapshot_bytes <= budget
        assert f.stats.snapshot_bytes + f.stats.device_copy_bytes + f.stats.device_snapshot_bytes == total
        assert f.stats.device_copy_bytes > 0


def test_start_to_host_copies_outlive_the_arrays():
    xs = [jnp.arange(1000, dtype=jnp.float32) + i for i in range(3)]
    want = [np.asarray(x).copy() for x in xs]
    ys = [x.copy() for x in xs]
    hosts = shardings.start_to_host(ys, "pinned")
    for y in ys:
        y.delete()
    for h, w in zip(hosts, want):
        np.testing.assert_array_equal(np.asarray(h), w)
    for h, w in zip(shardings.start_to_host(xs, "cpu"), want):  # (on a CPU device, the same buffer)
        np.testing.assert_array_equal(np.asarray(h), w)
    with pytest.raises(ValueError, match="unknown device-to-host method 'nope'"):
        shardings.start_to_host(xs, "nope")


def test_the_device_to_host_method_is_chosen_per_platform(monkeypatch):
    """With no method named, the platform's (measured: pinned on GPUs, the CPU backend elsewhere,
    TPUs included); the host arrays it returns are what the writer threads read (`host_view`)."""
    x = jnp.arange(100, dtype=jnp.float32)
    assert shardings.TO_HOST is None
    assert shardings.TO_HOST_BY_PLATFORM["gpu"] == "pinned" and "tpu" not in shardings.TO_HOST_BY_PLATFORM
    [h] = shardings.start_to_host([x])
    assert h.sharding.memory_kind == "device"  # "cpu": onto the CPU backend (here the same device)
    monkeypatch.setitem(shardings.TO_HOST_BY_PLATFORM, "cpu", "pinned")
    [h] = shardings.start_to_host([x])
    assert h.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(shardings.host_view(h), np.arange(100, dtype=np.float32))


def test_device_snapshot_only_where_device_memory_has_room(monkeypatch):
    """"auto" copies on the device only where its limit minus its peak use leaves room for the copies
    and the headroom; a platform without memory statistics (the CPU backend) gets none."""

    class Device:
        platform = "tpu"

        def __init__(self, peak):
            self.peak = peak

        def memory_stats(self):
            return {"bytes_limit": 16 << 30, "peak_bytes_in_use": self.peak, "bytes_in_use": 1 << 30}

    class Array:
        def __init__(self, device, nbytes):
            self.device, self.nbytes = device, nbytes

    made = []
    monkeypatch.setattr(shardings, "_copy_all", lambda *xs: made.append(xs) or [("copy", x) for x in xs])
    monkeypatch.setattr(shardings, "DEVICE_SNAPSHOT", "auto")
    roomy, full = Device(peak=8 << 30), Device(peak=13 << 30)
    xs = [Array(roomy, 2 << 30), Array(roomy, 1 << 30)]
    assert shardings.device_snapshot(xs) == [("copy", x) for x in xs]
    assert len(made) == 1  # one call for the arrays of each device
    # 13 GiB peak + 3 GiB of copies leaves less than the headroom: no copies, on any device
    assert shardings.device_snapshot([Array(roomy, 1 << 20), Array(full, 3 << 30)]) is None
    assert shardings.device_snapshot([jnp.arange(10)]) is None  # the CPU backend
    monkeypatch.setattr(shardings, "DEVICE_SNAPSHOT", "never")
    assert shardings.device_snapshot(xs) is None
    assert len(made) == 1


def test_updates_and_deletes_after_save_async(tmp_path, mesh8, monkeypatch):
    w = _sharded(mesh8)
    host = np.arange(1000, dtype=np.int64)
    want_w, want_host = np.asarray(w).copy(), host.copy()
    go = hold_writes(monkeypatch)
    f = cairn.save_async(tmp_path / "c", {"w": w, "host": host, "cfg": {"lr": 0.1}}, snapshot_budget_bytes=0)
    host[:] = -1  # the caller's numpy array changes
    w.delete()  # and the device array goes away
    go.set()
    f.result(timeout=60)
    out = cairn.load(tmp_path / "c")
    np.testing.assert_array_equal(out["w"], want_w)
    np.testing.assert_array_equal(out["host"], want_host)
    assert out["cfg"] == {"lr": 0.1}


def test_stats_cover_each_phase(tmp_path, mesh8):
    w = _sharded(mesh8, n=8 * 65536)
    f = cairn.save_async(tmp_path / "c", {"w": w})
    stats = f.result(timeout=60)
    assert stats is f.stats
    assert stats.blocking_s > 0 and stats.snapshot_s > 0 and stats.write_s > 0 and stats.commit_s > 0
    assert stats.snapshot_s <= stats.blocking_s <= stats.total_s
    assert stats.bytes_written == w.nbytes == stats.snapshot_bytes
    assert stats.files_written >= 1


# ---------------------------------------------------------------------- errors


def test_background_error_surfaces_from_result_log_and_next_save(tmp_path, monkeypatch, caplog):
    _fail_writes(monkeypatch, LocalStorage, "nospace")
    x = np.arange(10)
    with caplog.at_level(logging.ERROR, logger="cairn"):
        f = cairn.save_async(tmp_path / "nospace", {"x": x})
        with pytest.raises(cairn.CheckpointError, match="No space left") as info:
            f.result(timeout=60)
    assert str(tmp_path / "nospace") in str(info.value)
    assert any("background save" in r.message and "nospace" in r.message for r in caplog.records)
    assert not (tmp_path / "nospace").exists(), "a failed save leaves nothing visible"
    # result() collected the error: the next save is not blocked by it.
    cairn.save_async(tmp_path / "ok1", {"x": x}).result(timeout=60)

    # Nobody collects this one: the next save raises it, once, and does not start.
    cairn.save_async(tmp_path / "nospace2", {"x": x})
    _async._background.wait_all(60)
    with pytest.raises(cairn.CheckpointError, match="earlier async save to .*nospace2") as info:
        cairn.save_async(tmp_path / "ok2", {"x": x})
    assert "No space left" in str(info.value.__cause__)
    assert not (tmp_path / "ok2").exists()
    cairn.save_async(tmp_path / "ok2", {"x": x}).result(timeout=60)
    # The blocking save surfaces it too, and so does wait_all.
    cairn.save_async(tmp_path / "nospace3", {"x": x})
    _async._background.wait_all(60)
    with pytest.raises(cairn.CheckpointError, match="nospace3"):
        cairn.save(tmp_path / "ok3", {"x": x})
    cairn.save_async(tmp_path / "nospace4", {"x": x})
    with pytest.raises(cairn.CheckpointError, match="nospace4"):
        cairn.wait_all()
    cairn.wait_all()  # reported once


def test_exception_collects_the_error(tmp_path, monkeypatch):
    _fail_writes(monkeypatch, MemoryStorage, "nospace")
    f = cairn.save_async("memory://async-exc/nospace", {"x": np.ones(3)})
    assert isinstance(f.exception(timeout=60), OSError | cairn.CheckpointError)
    cairn.save_async("memory://async-exc/ok", {"x": np.ones(3)}).result(timeout=60)


def test_validation_errors_raise_in_the_blocking_phase(tmp_path):
    with pytest.raises(cairn.UnsupportedTypeError, match="'x/bad'"):
        cairn.save_async(tmp_path / "c", {"x": {"bad": object()}})
    cairn.save(tmp_path / "d", {"x": np.ones(2)})
    with pytest.raises(cairn.CheckpointExistsError):
        cairn.save_async(tmp_path / "d", {"x": np.ones(2)})


# ---------------------------------------------------------------------- ordering and concurrency


def test_saves_commit_in_order_one_at_a_time(tmp_path, monkeypatch):
    """A second save queues behind the first: never writes or commits of two saves at once (one save's
    commit writes its index and index part together, `RenameCommit.put_all`)."""
    active, peak, order = collections.Counter(), [0], []
    lock = threading.Lock()
    orig = LocalStorage.write

    def slow_write(self, key, parts):
        save = key.split("/")[0]
        with lock:
            active[save] += 1
            peak[0] = max(peak[0], len(+active))  # saves with a write in flight
        try:
            time.sleep(0.05)
            return orig(self, key, parts)
        finally:
            with lock:
                active[save] -= 1
                order.append(save)

    monkeypatch.setattr(LocalStorage, "write", slow_write)
    futures = [cairn.save_async(tmp_path / f"c{i}", {"x": np.full(4, i)}, threads=1) for i in range(4)]
    for f in futures:
        f.result(timeout=60)
    assert peak[0] == 1
    saves = [o.split("cairn-tmp")[0] for o in order]
    assert [s for k, s in enumerate(saves) if not k or saves[k - 1] != s] == [f".c{i}." for i in range(4)]
    assert futures[1].stats.queued_s > 0.02
    for i in range(4):
        assert cairn.load(tmp_path / f"c{i}")["x"].tolist() == [i] * 4


def test_two_saves_to_one_path_never_race(tmp_path):
    x = np.arange(5)
    f1 = cairn.save_async(tmp_path / "c", {"x": x})
    f2 = cairn.save_async(tmp_path / "c", {"x": x + 1})
    f1.result(timeout=60)
    with pytest.raises(cairn.CheckpointExistsError):
        f2.result(timeout=60)
    assert cairn.load(tmp_path / "c")["x"].tolist() == x.tolist()


@pytest.mark.parametrize("where", ["local", "memory"])
def test_many_rapid_saves(tmp_path, mesh8, where):
    base = str(tmp_path) if where == "local" else "memory://rapid"
    w = _sharded(mesh8, n=8 * 256)
    inc = jax.jit(lambda w: w + 1.0, donate_argnums=0)
    futures = []
    for i in range(40):
        futures.append(cairn.save_async(f"{base}/c{i}", {"w": w, "i": i}))
        assert len(_async._background._pending) <= _async.MAX_PENDING
        w = inc(w)
    for f in futures:
        f.result(timeout=120)
    base_values = np.arange(8 * 256, dtype=np.float32).reshape(8, -1)
    for i in range(40):
        out = cairn.load(f"{base}/c{i}")
        assert out["i"] == i
        np.testing.assert_array_equal(out["w"], base_values + i)


# ---------------------------------------------------------------------- process exit


@pytest.mark.parametrize("budget", ["none", "0"])
def test_exit_with_a_save_in_flight_completes_it(tmp_path, budget):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    path = tmp_path / "c"
    proc = subprocess.run(
        [sys.executable, os.path.join(_PROCS, "async_exit.py"), str(path), budget],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "returned" in proc.stdout
    assert "failed" not in proc.stderr, proc.stderr
    out = cairn.load(path)
    np.testing.assert_array_equal(out["x"], np.arange(8 * 65536, dtype=np.float32).reshape(8, 65536))
    assert out["y"].tolist() == list(range(100)) and out["cfg"] == {"lr": 0.5}
    assert sorted(os.listdir(tmp_path)) == ["c"], "no temporary folder is left behind"


def test_snapshot_buffers_are_reused_without_mixing_saves(tmp_path, mesh8):
    """Later snapshots reuse the host buffers of finished ones; no checkpoint sees another's bytes."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from cairn._core import buffers as _buffers

    cairn.release_snapshot_buffers()
    states = [
        {"p": {"w": jax.device_put(np.full((64, 32), float(i), np.float32), NamedSharding(mesh8, P("x"))),
               "n": np.full(5, i, np.int32)}}
        for i in range(5)
    ]
    futures = [cairn.save_async(tmp_path / "s0", states[0])]
    futures[0].result()
    pooled = _buffers.snapshot_pool._bytes
    assert pooled == 64 * 32 * 4 + 5 * 4  # the finished snapshot's buffers wait for the next save
    for i in range(1, 5):  # some in flight at once, some reusing buffers
        futures.append(cairn.save_async(tmp_path / f"s{i}", states[i]))
    for f in futures:
        f.result()
    assert _buffers.snapshot_pool._bytes > 0
    for i in range(5):
        out = cairn.load(tmp_path / f"s{i}")  # a load gives the cached buffers back first
        assert _buffers.snapshot_pool._bytes == 0
        np.testing.assert_array_equal(out["p"]["w"], np.full((64, 32), float(i), np.float32))
        np.testing.assert_array_equal(out["p"]["n"], np.full(5, i, np.int32))
    cairn.release_snapshot_buffers()
    assert _buffers.snapshot_pool._bytes == 0


def test_device_copies_of_a_structure_are_batched_once_compiled(monkeypatch):
    """The first copies of a structure go array by array while its batched copy compiles in the
    background; later ones use the batched copy. Either way: new buffers with the same values."""
    monkeypatch.setattr(shardings, "_batched", {})
    xs = [jnp.arange(1000, dtype=jnp.float32) + i for i in range(3)] + [jnp.ones((4, 5), jnp.bfloat16)]
    first = shardings._copy_all(*xs)
    for _ in range(200):  # the background compile (seconds at most)
        if all(v is not shardings._COMPILING for v in shardings._batched.values()):
            break
        time.sleep(0.05)
    [compiled] = shardings._batched.values()
    assert compiled is not shardings._COMPILING
    later = shardings._copy_all(*xs)
    for x, a, b in zip(xs, first, later):
        assert a.unsafe_buffer_pointer() != x.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(x))
        np.testing.assert_array_equal(np.asarray(b), np.asarray(x))
    x0 = np.asarray(xs[0]).copy()
    xs[0].delete()
    np.testing.assert_array_equal(np.asarray(later[0]), x0)
