"""A job's restart: the first load of a fresh process, raw, compressed and Orbax's, onto one accelerator.

    python -m benchmarks.probe restart_load [--gib 2.38] [--rounds 3] [--workdir DIR] [--json out.json]

A job that resumes after a preemption loads its checkpoint once, in a process that has
allocated nothing yet. Benchmarks that load in the process that built and saved the state
(`benchmarks.probes.gpu_save`) hand the loads memory the allocator already holds; on hosts where
first-touch page faults are slow (the TPU v5e host under gVisor: 0.94 GB/s a thread,
docs/compression.md) that flatters every load, and the codec's share of it most.

This builds the trained-like state (`benchmarks.trained_state`), puts it on the first device,
saves it three ways (cairn raw, cairn ``compression=True``, Orbax's ``StandardCheckpointer``
with its default zstd) and then, round by round, the three systems alternated, starts one
fresh Python process per load that imports JAX, cairn and (for its loads) Orbax, initialises the device
(not timed: Orbax's import inside the timed restart would flatter cairn), loads
the checkpoint onto the device with the same sharding (timed: the restart), then loads it
again (timed: a warm process's load). Files stay in the page cache between rounds for all
three alike. Reported: medians, and the ratios per round (compressed / raw, compressed / Orbax).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

GiB = float(1 << 30)
SYSTEMS = ("raw", "compressed", "orbax")
#: The compression= of each cairn system ("lz4": the "blosc2-lz4" codec for every leaf; not run by default).
COMPRESSION = {"raw": False, "compressed": True, "lz4": "blosc2-lz4"}


def _child(path: str, system: str) -> None:
    """One fresh process: two timed loads of `path` onto the first device, as JSON on stdout."""
    import jax

    dev = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    jax.block_until_ready(jax.device_put(0.0, dev))  # the device and its runtime, not timed
    import cairn

    if system == "orbax":
        import orbax.checkpoint as ocp  # (imported before the clock, as cairn is)
    meta = cairn.metadata(os.path.join(os.path.dirname(path), "raw"))
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), meta)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        if system == "orbax":
            with ocp.StandardCheckpointer() as ckptr:
                out = jax.block_until_ready(ckptr.restore(path, target))
        else:
            out = jax.block_until_ready(cairn.load(path, target))
        times.append(time.perf_counter() - t0)
        del out
    print(json.dumps({"first_s": times[0], "second_s": times[1], "cairn": os.path.dirname(cairn.__file__)}), flush=True)


def _save_all(work: str, gib: float, variant: str, systems: list[str]) -> dict[str, Any]:
    import jax
    import orbax.checkpoint as ocp

    import cairn
    from benchmarks.trained_state import make_state, raw_bytes

    t0 = time.perf_counter()
    host = make_state(int(gib * GiB), variant)
    raw = raw_bytes(host)
    print(f"state: {variant}, {raw / 2**20:.0f} MiB raw, built in {time.perf_counter() - t0:.0f} s", flush=True)
    state = jax.block_until_ready(jax.device_put(host, jax.devices()[0]))
    del host
    out: dict[str, Any] = {"raw_bytes": raw}
    for system, comp in COMPRESSION.items():
        if system != "raw" and system not in systems:
            continue
        st = cairn.save(os.path.join(work, system), state, compression=comp)
        out[system] = {"bytes": st.bytes_written, "save_s": st.total_s}
        print(f"saved {system}: {st.bytes_written / 1e6:.0f} MB", flush=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(work, "orbax"), state)
        ckptr.wait_until_finished()
    print("saved orbax", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.38)
    ap.add_argument("--variant", default="bf16-f32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="of raw, compressed, lz4, orbax; raw@NAME and compressed@NAME load with --tree NAME's cairn")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=SRC",
                    help="another cairn source tree (its src folder) for the @NAME systems, A/B in one run")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=2, metavar=("PATH", "SYSTEM"), help=argparse.SUPPRESS)
    ap.add_argument("--save-in", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--save-systems", default="raw,compressed", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    if args.save_in:
        print(json.dumps(_save_all(args.save_in, args.gib, args.variant, args.save_systems.split(","))),
              flush=True)
        return 0
    systems = args.systems.split(",")
    work = tempfile.mkdtemp(prefix="cairn-restart-", dir=args.workdir)
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; checkpoints under {work}", flush=True)
    try:
        # (in a process of its own: a process that holds the accelerator keeps the next ones from it)
        p = subprocess.run([sys.executable, "-m", "benchmarks.probe", "restart_load", "--save-in", work, "--gib", str(args.gib),
                            "--variant", args.variant, "--save-systems",
                            ",".join(s.partition("@")[0] for s in systems)], capture_output=True, text=True, check=False)
        print("\n".join(ln for ln in p.stdout.splitlines()[:-1]), flush=True)
        if p.returncode:
            raise RuntimeError(f"the save failed:\n{p.stderr[-3000:]}")
        saved = json.loads(p.stdout.strip().splitlines()[-1])
        runs: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
        trees = dict(t.split("=", 1) for t in args.tree)
        for r in range(args.rounds):
            for s in systems:
                kind, _, tree = s.partition("@")
                env = dict(os.environ)
                if tree:  # that tree's cairn first on the path
                    env["PYTHONPATH"] = os.pathsep.join(p for p in (trees[tree], env.get("PYTHONPATH")) if p)
                t0 = time.perf_counter()
                p = subprocess.run([sys.executable, "-m", "benchmarks.probe", "restart_load", "--child",
                                    os.path.join(work, kind), kind], capture_output=True, text=True, check=False,
                                   env=env)
                if p.returncode:
                    raise RuntimeError(f"the {s} load failed:\n{p.stderr[-3000:]}")
                got = json.loads(p.stdout.strip().splitlines()[-1])
                got["process_s"] = time.perf_counter() - t0
                runs[s].append(got)
                print(f"round {r + 1} {s}: first {got['first_s']:.3f} s, second {got['second_s']:.3f} s "
                      f"(process {got['process_s']:.1f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    print(f"\nmedians of {args.rounds} rounds (load average after {os.getloadavg()[0]:.2f}):")
    for s in systems:
        print(f"  {s}: restart {med(x['first_s'] for x in runs[s]):.3f} s, "
              f"a second load {med(x['second_s'] for x in runs[s]):.3f} s")
    for a, b in (("compressed", "raw"), ("compressed", "orbax"), ("lz4", "raw"), ("lz4", "orbax"), ("lz4", "compressed"),
                 ("raw", "orbax")):
        if a in runs and b in runs:
            for k in ("first_s", "second_s"):
                rs = [x[k] / y[k] for x, y in zip(runs[a], runs[b])]
                print(f"  {a} / {b}, {'restart' if k == 'first_s' else 'second load'}: per round "
                      f"{', '.join(f'{v:.2f}' for v in rs)} (median {med(rs):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gib": args.gib, "variant": args.variant, "saved": saved, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
