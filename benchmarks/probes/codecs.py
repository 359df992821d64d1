"""Codec ratios and single-thread speeds on realistic trained states: ``python -m benchmarks.probe codecs``.

For each variant of `benchmarks.trained_state` and each leaf kind (params, mu,
nu, count) this reports, per codec, the ratio raw / stored and the
single-thread compress and decompress speed in GiB/s of raw bytes per second of
this thread's CPU time (`time.thread_time`: wall time is meaningless on a
shared, loaded machine; best of 3; where the thread clock does not advance, as under
gVisor's sandbox, wall time on an otherwise idle machine, said in the output), coding the
leaves block by block (1 MiB blocks, as cairn's checksum blocks) and decoding
into a preallocated buffer. Then the whole state: cairn with the codec
`choose` picks per leaf, plain zstd levels 1 and 3 of each leaf's bytes (about
what Orbax's zarr zstd gives), and, where orbax-checkpoint imports, the bytes
Orbax's `StandardCheckpointer` writes for the same state.

Options: ``--size BYTES`` (default 256 MiB per variant), ``--variants a,b``,
``--no-orbax``, ``--json PATH``, ``--threads 1,2,4`` (the whole state coded on that
many threads at once: do the codecs scale over cores?), and ``--against FILE``: another version of
``codecs.py`` (``git show REV:src/cairn/_codecs/codecs.py > old.py``), whose
"planes" codec is then measured against the current one per leaf kind,
interleaved (alternating order, best of 9 each), so that a change of the
machine's load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from typing import Any

import numpy as np
import zstandard

from benchmarks.trained_state import VARIANTS, flatten, leaf_kind, make_state
from cairn._codecs import choose as _choose
from cairn._codecs import codecs as _codecs

BLOCK = 1 << 20


def _pick_clock() -> Any:
    """`time.thread_time` where it measures this thread's CPU (it stays at 0 in some sandboxes), else wall time."""
    t0, w0 = time.thread_time(), time.perf_counter()
    x = np.ones(1 << 20)
    while time.perf_counter() - w0 < 0.05:
        x = np.sqrt(x + 1.0)
    if time.thread_time() - t0 > 0.01:
        return time.thread_time
    print("(this thread's CPU clock does not advance here: speeds are wall time)")
    return time.perf_counter


_clock = _pick_clock()
GiB = float(1 << 30)


def _blocks(a: np.ndarray) -> list[np.ndarray]:
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    step = BLOCK - BLOCK % a.dtype.itemsize
    return [raw[i:i + step] for i in range(0, raw.nbytes, step)] or [raw]


def measure(leaves: list[np.ndarray], codec: str) -> dict[str, float]:
    """Stored bytes and the best of 3 single-thread encode / decode times over all blocks of `leaves`."""
    work = [(b, a.dtype) for a in leaves for b in _blocks(a)]
    raw = sum(b.nbytes for b, _ in work)
    enc_t = dec_t = float("inf")
    for _ in range(3):
        t = _clock()
        stored = [_codecs.encode(codec, b, dt) for b, dt in work]
        enc_t = min(enc_t, _clock() - t)
        outs = [np.ones(b.nbytes, np.uint8) for b, _ in work]  # pages touched: decoding into target buffers
        t = _clock()
        for s, (b, dt), o in zip(stored, work, outs):
            _codecs.decode(codec, s, dt, b.nbytes, out=o)
        dec_t = min(dec_t, _clock() - t)
    for (b, _), o in zip(work, outs):
        assert np.array_equal(b, o)
    size = sum(len(s) for s in stored)
    return {"raw": raw, "stored": size, "ratio": raw / max(size, 1),
            "compress_gib_s": raw / max(enc_t, 1e-9) / GiB, "decompress_gib_s": raw / max(dec_t, 1e-9) / GiB}


def load_codecs(path: str) -> Any:
    """A `codecs.py` from another revision, imported as a module of its own: its relative imports are
    made absolute, those of its own package (``from . import blosc2lib``) against `cairn._codecs`."""
    import importlib.util

    with open(path) as f:
        text = f.read().replace("from .._", "from cairn._").replace("from . import", "from cairn._codecs import")
        text = re.sub(r"^from \.(\w)", r"from cairn._codecs.\1", text, flags=re.M)
    spec = importlib.util.spec_from_loader("cairn_codecs_against", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    exec(compile(text, path, "exec"), module.__dict__)
    return module


def interleaved(leaves: list[np.ndarray], modules: dict[str, Any], reps: int = 9) -> dict[str, dict[str, float]]:
    """Ratio and best compress / decompress GiB/s (thread CPU time) of "planes" per module, runs alternating."""
    work = [(b, a.dtype) for a in leaves for b in _blocks(a)]
    raw = sum(b.nbytes for b, _ in work)
    outs = [np.ones(b.nbytes, np.uint8) for b, _ in work]
    best = {name: {"stored": 0.0, "enc": float("inf"), "dec": float("inf")} for name in modules}
    names = list(modules)
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            m = modules[name]
            t = _clock()
            stored = [m.encode("planes", b, dt) for b, dt in work]
            enc = _clock() - t
            t = _clock()
            for s, (b, dt), o in zip(stored, work, outs):
                m.decode("planes", s, dt, b.nbytes, out=o)
            dec = _clock() - t
            assert all(np.array_equal(b, o) for (b, _), o in zip(work, outs)), name
            got = best[name]
            got["stored"] = sum(len(s) for s in stored)
            got["enc"], got["dec"] = min(got["enc"], enc), min(got["dec"], dec)
    return {name: {"ratio": raw / max(v["stored"], 1), "compress_gib_s": raw / v["enc"] / GiB,
                   "decompress_gib_s": raw / v["dec"] / GiB} for name, v in best.items()}


def whole_state(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    raw = sum(a.nbytes for a in flat.values())
    out: dict[str, Any] = {"raw": raw}
    chosen: dict[str, int] = {}
    stored = 0
    t = time.perf_counter()
    for a in flat.values():
        c = _choose.choose(a.dtype, _choose.sample(a))
        chosen[c] = chosen.get(c, 0) + 1
        stored += sum(len(_codecs.encode(c, b, a.dtype)) for b in _blocks(a))
    out["cairn_auto"] = stored
    out["cairn_auto_s"] = time.perf_counter() - t
    out["cairn_choices"] = chosen
    for level in (1, 3):
        z = zstandard.ZstdCompressor(level=level)
        out[f"zstd{level}_per_leaf"] = sum(len(z.compress(np.ascontiguousarray(a).tobytes())) for a in flat.values())
    return out


def coding_tasks(leaves: list[tuple[np.ndarray, str]], blocks: int) -> list[list[tuple[Any, ...]]]:
    """The tasks a compressed save codes `leaves` in (as `_save.engine` groups a file's chunks): a leaf
    over `blocks` blocks in runs of that many blocks, smaller leaves together up to as many bytes;
    each task a list of ``(codec, raw, block, dtype)`` for `codecs.encode_runs`."""
    tasks: list[list[tuple[Any, ...]]] = []
    group: list[tuple[Any, ...]] = []
    size = 0
    for a, c in leaves:
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        block = BLOCK - BLOCK % a.dtype.itemsize
        run = block * blocks
        if raw.nbytes > run:
            tasks += [[(c, raw[o:o + run], block, a.dtype)] for o in range(0, raw.nbytes, run)]
            continue
        group.append((c, raw, block, a.dtype))
        size += raw.nbytes
        if size >= run:
            tasks.append(group)
            group, size = [], 0
    return tasks + ([group] if group else [])


def scaling(flat: dict[str, np.ndarray], counts: list[int]) -> list[dict[str, float]]:
    """Whole-state encode and decode (each leaf's chosen codec, 1 MiB blocks) on n threads at once:
    wall time, best of 3, in GiB/s of raw bytes. Encoding codes the tasks a save codes
    (`coding_tasks`: runs of `RUN_BLOCKS` blocks, small leaves together; `codecs.encode_runs`),
    decoding a run of blocks per call (`codecs.decode_run`, as a load of a local file does). Shows
    whether the codecs scale over cores."""
    from concurrent.futures import ThreadPoolExecutor

    from cairn._save.pipeline import RUN_BLOCKS

    leaves = [(a, _choose.choose(a.dtype, _choose.sample(a))) for a in flat.values() if a.nbytes]
    tasks = coding_tasks(leaves, RUN_BLOCKS)
    runs = [r for t in tasks for r in t]
    raw = sum(r[1].nbytes for r in runs)
    stored = [_codecs.encode_run(*r) for r in runs]
    sizes = [[min(r[2], r[1].nbytes - o) for o in range(0, r[1].nbytes, r[2])] for r in runs]
    outs = [np.empty(r[1].nbytes, np.uint8) for r in runs]
    rows = []
    for n in counts:
        with ThreadPoolExecutor(n) as pool:
            enc = dec = float("inf")
            list(pool.map(_codecs.encode_runs, tasks[:n]))
            for _ in range(3):
                t = time.perf_counter()
                list(pool.map(_codecs.encode_runs, tasks))
                enc = min(enc, time.perf_counter() - t)
                t = time.perf_counter()
                list(pool.map(lambda i: _codecs.decode_run(runs[i][0], stored[i], runs[i][3], sizes[i], outs[i]),
                              range(len(runs))))
                dec = min(dec, time.perf_counter() - t)
        rows.append({"threads": n, "compress_gib_s": raw / enc / GiB, "decompress_gib_s": raw / dec / GiB,
                     "ratio": raw / sum(len(b) for bs in stored for b in bs)})
    for r, o in zip(runs, outs):
        assert np.array_equal(r[1], o)
    base = rows[0]
    for r in rows:
        print(f"  {r['threads']:3} threads: compress {r['compress_gib_s']:.2f} GiB/s "
              f"({r['compress_gib_s'] / base['compress_gib_s']:.1f}x), decompress {r['decompress_gib_s']:.2f} GiB/s "
              f"({r['decompress_gib_s'] / base['decompress_gib_s']:.1f}x), ratio {r['ratio']:.3f}")
    return rows


def orbax_bytes(state: dict[str, Any]) -> int | None:
    try:
        import jax
        import orbax.checkpoint as ocp
    except ImportError:
        return None
    tree = jax.tree.map(lambda x: jax.numpy.asarray(x), state)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt")
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, tree)
            ckptr.wait_until_finished()
        total = 0
        for root, _, files in os.walk(path):
            for f in files:
                total += os.path.getsize(os.path.join(root, f))
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=256 << 20)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-orbax", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--against", help="another codecs.py to measure 'planes' against, interleaved")
    ap.add_argument("--threads", help="also the whole state coded on these thread counts at once, e.g. 1,2,4")
    ap.add_argument("--threads-only", action="store_true", help="skip the per-kind and whole-state tables")
    args = ap.parse_args(argv)
    against = load_codecs(args.against) if args.against else None
    report: dict[str, Any] = {"size": args.size, "variants": {}}
    for variant in args.variants.split(","):
        t = time.perf_counter()
        state = make_state(args.size, variant)
        flat = flatten(state)
        print(f"\n== {variant}: {sum(a.nbytes for a in flat.values()) / 2**20:.1f} MiB raw, "
              f"{len(flat)} leaves (made in {time.perf_counter() - t:.1f} s)")
        kinds: dict[str, Any] = {}
        if args.threads_only:
            print(f"whole state on threads at once ({os.cpu_count()} cores, wall time):")
            report["variants"][variant] = {"threads": scaling(flat, [int(n) for n in (args.threads or "1").split(",")])}
            continue
        print(f"{'kind':6} {'dtype':9} {'MiB':>7} {'codec':7} {'ratio':>6} {'comp GiB/s':>10} {'dec GiB/s':>9}")
        for kind in ("params", "mu", "nu", "count"):
            leaves = [a for k, a in flat.items() if leaf_kind(k) == kind]
            kinds[kind] = {}
            for codec in _codecs.CODECS:
                m = measure(leaves, codec)
                kinds[kind][codec] = m
                print(f"{kind:6} {leaves[0].dtype!s:9} {m['raw'] / 2**20:7.1f} {codec:7} {m['ratio']:6.3f} "
                      f"{m['compress_gib_s']:10.2f} {m['decompress_gib_s']:9.2f}")
        if against is not None:
            print(f"'planes', {args.against} against this tree's, interleaved, best of 9 "
                  f"(load average {os.getloadavg()[0]:.1f}):")
            print("| kind | dtype | raw MiB | ratio them / now | compress GiB/s them / now | "
                  "decompress GiB/s them / now |\n|---|---|---|---|---|---|")
            for kind in ("params", "mu", "nu"):
                leaves = [a for k, a in flat.items() if leaf_kind(k) == kind]
                got = interleaved(leaves, {"them": against, "now": _codecs})
                kinds[kind]["against"] = got
                a, b = got["them"], got["now"]
                print(f"| {kind} | {leaves[0].dtype} | {sum(x.nbytes for x in leaves) / 2**20:.1f} | "
                      f"{a['ratio']:.3f} / {b['ratio']:.3f} | {a['compress_gib_s']:.2f} / {b['compress_gib_s']:.2f} | "
                      f"{a['decompress_gib_s']:.2f} / {b['decompress_gib_s']:.2f} |")
        w = whole_state(flat)
        if not args.no_orbax:
            w["orbax"] = orbax_bytes(state)
        raw = w["raw"]
        print(f"whole state: raw {raw / 2**20:.1f} MiB; cairn auto {w['cairn_auto'] / 2**20:.1f} MiB "
              f"({raw / w['cairn_auto']:.3f}x, choices {w['cairn_choices']}); zstd-1 per leaf "
              f"{w['zstd1_per_leaf'] / 2**20:.1f} MiB; zstd-3 per leaf {w['zstd3_per_leaf'] / 2**20:.1f} MiB")
        if w.get("orbax"):
            print(f"orbax StandardCheckpointer: {w['orbax'] / 2**20:.1f} MiB on disk; "
                  f"cairn auto / orbax = {w['cairn_auto'] / w['orbax']:.3f}; raw / orbax = {raw / w['orbax']:.3f}")
        if args.threads:
            print(f"whole state on threads at once ({os.cpu_count()} cores, wall time):")
            w["threads"] = scaling(flat, [int(n) for n in args.threads.split(",")])
        report["variants"][variant] = {"kinds": kinds, "whole": w}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
