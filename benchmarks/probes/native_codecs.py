"""Native codec candidates against `planes`, side by side: ``python -m benchmarks.probe native_codecs``.

The whole bf16-f32 trained state of `benchmarks.trained_state`, cut into 1 MiB blocks, coded by
each candidate on n threads at once (wall time, best of `--reps`, GiB/s of raw bytes; the
candidates interleaved within each repetition, so a machine's drift hits them alike):

- ``planes``: cairn's codecs as a save and a local load call them: `codecs.encode_runs` of the
  save's tasks (`benchmarks.probes.codecs.coding_tasks`: runs of 16 blocks, small leaves together), each
  leaf's codec from `choose.choose_sized` without blosc2 (planes / zstd / none), and `codecs.decode_run` per run.
- ``cairn-blosc2``: cairn's "blosc2" codec through `codecs.encode_runs` / `codecs.decode_run`, same tasks
  (`decode_run`: each block's header checked, then its `decompress2` call).
- ``cairn-blosc2-lz4``: cairn's "blosc2-lz4" codec (bit shuffle and LZ4) the same way.
- ``cairn-blosc2-py``: the same, with C-Blosc2 reached through python-blosc2's `compress2` /
  `decompress2` (cairn's path where `cairn._codecs.blosc2lib` cannot load; ``cairn-blosc2`` calls the
  library directly where it can): the A/B of the direct binding, in one run.
- ``cairn-blosc2-perblock``: the same check and call per block in this benchmark's own loop, without
  `decode_run` around it (what cairn's wrapper costs).
- ``zstd1``: every block one zstd level-1 frame (the ``zstd`` codec for every leaf), same tasks.
- ``b2-...``: python-blosc2's `compress2` / `decompress2` of each 1 MiB block as one Blosc2 chunk
  (typesize = the leaf's itemsize), named by filters, codec, split mode, Blosc block size and
  threads: ``shuf`` SHUFFLE, ``shuf+bd`` SHUFFLE then BYTEDELTA; ``split`` ALWAYS_SPLIT (each
  shuffled byte stream compressed on its own, as `planes` does), ``auto`` AUTO_SPLIT (Blosc2's
  default); ``bs0`` Blosc's own block size, ``bs1m`` one 1 MiB Blosc block per chunk; ``pool``:
  n Python threads, Blosc nthreads=1 (as cairn's writer pool would call it), ``inner``: one Python
  thread, Blosc nthreads=n inside each call. `blosc2.set_releasegil(True)` is set (without it
  every call holds the GIL).

Every candidate's decoded bytes are checked against the state. Options: ``--size BYTES``
(default 512 MB), ``--threads 1,12``, ``--reps 3``, ``--only NAME,...``, ``--dtype NAME`` (only the
leaves of that dtype, e.g. bfloat16 or float32: codec speed per element size), ``--json PATH``.
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

from benchmarks.measure import write_rows
from benchmarks.probes.codecs import coding_tasks
from benchmarks.trained_state import flatten, make_state
from cairn._codecs import blosc2lib
from cairn._codecs import codecs as C
from cairn._codecs.choose import choose_sized, sample
from cairn._save.pipeline import RUN_BLOCKS

BLOCK = 1 << 20
GiB = float(1 << 30)


def _b2_variants(b2: Any) -> dict[str, dict[str, Any]]:
    shuf, bd = [b2.Filter.SHUFFLE], [b2.Filter.SHUFFLE, b2.Filter.BYTEDELTA]
    split, auto = b2.SplitMode.ALWAYS_SPLIT, b2.SplitMode.AUTO_SPLIT
    zstd, lz4 = b2.Codec.ZSTD, b2.Codec.LZ4
    out = {}
    for name, filters, codec, mode, bs, how in [
        ("b2-shuf-zstd1-split-bs0", shuf, zstd, split, 0, "pool"),
        ("b2-shuf-zstd1-auto-bs0", shuf, zstd, auto, 0, "pool"),
        ("b2-shuf+bd-zstd1-split-bs0", bd, zstd, split, 0, "pool"),
        ("b2-shuf-zstd1-split-bs1m", shuf, zstd, split, BLOCK, "pool"),
        ("b2-shuf+bd-zstd1-split-bs1m", bd, zstd, split, BLOCK, "pool"),
        ("b2-shuf-lz4-split-bs0", shuf, lz4, split, 0, "pool"),
        ("b2-shuf-zstd1-split-bs0-inner", shuf, zstd, split, 0, "inner"),
        ("b2-shuf+bd-zstd1-split-bs0-inner", bd, zstd, split, 0, "inner"),
    ]:
        out[name] = {"filters": filters, "codec": codec, "clevel": 1, "splitmode": mode, "blocksize": bs,
                     "how": how}
    return out


def _blocks_of(run: tuple[Any, ...]) -> list[tuple[int, int]]:
    _, raw, block, _ = run
    return [(o, min(block, raw.nbytes - o)) for o in range(0, raw.nbytes, block)]


def _best(fn: Callable[[], Any], times: list[float]) -> None:
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=512_000_000)
    ap.add_argument("--threads", default="1,12")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", help="candidates to run (comma-separated names)")
    ap.add_argument("--dtype", help="only the leaves of this dtype (bfloat16, float32)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    counts = [int(n) for n in args.threads.split(",")]
    try:
        import blosc2
    except ImportError:
        blosc2 = None
    t0 = time.perf_counter()
    flat = flatten(make_state(args.size, "bf16-f32"))
    # `planes`: each leaf's codec as chosen without blosc2 (planes / zstd / none)
    leaves = [(a, choose_sized(a.dtype, sample(a), blosc2=False)[0]) for a in flat.values()
              if a.nbytes and (args.dtype is None or a.dtype.name == args.dtype)]
    tasks = coding_tasks(leaves, RUN_BLOCKS)
    runs = [r for t in tasks for r in t]
    raw = sum(r[1].nbytes for r in runs)
    info: dict[str, Any] = {
        "cores": os.cpu_count(), "machine": platform.machine(), "node": platform.node(),
        "python": platform.python_version(), "numpy": np.__version__, "zstandard": zstandard.__version__,
        "zstd": ".".join(map(str, zstandard.ZSTD_VERSION)), "raw_bytes": raw, "leaves": len(leaves),
        "runs": len(runs), "tasks": len(tasks), "build_s": time.perf_counter() - t0,
        "load_before": os.getloadavg()}
    if blosc2 is not None:
        blosc2.set_releasegil(True)
        info["blosc2"] = blosc2.__version__
        info["c_blosc2"] = blosc2.VERSION_STRING
    print(json.dumps(info), flush=True)

    outs = [np.empty(r[1].nbytes, np.uint8) for r in runs]
    sizes = [[n for _, n in _blocks_of(r)] for r in runs]
    cands: dict[str, dict[str, Any]] = {}

    direct = blosc2lib.load(blosc2) if blosc2 is not None else None
    info["blosc2_direct"] = direct is not None

    def add(name: str, enc_task: Callable[[list[Any]], list[list[Any]]], dec_run: Callable[[int, list[Any]], None],
            how: str = "pool", via_python: bool = False) -> None:
        cands[name] = {"enc": enc_task, "dec": dec_run, "how": how, "direct": None if via_python else direct}

    add("planes", C.encode_runs,
        lambda i, st: C.decode_run(runs[i][0], st, runs[i][3], sizes[i], outs[i]))
    add("zstd1", lambda task: C.encode_runs([("zstd", *r[1:]) for r in task]),
        lambda i, st: C.decode_run("zstd", st, runs[i][3], sizes[i], outs[i]))
    if blosc2 is not None:
        add("cairn-blosc2", lambda task: C.encode_runs([("blosc2", *r[1:]) for r in task]),
            lambda i, st: C.decode_run("blosc2", st, runs[i][3], sizes[i], outs[i]))
        add("cairn-blosc2-lz4", lambda task: C.encode_runs([("blosc2-lz4", *r[1:]) for r in task]),
            lambda i, st: C.decode_run("blosc2-lz4", st, runs[i][3], sizes[i], outs[i]))
        if direct is not None:
            add("cairn-blosc2-py", lambda task: C.encode_runs([("blosc2", *r[1:]) for r in task]),
                lambda i, st: C.decode_run("blosc2", st, runs[i][3], sizes[i], outs[i]), via_python=True)

        def perblock(i: int, st: list[Any]) -> None:
            out, k, dec = outs[i], runs[i][3].itemsize, blosc2.decompress2
            for (o, n), s in zip(_blocks_of(runs[i]), st):
                C._check_blosc2(memoryview(s).cast("B"), n, k, "")
                dec(s, dst=out[o:o + n], nthreads=1)
        add("cairn-blosc2-perblock", lambda task: C.encode_runs([("blosc2", *r[1:]) for r in task]), perblock)
        for name, v in _b2_variants(blosc2).items():
            kw = {k: v[k] for k in ("filters", "codec", "clevel", "splitmode", "blocksize")}

            def enc(task: list[Any], kw: dict[str, Any] = kw, nt: int = 1) -> list[list[Any]]:
                return [[blosc2.compress2(r[1][o:o + n], typesize=r[3].itemsize, nthreads=nt, **kw)
                         for o, n in _blocks_of(r)] for r in task]

            def dec(i: int, st: list[Any], nt: int = 1) -> None:
                out = outs[i]
                for (o, n), s in zip(_blocks_of(runs[i]), st):
                    blosc2.decompress2(s, dst=out[o:o + n], nthreads=nt)
            add(name, enc, dec, v["how"])
    if args.only:
        keep = set(args.only.split(","))
        cands = {k: v for k, v in cands.items() if k in keep}

    stored: dict[str, list[list[Any]]] = {}
    ratios: dict[str, float] = {}
    for name, c in cands.items():
        blosc2lib._loaded[:] = [c["direct"]]  # (the direct path or python-blosc2's, per candidate)
        st = [b for t in tasks for b in c["enc"](t)]
        stored[name] = st
        ratios[name] = raw / sum(len(b) for bs in st for b in bs)
        print(f"{name}: ratio {ratios[name]:.4f}", flush=True)

    rows = []
    for n in counts:
        enc_t: dict[str, list[float]] = {k: [] for k in cands}
        dec_t: dict[str, list[float]] = {k: [] for k in cands}
        with ThreadPoolExecutor(n) as pool:
            def run_all(name: str, reps: int, n: int = n, pool: ThreadPoolExecutor = pool,
                        enc_t: dict[str, list[float]] = enc_t, dec_t: dict[str, list[float]] = dec_t) -> None:
                c, st = cands[name], stored[name]
                blosc2lib._loaded[:] = [c["direct"]]
                for _ in range(reps):
                    if c["how"] == "inner":  # one caller, Blosc's own n threads in each call
                        _best(lambda: [c["enc"](t, nt=n) for t in tasks], enc_t[name])
                        _best(lambda: [c["dec"](i, st[i], nt=n) for i in range(len(runs))], dec_t[name])
                    else:
                        _best(lambda: list(pool.map(c["enc"], tasks)), enc_t[name])
                        _best(lambda: list(pool.map(lambda i: c["dec"](i, st[i]), range(len(runs)))), dec_t[name])
            for name in cands:  # warm: threads, per-thread buffers
                run_all(name, 1)
                enc_t[name].clear()
                dec_t[name].clear()
            for _ in range(args.reps):
                for name in cands:
                    run_all(name, 1)
                    for i, r in enumerate(runs):  # what was decoded is the state
                        if not np.array_equal(outs[i], r[1]):
                            raise AssertionError(f"{name} decoded run {i} wrong")
                        outs[i][:] = 0
        for name in cands:
            row = {"threads": n, "candidate": name, "how": cands[name]["how"], "ratio": ratios[name],
                   "compress_gib_s": raw / min(enc_t[name]) / GiB, "decompress_gib_s": raw / min(dec_t[name]) / GiB,
                   "compress_s": enc_t[name], "decompress_s": dec_t[name]}
            rows.append(row)
            print(f"{n:3} threads  {name:34} ratio {row['ratio']:.4f}  compress {row['compress_gib_s']:6.2f} GiB/s"
                  f"  decompress {row['decompress_gib_s']:6.2f} GiB/s", flush=True)
    write_rows(args.json, info, rows)


if __name__ == "__main__":
    main()
