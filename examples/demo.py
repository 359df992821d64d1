"""cairn demo: train a small sharded MLP, checkpoint it, restore onto another mesh, continue.

Run with `make demo` (8 virtual CPU devices). Prints what it does and the
save/load timings, and checks that training resumed from the checkpoint on a
different mesh matches training that never stopped, bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn

WIDTH, DEPTH, BATCH, LR = 512, 4, 64, 3e-3


def init(key):
    params = {}
    for i in range(DEPTH):
        key, k = jax.random.split(key)
        params[f"layer{i}"] = {
            "w": jax.random.normal(k, (WIDTH, WIDTH), jnp.float32) / np.sqrt(WIDTH),
            "b": jnp.zeros((WIDTH,), jnp.float32),
        }
    return params


def shard_params(params, mesh):
    """FSDP-style on axis "data" for the first dimension, tensor-parallel on "model" for the second."""
    w_sharding = NamedSharding(mesh, P("data", "model"))
    b_sharding = NamedSharding(mesh, P("model"))
    return {name: {"w": jax.device_put(p["w"], w_sharding), "b": jax.device_put(p["b"], b_sharding)}
            for name, p in params.items()}


def loss_fn(params, x, y):
    h = x
    for i in range(DEPTH):
        p = params[f"layer{i}"]
        h = h @ p["w"] + p["b"]
        if i < DEPTH - 1:
            h = jax.nn.gelu(h)
    return jnp.mean((h - y) ** 2)


@jax.jit
def train_step(state, x, y):
    """One Adam step on (params, mu, nu, step)."""
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
    t = state["step"] + 1
    mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["mu"], grads)
    nu = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, state["nu"], grads)
    def upd(p, m, v):
        mhat = m / (1 - 0.9 ** t)
        vhat = v / (1 - 0.999 ** t)
        return p - LR * mhat / (jnp.sqrt(vhat) + 1e-8)
    params = jax.tree.map(upd, state["params"], mu, nu)
    return {"params": params, "mu": mu, "nu": nu, "step": t}, loss


def batch(step):
    rng = np.random.default_rng(step)
    x = rng.standard_normal((BATCH, WIDTH), dtype=np.float32)
    y = np.sin(x)
    return x, y


def new_state(mesh):
    params = shard_params(init(jax.random.key(0)), mesh)
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"params": params, "mu": zeros, "nu": jax.tree.map(jnp.zeros_like, params), "step": jnp.int32(0)}


def train(state, start, stop):
    losses = []
    for s in range(start, stop):
        state, loss = train_step(state, *batch(s))
        losses.append(float(loss))
    return state, losses


def main() -> None:
    devices = jax.devices()
    print(f"cairn {cairn.__version__} demo on {len(devices)} {devices[0].platform} devices")
    auto = (jax.sharding.AxisType.Auto,) * 2  # let XLA place the activations
    mesh_a = jax.make_mesh((4, 2), ("data", "model"), axis_types=auto)
    mesh_b = jax.make_mesh((2, 4), ("data", "model"), axis_types=auto)
    root = tempfile.mkdtemp(prefix="cairn-demo-")
    try:
        state = new_state(mesh_a)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        print(f"model: {DEPTH} layers of {WIDTH}x{WIDTH}, state {nbytes / 2**20:.1f} MiB "
              f"(params + Adam moments), sharded on mesh {dict(mesh_a.shape)}")

        state, losses = train(state, 0, 30)
        print(f"trained steps 0-29 on mesh {dict(mesh_a.shape)}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")

        path = os.path.join(root, "step_30")
        t0 = time.perf_counter()
        fut = cairn.save_async(path, {"model": state, "config": {"width": WIDTH, "depth": DEPTH, "lr": LR}})
        blocking = time.perf_counter() - t0
        # Keep training while the checkpoint is written: the saved values are the step-30 ones.
        reference, ref_losses = train(state, 30, 60)
        stats = fut.result()
        print(f"async save of step 30: caller blocked {blocking * 1e3:.1f} ms, committed after "
              f"{stats.total_s * 1e3:.1f} ms, {stats.bytes_written / 2**20:.1f} MiB in {stats.files_written} files")

        info = cairn.metadata(path)
        w0 = info["model"]["params"]["layer0"]["w"]
        print(f"metadata (no data read): layer0/w {w0.shape} {w0.dtype}, saved spec {w0.sharding['spec']} "
              f"on mesh {w0.sharding['mesh']['shape']}; config {info['config']}")

        # Restore onto a different mesh: (2, 4) instead of (4, 2). Each device reads only its part.
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(mesh_b, getattr(x.sharding, "spec", P()))
            ),
            new_state(mesh_b),
        )
        t0 = time.perf_counter()
        restored = cairn.load(path, {"model": target})["model"]
        jax.block_until_ready(restored)
        load_s = time.perf_counter() - t0
        print(f"loaded step {int(restored['step'])} onto mesh {dict(mesh_b.shape)} in {load_s * 1e3:.1f} ms "
              f"(layer0/w now {restored['params']['layer0']['w'].sharding.spec})")

        resumed, res_losses = train(restored, 30, 60)
        same = all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(reference)))
        print(f"continued steps 30-59 on mesh {dict(mesh_b.shape)}: loss {res_losses[0]:.4f} -> {res_losses[-1]:.4f}")
        close = max(abs(a - b) for a, b in zip(res_losses, ref_losses))
        print(f"vs. training that never stopped: max loss difference {close:.2e}; "
              f"final parameters {'bitwise identical' if same else 'differ (different mesh => different reduction order)'}")
        if close > 1e-3:
            raise SystemExit("resumed training diverged from the uninterrupted run")
        # On the same mesh the computation is the same, so resuming must be exact.
        same_mesh = cairn.load(path, {"model": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)})["model"]
        again, _ = train(same_mesh, 30, 60)
        exact = all(np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(reference)))
        print(f"resumed on the original mesh: final parameters {'bitwise identical' if exact else 'DIFFER'} "
              "to the uninterrupted run")
        if not exact:
            raise SystemExit("resuming on the same mesh was not exact")
        print(f"checkpoint layout: {sorted(os.listdir(path))}")
        crash_and_resume(root, state, reference)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _train_child(directory: str, stop: int) -> None:
    """The "training process" that gets killed: trains from scratch, async saves every 10 steps."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    state = new_state(jax.make_mesh((4, 2), ("data", "model"), axis_types=auto))
    with cairn.CheckpointManager(directory, max_to_keep=2, save_every=10) as mgr:
        for s in range(stop):
            state, loss = train_step(state, *batch(s))
            mgr.save(s + 1, {"model": state}, metrics={"loss": float(loss)})  # state after s + 1 steps
            print(f"trained {s + 1}", flush=True)
            time.sleep(0.02)


def crash_and_resume(root: str, template, reference) -> None:
    """Kill a training process that saves with a CheckpointManager; resume from its latest step."""
    directory = os.path.join(root, "run")
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--train-child", directory, "60"],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    for line in child.stdout:
        if line.strip() == "trained 45":
            break
    child.kill()  # SIGKILL: no exit hooks, saves in flight are simply cut off
    child.wait()
    mgr = cairn.CheckpointManager(directory, max_to_keep=2, save_every=10)
    step = mgr.latest_step()
    if step is None:
        raise SystemExit("the killed training process left no committed checkpoint")
    print(f"killed the training process (manager, async saves every 10 steps, keep 2) after step 45; "
          f"committed steps on disk: {mgr.steps()}, loss at {step}: {mgr.metrics(step)['loss']:.4f}")
    # The shardings train_step produces (its step counter is replicated on the mesh, too).
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template)
    state = mgr.restore(target={"model": target})["model"]
    resumed, _ = train(state, step, 60)
    exact = all(np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(reference)))
    print(f"resumed from step {step} to 60: final parameters {'bitwise identical' if exact else 'DIFFER'} "
          "to the uninterrupted run")
    mgr.close()
    if not exact:
        raise SystemExit("resuming after the crash was not exact")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train-child"]:
        _train_child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
