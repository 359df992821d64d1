"""Reads and decoding on one host, alone and at once: ``python -m benchmarks.read_and_decode [DIR]``.

Reader threads read 16 files of 128 MiB from DIR (default /dev/shm) in 4 MiB `preadv` calls into a
buffer each keeps; decoder threads decode the trained state's 1 MiB blocks coded "blosc2-lz4" into a
1 MiB buffer each keeps; each mix of readers and decoders runs 3 s, GiB/s of raw bytes of each. What a
compressed load's reads and decoding could reach together on the host, against what the load reaches
(docs/compression.md, "LZ4 with the bit shuffle"). Needs python-blosc2.
"""
import os
import shutil
import sys
import threading
import time

import numpy as np

from benchmarks.trained_state import flatten, make_state
from cairn._format import codecs as C

st = make_state(512 << 20, "bf16-f32")
blocks = []
for a in flatten(st).values():
    if a.nbytes < 1 << 20:
        continue
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    for o in range(0, raw.nbytes - (1 << 20) + 1, 1 << 20):
        blocks.append((raw[o:o + (1 << 20)], a.dtype))
coded = [(C.encode("blosc2-lz4", b, dt), dt) for b, dt in blocks]
print(f"{len(blocks)} blocks; coded {sum(len(c) for c, _ in coded) / 2**20:.0f} MiB", flush=True)
d = os.path.join(sys.argv[1] if len(sys.argv) > 1 else "/dev/shm", "cairn-read-and-decode")
os.makedirs(d, exist_ok=True)
files = []
for i in range(16):
    p = f"{d}/f{i}"
    with open(p, "wb") as f:
        f.write(np.random.default_rng(i).integers(0, 255, 128 << 20, dtype=np.uint8).tobytes())
    files.append(p)
READ = 4 << 20
local = threading.local()

def read_file(p):
    buf = getattr(local, "buf", None)
    if buf is None:
        buf = local.buf = bytearray(READ)
    mv = memoryview(buf)
    fd = os.open(p, os.O_RDONLY)
    n = 0
    try:
        while True:
            got = os.preadv(fd, [mv], n)
            if got <= 0:
                break
            n += got
    finally:
        os.close(fd)
    return n

def decode(i):
    out = getattr(local, "out", None)
    if out is None:
        out = local.out = np.empty(1 << 20, np.uint8)
    c, dt = coded[i % len(coded)]
    C.decode("blosc2-lz4", c, dt, 1 << 20, out)
    return 1 << 20

def run(readers, decoders, secs=3.0):
    stop = time.perf_counter() + secs
    counts = {"r": 0, "d": 0}
    lock = threading.Lock()
    def rloop(k):
        j = k
        while time.perf_counter() < stop:
            n = read_file(files[j % len(files)])
            j += 1
            with lock:
                counts["r"] += n
    def dloop(k):
        j = k * 97
        while time.perf_counter() < stop:
            n = decode(j)
            j += 1
            with lock:
                counts["d"] += n
    ts = ([threading.Thread(target=rloop, args=(k,)) for k in range(readers)]
          + [threading.Thread(target=dloop, args=(k,)) for k in range(decoders)])
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    el = time.perf_counter() - t0
    print(f"readers {readers:2} decoders {decoders:2}: read {counts['r'] / el / 2**30:5.2f} GiB/s, "
          f"decode {counts['d'] / el / 2**30:5.2f} GiB/s (raw bytes)", flush=True)

for r in range(len(files)):
    read_file(files[r])  # warm
for cfg in [(1, 0), (4, 0), (8, 0), (12, 0), (0, 1), (0, 4), (0, 8), (0, 12), (4, 4), (4, 8), (8, 4), (8, 8), (2, 10)]:
    run(*cfg)
shutil.rmtree(d)
