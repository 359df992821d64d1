"""Steady-state memory of a training loop that saves every step, against the same loop without saves.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.probe soak [--steps 1000] [--leaves 16] [--mib 8] [--env MALLOC_ARENA_MAX=2]

Each loop runs in a subprocess of its own, one after the other in one run:
a jitted, buffer-donating train step over `--leaves` float32 arrays of
`--mib` MiB each (sharded over the devices), with and without
`CheckpointManager(max_to_keep=2)` async-saving every step to a temporary
folder. RSS (VmRSS) is sampled at the steps given by `--report`. Printed:
RSS per loop, the difference, the snapshot buffers it is allowed (two saves
in flight, `_async.MAX_PENDING`, each one state), and the target
(saving loop <= no-save loop + snapshot buffers + 10%, and flat).

`--env K=V` (repeatable) sets environment variables of both loops, e.g. to
measure glibc's `MALLOC_ARENA_MAX` or `MALLOC_TRIM_THRESHOLD_`.
`--json FILE` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = "--child"


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def child(save: bool, steps: int, leaves: int, mib: int, report: list[int], directory: str) -> dict[str, int]:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import cairn

    mesh = Mesh(np.array(jax.devices()), ("x",))
    sh = NamedSharding(mesh, P("x"))
    n = mib * (1 << 20) // 4
    rows = len(jax.devices()) * 64
    state = {f"w{i:02d}": jax.device_put(np.full((rows, n // rows), i, np.float32), sh) for i in range(leaves)}

    def _step(s: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {k: v * 0.999 + 0.001 for k, v in s.items()}

    step_fn = jax.jit(_step, donate_argnums=0)
    out: dict[str, int] = {}
    mgr = cairn.CheckpointManager(directory, max_to_keep=2) if save else None
    try:
        for step in range(1, steps + 1):
            state = step_fn(state)
            if mgr is not None:
                mgr.save(step, {"params": state})
            else:
                jax.block_until_ready(state)
            if step in report:
                out[str(step)] = _rss()
        if mgr is not None:
            mgr.wait()
        out["end"] = _rss()
    finally:
        if mgr is not None:
            mgr.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--report", default="100,300,500,1000")
    ap.add_argument("--env", action="append", default=[], metavar="K=V")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument(_CHILD, choices=["save", "nosave"], help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    report = [int(s) for s in a.report.split(",") if int(s) <= a.steps]
    if a.child:
        res = child(a.child == "save", a.steps, a.leaves, a.mib, report, a.dir)
        print(json.dumps(res))
        return 0
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env.setdefault("JAX_PLATFORMS", "cpu")
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    results = {}
    for mode in ("nosave", "save"):
        with tempfile.TemporaryDirectory(prefix="cairn-soak-") as d:
            cmd = [sys.executable, "-m", "benchmarks.probe", "soak", _CHILD, mode, "--dir", os.path.join(d, "run"),
                   "--steps", str(a.steps), "--leaves", str(a.leaves), "--mib", str(a.mib), "--report", a.report]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if p.returncode:
                print(p.stderr[-4000:], file=sys.stderr)
                return p.returncode
            results[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    state = a.leaves * a.mib << 20
    allowance = 2 * state  # snapshot buffers: two async saves in flight, one state each
    mib = 1 << 20
    print(f"{a.leaves} leaves x {a.mib} MiB = {state // mib} MiB, {a.steps} steps, env {a.env or 'default'}")
    print(f"{'step':>6} {'no saves MiB':>13} {'saves MiB':>10} {'difference':>11} {'allowed':>8}")
    for k in [*map(str, report), "end"]:
        ns, s = results["nosave"][k], results["save"][k]
        limit = (ns + allowance) * 1.1
        print(f"{k:>6} {ns / mib:13.0f} {s / mib:10.0f} {(s - ns) / mib:11.0f} {limit / mib:8.0f}"
              f"  {'met' if s <= limit else 'MISSED'}")
    first, last = str(report[0]), str(report[-1])
    growth = (results["save"][last] - results["save"][first]) / mib
    print(f"growth of the saving loop from step {first} to {last}: {growth:.0f} MiB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rss": results, "state_bytes": state}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
