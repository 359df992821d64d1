"""The host's memory system on n threads: ``python -m benchmarks.mem_copy [--threads 1,2,4,8,12]``.

GiB/s of `np.copyto` between 16 MiB buffers already mapped (a copy: read and write) and of an XOR
reduction over them (a read), 96 tasks on a pool of n threads, best of 3: what decoding's and reading's
speeds on many threads compare against (docs/compression.md, "LZ4 with the bit shuffle").
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

N = 16 << 20
TASKS = 96
BUFFERS = 24


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2,4,8,12")
    args = ap.parse_args()
    src = [np.ones(N, np.uint8) for _ in range(BUFFERS)]
    dst = [np.zeros(N, np.uint8) for _ in range(BUFFERS)]

    def copy(i: int) -> None:
        np.copyto(dst[i % BUFFERS], src[i % BUFFERS])

    def read(i: int) -> None:
        np.bitwise_xor.reduce(src[i % BUFFERS].view(np.uint64))

    for n in (int(t) for t in args.threads.split(",")):
        with ThreadPoolExecutor(n) as pool:
            for name, fn in (("copy", copy), ("read", read)):
                list(pool.map(fn, range(n)))
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    list(pool.map(fn, range(TASKS)))
                    best = min(best, time.perf_counter() - t)
                print(f"{n:2} threads {name}: {TASKS * N / best / 2**30:.1f} GiB/s", flush=True)


if __name__ == "__main__":
    main()
