"""A load's timeline, against a lean pipeline in the same process:
``python -m benchmarks.load_timeline [--mib 256] [--reps 3] [--workdir DIR] [--json PATH] [--fresh]``.

Saves the trained state (`benchmarks.trained_state`, bf16 parameters and f32 AdamW moments) raw and
``compression="blosc2-lz4"``, then loads each onto JAX's first device, alternated round by round, two
ways:

- ``cairn``: `cairn.load` with ``ShapeDtypeStruct`` targets on that device;
- ``lean``: the reads cairn plans for each leaf (`plan.array_reads`, one read per chunk) run by a
  pool of 8 threads that each read a read's stored bytes into a buffer the thread keeps, check each
  block's CRC-32C and decode it straight into the leaf's host buffer (lent from `buffers.load_pool`,
  as cairn's are), with no decode pool, no batching of small leaves and no byte budget but 1 GiB of
  leaves in flight; the loading thread puts each leaf on the device once its reads are done, in
  order. What the storage, the codec and the device transfers allow with the least around them.

Printed per case: medians of wall seconds and of the process's user and system CPU seconds
(``getrusage``: under gVisor, first touches of fresh pages show as system time); and, for the last
round, a timeline: per read (thread, start, end, raw bytes; cairn's `ChunkReader.do_read` and
`_do_read_part`, small leaves read in runs not counted) and per leaf (queued, reads done, put on the device; cairn's
`engine._assemble`), summarised as active reads every 50 ms, when the first leaf was put and the
mean time of reads by size. ``--fresh`` frees the buffers cairn keeps between loads
(`cairn.release_snapshot_buffers`) before each of its loads: every load then reads into fresh pages,
as a process's first does. Made for the TPU host (docs/compression.md, "Scratch buffers kept
between loads"); needs python-blosc2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

_LOCK = threading.Lock()
_TL: dict[str, Any] = {"on": False, "reads": [], "leaves": [], "t0": 0.0}


def _rec(kind: str, row: tuple) -> None:
    if _TL["on"]:
        with _LOCK:
            _TL[kind].append(row)


def _now() -> float:
    return time.perf_counter() - _TL["t0"]


class Lean:
    """The lean pipeline over cairn's planned reads of the checkpoint at `path`."""

    def __init__(self, path: str, direct: Any) -> None:
        from cairn._core.stats import LoadStats
        from cairn._load import reader as R
        from cairn._load.source import open_checkpoint

        self.direct, self.R = direct, R
        ck = open_checkpoint(path)
        self.leaves = []
        self.local = threading.local()
        self.pool = ThreadPoolExecutor(8, thread_name_prefix="lean")
        for name, index in ck.indexes.items():
            reader = R.ChunkReader(ck.loc, name, ck.manifest.items[name], index, True, self.pool, LoadStats())
            for leaf in index.leaves:
                if not hasattr(leaf, "shape"):
                    continue
                box = tuple((0, n) for n in leaf.shape)
                _, reads = R.array_reads(leaf, [box], None, False, index.block_size, True, R.DEFAULT_MAX_READ, 0,
                                         R.PlanMemo())
                self.leaves.append((reader, leaf, reads))

    def _task(self, reader: Any, leaf: Any, host: np.ndarray, read: Any) -> None:
        from cairn._core.checksum import crc32c
        from cairn._load.landing import direct_bytes

        t = _now()
        out = direct_bytes(read, [host])
        assert out is not None  # whole leaves, C order: every read lands in place
        if leaf.codec == "none":
            view = memoryview(out)  # type: ignore[arg-type]
            reader._reader(read.file).read_into(read.start, view)
            for s, e, crc in read.checks:
                if crc32c(view[s - read.start:e - read.start]) != crc:
                    raise RuntimeError(f"block {s}..{e}: checksum mismatch")
        else:
            coded = self.R.CodedRead.of(reader, read, leaf, out)
            stored = getattr(self.local, "stored", None)
            if stored is None or stored.nbytes < coded.nbytes:
                stored = self.local.stored = np.empty(max(coded.nbytes, 16 << 20), np.uint8)
            view = memoryview(stored)[:coded.nbytes]  # type: ignore[arg-type]
            reader._reader(coded.file).read_into(coded.first, view)
            first = coded.first
            sbase, rbase = stored.ctypes.data, out.ctypes.data
            for (s, e, crc), (lo, hi, where) in zip(coded.checks, coded.blocks):
                if crc32c(view[s - first:e - first]) != crc:
                    raise RuntimeError(f"{where}: checksum mismatch")
                if self.direct.decompress_into(sbase + s - first, e - s, rbase + lo, hi - lo) != hi - lo:
                    raise RuntimeError(f"{where}: does not decode")
        _rec("reads", (threading.get_ident(), t, _now(), read.nbytes))

    def run(self, device: Any, inflight: int = 1 << 30) -> Any:
        import jax

        from cairn._core.buffers import lent_empty, load_pool

        results, pending, queued = [], [], 0
        todo = iter(self.leaves)
        more = True
        while True:
            while more and queued < inflight:
                nxt = next(todo, None)
                if nxt is None:
                    more = False
                    break
                reader, leaf, reads = nxt
                host = (lent_empty(load_pool, leaf.shape, leaf.dtype) if leaf.nbytes >= 1 << 20
                        else np.empty(leaf.shape, leaf.dtype))
                futures = [self.pool.submit(self._task, reader, leaf, host, r) for r in reads]
                pending.append((host, _now(), futures))
                queued += host.nbytes
            if not pending:
                break
            host, queued_at, futures = pending.pop(0)
            for f in futures:
                f.result()
            done = _now()
            queued -= host.nbytes
            results.append(jax.device_put(host, device))
            _rec("leaves", (queued_at, done, _now(), host.nbytes))
        return jax.block_until_ready(results)


def _instrument() -> None:
    """Timeline hooks on cairn's reads and leaf placements (no change to the library)."""
    from cairn._load import engine
    from cairn._load import reader as R

    do_read, read_array, assemble = R.ChunkReader.do_read, R.ChunkReader.read_array, engine._assemble
    read_part = getattr(R.ChunkReader, "_do_read_part", None)  # (compressed reads that decode in place)
    queued: dict[int, float] = {}

    def timed_read(self: Any, read: Any, leaf: Any, dests: Any) -> None:
        t = _now()
        do_read(self, read, leaf, dests)
        _rec("reads", (threading.get_ident(), t, _now(), read.nbytes))

    def timed_part(self: Any, part: Any, leaf: Any, raw: Any) -> None:
        t = _now()
        read_part(self, part, leaf, raw)
        _rec("reads", (threading.get_ident(), t, _now(), part.nbytes))

    def noted_array(self: Any, leaf: Any, *args: Any, **kwargs: Any) -> Any:
        r = read_array(self, leaf, *args, **kwargs)
        queued[id(r)] = _now()
        return r

    def timed_assemble(want: Any, reads: Any, it: Any, where: str, shape: Any = None) -> Any:
        t = _now()
        x = assemble(want, reads, it, where, shape)
        _rec("leaves", (queued.pop(id(reads), -1.0), t, _now(), reads.nbytes))
        return x

    R.ChunkReader.do_read = timed_read  # type: ignore[method-assign]
    if read_part is not None:
        R.ChunkReader._do_read_part = timed_part  # type: ignore[method-assign]
    R.ChunkReader.read_array = noted_array  # type: ignore[method-assign]
    engine._assemble = timed_assemble


def _summary(name: str, tl: dict[str, Any]) -> str:
    reads, leaves, total = tl["reads"], tl["leaves"], tl["total"]
    if not reads:
        return f"  {name}: no reads recorded"
    active = [sum(1 for _, s, e, _ in reads if s <= x * 0.05 < e) for x in range(int(total / 0.05) + 1)]
    by_size: dict[int, list[float]] = {}
    for _, s, e, n in reads:
        by_size.setdefault(n >> 20, []).append(e - s)
    sizes = ", ".join(f"{mib} MiB x{len(d)} {statistics.mean(d) * 1e3:.0f} ms" for mib, d in sorted(by_size.items())
                      if mib)
    first_put = min((t1 for _, t1, _, _ in leaves), default=float("nan"))
    return (f"  {name}: total {total:.3f} s, {len(reads)} reads (last ends {max(e for _, _, e, _ in reads):.3f} s, "
            f"{sum(e - s for _, s, e, _ in reads):.2f} thread-s), {len(leaves)} leaves put (first at {first_put:.3f} s)\n"
            f"    active reads every 50 ms: {active}\n    mean read by size: {sizes}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="raw size of the state (MiB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="write every repetition and the last round's timelines here")
    ap.add_argument("--fresh", action="store_true", help="free cairn's kept buffers before each of its loads")
    args = ap.parse_args(argv)

    import blosc2
    import jax

    import cairn
    from benchmarks.trained_state import make_state
    from cairn._format import blosc2lib

    direct = blosc2lib.load(blosc2)
    if direct is None:
        raise SystemExit("needs C-Blosc2 called directly (python-blosc2 with its library and header)")
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    print(f"{os.cpu_count()} cores, {device.platform}", flush=True)
    work = tempfile.mkdtemp(prefix="cairn-load-timeline-", dir=args.workdir)
    try:
        state = make_state(args.mib << 20, "bf16-f32")
        paths = {"raw": os.path.join(work, "raw"), "lz4": os.path.join(work, "lz4")}
        cairn.save(paths["raw"], state, compression=False)
        cairn.save(paths["lz4"], state, compression="blosc2-lz4")
        del state
        meta = cairn.metadata(paths["raw"])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), meta,
                              is_leaf=lambda x: isinstance(x, cairn.ArrayMetadata))
        lean = {k: Lean(p, direct) for k, p in paths.items()}
        _instrument()

        def cairn_load(p: str) -> Any:
            if args.fresh:
                cairn.release_snapshot_buffers()
            return jax.block_until_ready(cairn.load(p, target))

        cases = {"cairn raw": lambda: cairn_load(paths["raw"]), "cairn lz4": lambda: cairn_load(paths["lz4"]),
                 "lean raw": lambda: lean["raw"].run(device), "lean lz4": lambda: lean["lz4"].run(device)}
        for f in cases.values():  # warm: imports, pools, buffers
            f()
        rows: dict[str, list[list[float]]] = {k: [] for k in cases}
        timelines: dict[str, Any] = {}
        names = list(cases)
        for rep in range(args.reps):
            for k in (names if rep % 2 == 0 else names[::-1]):
                _TL.update(on=rep == args.reps - 1, reads=[], leaves=[], t0=time.perf_counter())
                r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                cases[k]()
                wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
                rows[k].append([wall, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime])
                if _TL["on"]:
                    timelines[k] = {"reads": _TL["reads"], "leaves": _TL["leaves"], "total": wall}
                _TL["on"] = False
            print(f"round {rep + 1}/{args.reps}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    print(f"\n{args.mib} MiB state onto {device.platform}; medians: wall, user, system seconds"
          + (" (cairn's loads into fresh buffers)" if args.fresh else ""))
    for k, rs in rows.items():
        m = [med(r[i] for r in rs) for i in range(3)]
        print(f"  {k:10s} wall {m[0]:.3f}  user {m[1]:.2f}  sys {m[2]:.2f}  walls {[round(r[0], 3) for r in rs]}")
    print("ratios of medians: " + ", ".join(
        f"{a} / {b} {med(r[0] for r in rows[a]) / med(r[0] for r in rows[b]):.2f}"
        for a, b in (("cairn lz4", "cairn raw"), ("cairn lz4", "lean lz4"), ("cairn raw", "lean raw"))))
    print("timelines of the last round:")
    for k, tl in timelines.items():
        print(_summary(k, tl))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "timelines": timelines}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
