"""Equinox: checkpoint the arrays of a module with `eqx.partition`, rebuild it with `eqx.combine`.

    python examples/equinox_model.py

An Equinox module holds non-array leaves too (here its activation
functions), which are code, not state: cairn refuses them, naming the leaf.
Save the array part; the static part comes from a freshly built module.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import cairn

TX = optax.adam(1e-2)
X = jnp.linspace(-1, 1, 24, dtype=jnp.float32).reshape(8, 3)
Y = jnp.sum(X**2, axis=1, keepdims=True)


def create(seed: int) -> eqx.nn.MLP:
    return eqx.nn.MLP(3, 1, 16, 2, activation=jax.nn.relu, key=jax.random.key(seed))


@eqx.filter_jit
def train_step(model, opt_state):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(X) - Y) ** 2))(model)
    updates, opt_state = TX.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def main() -> None:
    model = create(0)
    opt_state = TX.init(eqx.filter(model, eqx.is_array))
    for _ in range(3):
        model, opt_state, _ = train_step(model, opt_state)

    with tempfile.TemporaryDirectory() as tmp:
        try:
            cairn.save(f"{tmp}/whole", model)
        except cairn.UnsupportedTypeError as e:
            print("saving the whole module:", str(e).split(": ", 1)[1][:120], "...")

        params, _static = eqx.partition(model, eqx.is_array)
        cairn.save(f"{tmp}/step_3", {"params": params, "opt": opt_state})

        # Restore: the static part and the target's shapes come from a freshly built module.
        fresh_params, static = eqx.partition(create(1), eqx.is_array)
        like = jax.eval_shape(lambda: {"params": fresh_params, "opt": TX.init(fresh_params)})
        restored = cairn.load(f"{tmp}/step_3", like)
    restored_model = eqx.combine(restored["params"], static)

    want = train_step(model, opt_state)[2]
    got = train_step(restored_model, restored["opt"])[2]
    print(f"next loss: uninterrupted {float(want)}, resumed {float(got)}")
    assert float(got) == float(want), "resumed training differs"
    print("OK: resumed training is bitwise equal")


if __name__ == "__main__":
    main()
