"""Where a load's time goes, stage by stage:
``python -m benchmarks.probe load_stages [--mib 256] [--targets numpy,jax] [--orbax]``.

Saves the trained state of `benchmarks.trained_state` (bf16 parameters, f32 AdamW moments) to a local
folder with ``compression=False`` and ``True``, then loads each back (numpy targets, and with ``jax``
onto JAX's first device: ``ShapeDtypeStruct`` targets with its sharding), the cases interleaved per
repetition (every other round in reverse order), and times the load's stages by wrapping the
functions that do them (no change to the library):

- ``read``: `ChunkReader._fill` (storage reads into buffers), union of spans (wall seconds some
  thread was reading) and sum (thread-seconds);
- ``crc``: `BlockChecks._crc` (CRC-32C of stored blocks), union and sum;
- ``decode``: `codecs.decode_run` and `codecs.decode` (outermost call only), union and sum;
- ``land``: the loading thread placing arrays (`engine._assemble`, `PutBatch.flush`: host-to-device
  puts, casts), union;
- ``wait``: the loading thread waiting for reads (``Future.result`` on it), sum;
- ``ready``: ``jax.block_until_ready`` after the load returns (device transfers still running);
- ``load``: the call. ``cores`` is the sum of the thread stages over ``load``: how many cores the
  load kept busy on average with reading, checking and decoding.

``--settings`` names `decodepool.DECODE_THREADS` values to compare in one run: ``0`` decodes in the reader
threads alone, ``auto`` on the decode pool (one thread per core); each may add, joined by
``+``, ``p8`` (`decodepool.DECODE_PIECE` in MiB), ``nolend`` (new host buffers for every load, not lent
from `buffers.load_pool`), ``spread`` (a compressed read's pieces queued on the pool and waited for,
`reader.CODED_SHARED` off), ``c16`` (`landing.CODED_PART` in MiB; ``whole``: large chunks read whole, not in
parts), ``pool`` (a compressed read decoded in place shares its pieces with the decode pool,
`reader.PART_POOL` on), ``lateputs`` (small leaves placed on the
device only after the last read, `engine.EARLY_PUT_ITEMS` off; ``e128``: placed
once 128 wait) and ``t12`` (``load(threads=12)``): ``--settings auto,auto+nolend,auto+spread,auto+whole``.
``--ab SRC`` instead compares this tree against another checkout's ``src`` (e.g. ``/work/main/src``): each
load runs in a child process of either tree, alternated, on the same saved checkpoints (after a warm-up load
in that process; ``--first``: the child's first load, a restart's, its stages timed).

``--orbax`` adds Orbax's ``StandardCheckpointer`` (its default zstd) saving the state from the device
and restoring it onto the device, in the same rounds. Prints medians per case and the ratios
compressed / raw and / Orbax; ``--json PATH`` writes every repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any

MiB = 1 << 20
THREAD_STAGES = ("read", "crc", "decode")


class Spans:
    """(start, end) spans per stage from any thread; a stage nested in itself counts once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self.depth = threading.local()

    def add(self, stage: str, a: float, b: float) -> None:
        with self.lock:
            self.spans.setdefault(stage, []).append((a, b))

    def wrap(self, owner: Any, name: str, stage: str, main_only: bool = False) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return
        spans = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if main_only and threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)
            d = getattr(spans.depth, stage, 0)
            setattr(spans.depth, stage, d + 1)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(spans.depth, stage, d)
                if d == 0:
                    spans.add(stage, t, time.perf_counter())

        setattr(owner, name, timed)

    def summary(self, total: float) -> dict[str, float]:
        out = {"load": total}
        for stage, ss in self.spans.items():
            out[f"{stage}_sum"] = sum(b - a for a, b in ss)
            out[f"{stage}_union"] = _union(ss)
        out["cores"] = sum(out.get(f"{s}_sum", 0.0) for s in THREAD_STAGES) / total if total else 0.0
        return out


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def instrument(spans: Spans) -> None:
    from cairn._codecs import codecs
    from cairn._core import checksum
    from cairn._load import engine, reader
    from cairn._tree import shardings

    spans.wrap(reader.ChunkReader, "_fill", "read")
    spans.wrap(checksum.BlockChecks, "_crc", "crc")
    spans.wrap(codecs, "decode_run", "decode")
    spans.wrap(codecs, "decode", "decode")
    spans.wrap(engine, "_assemble", "land", main_only=True)
    spans.wrap(shardings.PutBatch, "flush", "land", main_only=True)
    spans.wrap(Future, "result", "wait", main_only=True)


def _number(parts: list[str], prefix: str, default: int) -> int:
    """The number of the first of `parts` that is `prefix` then digits (``p8``: 8), else `default`."""
    return next((int(p[1:]) for p in parts if p[:1] == prefix and p[1:].isdigit()), default)


def set_decode_threads(value: str) -> int | None:
    """Apply a ``--settings`` value: `decodepool.DECODE_THREADS` (``auto`` or a number), then, joined by
    ``+``, ``p<MiB>`` for `decodepool.DECODE_PIECE`, ``nolend`` for new load buffers
    (`reader.LEND_LOAD_BUFFERS` False), ``spread`` for `reader.CODED_SHARED` False, ``c<MiB>`` for
    `landing.CODED_PART` (``whole``: a large chunk's coded read is never cut into parts), ``pool`` for
    `reader.PART_POOL` True and ``t<N>`` for
    ``load(threads=N)``, the load's reader threads (returned; None: ``--threads``). Each value sets all of them, so a setting never inherits another's."""
    try:  # the decode pool's settings (in `reader` before they had a module of their own)
        from cairn._load import decodepool as pool
    except ImportError:
        from cairn._load import reader as pool  # type: ignore[no-redef]
    from cairn._load import reader

    first, *rest = value.split("+")
    if hasattr(pool, "DECODE_THREADS"):
        pool.DECODE_THREADS = None if first == "auto" else int(first)
    if hasattr(pool, "DECODE_PIECE"):
        pool.DECODE_PIECE = _number(rest, "p", 4) << 20
    if hasattr(reader, "LEND_LOAD_BUFFERS"):
        reader.LEND_LOAD_BUFFERS = "nolend" not in rest
    if hasattr(reader, "CODED_SHARED"):
        reader.CODED_SHARED = "spread" not in rest
    from cairn._load import landing

    if hasattr(landing, "CODED_PART"):
        landing.CODED_PART = (1 << 62) if "whole" in rest else _number(rest, "c", 8) << 20
    if hasattr(reader, "PART_POOL"):
        reader.PART_POOL = "pool" in rest
    from cairn._load import engine

    if hasattr(engine, "EARLY_PUT_ITEMS"):
        engine.EARLY_PUT_ITEMS, engine.EARLY_PUT_BYTES = (
            (1 << 62, 1 << 62) if "lateputs" in rest else (_number(rest, "e", 32), 4 << 20))
    return _number(rest, "t", 0) or None  # (t0 is no thread count: the caller's --threads, as None)


def load_once(path: str, use_jax: bool, threads: int, spans: Spans | None) -> dict[str, float]:
    import cairn

    target = None
    if use_jax:
        import jax

        dev = jax.devices()[0]
        sharding = jax.sharding.SingleDeviceSharding(dev)
        meta = cairn.metadata(path)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), meta,
                              is_leaf=lambda x: isinstance(x, cairn.ArrayMetadata))
    if spans is not None:
        spans.spans = {}
    t0 = time.perf_counter()
    out = cairn.load(path, target, threads=threads)
    t1 = time.perf_counter()
    if use_jax:
        import jax

        jax.block_until_ready(out)
    t2 = time.perf_counter()
    row = spans.summary(t1 - t0) if spans is not None else {"load": t1 - t0}
    row["ready"] = t2 - t1
    row["total"] = t2 - t0
    return row


def _child(args: argparse.Namespace) -> int:
    spans = Spans()
    instrument(spans)
    if not args.first:
        load_once(args.path, args.jax, args.threads, spans)  # warm: imports, pools, compilation
    elif args.jax:  # as `restart_load`: the device and its runtime started, not timed
        import jax

        jax.block_until_ready(jax.device_put(0.0, jax.devices()[0]))
    rows = [load_once(args.path, args.jax, args.threads, spans) for _ in range(args.reps)]
    print("ROWS " + json.dumps(rows))
    return 0


def _line(rows: list[dict[str, float]]) -> str:
    med = statistics.median
    keys = ["total", "load", "ready", "read_union", "read_sum", "crc_sum", "decode_union", "decode_sum",
            "land_union", "wait_sum", "cores"]
    return ", ".join(f"{k} {med(r.get(k, 0.0) for r in rows):.3f}" for k in keys)


def _orbax(path: str, state: Any) -> Any:
    """Save `state` with Orbax's StandardCheckpointer (its default zstd) from JAX's first device; a
    function that restores it there, timed as a load (``total``)."""
    import jax
    import orbax.checkpoint as ocp

    dev = jax.devices()[0]
    on_device = jax.block_until_ready(jax.device_put(state, dev))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, on_device)
    ckptr.wait_until_finished()
    sharding = jax.sharding.SingleDeviceSharding(dev)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), on_device)
    del on_device

    def restore() -> dict[str, float]:
        t0 = time.perf_counter()
        jax.block_until_ready(ckptr.restore(path, target))
        return {"total": time.perf_counter() - t0}
    return restore


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="raw size of the state (MiB)")
    ap.add_argument("--variant", default="bf16-f32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8, help="load(threads=)")
    ap.add_argument("--targets", default="numpy", help="of numpy and jax (onto JAX's first device)")
    ap.add_argument("--jax", action="store_true", help="the same as --targets jax")
    ap.add_argument("--orbax", action="store_true", help="also Orbax's StandardCheckpointer restoring onto the device")
    ap.add_argument("--compression", default="False,True", help="compression= values of the saves")
    ap.add_argument("--settings", default="0,auto",
                    help="decodepool.DECODE_THREADS values to compare, each with +p<MiB>, +nolend, +spread, +c<MiB>, +whole, +pool, +lateputs, +e<N>, "
                         "+t<N> (see above)")
    ap.add_argument("--ab", default=None, help="another tree's src folder: compare its loads with this tree's")
    ap.add_argument("--first", action="store_true",
                    help="with --ab: time each child's first load (a restart's), not a load after a warm-up one")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)

    import cairn
    from benchmarks.trained_state import make_state

    targets = ["jax"] if args.jax else args.targets.split(",")
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}", flush=True)
    t0 = time.perf_counter()
    state = make_state(args.mib * MiB, args.variant)
    print(f"state built in {time.perf_counter() - t0:.0f} s", flush=True)
    work = tempfile.mkdtemp(prefix="cairn-load-stages-", dir=args.workdir)
    paths = {}
    for c in args.compression.split(","):
        comp: Any = {"False": False, "True": True}.get(c, c)
        paths[c] = os.path.join(work, f"ckpt-{c}")
        saved = cairn.save(paths[c], state, compression=comp)
        print(f"saved compression={c}: {saved.bytes_written / MiB:.0f} MiB stored; {saved.compression}", flush=True)
    raw = sum(x.nbytes for x in _leaves(state))
    restore = _orbax(os.path.join(work, "orbax"), state) if args.orbax else None
    del state
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    settings = ["A", "B"] if args.ab else args.settings.split(",")
    trees = {"A": args.ab or "", "B": os.path.join(here, "src")}
    cases: list[tuple[str, str, str]] = [(c, t, s) for t in targets for c in paths for s in settings]
    if restore is not None:
        cases.append(("orbax", "jax", "-"))
    spans = Spans()
    if not args.ab:
        instrument(spans)
    runs: dict[tuple[str, str, str], list[dict[str, float]]] = {k: [] for k in cases}
    try:
        if not args.ab:
            for c, t, s in cases:  # warm: imports, compilation, each setting's decode pool started
                if c != "orbax":
                    load_once(paths[c], t == "jax", set_decode_threads(s) or args.threads, None)
        if restore is not None:
            restore()
        for rep in range(args.reps):
            for c, t, s in (cases if rep % 2 == 0 else cases[::-1]):  # each order as often: no case always first
                if c == "orbax":
                    assert restore is not None
                    runs[(c, t, s)].append(restore())
                elif args.ab:
                    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                        p for p in (trees[s], here, os.environ.get("PYTHONPATH")) if p))
                    cmd = [sys.executable, "-m", "benchmarks.probe", "load_stages", "--child", "--path", paths[c],
                           "--reps", "1", "--threads", str(args.threads)] + (["--jax"] if t == "jax" else []) + (
                               ["--first"] if args.first else [])
                    got = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                    line = [ln for ln in got.stdout.splitlines() if ln.startswith("ROWS ")]
                    if got.returncode or not line:
                        raise RuntimeError(f"child {s} failed: {got.stderr[-2000:]}")
                    runs[(c, t, s)] += json.loads(line[0][5:])
                else:
                    runs[(c, t, s)].append(load_once(paths[c], t == "jax", set_decode_threads(s) or args.threads, spans))
            print(f"round {rep + 1}/{args.reps}, load average {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    label = {"A": f"A {args.ab}", "B": "B this tree"} if args.ab else {}
    print(f"\n{raw / MiB:.0f} MiB raw, threads={args.threads}; medians, seconds:")
    for (c, t, s), rows in runs.items():
        print(f"  {t}, compression={c}, {label.get(s, f'DECODE_THREADS={s}')}: {_line(rows)}")
    print("ratios of medians of total (load and ready):")
    total = {k: med(r["total"] for r in rows) for k, rows in runs.items()}
    first = settings[0]
    for (c, t, s), v in total.items():
        if c == "orbax":
            continue
        raw_same = total.get(("False", t, s))
        parts = [f"/ {first} {v / total[(c, t, first)]:.2f}"]
        if raw_same:
            parts.append(f"/ raw same setting {v / raw_same:.2f}")
        if (first_raw := total.get(("False", t, first))) is not None:
            parts.append(f"/ raw {first} {v / first_raw:.2f}")
        if ("orbax", "jax", "-") in total and t == "jax":
            parts.append(f"/ Orbax {v / total[('orbax', 'jax', '-')]:.2f}")
        print(f"  {t}, compression={c}, {label.get(s, s)}: " + ", ".join(parts))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw_bytes": raw, "cores": os.cpu_count(),
                       "runs": {"|".join(k): rows for k, rows in runs.items()}}, f, indent=1)
    return 0


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    return [tree]


if __name__ == "__main__":
    raise SystemExit(main())
