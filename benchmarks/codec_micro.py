"""Where the many-core ceiling is: pure C threads vs Python pools (device micro-benchmark)."""
import json, os, sys, time, subprocess
from concurrent.futures import ThreadPoolExecutor
import numpy as np, zstandard
sys.path[:0] = ["src", "."]
from benchmarks.trained_state import flatten, make_state
from cairn._format import codecs as C

GiB = float(1 << 30)
out = {}
try:
    out["lscpu"] = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
except Exception as e:
    out["lscpu"] = str(e)
print(out["lscpu"][:1500], flush=True)
flat = flatten(make_state(256_000_000, "bf16-f32"))
big = [a for a in flat.values() if a.nbytes >= 4 << 20]
raw = sum(a.nbytes for a in big)
# exponent-carrying planes, 1 MiB blocks' worth each
planes = []
for a in big:
    u8 = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    k = a.dtype.itemsize
    p = C._split(u8, k)
    n = (1 << 20) // k
    for o in range(0, p.shape[1], n):
        planes.append(np.ascontiguousarray(p[k - 1, o:o + n]))
pbytes = sum(x.nbytes for x in planes)
cp = C._compressor("planes")
print(f"{raw/2**20:.0f} MiB raw, {len(planes)} top planes {pbytes/2**20:.0f} MiB", flush=True)
def best(fn, reps=3):
    fn(); b = 1e9
    for _ in range(reps):
        t = time.perf_counter(); fn(); b = min(b, time.perf_counter() - t)
    return b
rows = []
frames_all = cp.multi_compress_to_buffer(planes, threads=1)
sizes = [x.nbytes for x in planes]
for T in (1, 4, 8, 12):
    r = {"threads": T}
    r["one_call_compress_planes"] = pbytes / best(lambda: cp.multi_compress_to_buffer(planes, threads=T)) / GiB
    r["one_call_decompress_planes"] = pbytes / best(lambda: C._decompressor(1 << 20).multi_decompress_to_buffer(frames_all, threads=T)) / GiB
    with ThreadPoolExecutor(T) as pool:
        r["pool_compress_per_plane"] = pbytes / best(lambda: list(pool.map(lambda x: C._compressor("planes").compress(x), planes))) / GiB
        groups = [planes[i:i + 16] for i in range(0, len(planes), 16)]
        r["pool_multi16"] = pbytes / best(lambda: list(pool.map(lambda g: C._compressor("planes").multi_compress_to_buffer(g, threads=1), groups))) / GiB
        runs = []
        for a in big:
            u8 = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            runs += [(u8[o:o + (16 << 20)], a.dtype.itemsize) for o in range(0, u8.nbytes, 16 << 20)]
        r["pool_split16MiB"] = raw / best(lambda: list(pool.map(lambda x: C._split(x[0], x[1], scratch=True), runs))) / GiB
        r["pool_join16MiB"] = raw / best(lambda: list(pool.map(lambda x: len(b"".join([x[0][:len(x[0])//2], x[0][len(x[0])//2:]])), runs))) / GiB
        r["pool_probe16MiB"] = raw / best(lambda: list(pool.map(lambda x: C._planes_to_try(x[0], x[1], (1 << 20) // x[1]), runs))) / GiB
        r["pool_encode_run16"] = raw / best(lambda: list(pool.map(lambda x: C.encode_run("planes", x[0], 1 << 20, np.dtype(f"u{x[1]}")), runs))) / GiB
    rows.append(r)
    print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), flush=True)
out["rows"] = rows
with open(os.path.join(os.environ.get("OUT", "."), "micro.json"), "w") as f:
    json.dump(out, f, indent=1)
