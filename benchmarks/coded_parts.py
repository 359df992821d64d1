"""Compressed loads of an incremental checkpoint, its blocks decoded as fetched (issue 38, dec38).

    python -m benchmarks.coded_parts --mib 256 --storages memory,moto --ab /work/main/src
    python -m benchmarks.coded_parts --mib 2048 --storages memory --threads 12 --settings old,1,4,16

An incremental checkpoint (format version 4) keeps a leaf's blocks where they lie: its own changed blocks,
references to its base's. A load reads them with `blocks.read_blocks`, which fetches the stored blocks
(own and referred to, back to back in a file as one request) and decodes the coded ones. This saves
the trained state of `benchmarks.trained_state` (bf16 parameters, f32 AdamW moments) three times with
the codec named (``--codecs``, each forced: ``compression="planes"`` / ``"blosc2"``): step 0 plain,
step 1 against it (every block written, with hashes), step 2 against step 1 with changed parameters
(step 0's rolled by one row: coded as themselves, not as deltas) and the same moments (the moments' blocks references into
step 1's files, the parameters' own), and times
numpy loads of step 2 (``cairn.load(path, threads=)``): wall seconds, this process's CPU seconds, the
CPU seconds of the decoding calls (`codecs.decode` and `decode_run`, wrapped: each thread's own CPU time
of its outermost call) and their number, and the raw bytes over the wall time. A check that the loaded values are step 2's runs first.

Each tree (this one; with ``--ab SRC`` also the tree at SRC, e.g. ``/work/main/src``) gets a worker
process of its own, kept warm; loads alternate between workers (and settings) repetition by
repetition, every other repetition in reverse order. ``memory://`` is the in-process object store: each
worker saves its own copy there. ``moto`` is moto's S3 server on 127.0.0.1 (as `benchmarks.bench_objstore`
starts it): the first worker saves, every worker loads the same objects.

``--settings`` compares, in each worker, values of the piece a run of blocks is decoded in
(`blocks.RUN_PIECE`, MiB): ``old`` is the per-block decoding of before (pieces of one block, no decode
pool: `decodepool.DECODE_THREADS` 0), ``1``, ``4`` (the default), ``16``...; ``R:D`` also sets the piece of a
plain compressed read (`decodepool.DECODE_PIECE`, MiB; default 4), which ``--steps 0,2`` measures on step 0,
the same state saved plain (format 3 or 5: `reader.CodedRead`'s pieces, not `read_blocks`'). A tree
without `RUN_PIECE` (main before issue 38's change) runs only its own default (setting ``-``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
MiB = 1 << 20


def _worker() -> int:
    import numpy as np

    import cairn
    from benchmarks.trained_state import make_state, raw_bytes

    state: dict[str, Any] = {}
    decoding = _time_decoding()

    def apply(setting: str) -> None:
        from cairn._load import blocks

        try:  # the decode pool's settings (in `reader` before they had a module of their own)
            from cairn._load import decodepool as reader
        except ImportError:
            from cairn._load import reader  # type: ignore[no-redef]

        if setting == "-":
            return
        if not hasattr(blocks, "RUN_PIECE"):
            raise RuntimeError("this tree has no blocks.RUN_PIECE: run it with setting '-' only")
        state.setdefault("defaults", (blocks.RUN_PIECE, reader.DECODE_THREADS, reader.DECODE_PIECE))
        _, threads, piece = state["defaults"]
        if setting == "old":
            blocks.RUN_PIECE, reader.DECODE_THREADS, reader.DECODE_PIECE = 1, 0, piece
        else:
            run, _, plain = setting.partition(":")
            blocks.RUN_PIECE, reader.DECODE_THREADS = int(float(run) * MiB), threads
            reader.DECODE_PIECE = int(float(plain) * MiB) if plain else piece

    def states(mib: int) -> tuple[Any, Any]:
        """Steps 0 and 2, built once per process: step 2's parameters are step 0's rolled by one row (every
        block changed, the values alike; an XOR with the base's block stores about half, so no deltas)."""
        if state.get("mib") != mib:
            s0 = make_state(mib * MiB)

            def flipped(tree: Any) -> Any:
                if isinstance(tree, dict):
                    return {k: flipped(v) for k, v in tree.items()}
                return np.roll(tree, 1, axis=0) if tree.ndim else tree

            state.update(mib=mib, s0=s0, s2={"params": flipped(s0["params"]), "opt_state": s0["opt_state"]})
        return state["s0"], state["s2"]

    def save(job: dict[str, Any]) -> None:
        from cairn._save import incremental

        # No deltas: the parameters' changed blocks coded as themselves (what this measures), and an S3 save
        # that tries a delta for a small chunk reads its base inside obstore's put, which panics ("Cannot
        # start a runtime from within a runtime", 2026-12-06: dec38's report).
        incremental.DELTA_MIN = 1 << 62
        s0, s2 = states(job["mib"])
        root, opts, codec = job["root"], job.get("opts"), job["codec"]
        cairn.save(f"{root}/s0", s0, storage_options=opts, compression=codec)
        cairn.save(f"{root}/s1", s0, base=f"{root}/s0", storage_options=opts, compression=codec)
        cairn.save(f"{root}/s2", s2, base=f"{root}/s1", storage_options=opts, compression=codec)

    def check(job: dict[str, Any]) -> bool:
        from benchmarks.trained_state import flatten

        want = flatten(states(job["mib"])[1])
        got = flatten(cairn.load(f"{job['root']}/s2", storage_options=job.get("opts")))
        state[job["root"]] = raw_bytes(want)
        return got.keys() == want.keys() and all(
            np.asarray(got[k]).tobytes() == want[k].tobytes() for k in want)

    def load(job: dict[str, Any]) -> list[float]:
        apply(job["setting"])
        decoding[:] = [0.0, 0]
        t0, c0 = time.perf_counter(), time.process_time()
        kept = cairn.load(f"{job['root']}/s{job['step']}", storage_options=job.get("opts"), threads=job["threads"])
        out = [time.perf_counter() - t0, time.process_time() - c0, state[job["root"]], *decoding]
        del kept
        gc.collect()
        return out

    from benchmarks.measure import serve

    ops = {"save": save, "check": check, "load": load}
    return serve(lambda job: ops[job["op"]](job))


def _time_decoding() -> list[Any]:
    """Wrap `codecs.decode` and `codecs.decode_run` (the outermost call of a thread only): the list returned
    holds the CPU seconds of those calls (each thread's own, `time.thread_time`) and their number."""
    import threading

    from cairn._format import codecs

    got: list[Any] = [0.0, 0]
    lock, depth = threading.Lock(), threading.local()

    def timed(fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            if getattr(depth, "n", 0):
                return fn(*a, **k)
            depth.n = 1
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                depth.n = 0
                with lock:
                    got[0] += time.thread_time() - t0
                    got[1] += 1
        return call

    codecs.decode, codecs.decode_run = timed(codecs.decode), timed(codecs.decode_run)
    return got


def Worker(name: str, src: str) -> Any:
    """A warm worker of the tree at `src` (its sources, then this repository for `benchmarks`), on the CPU
    unless JAX_PLATFORMS says otherwise."""
    from benchmarks import measure

    return measure.Worker(name, str(HERE), [src, str(HERE.parent.parent)],
                          {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})


def _loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def run(storage: str, a: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(HERE.parent.parent))
    trees = [("this", str(HERE.parent.parent / "src"))] + ([("ab", a.ab)] if a.ab else [])
    server = None
    workers = [Worker(name, src) for name, src in trees]
    result: dict[str, Any] = {"storage": storage, "mib": a.mib, "rows": {}}
    try:
        opts = None
        if storage == "moto":
            from benchmarks.bench_objstore import start

            server = start("moto")
            bucket = server.bucket()
            opts = server.options()
        cases = []  # (worker, setting, step)
        for step in a.steps:
            for w, (name, _) in zip(workers, trees):
                settings = a.settings if name == "this" else ["-"]
                cases += [(w, s, step) for s in settings]
        for codec in a.codecs:
            roots = {}
            for w in workers:
                if storage == "memory":
                    roots[w.name] = f"memory://coded_parts/{codec}"
                    w(op="save", mib=a.mib, codec=codec, root=roots[w.name])
                else:
                    roots[w.name] = server.url(bucket, f"coded_parts/{codec}")  # type: ignore[union-attr]
                    if w is workers[0]:
                        w(op="save", mib=a.mib, codec=codec, root=roots[w.name], opts=opts)
            for w in workers:
                assert w(op="check", mib=a.mib, root=roots[w.name], opts=opts), f"{w.name} loaded wrong values"
            for w, s, step in cases:  # warm up
                w(op="load", root=roots[w.name], opts=opts, setting=s, threads=a.threads, step=step)
            rows: dict[str, list[list[float]]] = {}
            la = [_loadavg()]
            for rep in range(a.reps):
                for w, s, step in (cases if rep % 2 == 0 else cases[::-1]):
                    got = w(op="load", root=roots[w.name], opts=opts, setting=s, threads=a.threads, step=step)
                    rows.setdefault(f"{w.name} s{step} {s}", []).append(got)
            la.append(_loadavg())
            print(f"\n{storage}, {codec}: {a.mib} MiB trained state, steps {','.join(a.steps)}, numpy loads "
                  f"(threads={a.threads}), medians of {a.reps} (load average {la[0]} -> {la[1]})")
            med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v), v[0][2],
                        statistics.median(r[3] for r in v), statistics.median(r[4] for r in v))
                   for k, v in rows.items()}
            first = next(iter(med))
            for k, (wall, cpu, raw, dec, calls) in med.items():
                print(f"  {k:15s} wall {wall:7.3f} s (min {min(r[0] for r in rows[k]):.3f})  cpu {cpu:7.3f} s  "
                      f"decode cpu {dec:6.3f} s in {calls:5.0f} calls  {raw / wall / (1 << 30):5.2f} GiB/s raw   "
                      f"wall {wall / med[first][0]:.3f}x, cpu {cpu / med[first][1]:.3f}x, "
                      f"decode cpu {dec / max(med[first][3], 1e-9):.3f}x of {first!r}")
            result["rows"][codec] = {"runs": rows, "loadavg": la}
        return result
    finally:
        for w in workers:
            try:
                w.stop()
            except Exception:
                w.proc.kill()
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        sys.path.insert(0, str(HERE.parent.parent))
        return _worker()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="raw size of the state (MiB)")
    ap.add_argument("--storages", default="memory", help="comma-separated, of memory, moto")
    ap.add_argument("--codecs", default="planes,blosc2")
    ap.add_argument("--settings", default="4", help="old, or blocks.RUN_PIECE[:decodepool.DECODE_PIECE] in MiB, "
                    "in this tree")
    ap.add_argument("--steps", default="2", help="steps loaded: 2 (incremental), 0 (plain compressed)")
    ap.add_argument("--ab", default="", help="another tree's src folder, e.g. /work/main/src (its default only)")
    ap.add_argument("--threads", type=int, default=8, help="load(threads=)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    a.codecs, a.settings, a.steps = a.codecs.split(","), a.settings.split(","), a.steps.split(",")
    out = [run(s, a) for s in a.storages.split(",")]
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
