"""What fresh memory costs on this host, by how it is had and filled: ``python -m benchmarks.fresh_memory all``.

Each case is ``kind:op:threads`` and runs in a fresh process on 1 GiB: ``kind`` is how the buffer is
had (``empty``: ``np.empty`` with numpy's huge-page advice off; ``thp``: with it on; ``mmap``: an anonymous
mapping; ``populate``: one with ``MAP_POPULATE``), ``op`` how it is filled (``fill``: written by numpy;
``pread``: read from a 1 GiB file in /dev/shm; ``touchpread``: a byte written per page, then read into),
on ``threads`` threads, each its share. Printed: the time to have it, the first fill's speed, a second
fill's (pages mapped), and both together. ``all`` runs the cases named after it (by default the four of
the thirteenth session's second call), each once.

Under gVisor (the TPU v5e host, benchmarks/results/tpu-v5e-freshmem.log) a first write into a fresh page costs
0.9 GiB/s a thread and scales to ~3.9 GiB/s on 8-12 threads, but a ``pread`` into fresh pages runs at
~1 GiB/s however many threads read: a restart's raw load, which reads into its fresh host buffers, is
bound by that, while a compressed one decodes into them, on every reader thread at once.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
import time

import numpy as np

N = 1 << 30
SHM = "/dev/shm/cairn-fresh-memory.bin"


def _threads(fns: list) -> None:
    ts = [threading.Thread(target=f) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def fill(a: np.ndarray, threads: int) -> None:
    _threads([lambda p=p: p.fill(1) for p in np.array_split(a, threads)])


def pread_into(a: np.ndarray, threads: int) -> None:
    fd = os.open(SHM, os.O_RDONLY)
    parts = np.array_split(a, threads)
    offs = np.cumsum([0] + [p.nbytes for p in parts])

    def one(p: np.ndarray, off: int) -> None:
        mv = memoryview(p)
        got = 0
        while got < p.nbytes:
            got += os.preadv(fd, [mv[got:got + (8 << 20)]], off + got)

    _threads([lambda p=p, o=o: one(p, int(o)) for p, o in zip(parts, offs)])
    os.close(fd)


def touch_pread(a: np.ndarray, threads: int) -> None:
    _threads([lambda p=p: p[::4096].fill(0) for p in np.array_split(a, threads)])
    pread_into(a, threads)


def get(kind: str) -> tuple[np.ndarray, float]:
    t = time.perf_counter()
    if kind in ("empty", "thp"):
        a = np.empty(N, np.uint8)
    else:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if kind == "populate" else 0)
        a = np.frombuffer(mmap.mmap(-1, N, flags=flags), np.uint8)
    return a, time.perf_counter() - t


def case(name: str) -> None:
    kind, op, n = name.split(":")
    threads = int(n)
    if kind == "empty":
        np._core.multiarray._set_madvise_hugepage(False)  # type: ignore[attr-defined]
    a, t_get = get(kind)
    run = {"fill": fill, "pread": pread_into, "touchpread": touch_pread}[op]
    t = time.perf_counter()
    run(a, threads)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    run(a, threads)
    t2 = time.perf_counter() - t
    print(f"{name:24s} get {t_get * 1e3:7.1f} ms  first {op} {N / t1 / 2**30:6.2f} GiB/s ({t1:.3f} s)  "
          f"again {N / t2 / 2**30:6.2f} GiB/s  get+first {N / (t_get + t1) / 2**30:6.2f} GiB/s", flush=True)


def main() -> int:
    if len(sys.argv) == 2 and sys.argv[1] != "all":
        case(sys.argv[1])
        return 0
    with open(SHM, "wb") as f:
        np.ones(N, np.uint8).tofile(f)
    print(os.cpu_count(), "cores", flush=True)
    try:
        for c in sys.argv[2:] or ["empty:pread:8", "empty:touchpread:8", "empty:touchpread:12", "empty:fill:12"]:
            subprocess.run([sys.executable, "-m", "benchmarks.fresh_memory", c], check=False)
    finally:
        os.unlink(SHM)
    return 0


if __name__ == "__main__":
    sys.exit(main())
