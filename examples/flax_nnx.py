"""Flax NNX: checkpoint a model, its optimizer, BatchNorm statistics and its `nnx.Rngs`, then resume.

    python examples/flax_nnx.py

The state is what `nnx.split` returns (an `nnx.State` holding Variables;
`nnx.Rngs` contributes typed PRNG keys). It is restored into the abstract
state of `nnx.eval_shape` and merged back; training then continues exactly
as if it had never stopped.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import cairn


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(3, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)  # draws from rngs["dropout"] on every call
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.norm(self.hidden(x)))))


def create(seed: int = 0) -> tuple[Model, nnx.Optimizer]:
    model = Model(nnx.Rngs(params=seed, dropout=seed + 1))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def main() -> None:
    x = jnp.linspace(-1, 1, 24, dtype=jnp.float32).reshape(8, 3)
    y = jnp.sum(x**2, axis=1, keepdims=True)

    # Uninterrupted: 6 steps.
    model, optimizer = create()
    reference = [float(train_step(model, optimizer, x, y)) for _ in range(6)]

    # Interrupted: 3 steps, checkpoint, restore into a fresh abstract state, 3 more.
    model, optimizer = create()
    for _ in range(3):
        train_step(model, optimizer, x, y)
    with tempfile.TemporaryDirectory() as tmp:
        _, state = nnx.split((model, optimizer))
        cairn.save(f"{tmp}/step_3", {"state": state})

        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: create(seed=123)))
        state = cairn.load(f"{tmp}/step_3", {"state": abstract})["state"]
        model, optimizer = nnx.merge(graphdef, state)
    resumed = [float(train_step(model, optimizer, x, y)) for _ in range(3)]

    print("uninterrupted:", np.round(reference[3:], 6))
    print("resumed:      ", np.round(resumed, 6))
    assert resumed == reference[3:], "resumed training differs"
    print("OK: resumed training is bitwise equal")


if __name__ == "__main__":
    main()
