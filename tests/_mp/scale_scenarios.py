"""Many-process scenarios (tests/distributed/test_scale.py): one CPU device per process, every operation counted.

`scale` runs, in one cluster, a sequence of operations on a small state over a
``(processes,)`` mesh and reports, per operation and per process: wall time,
the calls this process made to JAX's coordination client and the bytes that
went through it (keys, values sent and values received), the heartbeat
thread's calls apart (they follow the clock, not the operation), and the
storage requests (`LocalStorage` calls, plus the counts of `SaveStats` /
`LoadStats` where an operation has them).

The client is wrapped (`CountingClient`) after the backend exists and
before cairn first asks for its coordinator. Operations are separated by a
barrier on the raw client, which is not counted. Every result is checked
exactly on every process; a failed check fails the process.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn

#: Wait limit for the harness's own barriers between operations (seconds).
BARRIER_S = 300


class CountingClient:
    """Wraps a ``DistributedRuntimeClient``: counts each call and its bytes, by thread kind."""

    def __init__(self, client: Any):
        self._client = client
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()  # "op:method" / "beat:method"
        self.bytes: Counter[str] = Counter()  # "op" / "beat"

    def raw(self) -> Any:
        return self._client

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"calls": dict(self.calls), "bytes": dict(self.bytes)}

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._client, name)
        if not callable(real) or name.startswith("_"):
            return real

        def call(*args: Any, **kw: Any) -> Any:
            kind = "beat" if threading.current_thread().name == "cairn-heartbeat" else "op"
            if kind == "op" and args and isinstance(args[0], str) and args[0].startswith("cairn/alive"):
                kind = "wait"  # a liveness check while waiting: as many as the wait lasts slices
            sent = sum(len(a) for a in args if isinstance(a, (str, bytes)))
            try:
                out = real(*args, **kw)
            except Exception as e:
                if kind == "op" and any(w in str(e).lower() for w in ("deadline", "timed out", "timeout")):
                    kind = "wait"  # a wait slice that ran out: the protocol's call is the one that succeeds
                raise
            finally:
                with self._lock:
                    self.calls[f"{kind}:{name}"] += 1
                    self.bytes[kind] += sent
            got = 0
            if isinstance(out, (bytes, str)):
                got = len(out)
            elif isinstance(out, list):  # a directory listing: [(key, value)]
                got = sum(len(k) + len(v) for k, v in out)
            if got:
                with self._lock:
                    self.bytes[kind] += got
            return out

        return call


def _count_storage() -> Counter[str]:
    """Count the requests of the local storage backend (and its file readers), by method."""
    from cairn._storage import local

    counts: Counter[str] = Counter()
    for cls in (local.LocalStorage, local._FileReader):
        for name, fn in list(vars(cls).items()):
            if name.startswith("_") or not callable(fn) or name in ("describe", "close"):
                continue

            def wrap(fn: Any = fn, name: str = name) -> Any:
                def counted(*a: Any, **kw: Any) -> Any:
                    counts[name] += 1
                    return fn(*a, **kw)
                return counted

            setattr(cls, name, wrap())
    return counts


def install() -> tuple[CountingClient, Counter[str]]:
    """Wrap the coordination client (after the backend exists) and the storage backend."""
    from jax._src import distributed

    jax.devices()  # the backend, and with it the client's connection, exists now
    client = CountingClient(distributed.global_state.client)
    distributed.global_state.client = client
    return client, _count_storage()


# ---------------------------------------------------------------------------- the state

def full(name: str, shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
    seed = sum(map(ord, name)) % 97
    return (np.arange(int(np.prod(shape)), dtype=np.float64) * 0.5 + seed).reshape(shape).astype(dtype)


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()), ("x",))


#: The size unit of the state: a multiple of every process count a run's state is loaded onto.
UNIT = [1]


def _shapes(n: int) -> dict[str, tuple[int, ...]]:
    u = UNIT[0]  # (n: the process count, which divides u)
    assert u % n == 0, (u, n)
    return {"w": (8 * u, 4 * u), "b": (16,), "c": (4 * u,)}


def _specs(reshard: bool) -> dict[str, P]:
    if reshard:  # every leaf moves: w along the other axis, c replicated, b split
        return {"w": P(None, "x"), "b": P(), "c": P()}
    return {"w": P("x", None), "b": P(), "c": P("x")}


def make_state(n: int) -> dict[str, Any]:
    m = _mesh()
    params = {}
    for name, shape in _shapes(n).items():
        f = full(name, shape)
        params[name] = jax.make_array_from_callback(shape, NamedSharding(m, _specs(False)[name]),
                                                    lambda idx, f=f: f[idx])
    return {"params": params, "extra": {"step": 7, "table": np.arange(6, dtype=np.int64)}}


def abstract(n: int, reshard: bool = False) -> dict[str, Any]:
    m = _mesh()
    return {name: jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(m, _specs(reshard)[name]))
            for name, shape in _shapes(n).items()}


def check(params: dict[str, Any], n: int, target: dict[str, Any]) -> int:
    """Every addressable shard against the pure function of its leaf; returns the shards checked."""
    checked = 0
    for name, shape in _shapes(n).items():
        arr = params[name]
        assert arr.shape == shape and arr.sharding == target[name].sharding, (name, arr.sharding)
        f = full(name, shape)
        for s in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), f[s.index], err_msg=name)
            checked += 1
    return checked


# ---------------------------------------------------------------------------- operations

def _op_save(ctx: dict[str, Any]) -> dict[str, Any]:
    stats = cairn.save(ctx["path"], make_state(ctx["n"]), timeout=120)
    return {"files_written": stats.files_written, "bytes_written": stats.bytes_written}


def _load(ctx: dict[str, Any], reshard: bool) -> dict[str, Any]:
    n = ctx["n"]
    target = abstract(n, reshard)
    stats = cairn.LoadStats()
    out = cairn.load(ctx["path"], {"params": target, "extra": None}, stats=stats, timeout=120)
    checked = check(out["params"], n, target)
    assert out["extra"]["step"] == 7
    np.testing.assert_array_equal(out["extra"]["table"], np.arange(6))
    return {"reads": stats.reads, "bytes_read": stats.bytes_read, "read_once_leaves": stats.read_once_leaves,
            "shards_checked": checked}


def _op_load(ctx: dict[str, Any]) -> dict[str, Any]:
    return _load(ctx, False)


def _op_load_resharded(ctx: dict[str, Any]) -> dict[str, Any]:
    return _load(ctx, True)


def _op_metadata(ctx: dict[str, Any]) -> dict[str, Any]:
    meta = cairn.metadata(ctx["path"])
    for name, shape in _shapes(ctx["n"]).items():
        assert tuple(meta["params"][name].shape) == shape, (name, meta["params"][name])
    return {}


def _op_manager(ctx: dict[str, Any]) -> dict[str, Any]:
    n = ctx["n"]
    state = make_state(n)
    directory = os.path.join(ctx["root"], "run")
    with cairn.CheckpointManager(directory, max_to_keep=2, async_save=True, handle_sigterm=False) as mgr:
        for step in range(4):
            assert mgr.save(step, state)
        mgr.wait(120)
        steps = mgr.steps()
        assert steps == [2, 3], steps
        got = mgr.restore(target={"params": abstract(n), "extra": None})
        assert mgr.restored_step == 3
        check(got["params"], n, abstract(n))
    return {"steps": steps}


def _per_process_value(p: int) -> dict[str, Any]:
    return {"pos": 1000 + p, "rng": [p, p * 2]}


def _op_per_process(ctx: dict[str, Any]) -> dict[str, Any]:
    me, n = jax.process_index(), ctx["n"]
    path = os.path.join(ctx["root"], "perprocess")
    state = make_state(n)
    cairn.save(path, {"params": state["params"], "data": cairn.PerProcess(_per_process_value(me)),
                      "config": {"lr": 0.5}}, timeout=120)
    got = cairn.load(path, {"params": abstract(n), "data": cairn.PerProcess(), "config": None}, timeout=120)
    assert isinstance(got["data"], cairn.PerProcess) and got["data"].value == _per_process_value(me), got["data"]
    assert got["config"] == {"lr": 0.5}
    check(got["params"], n, abstract(n))
    return {}


def _reshard_values(saved: list, index: int, count: int) -> dict[str, Any]:
    assert [v["pos"] for v in saved] == [1000 + p for p in range(len(saved))], saved
    return _per_process_value(index)


def _tier_state(n: int, step: int) -> dict[str, Any]:
    state = make_state(n)
    return {"params": state["params"], "step": step, "iter": cairn.PerProcess(_per_process_value(jax.process_index()))}


def _tier_target(n: int) -> dict[str, Any]:
    return {"params": abstract(n), "step": 0, "iter": cairn.PerProcess(reshard=_reshard_values)}


def _op_local_restore_other(ctx: dict[str, Any]) -> dict[str, Any]:
    """Restore the local tier another cluster (of a different process count) saved into `ctx['tier_from']`."""
    n, me = ctx["n"], jax.process_index()
    src = ctx["tier_from"]
    local = cairn.LocalTier(os.path.join(src, "host"), every=1, keep=2, replicas=1)
    with cairn.CheckpointManager(os.path.join(src, "persist"), save_every=10_000, local=local,
                                 handle_sigterm=False) as mgr:
        got = mgr.restore(target=_tier_target(n))
        assert local.restored_step == 2 and mgr.restored_step == 2, (local.restored_step, mgr.restored_step)
    assert got["step"] == 2 and got["iter"].value == _per_process_value(me), got["iter"]
    check(got["params"], n, abstract(n))
    return {"restored_step": 2}


def _tier_save(ctx: dict[str, Any], folder: str, host: str, restore: bool) -> dict[str, Any]:
    n, me = ctx["n"], jax.process_index()
    base = os.path.join(ctx["root"], folder)
    local = cairn.LocalTier(os.path.join(base, host), every=1, keep=2, replicas=1)
    with cairn.CheckpointManager(os.path.join(base, "persist"), save_every=10_000, local=local,
                                 handle_sigterm=False) as mgr:
        for step in range(3):
            mgr.save(step, _tier_state(n, step))
        local.wait()
        if restore:
            got = mgr.restore(target=_tier_target(n))
            assert local.restored_step == 2, local.restored_step
            assert got["step"] == 2 and got["iter"].value == _per_process_value(me), got["iter"]
            check(got["params"], n, abstract(n))
    return {"local_steps": local.steps()}


def _op_local_tier(ctx: dict[str, Any]) -> dict[str, Any]:
    """Save three steps to the local tier, a host directory per process and one peer replica each,
    then restore the newest from it on the same processes."""
    return _tier_save(ctx, "tier", f"host{jax.process_index()}", True)


def _op_local_tier_shared(ctx: dict[str, Any]) -> dict[str, Any]:
    """Save three steps to the local tier with every process in one host directory (as on one machine),
    for another process count to restore (`_op_local_restore_other`): there every process sees every blob."""
    return _tier_save(ctx, "shared", "host", False)


def _op_dead_peer(ctx: dict[str, Any]) -> dict[str, Any]:
    """The last process dies before it writes its status; every survivor must raise naming it."""
    n, me = ctx["n"], jax.process_index()
    dead = n - 1
    if me == dead:
        with open(os.path.join(ctx["root"], f"dead-{me}.json"), "w") as f:
            json.dump(ctx["out"], f)  # what it measured before, for the test
        time.sleep(0.5)
        os._exit(9)
    t0 = time.monotonic()
    try:
        cairn.save(os.path.join(ctx["root"], "dead"), make_state(n), timeout=300)
    except cairn.CoordinationError as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
    raise AssertionError("the save succeeded without the dead process")


OPS = {
    "save": _op_save, "load": _op_load, "load_resharded": _op_load_resharded, "metadata": _op_metadata,
    "manager": _op_manager, "per_process": _op_per_process, "local_tier": _op_local_tier,
    "local_tier_shared": _op_local_tier_shared,
    "local_restore_other": _op_local_restore_other, "dead_peer": _op_dead_peer,
}


def scale(root: str, ops: list[str], tier_from: str | None = None, unit: int | None = None) -> dict[str, Any]:
    """Run `ops` in order on every process; per operation, this process's counts. `unit`: the state's
    size unit, a multiple of the process count (default: the process count)."""
    client, storage = install()
    raw = client.raw()
    n, me = jax.process_count(), jax.process_index()
    UNIT[0] = unit or n
    os.makedirs(root, exist_ok=True)
    ctx = {"n": n, "root": root, "path": os.path.join(root, "ckpt"), "tier_from": tier_from}
    out: dict[str, Any] = {"process": me, "ops": {}}
    ctx["out"] = out
    for k, op in enumerate(ops):
        if op != "dead_peer":
            raw.wait_at_barrier(f"scale/before/{k}", BARRIER_S * 1000)
        c0, s0, t0 = client.snapshot(), Counter(storage), time.perf_counter()
        result = OPS[op](ctx)
        wall = time.perf_counter() - t0
        c1, s1 = client.snapshot(), Counter(storage)
        calls = {m: c1["calls"].get(m, 0) - c0["calls"].get(m, 0) for m in c1["calls"]}
        out["ops"][op] = {
            "wall_s": round(wall, 4),
            "calls": sum(v for m, v in calls.items() if m.startswith("op:")),
            "bytes": c1["bytes"].get("op", 0) - c0["bytes"].get("op", 0),
            # Time-driven, not the protocol's: wait slices that ran out and the liveness checks between them.
            "wait_calls": sum(v for m, v in calls.items() if m.startswith("wait:")),
            "beat_calls": sum(v for m, v in calls.items() if m.startswith("beat:")),
            "by_method": {m[3:]: v for m, v in sorted(calls.items()) if m.startswith("op:") and v},
            "storage": sum((s1 - s0).values()),
            "storage_by_method": dict(sorted((s1 - s0).items())),
            **result,
        }
    if "dead_peer" not in ops:
        raw.wait_at_barrier("scale/end", BARRIER_S * 1000)
    return out


# ---------------------------------------------------------------------------- reporting (no jax needed)

def state_bytes(unit: int) -> int:
    """The bytes of the saved state's arrays: what a save writes and a load reads, cluster-wide."""
    return 4 * (8 * unit * 4 * unit + 16 + 4 * unit) + 8 * 6  # w, b, c (float32) and extra/table (int64)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per operation: the primary's calls and bytes, the non-primaries' (max and mean), the slowest
    process's wall time, and storage requests (max over processes)."""
    out: dict[str, Any] = {}
    ops = results[0]["ops"]
    for op in ops:
        rows = [r["ops"][op] for r in results if op in r["ops"]]
        rest = [r for r in rows[1:]] or rows
        out[op] = {
            "processes": len(rows),
            "wall_s": max(r["wall_s"] for r in rows),
            "primary_calls": rows[0]["calls"], "primary_bytes": rows[0]["bytes"],
            "other_calls_max": max(r["calls"] for r in rest),
            "other_calls_mean": round(sum(r["calls"] for r in rest) / len(rest), 2),
            "other_bytes_max": max(r["bytes"] for r in rest),
            "service_calls": sum(r["calls"] for r in rows), "service_bytes": sum(r["bytes"] for r in rows),
            "wait_calls_max": max(r["wait_calls"] for r in rows),
            "storage_max": max(r["storage"] for r in rows),
            "beat_calls_mean": round(sum(r["beat_calls"] for r in rows) / len(rows), 2),
        }
    return out
