"""Ways of coding on many threads, side by side: ``python -m benchmarks.codec_threads``.

The bf16-f32 trained state of `benchmarks.trained_state` (1 MiB blocks, each leaf's codec from
`codecs.choose`) is encoded and decoded on 1..N threads at once (wall time, best of 3, GiB/s of
raw bytes), by each candidate:

- ``old``: `--against FILE`'s codecs (the previous version): `encode_run` of 4 blocks per task,
  `decode` per block (as a save and a load called them).
- ``run4`` / ``run16``: this tree's `encode_run` (the run's planes split by one numpy pass per plane,
  every plane compressed by one `multi_compress_to_buffer` call) of 4 / 16 blocks per task, on a
  pool of n threads; ``inner``: runs of 16 on ceil(n/4) pool threads, each call coding on
  min(n, 4) zstd threads of its own.
- decoding: ``block`` (this tree's `decode` per block), ``run16`` (`decode_run` of 16 blocks per
  task: one `multi_decompress_to_buffer` per run), ``inner`` (as for encoding); ``run16_old``: the
  `--against` file's `decode_run`, where it has one.
- ``zstd1``: plain zstd level 1 of each block (`encode_run("zstd")`, runs of 16), the native
  reference.
- small leaves: the state's matrices cut into 256x256 leaves (as the issue's 2,449-leaf case),
  coded one leaf per task (``old``, ``leaf``) or in batches of leaves up to 16 MiB per task
  (`encode_runs`, ``batch``).
- ``copy``: one 16 MiB `np.copyto` per task, the memory system's reference.

Options: ``--size BYTES`` (default 512 MB), ``--threads 1,4,8,12``, ``--against FILE``, ``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zstandard

from benchmarks.codecs import load_codecs
from benchmarks.measure import write_rows
from benchmarks.trained_state import flatten, make_state
from cairn._format import codecs as C

BLOCK = 1 << 20
GiB = float(1 << 30)


def _best(pool: ThreadPoolExecutor, fn: Callable[[Any], Any], tasks: list[Any], reps: int = 3) -> float:
    list(pool.map(fn, tasks[: pool._max_workers]))  # warm: threads, per-thread buffers
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        list(pool.map(fn, tasks))
        best = min(best, time.perf_counter() - t)
    return best


def runs_of(leaves: list[tuple[np.ndarray, str]], blocks: int) -> list[tuple[Any, ...]]:
    out = []
    for a, codec in leaves:
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        block = BLOCK - BLOCK % a.dtype.itemsize
        out += [(codec, raw[o:o + blocks * block], block, a.dtype) for o in range(0, raw.nbytes, blocks * block)]
    return out


def tiles(flat: dict[str, np.ndarray], count: int) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for a in flat.values():
        if a.ndim != 2:
            continue
        for i in range(0, a.shape[0] - 255, 256):
            for j in range(0, a.shape[1] - 255, 256):
                out.append(np.ascontiguousarray(a[i:i + 256, j:j + 256]))
                if len(out) >= count:
                    return out
    return out


def batches(leaves: list[tuple[np.ndarray, str]], limit: int) -> list[list[tuple[Any, ...]]]:
    out: list[list[tuple[Any, ...]]] = [[]]
    size = 0
    for a, codec in leaves:
        raw = a.reshape(-1).view(np.uint8)
        if size + raw.nbytes > limit and out[-1]:
            out.append([])
            size = 0
        out[-1].append((codec, raw, BLOCK - BLOCK % a.dtype.itemsize, a.dtype))
        size += raw.nbytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=512_000_000)
    ap.add_argument("--threads", default="1,4,8,12")
    ap.add_argument("--against", help="the previous codecs.py (git show REV:src/cairn/_format/codecs.py)")
    ap.add_argument("--json")
    args = ap.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    old = load_codecs(args.against) if args.against else None
    t0 = time.perf_counter()
    flat = flatten(make_state(args.size, "bf16-f32"))
    leaves = [(a, C.choose(a.dtype, C.sample(a))) for a in flat.values() if a.nbytes]
    raw = sum(a.nbytes for a, _ in leaves)
    small = [(t, C.choose(t.dtype, C.sample(t))) for t in tiles(flat, 2449)]
    small_raw = sum(a.nbytes for a, _ in small)
    info = {"cores": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "numpy": np.__version__, "zstandard": zstandard.__version__, "raw_bytes": raw,
            "small_leaves": len(small), "small_raw_bytes": small_raw, "build_s": time.perf_counter() - t0,
            "load_before": os.getloadavg()}
    print(json.dumps(info), flush=True)
    runs4, runs16 = runs_of(leaves, 4), runs_of(leaves, 16)
    stored = {id(r): C.encode_run(*r) for r in runs16}
    sizes = {id(r): [min(r[2], r[1].nbytes - o) for o in range(0, r[1].nbytes, r[2])] for r in runs16}
    stored_bytes = sum(len(b) for v in stored.values() for b in v)
    blocks = [(r[0], s, r[3], n, r[1][i * r[2]: i * r[2] + n])
              for r in runs16 for i, (s, n) in enumerate(zip(stored[id(r)], sizes[id(r)]))]
    outs = {id(r): np.empty(r[1].nbytes, np.uint8) for r in runs16}
    zruns = [("zstd", *r[1:]) for r in runs16]
    zraw = sum(r[1].nbytes for r in zruns)
    small_stored = [C.encode_run(c, a.reshape(-1).view(np.uint8), BLOCK, a.dtype) for a, c in small]
    small_batches = batches(small, 16 << 20)
    copy_src = np.ones(16 << 20, np.uint8)
    print(f"ratio {raw / stored_bytes:.3f} ({raw / 2**20:.0f} MiB, {len(leaves)} leaves); small leaves "
          f"{len(small)}, {small_raw / 2**20:.0f} MiB", flush=True)
    rows = []
    for n in counts:
        row: dict[str, Any] = {"threads": n}
        inner = min(n, 4)
        with ThreadPoolExecutor(n) as pool, ThreadPoolExecutor(-(-n // 4)) as few:
            if old is not None:
                row["enc_old"] = raw / _best(pool, lambda r: old.encode_run(r[0], r[1], r[2], r[3]), runs4) / GiB
                row["dec_old"] = raw / _best(pool, lambda b: old.decode(b[0], b[1], b[2], b[3]), blocks) / GiB
                if hasattr(old, "decode_run"):
                    row["dec_run16_old"] = raw / _best(pool, lambda r: old.decode_run(
                        r[0], stored[id(r)], r[3], sizes[id(r)], outs[id(r)]), runs16) / GiB
                row["small_enc_old"] = small_raw / _best(
                    pool, lambda x: old.encode_run(x[1], x[0].reshape(-1).view(np.uint8), BLOCK, x[0].dtype),
                    small) / GiB
            row["enc_run4"] = raw / _best(pool, lambda r: C.encode_run(*r), runs4) / GiB
            row["enc_run16"] = raw / _best(pool, lambda r: C.encode_run(*r), runs16) / GiB
            row["enc_inner"] = raw / _best(few, lambda r, t=inner: C.encode_run(*r, threads=t), runs16) / GiB
            row["zstd1_enc"] = zraw / _best(pool, lambda r: C.encode_run(*r), zruns) / GiB
            row["dec_block"] = raw / _best(pool, lambda b: C.decode(b[0], b[1], b[2], b[3]), blocks) / GiB
            row["dec_run16"] = raw / _best(pool, lambda r, t=inner: C.decode_run(r[0], stored[id(r)], r[3], sizes[id(r)],
                                                                        outs[id(r)]), runs16) / GiB
            row["dec_inner"] = raw / _best(few, lambda r, t=inner: C.decode_run(r[0], stored[id(r)], r[3], sizes[id(r)],
                                                                       outs[id(r)], threads=t), runs16) / GiB
            row["small_enc_leaf"] = small_raw / _best(
                pool, lambda x: C.encode_run(x[1], x[0].reshape(-1).view(np.uint8), BLOCK, x[0].dtype), small) / GiB
            row["small_enc_batch"] = small_raw / _best(pool, C.encode_runs, small_batches) / GiB
            row["small_dec_block"] = small_raw / _best(
                pool, lambda i: C.decode(small[i][1], small_stored[i][0], small[i][0].dtype, small[i][0].nbytes),
                list(range(len(small)))) / GiB
            row["copy"] = 64 * copy_src.nbytes / _best(
                pool, lambda _: np.copyto(np.empty_like(copy_src), copy_src), list(range(64))) / GiB
        rows.append(row)
        print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    for r in runs16:  # the last decode is right
        assert np.array_equal(outs[id(r)], r[1])
    info["ratio"] = raw / stored_bytes
    write_rows(args.json, info, rows)


if __name__ == "__main__":
    main()
