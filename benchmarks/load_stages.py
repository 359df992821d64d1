"""Where a load's time goes, stage by stage: ``python -m benchmarks.load_stages [--mib 256] [--jax]``.

Saves the trained state of `benchmarks.trained_state` (bf16 parameters, f32 AdamW moments) to a local
folder with ``compression=False`` and ``True``, then loads each back (numpy targets, or with ``--jax``
onto JAX's first device), the cases interleaved per repetition, and times the load's stages by
wrapping the functions that do them (no change to the library):

- ``read``: `ChunkReader._fill` (storage reads into buffers), union of spans (wall seconds some
  thread was reading) and sum (thread-seconds);
- ``crc``: `BlockChecks._crc` (CRC-32C of stored blocks), union and sum;
- ``decode``: `codecs.decode_run` and `codecs.decode` (outermost call only), union and sum;
- ``land``: the loading thread placing arrays (`engine._assemble`, `PutBatch.flush`: host-to-device
  puts, casts), union;
- ``wait``: the loading thread waiting for reads (``Future.result`` on it), sum;
- ``ready``: ``jax.block_until_ready`` after the load returns (device transfers still running);
- ``load``: the call. ``cores`` is the sum of the thread stages over ``load``: how many cores the
  load kept busy on average with reading, checking and decoding.

``--settings`` names `reader.DECODE_THREADS` values to compare in one run: ``0`` decodes in the reader
threads as before issue 38, ``auto`` on the decode pool (one thread per core). ``--ab SRC`` instead
compares this tree against another checkout's ``src`` (e.g. ``/work/main/src``): each load runs in a
child process of either tree, alternated, on the same saved checkpoints.

Prints medians per case; ``--json PATH`` writes every repetition.
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
import threading
import time
from concurrent.futures import Future
from typing import Any

MiB = 1 << 20
THREAD_STAGES = ("read", "crc", "decode")


class Spans:
    """(start, end) spans per stage from any thread; a stage nested in itself counts once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self.depth = threading.local()

    def add(self, stage: str, a: float, b: float) -> None:
        with self.lock:
            self.spans.setdefault(stage, []).append((a, b))

    def wrap(self, owner: Any, name: str, stage: str, main_only: bool = False) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return
        spans = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if main_only and threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)
            d = getattr(spans.depth, stage, 0)
            setattr(spans.depth, stage, d + 1)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(spans.depth, stage, d)
                if d == 0:
                    spans.add(stage, t, time.perf_counter())

        setattr(owner, name, timed)

    def summary(self, total: float) -> dict[str, float]:
        out = {"load": total}
        for stage, ss in self.spans.items():
            out[f"{stage}_sum"] = sum(b - a for a, b in ss)
            out[f"{stage}_union"] = _union(ss)
        out["cores"] = sum(out.get(f"{s}_sum", 0.0) for s in THREAD_STAGES) / total if total else 0.0
        return out


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def instrument(spans: Spans) -> None:
    from cairn._core import checksum
    from cairn._format import codecs
    from cairn._load import engine, reader
    from cairn._tree import shardings

    spans.wrap(reader.ChunkReader, "_fill", "read")
    spans.wrap(checksum.BlockChecks, "_crc", "crc")
    spans.wrap(codecs, "decode_run", "decode")
    spans.wrap(codecs, "decode", "decode")
    spans.wrap(engine, "_assemble", "land", main_only=True)
    spans.wrap(shardings.PutBatch, "flush", "land", main_only=True)
    spans.wrap(Future, "result", "wait", main_only=True)


def set_decode_threads(value: str) -> None:
    from cairn._load import reader

    if hasattr(reader, "DECODE_THREADS"):
        reader.DECODE_THREADS = None if value == "auto" else int(value)


def load_once(path: str, use_jax: bool, threads: int, spans: Spans | None) -> dict[str, float]:
    import cairn

    target = None
    if use_jax:
        import jax

        dev = jax.devices()[0]
        sharding = jax.sharding.SingleDeviceSharding(dev)
        meta = cairn.metadata(path)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), meta,
                              is_leaf=lambda x: isinstance(x, cairn.ArrayMetadata))
    if spans is not None:
        spans.spans = {}
    t0 = time.perf_counter()
    out = cairn.load(path, target, threads=threads)
    t1 = time.perf_counter()
    if use_jax:
        import jax

        jax.block_until_ready(out)
    t2 = time.perf_counter()
    row = spans.summary(t1 - t0) if spans is not None else {"load": t1 - t0}
    row["ready"] = t2 - t1
    row["total"] = t2 - t0
    return row


def _child(args: argparse.Namespace) -> int:
    spans = Spans()
    instrument(spans)
    load_once(args.path, args.jax, args.threads, spans)  # warm: imports, pools, compilation
    rows = [load_once(args.path, args.jax, args.threads, spans) for _ in range(args.reps)]
    print("ROWS " + json.dumps(rows))
    return 0


def _line(rows: list[dict[str, float]]) -> str:
    med = statistics.median
    keys = ["total", "load", "ready", "read_union", "read_sum", "crc_sum", "decode_union", "decode_sum",
            "land_union", "wait_sum", "cores"]
    return ", ".join(f"{k} {med(r.get(k, 0.0) for r in rows):.3f}" for k in keys)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="raw size of the state (MiB)")
    ap.add_argument("--variant", default="bf16-f32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8, help="load(threads=)")
    ap.add_argument("--jax", action="store_true", help="load onto JAX's first device (else numpy)")
    ap.add_argument("--compression", default="False,True", help="compression= values of the saves")
    ap.add_argument("--settings", default="0,auto", help="reader.DECODE_THREADS values to compare")
    ap.add_argument("--ab", default=None, help="another tree's src folder: compare its loads with this tree's")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)

    import numpy as np

    import cairn
    from benchmarks.trained_state import make_state

    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}", flush=True)
    state = make_state(args.mib * MiB, args.variant)
    work = tempfile.mkdtemp(prefix="cairn-load-stages-", dir=args.workdir)
    paths = {}
    for c in args.compression.split(","):
        comp: Any = {"False": False, "True": True}.get(c, c)
        paths[c] = os.path.join(work, f"ckpt-{c}")
        saved = cairn.save(paths[c], state, compression=comp)
        print(f"saved compression={c}: {saved.bytes_written / MiB:.0f} MiB stored; {saved.compression}", flush=True)
    raw = sum(x.nbytes for x in _leaves(state))
    del state
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cases: list[tuple[str, str]]
    if args.ab:
        cases = [(c, t) for c in paths for t in ("A", "B")]
        trees = {"A": args.ab, "B": os.path.join(here, "src")}
    else:
        cases = [(c, s) for c in paths for s in args.settings.split(",")]
        spans = Spans()
        instrument(spans)
    runs: dict[tuple[str, str], list[dict[str, float]]] = {k: [] for k in cases}
    try:
        if not args.ab:
            for c in paths:
                load_once(paths[c], args.jax, args.threads, None)  # warm
        for rep in range(args.reps):
            for c, s in (cases if rep % 2 == 0 else cases[::-1]):  # each order as often: no case always first
                if args.ab:
                    env = dict(os.environ, PYTHONPATH=os.pathsep.join([trees[s], here]))
                    cmd = [sys.executable, "-m", "benchmarks.load_stages", "--child", "--path", paths[c],
                           "--reps", "1", "--threads", str(args.threads)] + (["--jax"] if args.jax else [])
                    got = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                    line = [ln for ln in got.stdout.splitlines() if ln.startswith("ROWS ")]
                    if got.returncode or not line:
                        raise RuntimeError(f"child {s} failed: {got.stderr[-2000:]}")
                    runs[(c, s)] += json.loads(line[0][5:])
                else:
                    set_decode_threads(s)
                    runs[(c, s)].append(load_once(paths[c], args.jax, args.threads, spans))
            print(f"round {rep + 1}/{args.reps}, load average {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    label = {"A": f"A {args.ab}", "B": "B this tree"}
    print(f"\n{raw / MiB:.0f} MiB raw, {'jax' if args.jax else 'numpy'} targets, threads={args.threads}; "
          "medians, seconds:")
    for (c, s), rows in runs.items():
        shown = label.get(s, f"DECODE_THREADS={s}") if args.ab else f"DECODE_THREADS={s}"
        print(f"  compression={c}, {shown}: {_line(rows)}")
    base = {c: med(r["total"] for r in runs[(c, cases[0][1])]) for c in paths}
    for (c, s), rows in runs.items():
        print(f"  compression={c}, {s}: total / first setting's {med(r['total'] for r in rows) / base[c]:.2f}; "
              f"/ raw first setting's {med(r['total'] for r in rows) / base[next(iter(paths))]:.2f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw_bytes": raw, "cores": os.cpu_count(),
                       "runs": {f"{c}|{s}": rows for (c, s), rows in runs.items()}}, f, indent=1)
    del np
    return 0


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    return [tree]


if __name__ == "__main__":
    raise SystemExit(main())
