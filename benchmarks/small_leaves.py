"""Compression on many small leaves: ``python -m benchmarks.small_leaves [--leaves 2449] [--reps 3]``.

The matrices of a trained bf16-f32 state (`benchmarks.trained_state`) cut into `--leaves` leaves of
256x256 (the issue's 2,449-leaf case: bf16 parameters, f32 moments), saved to a local folder
(blocking, fsync'd) and loaded back as numpy, with each `--settings` value of ``compression=``,
interleaved per repetition; median seconds, bytes written, and what SaveStats.compression says
"auto" decided. Prints a table; ``--json PATH`` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

import cairn
from benchmarks.trained_state import flatten, make_state


def tiles(flat: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, a in flat.items():
        if a.ndim != 2:
            continue
        for i in range(0, a.shape[0] - 255, 256):
            for j in range(0, a.shape[1] - 255, 256):
                out[f"{name}.{i}.{j}"] = np.ascontiguousarray(a[i:i + 256, j:j + 256])
                if len(out) >= count:
                    return out
    return out


def setting(s: str) -> Any:
    return {"false": False, "true": True}.get(s.lower(), s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leaves", type=int, default=2449)
    ap.add_argument("--size", type=int, default=1_000_000_000, help="bytes of the state the leaves are cut from")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--settings", default="false,true,auto")
    ap.add_argument("--stages", action="store_true",
                    help="time each save's stages (benchmarks.save_stages) and print their medians per setting")
    ap.add_argument("--json")
    args = ap.parse_args()
    spans = None
    if args.stages:
        from benchmarks.save_stages import Spans, instrument

        spans = Spans()
        instrument(spans)
    staged: dict[str, list[dict[str, float]]] = {}
    state = tiles(flatten(make_state(args.size, "bf16-f32")), args.leaves)
    raw = sum(a.nbytes for a in state.values())
    settings = [setting(s) for s in args.settings.split(",")]
    print(f"{len(state)} leaves, {raw / 2**20:.0f} MiB raw; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
          flush=True)
    times: dict[str, dict[str, list[float]]] = {str(s): {"save": [], "load": []} for s in settings}
    info: dict[str, Any] = {}
    root = tempfile.mkdtemp(prefix="cairn-small-")
    try:
        for _ in range(args.reps):
            for s in settings:
                path = os.path.join(root, f"c-{s}")
                shutil.rmtree(path, ignore_errors=True)
                if spans is not None:
                    spans.clear()
                t = time.perf_counter()
                stats = cairn.save(path, state, compression=s)
                times[str(s)]["save"].append(time.perf_counter() - t)
                if spans is not None:
                    staged.setdefault(str(s), []).append({**spans.summary(), "write_s": stats.write_s,
                                                          "commit_s": stats.commit_s})
                t = time.perf_counter()
                back = cairn.load(path)
                times[str(s)]["load"].append(time.perf_counter() - t)
                assert len(back) == len(state)
                info[str(s)] = {"bytes_written": stats.bytes_written, "decision": stats.compression}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    print("| compression | bytes written | save s | load s | decision |\n|---|---|---|---|---|")
    for s in settings:
        t = times[str(s)]
        r = {"compression": str(s), "save_s": statistics.median(t["save"]), "load_s": statistics.median(t["load"]),
             "save_each": t["save"], "load_each": t["load"], **info[str(s)]}
        rows.append(r)
        print(f"| {s} | {r['bytes_written'] / 2**20:.1f} MiB | {r['save_s']:.2f} | {r['load_s']:.2f} | "
              f"{r['decision']} |", flush=True)
    if staged:
        from benchmarks.save_stages import stage_line

        print("stages of each setting's saves, median seconds (benchmarks.save_stages):")
        for s in settings:
            st = staged[str(s)]
            print(f"  {s}: write_s {statistics.median(r['write_s'] for r in st):.2f}, commit_s "
                  f"{statistics.median(r['commit_s'] for r in st):.2f}; {stage_line(st)}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"leaves": len(state), "raw": raw, "cores": os.cpu_count(), "rows": rows,
                       "stages": staged}, f, indent=1)


if __name__ == "__main__":
    main()
