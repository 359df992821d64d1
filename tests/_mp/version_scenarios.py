"""Scenarios of tests/distributed/test_version5_mp.py: which format version a save by several processes
declares when only some process writes a block of format version 5 (see __init__.py)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn


def _w(last: float | None) -> jax.Array:
    """8 MiB of rows sharded over every device of every process; `last` changes a few elements of the last
    row, which the last process writes."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    full = np.arange(4 * 2048 * 256, dtype=np.float32).reshape(4 * 2048, 256)
    if last is not None:
        full[-1, [3, 100, 200]] = last
    return jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("x")), lambda idx: full[idx])


def sparse_on_the_last(directory: str) -> dict:
    """A hashed save, then one against it where only the last process's chunk changed (three elements: a
    sparse delta): the primary, whose blocks are all references, must still write version 5."""
    cairn.save(f"{directory}/plain", {"w": _w(None)})
    cairn.save(f"{directory}/a", {"w": _w(None)}, base=f"{directory}/plain")
    cairn.save(f"{directory}/b", {"w": _w(-1.0)}, base=f"{directory}/a")
    return {"process": jax.process_index()}
