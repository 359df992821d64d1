"""Local tier vs persistent tier: blocking time, background time and restore time.

Usage: python benchmarks/local_tier.py [--mib 1024] [--dir /tmp/bench] [--local /dev/shm/bench]

One process, the state a few float32 arrays sharded over the local devices.
Measures, for `--mib` MiB of state: the blocking part and the full time of a
local-tier save (pack on device, write, commit) next to a persistent
`CheckpointManager` save, and a restore from each tier. Peer replication
(collectives between processes) is exercised by tests/test_local_tier.py, not
timed here.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import cairn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--local", default=None)
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="cairn-lt-")
    local_dir = args.local or f"{base}/local"
    mesh = Mesh(np.array(jax.devices()), ("x",))
    s = NamedSharding(mesh, P("x"))
    rows = len(jax.devices()) * 64
    n = args.mib * (1 << 20) // 4 // 4 // rows
    state = {f"w{i}": jax.device_put(jnp.full((rows, n), float(i), jnp.float32), s) for i in range(4)}
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s) for k, v in state.items()}
    nbytes = sum(v.nbytes for v in state.values())
    tier = cairn.LocalTier(local_dir, every=1, keep=2, replicas=0)
    mgr = cairn.CheckpointManager(f"{base}/persist", save_every=1000, local=tier, handle_sigterm=False)
    res = {}
    for step in (1, 2):  # the first compiles the packer
        t0 = time.perf_counter()
        mgr.save(step, state)
        res["local_blocking_s"] = time.perf_counter() - t0
        tier.wait()
        res["local_total_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    mgr.save(1000, state)
    res["persistent_blocking_s"] = time.perf_counter() - t0
    mgr.wait()
    res["persistent_total_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = tier.restore(target)
    assert got is not None
    jax.block_until_ready(got[1])
    res["restore_local_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(mgr.restore(step=1000, target=target))
    res["restore_persistent_s"] = time.perf_counter() - t0
    mgr.close()
    print(f"state {nbytes / 2**20:.0f} MiB on {len(jax.devices())} devices")
    for k, v in res.items():
        print(f"  {k:24s} {v:8.3f} s   {nbytes / 2**20 / v:8.0f} MiB/s")
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
