"""A recompressing copy's coding, "blosc2" chunks gathered or not (issue 38, dec38), in one process.

    python -m benchmarks.stream_copy --mib 256 --reps 5
    python -m benchmarks.stream_copy --mib 2048 --reps 3 --threads 12 --dir /dev/shm

`cairn.copy(src, dst, compression=...)` writes through the stream writer (`_save.stream.StreamWriter`),
which codes each slab's blocks in runs of `engine.RUN_BLOCKS` on a pool of ``min(threads, cores)``
coders (`engine._encoded`). Since issue 38's dec38 change those runs go through `codecs.encode_runs`
with the pool's coders counted, so that from `codecs.BLOSC2_JOIN_MIN_CODERS` coders on "blosc2" chunks
are gathered into shared buffers as a save's are (`codecs.BLOSC2_JOIN_BYTES`); before, never.

This saves the trained state of `benchmarks.trained_state` raw to a local folder (``--dir``, default a
temporary one), then copies it with ``compression=`` each codec of ``--codecs`` under two settings,
alternated repetition by repetition (every other one in reverse order): ``gathered`` (this tree's
default) and ``apart`` (`codecs.BLOSC2_JOIN_MIN_CODERS` set past any pool: what main does). Prints the
median wall and CPU seconds of each and their ratio, with the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="raw size of the state (MiB)")
    ap.add_argument("--codecs", default="blosc2")
    ap.add_argument("--threads", type=int, default=8, help="copy(threads=): readers, and coders up to the cores")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="", help="where the checkpoints go (default: a temporary folder)")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import cairn
    from benchmarks.trained_state import make_state, raw_bytes
    from cairn._format import codecs

    work = Path(tempfile.mkdtemp(prefix="stream_copy_", dir=a.dir or None))
    default = codecs.BLOSC2_JOIN_MIN_CODERS
    settings = {"gathered": default, "apart": 1 << 30}
    try:
        state = make_state(a.mib * MiB)
        raw = raw_bytes(state)
        cairn.save(work / "src", state, compression=False)
        del state
        la0 = _loadavg()
        for codec in a.codecs.split(","):
            times: dict[str, list[tuple[float, float]]] = {}
            order = list(settings)
            for rep in range(a.reps + 1):  # the first is a warm-up
                for name in (order if rep % 2 == 0 else order[::-1]):
                    codecs.BLOSC2_JOIN_MIN_CODERS = settings[name]
                    dst = work / f"dst_{name}"
                    t0, c0 = time.perf_counter(), time.process_time()
                    cairn.copy(work / "src", dst, compression=codec, threads=a.threads)
                    got = (time.perf_counter() - t0, time.process_time() - c0)
                    shutil.rmtree(dst)
                    if rep:
                        times.setdefault(name, []).append(got)
            codecs.BLOSC2_JOIN_MIN_CODERS = default
            la1 = _loadavg()
            print(f"\n{codec}: copy of a {raw / MiB:.0f} MiB trained state, threads={a.threads} "
                  f"({os.cpu_count()} cpus), medians of {a.reps} (load average {la0} -> {la1})")
            med = {k: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for k, v in times.items()}
            for k, (wall, cpu) in med.items():
                print(f"  {k:9s} wall {wall:7.3f} s  cpu {cpu:7.3f} s  {raw / wall / (1 << 30):5.2f} GiB/s raw   "
                      f"wall {wall / med['apart'][0]:.3f}x, cpu {cpu / med['apart'][1]:.3f}x of 'apart'")
            la0 = la1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
