"""Local tier vs persistent tier: blocking time, background time, step overhead, recovery.

Usage: python -m benchmarks.probe local_tier [--mib 1024] [--processes 2] [--replicas 1] [--dir DIR]

Runs `--processes` real JAX processes on 127.0.0.1 (the test harness in
tests/_mp, 2 CPU devices each), the state `--mib` MiB of float32 sharded over
every device. Measures per process (the slowest is reported): the blocking part
and the full time of a local-tier save (pack on device, replica transfer,
write, commit) next to a persistent `CheckpointManager` save; the time of a
training step with and without a local save every step; and recovery from
the local tier, from a peer's replica (process 1's directory wiped), and from
the persistent tier. Loopback gloo on 2 cores moves 50-80 MB/s: replica
figures are this machine's, far below a real interconnect.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests"))

from _mp import run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--dir", default=None, help="persistent tier (default: a temporary folder on disk)")
    ap.add_argument("--local", default="/dev/shm", help="where the local tier's host folders go")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    base = args.dir or tempfile.mkdtemp(prefix="cairn-lt-")
    local = tempfile.mkdtemp(prefix="cairn-lt-", dir=args.local)
    try:
        out = run(args.processes, "localtier_scenarios:bench",
                  {"root": local, "persist": f"{base}/persist", "mib": args.mib, "replicas": args.replicas},
                  devices_per_process=2, timeout=1800)
    finally:
        shutil.rmtree(local, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    mib = out[0]["nbytes"] / 2**20
    res = {k: max(r[k] for r in out) for k in out[0] if k != "nbytes"}
    print(f"state {mib:.0f} MiB over {args.processes} processes x 2 devices, replicas={args.replicas}")
    for k, v in res.items():
        rate = "" if k.startswith("step") else f"{mib / v:9.0f} MiB/s"
        print(f"  {k:26s} {v:8.3f} s {rate}")
    print(f"  overhead of a local save every step: {res['step_with_local_save_s'] - res['step_s']:.3f} s per step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": mib, "processes": args.processes, "replicas": args.replicas, **res}, f, indent=1)


if __name__ == "__main__":
    main()
