"""optax states and typed PRNG keys: chained, masked and injected optimizer states, a key per device.

    python examples/optax_and_keys.py

optax states are named tuples (`ScaleByAdamState`, `MaskedNode`,
`EmptyState`, `InjectHyperparamsState` with its `hyperparams` dict); restored
into a `jax.eval_shape` target they come back as the same types. Typed keys
(`jax.random.key`, any implementation) come back as keys of the same
implementation, on the target's sharding.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn


def main() -> None:
    params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.masked(optax.adam(1e-2), {"w": True, "b": False}),
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
    )
    opt_state = tx.init(params)

    # One key per device: split, then shard along the mesh (one per host in a multi-host job).
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    keys = jax.device_put(jax.random.split(jax.random.key(0, impl="rbg"), len(jax.devices())),
                          NamedSharding(mesh, P("data")))

    with tempfile.TemporaryDirectory() as tmp:
        cairn.save(f"{tmp}/ck", {"opt": opt_state, "rng": keys})
        print(cairn.metadata(f"{tmp}/ck")["rng"])
        target = {
            "opt": jax.eval_shape(tx.init, params),
            "rng": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=keys.sharding),
        }
        restored = cairn.load(f"{tmp}/ck", target)

    assert jax.tree.structure(restored["opt"]) == jax.tree.structure(opt_state)
    assert isinstance(restored["opt"][1].inner_state[0].mu["b"], optax.MaskedNode)
    rng = restored["rng"]
    assert str(jax.random.key_impl(rng)) == "rbg" and rng.sharding == keys.sharding
    assert np.array_equal(jax.random.key_data(rng), jax.random.key_data(keys))
    print("restored:", type(restored["opt"][2]).__name__, restored["opt"][2].hyperparams, rng.dtype, rng.shape)
    print("OK: optimizer state types and typed keys restored")


if __name__ == "__main__":
    main()
