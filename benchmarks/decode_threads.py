"""Which part of decoding scales over threads: ``python -m benchmarks.decode_threads [SIZE] [THREADS]``.

Codes the bf16-f32 trained state (`benchmarks.trained_state`, SIZE bytes, default
128 MB) in 1 MiB "planes" blocks, then times, on 1, 2, 4, 8 and 12 threads at once
(wall time, best of 3, about 1 GiB of blocks per pass, GiB/s of raw bytes):

- ``decode (cairn)``: `codecs.decode` of each block into a preallocated buffer;
- ``decode tiled``: the same with the planes merged in 64 Ki-element tiles
  (fewer bytes through memory per pass, more numpy calls);
- ``merge`` / ``merge tiled``: only the interleaving of decoded planes;
- ``copyto 1MiB``: one 1 MiB copy per block, the memory system's own scaling.

On the TPU v5e machine's 13-core host (`benchmarks/results/tpu-v5e-host-decode-threads.log`)
it showed where decoding stops scaling: see docs/compression.md.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks.trained_state import flatten, make_state
from cairn._format import codecs as C

TILE = 1 << 16


def merge_tiled(planes: list[np.ndarray], dst: np.ndarray, k: int) -> None:
    n = dst.nbytes // k
    w = dst.view(f"<u{k}")
    for s in range(0, n, TILE):
        ww = w[s:s + TILE]
        np.copyto(ww, planes[k - 1][s:s + TILE], casting="unsafe")
        for p in range(k - 2, -1, -1):
            ww <<= 8
            ww |= planes[p][s:s + TILE]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    size = int(argv[0]) if argv else 128_000_000
    counts = [int(x) for x in (argv[1] if len(argv) > 1 else "1,2,4,8,12").split(",")]
    blocks = []
    for a in flatten(make_state(size, "bf16-f32")).values():
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        for o in range(0, raw.nbytes - (1 << 20) + 1, 1 << 20):
            blocks.append((raw[o:o + (1 << 20)], a.dtype))
    stored = [C.encode("planes", b, dt) for b, dt in blocks]
    outs = [np.ones(b.nbytes, np.uint8) for b, _ in blocks]
    planes = [C._split(b, dt.itemsize).copy() for b, dt in blocks]
    tot = sum(b.nbytes for b, _ in blocks)
    nb = len(blocks)
    reps = max(1, (1 << 30) // tot)
    print(f"{os.cpu_count()} cores; {nb} blocks x {reps} per pass", flush=True)

    def decode_tiled(i: int) -> None:
        b, dt = blocks[i]
        s = memoryview(stored[i])
        k, n = dt.itemsize, b.nbytes // dt.itemsize
        layout = C._planes_layout(s, b.nbytes, k, "")
        scratch = C._scratch(n * sum(c for _, _, c in layout))
        pl, used = [], 0
        for pos, ln, coded in layout:
            if coded:
                p = scratch[used:used + n]
                C._unzstd(s[pos:pos + ln], p, n, "", "planes")
                used += n
            else:
                p = np.frombuffer(s, np.uint8, n, pos)
            pl.append(p)
        merge_tiled(pl, outs[i], k)

    ops = {
        "decode (cairn)": lambda i: C.decode("planes", stored[i % nb], blocks[i % nb][1], blocks[i % nb][0].nbytes,
                                             out=outs[i % nb]),
        "decode tiled": lambda i: decode_tiled(i % nb),
        "merge": lambda i: C._merge(list(planes[i % nb]), outs[i % nb], blocks[i % nb][1].itemsize),
        "merge tiled": lambda i: merge_tiled(list(planes[i % nb]), outs[i % nb], blocks[i % nb][1].itemsize),
        "copyto 1MiB": lambda i: np.copyto(outs[i % nb], blocks[i % nb][0]),
    }
    for name, f in ops.items():
        res = []
        for n in counts:
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(f, range(n)))
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    list(pool.map(f, range(nb * reps), chunksize=4))
                    best = min(best, time.perf_counter() - t)
            res.append(tot * reps / best / 2**30)
        print(f"{name:16}: " + "  ".join(f"{n}t {r:.2f} ({r / res[0]:.1f}x)" for n, r in zip(counts, res))
              + " GiB/s", flush=True)
    for i in range(nb):
        decode_tiled(i)
        assert np.array_equal(outs[i], blocks[i][0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
