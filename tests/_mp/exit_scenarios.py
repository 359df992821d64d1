"""A dead peer's survivors all get to run their handlers, whenever process 0 exits (tests/distributed/test_exit.py)."""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn


def dead_peer_handlers(root: str, handler_s: float, leave: str) -> dict[str, Any]:
    """The last process dies in a save; each survivor catches the `CoordinationError` and runs a handler
    that outlives process 0's (process 0's is instant, the others take `handler_s`): it writes and
    fsyncs a file, as a handler that saves what it can would. `leave`: "exit" (return, and let the
    interpreter exit: process 0 waits at exit on its own) or "shutdown" (call `cairn.shutdown()`)."""
    n, me = jax.process_count(), jax.process_index()
    mesh = jax.make_mesh((n,), ("x",))
    full = np.arange(n * 4096, dtype=np.float32).reshape(n, 4096)
    state = {"w": jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("x")), lambda i: full[i])}
    cairn.save(os.path.join(root, "good"), state, timeout=120)
    if me == n - 1:
        time.sleep(0.5)
        os._exit(9)
    t0 = time.monotonic()
    try:
        cairn.save(os.path.join(root, "bad"), state, timeout=300)
    except cairn.CoordinationError as e:
        error = f"{type(e).__name__}: {e}"
    else:
        raise AssertionError("the save succeeded without the dead process")
    seconds = time.monotonic() - t0
    if me:
        time.sleep(handler_s)
    path = os.path.join(root, f"handled-{me}.npy")
    with open(path + ".tmp", "wb") as f:
        np.save(f, np.arange(1000) * me)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    if leave == "shutdown":
        cairn.shutdown()
    return {"error": error, "seconds": seconds}
