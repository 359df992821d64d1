"""Benchmark cairn against Orbax, PyTorch DCP and the machine's limits.

    python -m benchmarks.run training --help       # scenario: checkpoint every step of a training loop
    python -m benchmarks.run                       # defaults: 2 GiB float32, 3 reps, plot at 0.5/1/2 GiB
    python -m benchmarks.run --systems cairn,cairn_compressed,orbax,limits --size-gib 0.5 --sizes ''
    python -m benchmarks.run --size-gib 0.25 --reps 1 --sizes 0.0625,0.125,0.25 --systems cairn,limits

Every (system, size, repetition) runs in a fresh subprocess (`benchmarks.worker`),
so peak RSS is per system; the order of systems rotates between repetitions.
The values are a trained model's by default (``--values random`` for random
mantissas), built once per run and read back by each worker; ``cairn`` saves with
``--compression`` (default "auto": raw on a local disk) and ``cairn_compressed``
with ``compression=True``, so the bytes table compares both with Orbax's.
Writes results.json, results.md and time_vs_size.png into --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from . import report
from . import state as st

# dcp_jax: DCP in a process that also holds the JAX state; cairn_compressed: cairn with compression=True
ALL = ["cairn", "cairn_compressed", "orbax", "dcp", "dcp_jax", "limits"]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0, help="state size of the main table (GiB)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions at the main size")
    ap.add_argument("--sizes", type=_floats, default=[0.5, 1.0, 2.0],
                    help="sizes (GiB) for the time-vs-size plot; '' for none")
    ap.add_argument("--plot-reps", type=int, default=1, help="repetitions at the other plot sizes")
    ap.add_argument("--systems", default=",".join(ALL), help=f"comma list from {ALL}")
    ap.add_argument("--dtype", default="float32", help="comma list of float32, bfloat16, mixed")
    ap.add_argument("--out", default="bench-results", help="output folder")
    ap.add_argument("--workdir", default=None,
                    help="where checkpoints are written (default: <out>/work; same disk as --out)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
    ap.add_argument("--values", choices=["random", "trained"], default="trained",
                    help="array values: a trained layer's (the default; benchmarks.trained_state: init as a model "
                         "would, then AdamW steps), so that bytes on disk and compression are realistic; or random "
                         "mantissas (what zstd cannot compress)")
    ap.add_argument("--compression", default="auto", help="cairn's compression= (auto, true, false, zstd, planes)")
    a = ap.parse_args(argv)
    a.systems = [s for s in a.systems.split(",") if s]
    bad = [s for s in a.systems if s not in ALL]
    if bad:
        ap.error(f"unknown systems {bad}; choose from {ALL}")
    a.dtypes = [d for d in a.dtype.split(",") if d]
    for d in a.dtypes:
        if d not in st.DTYPES:
            ap.error(f"unknown dtype {d!r}")
    return a


def _machine() -> dict[str, Any]:
    import psutil

    info = {
        "cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(), "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "drop_caches_writable": os.access("/proc/sys/vm/drop_caches", os.W_OK),
    }
    try:
        git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, check=False).stdout.strip()  # noqa: E731
        info["git"] = git("rev-parse", "--short", "HEAD")
        # Uncommitted changes to the library itself change what is measured: record them.
        info["src_dirty"] = git("status", "--short", "--", "src").splitlines()
    except OSError:
        pass
    return info


def run_one(system: str, size_bytes: int, dtype: str, workdir: str, timeout: float) -> dict[str, Any]:
    os.makedirs(workdir, exist_ok=True)
    result = os.path.join(workdir, "result.json")
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={st.N_DEVICES}")
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cmd = [sys.executable, "-m", "benchmarks.worker", "--system", system, "--size-bytes", str(size_bytes),
           "--dtype", dtype, "--workdir", workdir, "--result", result]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out: dict[str, Any]
        try:
            with open(result) as f:
                out = json.load(f)
        except (OSError, ValueError):
            out = {"system": system, "ok": False,
                   "error": f"worker exited {proc.returncode} without a result: {proc.stderr[-2000:]}"}
    except subprocess.TimeoutExpired:
        out = {"system": system, "ok": False, "error": f"timed out after {timeout:.0f}s"}
    out["wall_s"] = time.perf_counter() - t0
    shutil.rmtree(workdir, ignore_errors=True)
    return out


#: Scenarios other than the save/load table: ``python -m benchmarks.run NAME [its options]``.
SCENARIOS = {"training": "benchmarks.training", "repeated_load": "benchmarks.repeated"}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in SCENARIOS:
        import importlib

        return int(importlib.import_module(SCENARIOS[args[0]]).main(args[1:]))
    a = parse(argv)
    os.environ["CAIRN_BENCH_VALUES"] = a.values  # the workers (subprocesses) build their states from it
    os.environ["CAIRN_BENCH_COMPRESSION"] = a.compression
    os.makedirs(a.out, exist_ok=True)
    cache = None
    if a.values == "trained":  # trained values take about a minute per GiB to build: once per run, then read
        cache = tempfile.mkdtemp(prefix="values-", dir=a.out)
        os.environ["CAIRN_BENCH_VALUES_CACHE"] = cache
    # Absolute: Orbax refuses relative checkpoint paths.
    workdir = os.path.abspath(a.workdir or os.path.join(a.out, "work"))
    main_size = int(a.size_gib * 2**30)
    sizes = sorted({main_size, *(int(g * 2**30) for g in a.sizes)})
    plan = [(d, s, a.reps if s == main_size else a.plot_reps) for d in a.dtypes for s in sizes]
    meta = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"), "machine": _machine(),
        "args": {k: v for k, v in vars(a).items()}, "main_size": main_size,
    }
    runs: list[dict[str, Any]] = []
    n_total = sum(r for _, _, r in plan) * len(a.systems)
    n = 0
    t_start = time.perf_counter()
    for dtype, size, reps in plan:
        for rep in range(reps):
            order = a.systems[rep % len(a.systems):] + a.systems[: rep % len(a.systems)]
            for system in order:
                n += 1
                print(f"[{n}/{n_total} {time.perf_counter() - t_start:6.0f}s] {system:6s} {dtype} "
                      f"{size / 2**30:.3g} GiB rep {rep + 1}/{reps}", file=sys.stderr, flush=True)
                r = run_one(system, size, dtype, os.path.join(workdir, f"{system}-{rep}"), a.timeout)
                r.update(dtype=dtype, size=size, rep=rep)
                if not r.get("ok"):
                    print(f"    FAILED: {r.get('error')}", file=sys.stderr, flush=True)
                runs.append(r)
    shutil.rmtree(workdir, ignore_errors=True)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
    meta["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    meta["machine"]["loadavg_end"] = os.getloadavg()
    meta["elapsed_s"] = time.perf_counter() - t_start
    summary = report.summarize(runs, meta)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "runs": runs}, f, indent=1, default=str)
    md = report.markdown(summary, meta)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(md)
    png = os.path.join(a.out, "time_vs_size.png")
    if report.plot(summary, png):
        print(f"plot: {png}", file=sys.stderr)
    print(md)
    return 0 if all(r.get("ok") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
