"""Coordination at scale: calls and bytes per process and at the service, per operation, to 1,024 processes.

`plan_scale` models what each process computes; this models what the processes say to each other
through JAX's coordination service. Every message cairn sends goes through the primary (process
0): a non-primary process publishes its part and waits for the primary's one answer with one
blocking get, so its calls per operation are a constant; the primary gets one value per process.
Per operation and process count N the model is therefore

    calls of a non-primary process    c          (a constant of the operation)
    calls of the primary              a + g * N  (g: the gathers the operation makes)
    bytes of a non-primary process    c' + d' * N (d' = 0 but for the local tier, whose
                                                  processes each receive every peer's table)
    bytes of the primary              a' + g' * N
    at the service                    primary + (N - 1) * non-primary

The constants are fitted on the two smallest measured process counts and checked against the
others (exact for calls, within 5 % for bytes), then evaluated at 1,024 processes. The
measurements come from the many-process harness (tests/_mp/scale_scenarios.py): real processes
with one CPU device each on 127.0.0.1, every call to the coordination client counted.

    PYTHONPATH=src python -m benchmarks.probe coord_scale      # measure 2, 4 and 8 processes, fit, check, model
    python -m benchmarks.probe coord_scale --counts 2,4,8,16   # other counts (unit: the largest)
    python -m benchmarks.probe coord_scale --report r.json     # also check counts saved by tests/distributed/test_scale.py
                                                         # (CAIRN_SCALE_REPORT=r.json, e.g. at 32 and 16)

The heartbeat is apart: one set per process every CAIRN_PEER_TIMEOUT / 6 seconds (0.2 to 5 s),
whatever cairn is doing, and the primary, while it waits for missing peers, lists the heartbeats
once per wait slice (2 s at most).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests")

OPS = ["save", "load", "load_resharded", "metadata", "manager", "per_process", "local_tier", "local_tier_shared"]
#: How many saves and loads each operation is: the manager makes four saves and a restore, the
#: per-process operation a save and a load, the local tier three saves and a restore
#: (local_tier_shared: three saves with every process in one host directory, no restore).
TARGET = {"save": 1, "load": 1, "load_resharded": 1, "metadata": 1, "per_process": 2, "manager": 5,
          "local_tier": 4, "local_tier_shared": 3}
MAX_CALLS_PER_OP = 100  # per non-primary process, per save or load, at 1,024 processes
MAX_SERVICE_BYTES_PER_100 = 1 << 20  # per save, per 100 processes


def measure(counts: list[int], unit: int) -> dict[int, dict[str, Any]]:
    """Run the harness once per process count; the per-operation summary of each."""
    sys.path.insert(0, _TESTS)
    from _mp import start, wait
    from _mp.scale_scenarios import summarize

    out = {}
    for n in counts:
        root = tempfile.mkdtemp(prefix=f"cairn-coord-scale-{n}-")
        t0 = time.monotonic()
        procs = start(n, "scale_scenarios:scale", {"root": root, "ops": OPS, "unit": unit},
                      devices_per_process=1)
        out[n] = summarize(wait(procs, 120 + 10 * n))
        print(f"measured {n} processes in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    return out


def _line(x0: int, y0: float, x1: int, y1: float) -> tuple[float, float]:
    slope = (y1 - y0) / (x1 - x0)
    return y0 - slope * x0, slope


def fit(measured: dict[int, dict[str, Any]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per operation: (intercept, slope in N) of each measure, from the two smallest counts."""
    model: dict[str, dict[str, tuple[float, float]]] = {}
    for op in OPS:
        n0, n1 = sorted(n for n in measured if op in measured[n])[:2]
        m0, m1 = measured[n0][op], measured[n1][op]
        model[op] = {k: _line(n0, m0[k], n1, m1[k])
                     for k in ("other_calls_max", "primary_calls", "other_bytes_max", "primary_bytes")}
    return model


def predict(model: dict[str, dict[str, tuple[float, float]]], op: str, n: int) -> dict[str, float]:
    got = {k: a + b * n for k, (a, b) in model[op].items()}
    got["service_calls"] = got["primary_calls"] + (n - 1) * got["other_calls_max"]
    got["service_bytes"] = got["primary_bytes"] + (n - 1) * got["other_bytes_max"]
    return got


def check(model: dict[str, dict[str, tuple[float, float]]], measured: dict[int, dict[str, Any]]) -> list[str]:
    """Where the model misses a measured count (calls exactly, bytes within 5 %)."""
    misses = []
    for n, ops in sorted(measured.items()):
        for op in OPS:
            if op not in ops:
                continue
            p = predict(model, op, n)
            for k in ("other_calls_max", "primary_calls"):
                if abs(p[k] - ops[op][k]) > 0.5:
                    misses.append(f"{op} at {n}: {k} {ops[op][k]} measured, {p[k]:.1f} modelled")
            for k in ("other_bytes_max", "primary_bytes"):
                if abs(p[k] - ops[op][k]) > 0.05 * max(ops[op][k], 1) + 16:
                    misses.append(f"{op} at {n}: {k} {ops[op][k]} measured, {p[k]:.0f} modelled")
    return misses


def table(model: dict[str, dict[str, tuple[float, float]]], counts: list[int]) -> str:
    rows = ["| operation | N | calls/non-primary | calls primary | bytes/non-primary | bytes primary | "
            "service calls | service bytes |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for op in OPS:
        for n in counts:
            p = predict(model, op, n)
            rows.append(f"| {op} | {n} | {p['other_calls_max']:.0f} | {p['primary_calls']:.0f} | "
                        f"{p['other_bytes_max']:.0f} | {p['primary_bytes']:.0f} | {p['service_calls']:.0f} | "
                        f"{p['service_bytes'] / 1024:.0f} KiB |")
    return "\n".join(rows)


def targets(model: dict[str, dict[str, tuple[float, float]]], n: int = 1024) -> list[str]:
    """Per operation at `n` processes, per save or load it contains: a non-primary process's calls
    (target <= 100), the primary's (a + g * N), and the service's bytes per 100 processes (<= 1 MiB)."""
    out = []
    for op in OPS:
        p = predict(model, op, n)
        per = TARGET[op]
        a, g = model[op]["primary_calls"]
        calls = p["other_calls_max"] / per
        per_100 = p["service_bytes"] / per / (n / 100)
        ok = calls <= MAX_CALLS_PER_OP and per_100 <= MAX_SERVICE_BYTES_PER_100
        out.append(f"| {op} | {calls:.0f} | {a / per:.0f} + {g / per:.2f} N = {p['primary_calls'] / per:.0f} | "
                   f"{per_100 / 1024:.1f} KiB | {'yes' if ok else 'NO'} |")
    return [f"| operation (per save or load) | calls per non-primary at {n} | calls at the primary | "
            f"service bytes per 100 processes at {n} | targets met |", "|---|---:|---:|---:|---|", *out]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="2,4,8", help="process counts to measure (the first two fit the model)")
    ap.add_argument("--report", action="append", default=[],
                    help="a CAIRN_SCALE_REPORT file of tests/distributed/test_scale.py to check the model against")
    ap.add_argument("--load", help="measured counts saved by an earlier run (--save), instead of measuring")
    ap.add_argument("--save", help="keep the measured counts in this file")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    if args.load:
        with open(args.load) as f:
            measured = {int(k): v for k, v in json.load(f).items()}
    else:
        measured = measure(counts, max(counts))
    if args.save:
        with open(args.save, "w") as f:
            json.dump(measured, f, indent=1)
    reported: dict[int, dict[str, Any]] = {}
    for path in args.report:
        with open(path) as f:
            rep = json.load(f)
        for k, v in rep.items():
            if k.isdigit():
                reported[int(k)] = v
    model = fit(measured)
    print("## Coordination per operation (model fitted at "
          f"{', '.join(map(str, sorted(measured)[:2]))} processes)\n")
    print(table(model, sorted({*measured, *reported, 1024})))
    misses = check(model, {**measured, **reported})
    print(f"\nchecked against the measured counts at {sorted({*measured, *reported})}: "
          + ("all match" if not misses else f"{len(misses)} misses"))
    for m in misses:
        print("  miss:", m)
    print()
    for line in targets(model):
        print(line)
    print("\nper operation, fitted (N: processes): non-primary calls, primary calls, non-primary bytes, primary bytes")
    for op in OPS:
        m = model[op]
        print(f"  {op}: {m['other_calls_max'][0]:.0f} + {m['other_calls_max'][1]:.2f} N calls; "
              f"{m['primary_calls'][0]:.0f} + {m['primary_calls'][1]:.2f} N; "
              f"{m['other_bytes_max'][0]:.0f} + {m['other_bytes_max'][1]:.1f} N B; "
              f"{m['primary_bytes'][0]:.0f} + {m['primary_bytes'][1]:.1f} N B")


if __name__ == "__main__":
    main()
