"""The small requests of a save's commit, through a shaped link to moto: source trees alternated.

    python -m benchmarks.commit_requests --trees base=/tmp/base/src,new=$PWD/src [--reps 3] [--link 1GB/s,10ms]

Each repetition runs, for each tree in turn, a fresh process that saves a small state (one array)
6 times through the link (the first save of a process is not counted), then reads the link's request
log: for each save, the requests to the checkpoint's own keys after its last data byte (index parts,
indexes, the manifest; the commit's listing names the checkpoint in its query and is not matched),
grouped into serial waves (a request that starts after every earlier one was answered starts a new
wave), and the time from the last data byte to the manifest's answer. Medians per tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SAVES = 6
WORKER = r"""
import json, sys, time
import numpy as np
import cairn
opts, url, n = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
out = []
for i in range(n):
    t0 = time.perf_counter()
    s = cairn.save(f"{url}-{i}", {"a": np.arange(1000, dtype=np.float32)}, storage_options=opts)
    out.append([s.commit_s, time.perf_counter() - t0])
print(json.dumps(out))
"""


def _waves(log: list[Any], key: str) -> tuple[int, float] | None:
    """(serial waves of requests after the last data byte, seconds from it to the manifest's answer)."""
    mine = sorted((r for r in log if key in r.target), key=lambda r: r.start)
    data = [r for r in mine if ".bin" in r.target]
    if not data:
        return None
    last = max(r.end for r in data)
    after = [r for r in mine if ".bin" not in r.target and r.start >= last - 1e-4]
    waves, end = 0, float("-inf")
    for r in after:
        if r.start >= end:
            waves += 1
        end = max(end, r.end)
    manifest = [r.end for r in after if r.method == "PUT" and "manifest" in r.target]
    return waves, (manifest[-1] - last) if manifest else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", required=True, help="name=src folder, comma-separated (alternated in this order)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--link", default="1GB/s,10ms")
    args = ap.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    sys.path.insert(0, str(REPO / "tests"))
    from _shapedlink import ShapedLink
    from benchmarks.bench_objstore import start

    server = start("moto")
    link = ShapedLink.parse(args.link, server.port).start()
    saves: dict[str, list[list[float]]] = {k: [] for k in trees}
    waves: dict[str, list[int]] = {k: [] for k in trees}
    tails: dict[str, list[float]] = {k: [] for k in trees}
    try:
        opts = {**server.options(), "endpoint": link.endpoint}
        bucket = server.bucket()
        for rep in range(args.reps):
            for name, src in trees.items():
                env = {**os.environ, "PYTHONPATH": src, "JAX_PLATFORMS": "cpu"}
                got = subprocess.run([sys.executable, "-c", WORKER, json.dumps(opts), server.url(bucket, f"{name}{rep}"),
                                      str(SAVES)], env=env, capture_output=True, text=True, check=True)
                saves[name] += json.loads(got.stdout.strip().splitlines()[-1])[1:]
                link.idle()
                with link._lock:
                    log = list(link.log)
                for i in range(1, SAVES):
                    w = _waves(log, f"/{name}{rep}-{i}/")
                    if w is not None:
                        waves[name].append(w[0])
                        tails[name].append(w[1])
        for name in trees:
            print(f"{name}: save median {statistics.median(s[1] for s in saves[name]) * 1e3:.1f} ms, commit_s median "
                  f"{statistics.median(s[0] for s in saves[name]) * 1e3:.1f} ms; waves after the data "
                  f"{sorted(waves[name])}; last data byte -> manifest answered, median "
                  f"{statistics.median(tails[name]) * 1e3:.1f} ms (n={len(tails[name])})")
        print(f"load average {os.getloadavg()[0]:.1f}")
    finally:
        link.stop()
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
