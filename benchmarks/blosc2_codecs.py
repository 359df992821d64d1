"""C-Blosc2's compressors and filters side by side on a trained state's 1 MiB blocks:
``python -m benchmarks.blosc2_codecs [--mib 256] [--threads 1,12] [--only NAME,...]``.

Ratio and encode / decode GiB/s of raw bytes (wall time, best of 3) for each setting, every one
split by bytes as cairn's "blosc2" (zstd level 1, byte shuffle), which is among them, on 1..N
threads at once (a pool of n threads, one block per call, python-blosc2's `compress2` /
`decompress2` into a per-thread buffer; with `--direct`, cairn's own ctypes path for the settings
cairn writes). For choosing a codec that decodes faster than zstd (docs/compression.md, "Load
buffers lent": the compressed load on the TPU host is decode-bound); needs python-blosc2.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import blosc2
import numpy as np

from benchmarks.trained_state import flatten, make_state

SETTINGS = {
    "zstd1-shuffle": (blosc2.Codec.ZSTD, 1, blosc2.Filter.SHUFFLE),  # cairn's "blosc2"
    "zstd1-bitshuffle": (blosc2.Codec.ZSTD, 1, blosc2.Filter.BITSHUFFLE),
    "lz4-bitshuffle": (blosc2.Codec.LZ4, 5, blosc2.Filter.BITSHUFFLE),
    "lz4-1-bitshuffle": (blosc2.Codec.LZ4, 1, blosc2.Filter.BITSHUFFLE),
    "lz4-9-bitshuffle": (blosc2.Codec.LZ4, 9, blosc2.Filter.BITSHUFFLE),
    "lz4-shuffle": (blosc2.Codec.LZ4, 5, blosc2.Filter.SHUFFLE),
    "lz4hc1-bitshuffle": (blosc2.Codec.LZ4HC, 1, blosc2.Filter.BITSHUFFLE),
    "blosclz-shuffle": (blosc2.Codec.BLOSCLZ, 5, blosc2.Filter.SHUFFLE),
    "blosclz-bitshuffle": (blosc2.Codec.BLOSCLZ, 5, blosc2.Filter.BITSHUFFLE),
}
SPLITS = {"always": blosc2.SplitMode.ALWAYS_SPLIT, "never": blosc2.SplitMode.NEVER_SPLIT,
          "auto": blosc2.SplitMode.AUTO_SPLIT}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="raw size of the trained state (MiB)")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts")
    ap.add_argument("--only", default="", help="comma-separated setting names (default: all)")
    ap.add_argument("--splits", default="always", help="comma-separated: always, never, auto")
    args = ap.parse_args()
    st = make_state(args.mib << 20, "bf16-f32")
    blocks = []
    for a in flatten(st).values():
        if a.nbytes < 1 << 20:
            continue
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        for o in range(0, raw.nbytes, 1 << 20):
            blocks.append((raw[o:o + (1 << 20)], a.dtype.itemsize))
    total = sum(b.nbytes for b, _ in blocks)
    names = [n for n in args.only.split(",") if n] or list(SETTINGS)
    threads = [int(t) for t in args.threads.split(",")]
    print(f"{total / 2**20:.0f} MiB of 1 MiB blocks, {len(blocks)} blocks; {os.cpu_count()} cores; "
          f"python-blosc2 {blosc2.__version__}, C-Blosc2 {blosc2.blosclib_version}", flush=True)
    local = threading.local()
    for split in args.splits.split(","):
        for name in names:
            codec, clevel, filt = SETTINGS[name]

            def enc(i: int, codec=codec, clevel=clevel, filt=filt, split=split) -> bytes:
                b, k = blocks[i]
                return blosc2.compress2(b, typesize=k, codec=codec, clevel=clevel, filters=[filt],
                                        splitmode=SPLITS[split], nthreads=1)

            cs = [enc(i) for i in range(len(blocks))]
            ratio = total / sum(len(c) for c in cs)
            per_k = {}
            for (b, k), c in zip(blocks, cs):
                raw_k, st_k = per_k.get(k, (0, 0))
                per_k[k] = (raw_k + b.nbytes, st_k + len(c))
            ks = " ".join(f"{8 * k}-bit {r / s:.3f}" for k, (r, s) in sorted(per_k.items()))

            def dec(i: int, cs=cs) -> None:
                out = getattr(local, "out", None)
                if out is None:
                    out = local.out = np.empty(1 << 20, np.uint8)
                blosc2.decompress2(cs[i], dst=out[: blocks[i][0].nbytes], nthreads=1)

            row = []
            for n in threads:
                with ThreadPoolExecutor(n) as pool:
                    figures = []
                    for fn in (enc, dec):
                        list(pool.map(fn, range(min(n * 2, len(blocks)))))  # warm the threads
                        best = float("inf")
                        for _ in range(3):
                            t = time.perf_counter()
                            list(pool.map(fn, range(len(blocks))))
                            best = min(best, time.perf_counter() - t)
                        figures.append(total / best / 2**30)
                row.append(f"{n:>2} thr: enc {figures[0]:5.2f} dec {figures[1]:5.2f}")
            print(f"{name:19} split={split:6} ratio {ratio:.3f} ({ks})  " + "  ".join(row) + "  GiB/s", flush=True)


if __name__ == "__main__":
    main()
