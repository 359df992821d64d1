"""Scenarios of tests/tree/test_perprocess.py: per-process values across real processes (see __init__.py)."""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn


def own_value(p: int) -> dict[str, Any]:
    """What process `p` declares as its own: inline values, bytes and a numpy array."""
    return {"state": f"iterator state of process {p}".encode(), "pos": 10 * p + 1, "name": f"p{p}",
            "window": np.full((2, p + 1), p, np.int32), "seen": [b"x" * i for i in range(p)]}


def _params() -> jax.Array:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    full = np.arange(8 * len(jax.devices()), dtype=np.float32)
    return jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("x")), lambda idx: full[idx])


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and got.dtype == want.dtype and np.array_equal(got, want)
    return type(got) is type(want) and got == want


def save_and_restore(directory: str) -> dict:
    """Declared per-process values round-trip to their own process (save, save_async, manager);
    undeclared differing values are refused on every process; a checkpoint is left for other counts."""
    me = jax.process_index()
    params = _params()
    target = {"params": jax.ShapeDtypeStruct(params.shape, params.dtype, sharding=params.sharding),
              "data": cairn.PerProcess(), "config": None}
    out: dict[str, Any] = {}

    path = os.path.join(directory, "declared")
    cairn.save(path, {"params": params, "data": cairn.PerProcess(own_value(me)), "config": {"lr": 0.5}})
    got = cairn.load(path, target, timeout=60)
    assert isinstance(got["data"], cairn.PerProcess), got["data"]
    out["declared"] = _same(got["data"].value, own_value(me)) and got["config"] == {"lr": 0.5}
    plain = cairn.load(path, {"data": None}, timeout=60)["data"]  # a non-PerProcess target leaf: the plain value
    out["plain"] = _same(plain, own_value(me)) and _same(cairn.load(path)["data"], own_value(me))
    np.testing.assert_array_equal(np.asarray(got["params"].addressable_shards[0].data),
                                  np.asarray(params.addressable_shards[0].data))

    path = os.path.join(directory, "async")
    cairn.save_async(path, {"data": cairn.PerProcess(own_value(me)), "step": 3}).result()
    out["async"] = _same(cairn.load(path, {"data": cairn.PerProcess(), "step": None})["data"].value, own_value(me))

    with cairn.CheckpointManager(os.path.join(directory, "run"), async_save=True) as mgr:
        for step in (1, 2):
            mgr.save(step, {"params": params, "data": cairn.PerProcess({"step": step, "p": me})})
        mgr.wait()
    with cairn.CheckpointManager(os.path.join(directory, "run")) as mgr:
        restored = mgr.restore(target={"params": target["params"], "data": cairn.PerProcess()})
        out["manager"] = [mgr.restored_step, restored["data"].value]

    # Undeclared: the bytes differ on every process, `cfg/x` on odd ones; `same` agrees.
    refused = os.path.join(directory, "refused")
    try:
        cairn.save(refused, {"params": params, "data": f"iterator state of process {me}".encode(),
                             "same": 1, "cfg": {"x": me % 2}}, timeout=60)
        out["refused"] = None
    except cairn.CheckpointError as e:
        out["refused"] = [type(e).__name__, str(e)]
    try:  # the last process saves another tree: refused, naming it
        cairn.save(os.path.join(directory, "trees"), {"cfg": {"x": 1} if me < jax.process_count() - 1 else {"y": 1}})
        out["trees"] = None
    except cairn.CheckpointError as e:
        out["trees"] = str(e)
    out["refused_left"] = sorted(os.listdir(directory))

    # A leaf that process 1 cannot store: it fails there, and the others learn so at once.
    t0 = time.monotonic()
    try:
        cairn.save(os.path.join(directory, "unstorable"), {"x": object() if me == 1 else 1}, timeout=60)
        out["unstorable"] = None
    except cairn.CheckpointError as e:
        out["unstorable"] = [type(e).__name__, str(e), time.monotonic() - t0]
    return out


def load_other_count(path: str, kind: str) -> dict:
    """Load a checkpoint saved by another number of processes: with the hook, or without (an error)."""
    me, n = jax.process_index(), jax.process_count()

    def reshard(saved: list[Any], index: int, count: int) -> Any:
        # Deal the saved positions out round-robin: new process `index` takes old ones index, index+count, ...
        return sorted(int(v["pos"]) for v in saved[index::count])

    if kind == "hook":
        got = cairn.load(path, {"data": cairn.PerProcess(reshard=reshard), "config": None}, timeout=60)
        return {"value": got["data"].value, "me": me, "n": n}
    if kind == "targetless":  # every saved value, the same on each process; a None target leaf alike
        whole = cairn.load(path, timeout=60)
        leaf = cairn.load(path, {"data": None, "config": None}, timeout=60)
        # mesh=: the params, saved P("x") over 3 processes, come back P("x") over these processes.
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
        params = cairn.load(path, {"params": None}, partial=True, mesh=mesh, timeout=60)["params"]
        shard = params.addressable_shards[0]
        return {"spec": str(params.sharding.spec), "shard": np.asarray(shard.data).tolist(),
                "index": [[s.start, s.stop] for s in shard.index],
                "pos": [v["pos"] for v in whole["data"]], "config": whole["config"],
                "same": [_same(a, b) for a, b in zip(whole["data"], leaf["data"])] + [len(whole["data"]) == len(
                    leaf["data"])], "mine": {k: whole["data"][me][k] for k in ("pos", "name")}}
    try:
        cairn.load(path, {"data": cairn.PerProcess(), "config": None}, timeout=60)
        return {"error": None}
    except cairn.CheckpointError as e:
        return {"error": [type(e).__name__, str(e)]}
