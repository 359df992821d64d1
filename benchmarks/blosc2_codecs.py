"""C-Blosc2's compressors and filters side by side on a trained state's 1 MiB blocks, one thread:
``python -m benchmarks.blosc2_codecs``. Ratio and encode / decode GiB/s (wall time, best of 3 for
decoding) for each setting, every one split by bytes as cairn's "blosc2" (zstd level 1, byte shuffle),
which is among them. For choosing a codec that decodes faster than zstd (docs/compression.md, "Load
buffers lent": the compressed load on the TPU host is decode-bound); needs python-blosc2.
"""

import time

import blosc2
import numpy as np

from benchmarks.trained_state import flatten, make_state

st = make_state(256 << 20, "bf16-f32")
leaves = [a for a in flatten(st).values() if a.nbytes >= 1 << 20]
blocks = []
for a in leaves:
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    for o in range(0, raw.nbytes, 1 << 20):
        blocks.append((raw[o:o + (1 << 20)], a.dtype.itemsize))
total = sum(b.nbytes for b, _ in blocks)
for name, codec, clevel, filt in [("zstd1 shuffle (cairn)", blosc2.Codec.ZSTD, 1, blosc2.Filter.SHUFFLE),
                                  ("zstd1 bitshuffle", blosc2.Codec.ZSTD, 1, blosc2.Filter.BITSHUFFLE),
                                  ("lz4hc 5 bitshuffle", blosc2.Codec.LZ4HC, 5, blosc2.Filter.BITSHUFFLE),
                                  ("lz4hc 1 bitshuffle", blosc2.Codec.LZ4HC, 1, blosc2.Filter.BITSHUFFLE),
                                  ("lz4hc 1 shuffle", blosc2.Codec.LZ4HC, 1, blosc2.Filter.SHUFFLE),
                                  ("lz4 5 shuffle", blosc2.Codec.LZ4, 5, blosc2.Filter.SHUFFLE),
                                  ("lz4hc 5 shuffle", blosc2.Codec.LZ4HC, 5, blosc2.Filter.SHUFFLE),
                                  ("lz4 5 bitshuffle", blosc2.Codec.LZ4, 5, blosc2.Filter.BITSHUFFLE),
                                  ("blosclz 5 shuffle", blosc2.Codec.BLOSCLZ, 5, blosc2.Filter.SHUFFLE)]:
    t = time.perf_counter()
    cs = [blosc2.compress2(b, typesize=k, codec=codec, clevel=clevel, filters=[filt], splitmode=blosc2.SplitMode.ALWAYS_SPLIT, nthreads=1) for b, k in blocks]
    enc = time.perf_counter() - t
    stored = sum(len(c) for c in cs)
    out = np.empty(1 << 20, np.uint8)
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        for c in cs:
            blosc2.decompress2(c, dst=out, nthreads=1)
        best = min(best, time.perf_counter() - t)
    print(f"{name:22} ratio {total / stored:.3f}  encode {total / enc / 2**30:.2f}, decode {total / best / 2**30:.2f} GiB/s (1 thread)")
