"""Resume is exact: a training loop killed at random moments and resumed ends bitwise where an uninterrupted run ends.

The loop (below, run as a subprocess) trains a small plain-JAX MLP with a
hand-written Adam, dropout driven by a JAX PRNG key, and a shuffling data
iterator (epoch and position). Every 3 steps a `CheckpointManager` saves,
asynchronously, everything the next step depends on: parameters (sharded
over 2 devices), both Adam moments and the step count, the PRNG key and the
iterator position. The test SIGKILLs it at random steps (often in the middle
of a background save), restarts it, and at the end compares the final
parameters bit for bit with a run that was never interrupted.

5 kills in the normal suite; ``CAIRN_STRESS=1`` makes it 25, over a longer run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

STRESS = os.environ.get("CAIRN_STRESS") == "1"
KILLS = 25 if STRESS else 5
STEPS = 150 if STRESS else 60
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRAIN = textwrap.dedent(
    r'''
    import sys, time
    import numpy as np
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import cairn

    directory, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))  # automatic (not explicit) sharding
    col = NamedSharding(mesh, P(None, "x"))   # hidden units split over the 2 devices
    row = NamedSharding(mesh, P("x", None))
    rep = NamedSharding(mesh, P())
    SHARD = {"w1": col, "b1": NamedSharding(mesh, P("x")), "w2": row, "b2": rep}

    # A fixed synthetic regression set; the iterator reshuffles every epoch.
    N, D, H, B = 96, 8, 32, 16
    data_rng = np.random.default_rng(0)
    X = data_rng.standard_normal((N, D)).astype(np.float32)
    Y = np.sin(X @ data_rng.standard_normal((D, 1))).astype(np.float32)

    class Iterator:
        def __init__(self, epoch=0, pos=0):
            self.epoch, self.pos = epoch, pos

        def next(self):
            order = np.random.default_rng(1000 + self.epoch).permutation(N)
            idx = order[self.pos : self.pos + B]
            self.pos += B
            if self.pos >= N:
                self.epoch, self.pos = self.epoch + 1, 0
            return X[idx], Y[idx]

        def state(self):
            return {"epoch": self.epoch, "pos": self.pos}

    def init(key):
        k1, k2 = jax.random.split(key)
        p = {"w1": jax.random.normal(k1, (D, H)) * 0.3, "b1": jnp.zeros(H),
             "w2": jax.random.normal(k2, (H, 1)) * 0.3, "b2": jnp.zeros(1)}
        return {k: jax.device_put(v, SHARD[k]) for k, v in p.items()}

    def loss_fn(p, x, y, key):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        keep = jax.random.bernoulli(key, 0.9, h.shape)  # dropout
        h = jnp.where(keep, h / 0.9, 0.0)
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    @jax.jit
    def train_step(p, m, v, t, x, y, key):
        g = jax.grad(loss_fn)(p, x, y, key)
        t = t + 1
        b1, b2, lr, eps = 0.9, 0.999, 1e-2, 1e-8
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        mhat = jax.tree.map(lambda m: m / (1 - b1 ** t), m)
        vhat = jax.tree.map(lambda v: v / (1 - b2 ** t), v)
        p = jax.tree.map(lambda p, a, b: p - lr * a / (jnp.sqrt(b) + eps), p, mhat, vhat)
        return p, m, v, t

    mgr = cairn.CheckpointManager(directory, max_to_keep=2, save_every=3)
    latest = mgr.latest_step()
    if latest is None:
        start, key = 0, jax.random.key(42)
        params = init(jax.random.key(7))
        m = jax.tree.map(jnp.zeros_like, params)
        v = jax.tree.map(jnp.zeros_like, params)
        t = jnp.zeros((), jnp.int32)
        it = Iterator()
    else:
        abstract = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SHARD[k])
                    for k, x in jax.eval_shape(init, jax.random.key(0)).items()}
        s = mgr.restore(target={"params": abstract, "opt": {"m": abstract, "v": abstract, "t": None},
                                "rng": None, "data": None, "step": None})
        assert s["step"] == latest
        start = latest + 1
        params, m, v = s["params"], s["opt"]["m"], s["opt"]["v"]
        t = jnp.asarray(s["opt"]["t"])
        key = jax.random.wrap_key_data(jnp.asarray(s["rng"]))
        it = Iterator(s["data"]["epoch"], s["data"]["pos"])
    print("start", start, flush=True)
    for step in range(start, steps):
        x, y = it.next()
        key, sub = jax.random.split(key)
        params, m, v, t = train_step(params, m, v, t, x, y, sub)
        mgr.save(step, {"params": params, "opt": {"m": m, "v": v, "t": np.asarray(t)},
                        "rng": np.asarray(jax.random.key_data(key)), "data": it.state(), "step": step})
        print("step", step, flush=True)
        time.sleep(0.01)
    mgr.close()
    np.savez(out, **{k: np.asarray(x) for k, x in params.items()},
             **{f"m_{k}": np.asarray(x) for k, x in m.items()}, t=np.asarray(t),
             key=np.asarray(jax.random.key_data(key)), epoch=it.epoch, pos=it.pos)
    print("done", flush=True)
    '''
)


def launch(script, directory, out):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(script), str(directory), str(STEPS), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err[-4000:]}"
    return out


def test_killed_and_resumed_training_is_bitwise_exact(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    ref_out = tmp_path / "reference.npz"
    reference = launch(script, tmp_path / "ref", ref_out)  # runs alongside the first interrupted attempt

    rng = np.random.default_rng(int(os.environ.get("CAIRN_SEED", "0")))
    out = tmp_path / "resumed.npz"
    kills, starts = 0, []
    while True:
        proc = launch(script, tmp_path / "run", out)
        try:
            first = proc.stdout.readline().split()
            assert first[:1] == ["start"], (first, proc.stderr.read()[-4000:] if proc.poll() is not None else "")
            starts.append(int(first[1]))
            if kills >= KILLS:
                finish(proc)
                break
            # Kill a few steps in, at a random moment: between steps or in a background save.
            target = starts[-1] + int(rng.integers(1, 12))
            for line in proc.stdout:
                if (line.startswith("step") and int(line.split()[1]) >= target) or line.startswith("done"):
                    break
            time.sleep(float(rng.uniform(0, 0.03)))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
            if proc.returncode == 0:  # it finished first: run again to have the full count of kills
                out.unlink()
            kills += 1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finish(reference)
    assert kills == KILLS and len(starts) == KILLS + 1
    # Each restart resumed from a committed step: it never went back to the beginning once one existed.
    assert starts[0] == 0 and any(s > 0 for s in starts[1:]), starts
    got, want = np.load(out), np.load(ref_out)
    assert sorted(got.files) == sorted(want.files)
    for k in want.files:
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k
    print(f"\n{KILLS} kills, restarts resumed at steps {starts[1:]}")
