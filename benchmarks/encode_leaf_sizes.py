"""Does coding scale over threads for small and large leaves? ``python -m benchmarks.encode_leaf_sizes``.

Codes the bf16-f32 trained state (128 MB) in runs of 4 blocks (`codecs.encode_run`, as a
save does) on 1, 4 and 12 threads at once, separately for leaves under and over 4 MiB
(wall time, best of 3, about 512 MiB per pass). The TPU host's figures are in
benchmarks/results/tpu-v5e-host-encode-leaf-sizes.log.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from benchmarks.trained_state import flatten, make_state
from cairn._format import codecs as C

BLOCK = 1 << 20
THREADS = (1, 4, 12)


def runs_of(flat: dict[str, np.ndarray], keep: Callable[[int], bool]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for a in flat.values():
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        if not keep(raw.nbytes):
            continue
        codec, block = C.choose(a.dtype, C.sample(a)), BLOCK - BLOCK % a.dtype.itemsize
        out += [(raw[o:o + 4 * block], a.dtype, codec, block) for o in range(0, raw.nbytes, 4 * block)]
    return out


def code(run: tuple[Any, ...]) -> list[bytes]:
    raw, dtype, codec, block = run
    return C.encode_run(codec, raw, block, dtype)


def main() -> int:
    flat = flatten(make_state(128_000_000, "bf16-f32"))
    print(os.cpu_count(), "cores", flush=True)
    for name, keep in (("leaves >= 4 MiB", lambda n: n >= 4 << 20), ("leaves < 4 MiB", lambda n: n < 4 << 20),
                       ("all leaves", lambda n: True)):
        runs = runs_of(flat, keep)
        if not runs:
            continue
        total = sum(r[0].nbytes for r in runs)
        reps = max(1, (512 << 20) // total)
        res = []
        for n in THREADS:
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(code, runs[:n]))
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    list(pool.map(code, runs * reps))
                    best = min(best, time.perf_counter() - t)
            res.append(total * reps / best / 2**30)
        print(f"{name:16} {total / 2**20:5.0f} MiB {len(runs):4} runs: "
              + "  ".join(f"{n}t {r:.2f} ({r / res[0]:.1f}x)" for n, r in zip(THREADS, res)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
