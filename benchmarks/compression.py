"""Compression on vs off, in one run: bytes on disk, save and load time of a trained state.

    python -m benchmarks.compression [--mib 256] [--variant bf16-f32] [--reps 3] [--json out.json]

The state is `benchmarks.trained_state.make_state` (a small GPT-like model
after AdamW steps; numpy arrays, so no device copies are timed). For each
storage (a local folder, the in-process ``memory://`` object store) and each
setting of ``compression=`` (False: raw blocks, format version 2; True: a
codec per leaf by measurement, version 3) it saves the state `reps` times
and loads it back as numpy as many times, and reports the median times, the
bytes written (data files, as `SaveStats.bytes_written` counts them) and the
bytes a load reads (`LoadStats.bytes_read`). Settings are interleaved per
repetition so that a change in the machine's load hits them alike. What
``"auto"`` does is printed beside: on a local disk it is the False row, on
an object store the True row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from typing import Any

import cairn
from benchmarks.trained_state import make_state, raw_bytes

MiB = 1 << 20


def _one(path: str, state: Any, compression: Any) -> dict[str, float]:
    t0 = time.perf_counter()
    saved = cairn.save(path, state, compression=compression, overwrite=True)
    t_save = time.perf_counter() - t0
    ls = cairn.LoadStats()
    t0 = time.perf_counter()
    cairn.load(path, stats=ls)
    t_load = time.perf_counter() - t0
    fut = cairn.save_async(path, state, compression=compression, overwrite=True)
    done = fut.result()  # its stats: blocking_s is the caller's wait (validation and the snapshot)
    return {"save_s": t_save, "load_s": t_load, "bytes_written": saved.bytes_written, "bytes_read": ls.bytes_read,
            "async_blocking_s": done.blocking_s, "async_total_s": done.total_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="raw size of the state (MiB)")
    ap.add_argument("--variant", default="bf16-f32", help="trained_state variant: bf16-f32, bf16-bf16, f32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="local folder for the local-disk rows (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    state = make_state(args.mib * MiB, args.variant)
    raw = raw_bytes(state)
    print(f"state: {args.variant}, {raw / MiB:.1f} MiB raw, built in {time.perf_counter() - t0:.1f} s; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    work = tempfile.mkdtemp(prefix="cairn-cmp-", dir=args.workdir)
    where = {"local": os.path.join(work, "ckpt"), "memory": f"memory://bench-{uuid.uuid4().hex}/ckpt"}
    settings = [False, True]
    runs: dict[tuple[str, bool], list[dict[str, float]]] = {(s, c): [] for s in where for c in settings}
    try:
        for _ in range(args.reps):
            for s, path in where.items():
                for c in settings:
                    runs[(s, c)].append(_one(path, state, c))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    print("\n| storage | compression | auto picks it | bytes written | ratio | save s | load s | "
          "save MiB/s | load MiB/s | async blocking s | async total s |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for (s, c), rs in runs.items():
        save_s = statistics.median(r["save_s"] for r in rs)
        load_s = statistics.median(r["load_s"] for r in rs)
        written = rs[-1]["bytes_written"]
        auto = (s == "memory") == c
        blocking = statistics.median(r["async_blocking_s"] for r in rs)
        async_total = statistics.median(r["async_total_s"] for r in rs)
        rows.append({"storage": s, "compression": c, "auto": auto, "raw_bytes": raw, "bytes_written": written,
                     "bytes_read": rs[-1]["bytes_read"], "save_s": save_s, "load_s": load_s,
                     "async_blocking_s": blocking, "async_total_s": async_total, "all": rs})
        print(f"| {s} | {c} | {'yes' if auto else ''} | {written / MiB:.1f} MiB | {raw / written:.3f} | "
              f"{save_s:.2f} | {load_s:.2f} | {raw / MiB / save_s:.0f} | {raw / MiB / load_s:.0f} | "
              f"{blocking:.3f} | {async_total:.2f} |")
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variant": args.variant, "raw_bytes": raw, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
