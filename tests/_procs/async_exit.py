"""Start an async save and leave at once: the save must still commit.

Usage: async_exit.py PATH BUDGET   (BUDGET: snapshot budget in bytes, or "none")
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn

path, budget = sys.argv[1], sys.argv[2]
mesh = jax.make_mesh((8,), ("x",))
x = jax.device_put(jnp.arange(8 * 65536, dtype=jnp.float32).reshape(8, 65536), NamedSharding(mesh, P("x")))
cairn.save_async(
    path, {"x": x, "y": np.arange(100), "cfg": {"lr": 0.5}},
    snapshot_budget_bytes=None if budget == "none" else int(budget),
)
print("returned", flush=True)
# Falling off the end: interpreter exit must finish the save.
