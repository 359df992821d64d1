"""Compression's effect on a save from device memory, and Orbax beside it, on one accelerator.

    python -m benchmarks.probe gpu_save [--gib 1] [--reps 3] [--json out.json]

Run where JAX sees a GPU (or TPU); on CPU it runs too, as a rehearsal. The state is
`benchmarks.trained_state.make_state` (bf16 parameters with f32 AdamW moments, a small
GPT-like model after training steps: what compression meets in practice), built on the
host and put on the first device. Then, settings interleaved per repetition so a change
in the machine hits them alike:

- the raw device-to-host copy of a fresh copy of the whole state by each of the snapshot's
  methods (`cairn._tree.shardings.start_to_host`: pinned host memory, the CPU backend,
  ``copy_to_host_async``), waited for with ``np.asarray``;
- for each storage (a local folder; the in-process ``memory://`` object store) and each
  ``compression=`` (False: raw blocks; True: a codec per leaf by measurement), and each
  writer thread count (and, for the raw local save, each device-to-host method):
  ``save_async``'s blocking time (what training waits for: the
  device-to-host snapshot) and its total time, a blocking ``save``, and a ``load`` back
  onto the device (decode included), with bytes written and read;
- the disk's floor: the same number of bytes written to 4 files by 4 threads, each fsync'd;
- a raw local save with a snapshot budget (``--budget-mib``): the chunks past it are protected
  by on-device copies that the writer threads bring to host one at a time;
- Orbax's ``StandardCheckpointer`` (its default zstd) saving and restoring the same state
  on the local folder, with its bytes on disk.

Medians over the repetitions; every repetition is kept in the JSON.
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

import jax
import numpy as np

import cairn
from benchmarks.measure import rss
from benchmarks.systems import raw_write_parallel
from benchmarks.trained_state import make_state, raw_bytes
from cairn._tree import shardings

MiB = 1 << 20
GiB = float(1 << 30)


def _ready(tree: Any) -> Any:
    return jax.block_until_ready(tree)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _cairn_round(path: str, state: Any, target: Any, compression: Any, threads: int, to_host: str,
                 budget: int | None, pipeline_mib: int | None = None, spans: Any = None) -> dict[str, float]:
    from cairn._save import engine

    shardings.TO_HOST = to_host
    if pipeline_mib is not None:
        engine.HOST_PIPELINE_BYTES = pipeline_mib * MiB
    t0 = time.perf_counter()
    fut = cairn.save_async(path, state, compression=compression, overwrite=True, threads=threads,
                           snapshot_budget_bytes=budget)
    blocking = time.perf_counter() - t0
    done = fut.result()
    async_total = time.perf_counter() - t0
    if spans is not None:
        spans.clear()
    t0 = time.perf_counter()
    saved = cairn.save(path, state, compression=compression, overwrite=True, threads=threads)
    save_s = time.perf_counter() - t0
    stages = spans.summary() if spans is not None else {}
    ls = cairn.LoadStats()
    t0 = time.perf_counter()
    _ready(cairn.load(path, target, stats=ls))
    load_s = time.perf_counter() - t0
    return {"async_blocking_s": blocking, "async_snapshot_s": done.snapshot_s, "async_total_s": async_total,
            "save_s": save_s, "load_s": load_s, "bytes_written": saved.bytes_written, "bytes_read": ls.bytes_read,
            "write_s": saved.write_s, "commit_s": saved.commit_s, "decision": saved.compression,
            **{f"stage_{k}": v for k, v in stages.items()}}


def _orbax_round(path: str, state: Any, target: Any) -> dict[str, float]:
    import orbax.checkpoint as ocp

    shutil.rmtree(path, ignore_errors=True)
    ckptr = ocp.StandardCheckpointer()
    t0 = time.perf_counter()
    ckptr.save(path, state)
    blocking = time.perf_counter() - t0
    ckptr.wait_until_finished()
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _ready(ckptr.restore(path, target))
    load_s = time.perf_counter() - t0
    ckptr.close()
    return {"async_blocking_s": blocking, "save_s": save_s, "load_s": load_s, "bytes_written": _dir_bytes(path)}


def donation_check(leaves: list[Any], work: str, to_host: str, budget: int | None) -> str:
    """`save_async`, then at once two steps that donate the saved arrays (their buffers reused):
    the checkpoint must hold the values from before. Raises if it does not."""
    shardings.TO_HOST = to_host
    xs = _ready([x.copy() for x in leaves])
    want = [np.asarray(x).copy() for x in xs]
    step = jax.jit(lambda t: [x * 2 + 1 for x in t], donate_argnums=0)
    jax.block_until_ready(step(_ready([x.copy() for x in xs])))  # compiled before the save
    path = os.path.join(work, f"donate-{to_host}-{budget}")
    t0 = time.perf_counter()
    fut = cairn.save_async(path, {"xs": xs}, overwrite=True, snapshot_budget_bytes=budget)
    blocking = time.perf_counter() - t0
    ys = jax.block_until_ready(step(step(xs)))
    if not all(x.is_deleted() for x in xs):
        raise AssertionError("the step did not donate the saved arrays")
    fut.result()
    got = cairn.load(path)["xs"]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if not np.array_equal(np.asarray(g), w)]
    if bad:
        raise AssertionError(f"donation after save_async ({to_host}, budget {budget}) changed leaves {bad}")
    del ys
    return f"donation right after save_async ({to_host}, budget {budget}): values kept ({blocking:.3f} s blocking)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="raw size of the state (GiB)")
    ap.add_argument("--variant", default="bf16-f32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="4,16", help="writer thread counts to run (comma separated)")
    ap.add_argument("--to-host", default="pinned,cpu,async", help="device-to-host methods to compare")
    ap.add_argument("--budget-mib", type=int, default=256,
                    help="also a raw local save with this snapshot budget (the rest protected by device copies)")
    ap.add_argument("--no-orbax", action="store_true")
    ap.add_argument("--compressions", default="False,True", help="compression= values (False, True, a codec)")
    ap.add_argument("--storages", default="local,memory", help="of local (a folder) and memory (memory://)")
    ap.add_argument("--stages", action="store_true",
                    help="time the blocking save's stages (benchmarks.probes.save_stages: choose, host copy, code, "
                         "wait, crc, write, fsync) and print them per case")
    ap.add_argument("--pipeline-mib", default=None,
                    help="values of the blocking save's host-copy pipeline budget to compare, in MiB, comma "
                         "separated (engine.HOST_PIPELINE_BYTES; 0: none, each device chunk copied to host by its "
                         "writer or the codec choosing when it comes to it); every "
                         "cairn case runs with each")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, device {dev.platform}: {getattr(dev, 'device_kind', '')}; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    t0 = time.perf_counter()
    host = make_state(int(args.gib * GiB), args.variant)
    raw = raw_bytes(host)
    print(f"state: {args.variant}, {raw / MiB:.0f} MiB raw, built in {time.perf_counter() - t0:.0f} s", flush=True)
    state = _ready(jax.device_put(host, dev))
    del host
    sharding = jax.sharding.SingleDeviceSharding(dev)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)

    work = tempfile.mkdtemp(prefix="cairn-gpu-", dir=args.workdir)
    where = {"local": os.path.join(work, "ckpt"), "memory": f"memory://gpu-{uuid.uuid4().hex}/ckpt"}
    where = {s: p for s, p in where.items() if s in args.storages.split(",")}
    threads = [int(t) for t in args.threads.split(",")]
    methods = args.to_host.split(",")
    pipes: list[Any] = [int(x) for x in args.pipeline_mib.split(",")] if args.pipeline_mib else [None]
    comps = [{"False": False, "True": True}.get(c, c) for c in args.compressions.split(",")]
    cases: list[Any] = [(s, c, t, methods[0], None, p) for p in pipes for s in where for c in comps
                        for t in threads]
    cases += [("local", False, threads[0], m, None, p) for p in pipes for m in methods[1:]]
    if args.budget_mib:
        cases.append(("local", False, threads[0], methods[0], args.budget_mib * MiB, pipes[0]))
    runs: dict[Any, list[dict[str, float]]] = {c: [] for c in cases}
    runs["orbax"] = []
    gets: dict[str, list[float]] = {m: [] for m in methods}
    leaves = jax.tree.leaves(state)
    floor = np.ones(raw, dtype=np.uint8)
    floors: list[float] = []
    small = [x for x in leaves if x.ndim][:16]
    for m in methods:
        if m != "async":  # (measurement only: the host value stays on the caller's array)
            print(donation_check(small, work, m, None), flush=True)
    print(donation_check(small, work, methods[0], 0), flush=True)
    spans = None
    if args.stages:
        from benchmarks.probes.save_stages import Spans, instrument

        spans = Spans()
        instrument(spans)
    rss_seen = [rss()]
    print(f"process RSS before the first save: {rss_seen[0] / GiB:.2f} GiB", flush=True)
    try:
        for rep in range(args.reps):
            floors.append(raw_write_parallel(floor, [os.path.join(work, f"floor{i}") for i in range(4)]))
            for m in methods:
                fresh = _ready([x.copy() for x in leaves])  # arrays no host value is cached on yet
                t0 = time.perf_counter()
                for h in shardings.start_to_host(fresh, m):
                    np.asarray(h)
                gets[m].append(time.perf_counter() - t0)
                del fresh
            for case in cases:
                runs[case].append(_cairn_round(where[case[0]], state, target, *case[1:], spans=spans))
            if not args.no_orbax:
                runs["orbax"].append(_orbax_round(os.path.join(work, "orbax"), state, target))
            rss_seen.append(rss())
            print(f"round {rep + 1}/{args.reps} done; process RSS {rss_seen[-1] / GiB:.2f} GiB", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    print(f"raw write floor (4 files, 4 threads, fsync'd): median {med(floors):.2f} s "
          f"({raw / GiB / med(floors):.2f} GiB/s)")
    for m, ts in gets.items():
        print(f"device-to-host of the whole state, {m}: median {med(ts):.3f} s ({raw / GiB / med(ts):.1f} GiB/s)")
    print("\n| system | storage | compression | threads | to host | stored / raw | async blocking s | async total s | "
          "save s | load s | save GiB/s | load GiB/s |\n" + "|---" * 12 + "|")
    rows = []
    for key, rs in runs.items():
        if not rs:
            continue
        system, storage, comp, thr, how, budget, pipe = (("orbax", "local", "zstd (default)", "", "", None, None)
                                                         if key == "orbax" else ("cairn", *key))
        how = f"{how}, budget {budget // MiB} MiB" if budget else how
        how = f"{how}, pipeline {pipe} MiB" if pipe is not None else how
        row = {k: med(r.get(k, 0.0) for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}  # not "decision"
        row.update(system=system, storage=storage, compression=comp, threads=thr, to_host=how, all=rs)
        rows.append(row)
        print(f"| {system} | {storage} | {comp} | {thr} | {how} | {row['bytes_written'] / raw:.3f} | "
              f"{row['async_blocking_s']:.3f} | {row.get('async_total_s', float('nan')):.2f} | {row['save_s']:.2f} | "
              f"{row['load_s']:.2f} | {raw / GiB / row['save_s']:.2f} | {raw / GiB / row['load_s']:.2f} |")
    if args.stages:
        from benchmarks.probes.save_stages import stage_line

        print("\nblocking save's stages, median seconds (union: wall time the stage ran anywhere in the data "
              "phase; `benchmarks.probes.save_stages`):")
        for key, rs in runs.items():
            if key != "orbax" and rs:
                st = [{k[6:]: v for k, v in r.items() if k.startswith("stage_")} for r in rs]
                print(f"  {key}: save {med(r['save_s'] for r in rs):.2f} (write_s {med(r['write_s'] for r in rs):.2f}, "
                      f"commit_s {med(r['commit_s'] for r in rs):.2f}): {stage_line(st)}; {rs[-1]['decision']}")
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variant": args.variant, "raw_bytes": raw, "device": str(dev), "jax": jax.__version__,
                       "cores": os.cpu_count(), "to_host_s": gets, "raw_write_s": floors, "rss_bytes": rss_seen, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
