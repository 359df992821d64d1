"""Where the load of an incremental step with deltas spends its time: ``python -m benchmarks.incremental_load``.

Saves the chain of `benchmarks.incremental`'s ``lr1e-6`` case (`--state-mib` of `benchmarks.trained_state`'s
bf16 parameters and f32 AdamW moments; a self-contained step with hashes, then `--steps` AdamW steps at
learning rate 1e-6, each saved against the one before: the parameters mostly as deltas) and the last state
in full, raw, on local disk; then loads the last step and the full save alternately (`--reps`, the order
flipped every rep) and reports, per kind, the medians of:

- ``load``: the call, and the paired ratio incremental / full;
- ``first`` / ``last``: when the first read began and the last read ended (`ChunkReader.do_read`), from the
  call's start: the loading thread's work before any read (plan, index records) and the reads' tail;
- thread seconds (`time.thread_time`) in `blocks.apply_delta` (the deltas' rebuild: base block CRC, zstd,
  XOR or scatter), in `ChunkReader.do_read` (every read, deltas included) and in the version-4 records'
  decode (`binindex.ChunkTable._decode`).

The wrappers change no behaviour. ``--deltas shared,reader`` loads the incremental step once per setting of
`blocks.DELTAS_SHARED` in each rep (``shared``: a read's deltas taken by its reader thread and free threads of
the decode pool, `decodepool.share`; ``reader``: by its reader thread alone), each against the same full loads.
Run it from two trees in turn to compare them (same machine, the load average is printed). ``--dir`` puts the
checkpoints elsewhere (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

import numpy as np

import cairn
from benchmarks.incremental import _adamw
from benchmarks.trained_state import make_state

MiB = 1 << 20


class _Clock:
    def __init__(self) -> None:
        self.cpu: dict[str, float] = collections.defaultdict(float)
        self.spans: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def wrap(self, obj: Any, name: str, label: str, span: bool = False) -> None:
        f = getattr(obj, name)

        @functools.wraps(f)
        def timed(*a: Any, **k: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return f(*a, **k)
            finally:
                with self.lock:
                    self.cpu[label] += time.thread_time() - c0
                    if span:
                        self.spans.append((t0, time.perf_counter()))

        setattr(obj, name, timed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state-mib", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--deltas", default="shared", help="comma-separated: shared, reader (`blocks.DELTAS_SHARED`)")
    args = ap.parse_args(argv)
    from cairn._format import binindex
    from cairn._load import blocks
    from cairn._load import reader as _reader

    clock = _Clock()
    clock.wrap(blocks, "apply_delta", "apply_delta")
    clock.wrap(_reader.ChunkReader, "do_read", "do_read", span=True)
    clock.wrap(binindex.ChunkTable, "_decode", "index_decode")
    root = tempfile.mkdtemp(prefix="cairn-incload-", dir=args.dir)
    try:
        state = make_state(args.state_mib * MiB, "bf16-f32")
        rng = np.random.default_rng(1)
        cairn.save(f"{root}/plain", state, compression=False)
        cairn.save(f"{root}/inc_0", state, compression=False, base=f"{root}/plain")  # with hashes
        shutil.rmtree(f"{root}/plain")
        for t in range(1, args.steps + 1):
            _adamw(state, 1e-6, rng, 20 + t)
            cairn.save(f"{root}/inc_{t}", state, compression=False, base=f"{root}/inc_{t - 1}")
        cairn.save(f"{root}/full", state, compression=False)
        settings = args.deltas.split(",")
        if not hasattr(blocks, "DELTAS_SHARED"):  # (a tree from before it: its one way)
            settings = ["reader"]
        kinds = {**{f"inc-{s}": f"{root}/inc_{args.steps}" for s in settings}, "full": f"{root}/full"}
        got: dict[str, dict[str, list[float]]] = {k: collections.defaultdict(list) for k in kinds}
        order = list(kinds)
        for rep in range(args.reps + 1):
            for kind in (order if rep % 2 == 0 else order[::-1]):
                clock.cpu.clear()
                clock.spans.clear()
                if kind.startswith("inc-") and hasattr(blocks, "DELTAS_SHARED"):
                    blocks.DELTAS_SHARED = kind == "inc-shared"
                t0 = time.perf_counter()
                cairn.load(kinds[kind])
                dt = time.perf_counter() - t0
                if rep == 0:  # warm-up: pools started, files in the page cache
                    continue
                g = got[kind]
                g["load"].append(dt)
                g["first"].append(min(s for s, _ in clock.spans) - t0)
                g["last"].append(max(e for _, e in clock.spans) - t0)
                for label in ("apply_delta", "do_read", "index_decode"):
                    g[label].append(clock.cpu.get(label, 0.0))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} cores; state {args.state_mib} MiB, "
          f"{args.reps} loads of each")
    for kind, g in got.items():
        print(f"  {kind:10s} " + ", ".join(f"{k} {1e3 * statistics.median(v):.1f} ms" for k, v in g.items()))
    full = got["full"]["load"]
    for kind in kinds:
        if kind != "full":
            ratios = [a / b for a, b in zip(got[kind]["load"], full)]
            print(f"  load {kind} / full: {statistics.median(got[kind]['load']) / statistics.median(full):.3f}x (ratio of "
                  f"medians), paired median {statistics.median(ratios):.3f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
