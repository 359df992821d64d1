"""cairn's loads from object stores against the best raw read pattern for the same bytes.

    python -m benchmarks.probe objstore                       # moto, Azurite, fake-gcs-server; 256 MiB
    python -m benchmarks.probe objstore --servers moto --reps 5 --json out.json
    python -m benchmarks.probe objstore --servers azurite --only cairn   # just cairn's loads

One run per server, each on 127.0.0.1 in its own process (so it does not
compete with the client for the GIL): moto's S3 server, Azurite's blob
service, fake-gcs-server (which takes no write from obstore, so there the
checkpoint is saved to local disk and copied in through its JSON API). The
state is `--arrays` float32 arrays sharded over 8 virtual CPU devices
(``P("x")``), saved with `cairn.save`. Then, per repetition, in alternating
order and on the very objects cairn wrote:

- raw, whole objects: one GET per data file, all files at once;
- raw, ranged GETs: the files cut into ranges of each `--parts` size, all
  ranges of all files through a pool of each `--concurrency` threads;
- raw, ``obstore.get_ranges``: one call per file with 8 MiB ranges, all
  files at once (obstore merges adjacent ranges, even with ``coalesce=0``,
  so this is one GET per file too);
- cairn, numpy: ``cairn.load(path)`` (checksums verified);
- cairn, mesh: ``cairn.load(path, target)`` onto the arrays' own sharding;
- cairn, numpy without checksums (``verify=False``), to show what they cost.

Each server run also probes how the server's cost of one ranged GET depends
on the object's size (4 MiB read from a 4 MiB and from a 64 MiB object): moto
answers a ranged GET in time proportional to the whole object.

``--plan-max-read MIB`` sets the storage option ``plan_read_size`` (default
32 MiB): the load planner merges adjacent chunks of a file into reads of up to
that size.

The raw patterns only receive the bytes (no copy into arrays, no checksum):
the strictest comparison. Prints seconds (median) per pattern, the best raw
pattern, and cairn / best ratios. Only loopback addresses are contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
SERVERS = ("moto", "azurite", "gcs")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int) -> subprocess.Popen[bytes]:
    """`python -m moto.server` on 127.0.0.1:`port`, once it answers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return proc
        except Exception:
            if proc.poll() is not None:
                raise RuntimeError("moto.server exited on start") from None
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto.server did not start within 60 s")


def make_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                 region_name="us-east-1").create_bucket(Bucket=name)


class Moto:
    """moto's S3 server as its own process (python -m moto.server)."""

    name = "moto"

    def __init__(self) -> None:
        self.port = _free_port()
        self.proc = start_moto(self.port)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def bucket(self) -> str:
        name = f"bench-{uuid.uuid4().hex[:8]}"
        make_bucket(self.endpoint, name)
        return name

    def options(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "region": "us-east-1", "access_key_id": "bench",
                "secret_access_key": "bench", "allow_http": True}

    def url(self, bucket: str, path: str) -> str:
        return f"s3://{bucket}/{path}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def _test_server(kind: str) -> Any:
    """Azurite or fake-gcs-server, started as the tests start them (tests/_servers.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    import _servers

    cls = _servers.AzuriteServer if kind == "azurite" else _servers.FakeGCSServer
    server = cls().start()
    server.bucket = lambda: server.new_bucket("bench")
    return server


def start(kind: str) -> Any:
    return Moto() if kind == "moto" else _test_server(kind)


def through_link(spec: str, server: Any, kind: str, opts: dict[str, Any]) -> Any:
    """A shaped link (tests/_shapedlink.py, `spec` as its `parse` takes it) started in front of `server`,
    with `opts` (the storage options) changed in place to send every request through it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from _shapedlink import ShapedLink

    link = ShapedLink.parse(spec, server.port).start()
    if kind == "gcs":  # obstore's GCS emulator setup names the base URL in the service-account key
        link.rewrite_host = True  # fake-gcs-server tells its XML API from its JSON API by the Host
        key = json.loads(opts["service_account_key"])
        opts["service_account_key"] = json.dumps({**key, "gcs_base_url": link.endpoint})
    else:
        opts["endpoint"] = link.endpoint
    return link


def median_time(fn: Callable[[], Any], reps: int, times: list[float]) -> None:
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)


def probe_object_size(server: Any, bucket: str, store: Any, n: int = 8) -> dict[str, float]:
    """Median ms of one 4 MiB ranged GET from objects of 4 and 64 MiB (put in one request each)."""
    import obstore

    out = {}
    for size in (4, 64):
        key = f"probe/{size}"
        data = os.urandom(size * MiB)
        if hasattr(server, "put_object"):
            server.put_object(bucket, key, data)
        else:
            obstore.put(store, key, data, use_multipart=False)
        ts = []
        for i in range(n):
            t0 = time.perf_counter()
            obstore.get_range(store, key, start=(i % (size // 4)) * 4 * MiB, length=4 * MiB)
            ts.append(time.perf_counter() - t0)
        out[f"{size} MiB"] = statistics.median(ts) * 1000
    return out


def _save_patterns(cairn: Any, server: Any, bucket: str, opts: dict[str, Any], arrays: dict[str, Any],
                   host: dict[str, np.ndarray], compression: Any) -> dict[str, Callable[[], None]]:
    """cairn.save of the sharded state against raw multipart puts of the same bytes in as many objects
    as cairn writes (with cairn's part size and parts in flight), each into a fresh prefix."""
    import obstore

    from cairn._storage.obstore import ObjectStorage

    storage = ObjectStorage(server.url(bucket, ""), opts)
    t = storage.tuning
    counter = iter(range(1 << 30))
    files = 4  # as many data files as cairn's save writes here (checked below)

    def save() -> None:
        cairn.save(server.url(bucket, f"save/{next(counter)}"), {"params": arrays}, storage_options=opts,
                   compression=compression)

    def raw() -> None:
        prefix = f"raw/{next(counter)}"
        views = [memoryview(v.reshape(-1).view(np.uint8)) for v in host.values()]
        per = -(-len(views) // files)

        def put(f: int) -> None:
            obstore.put(storage.upload_store, f"{prefix}/f{f}", iter(views[f * per:(f + 1) * per]),
                        use_multipart=True, chunk_size=t.part_size, max_concurrency=t.upload_concurrency)

        with ThreadPoolExecutor(files) as pool:
            list(pool.map(put, range(files)))

    save()
    written = [k for k in storage.list("save/0") if k.endswith(".bin")]
    assert len(written) == files, f"cairn wrote {len(written)} data files, the raw puts {files}"
    return {"raw puts (save)": raw, "cairn save": save}


def rss_child(spec: str) -> int:
    """One load in this fresh process (`spec`: JSON of path, options, mode): prints its peak RSS growth.

    The kernel's high-water mark of this process image (``VmHWM``) less the resident size just
    before the load, so the state held by the parent and anything an earlier load left behind do
    not count."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import cairn
    from benchmarks.measure import PeakRSS

    job = json.loads(spec)
    opts = job["options"]
    mesh = jax.make_mesh((8,), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    meta = cairn.metadata(job["path"], storage_options=opts)
    target = None
    if job["mode"] == "mesh":
        target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
                             for k, v in meta["params"].items()}}
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        out = cairn.load(job["path"], target, storage_options=opts, threads=job["threads"])
        jax.block_until_ready(out)
        took = time.perf_counter() - t0
    print(json.dumps({"mode": job["mode"], "peak_growth": peak.peak - peak.base, "method": peak.method,
                      "seconds": took}))
    return 0


def rss_rows(path: str, opts: dict[str, Any], nbytes: int, threads: int) -> dict[str, Any]:
    """Peak RSS growth of one numpy and one mesh load, each in a fresh process, against the
    bound: the state's bytes + the default `budget_bytes` + 10 %."""
    import subprocess

    from cairn._load.reader import DEFAULT_BUDGET

    bound = (nbytes + DEFAULT_BUDGET) * 1.1
    out: dict[str, Any] = {"state_bytes": nbytes, "budget_bytes": DEFAULT_BUDGET, "bound": bound}
    print(f"  peak RSS during one load (fresh process each; bound: state + budget + 10 % = {bound / 1e9:.2f} GB):")
    for mode in ("numpy", "mesh"):
        spec = json.dumps({"path": path, "options": opts, "mode": mode, "threads": threads})
        r = subprocess.run([sys.executable, "-m", "benchmarks.probe", "objstore", "--rss-child", spec],
                           capture_output=True, text=True, timeout=600, env=os.environ)
        if r.returncode != 0:
            raise RuntimeError(f"the {mode} load's process failed: {r.stderr[-2000:]}")
        row = json.loads(r.stdout.strip().splitlines()[-1])
        out[mode] = row
        print(f"    {mode:6s} +{row['peak_growth'] / 1e9:.3f} GB = {row['peak_growth'] / nbytes:.3f} x the state, "
              f"{row['peak_growth'] / bound:.2f} of the bound ({row['method']}; load {row['seconds']:.2f} s)")
    return out


def run_server(kind: str, a: argparse.Namespace) -> dict[str, Any]:
    import jax
    import obstore
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import cairn
    from cairn._storage.obstore import ObjectStorage

    server = start(kind)
    link = None
    try:
        bucket = server.bucket()
        opts = {**server.options(), **a.option}
        if a.link:  # every request of every pattern through the shaped link (which logs them)
            link = through_link("" if a.link == "log" else a.link, server, kind, opts)
        mesh = jax.make_mesh((8,), ("x",))
        sharding = NamedSharding(mesh, P("x"))
        per = a.size_mib * MiB // a.arrays // 4
        rng = np.random.default_rng(0)
        host = {f"w{i}": rng.standard_normal((8, per // 8), dtype=np.float32) for i in range(a.arrays)}
        arrays = {k: jax.device_put(v, sharding) for k, v in host.items()}
        nbytes = sum(x.nbytes for x in host.values())
        path = server.url(bucket, "ckpt")
        if kind == "gcs":  # fake-gcs-server takes no write from obstore: save locally, copy in
            with tempfile.TemporaryDirectory() as tmp:
                cairn.save(f"{tmp}/ckpt", {"params": arrays}, compression=a.compression)
                server.upload_tree(bucket, "ckpt", f"{tmp}/ckpt")
        else:
            cairn.save(path, {"params": arrays}, storage_options=opts, compression=a.compression)
        if a.save:
            patterns_save = _save_patterns(cairn, server, bucket, opts, arrays, host, a.compression)
        storage = ObjectStorage(server.url(bucket, ""), opts)
        store = storage.store
        files = {k: storage.size(k) for k in storage.list("ckpt") if k.endswith(".bin")}
        target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in host.items()}}

        def whole() -> None:
            with ThreadPoolExecutor(len(files)) as pool:
                got = sum(pool.map(lambda k: len(obstore.get(store, k).bytes()), files))
            assert got == sum(files.values())

        def ranged(part: int, conc: int) -> Callable[[], None]:
            jobs = [(k, s, min(part, n - s)) for k, n in files.items() for s in range(0, n, part)]

            def go() -> None:
                with ThreadPoolExecutor(conc) as pool:
                    got = sum(pool.map(lambda j: len(obstore.get_range(store, j[0], start=j[1], length=j[2])),
                                       jobs))
                assert got == sum(files.values())
            return go

        def get_ranges(part: int, coalesce: int) -> Callable[[], None]:
            def one(k: str) -> int:
                n = files[k]
                starts = list(range(0, n, part))
                return sum(len(b) for b in obstore.get_ranges(store, k, starts=starts, coalesce=coalesce,
                                                              ends=[min(s + part, n) for s in starts]))

            def go() -> None:
                with ThreadPoolExecutor(len(files)) as pool:
                    assert sum(pool.map(one, files)) == sum(files.values())
            return go

        def load_numpy() -> None:
            out = cairn.load(path, storage_options=opts, threads=a.threads)["params"]
            assert all(out[k].shape == host[k].shape for k in host)

        def load_unverified() -> None:
            cairn.load(path, storage_options=opts, threads=a.threads, verify=False)

        def load_mesh() -> None:
            out = cairn.load(path, target, storage_options=opts, threads=a.threads)["params"]
            jax.block_until_ready(out)

        def chunked(size: int, fn: Callable[[], None]) -> Callable[[], None]:
            import cairn._storage.obstore as backend

            def go() -> None:
                default = backend._STREAM_CHUNK
                backend._STREAM_CHUNK = size
                try:
                    fn()
                finally:
                    backend._STREAM_CHUNK = default
            return go

        patterns: dict[str, Callable[[], None]] = {}
        if a.only in ("all", "raw"):
            patterns["raw whole-object GETs"] = whole
            for part in a.parts:
                for conc in a.concurrency:
                    patterns[f"raw {part} MiB ranges x{conc}"] = ranged(part * MiB, conc)
            # obstore merges adjacent ranges (even with coalesce=0): one GET per file, by another road
            patterns["raw get_ranges per file"] = get_ranges(8 * MiB, 0)
        if a.only in ("all", "cairn"):
            patterns["cairn load (numpy)"] = load_numpy
            patterns["cairn load (mesh)"] = load_mesh
            patterns["cairn load (numpy, verify=False)"] = load_unverified
            for kib in a.stream_chunks:  # the same numpy load with other stream chunk sizes, interleaved
                patterns[f"cairn load (numpy, {kib} KiB chunks)"] = chunked(kib << 10, load_numpy)
        # correctness once, then warm up every pattern (connections, first-touch of buffers)
        got = cairn.load(path, storage_options=opts)["params"]
        assert all(np.array_equal(got[k], host[k]) for k in host), "cairn read back wrong bytes"
        del got
        for fn in patterns.values():
            fn()
        if a.save:
            patterns.update(patterns_save)
        times: dict[str, list[float]] = {k: [] for k in patterns}
        requests: dict[str, dict[str, Any]] = {}
        names = list(patterns)
        for rep in range(a.reps):
            for name in names if rep % 2 == 0 else names[::-1]:
                since = time.monotonic()
                median_time(patterns[name], a.reps, times[name])
                if link is not None and rep == 0:
                    requests[name] = link.stats(since)
        probe = probe_object_size(server, bucket, store)
        med = {k: statistics.median(v) for k, v in times.items()}
        raw = {k: v for k, v in med.items() if k.startswith("raw")}
        best = min(raw, key=raw.__getitem__) if raw else None
        result: dict[str, Any] = {
            "server": kind, "bytes": nbytes, "arrays": a.arrays, "data_files": len(files),
            "file_sizes": sorted(files.values()), "reps": a.reps, "seconds": times, "median_s": med,
            "best_raw": best, "ranged_get_ms_by_object_size": probe, "link": a.link,
            "requests": requests,
        }
        print(f"\n{kind}: {nbytes / MiB:.0f} MiB in {a.arrays} arrays, {len(files)} data files, median of {a.reps}:")
        for k, v in med.items():
            ratio = f"   {v / raw[best]:.2f}x best raw" if best and k.startswith("cairn load") else ""
            link_ratio = f"   {nbytes / v / link.rate:.2f} of the link" if link is not None and link.rate else ""
            print(f"  {k:32s} {v:7.3f} s  {nbytes / MiB / v:8.1f} MiB/s{ratio}{link_ratio}")
            if k in requests:
                r = requests[k]
                print(f"  {'':32s} {r['requests']} requests {r['by_method']}, at most {r['peak_in_flight']} "
                      f"in flight, busy {r['busy_s']:.3f} s")
        print("  one 4 MiB ranged GET: " + ", ".join(f"{v:.1f} ms from a {k} object" for k, v in probe.items()))
        if best:
            print(f"  best raw: {best}")
            result["ratios"] = {k: v / raw[best] for k, v in med.items() if k.startswith("cairn")}
        if a.rss:
            result["peak_rss"] = rss_rows(path, opts, nbytes, a.threads)
        if a.save:
            raw_puts = med.get("raw puts (save)")
            if raw_puts:
                result["save_ratio"] = med["cairn save"] / raw_puts
                print(f"  cairn save / raw puts: {result['save_ratio']:.2f}x")
        if a.reps > 1:  # the same ratios from each pattern's fastest repetition
            low = {k: min(v) for k, v in times.items()}
            raw_low = {k: v for k, v in low.items() if k.startswith("raw") and "puts" not in k}
            if raw_low:
                b = min(raw_low, key=raw_low.__getitem__)
                result["best_of_ratios"] = {k: v / raw_low[b] for k, v in low.items() if k.startswith("cairn load")}
                print(f"  best of {a.reps}: best raw {b} {raw_low[b]:.3f} s; " + ", ".join(
                    f"{k[len('cairn load '):]} {v:.2f}x" for k, v in result["best_of_ratios"].items()))
            if "cairn save" in low and "raw puts (save)" in low:
                result["best_of_save_ratio"] = low["cairn save"] / low["raw puts (save)"]
                print(f"  best of {a.reps}: cairn save / raw puts {result['best_of_save_ratio']:.2f}x")
        return result
    finally:
        if link is not None:
            link.stop()
            if link.errors:
                print(f"  the link's connections that ended on an error: {link.errors[:5]}")
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--arrays", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16, 32],
                    help="ranged-GET sizes in MiB (default 4,8,16,32)")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32],
                    help="threads for the ranged GETs (default 8,16,32)")
    ap.add_argument("--only", choices=["all", "raw", "cairn"], default="all")
    ap.add_argument("--threads", type=int, default=8, help="cairn.load's threads (default 8, its default)")
    ap.add_argument("--option", action="append", default=[], type=lambda kv: (kv.split("=", 1)[0], int(kv.split("=", 1)[1])),
                    help="a cairn storage option for every run, e.g. read_part_size=16777216 (repeatable)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--link", default=None, metavar="SPEC",
                    help="every request through a shaped link (tests/_shapedlink.py): e.g. 1GB/s,10ms or "
                    "10GB/s; 'log' only logs the requests; prints request counts per pattern")
    ap.add_argument("--compression", default=False, type=lambda v: False if v in ("none", "false") else v,
                    help="cairn.save's compression (default none: the uncompressed case; auto, zstd, planes)")
    ap.add_argument("--save", action="store_true", help="also time cairn.save against raw multipart puts")
    ap.add_argument("--plan-max-read", type=int, default=None, metavar="MIB",
                    help="plan loads with reads merged up to this size (the storage option plan_read_size, default 32)")
    ap.add_argument("--stream-chunks", type=lambda s: [int(x) for x in s.split(",")], default=[], metavar="KIB,...",
                    help="also time the numpy load with these stream chunk sizes (KiB; the storage's _STREAM_CHUNK)")
    ap.add_argument("--rss", action="store_true",
                    help="also measure the peak RSS of one numpy and one mesh load, each in a fresh process")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.option = dict(a.option)
    if a.plan_max_read:  # the storage option the loads plan their reads up to
        a.option["plan_read_size"] = a.plan_max_read * MiB

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    if a.rss_child:
        return rss_child(a.rss_child)
    results = [run_server(kind, a) for kind in a.servers.split(",") if kind]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
