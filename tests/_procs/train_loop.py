"""A training loop with a CheckpointManager, for preemption and crash tests.

Usage: train_loop.py DIR SAVE_EVERY MAX_TO_KEEP SLEEP_S

The state saved at step s is a deterministic function of s (see
`expected`), so the parent can check any restored step. The loop resumes
from the latest committed step, prints "saved <step>" after each save call
that wrote, and "preempted <step>" when `reached_preemption` stops it.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn

N = 8 * 32768


def expected(step: int) -> dict:
    return {
        "params": {"w": np.full((8, N // 8), float(step), np.float32), "b": np.arange(4) + step},
        "config": {"lr": 0.1, "name": "loop"},
        "data": f"iterator-at-{step}".encode(),
    }


def main() -> None:
    directory, save_every, keep, sleep_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
    update = jax.jit(lambda w: w + 1.0, donate_argnums=0)
    mgr = cairn.CheckpointManager(directory, max_to_keep=keep, save_every=save_every)
    latest = mgr.latest_step()
    if latest is None:
        step, w = 0, jax.device_put(jnp.zeros((8, N // 8), jnp.float32), sharding)
    else:
        target = {"params": {"w": jax.ShapeDtypeStruct((8, N // 8), jnp.float32, sharding=sharding)}}
        w = mgr.restore(target=target, partial=True)["params"]["w"]
        step, w = latest + 1, update(w)
    print("start", step, flush=True)
    while True:
        state = expected(step)
        state["params"]["w"] = w
        if mgr.save(step, state):
            print("saved", step, flush=True)
        if mgr.reached_preemption(step):
            print("preempted", step, flush=True)
            break
        w = update(w)  # donates the buffer that was just saved
        step += 1
        time.sleep(sleep_s)
    mgr.close()


if __name__ == "__main__":
    main()
