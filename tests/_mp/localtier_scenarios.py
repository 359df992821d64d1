"""Scenarios for the local tier (tests/local/test_local_tier.py): a small deterministic training run.

Every process trains the same sharded model on a (processes, 2) mesh, saving
to a persistent directory every `save_every` steps and to its own host
directory every `local_every` steps. A run may stop dead (``os._exit``) right
after the save of step `die_at`, with the local save of that step still in
flight. A resumed run reports where it resumed from and whether its final
state is bitwise equal to an uninterrupted run computed in the same process.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import cairn


def _shardings() -> dict[str, NamedSharding]:
    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("x", "y"))
    return {"w": NamedSharding(mesh, P("x", "y")), "b": NamedSharding(mesh, P()),
            "e": NamedSharding(mesh, P(None, "y"))}


def _init() -> dict[str, Any]:
    s = _shardings()
    w = np.linspace(-1, 1, 16 * 12, dtype=np.float32).reshape(16, 12)
    params = {"w": jax.device_put(w, s["w"]), "b": jax.device_put(np.zeros(12, np.float32), s["b"]),
              "e": jax.device_put(np.ones((8, 6), jnp.bfloat16), s["e"])}
    return {"params": params, "step": -1, "data": b"it--1", "table": np.arange(3), "iter": _iter(-1)}


def _iter(step: int) -> cairn.PerProcess:
    """A data iterator's state: each process's own."""
    return cairn.PerProcess({"pos": step, "proc": jax.process_index()})


def _reshard_iter(saved: list, index: int, count: int) -> dict:
    assert len({v["pos"] for v in saved}) == 1 and [v["proc"] for v in saved] == list(range(len(saved)))
    return {"pos": saved[0]["pos"], "proc": index}


def _step_fn():
    s = _shardings()

    def f(p, step):
        w = p["w"] * 0.75 + jnp.sin(p["w"] * 3.0 + step) * 0.25
        b = p["b"] + w.sum(0) * 0.01
        e = (p["e"].astype(jnp.float32) * 0.9 + jnp.cos(step * 0.1)).astype(jnp.bfloat16)
        return {"w": w, "b": b, "e": e}

    return jax.jit(f, out_shardings={k: s[k] for k in ("w", "b", "e")})


def _advance(state: dict[str, Any], step: int, fn: Any) -> dict[str, Any]:
    return {"params": fn(state["params"], jnp.float32(step)), "step": step, "data": f"it-{step}".encode(),
            "table": np.arange(3) + step, "iter": _iter(step)}


def _abstract() -> dict[str, Any]:
    s = _shardings()
    init = _init()
    params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s[k]) for k, v in init["params"].items()}
    return {"params": params, "step": 0, "data": b"", "table": np.zeros(3, np.int64),
            "iter": cairn.PerProcess(reshard=_reshard_iter)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for k in a["params"]:
        for x, y in zip(a["params"][k].addressable_shards, b["params"][k].addressable_shards):
            if x.index != y.index or np.asarray(x.data).tobytes() != np.asarray(y.data).tobytes():
                return False
    return ((a["step"], a["data"]) == (b["step"], b["data"]) and np.array_equal(a["table"], b["table"])
            and isinstance(a["iter"], cairn.PerProcess) and a["iter"].value == b["iter"].value)


def _e_init() -> dict[str, Any]:
    s = _shardings()
    w = np.linspace(-1, 1, 24 * 12, dtype=np.float32).reshape(24, 12)
    params = {"w": jax.device_put(w, s["w"]), "b": jax.device_put(np.zeros(12, np.float32), s["b"]),
              "e": jax.device_put(np.ones((8, 6), jnp.bfloat16), s["e"]),
              "c": jax.device_put(np.arange(24, dtype=np.int32), NamedSharding(s["w"].mesh, P("x")))}
    return {"params": params, "step": -1, "data": b"it--1", "table": np.arange(3), "iter": _iter(-1)}


def _e_step_fn():
    s = _shardings()
    c_sharding = NamedSharding(s["w"].mesh, P("x"))

    def f(p, step):  # products by powers of two and sums: exact, whatever the shard shapes
        w = p["w"] * 0.5 + step
        b = p["b"] + w[0] * 0.25
        e = (p["e"].astype(jnp.float32) * 0.5 + 1.0).astype(jnp.bfloat16)
        return {"w": w, "b": b, "e": e, "c": p["c"] * 3 + step.astype(jnp.int32)}

    return jax.jit(f, out_shardings={"w": s["w"], "b": s["b"], "e": s["e"], "c": c_sharding})


def _e_advance(state: dict[str, Any], step: int, fn: Any) -> dict[str, Any]:
    return {"params": fn(state["params"], jnp.float32(step)), "step": step, "data": f"it-{step}".encode(),
            "table": np.arange(3) + step, "iter": _iter(step)}


def _e_abstract() -> dict[str, Any]:
    init = _e_init()
    params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in init["params"].items()}
    return {"params": params, "step": 0, "data": b"", "table": np.zeros(3, np.int64),
            "iter": cairn.PerProcess(reshard=_reshard_iter)}


def train(root: str, persist: str, total: int, local_every: int = 2, save_every: int = 6,
          die_at: int | None = None, replicas: int = 1, elastic: bool = False,
          restore_kw: dict[str, Any] | None = None) -> dict[str, Any]:
    """`elastic`: a state and an update that give the same bits on any process count (exact
    arithmetic only), for runs that restart on another number of processes. `restore_kw`: keywords
    of the restore (reading options, which the local tier serves)."""
    init, step_fn, abstract, advance = ((_e_init, _e_step_fn, _e_abstract, _e_advance) if elastic
                                        else (_init, _step_fn, _abstract, _advance))
    me = jax.process_index()
    fn = step_fn()
    local = cairn.LocalTier(f"{root}/host{me}", every=local_every, keep=2, replicas=replicas)
    mgr = cairn.CheckpointManager(persist, save_every=save_every, local=local, handle_sigterm=False)
    state, start, tier = init(), 0, None
    try:
        state = mgr.restore(target=abstract(), **(restore_kw or {}))
        start = mgr.restored_step + 1
        tier = "local" if local.restored_step is not None else "persistent"
    except cairn.CheckpointNotFoundError:
        pass
    restored = None if tier is None else start - 1
    print(f"resumed {tier} {restored}", flush=True)  # for runs that die before reporting
    for step in range(start, total):
        state = advance(state, step, fn)
        mgr.save(step, state)
        if step == die_at:
            os._exit(3)  # dead: no wait, no close; the local save of this step may be half written
    mgr.close()
    ref = init()
    for step in range(total):
        ref = advance(ref, step, fn)
    return {"restored": restored, "tier": tier, "equal": _same(state, ref), "local_steps": local.steps(),
            "blocking_s": local.last_save.get("blocking_s")}


def bench(root: str, persist: str, mib: int, replicas: int = 1, steps: int = 4) -> dict[str, Any]:
    """Timings for benchmarks/probes/local_tier.py: `mib` MiB of float32 state over every device."""
    import shutil
    import time

    me = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("x",))
    s = NamedSharding(mesh, P("x"))
    rows = len(jax.devices()) * 64
    n = mib * (1 << 20) // 4 // 4 // rows
    state = {f"w{i}": jax.device_put(jnp.full((rows, n), float(i), jnp.float32), s) for i in range(4)}
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s) for k, v in state.items()}
    local = cairn.LocalTier(f"{root}/host{me}", every=1, keep=2, replicas=replicas)
    mgr = cairn.CheckpointManager(persist, save_every=10_000, local=local, handle_sigterm=False)
    out: dict[str, Any] = {"nbytes": sum(v.nbytes for v in state.values())}

    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - t0

    mgr.save(1, state)  # compiles the packer and the replica transfer
    local.wait()
    t0 = time.perf_counter()
    mgr.save(2, state)
    out["local_blocking_s"] = time.perf_counter() - t0
    local.wait()
    out["local_total_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    mgr.save(10_000, state)
    out["persistent_blocking_s"] = time.perf_counter() - t0
    mgr.wait()
    out["persistent_total_s"] = time.perf_counter() - t0
    step = jax.jit(lambda t: jax.tree.map(lambda x: x * 0.999 + 0.001, t), donate_argnums=0)
    x = jax.tree.map(lambda v: v + 0, state)
    x = step(x)  # compile
    jax.block_until_ready(x)
    t0 = time.perf_counter()
    for _ in range(steps):
        x = step(x)
    jax.block_until_ready(x)
    t_plain = (time.perf_counter() - t0) / steps
    t0 = time.perf_counter()
    for i in range(steps):
        x = step(x)
        mgr.save(100 + i, x)  # a local save every step: the worst case
    jax.block_until_ready(x)
    out["step_s"] = t_plain
    out["step_with_local_save_s"] = (time.perf_counter() - t0) / steps
    local.wait()
    out["restore_local_s"] = timed(lambda: local.restore(target)[1])
    columns = NamedSharding(mesh, P(None, "x"))  # another layout: every process needs both blobs' bytes
    out["restore_resharded_s"] = timed(lambda: local.restore(
        {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=columns) for k, v in target.items()})[1])
    if jax.process_count() > 1 and me == 1:
        shutil.rmtree(f"{root}/host{me}")  # a replaced host: its shards come from process 0
    out["restore_from_peer_s"] = timed(lambda: local.restore(target)[1])
    out["restore_persistent_s"] = timed(lambda: mgr.restore(step=10_000, target=target))
    mgr.close()
    return out
