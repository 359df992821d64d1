"""Coding small leaves: ``python -m benchmarks.small_leaf_coding [--saves]``.

Without ``--saves``: 300 leaves of 256x256 cut from a 64 MB bf16-f32 trained state, coded on one
thread in batches of 16 MiB (`codecs.encode_runs`, as a save does) with `codecs.PLANE_PROBE_MIN_BYTES`
at 256 and 512 KiB, alternating; thread CPU time, best of 3, GiB/s of raw bytes, and the ratio.

With ``--saves``: 2,449 such leaves (from a 600 MB state) saved compressed (True) as 2,449
checkpointables and as one, with `codecs.BLOSC2_JOIN_BYTES` off and at 1 MiB, ``--coders`` coding
threads (`engine._cores`; 13 is the TPU host's count), ``--reps`` times. Per save: the coding tasks'
wall seconds summed over threads, their thread CPU, the pages they faulted in (minor faults,
``RUSAGE_THREAD``) and how many of those python-blosc2's `compress2` took (its copy of each chunk,
made holding the GIL): docs/compression.md, "Small leaves in one checkpointable".
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import threading
import time
import types
from typing import Any

from benchmarks.codec_threads import batches, tiles
from benchmarks.trained_state import flatten, make_state
from cairn._format import codecs as C


def saves(coders: int, reps: int) -> None:
    """The ``--saves`` probe (see the module's docstring)."""
    import cairn
    from benchmarks.small_leaves import tiles as cut
    from cairn._save import engine

    engine._cores = lambda: coders  # type: ignore[assignment]
    leaves = cut(flatten(make_state(600_000_000, "bf16-f32")), 2449)
    lock = threading.Lock()
    acc: dict[str, float] = {}

    def add(k: str, v: float) -> None:
        with lock:
            acc[k] = acc.get(k, 0) + v

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    b2 = C._blosc2()
    real = b2.compress2

    def compress2(src: Any, **kw: Any) -> Any:
        f0 = faults()
        try:
            return real(src, **kw)
        finally:
            add("c2_faults", faults() - f0)

    counted = types.SimpleNamespace(**{k: getattr(b2, k) for k in dir(b2) if not k.startswith("__")})
    counted.compress2 = compress2
    C._blosc2_module = counted
    code_task = engine._code_task

    def timed(task: Any, *args: Any) -> Any:
        f0, c0, t0 = faults(), time.thread_time(), time.perf_counter()
        try:
            return code_task(task, *args)
        finally:
            add("wall", time.perf_counter() - t0)
            add("cpu", time.thread_time() - c0)
            add("faults", faults() - f0)
    engine._code_task = timed  # type: ignore[assignment]
    page = os.sysconf("SC_PAGE_SIZE") / 2**20
    root = tempfile.mkdtemp(prefix="cairn-slc-")
    print(f"{len(leaves)} leaves, {coders} coders, load average {os.getloadavg()[0]:.1f}", flush=True)
    try:
        for _ in range(reps):
            for join in (0, 1 << 20):
                for layout in ("items", "nested"):
                    C.BLOSC2_JOIN_BYTES = join
                    state = {"params": leaves} if layout == "nested" else leaves
                    acc.clear()
                    path = os.path.join(root, layout)
                    shutil.rmtree(path, ignore_errors=True)
                    t = time.perf_counter()
                    cairn.save(path, state, compression=True)
                    t = time.perf_counter() - t
                    print(f"join {join >> 10:4d} KiB, {layout:6s}: save {t:.2f} s; coding {acc['wall']:.2f} s summed, "
                          f"{acc['cpu']:.2f} s CPU, {acc['faults'] * page:.0f} MiB faulted in "
                          f"({acc['c2_faults'] * page:.0f} MiB inside compress2)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--saves", action="store_true", help="the save probe (see the module's docstring)")
    ap.add_argument("--coders", type=int, default=13)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    if args.saves:
        saves(args.coders, args.reps)
        return
    flat = flatten(make_state(64_000_000, "bf16-f32"))
    small = [(t, C.choose(t.dtype, C.sample(t))) for t in tiles(flat, 300)]
    tasks = batches(small, 16 << 20)
    raw = sum(a.nbytes for a, _ in small)
    keep = C.PLANE_PROBE_MIN_BYTES
    try:
        for threshold in (256 << 10, 512 << 10, 256 << 10, 512 << 10):
            C.PLANE_PROBE_MIN_BYTES = threshold
            best = float("inf")
            for _ in range(3):
                t = time.thread_time()
                out = [C.encode_runs(b) for b in tasks]
                best = min(best, time.thread_time() - t)
            stored = sum(len(x) for o in out for r in o for x in r)
            print(f"{threshold >> 10} KiB: {raw / best / 2**30:.3f} GiB/s (thread CPU), ratio {raw / stored:.4f}")
    finally:
        C.PLANE_PROBE_MIN_BYTES = keep


if __name__ == "__main__":
    main()
