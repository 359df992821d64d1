"""Repeated loads in one process: an evaluator that loads each new step, a job that reloads after a rollback.

    python -m benchmarks.run repeated_load [--gib 1.5] [--loads 5] [--rounds 3] [--workdir DIR]
        [--trees SRC[,SRC...]] [--keep] [--json out.json]

The Llama-like float32 state of `benchmarks.state` (random mantissas, sharded over the 8 devices as
`benchmarks.state.sharding_for` says) is saved once per tree with ``compression=False``. Then, round by
round with the trees alternated, one fresh Python process per tree imports JAX and cairn, initialises
the devices (not timed) and loads the checkpoint `--loads` times onto targets of
``jax.ShapeDtypeStruct`` with the saved sharding, printing each load's time (block_until_ready
included), and checks the last load's values and shardings (not timed). Each load drops the previous
one's arrays first, as an evaluator that is done with a step does; with ``--keep`` they stay alive
until the load returns (``state = cairn.load(...)``). The same process then measures the limit of a
warm load: a read of the checkpoint's files, already in the page cache, into buffers it allocated
before (the best of three), and a ``jax.device_put`` of the same state's numpy arrays onto the same
shardings (the best of three).

``--trees`` names source folders (each put first on the children's PYTHONPATH), so that an older
checkout of cairn can be measured against this one in the same run; the default is the cairn this
package imports. Files stay in the page cache for all trees alike.
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
import time
from typing import Any

import numpy as np

GiB = float(1 << 30)


def _spec(gib: float) -> Any:
    from . import state as st

    return st.sized_spec(int(gib * GiB), "float32")


def _child_save(path: str, gib: float) -> None:
    import jax

    import cairn

    from . import state as st

    state, _ = st.build_jax(_spec(gib), "float32")
    cairn.save(path, state, compression=False)
    jax.block_until_ready(state)


def _read_files(path: str, bufs: dict[str, bytearray]) -> int:
    total = 0
    for name, buf in bufs.items():
        with open(os.path.join(path, name), "rb", buffering=0) as f:
            n = f.readinto(buf)
            total += n or 0
    return total


def _child_load(path: str, gib: float, loads: int, keep: bool) -> dict[str, Any]:
    import jax

    from . import state as st

    jax.block_until_ready([jax.device_put(0.0, d) for d in jax.devices()])  # runtime start, not timed
    import cairn

    spec = _spec(gib)
    target = st.abstract_jax(spec, "float32", resharded=False)
    times = []
    out = None
    for _ in range(loads):
        if not keep:
            out = None  # the previous load's arrays are dropped, as an evaluator drops the last step's
        t0 = time.perf_counter()
        out = jax.block_until_ready(cairn.load(path, target))
        times.append(time.perf_counter() - t0)
    # The limit: the files (warm) into buffers that exist, then device_put of arrays that exist.
    names = []
    for root, _, files in os.walk(path):
        for f in files:
            names.append(os.path.relpath(os.path.join(root, f), path))
    bufs = {n: bytearray(os.path.getsize(os.path.join(path, n))) for n in names}
    _read_files(path, bufs)
    read_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        _read_files(path, bufs)
        read_s.append(time.perf_counter() - t0)
    del bufs
    m = st.mesh()
    hosts = [st.leaf_values(leaf, i, np.dtype(np.float32)) for i, leaf in enumerate(spec)]
    flat = st.unnest(out)
    for leaf, host in zip(spec, hosts):  # the last load's values and shardings, checked after the clock
        got = flat[leaf.name]
        if not got.sharding.is_equivalent_to(st.sharding_for(leaf, m), host.ndim):
            raise AssertionError(f"{leaf.name}: loaded with sharding {got.sharding}")
        if not np.array_equal(np.asarray(got), host):
            raise AssertionError(f"{leaf.name}: the loaded values differ from the saved ones")
    del out, flat, got
    shardings = [st.sharding_for(leaf, m) for leaf in spec]
    put_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        placed = jax.block_until_ready(jax.device_put(hosts, shardings))
        put_s.append(time.perf_counter() - t0)
        del placed
    return {"loads_s": times, "read_s": min(read_s), "put_s": min(put_s), "cairn": cairn.__file__}


def _run_child(tree: str | None, args: list[str], timeout: float) -> str:
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env.setdefault("JAX_PLATFORMS", "cpu")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parts = ([tree] if tree else []) + [here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    r = subprocess.run([sys.executable, "-m", "benchmarks.repeated", *args], env=env, cwd=here,
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"child {args[:2]} with tree {tree or 'default'} failed:\n{r.stderr[-4000:]}")
    return r.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run repeated_load", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.5, help="state size (GiB)")
    ap.add_argument("--loads", type=int, default=5, help="loads per fresh process")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (one process per tree each)")
    ap.add_argument("--trees", default="", help="comma list of source folders to alternate ('' for this cairn)")
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per child process")
    ap.add_argument("--keep", action="store_true", help="keep the previous load's arrays alive during each load")
    ap.add_argument("--child", choices=["save", "load"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.loads < 1 or a.rounds < 1:
        ap.error("--loads and --rounds must be at least 1")
    if a.child == "save":
        _child_save(a.path, a.gib)
        print("{}")
        return 0
    if a.child == "load":
        print(json.dumps(_child_load(a.path, a.gib, a.loads, a.keep)))
        return 0
    trees: list[str | None] = [os.path.abspath(t) for t in a.trees.split(",") if t] or [None]
    for t in trees:
        if t is not None and not os.path.isdir(os.path.join(t, "cairn")):
            ap.error(f"--trees: {t} holds no cairn package")
    work = a.workdir or tempfile.mkdtemp(prefix="repeated-")
    os.makedirs(work, exist_ok=True)
    paths = {}
    try:
        for i, t in enumerate(trees):
            paths[t] = os.path.join(work, f"ckpt{i}")
            shutil.rmtree(paths[t], ignore_errors=True)
            _run_child(t, ["--child", "save", "--path", paths[t], "--gib", str(a.gib)], a.timeout)
        rows = []
        for r in range(a.rounds):
            for t in (trees if r % 2 == 0 else trees[::-1]):
                res = json.loads(_run_child(t, ["--child", "load", "--path", paths[t], "--gib", str(a.gib),
                                                "--loads", str(a.loads), *(["--keep"] if a.keep else [])],
                                           a.timeout))
                res.update(round=r, tree=t or "default")
                rows.append(res)
                lo = res["loads_s"]
                print(f"round {r} {res['tree']}: first {lo[0]:.3f} s, then "
                      + " ".join(f"{x:.3f}" for x in lo[1:])
                      + f" | raw read {res['read_s']:.3f} s + device_put {res['put_s']:.3f} s", flush=True)
        print("\nmedians per tree (first load; repeated loads; repeated / (read + put))")
        for t in trees:
            mine = [x for x in rows if x["tree"] == (t or "default")]
            first = statistics.median(x["loads_s"][0] for x in mine)
            rest = [y for x in mine for y in x["loads_s"][1:]]
            rep = statistics.median(rest) if rest else float("nan")
            limit = statistics.median(x["read_s"] + x["put_s"] for x in mine)
            print(f"  {t or 'default'}: first {first:.3f} s; repeated {rep:.3f} s; limit {limit:.3f} s; "
                  f"ratio {rep / limit:.2f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": {k: v for k, v in vars(a).items() if k not in ("child", "path")}, "rows": rows},
                          f, indent=1)
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
