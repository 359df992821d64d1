"""cairn against raw obstore on a local S3 server (moto), same bytes, same run.

    python -m benchmarks.bench_s3                      # 256 MiB, 3 repetitions
    python -m benchmarks.bench_s3 --size-mib 1024 --arrays 16 --reps 5

The server is ``python -m moto.server`` in its own process on 127.0.0.1, so
it does not compete with the client for the GIL. The state is one
checkpointable holding `--arrays` float32 arrays. Per repetition and in alternating order:

- raw save: the arrays packed into `--threads` objects (as cairn packs them
  into data files), each put with obstore's multipart upload (the part size
  and parts in flight cairn uses), all objects at once;
- cairn save: ``cairn.save`` with ``threads=--threads``;
- raw load: each array read into a preallocated numpy array with parallel
  ranged gets (the part size and parts in flight cairn uses), 2 x `--threads`
  arrays at a time;
- cairn load: ``cairn.load`` (checksums verified) with ``threads=--threads``.

Prints MiB/s (median of the repetitions) and cairn / raw ratios; the issue's
target is a ratio of 0.8 or better. Only loopback addresses are contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int) -> subprocess.Popen[bytes]:
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


def layout(arrays: dict[str, np.ndarray], files: int) -> dict[str, tuple[int, int]]:
    """Array -> (object, byte offset): the arrays packed into `files` objects, as cairn packs them.

    moto copies a whole object to answer a ranged get, so the raw client must
    read objects of the same sizes as cairn's for the comparison to be fair.
    """
    where: dict[str, tuple[int, int]] = {}
    fill = [0] * files
    for name, x in arrays.items():
        f = fill.index(min(fill))
        where[name] = (f, fill[f])
        fill[f] += x.nbytes
    return where


def raw_save(store: Any, prefix: str, arrays: dict[str, np.ndarray], where: dict[str, tuple[int, int]],
             threads: int, part: int, conc: int) -> None:
    import obstore

    files: dict[int, list[memoryview]] = {}
    for name, (f, _) in sorted(where.items(), key=lambda kv: kv[1]):
        files.setdefault(f, []).append(memoryview(arrays[name].reshape(-1).view(np.uint8)))

    def put(f: int) -> None:
        obstore.put(store, f"{prefix}/f{f}", iter(files[f]), use_multipart=True, chunk_size=part,
                    max_concurrency=conc)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, files))


def raw_load(store: Any, prefix: str, like: dict[str, np.ndarray], where: dict[str, tuple[int, int]],
             threads: int, part: int, conc: int) -> dict[str, np.ndarray]:
    import obstore

    def get(name: str) -> tuple[str, np.ndarray]:
        f, base = where[name]
        out = np.empty_like(like[name])
        buf = memoryview(out.reshape(-1).view(np.uint8))
        n = len(buf)
        window = part * conc
        for w in range(0, n, window):
            starts = list(range(w, min(w + window, n), part))
            ends = [min(s + part, n) for s in starts]
            datas = obstore.get_ranges(store, f"{prefix}/f{f}", starts=[base + s for s in starts],
                                       ends=[base + e for e in ends], coalesce=0)
            for s, e, data in zip(starts, ends, datas):
                buf[s:e] = memoryview(data)
        return name, out

    with ThreadPoolExecutor(threads) as pool:
        return dict(pool.map(get, like))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_s3", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--arrays", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    a = ap.parse_args(argv)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import obstore  # fails early without the cloud extra
    from obstore.store import S3Store

    import cairn
    from cairn._storage.obstore import Tuning

    tuning = Tuning()
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = start_moto(port)
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        make_bucket(endpoint, bucket)
        opts = {"endpoint": endpoint, "region": "us-east-1", "access_key_id": "bench",
                "secret_access_key": "bench", "allow_http": True}
        store = S3Store(bucket, endpoint=endpoint, region="us-east-1", access_key_id="bench",
                        secret_access_key="bench", client_options={"allow_http": True})
        rng = np.random.default_rng(0)
        per = a.size_mib * MiB // a.arrays // 4
        arrays = {f"w{i}": rng.standard_normal(per, dtype=np.float32) for i in range(a.arrays)}
        nbytes = sum(x.nbytes for x in arrays.values())
        where = layout(arrays, min(a.threads, a.arrays))
        times: dict[str, list[float]] = {"raw_save": [], "cairn_save": [], "raw_load": [], "cairn_load": []}
        for rep in range(a.reps):
            order = ["raw", "cairn"] if rep % 2 == 0 else ["cairn", "raw"]
            for who in order:
                if who == "raw":
                    prefix = f"raw/{rep}"
                    t0 = time.perf_counter()
                    raw_save(store, prefix, arrays, where, a.threads, tuning.part_size, tuning.upload_concurrency)
                    times["raw_save"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    got = raw_load(store, prefix, arrays, where, a.threads * 2, tuning.read_part_size,
                                   tuning.read_concurrency)
                    times["raw_load"].append(time.perf_counter() - t0)
                else:
                    path = f"s3://{bucket}/cairn/{rep}"
                    t0 = time.perf_counter()
                    cairn.save(path, {"params": arrays}, storage_options=opts, threads=a.threads, compression=False)
                    times["cairn_save"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    got = cairn.load(path, storage_options=opts, threads=a.threads * 2)["params"]
                    times["cairn_load"].append(time.perf_counter() - t0)
                assert all(np.array_equal(got[k], arrays[k]) for k in arrays), f"{who} read back wrong bytes"
                del got
                # Empty the bucket: moto slows down as it holds more objects.
                obstore.delete(store, [m["path"] for c in obstore.list(store) for m in c])
        med = {k: statistics.median(v) for k, v in times.items()}
        mbps = {k: nbytes / MiB / t for k, t in med.items()}
        result = {
            "bytes": nbytes, "arrays": a.arrays, "reps": a.reps, "threads": a.threads,
            "part_size": tuning.part_size, "read_part_size": tuning.read_part_size,
            "seconds": times, "median_MiB_per_s": mbps,
            "save_ratio": mbps["cairn_save"] / mbps["raw_save"],
            "load_ratio": mbps["cairn_load"] / mbps["raw_load"],
        }
        print(f"S3 (moto on 127.0.0.1), {nbytes / MiB:.0f} MiB in {a.arrays} arrays, median of {a.reps}:")
        for op in ("save", "load"):
            raw, ours = mbps[f"raw_{op}"], mbps[f"cairn_{op}"]
            print(f"  {op}: raw obstore {raw:8.1f} MiB/s   cairn {ours:8.1f} MiB/s   ratio {ours / raw:.2f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=2)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
