"""A/B of cairn's object-store loads: two source trees, one server, alternated in one run.

    git archive main src benchmarks | tar -x -C /tmp/obj_base
    python -m benchmarks.probe objstore_ab --servers moto,azurite --reps 7            # base vs this tree
    python -m benchmarks.probe objstore_ab --servers moto --reps 3 --profile new      # + a sampling profile
    python -m benchmarks.probe objstore_ab --servers moto --reps 5 --link 1GB/s,10ms  # through a shaped link
    python -m benchmarks.probe objstore_ab --servers moto --reps 7 --ops "raw puts,cairn save"  # saves against raw puts

Each tree gets a worker process of its own (``PYTHONPATH`` = that tree's ``src``), started once and
kept warm, so the A and B loads alternate repetition by repetition against the same server and the
same objects (saved once, by the first tree): what the machine's load does to one does it to the other.
GCS runs on fake-gcs-server, which takes no write from obstore: the first tree saves to a local
folder and the driver copies the checkpoint in (loads only). What each pattern read is freed after its
clock stops (and the garbage collected), so no pattern pays for another's memory.
Each repetition times, in each worker, in alternating order: the raw reads (``obstore.get_ranges`` per
file with 8 MiB ranges, all files at once; one whole-object GET per file, all at once), a numpy
load and a load onto the arrays' own sharding on 8 CPU devices. Ratios are each tree's median over
the best raw median of the run (the raw reads pooled from both workers: the same code).

``--profile TREE`` then samples every thread's stack every 2 ms (``sys._current_frames``) in that
tree's worker over a few numpy and mesh loads and prints where the threads that were not idle spent
their samples (innermost frame, and innermost cairn frame).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
HERE = Path(__file__).resolve()


# ---------------------------------------------------------------------- worker (one per tree)


def _worker() -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import cairn

    state: dict[str, Any] = {}

    def setup(job: dict[str, Any]) -> None:
        mesh = jax.make_mesh((8,), ("x",))
        sharding = NamedSharding(mesh, P("x"))
        per = job["size_mib"] * MiB // job["arrays"] // 4
        state.update(path=job["path"], opts=job["opts"], sharding=sharding, threads=job.get("threads") or 8,
                     shapes={f"w{i}": (8, per // 8) for i in range(job["arrays"])})
        state["target"] = {"params": {k: jax.ShapeDtypeStruct(s, np.float32, sharding=sharding)
                                      for k, s in state["shapes"].items()}}

    def save(job: dict[str, Any]) -> None:
        rng = np.random.default_rng(0)
        host = {k: rng.standard_normal(s, dtype=np.float32) for k, s in state["shapes"].items()}
        arrays = {k: jax.device_put(v, state["sharding"]) for k, v in host.items()}
        # `local`: to this folder instead (fake-gcs-server takes no write from obstore; the driver copies it in)
        cairn.save(job.get("local") or state["path"], {"params": arrays},
                   storage_options=None if job.get("local") else state["opts"],
                   compression=job.get("compression") or False)

    def files() -> dict[str, int]:
        if "files" not in state:
            from cairn._storage.obstore import ObjectStorage

            url = state["path"].rsplit("/", 1)[0]
            st = ObjectStorage(url, state["opts"])
            state["store"] = st.store
            state["files"] = {k: st.size(k) for k in st.list("ckpt") if k.endswith(".bin")}
        return state["files"]

    def raw_ranges() -> Any:
        from concurrent.futures import ThreadPoolExecutor

        import obstore

        fs, store = files(), state["store"]

        def one(k: str) -> Any:
            n = fs[k]
            starts = list(range(0, n, 8 * MiB))
            return obstore.get_ranges(store, k, starts=starts, coalesce=0, ends=[min(s + 8 * MiB, n) for s in starts])

        with ThreadPoolExecutor(len(fs)) as pool:
            got = list(pool.map(one, fs))
        assert sum(sum(len(b) for b in bs) for bs in got) == sum(fs.values())
        return got

    def raw_whole() -> Any:
        from concurrent.futures import ThreadPoolExecutor

        import obstore

        fs, store = files(), state["store"]
        with ThreadPoolExecutor(len(fs)) as pool:
            got = list(pool.map(lambda k: obstore.get(store, k).bytes(), fs))
        assert sum(len(b) for b in got) == sum(fs.values())
        return got

    from cairn._core.stats import LoadStats

    stats = LoadStats()
    phases: dict[str, list[float]] = {}

    def noted() -> None:
        for k in ("plan_s", "read_s", "transfer_s", "total_s"):
            phases.setdefault(k, []).append(getattr(stats, k))

    def load_numpy() -> Any:
        out = cairn.load(state["path"], storage_options=state["opts"], stats=stats, threads=state["threads"])
        noted()
        return out

    def load_mesh() -> Any:
        out = jax.block_until_ready(cairn.load(state["path"], state["target"], storage_options=state["opts"],
                                               stats=stats, threads=state["threads"]))
        noted()
        return out

    counter = iter(range(1 << 30))

    def timed_save() -> None:
        # A fresh path each time, beside the loaded checkpoint; the arrays as the save of `save` made them.
        if "arrays" not in state:
            rng = np.random.default_rng(0)
            state["host"] = {k: rng.standard_normal(s, dtype=np.float32) for k, s in state["shapes"].items()}
            state["arrays"] = {k: jax.device_put(v, state["sharding"]) for k, v in state["host"].items()}
        cairn.save(f"{state['path']}-saves/{os.getpid()}-{next(counter)}", {"params": state["arrays"]},
                   storage_options=state["opts"], compression=False)

    def raw_puts() -> None:
        # Multipart puts of the same bytes in as many objects as the save writes, with its part size and parts
        # in flight (as `bench_objstore`'s raw puts).
        from concurrent.futures import ThreadPoolExecutor

        import obstore

        from cairn._storage.obstore import ObjectStorage

        if "arrays" not in state:
            timed_save()
        st = ObjectStorage(state["path"].rsplit("/", 1)[0], state["opts"])
        t, n = st.tuning, len(files())
        views = [memoryview(v.reshape(-1).view(np.uint8)) for v in state["host"].values()]
        per, prefix = -(-len(views) // n), f"raw-puts/{os.getpid()}-{next(counter)}"

        def put(f: int) -> None:
            obstore.put(st.upload_store, f"{prefix}/f{f}", iter(views[f * per:(f + 1) * per]),
                        use_multipart=True, chunk_size=t.part_size, max_concurrency=t.upload_concurrency)

        with ThreadPoolExecutor(n) as pool:
            list(pool.map(put, range(n)))

    def forget_saves() -> None:  # untimed, before each save: the emulator holds every object in memory
        from cairn._storage.obstore import ObjectStorage

        st = ObjectStorage(state["path"].rsplit("/", 1)[0], state["opts"])
        name = state["path"].rsplit("/", 1)[1]
        for prefix in (f"{name}-saves/{os.getpid()}-", f"raw-puts/{os.getpid()}-"):
            keys = [k for k in st.list(prefix.rsplit("/", 1)[0]) if k.startswith(prefix)]
            if keys:  # (the base tree's storage may not have `delete_keys`)
                import obstore

                obstore.delete(st.store, keys)

    ops = {"raw get_ranges": raw_ranges, "raw whole": raw_whole, "numpy": load_numpy, "mesh": load_mesh,
           "cairn save": timed_save, "raw puts": raw_puts}
    before = {"cairn save": forget_saves, "raw puts": forget_saves}

    def profile(job: dict[str, Any]) -> dict[str, Any]:
        return _profile([ops[k] for k in job["ops"]] * job["n"])

    def handle(job: dict[str, Any]) -> Any:
        op = job["op"]
        if op == "setup":
            setup(job)
            return None
        if op == "save":
            save(job)
            return None
        if op == "check":
            got = cairn.load(state["path"], storage_options=state["opts"])["params"]
            rng = np.random.default_rng(0)
            return all(np.array_equal(got[k], rng.standard_normal(s, dtype=np.float32))
                       for k, s in state["shapes"].items())
        if op == "profile":
            return profile(job)
        if op == "phases":
            out = {k: statistics.median(v) for k, v in phases.items()}
            phases.clear()
            return out
        if op in before:
            before[op]()
        t0, c0 = time.perf_counter(), time.process_time()
        kept = ops[op]()
        out = [time.perf_counter() - t0, time.process_time() - c0]
        # What a pattern read is freed after the clock stops, and any garbage with it: freeing
        # 256 MiB-1 GiB of pages costs tens of ms, which would otherwise fall on whichever
        # pattern ran when the last reference went (or the collector ran), not on a load.
        del kept
        gc.collect()
        return out

    from benchmarks.measure import serve

    return serve(handle)


_IDLE = ("_worker (concurrent/futures/thread.py", "wait (threading.py", "_sample (", "readline",
         "select (selectors.py")


def _profile(fns: list[Any]) -> dict[str, Any]:
    """Run `fns` while a thread samples every other thread's stack every 2 ms."""
    import collections
    import threading

    inner: collections.Counter[str] = collections.Counter()
    cairn_inner: collections.Counter[str] = collections.Counter()
    stop = threading.Event()
    count = [0]

    def _sample() -> None:
        while not stop.is_set():
            for tid, frame in sys._current_frames().items():
                if tid == threading.get_ident():
                    continue
                f, chain = frame, []
                while f is not None:
                    code = f.f_code
                    chain.append(f"{code.co_name} ({'/'.join(code.co_filename.split('/')[-2:])}:{f.f_lineno})")
                    f = f.f_back
                top = chain[0]
                if top.startswith(("_worker (", "wait (threading.py", "get (queue", "_wait_for_tstate_lock")) or (
                        top.startswith("wait (") and any(c.startswith("_worker (") for c in chain[1:3])):
                    continue  # an idle pool thread
                count[0] += 1
                inner[top] += 1
                mine = next((c for c in chain if "cairn/" in c or "/_" in c.split("(", 1)[1][:12]), top)
                cairn_inner[mine] += 1
            time.sleep(0.002)

    th = threading.Thread(target=_sample, daemon=True)
    t0 = time.perf_counter()
    th.start()
    for fn in fns:
        fn()
    stop.set()
    th.join()
    return {"seconds": time.perf_counter() - t0, "samples": count[0], "inner": inner.most_common(25),
            "cairn_inner": cairn_inner.most_common(25)}


# ---------------------------------------------------------------------- driver


def Worker(name: str, src: str) -> Any:
    """A warm worker of the tree at `src` (its sources first, then this repository for `benchmarks`, then
    whatever the driver's path had: site packages carried along), on the CPU with 8 virtual devices."""
    from benchmarks import measure

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags = (flags + " --xla_force_host_platform_device_count=8").strip()
    return measure.Worker(name, str(HERE), [src, str(HERE.parents[2])], {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags},
                          stop_timeout=30)


def _loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def run(kind: str, a: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(HERE.parents[2]))
    from benchmarks.probes.objstore import start, through_link

    server = start(kind)
    workers: list[Worker] = []
    link = None
    try:
        bucket = server.bucket()
        opts = {**server.options(), **a.option}
        if a.link:  # every request through the shaped link (tests/_shapedlink.py)
            link = through_link(a.link, server, kind, opts)
        path = server.url(bucket, "ckpt")
        workers = [Worker(name, src.split("@")[0]) for name, src in a.trees]
        for w, (_, src) in zip(workers, a.trees):  # SRC@N: that worker's loads with threads=N (default 8)
            w(op="setup", path=path, opts=opts, size_mib=a.size_mib, arrays=a.arrays,
              threads=int(src.split("@")[1]) if "@" in src else None)
        if kind == "gcs":  # fake-gcs-server takes no write from obstore: save locally, copy in (loads only)
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                workers[0](op="save", compression=a.compression, local=f"{tmp}/ckpt")
                server.upload_tree(bucket, "ckpt", f"{tmp}/ckpt")
        else:
            workers[0](op="save", compression=a.compression)
        for w in workers:
            assert w(op="check"), f"{w.name} read back wrong bytes"
            for op in a.ops:  # warm up: connections, first use of every path
                w(op=op)
        times: dict[str, list[float]] = {}
        cpus: dict[str, list[float]] = {}  # this process's CPU seconds (all its threads) per repetition
        la = [_loadavg()]
        for rep in range(a.reps):
            order = workers if rep % 2 == 0 else workers[::-1]
            for op in a.ops if rep % 2 == 0 else a.ops[::-1]:
                for w in (order if not op.startswith("raw") else order[:1]):  # raw: the same code in both
                    key = f"raw: {op}" if op.startswith("raw") else f"{w.name}: {op}"
                    wall, cpu = w(op=op)
                    times.setdefault(key, []).append(wall)
                    cpus.setdefault(key, []).append(cpu)
        la.append(_loadavg())
        med = {k: statistics.median(v) for k, v in times.items()}
        raw = {k: v for k, v in med.items() if k.startswith("raw") and "puts" not in k}
        puts = med.get("raw: raw puts")
        best = min(raw, key=raw.__getitem__) if raw else None
        print(f"\n{kind}: {a.size_mib} MiB in {a.arrays} arrays, medians of {a.reps} "
              f"(load average {la[0]} -> {la[1]})")
        nbytes = a.size_mib * MiB
        for k, v in med.items():
            ratio = ""
            if k.endswith(": cairn save"):
                ratio = f"   {v / puts:.2f}x raw puts" if puts else ""
            elif best and not k.startswith("raw"):
                ratio = f"   {v / raw[best]:.2f}x best raw"
            if link is not None and link.rate:
                ratio += f"   {nbytes / v / link.rate:.2f} of the link"
            print(f"  {k:28s} {v:7.3f} s  (min {min(times[k]):.3f}, max {max(times[k]):.3f}; "
                  f"client CPU {statistics.median(cpus[k]):.3f} s){ratio}")
        for w in workers:
            ph = w(op="phases")
            print(f"  {w.name} load phases (medians): " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
        names = [w.name for w in workers]
        for op in a.ops:
            if not op.startswith("raw") and len(names) == 2:
                x, y = med[f"{names[1]}: {op}"], med[f"{names[0]}: {op}"]
                print(f"  {op}: {names[1]} / {names[0]} = {x / y:.3f}")
        result = {"server": kind, "seconds": times, "cpu_s": cpus, "median_s": med, "best_raw": best, "loadavg": la}
        for name in a.profile:
            w = next(w for w in workers if w.name == name)
            p = w(op="profile", ops=["numpy", "mesh"], n=a.profile_loads)
            result[f"profile {name}"] = p
            print(f"\n  profile of {name}: {2 * a.profile_loads} loads in {p['seconds']:.2f} s, "
                  f"{p['samples']} busy samples (load average {_loadavg()})")
            for title in ("inner", "cairn_inner"):
                print(f"   -- {title}")
                for frame, k in p[title][:14]:
                    print(f"   {100 * k / max(p['samples'], 1):5.1f}%  {frame}")
        return result
    finally:
        if link is not None:
            link.stop()
        for w in workers:
            try:
                w.stop()
            except Exception:
                w.proc.kill()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        return _worker()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="moto")
    ap.add_argument("--trees", default=f"base=/tmp/obj_base/src,new={HERE.parents[2] / 'src'}",
                    type=lambda s: [tuple(t.split("=", 1)) for t in s.split(",")],
                    help="name=src_dir[@threads],... (default base=/tmp/obj_base/src,new=this tree's src)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ops", default="raw get_ranges,raw whole,numpy,mesh", type=lambda s: s.split(","))
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--arrays", type=int, default=8)
    ap.add_argument("--compression", default="", help="the save's compression (default none)")
    ap.add_argument("--option", action="append", default=[], type=lambda kv: (kv.split("=", 1)[0], int(kv.split("=", 1)[1])),
                    help="a cairn storage option, e.g. read_part_size=16777216 (repeatable)")
    ap.add_argument("--profile", default="", type=lambda s: [x for x in s.split(",") if x],
                    help="trees (by name) to profile after the timed repetitions")
    ap.add_argument("--profile-loads", type=int, default=3)
    ap.add_argument("--link", default=None, metavar="SPEC",
                    help="every request through a shaped link, e.g. 1GB/s,10ms (tests/_shapedlink.py)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.option = dict(a.option)
    results = [run(kind, a) for kind in a.servers.split(",") if kind]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
