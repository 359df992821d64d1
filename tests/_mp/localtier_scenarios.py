"""Scenarios for the local tier (tests/test_local_tier.py): a small deterministic training run.

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
    return {"params": params, "step": -1, "data": b"it--1", "table": np.arange(3)}


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
            "table": np.arange(3) + step}


def _abstract() -> dict[str, Any]:
    s = _shardings()
    init = _init()
    params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s[k]) for k, v in init["params"].items()}
    return {"params": params, "step": 0, "data": b"", "table": np.zeros(3, np.int64)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for k in ("w", "b", "e"):
        for x, y in zip(a["params"][k].addressable_shards, b["params"][k].addressable_shards):
            if x.index != y.index or np.asarray(x.data).tobytes() != np.asarray(y.data).tobytes():
                return False
    return (a["step"], a["data"]) == (b["step"], b["data"]) and np.array_equal(a["table"], b["table"])


def train(root: str, persist: str, total: int, local_every: int = 2, save_every: int = 6,
          die_at: int | None = None, replicas: int = 1) -> dict[str, Any]:
    me = jax.process_index()
    fn = _step_fn()
    local = cairn.LocalTier(f"{root}/host{me}", every=local_every, keep=2, replicas=replicas)
    mgr = cairn.CheckpointManager(persist, save_every=save_every, local=local, handle_sigterm=False)
    state, start, tier = _init(), 0, None
    try:
        state = mgr.restore(target=_abstract())
        start = mgr.restored_step + 1
        tier = "local" if local.restored_step is not None else "persistent"
    except cairn.CheckpointNotFoundError:
        pass
    restored = None if tier is None else start - 1
    print(f"resumed {tier} {restored}", flush=True)  # for runs that die before reporting
    for step in range(start, total):
        state = _advance(state, step, fn)
        mgr.save(step, state)
        if step == die_at:
            os._exit(3)  # dead: no wait, no close; the local save of this step may be half written
    mgr.close()
    ref = _init()
    for step in range(total):
        ref = _advance(ref, step, fn)
    return {"restored": restored, "tier": tier, "equal": _same(state, ref), "local_steps": local.steps(),
            "blocking_s": local.last_save.get("blocking_s")}
