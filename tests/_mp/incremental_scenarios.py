"""Scenarios of tests/save/test_incremental.py: incremental saves across real processes (see __init__.py)."""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from cairn._save import basecache


def _w(first_row: float | None) -> jax.Array:
    """8 MiB of rows sharded over every device of every process: each process writes its own chunks."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    full = np.arange(4 * 2048 * 256, dtype=np.float32).reshape(4 * 2048, 256)
    if first_row is not None:
        full[0, :] = first_row
    return jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("x")), lambda idx: full[idx])


def chain(directory: str) -> dict:
    """Three steps of an incremental manager: only process 0's first chunk changes after step 0; each
    process decides for its own chunks; every process loads every step, resharded and read once."""
    out: dict = {"ok": True}
    with cairn.CheckpointManager(directory, incremental=True, async_save=True) as mgr:
        full = None
        for step, row in enumerate((None, 1.0, 2.0)):
            mgr.save(step, {"w": _w(row), "step": step})
            mgr.wait()
            if full is None:
                full = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in
                           os.walk(os.path.join(directory, "step_00000000")) for f in fs if f.endswith(".bin"))
        last = os.path.join(directory, "step_00000002")
        out["full_bytes"] = full
        out["kept"] = len(basecache._kept)  # a two-process commit keeps nothing: each wrote only its own part
        out["incremental_bytes"] = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(last)
                                       for f in fs if f.endswith(".bin"))
        mine = f"p{jax.process_index():05d}-"  # what this process wrote of step 2: its own data files
        out["own_bytes"] = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(last)
                               for f in fs if f.startswith(mine) and f.endswith(".bin"))
        mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, -1), ("a", "b"))
        want = np.arange(4 * 2048 * 256, dtype=np.float32).reshape(4 * 2048, 256)
        want[0, :] = 2
        for spec, read_once in ((P(None, ("a", "b")), None), (P(), True), (P("b", "a"), False)):
            got = mgr.restore(2, {"w": NamedSharding(mesh, spec), "step": None}, read_once=read_once)
            for shard in got["w"].addressable_shards:
                if not np.array_equal(np.asarray(shard.data), want[shard.index]):
                    out["ok"] = False
            out["ok"] = out["ok"] and got["step"] == 2
    return out
