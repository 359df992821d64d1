"""C-Blosc2's block size against decoding on many threads: ``python -m benchmarks.blosc2_blocks``.

cairn's C-Blosc2 codecs let C-Blosc2's tuner pick the Blosc block inside each 1 MiB chunk (32 KiB per
byte of element for "blosc2", 64 KiB for "blosc2-lz4": 128-256 KiB for bf16 and f32). Each block is
decompressed into a scratch buffer and unshuffled into place, so the block size sets how much of that
stays in a core's cache; a reader accepts any block size (docs/FORMAT.md §6.4), so a writer could
choose another without a format change. This measures, on the whole bf16-f32 trained state of
`benchmarks.trained_state` cut into 1 MiB chunks, for each codec's setting and each Blosc block size:
the ratio, and coding and decoding on n threads at once (wall time, best of `--reps`, GiB/s of raw
bytes; the sizes interleaved within each repetition), through the library cairn calls directly
(`cairn._format.blosc2lib`, without python-blosc2's import). Block size 0, the tuner's, codes through
cairn's own per-thread contexts; an explicit size through contexts of the benchmark's, one per element
size and, for chunks shorter than the block, per chunk size (a C-Blosc2 context keeps a short chunk's
block for the chunks after it). A last row per thread count copies each 1 MiB block into place
(`np.copyto`): what moving the bytes alone costs on that host.

In the last repetition each case decodes into zeroed buffers, and every block is compared with the
original. Options: ``--size BYTES`` (default 512 MB), ``--threads 1,12``, ``--blocks 0,32768,...`` (0: the
tuner's choice), ``--codecs blosc2,blosc2-lz4``, ``--reps 3``, ``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from benchmarks.measure import write_rows
from benchmarks.trained_state import flatten, make_state
from cairn._format import blosc2lib

BLOCK = 1 << 20
GiB = float(1 << 30)


class _Coder:
    """One codec's setting coded at one Blosc block size: 0, the tuner's, through cairn's own contexts
    (`blosc2lib.Direct.compress_into`); any other through per-thread contexts of this class's
    (`blosc2lib.Direct.new_cctx`)."""

    def __init__(self, direct: blosc2lib.Direct, codec: str, blocksize: int) -> None:
        self.lib, self.setting, self.blocksize, self.codec = direct._lib, blosc2lib.SETTINGS[codec], blocksize, codec
        self.local = threading.local()
        self.direct = direct

    def _ctx(self, k: int, n: int) -> int:
        """A context for n bytes of k-byte elements: C-Blosc2 keeps in a context the block it last used,
        the chunk's size where that was shorter than the block asked for, so chunks shorter than the
        block get contexts of their own (as `blosc2lib.Direct._cctx` keeps them)."""
        kept = getattr(self.local, "c", None)
        if kept is None:
            kept = self.local.c = {}
        key = (k, -1 if n >= self.blocksize else n)
        if key not in kept:
            kept[key] = self.direct.new_cctx(self.setting, k, self.blocksize)
        return kept[key].ptr

    def encode(self, raw: np.ndarray, k: int) -> np.ndarray:
        out = np.empty(raw.nbytes + 64, np.uint8)
        src, dst = blosc2lib.address(raw)[0], blosc2lib.address(out)[0]
        if not self.blocksize:  # the tuner's block: cairn's own contexts (a context carries its last block)
            return out[:self.direct.compress_into(k, src, raw.nbytes, dst, out.nbytes, self.codec)].copy()
        n = self.lib.blosc2_compress_ctx(self._ctx(k, raw.nbytes), src, raw.nbytes, dst, out.nbytes)
        if n <= 0:
            raise RuntimeError(f"C-Blosc2 failed ({n})")
        return out[:n].copy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=512_000_000)
    ap.add_argument("--threads", default="1,12")
    ap.add_argument("--blocks", default="0,32768,65536,131072,262144,524288")
    ap.add_argument("--codecs", default="blosc2,blosc2-lz4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    direct = blosc2lib.encoder()
    if direct is None:
        raise SystemExit("C-Blosc2 was not found beside python-blosc2 (pip install blosc2)")
    flat = flatten(make_state(args.size, "bf16-f32"))
    chunks = []  # (raw 1 MiB block, element size)
    for a in flat.values():
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        step = BLOCK - BLOCK % a.dtype.itemsize
        chunks += [(raw[o:o + step], a.dtype.itemsize) for o in range(0, raw.nbytes, step)]
    total = sum(c.nbytes for c, _ in chunks)
    outs = [np.zeros(c.nbytes, np.uint8) for c, _ in chunks]  # faulted in once, reused (as lent buffers are)
    counts = [int(n) for n in args.threads.split(",")]
    cases = [(c, int(b)) for c in args.codecs.split(",") for b in args.blocks.split(",")]
    info = {"cores": os.cpu_count(), "raw_bytes": total, "chunks": len(chunks), "load_before": os.getloadavg()}
    print(json.dumps(info), flush=True)
    coders = {case: _Coder(direct, *case) for case in cases}
    stored: dict[Any, list[np.ndarray]] = {}
    with ThreadPoolExecutor(max(counts)) as pool:
        for case, coder in coders.items():
            stored[case] = list(pool.map(lambda ck, coder=coder: coder.encode(*ck), chunks))
    ratios = {case: total / sum(s.nbytes for s in st) for case, st in stored.items()}

    def decode(case: Any, i: int) -> None:
        s, out = stored[case][i], outs[i]
        if direct.decompress_into(blosc2lib.address(s)[0], s.nbytes, blosc2lib.address(out)[0], out.nbytes) != out.nbytes:
            raise RuntimeError(f"{case}: chunk {i} did not decode")

    def copy(i: int) -> None:
        np.copyto(outs[i], chunks[i][0])

    rows = []
    every: list[Any] = [*cases, "copy"]  # the codec cases, then the plain copy
    for n in counts:
        enc: dict[Any, list[float]] = {c: [] for c in cases}
        dec: dict[Any, list[float]] = {c: [] for c in every}
        with ThreadPoolExecutor(n) as pool:
            idx = range(len(chunks))
            for rep in range(args.reps + 1):  # the first repetition warms threads and contexts, not counted
                for case in every:
                    if case != "copy":
                        coder = coders[case]
                        t = time.perf_counter()
                        list(pool.map(lambda ck, coder=coder: coder.encode(*ck), chunks))
                        if rep:
                            enc[case].append(time.perf_counter() - t)
                    checked = rep == args.reps  # the last repetition: every block decoded into zeros, then compared
                    if checked:
                        for out in outs:
                            out[:] = 0
                    t = time.perf_counter()
                    list(pool.map(copy if case == "copy" else (lambda i, case=case: decode(case, i)), idx))
                    if rep:
                        dec[case].append(time.perf_counter() - t)
                    if checked and any(not np.array_equal(outs[i], chunks[i][0]) for i in idx):
                        raise AssertionError(f"{case} decoded wrong")
        for case in every:
            row = {"threads": n, "codec": case if case == "copy" else case[0],
                   "blocksize": None if case == "copy" else case[1],
                   "ratio": None if case == "copy" else ratios[case],
                   "compress_gib_s": None if case == "copy" else total / min(enc[case]) / GiB,
                   "decompress_gib_s": total / min(dec[case]) / GiB}
            rows.append(row)
            label = "copy" if case == "copy" else f"{case[0]} block {case[1] >> 10} KiB" if case[1] else f"{case[0]} tuner"
            print(f"{n:3} threads  {label:28} ratio {row['ratio'] or 1:.4f}  compress "
                  f"{row['compress_gib_s'] or 0:6.2f}  decompress {row['decompress_gib_s']:6.2f} GiB/s", flush=True)
    write_rows(args.json, info, rows)


if __name__ == "__main__":
    main()
