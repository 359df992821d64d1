"""Flax Linen: checkpoint a `TrainState` (optax inside, BatchNorm statistics) and the dropout key.

    python examples/flax_linen.py

The restore target comes from `jax.eval_shape` of the function that creates
the state, so nothing is computed or allocated for it; the static fields of
the TrainState (`apply_fn`, `tx`) come from the target.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import cairn


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(x)))
        return nn.Dense(1)(nn.Dropout(0.2, deterministic=not train)(x))


class TrainState(train_state.TrainState):
    batch_stats: Any


X = jnp.linspace(-1, 1, 24, dtype=jnp.float32).reshape(8, 3)
Y = jnp.sum(X**2, axis=1, keepdims=True)


def create(key: jax.Array) -> TrainState:
    variables = MLP().init({"params": key}, X, train=False)
    return TrainState.create(apply_fn=MLP().apply, params=variables["params"],
                             batch_stats=variables["batch_stats"], tx=optax.adam(1e-2))


@jax.jit
def train_step(state: TrainState, rng: jax.Array):
    rng, dropout = jax.random.split(rng)

    def loss_fn(params):
        out, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, X, train=True,
                                      rngs={"dropout": dropout}, mutable=["batch_stats"])
        return jnp.mean((out - Y) ** 2), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"]), rng, loss


def main() -> None:
    state, rng = create(jax.random.key(0)), jax.random.key(1)
    losses = []
    for _ in range(6):
        state, rng, loss = train_step(state, rng)
        losses.append(float(loss))

    state, rng = create(jax.random.key(0)), jax.random.key(1)
    for _ in range(3):
        state, rng, _ = train_step(state, rng)
    with tempfile.TemporaryDirectory() as tmp:
        cairn.save(f"{tmp}/step_3", {"state": state, "rng": rng})
        target = jax.eval_shape(lambda: {"state": create(jax.random.key(0)), "rng": jax.random.key(0)})
        restored = cairn.load(f"{tmp}/step_3", target)
    state, rng = restored["state"], restored["rng"]
    assert isinstance(state, TrainState) and int(state.step) == 3
    resumed = []
    for _ in range(3):
        state, rng, loss = train_step(state, rng)
        resumed.append(float(loss))

    print("uninterrupted:", losses[3:])
    print("resumed:      ", resumed)
    assert resumed == losses[3:], "resumed training differs"
    print("OK: resumed training is bitwise equal")


if __name__ == "__main__":
    main()
