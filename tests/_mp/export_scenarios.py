"""Multi-process scenarios of the safetensors export and of foreign loads (run by tests/exports/test_export.py)."""

from __future__ import annotations

import os

import jax

import cairn
from cairn._save import commit as _commit


def export(ckpt: str, dst: str, max_shard_size: str, item: str | None = None, all_items: bool = False) -> dict:
    """Every process exports; returns the files this process wrote and every file's name."""
    written: list[str] = []
    real = _commit.RenameCommit.write_whole

    def record(self, key, parts):
        written.append(os.path.basename(key))
        return real(self, key, parts)

    _commit.RenameCommit.write_whole = record  # type: ignore[method-assign]
    try:
        files = cairn.export_safetensors(ckpt, dst, max_shard_size=max_shard_size, item=item,
                                         all_items=all_items)
    finally:
        _commit.RenameCommit.write_whole = real  # type: ignore[method-assign]
    return {"process": jax.process_index(), "written": written, "files": [os.path.basename(f) for f in files]}


def load_hf(path: str, names: list[str]) -> dict:
    """Every process loads tensors of a Hugging Face folder onto one mesh over all processes
    (sharded, and replicated: the read-once route moves those by collectives); checks its shards."""
    import json

    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from safetensors.numpy import load_file

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    want = {n: load_file(os.path.join(path, weight_map[n]))[n] for n in names}
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    target: dict = {}
    for i, n in enumerate(names):
        node = target
        *parents, last = n.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = NamedSharding(mesh, P("x") if i % 2 == 0 else P())
    got = cairn.load(path, target, partial=True)
    for n in names:
        x = got
        for p in n.split("."):
            x = x[p]
        for shard in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[n][shard.index], err_msg=n)
    return {"process": jax.process_index(), "checked": len(names)}


def save_per_process(path: str) -> dict:
    """Every process saves sharded params and a per-process value of its own (arrays and inline values)."""
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    me = jax.process_index()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    full = np.arange(4 * len(jax.devices()), dtype=np.float32)
    params = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("x")), lambda idx: full[idx])
    cairn.save(path, {"params": {"w": params},
                      "data": cairn.PerProcess({"window": np.full((2, me + 1), me, np.int32), "pos": 10 * me + 1}),
                      "step": 7})
    return {"process": me}
