"""Multi-process scenarios of the way back to Orbax (run by tests/run/test_migration_runs.py)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn


def full_w() -> np.ndarray:
    return np.arange(8 * 4, dtype=np.float32).reshape(8, 4)


def save_and_export(path: str, out: str) -> dict:
    """Every process saves its shards with cairn, then exports them through Orbax onto the same mesh."""
    mesh = jax.make_mesh((2, 2), ("x", "y"))
    w = jax.make_array_from_callback((8, 4), NamedSharding(mesh, P("x", "y")), lambda idx: full_w()[idx])
    cairn.save(path, {"state": {"w": w}, "extra": {"seen": 3}})
    cairn.export_orbax(path, out, mesh=mesh)
    return {"process": jax.process_index()}
