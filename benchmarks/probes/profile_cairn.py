"""Profile one cairn operation on the benchmark state, to find where the time goes.

    python -m benchmarks.probe profile_cairn --op reshard --size-gib 0.25
    py-spy record -f raw -o prof.txt -- python -m benchmarks.probe profile_cairn --op load
    python -m benchmarks.probe profile_cairn --summarize prof.txt   # hottest functions, self and total

Ops: save, async (blocking phase only), load, reshard. The state is built
and (for loads) saved before the profiled section; only that section is
printed with its time, so a sampling profiler's output is dominated by it.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time


def summarize(path: str, focus: str = "", top: int = 25) -> None:
    """Read py-spy's raw (collapsed stack) output: hottest functions by self and total samples.

    With `focus`, only stacks with a frame containing that text count (e.g.
    "load (cairn/_api.py"); samples of the profiled call's worker threads
    are kept too, since they run inside cairn's thread pools.
    """
    self_c: collections.Counter[str] = collections.Counter()
    total_c: collections.Counter[str] = collections.Counter()
    n = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            k = int(count)
            frames = stack.split(";")
            if focus and not any(focus in fr or ("cairn/" in fr and "_worker" not in fr) for fr in frames):
                continue
            n += k
            self_c[frames[-1]] += k
            for fr in set(frames):
                total_c[fr] += k
    print(f"{n} samples")
    for title, c in (("self", self_c), ("total (inclusive)", total_c)):
        print(f"\n--- {title}")
        for fr, k in c.most_common(top):
            print(f"{100 * k / n:5.1f}%  {fr}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", choices=["save", "async", "load", "reshard"], default="load")
    ap.add_argument("--size-gib", type=float, default=0.25)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before a load")
    ap.add_argument("--summarize", metavar="PY_SPY_RAW")
    ap.add_argument("--focus", default="cairn/", help="with --summarize: count only stacks through this frame")
    a = ap.parse_args(argv)
    if a.summarize:
        summarize(a.summarize, a.focus)
        return 0
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import cairn
    from benchmarks import measure as ms
    from benchmarks import state as st

    dtype = st.np_dtype(a.dtype)
    spec = st.llama_spec(int(a.size_gib * 2**30), dtype.itemsize)
    state, _ = st.build_jax(spec, dtype)
    root = tempfile.mkdtemp(prefix="cairn-prof-", dir=os.environ.get("CAIRN_BENCH_DIR"))
    path = os.path.join(root, "ckpt")
    try:
        if a.op in ("load", "reshard"):
            cairn.save(path, state)
            del state
            target = st.abstract_jax(spec, dtype, resharded=a.op == "reshard")
            if a.cold:
                ms.drop_caches()
            t0 = time.perf_counter()
            out = jax.block_until_ready(cairn.load(path, target))
            print(f"{a.op}: {time.perf_counter() - t0:.3f}s", file=sys.stderr)
            del out
        elif a.op == "save":
            os.sync()
            t0 = time.perf_counter()
            cairn.save(path, state)
            print(f"save: {time.perf_counter() - t0:.3f}s", file=sys.stderr)
        else:
            t0 = time.perf_counter()
            f = cairn.save_async(path, state)
            print(f"async return: {time.perf_counter() - t0:.3f}s", file=sys.stderr)
            f.result()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
