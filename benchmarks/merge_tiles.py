"""Plane merge and split in cache-sized tiles, against one pass per buffer:
``python -m benchmarks.merge_tiles [--size BYTES] [--threads 1,2] [--tiles 0,16384,65536]``.

The leaves of at least `--min-leaf` bytes (4 MiB) of the bf16-f32 trained state of
`benchmarks.trained_state`, in 1 MiB "planes" blocks, each leaf's codec from `codecs.choose`. For each tile size (elements; 0 = one pass over the whole
buffer, the code before issue 38's tiling) and thread count, wall time of the pool, best of 3,
GiB/s of raw bytes:

- ``merge``: `codecs._merge` of each 1 MiB block's decoded planes (what a decode does after zstd);
- ``merge_stack`` (tile 0 rows): the same interleaving as one `np.stack` call per block;
- ``split``: `codecs._split` of each 16-block run (what `encode_runs` does before zstd);
- ``dec``: `codecs.decode_run` of each 16-block run (one task per run);
- ``dec_stack`` (tile 0 rows): `decode_run` with `merge_stack` patched in as its merge;
- ``enc``: `codecs.encode_run` of each 16-block run.

The tiled merge and split are this file's `merge_tiled` and `split_tiled`, patched into
`codecs` for a tile size above 0 (tile 0 runs the codecs' own); the stored bytes do not depend on
them (checked), and the decoded ones are checked after each tile size.

Measured on the TPU v5e host (`benchmarks/results/tpu-v5e-host-merge-tiles.json`): tiles made everything
slower with threads (docs/compression.md, "Tiles").
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from benchmarks.codec_threads import _best, runs_of
from benchmarks.measure import write_rows
from benchmarks.trained_state import flatten, make_state
from cairn._format import codecs as C

GiB = float(1 << 30)
_ONE_PASS = (C._merge, C._split)  # the codecs' own: one pass per plane over the whole buffer
_local = threading.local()
TILE = 0  # the tile size the patched functions use


def merge_tiled(planes: list[np.ndarray], dst: np.ndarray, k: int) -> None:
    """`codecs._merge` (shift each plane into place as it is widened, or it into the words) over
    tiles of TILE elements, so that a tile's words and the middle planes' buffer stay in cache."""
    if k not in (2, 4, 8):
        return _ONE_PASS[0](planes, dst, k)
    wide = np.dtype(f"<u{k}")
    w = dst.view(wide)
    n = w.size
    step = TILE if 0 < TILE < n else max(n, 1)
    tmp = C._scratch(min(step, n) * k, "merge").view(wide) if k > 2 else None
    for a in range(0, n, step):
        ww = w[a:a + step]
        np.left_shift(planes[k - 1][a:a + step], 8 * (k - 1), out=ww, dtype=wide)
        if tmp is not None:
            t = tmp[:ww.size]
            for p in range(k - 2, 0, -1):
                np.left_shift(planes[p][a:a + step], 8 * p, out=t, dtype=wide)
                ww |= t
        np.bitwise_or(ww, planes[0][a:a + step], out=ww)
    return None


def split_tiled(u8: np.ndarray, k: int, scratch: bool = False, slot: int = 0) -> np.ndarray:
    """`codecs._split` (each plane one shift of the words, truncated into it) over tiles of TILE
    elements, so that the k passes over a tile read it from cache; into a per-thread buffer."""
    if k not in (2, 4, 8):
        return _ONE_PASS[1](u8, k, scratch, slot)
    n = u8.nbytes // k
    bufs = _local.__dict__.setdefault("split", {})
    buf = bufs.get(slot)
    if buf is None or buf.nbytes < k * n:
        buf = bufs[slot] = np.empty(max(k * n, 1 << 16), np.uint8)
    out = buf[:k * n].reshape(k, n)
    w = u8.view(f"<u{k}")
    step = TILE if 0 < TILE < n else max(n, 1)
    for a in range(0, n, step):
        ww = w[a:a + step]
        np.copyto(out[0, a:a + step], ww, casting="unsafe")
        for p in range(1, k):
            np.right_shift(ww, 8 * p, out=out[p, a:a + step], casting="unsafe")
    return out


def merge_stack(planes: list[np.ndarray], dst: np.ndarray, k: int) -> None:
    """The planes interleaved by one `np.stack` call (k strided byte copies inside numpy)."""
    np.stack(planes, axis=1, out=dst.reshape(-1, k))


def use_tiles(tile: int) -> None:
    """Tile 0: the codecs' own one-pass functions; otherwise the tiled ones above, patched in."""
    global TILE
    TILE = tile
    C._merge, C._split = _ONE_PASS if tile == 0 else (merge_tiled, split_tiled)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=64_000_000)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tiles", default="0,16384,32768,65536")
    ap.add_argument("--min-leaf", type=int, default=4 << 20, help="leaves under this many bytes are left out")
    ap.add_argument("--json")
    args = ap.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    tiles = [int(t) for t in args.tiles.split(",")]
    flat = flatten(make_state(args.size, "bf16-f32"))
    runs = runs_of([(a, C.choose(a.dtype, C.sample(a))) for a in flat.values() if a.nbytes >= args.min_leaf], 16)
    raw_bytes = sum(r[1].nbytes for r in runs)
    use_tiles(0)
    stored = [C.encode_run(*r) for r in runs]
    sizes = [[min(r[2], r[1].nbytes - o) for o in range(0, r[1].nbytes, r[2])] for r in runs]
    outs = [np.empty(r[1].nbytes, np.uint8) for r in runs]
    # each block's planes as a decode has them (coded ones decompressed, raw ones in the stored bytes)
    merges = []
    for r in runs:
        k = r[3].itemsize
        for o in range(0, r[1].nbytes, r[2]):
            blk = r[1][o:o + r[2]]
            planes = _ONE_PASS[1](blk, k).copy()
            merges.append((list(planes), np.empty(blk.nbytes, np.uint8), k))
    splits = [(r[1], r[3].itemsize) for r in runs if r[3].itemsize > 1]
    info = {"cores": os.cpu_count(), "raw_bytes": raw_bytes, "runs": len(runs), "blocks": len(merges),
            "load_before": os.getloadavg()}
    print(json.dumps(info), flush=True)
    rows = []
    for tile in tiles:
        use_tiles(tile)
        again = [C.encode_run(*r) for r in runs[:8]]
        assert all(bytes(a) == bytes(b) for x, y in zip(again, stored) for a, b in zip(x, y)), "bytes differ"
        for n in counts:
            row: dict[str, Any] = {"tile": tile, "threads": n}
            with ThreadPoolExecutor(n) as pool:
                row["merge"] = raw_bytes / _best(pool, lambda m: C._merge(*m), merges) / GiB
                if tile == 0:  # for scale: one np.stack call per block (k strided byte copies)
                    row["merge_stack"] = raw_bytes / _best(pool, lambda m: np.stack(
                        m[0], axis=1, out=m[1].reshape(-1, m[2])), merges) / GiB
                row["split"] = raw_bytes / _best(pool, lambda s: C._split(s[0], s[1], scratch=True), splits) / GiB
                row["dec"] = raw_bytes / _best(pool, lambda i: C.decode_run(
                    runs[i][0], stored[i], runs[i][3], sizes[i], outs[i]), list(range(len(runs)))) / GiB
                if tile == 0:  # decode_run with `merge_stack` as its merge
                    C._merge = merge_stack
                    row["dec_stack"] = raw_bytes / _best(pool, lambda i: C.decode_run(
                        runs[i][0], stored[i], runs[i][3], sizes[i], outs[i]), list(range(len(runs)))) / GiB
                    C._merge = _ONE_PASS[0]
                row["enc"] = raw_bytes / _best(pool, lambda r: C.encode_run(*r), runs) / GiB
            rows.append(row)
            print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                  flush=True)
        for r, got in zip(runs, outs):  # the last decode is right
            assert np.array_equal(got, r[1])
    use_tiles(0)
    write_rows(args.json, info, rows)
    print(json.dumps({"load_after": info["load_after"]}), flush=True)


if __name__ == "__main__":
    main()
