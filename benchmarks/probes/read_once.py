"""Read-once restore on real processes over loopback: bytes read, load time, peak RSS.

    python -m benchmarks.probe read_once                 # 64 MiB leaf, local disk, cold and warm cache
    python -m benchmarks.probe read_once --mb 16 --s3    # also on a moto S3 server (needs moto)
    python -m benchmarks.probe read_once --routes        # 0.94 GiB FSDP dim 0 -> dim 1, 2 x 4 devices,
                                                   # default vs read_once=True vs False vs Orbax, and the
                                                   # same-sharding load (--cold: drop caches first)

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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


# name -> load keywords; "system": "orbax" restores Orbax's checkpoint of the same array instead,
# "target": "saved" loads onto the saved sharding (see the compare_routes scenario)
ROUTE_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {}, "read_once=True": {"read_once": True}, "read_once=False": {"read_once": False},
    "orbax": {"system": "orbax"},
    "same sharding: default": {"target": "saved"}, "same sharding: orbax": {"system": "orbax", "target": "saved"},
}
MEASURED = {"measured": {"bandwidths": {"interconnect_gbps": "measure"}}}


def compare_routes(reps: int, rows: int = 61440, cols: int = 4096, cold: bool = False,
                   options: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """One save each by cairn and Orbax, then the load with each of `options` (default
    `ROUTE_OPTIONS`), `reps` rounds in rotating order; per option the slowest process's seconds
    of each round, and process 0's stats."""
    options = options or ROUTE_OPTIONS
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="cairn-routes-") as d:
        out = run(2, "compare_routes", {"path": os.path.join(d, "ck"), "mesh": [2, 4], "save_spec": [["x", "y"]],
                                        "load_spec": [None, ["x", "y"]], "shape": [rows, cols],
                                        "options": options, "reps": reps, "cold": cold},
                  devices_per_process=4, timeout=3000)
    res: dict[str, Any] = {"gib": out[0]["nbytes"] / 2**30, "save_s": max(o["save_s"] for o in out),
                           "orbax_save_s": max(o.get("orbax_save_s", 0.0) for o in out), "cold": cold,
                           "loadavg_before": load0, "loadavg_after": os.getloadavg(), "options": {}}
    print(f"{res['gib']:.2f} GiB, {'cold' if cold else 'warm'} page cache; save: cairn {res['save_s']:.2f} s, "
          f"orbax {res['orbax_save_s']:.2f} s; load average before {load0[0]:.1f}, after "
          f"{res['loadavg_after'][0]:.1f}", flush=True)
    for name in options:
        times = [max(o["runs"][name][r]["load_s"] for o in out) for r in range(reps)]
        last = out[0]["runs"][name][-1]
        res["options"][name] = {"load_s": times, "median_s": statistics.median(times), "min_s": min(times),
                                "stats_p0": last}
        line = f"{name:24} load min {min(times):.2f}, median {statistics.median(times):.2f}, max {max(times):.2f} s"
        if "routes" in last:
            line += (f"; process 0: route {last['routes']}, {last['bytes_read'] / 2**20:.0f} MiB read, read "
                     f"{last['read_s']:.2f} s, reshard {last['reshard_s']:.2f} s")
        print(line, flush=True)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--routes", action="store_true", help="only the comparison of the load's options (0.94 GiB, FSDP dim 0 -> dim 1, against Orbax)")
    ap.add_argument("--cold", action="store_true", help="with --routes: drop the page cache before every load (root)")
    ap.add_argument("--measured", action="store_true", help="with --routes: also a load that measures the interconnect")
    ap.add_argument("--s3", action="store_true", help="also run against a moto S3 server on 127.0.0.1")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.routes:
        res = compare_routes(a.reps, cold=a.cold, options={**ROUTE_OPTIONS, **(MEASURED if a.measured else {})})
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return
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
