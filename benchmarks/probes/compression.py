"""Compression on vs off, in one run: bytes on disk, save and load time of a trained state.

    python -m benchmarks.probe compression [--mib 256] [--variant bf16-f32] [--reps 3] [--json out.json]
    python -m benchmarks.probe compression --mib 1024 --storages moto,azurite --settings false,auto --no-async
    python -m benchmarks.probe compression --mib 64 --storages moto,azurite --settings false,true,auto \
        --values trained,random --reps 5 --no-async --link 1GB/s,10ms

The state is `benchmarks.trained_state.make_state` (a small GPT-like model
after AdamW steps; numpy arrays, so no device copies are timed). For each
storage (a local folder, the in-process ``memory://`` object store, and with
``--storages`` moto's S3 server and Azurite's blob service, each on 127.0.0.1 in
a process of its own, started as `benchmarks.probes.objstore` starts them) and
each setting of ``compression=`` (False: raw blocks, format version 2; True: a
codec per leaf by measurement, version 3; "auto": True on object stores, False
on a local disk) it saves the state `reps` times
and loads it back as numpy as many times, and reports the median times, the
bytes written (data files, as `SaveStats.bytes_written` counts them) and the
bytes a load reads (`LoadStats.bytes_read`). Settings are interleaved per
repetition, in an order that rotates from one repetition to the next, so that a change in the
machine's load (and the place in the order) hits them alike. What
``"auto"`` does is printed beside: on a local disk it is the False row, on
an object store the True row.

``--values random`` adds (or gives instead) a state of the same leaves filled with random bits,
which no codec shrinks. ``--link`` puts every object-store server behind a shaped link.

Each setting keeps its own history of what was measured ("auto" prices each save with the
bandwidth and codec speed that earlier saves and loads of the process measured,
`cairn._storage.measured` and `cairn._save.codecpolicy.CodecMeter`): "auto"'s rows are what a process
saving only with "auto" gets (its first save at the defaults, the next ones with its own
measurements), not helped by the raw saves of the False rows beside it. The table gives, per
storage and values, "auto"'s median over the faster of the other settings' medians, for the save
and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from typing import Any

import cairn
from benchmarks.trained_state import flatten, make_state, raw_bytes

MiB = 1 << 20


STORAGES = ("local", "memory", "moto", "azurite")


def _one(path: str, state: Any, compression: Any, opts: dict[str, Any] | None,
         timed_async: bool = True) -> dict[str, Any]:
    t0 = time.perf_counter()
    saved = cairn.save(path, state, compression=compression, overwrite=True, storage_options=opts)
    t_save = time.perf_counter() - t0
    ls = cairn.LoadStats()
    t0 = time.perf_counter()
    cairn.load(path, stats=ls, storage_options=opts)
    t_load = time.perf_counter() - t0
    out = {"save_s": t_save, "load_s": t_load, "bytes_written": saved.bytes_written, "bytes_read": ls.bytes_read,
           "async_blocking_s": float("nan"), "async_total_s": float("nan"), "decision": saved.compression}
    if timed_async:
        fut = cairn.save_async(path, state, compression=compression, overwrite=True, storage_options=opts)
        done = fut.result()  # its stats: blocking_s is the caller's wait (validation and the snapshot)
        out.update(async_blocking_s=done.blocking_s, async_total_s=done.total_s)
    return out


def random_like(state: Any, seed: int = 1) -> Any:
    """`state` with every array's bytes replaced by random ones (the same leaves, shapes and dtypes)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if isinstance(state, dict):
        return {k: random_like(v, seed + i) for i, (k, v) in enumerate(state.items())}
    a = np.asarray(state)
    return rng.integers(0, 256, a.nbytes, np.uint8).view(a.dtype).reshape(a.shape)


class _Histories:
    """One history of measurements (link bandwidths, codec factor) per setting, swapped in before each
    of its saves, so that "auto" sees only what its own saves and loads measured. Does nothing on a
    tree without measurements (the "before" of a comparison)."""

    def __init__(self) -> None:
        try:
            from cairn._storage.measured import METER
        except ImportError:
            self.meters = None
            return
        try:
            from cairn._save.codecpolicy import CODEC_METER
        except ImportError:  # a tree from before the codec policy had a module of its own
            from cairn._save.options import CODEC_METER  # type: ignore[attr-defined,no-redef]
        self.meters = (METER, CODEC_METER)
        self.saved: dict[Any, tuple[Any, Any]] = {}
        self.current: Any = None

    def use(self, setting: Any) -> None:
        if self.meters is None:
            return
        link, codec = self.meters
        if self.current is not None:
            self.saved[self.current] = (link._links, codec._factors)
        from collections import deque

        link._links, codec._factors = self.saved.get(setting, ({}, deque(maxlen=codec.KEEP)))
        self.current = setting


def _setting(text: str) -> Any:
    return {"false": False, "true": True}.get(text.lower(), text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="raw size of the state (MiB)")
    ap.add_argument("--variant", default="bf16-f32", help="trained_state variant: bf16-f32, bf16-bf16, f32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="local folder for the local-disk rows (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--storages", default="local,memory", help=f"comma-separated, of {', '.join(STORAGES)}")
    ap.add_argument("--settings", default="false,true", help="compression= values to compare (false, true, auto, ...)")
    ap.add_argument("--no-async", action="store_true", help="skip the save_async run of each repetition")
    ap.add_argument("--values", default="trained", help="comma-separated: trained (the trained state), "
                    "random (the same leaves, random bytes)")
    ap.add_argument("--shared-history", action="store_true", help="let every setting's saves and loads feed "
                    "the measurements \"auto\" prices with (default: each setting its own)")
    ap.add_argument("--link", default=None, metavar="SPEC", help="the servers' requests through a shaped link "
                    "(tests/_shapedlink.py), e.g. 1GB/s,10ms")
    args = ap.parse_args(argv)
    kinds = [k for k in args.storages.split(",") if k]
    unknown = sorted(set(kinds) - set(STORAGES))
    if unknown:
        ap.error(f"unknown storages {unknown}; known: {', '.join(STORAGES)}")
    t0 = time.perf_counter()
    trained = make_state(args.mib * MiB, args.variant)
    values = [v for v in args.values.split(",") if v]
    states = {v: trained if v == "trained" else random_like(trained) for v in values}
    raw = raw_bytes(trained)
    print(f"state: {args.variant}, {raw / MiB:.1f} MiB raw ({len(flatten(trained))} leaves), values {values}, "
          f"built in {time.perf_counter() - t0:.1f} s; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    histories = _Histories()
    work = tempfile.mkdtemp(prefix="cairn-cmp-", dir=args.workdir)
    where: dict[str, tuple[str, dict[str, Any] | None]] = {}
    servers = []
    settings = [_setting(c) for c in args.settings.split(",") if c]
    runs: dict[tuple[str, Any], list[dict[str, float]]] = {}
    try:
        for kind in kinds:
            if kind == "local":
                where[kind] = (os.path.join(work, "ckpt"), None)
            elif kind == "memory":
                where[kind] = (f"memory://bench-{uuid.uuid4().hex}/ckpt", None)
            else:  # a loopback server in its own process
                from benchmarks.probes.objstore import start

                server = start(kind)
                servers.append(server)
                opts = server.options()
                if args.link:  # every request through a bandwidth and latency limit
                    import sys
                    from pathlib import Path

                    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
                    from _shapedlink import ShapedLink

                    link = ShapedLink.parse(args.link, server.port).start()
                    servers.append(link)
                    opts = {**opts, "endpoint": link.endpoint}
                where[kind] = (server.url(server.bucket(), "ckpt"), opts)
        runs = {(s, v, c): [] for s in where for v in values for c in settings}
        for rep in range(args.reps):
            order = settings[rep % len(settings):] + settings[:rep % len(settings)]  # no setting always first
            for s, (path, opts) in where.items():
                for v in values:
                    for c in order:
                        if not args.shared_history:
                            histories.use(c)
                        runs[(s, v, c)].append(_one(f"{path}-{v}", states[v], c, opts, not args.no_async))
            print(f"  repetition done, load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for server in servers:
            server.stop()
    rows = []
    print("\n| storage | values | compression | auto picks it | bytes written | ratio | save s | load s | "
          "save MiB/s | load MiB/s | async blocking s | async total s |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (s, v, c), rs in runs.items():
        save_s = statistics.median(r["save_s"] for r in rs)
        load_s = statistics.median(r["load_s"] for r in rs)
        written = rs[-1]["bytes_written"]
        auto = c == "auto" or (s != "local") == (c is True)
        blocking = statistics.median(r["async_blocking_s"] for r in rs)
        async_total = statistics.median(r["async_total_s"] for r in rs)
        rows.append({"storage": s, "values": v, "compression": c, "auto": auto, "raw_bytes": raw, "bytes_written": written,
                     "bytes_read": rs[-1]["bytes_read"], "save_s": save_s, "load_s": load_s,
                     "async_blocking_s": blocking, "async_total_s": async_total, "all": rs})
        print(f"| {s} | {v} | {c} | {'yes' if auto else ''} | {written / MiB:.1f} MiB | {raw / written:.3f} | "
              f"{save_s:.2f} | {load_s:.2f} | {raw / MiB / save_s:.0f} | {raw / MiB / load_s:.0f} | "
              f"{blocking:.3f} | {async_total:.2f} |" + (f" {rs[-1]['decision']}" if c == "auto" else ""))
    ratios = _auto_ratios(rows)
    if ratios:
        print("\n| storage | values | auto save / faster of the others | auto load / faster | auto's decisions |\n"
              "|---|---|---|---|---|")
        for r in ratios:
            print(f"| {r['storage']} | {r['values']} | {r['save']:.2f}x | {r['load']:.2f}x | {r['decisions']} |")
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        for r in rows:  # JSON-friendly: NaN (no async run) as null
            r["async_blocking_s"], r["async_total_s"] = (None if x != x else x for x in
                                                         (r["async_blocking_s"], r["async_total_s"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variant": args.variant, "raw_bytes": raw, "link": args.link, "rows": rows,
                       "auto_ratios": ratios, "load_average_after": os.getloadavg()}, f, indent=1)
    return 0


def _auto_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per storage and values: "auto"'s median save and load over the faster of the other settings'."""
    out = []
    for r in rows:
        if r["compression"] != "auto":
            continue
        others = [o for o in rows if o["storage"] == r["storage"] and o["values"] == r["values"]
                  and o["compression"] != "auto"]
        if not others:
            continue
        decisions = sorted({x["decision"] for x in r["all"]})
        out.append({"storage": r["storage"], "values": r["values"],
                    "save": r["save_s"] / min(o["save_s"] for o in others),
                    "load": r["load_s"] / min(o["load_s"] for o in others),
                    "decisions": " / ".join(x["decision"] for x in r["all"]) if len(decisions) > 1 else decisions[0]})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
