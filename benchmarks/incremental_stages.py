"""Where an incremental save's time goes, beside a full save's: ``python -m benchmarks.incremental_stages``.

The ``lr1e-6`` and ``pretrain`` cases of `benchmarks.incremental` (the bf16-f32 trained-like state,
one AdamW step per save at lr 1e-6 or 3e-4), saved per step in full and incrementally against the
previous incremental step (alternated, raw, local disk, fsync'd, each after an ``os.sync()``), with
their stages timed by wrapping the functions that do them (no change to the library; the wrappers of
`benchmarks.save_stages`):

- ``open``: `Incremental.open` (the base's manifest and block records read);
- ``run``: `incremental._run` (a task of up to `RUN_BLOCKS` blocks on the coder pool: hash, compare,
  delta, CRC): union and sum of its spans, and ``run cpu``, its threads' CPU time in it;
- ``hash``, ``delta`` (`_try_delta`, which reads the base block), ``crc`` (all CRC-32C calls):
  sums over threads;
- ``write`` / ``fsync``: ``os.write`` / ``os.fsync`` of the local storage (union);
- ``first write``: from the start of the data phase to its first ``os.write``;
- ``write_data``: the data phase; ``commit``: `SaveJob._write_parts` + `_commit`; ``save``: the call;
  ``cpu``: the process's CPU time over the save.

Then the last full and the last incremental step are loaded (numpy targets) ``--load-reps`` times each,
alternated, with the load's stages timed as `benchmarks.load_stages` times them (``read``, ``crc``,
``decode``, ``wait``), plus ``delta`` (`_load.blocks.apply_delta`, sum), ``blocks``
(`_load.blocks.read_blocks`: a leaf with references or deltas read block by block, union and sum) and
``index`` (`binindex.ChunkTable._decode`, the version-4 records, sum).

Prints medians per case and kind, and ``--json PATH`` writes every save's and load's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

import cairn
from benchmarks import load_stages
from benchmarks.incremental import _adamw
from benchmarks.save_stages import Spans, _costed, _Os, union
from benchmarks.trained_state import make_state
from cairn._save import engine
from cairn._save import incremental as inc
from cairn._storage import local as _local_storage

CASES = {"lr1e-6": 1e-6, "pretrain": 3e-4}


def instrument(spans: Spans) -> None:
    inc.Incremental.open = spans.wrap("open", inc.Incremental.open)
    inc._run = _costed(spans, spans.wrap("run", inc._run))
    inc.block_hash = spans.wrap("hash", inc.block_hash)
    inc._try_delta = spans.wrap("delta", inc._try_delta)
    inc.crc32c = spans.wrap("crc", inc.crc32c)
    engine.crc32c = spans.wrap("crc", engine.crc32c)
    engine.block_crcs = spans.wrap("crc", engine.block_crcs)
    engine.SaveJob.write_data = spans.wrap("write_data", engine.SaveJob.write_data)
    engine.SaveJob._write_parts = spans.wrap("commit", engine.SaveJob._write_parts)
    engine.SaveJob._commit = spans.wrap("commit", engine.SaveJob._commit)
    _local_storage.os = _Os(spans)  # type: ignore[assignment]


def summarize(spans: Spans, save_s: float, cpu_s: float) -> dict[str, float]:
    s = spans.spans
    out: dict[str, float] = {"save": save_s, "cpu": cpu_s}
    for st in ("open", "run", "hash", "delta", "crc", "write", "fsync", "write_data", "commit"):
        got = s.get(st, [])
        out[f"{st}_sum"] = sum(b - a for a, b in got)
        out[f"{st}_union"] = union(got)
        out[f"{st}_calls"] = len(got)
    out["run_cpu"] = sum(b for _, b in s.get("code_cpu", []))
    wd = s.get("write_data", [])
    writes = s.get("write", [])
    if wd and writes:
        out["first_write"] = min(a for a, _ in writes) - wd[0][0]
        out["last_write"] = max(b for _, b in writes) - wd[0][0]
    fs = s.get("fsync", [])
    if wd and fs:
        out["last_fsync"] = max(b for _, b in fs) - wd[0][0]
    return out


def instrument_load(spans: load_stages.Spans) -> None:
    from cairn._format import binindex
    from cairn._load import blocks

    load_stages.instrument(spans)
    spans.wrap(blocks, "apply_delta", "delta")
    spans.wrap(blocks, "read_blocks", "blocks")
    spans.wrap(binindex.ChunkTable, "_decode", "index")


def loads(paths: dict[str, str], reps: int, spans: load_stages.Spans) -> dict[str, list[dict[str, float]]]:
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in paths}
    items = list(paths.items())
    for k in range(reps + 1):  # the first round warms up (imports, pools)
        for kind, path in (items if k % 2 == 0 else items[::-1]):
            row = load_stages.load_once(path, False, 8, spans)
            if k:
                rows[kind].append(row)
    return rows


def load_line(rows: list[dict[str, float]]) -> str:
    med = statistics.median
    keys = ["load", "read_union", "read_sum", "crc_sum", "decode_sum", "delta_sum", "blocks_union", "blocks_sum",
            "index_sum", "wait_sum", "cores"]
    return ", ".join(f"{k} {med(r.get(k, 0.0) for r in rows) * (1 if k == 'cores' else 1e3):.1f}" for k in keys)


def run_case(name: str, lr: float, size: int, saves: int, root: str, spans: Spans,
             load_reps: int = 0, lspans: load_stages.Spans | None = None) -> dict[str, list[dict[str, float]]]:
    state = make_state(size, "bf16-f32")
    rng = np.random.default_rng(1)
    rows: dict[str, list[dict[str, float]]] = {"full": [], "inc": []}
    prev = None
    for t in range(1, saves + 1):
        if t > 1:
            _adamw(state, lr, rng, t)
        full, incp = os.path.join(root, f"{name}_full_{t}"), os.path.join(root, f"{name}_inc_{t}")
        order = [("full", full), ("inc", incp)] if t % 2 else [("inc", incp), ("full", full)]
        for kind, path in order:
            os.sync()
            time.sleep(0.2)
            spans.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            if kind == "full":
                cairn.save(path, state, compression=False)
            elif prev is None:  # the chain starts with a self-contained save with hashes
                cairn.save(path, state, compression=False, base=full if os.path.exists(full) else None)
            else:
                cairn.save(path, state, compression=False, base=prev)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if t > 1 and not (kind == "inc" and prev is None):
                rows[kind].append(summarize(spans, dt, dc))
        if prev is not None:
            shutil.rmtree(os.path.join(root, f"{name}_full_{t - 1}"), ignore_errors=True)
        prev = incp
    if load_reps and lspans is not None:
        got = loads({"full": os.path.join(root, f"{name}_full_{saves}"), "inc": prev}, load_reps, lspans)
        rows["load_full"], rows["load_inc"] = got["full"], got["inc"]
    return rows


def line(rows: list[dict[str, float]]) -> str:
    med = statistics.median
    keys = [("save", "save"), ("cpu", "cpu"), ("open", "open_union"), ("run", "run_union"), ("run sum", "run_sum"),
            ("run cpu", "run_cpu"), ("hash", "hash_sum"), ("delta", "delta_sum"), ("crc", "crc_sum"),
            ("write", "write_union"), ("fsync", "fsync_union"), ("first write", "first_write"),
            ("last write", "last_write"), ("last fsync", "last_fsync"), ("write_data", "write_data_union"),
            ("commit", "commit_union")]
    return ", ".join(f"{label} {med(r.get(k, 0.0) for r in rows) * 1e3:.0f}" for label, k in keys) + " (ms)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="pretrain,lr1e-6")
    ap.add_argument("--state-mib", type=int, default=256)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--load-reps", type=int, default=7)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    spans = Spans()
    instrument(spans)
    lspans = load_stages.Spans()
    instrument_load(lspans)
    root = tempfile.mkdtemp(prefix="cairn-incstages-", dir=args.dir)
    out: dict[str, Any] = {"cores": os.cpu_count(), "coders": engine._cores(), "loadavg_start": os.getloadavg()}
    try:
        for name in args.cases.split(","):
            rows = run_case(name, CASES[name], args.state_mib << 20, args.saves, root, spans, args.load_reps, lspans)
            out[name] = rows
            print(f"{name}, {args.state_mib} MiB, medians of {len(rows['full'])} saves (load {os.getloadavg()[0]:.1f}):")
            for kind in ("full", "inc"):
                print(f"  {kind:4s}: {line(rows[kind])}")
            ratio = [a["save"] / b["save"] for a, b in zip(rows["inc"], rows["full"])]
            print(f"  inc/full save: {statistics.median(ratio):.2f}x [{min(ratio):.2f}-{max(ratio):.2f}]", flush=True)
            if rows.get("load_inc"):
                for kind in ("full", "inc"):
                    print(f"  load {kind:4s}: {load_line(rows['load_' + kind])} (ms; cores: mean busy)")
                lr_ = [a["load"] / b["load"] for a, b in zip(rows["load_inc"], rows["load_full"])]
                print(f"  inc/full load: {statistics.median(lr_):.2f}x [{min(lr_):.2f}-{max(lr_):.2f}]", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["loadavg_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
