"""Coding into fresh or lent buffers: ``python -m benchmarks.coded_buffers [--threads 13] [--reps 3]``.

The coding tasks of a compressed save, alone (no files): 2,449 leaves of 256x256 cut from a 600 MB
bf16-f32 trained state, and the state's whole arrays, in the tasks a save codes them in
(`benchmarks.codecs.coding_tasks`: runs of 16 blocks of 1 MiB, small leaves together up to as many
bytes), each task coded by `codecs.encode_runs` with ``--codec`` (default "blosc2") on ``--threads``
threads at once. Each task's stored blocks go into a new buffer
(``fresh``) or one lent by a `buffers.SlabPool` that was filled by an earlier round (``lent``); the
blocks are either held until every task is done (``hold``: as a save's writers hold them until
written) or dropped at once (``drop``). Best wall time of ``--reps``, GiB/s of raw bytes, and the coder
threads' CPU seconds (median). docs/compression.md, "Coded buffers lent and taken back".
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.codecs import coding_tasks
from benchmarks.small_leaves import tiles
from benchmarks.trained_state import flatten, make_state
from cairn._core.buffers import SlabPool
from cairn._format import codecs as C

RUN_BLOCKS = 16  # as `engine.RUN_BLOCKS`


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size", type=int, default=600_000_000)
    ap.add_argument("--codec", default="blosc2" if C.blosc2_available() else "planes")
    args = ap.parse_args()
    flat = flatten(make_state(args.size, "bf16-f32"))
    sets = {"small leaves": coding_tasks([(a, args.codec) for a in tiles(flat, 2449).values()], RUN_BLOCKS),
            "whole arrays": coding_tasks([(a, args.codec) for a in flat.values() if a.nbytes], RUN_BLOCKS)}
    print(f"{args.threads} threads, codec {args.codec}, load {os.getloadavg()[0]:.1f}", flush=True)
    for name, tasks in sets.items():
        raw = sum(r[1].nbytes for t in tasks for r in t)
        pool = SlabPool()
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}

        def run(mode: str, hold: bool, tasks: list[Any] = tasks, pool: SlabPool = pool) -> tuple[float, float]:
            alloc = pool.lend if mode == "lent" else None
            lock, cpu, kept = threading.Lock(), [0.0], []

            def work(task: Any) -> None:
                c0 = time.thread_time()
                out = C.encode_runs(task, coders=args.threads, alloc=alloc)
                with lock:
                    cpu[0] += time.thread_time() - c0
                    if hold:
                        kept.append(out)

            with ThreadPoolExecutor(args.threads) as ex:
                t0 = time.perf_counter()
                list(ex.map(work, tasks))
                dt = time.perf_counter() - t0
            kept.clear()  # (the held blocks go now, before the next round)
            return dt, cpu[0]

        run("lent", True)  # fills the pool: the lent rounds code into buffers an earlier round touched
        for _ in range(args.reps):
            for mode in ("fresh", "lent"):
                for hold in (True, False):
                    results.setdefault((mode, "hold" if hold else "drop"), []).append(run(mode, hold))
        print(f"{name}: {len(tasks)} tasks, {raw / 2**20:.0f} MiB raw; pool made {pool.made}, reused {pool.reused}")
        for (mode, hold), v in results.items():
            best = min(x[0] for x in v)
            print(f"  {mode:5s} {hold}: {raw / 2**30 / best:5.2f} GiB/s (best {best * 1e3:6.1f} ms), "
                  f"coder CPU {statistics.median(x[1] for x in v):5.2f} s", flush=True)


if __name__ == "__main__":
    main()
