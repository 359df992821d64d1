"""Read-once restore on real processes over loopback: bytes read, load time, peak RSS.

    python -m benchmarks.read_once                 # 64 MiB leaf, local disk, cold and warm cache
    python -m benchmarks.read_once --mb 16 --s3    # also on a moto S3 server (needs moto)

Each case saves one float32 array on a 2- or 4-process cluster (the test
harness in tests/_mp: real `jax.distributed` processes on 127.0.0.1, CPU
devices) and loads it onto another sharding, once with cairn's default
(read-once where it pays) and once with ``read_once=False`` (every process
reads its own shards). Bytes are summed over processes: cairn's own count
(LoadStats.bytes_read) and rchar from /proc/self/io (every byte a read()
returned, metadata included). Loopback gloo on 2 cores is far slower than a
real interconnect, so judge read-once by bytes here; times are reported as
measured, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

from _mp import run  # noqa: E402

# name: (processes, devices per process, mesh, saved spec, loaded spec)
CASES: dict[str, tuple[int, int, list[int], list[Any], list[Any]]] = {
    "replicas (2 proc, full replica each)": (2, 2, [2, 2], [["x", "y"]], []),
    "rows -> columns (2 proc)": (2, 2, [2, 2], [["x", "y"]], [None, ["x", "y"]]),
    "2x2 mesh reshard (4 proc)": (4, 1, [2, 2], ["x", "y"], ["y", "x"]),
    "same sharding (2 proc)": (2, 2, [2, 2], ["x", "y"], ["x", "y"]),
}


def one(case: str, mb: int, read_once: bool | None, cold: bool, workdir: str,
        storage: dict[str, Any] | None) -> dict[str, Any]:
    n, devices, mesh, save_spec, load_spec = CASES[case]
    rows = mb * 256
    path = storage["path"] if storage else os.path.join(workdir, "ck")
    args = {"path": path, "mesh": mesh, "save_spec": save_spec, "load_spec": load_spec,
            "shape": [rows, 1024], "read_once": read_once, "cold": cold and storage is None,
            "storage_options": storage.get("options") if storage else None}
    out = run(n, "save_then_load", args, devices_per_process=devices, timeout=600)
    nbytes = out[0]["nbytes"]
    return {
        "bytes_ratio": sum(r["bytes_read"] for r in out) / nbytes,
        "rchar_ratio": sum(r["rchar"] for r in out) / nbytes,
        "load_s": max(r["load_s"] for r in out),
        "reshard_s": max(r["reshard_s"] for r in out),
        "peak_rss_growth_mib": max(r["peak_rss_growth"] for r in out) / 2**20,
        "target_mib_per_process": nbytes / 2**20 * (1 if not load_spec else 1 / n),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--s3", action="store_true", help="also run against a moto S3 server on 127.0.0.1")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    results: dict[str, Any] = {"mb": a.mb, "cases": {}}
    backends: list[tuple[str, Any]] = [("local cold", None), ("local warm", None)]
    server = None
    if a.s3:
        from _s3server import S3Server  # type: ignore[import-not-found]

        server = S3Server().start()
        backends.append(("s3 (moto)", server))
    try:
        for backend, srv in backends:
            for case in CASES:
                row: dict[str, Any] = {}
                for label, ro in (("read_once", None), ("direct", False)):
                    reps = []
                    for _ in range(a.reps):
                        with tempfile.TemporaryDirectory(prefix="cairn-ro-") as d:
                            storage = None if srv is None else {
                                "path": f"s3://{srv.new_bucket('ro')}/ck", "options": srv.options()}
                            reps.append(one(case, a.mb, ro, backend == "local cold", d, storage))
                    row[label] = {key: statistics.median(r[key] for r in reps) for key in reps[0]}
                results["cases"][f"{backend}: {case}"] = row
                r, d = row["read_once"], row["direct"]
                print(f"{backend:11} {case:38} bytes {r['bytes_ratio']:.2f}x (direct {d['bytes_ratio']:.2f}x)  "
                      f"rchar {r['rchar_ratio']:.2f}x  load {r['load_s']:.2f}s (direct {d['load_s']:.2f}s, "
                      f"reshard {r['reshard_s']:.2f}s)  peak RSS +{r['peak_rss_growth_mib']:.0f} MiB "
                      f"(direct +{d['peak_rss_growth_mib']:.0f})", flush=True)
    finally:
        if server is not None:
            server.stop()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
