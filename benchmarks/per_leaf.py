"""Per-leaf costs of cairn against JAX's own batched transfers, in one run.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.per_leaf [--leaves 2000] [--reps 5] [--profile save|async|load|metadata]

State: `--leaves` arrays of `--shape` float32 (default 64x8), each sharded
over all devices along axis 0. Measures, medians of `--reps` (the ops take turns within each repetition;
a ratio is the median of the per-repetition ratios):

- JAX `device_get` of the whole tree (one batched call) and `device_put` of
  its host copy back onto the same shardings (one batched call);
- `cairn.save` (blocking: written, fsync'd, committed), the blocking phase of
  `cairn.save_async`, `cairn.load` onto the same shardings, `cairn.metadata`;

and prints microseconds per leaf and the ratios the targets of issue 13 are
stated in (save <= 2x device_get, load <= 2.2x device_put, metadata <= 20 µs).
Every repetition of every operation, JAX's and cairn's alike, starts after a
`gc.collect()` (`--no-collect` to skip it: a full collection owed by earlier
repetitions then lands in whichever operation triggers it, which adds noise of
~100 ms per collection on a 2-core VM). `--profile OP` runs that operation under
cProfile instead and prints the top functions. `--json FILE` writes the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any


def _round_robin(ops: dict[str, tuple[Any, Any]], reps: int, collect: bool = True) -> dict[str, list[float]]:
    """Seconds of every repetition of every op, the ops taking turns within each repetition.

    Taking turns, JAX's calls and cairn's meet the same machine: on a shared VM
    whose speed drifts by 2x over a minute, ops measured one after the other
    (all of JAX's repetitions, then all of cairn's) gave ratios from 1.4x to
    2.4x in one hour; pairs measured side by side drift together.
    """
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(reps):
        for name, (fn, setup) in ops.items():
            if setup is not None:
                setup()
            if collect:  # every repetition, JAX's and cairn's alike, starts from a collected heap
                gc.collect()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def build(n: int, shape: tuple[int, ...]) -> tuple[Any, Any]:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    sh = NamedSharding(mesh, P("x"))
    rng = np.random.default_rng(0)
    host = {f"w{i:05d}": rng.standard_normal(shape).astype(np.float32) for i in range(n)}
    shardings = {k: sh for k in host}
    state = jax.device_put(host, shardings)
    jax.block_until_ready(state)
    return state, shardings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaves", type=int, default=2000)
    ap.add_argument("--shape", default="64x8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    ap.add_argument("--profile", choices=["save", "async", "load", "metadata"])
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--no-collect", action="store_true",
                    help="do not run gc.collect() before each repetition (then full collections left over "
                         "from earlier repetitions land in whichever operation triggers them)")
    args = ap.parse_args(argv)

    import jax

    import cairn

    shape = tuple(int(s) for s in args.shape.split("x"))
    n = args.leaves
    state, shardings = build(n, shape)
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}}
    base = tempfile.mkdtemp(prefix="cairn-per-leaf-", dir=args.dir)
    counter = iter(range(1 << 30))
    loaded_path = os.path.join(base, "loaded")
    cairn.save(loaded_path, {"params": state})

    def fresh() -> str:
        return os.path.join(base, f"s{next(counter)}")

    host = jax.device_get(state)
    cur: dict[str, Any] = {}

    def renew() -> None:
        # Fresh arrays before every repetition, as a training step makes them: a jax.Array
        # caches its numpy value, so a second device_get of the same array costs nothing.
        cur["params"] = jax.block_until_ready(jax.device_put(host, shardings))

    def jax_get() -> None:
        jax.device_get(cur["params"])

    def jax_put() -> None:
        jax.block_until_ready(jax.device_put(host, shardings))

    def c_save() -> None:
        cairn.save(fresh(), {"params": cur["params"]})

    def c_async() -> None:
        f = cairn.save_async(fresh(), {"params": cur["params"]})
        blocking.append(f.stats.blocking_s)
        f.result()

    def c_load() -> None:
        jax.block_until_ready(cairn.load(loaded_path, target))

    def c_meta() -> None:
        cairn.metadata(loaded_path)

    ops = {"save": c_save, "async": c_async, "load": c_load, "metadata": c_meta}
    blocking: list[float] = []
    try:
        for fn in (jax_get, jax_put, *ops.values()):  # warm up: compile, caches, pools
            renew()
            fn()
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.reps):
                prof.disable()
                renew()
                prof.enable()
                ops[args.profile]()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            pstats.Stats(prof).sort_stats("cumtime").print_stats(40)
            return 0
        blocking.clear()
        times = _round_robin({
            "jax_device_get": (jax_get, renew),
            "cairn_save": (c_save, renew),
            "cairn_async": (c_async, renew),
            "jax_device_put": (jax_put, None),
            "cairn_load": (c_load, None),
            "cairn_metadata": (c_meta, None),
        }, args.reps, not args.no_collect)
        times["cairn_async_blocking"] = blocking
        del times["cairn_async"]  # its blocking phase is what counts
    finally:
        shutil.rmtree(base, ignore_errors=True)
    res = {k: statistics.median(v) for k, v in times.items()}
    us = {k: v / n * 1e6 for k, v in res.items()}

    def paired(a: str, b: str) -> float:  # the median of the per-repetition ratios (neighbours in time)
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    ratios = {
        "save / device_get": paired("cairn_save", "jax_device_get"),
        "async blocking / device_get": paired("cairn_async_blocking", "jax_device_get"),
        "load / device_put": paired("cairn_load", "jax_device_put"),
    }
    heap = "uncollected heap" if args.no_collect else "gc.collect() before each"
    print(f"{n} leaves of {args.shape} float32 over {len(jax.devices())} devices, medians of {args.reps} "
          f"({heap}; the ops take turns in each repetition, ratios are medians of per-repetition ratios)")
    for k, v in us.items():
        print(f"  {k:24s} {v:9.1f} µs per leaf")
    targets = {"save / device_get": 2.0, "load / device_put": 2.2}
    for k, v in ratios.items():
        t = targets.get(k)
        verdict = "" if t is None else (f"  target <= {t}: " + ("met" if v <= t else "MISSED"))
        print(f"  {k:28s} {v:6.2f}x{verdict}")
    m = us["cairn_metadata"]
    print(f"  metadata per leaf {m:.1f} µs  target <= 20: {'met' if m <= 20 else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"leaves": n, "shape": list(shape), "us_per_leaf": us, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
