"""Compression on many small leaves: ``python -m benchmarks.probe small_leaves [--leaves 2449] [--reps 3]``.

The matrices of a trained bf16-f32 state (`benchmarks.trained_state`) cut into `--leaves` leaves of
256x256 (2,449 leaves by default: bf16 parameters, f32 moments), saved to a local folder
(blocking, fsync'd) and loaded back as numpy, with each `--settings` value of ``compression=``,
interleaved per repetition; median seconds, bytes written, save time over the first setting's
(``save / raw`` with the default first setting, false), and what SaveStats.compression says "auto"
decided. ``--layouts items,nested``: the leaves as checkpointables of their own (a dict of 2,449
string keys, as this benchmark always saved them) and in one (``{"params": {...}}``, as a training
state holds them); ``--stages`` prints each case's stage timings (`benchmarks.probes.save_stages`). The loads keep the
buffers cairn keeps for the next save (`release_save_buffers`; ``--release-on-load``: freed, as
`cairn.load` does), as a training process's saves find them.
Prints a table; ``--json PATH`` writes it.
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

import cairn
from benchmarks.measure import setting
from benchmarks.trained_state import flatten, make_state, tiles


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leaves", type=int, default=2449)
    ap.add_argument("--size", type=int, default=1_000_000_000, help="bytes of the state the leaves are cut from")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--settings", default="false,true,auto")
    ap.add_argument("--layouts", default="items",
                    help="of items (each leaf a checkpointable of its own: a dict of 2,449 string keys is 2,449 "
                         "checkpointables, each with a data file, an index and fsyncs) and nested (all in one: "
                         "{'params': {...}}), comma separated; each runs every setting")
    ap.add_argument("--stages", action="store_true",
                    help="time each save's stages (benchmarks.probes.save_stages) and print their medians per setting")
    ap.add_argument("--groups", default=None,
                    help="values of codecpolicy.GROUP_LEAVES to compare, comma separated (1: each small leaf's codec "
                         "measured on its own); each runs every layout and setting")
    ap.add_argument("--blosc2-join", default=None,
                    help="values of codecs.BLOSC2_JOIN_BYTES to compare, in KiB, comma separated (0: each blosc2 chunk "
                         "kept as python-blosc2 returned it); each runs every layout, "
                         "setting and group")
    ap.add_argument("--cores", type=int, default=0,
                    help="code on this many threads (codecpolicy.coder_cores; default: the cores this process "
                         "may use), e.g. 13 on a small host for the TPU host's coder count")
    ap.add_argument("--warmup", type=int, default=0,
                    help="untimed rounds of every case first (each case's first save is printed apart): a process "
                         "that checkpoints every few minutes saves from warm memory after its first save, and on "
                         "hosts where fresh pages are dear (the TPU host) the first compressed save costs 2x the next")
    ap.add_argument("--release-on-load", action="store_true",
                    help="let each timed load free the buffers kept for the next save (`release_save_buffers`, "
                         "as `cairn.load` does): by default they are kept, since a training process saves again and "
                         "again and loads only when it restarts, while this benchmark loads after every save")
    ap.add_argument("--no-lend", action="store_true",
                    help="code into a new buffer per coding task (pipeline.LEND_CODED_BUFFERS off)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from cairn._codecs import codecs
    from cairn._save import codecpolicy, pipeline
    if args.no_lend:
        pipeline.LEND_CODED_BUFFERS = False
    if not args.release_on_load:
        from cairn._load import engine as load_engine

        load_engine.release_save_buffers = lambda: None
    if args.cores:
        # (the save's modules call it through codecpolicy, so this one replacement reaches them all)
        codecpolicy.coder_cores = lambda: args.cores
    spans = None
    if args.stages:
        from benchmarks.probes.save_stages import Spans, instrument

        spans = Spans()
        instrument(spans)
    leaves = tiles(flatten(make_state(args.size, "bf16-f32")), args.leaves)
    raw = sum(a.nbytes for a in leaves.values())
    count = len(leaves)
    layouts = args.layouts.split(",")
    states = {lay: {"params": leaves} if lay == "nested" else leaves for lay in layouts}
    settings = [setting(s) for s in args.settings.split(",")]
    groups = [int(g) for g in args.groups.split(",")] if args.groups else [codecpolicy.GROUP_LEAVES]
    joins = [int(j) << 10 for j in args.blosc2_join.split(",")] if args.blosc2_join else [codecs.BLOSC2_JOIN_BYTES]
    cases = [(lay, s, g, j) for j in joins for g in groups for lay in layouts for s in settings]

    def key(case: tuple[str, Any, int, int]) -> str:
        return (f"{case[0]}, {case[1]}" + (f", group {case[2]}" if args.groups else "")
                + (f", join {case[3] >> 10} KiB" if args.blosc2_join else ""))

    print(f"{count} leaves, {raw / 2**20:.0f} MiB raw; layouts {', '.join(layouts)}; {os.cpu_count()} cores, "
          f"{codecpolicy.coder_cores()} coders, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    times: dict[str, dict[str, list[float]]] = {key(c): {"save": [], "load": []} for c in cases}
    staged: dict[str, list[dict[str, float]]] = {}
    first: dict[str, float] = {}  # each case's first save, with --warmup
    info: dict[str, Any] = {}
    root = tempfile.mkdtemp(prefix="cairn-small-")
    try:
        for rep in range(args.warmup + args.reps):
            for case in cases:
                lay, s, g, j = case
                codecpolicy.GROUP_LEAVES = g
                codecs.BLOSC2_JOIN_BYTES = j
                path = os.path.join(root, f"c-{lay}-{s}-{g}-{j}")
                shutil.rmtree(path, ignore_errors=True)
                if spans is not None:
                    spans.clear()
                t = time.perf_counter()
                stats = cairn.save(path, states[lay], compression=s)
                took = time.perf_counter() - t
                if rep < args.warmup:
                    first.setdefault(key(case), took)
                    continue
                times[key(case)]["save"].append(took)
                if spans is not None:
                    staged.setdefault(key(case), []).append({**spans.summary(), "write_s": stats.write_s,
                                                             "commit_s": stats.commit_s})
                t = time.perf_counter()
                back = cairn.load(path)
                times[key(case)]["load"].append(time.perf_counter() - t)
                assert len(back.get("params", back) if lay == "nested" else back) == count
                info[key(case)] = {"bytes_written": stats.bytes_written, "decision": stats.compression}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    print("| layout | compression | group | join KiB | bytes written | save s | save / raw | load s | decision |\n"
          + "|---" * 9 + "|")
    for case in cases:
        t = times[key(case)]
        r = {"layout": case[0], "compression": str(case[1]), "save_s": statistics.median(t["save"]),
             "load_s": statistics.median(t["load"]), "save_each": t["save"], "load_each": t["load"],
             "first_save_s": first.get(key(case)), **info[key(case)]}
        rows.append(r)
        r["group"] = case[2]
        r["blosc2_join"] = case[3]
        base = statistics.median(times[key((case[0], settings[0], case[2], case[3]))]["save"])
        print(f"| {case[0]} | {case[1]} | {case[2]} | {case[3] >> 10} | {r['bytes_written'] / 2**20:.1f} MiB | "
              f"{r['save_s']:.2f} | "
              f"{r['save_s'] / base:.2f} | {r['load_s']:.2f} | {r['decision']} |", flush=True)
    if staged:
        from benchmarks.probes.save_stages import stage_line

        print("stages of each case's saves, median seconds (benchmarks.probes.save_stages):")
        for case in cases:
            st = staged[key(case)]
            print(f"  {key(case)}: write_s {statistics.median(r['write_s'] for r in st):.2f}, commit_s "
                  f"{statistics.median(r['commit_s'] for r in st):.2f}; {stage_line(st)}")
    if first:
        print("first save of each case (a warm-up round, not in the medians): "
              + "; ".join(f"{k} {v:.2f} s" for k, v in first.items()))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"leaves": count, "layouts": layouts, "raw": raw, "cores": os.cpu_count(), "rows": rows,
                       "stages": staged}, f, indent=1)


if __name__ == "__main__":
    main()
