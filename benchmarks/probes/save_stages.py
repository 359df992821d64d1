"""Where a save's time goes, stage by stage: ``python -m benchmarks.probe save_stages [--size 512000000]``.

Saves the bf16-f32 trained state of `benchmarks.trained_state` (or, with ``--tiles N``, N leaves of
256x256 cut from it: the small-leaves case) to a local folder with each ``--settings`` value of
``compression=`` (interleaved per repetition, blocking saves, fsync'd), and times its stages by
wrapping the functions that do them (no change to the library):

- ``choose``: `codecpolicy._choose_leaf` and `_choose_group` (each leaf's codec, or a group of small
  leaves', measured on its sample, for True / "auto"; while the first files are written, in a single
  process);
- ``pipe``: `snapshot.HostPipeline.take` / ``peek`` (a blocking save's consumers taking the device-to-host
  transfers the host-copy pipeline started ahead; waiting for a transfer shows in ``host``, where its
  bytes are read);
- ``host``: `SaveJob._host` (device-to-host copies; numpy leaves cost nothing here, ``--jax`` puts
  the state on JAX's first device first);
- ``code``: `pipeline.code_task` (coding tasks on the coder pool): the union of their spans (wall
  seconds some task was coding) and the sum (seconds over all coder threads, waits for the GIL and
  for the CPU included); ``code cpu``: the CPU time those threads spent in them (``time.thread_time``),
  and ``code faults``: the pages they faulted in (minor faults, ``RUSAGE_THREAD``, as MiB): a sum far
  above ``code cpu`` is threads waiting (for the GIL, or for cores), not coding;
- ``crc``: the CRC-32C calls of a full save (`pipeline.block_crc`, per coded or raw block, and
  `engine.block_crcs`, a raw chunk's blocks at once), summed over threads;
- ``write`` / ``fsync``: ``os.write`` / ``os.fsync`` in the local storage, union of spans and sum;
- ``wait``: a writer thread waiting for its next coded task (`pipeline.in_order`'s consumer);
- ``tail``: from the end of the last coding task to the end of the data phase (the writes and
  flushes left once coding is done: what overlapping them with the coding would remove);
- ``write_data``: `SaveJob.write_data`, the whole data phase; ``save``: the call. Every stage but
  ``choose`` is counted inside ``write_data``'s span (the commit's own writes and fsyncs are not).

``overlap`` is ``(code union + write union + fsync union) / write_data``: above 1 the stages ran
at once. Prints a table per setting (medians) and ``--json PATH`` writes every repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import cairn
from benchmarks.measure import setting
from benchmarks.trained_state import flatten, make_state, tiles
from cairn._codecs import codecs as _codecs
from cairn._save import codecpolicy, engine, pipeline
from cairn._storage import local as _local_storage


class Spans:
    """Spans (start, end) of calls to the wrapped functions, per stage, from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: dict[str, list[tuple[float, float]]] = {}

    def clear(self) -> None:
        with self.lock:
            self.spans = {}

    def add(self, stage: str, a: float, b: float) -> None:
        with self.lock:
            self.spans.setdefault(stage, []).append((a, b))

    def wrap(self, stage: str, fn: Any) -> Any:
        def timed(*args: Any, **kw: Any) -> Any:
            a = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.add(stage, a, time.perf_counter())
        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def summary(self) -> dict[str, float]:
        """Per stage: the sum, union and count of its spans inside `write_data`'s (the data phase:
        the commit's own writes and fsyncs are left out)."""
        out: dict[str, float] = {}
        with self.lock:
            window = self.spans.get("write_data", [(float("-inf"), float("inf"))])
            for stage, spans in self.spans.items():
                if stage in ("code_cpu", "code_faults"):  # amounts, not spans in time
                    out[f"{stage}_sum"] = sum(b for _, b in spans)
                    continue
                if stage not in ("write_data", "choose"):
                    spans = [(max(a, lo), min(b, hi)) for a, b in spans for lo, hi in window if b > lo and a < hi]
                out[f"{stage}_sum"] = sum(b - a for a, b in spans)
                out[f"{stage}_union"] = union(spans)
                out[f"{stage}_calls"] = len(spans)
            code = self.spans.get("code")
            if code and "write_data" in self.spans:  # the data phase left once the last block was coded
                out["tail_union"] = max(b for _, b in window) - max(b for _, b in code)
        return out


def union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class _Os:
    """The `os` module as the local storage sees it, with `write` and `fsync` timed."""

    def __init__(self, spans: Spans) -> None:
        self._spans = spans
        self.write = spans.wrap("write", os.write)
        self.fsync = spans.wrap("fsync", os.fsync)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def _waited(spans: Spans, fn: Any) -> Any:
    """`pipeline.in_order` with each wait of its consumer (a writer thread) for the next coded task timed."""
    def in_order(*args: Any, **kw: Any) -> Any:
        it = fn(*args, **kw)
        while True:
            a = time.perf_counter()
            try:
                x = next(it)
            except StopIteration:
                return
            finally:
                spans.add("wait", a, time.perf_counter())
            yield x
    return in_order


def _costed(spans: Spans, fn: Any) -> Any:
    """`fn` with the CPU time and the minor page faults of its thread during each call added up, as the spans
    ``code_cpu`` and ``code_faults`` (the latter's "span" a page count)."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", None)

    def costed(*args: Any, **kw: Any) -> Any:
        f0 = resource.getrusage(who).ru_minflt if who is not None else 0
        c0 = time.thread_time()
        try:
            return fn(*args, **kw)
        finally:
            spans.add("code_cpu", 0.0, time.thread_time() - c0)
            if who is not None:
                spans.add("code_faults", 0.0, float(resource.getrusage(who).ru_minflt - f0))
    return costed


def instrument(spans: Spans) -> None:
    # Each function is replaced where its callers look it up when they call it (`engine` calls
    # `pipeline.in_order`, `pipeline.code_task` and `pipeline.block_crc` through the module; `codecpolicy`'s
    # `_Choosing` calls its own `_choose_leaf` and `_choose_group`).
    pipeline.in_order = _waited(spans, pipeline.in_order)
    # each leaf measured (in the background too), and each group of small leaves
    codecpolicy._choose_leaf = spans.wrap("choose", codecpolicy._choose_leaf)
    codecpolicy._choose_group = spans.wrap("choose", codecpolicy._choose_group)
    from cairn._save import snapshot as _snapshot

    _snapshot.HostPipeline.take = spans.wrap("pipe", _snapshot.HostPipeline.take)  # waits for started transfers
    _snapshot.HostPipeline.peek = spans.wrap("pipe", _snapshot.HostPipeline.peek)
    pipeline.code_task = _costed(spans, spans.wrap("code", pipeline.code_task))
    pipeline.block_crc = spans.wrap("crc", pipeline.block_crc)
    engine.block_crcs = spans.wrap("crc", engine.block_crcs)
    engine.SaveJob._host = spans.wrap("host", engine.SaveJob._host)
    engine.SaveJob.write_data = spans.wrap("write_data", engine.SaveJob.write_data)
    _local_storage.os = _Os(spans)  # type: ignore[assignment]


class FifoPool(ThreadPoolExecutor):
    """The coder pool as it was before `pipeline.CodePool`: first come, first served (``--pools fifo``)."""

    def __init__(self, workers: int, name: str = "cairn-code") -> None:
        super().__init__(max(1, workers), thread_name_prefix=name)

    def submit(self, fn: Any, /, *args: Any, priority: Any = None, **kw: Any) -> Any:  # type: ignore[override]
        return super().submit(fn, *args, **kw)


POOLS = {"priority": pipeline.CodePool, "fifo": FifoPool}

STAGES = ("choose", "pipe", "host", "code", "wait", "crc", "write", "fsync", "tail", "write_data")


#: The stages `stage_line` prints (union seconds, inside the data phase but for ``choose``).
SHORT = ("choose", "pipe", "host", "code", "wait", "crc", "write", "fsync", "tail")


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def stage_line(rows: list[dict[str, float]]) -> str:
    """One line of median stage seconds over `rows` (`Spans.summary` of each save), for other benchmarks."""
    med = statistics.median
    parts = [f"{st} {med(r.get(f'{st}_union', 0.0) for r in rows):.2f}" for st in SHORT]
    parts.append(f"code sum {med(r.get('code_sum', 0.0) for r in rows):.2f}")
    parts.append(f"code cpu {med(r.get('code_cpu_sum', 0.0) for r in rows):.2f}")
    parts.append(f"code faults {med(r.get('code_faults_sum', 0.0) for r in rows) * _PAGE / 2**20:.0f} MiB")
    parts.append(f"write_data {med(r.get('write_data_sum', 0.0) for r in rows):.2f}")
    return ", ".join(parts)


def name(s: tuple[Any, str]) -> str:
    return f"{s[0]} ({s[1]})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=512_000_000, help="raw bytes of the trained state")
    ap.add_argument("--tiles", type=int, default=0, help="cut the state into this many 256x256 leaves instead")
    ap.add_argument("--settings", default="false,planes,blosc2", help="compression= values, comma separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="the save's writer threads")
    ap.add_argument("--pools", default="priority",
                    help="coder pools to compare, of priority (`pipeline.CodePool`) and fifo (a plain thread pool)")
    ap.add_argument("--share", default=None,
                    help="values of codecpolicy.SAMPLE_SHARE to compare (comma separated; a leaf's sample is at most "
                         "1/share of it)")
    ap.add_argument("--keep", default=None,
                    help="values of codecpolicy.KEEP_HOST_SHARE to compare (0: device chunks measured for a codec "
                         "are copied to host again by the writer)")
    ap.add_argument("--background", default=None,
                    help="values of engine.CHOOSE_IN_BACKGROUND to compare, 1 and/or 0 (0: every codec chosen "
                         "before any file is written, as before)")
    ap.add_argument("--pipeline", default=None,
                    help="values of engine.HOST_PIPELINE_BYTES to compare, in MiB (0: no host-copy pipeline, each "
                         "device chunk copied to host by its writer or the codec choosing)")
    ap.add_argument("--groups", default=None,
                    help="values of codecpolicy.GROUP_LEAVES to compare (1: each small leaf's codec measured "
                         "on its own)")
    ap.add_argument("--blosc2-join", default=None,
                    help="values of codecs.BLOSC2_JOIN_BYTES to compare, in KiB (0: each blosc2 chunk kept as "
                         "python-blosc2 returned it)")
    ap.add_argument("--jax", action="store_true", help="put the state on JAX's first device first")
    ap.add_argument("--as-device", action="store_true",
                    help="with --jax on a CPU-only host: treat its arrays' host views as device-to-host copies "
                         "(codecpolicy.fresh_copy), so the host-copy pipeline and kept copies run as on an accelerator "
                         "(a rehearsal of their overhead; the copies themselves stay free)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    flat = flatten(make_state(args.size, "bf16-f32"))
    state: Any = tiles(flat, args.tiles) if args.tiles else flat
    raw = sum(np.asarray(a).nbytes for a in state.values())
    if args.jax:
        import jax

        state = jax.block_until_ready(jax.device_put(state, jax.devices()[0]))
        print(f"on {jax.devices()[0]}", flush=True)
        if args.as_device:
            codecpolicy.fresh_copy = lambda src: not isinstance(src, np.ndarray)
    shares = [int(x) for x in args.share.split(",")] if args.share else [codecpolicy.SAMPLE_SHARE]
    keeps = [float(x) for x in args.keep.split(",")] if args.keep else [codecpolicy.KEEP_HOST_SHARE]
    bgs = [int(x) for x in args.background.split(",")] if args.background else [int(engine.CHOOSE_IN_BACKGROUND)]
    pipes = [int(x) for x in args.pipeline.split(",")] if args.pipeline else [engine.HOST_PIPELINE_BYTES >> 20]
    grps = [int(x) for x in args.groups.split(",")] if args.groups else [codecpolicy.GROUP_LEAVES]
    joins = [int(x) for x in args.blosc2_join.split(",")] if args.blosc2_join else [_codecs.BLOSC2_JOIN_BYTES >> 10]
    settings = [(setting(s), pool + (f", share {sh}" if args.share else "") + (f", keep {kp}" if args.keep else "")
                 + (f", background {bg}" if args.background else "") + (f", pipeline {pp}" if args.pipeline else "")
                 + (f", groups {gr}" if args.groups else "") + (f", join {jn}" if args.blosc2_join else ""))
                for pool in args.pools.split(",") for sh in shares for kp in keeps for bg in bgs
                for pp in pipes for gr in grps for jn in joins for s in args.settings.split(",")]
    print(f"{len(state)} leaves, {raw / 2**20:.1f} MiB raw; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    spans = Spans()
    instrument(spans)
    runs: dict[str, list[dict[str, Any]]] = {name(s): [] for s in settings}
    root = tempfile.mkdtemp(prefix="cairn-stages-", dir=args.workdir)
    try:
        for _ in range(args.reps):
            for s, pool in settings:
                path = os.path.join(root, f"c-{s}")
                shutil.rmtree(path, ignore_errors=True)
                pipeline.CodePool = POOLS[pool.split(",")[0]]  # type: ignore[misc,assignment]
                knobs = dict(x.strip().split(" ") for x in pool.split(",")[1:])
                if "share" in knobs:
                    codecpolicy.SAMPLE_SHARE = int(knobs["share"])
                if "keep" in knobs:
                    codecpolicy.KEEP_HOST_SHARE = float(knobs["keep"])
                if "background" in knobs:
                    engine.CHOOSE_IN_BACKGROUND = bool(int(knobs["background"]))
                if "pipeline" in knobs:
                    engine.HOST_PIPELINE_BYTES = int(knobs["pipeline"]) << 20
                if "groups" in knobs:
                    codecpolicy.GROUP_LEAVES = int(knobs["groups"])
                if "join" in knobs:
                    _codecs.BLOSC2_JOIN_BYTES = int(knobs["join"]) << 10
                spans.clear()
                t = time.perf_counter()
                stats = cairn.save(path, state, compression=s, threads=args.threads)
                row: dict[str, Any] = {"save": time.perf_counter() - t, **spans.summary(),
                                       "bytes_written": stats.bytes_written, "decision": stats.compression}
                runs[name((s, pool))].append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print("\nseconds, median of each setting's repetitions (union: wall seconds the stage was running "
          "anywhere; sum: over all threads)")
    head = ["setting", "stored/raw", "save", *(f"{st} {k}" for st in STAGES[:-1] for k in (("union",) if st == "tail" else ("union", "sum"))),
            "write_data", "overlap"]
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    out = []
    for s in settings:
        rs = runs[name(s)]

        def m(key: str, rs: list[dict[str, Any]] = rs) -> float:
            return med(r.get(key, 0.0) for r in rs)

        serial = m("code_union") + m("write_union") + m("fsync_union")
        cells = [name(s), f"{m('bytes_written') / raw:.3f}", f"{m('save'):.2f}",
                 *(f"{m(f'{st}_{k}'):.2f}" for st in STAGES[:-1] for k in (("union",) if st == "tail" else ("union", "sum"))),
                 f"{m('write_data_sum'):.2f}", f"{serial / max(m('write_data_sum'), 1e-9):.2f}"]
        print("| " + " | ".join(cells) + " |")
        out.append({"setting": name(s), "runs": rs, "decision": rs[-1]["decision"]})
    for r in out:
        print(f"{r['setting']}: {r['decision']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"raw": raw, "leaves": len(state), "cores": os.cpu_count(), "settings": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
