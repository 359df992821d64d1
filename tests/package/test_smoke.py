import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn


def test_roundtrip_sharded_and_values(tmp_path, mesh8):
    x = jax.device_put(jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16), NamedSharding(mesh8, P("x")))
    state = {"params": {"w": x, "b": np.ones(3)}, "step": 3, "meta": {"name": "hi", "n": None, "blob": b"xyz"}}
    cairn.save(tmp_path / "c", state)
    out = cairn.load(tmp_path / "c")
    np.testing.assert_array_equal(out["params"]["w"], np.asarray(x))
    assert out["step"] == 3 and out["meta"] == {"name": "hi", "n": None, "blob": b"xyz"}
