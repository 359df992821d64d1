"""Coding small leaves on one thread, probe threshold 256 vs 512 KiB: ``python -m benchmarks.small_leaf_coding``.

300 leaves of 256x256 cut from a 64 MB bf16-f32 trained state, coded in batches of 16 MiB
(`codecs.encode_runs`, as a save does) with `codecs.PLANE_PROBE_MIN_BYTES` at 256 and 512 KiB,
alternating; thread CPU time, best of 3, GiB/s of raw bytes, and the ratio.
"""

from __future__ import annotations

import time

from benchmarks.codec_threads import batches, tiles
from benchmarks.trained_state import flatten, make_state
from cairn._format import codecs as C


def main() -> None:
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
