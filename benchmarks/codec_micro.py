"""Where a many-core host's coding ceiling is: ``python -m benchmarks.codec_micro`` (writes micro.json to $OUT or .).

On the large leaves (>= 4 MiB) of a 256 MB bf16-f32 trained state, on 1, 4, 8 and 12 threads
(wall time, best of 3, GiB/s): zstd on the exponent-carrying planes by one C-threaded call
(`multi_compress_to_buffer(threads=n)`, `multi_decompress_to_buffer`) against a Python pool of n
threads (per plane, or 16 planes per call); and, on 16 MiB runs, the numpy plane split, a bytes
join, the entropy probe and the whole `encode_run`. The TPU host's figures are
benchmarks/results/tpu-v5e-host-codec-micro.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from benchmarks.trained_state import flatten, make_state
from cairn._format import codecs as C

GiB = float(1 << 30)


def best(fn: Callable[[], Any], reps: int = 3) -> float:
    fn()
    b = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        b = min(b, time.perf_counter() - t)
    return b


def row(threads: int, big: list[np.ndarray], planes: list[np.ndarray], frames: Any) -> dict[str, Any]:
    raw = sum(a.nbytes for a in big)
    pbytes = sum(x.nbytes for x in planes)
    cp = C._compressor("planes")
    r: dict[str, Any] = {"threads": threads}
    r["one_call_compress_planes"] = pbytes / best(lambda: cp.multi_compress_to_buffer(planes, threads=threads)) / GiB
    r["one_call_decompress_planes"] = pbytes / best(
        lambda: C._decompressor(1 << 20).multi_decompress_to_buffer(frames, threads=threads)) / GiB
    groups = [planes[i:i + 16] for i in range(0, len(planes), 16)]
    runs = []
    for a in big:
        u8 = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        runs += [(u8[o:o + (16 << 20)], a.dtype.itemsize) for o in range(0, u8.nbytes, 16 << 20)]
    with ThreadPoolExecutor(threads) as pool:
        def over(items: list[Any], fn: Callable[[Any], Any]) -> float:
            return best(lambda: list(pool.map(fn, items)))

        r["pool_compress_per_plane"] = pbytes / over(planes, lambda x: C._compressor("planes").compress(x)) / GiB
        r["pool_multi16"] = pbytes / over(
            groups, lambda g: C._compressor("planes").multi_compress_to_buffer(g, threads=1)) / GiB
        r["pool_split16MiB"] = raw / over(runs, lambda x: C._split(x[0], x[1], scratch=True)) / GiB
        r["pool_join16MiB"] = raw / over(runs, lambda x: len(b"".join([x[0][:len(x[0]) // 2],
                                                                     x[0][len(x[0]) // 2:]]))) / GiB
        r["pool_probe16MiB"] = raw / over(runs, lambda x: C._planes_to_try(x[0], x[1], (1 << 20) // x[1])) / GiB
        r["pool_encode_run16"] = raw / over(
            runs, lambda x: C.encode_run("planes", x[0], 1 << 20, np.dtype(f"u{x[1]}"))) / GiB
    return r


def main() -> None:
    out: dict[str, Any] = {}
    try:
        out["lscpu"] = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError as e:
        out["lscpu"] = str(e)
    flat = flatten(make_state(256_000_000, "bf16-f32"))
    big = [a for a in flat.values() if a.nbytes >= 4 << 20]
    planes = []  # the exponent-carrying (top) plane of every 1 MiB block
    for a in big:
        k = a.dtype.itemsize
        p = C._split(np.ascontiguousarray(a).reshape(-1).view(np.uint8), k)
        n = (1 << 20) // k
        planes += [np.ascontiguousarray(p[k - 1, o:o + n]) for o in range(0, p.shape[1], n)]
    frames = C._compressor("planes").multi_compress_to_buffer(planes, threads=1)
    rows = []
    for threads in (1, 4, 8, 12):
        r = row(threads, big, planes, frames)
        rows.append(r)
        print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)
    out["rows"] = rows
    with open(os.path.join(os.environ.get("OUT", "."), "micro.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
