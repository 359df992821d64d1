"""Scenario `training`: checkpoint every step of a training loop, and what it costs the loop.

    python -m benchmarks.run training                          # this backend's defaults
    python -m benchmarks.run training --gib 2.38 --step-s 3.4,1.7 --steps 8 --workdir /tmp/train

The state is an MLP's: `--gib` of bf16 parameters (layers of four DxD matrices) with f32 AdamW
moments, built on the default device. Each step is a jitted, donating AdamW update from the
gradient of a real loss over a batch, plus a chain of bf16 matmuls sized (by measuring) so that a
step takes `--step-s` seconds; the loop reads the loss every step, as a training loop that logs it
does. Then, for each step time, the same `--steps` steps run:

- without saves (`none`), first and again last: the reference;
- with a checkpoint manager saving after every step, one row per `--modes` entry:
  `raw` (cairn, compression=False), `raw_host` (the same with the snapshot copied to host memory
  instead of on the device: CAIRN_DEVICE_SNAPSHOT=never), `true` (compression=True), `auto`,
  `continuous` (cairn's continuous=True, raw), `local` (every step into cairn's local tier under
  `--local-dir`, persisted every `--persist-every` steps), `orbax` (Orbax's CheckpointManager,
  async, save_interval_steps=1) and `orbax_continuous` (its ContinuousCheckpointingPolicy).

Each row reports the overhead (the loop's wall time over the reference's, minus 1), the longest
step against the reference's median step, the drain (waiting for the last save after the loop), the
steps saved and the median gap between saved steps, the bytes written, and per save the blocking
time and (cairn) the time from start to commit. A blocking probe follows (`--probe-gib`): save_async
of fresh arrays (as a step makes them) with the chip idle and busy, cairn's device and host
snapshots and Orbax's async save. Writes training.json and training.md into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

MODES = ["raw", "raw_host", "true", "auto", "continuous", "local", "orbax", "orbax_continuous"]


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run training", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=None, help="state size (default 2.38 on accelerators, 0.25 on CPU)")
    ap.add_argument("--dim", type=int, default=None, help="matrix side D (default 2048; 1024 on CPU)")
    ap.add_argument("--batch", type=int, default=None, help="rows per step's batch (default 256; 16 on CPU)")
    ap.add_argument("--chain-dim", type=int, default=None, help="side of the matmul chain (default 4096; 512 on CPU)")
    ap.add_argument("--step-s", default=None, help="comma list of step times (default 3.4,1.7; 1.5 on CPU)")
    ap.add_argument("--steps", type=int, default=8, help="steps per row")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list from {MODES}")
    ap.add_argument("--persist-every", type=int, default=4, help="the local tier's persistent saves")
    ap.add_argument("--probe-gib", type=float, default=None, help="blocking probe size (default 2; 0.25 on CPU; 0: none)")
    ap.add_argument("--probe-reps", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="where checkpoints go (default <out>/work)")
    ap.add_argument("--local-dir", default="/dev/shm/cairn-training-local", help="the local tier's directory")
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--trace", action="store_true", help="print each step's time and memory")
    ap.add_argument("--most-gib", type=float, default=1e9,
                    help="stop the run when this process's resident memory plus its files pass this")
    ap.add_argument("--least-free-gib", type=float, default=3.0,
                    help="stop the run when the machine's available memory falls under this")
    a = ap.parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; choose from {MODES}")
    return a


def _defaults(a: argparse.Namespace, cpu: bool) -> None:
    a.gib = a.gib if a.gib is not None else (0.25 if cpu else 2.38)
    a.dim = a.dim or (1024 if cpu else 2048)
    a.batch = a.batch or (16 if cpu else 256)
    a.chain_dim = a.chain_dim or (512 if cpu else 4096)
    a.step_s = [float(x) for x in (a.step_s or ("1.5" if cpu else "3.4,1.7")).split(",") if x]
    a.probe_gib = a.probe_gib if a.probe_gib is not None else (0.25 if cpu else 2.0)


# ---------------------------------------------------------------------- the model and its step


def build(a: argparse.Namespace) -> tuple[Any, Any, Any, int]:
    """The state {"params", "mu", "nu"} on the default device, the batch, and the jitted step."""
    import jax
    import jax.numpy as jnp

    d = a.dim
    layers = max(1, round(a.gib * (1 << 30) / (40 * d * d)))  # 4 matrices a layer: 2 + 4 + 4 bytes each
    names = [f"l{i:02d}_{m}" for i in range(layers) for m in ("q", "k", "v", "o")]

    @jax.jit
    def init(key: Any) -> Any:
        ks = jax.random.split(key, len(names))
        params = {n: (jax.random.normal(k, (d, d), jnp.float32) * (1.0 / d ** 0.5)).astype(jnp.bfloat16)
                  for n, k in zip(names, ks)}
        zeros = {n: jnp.zeros((d, d), jnp.float32) for n in names}
        return {"params": params, "mu": zeros, "nu": dict(zeros), "count": jnp.zeros((), jnp.int32)}

    def loss_fn(params: Any, x: Any) -> Any:
        h = x
        for n in names:
            h = jnp.tanh(h @ params[n])
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    def step(state: Any, x: Any, chain: Any, n_chain: int) -> Any:
        loss, g = jax.value_and_grad(loss_fn)(state["params"], x)
        b1, b2, lr, eps, wd = 0.9, 0.999, 1e-3, 1e-8, 0.01
        c = state["count"] + 1
        mu = {n: b1 * state["mu"][n] + (1 - b1) * g[n].astype(jnp.float32) for n in names}
        nu = {n: b2 * state["nu"][n] + (1 - b2) * jnp.square(g[n].astype(jnp.float32)) for n in names}
        cf = c.astype(jnp.float32)
        params = {}
        for n in names:
            p = state["params"][n].astype(jnp.float32)
            upd = (mu[n] / (1 - b1 ** cf)) / (jnp.sqrt(nu[n] / (1 - b2 ** cf)) + eps) + wd * p
            params[n] = (p - lr * upd).astype(jnp.bfloat16)
        # the rest of the step's compute, sized to the step time
        y = jax.lax.fori_loop(0, n_chain, lambda _, y: jnp.tanh(y @ chain), chain)
        return {"params": params, "mu": mu, "nu": nu, "count": c}, loss + 0.0 * jnp.sum(y[:1, :1])

    jstep = jax.jit(step, donate_argnums=(0,))
    state = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (a.batch, d), jnp.bfloat16)
    chain = (jax.random.normal(jax.random.key(2), (a.chain_dim, a.chain_dim), jnp.float32)
             / a.chain_dim ** 0.5).astype(jnp.bfloat16)
    jax.block_until_ready((state, x, chain))
    return state, (x, chain), jstep, layers


def calibrate(state: Any, inputs: Any, jstep: Any, target_s: float) -> tuple[Any, int, float]:
    """The chain length that makes a step take `target_s` (measured), and the state after the runs."""
    def timed(state: Any, n: int, reps: int = 2) -> tuple[Any, float]:
        state, loss = jstep(state, *inputs, n)  # compile
        float(loss)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            state, loss = jstep(state, *inputs, n)
            float(loss)
            ts.append(time.perf_counter() - t)
        return state, min(ts)

    state, t0 = timed(state, 0)
    probe = 4
    while True:  # enough matmuls that their time is well above the noise
        state, t1 = timed(state, probe)
        if t1 - t0 > 0.25 or t1 > target_s or probe >= 1 << 16:
            break
        probe *= 4
    per = max((t1 - t0) / probe, 1e-9)
    n = max(0, round((target_s - t0) / per))
    state, t = timed(state, n)
    return state, n, t


# ---------------------------------------------------------------------- the loops


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def loop(mode: str, state: Any, inputs: Any, jstep: Any, n_chain: int, steps: int, first: int,
         work: str, a: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """`steps` steps from step `first`, saving after each as `mode` says; the row and the state after."""
    import cairn
    from cairn._tree import shardings

    where = os.path.join(work, mode)
    shutil.rmtree(where, ignore_errors=True)
    mgr: Any = None
    saved: list[int] = []
    events: list[Any] = []
    listener = None
    old_snapshot = shardings.DEVICE_SNAPSHOT
    if mode in ("raw", "raw_host", "true", "auto", "continuous", "local"):
        kw: dict[str, Any] = {"max_to_keep": 2, "handle_sigterm": False,
                              "compression": {"true": True, "auto": "auto"}.get(mode, False)}
        if mode == "continuous":
            kw["continuous"] = True
        if mode == "local":
            shutil.rmtree(a.local_dir, ignore_errors=True)
            kw["local"] = cairn.LocalTier(a.local_dir, every=1, keep=2, replicas=0)
            kw["save_every"] = a.persist_every
        if mode == "raw_host":
            shardings.DEVICE_SNAPSHOT = "never"
        mgr = cairn.CheckpointManager(where, **kw)

        def listener(e: Any) -> None:
            if e.kind == "save" and e.path.startswith(where):
                events.append(e.stats)

        cairn.add_listener(listener)
    elif mode.startswith("orbax"):
        import orbax.checkpoint as ocp

        policy = {}
        if mode == "orbax_continuous":
            policy["save_decision_policy"] = ocp.checkpoint_managers.ContinuousCheckpointingPolicy()
        mgr = ocp.CheckpointManager(where, options=ocp.CheckpointManagerOptions(
            max_to_keep=2, save_interval_steps=1, enable_async_checkpointing=True, **policy))
    step_t: list[float] = []
    block_t: list[float] = []
    t_loop = time.perf_counter()
    try:
        for s in range(first, first + steps):
            t = time.perf_counter()
            state, loss = jstep(state, *inputs, n_chain)
            float(loss)
            tb = time.perf_counter()
            if mode.startswith("orbax"):
                import orbax.checkpoint as ocp

                if mgr.save(s, args=ocp.args.StandardSave(state)):
                    saved.append(s)
            elif mgr is not None:
                if mgr.save(s, state) and (mode != "local" or s % a.persist_every == 0):
                    saved.append(s)
            te = time.perf_counter()
            block_t.append(te - tb)
            step_t.append(te - t)
            if a.trace:
                print(f"    {mode} step {s}: {te - t:.3f} s (save call {te - tb:.3f}) {_meminfo()}", flush=True)
        loop_s = time.perf_counter() - t_loop
        t = time.perf_counter()
        if mode.startswith("orbax"):
            mgr.wait_until_finished()
        elif mgr is not None:
            mgr.wait()
        drain = time.perf_counter() - t
    finally:
        shardings.DEVICE_SNAPSHOT = old_snapshot
        if listener is not None:
            cairn.remove_listener(listener)
    row: dict[str, Any] = {"mode": mode, "loop_s": loop_s, "drain_s": drain, "steps": steps,
                           "step_s": step_t, "save_call_s": block_t, "saved": saved}
    gaps = [b - a_ for a_, b in zip(saved, saved[1:])]
    row["median_gap_steps"] = statistics.median(gaps) if gaps else None
    if events:
        row["bytes_written"] = sum(e.bytes_written for e in events)
        row["save_total_s"] = [round(e.total_s, 3) for e in events]
        row["save_queued_s"] = [round(e.queued_s, 3) for e in events]
        row["save_blocking_s"] = [round(e.blocking_s, 4) for e in events]
    elif mode.startswith("orbax") and saved:
        steps_there = [d for d in os.listdir(where) if d.isdigit()]
        row["bytes_written"] = (_dir_bytes(os.path.join(where, max(steps_there, key=int))) * len(saved)
                                if steps_there else 0)
    if mode == "local":
        row["local_saves"] = steps
    if mgr is not None and not mode.startswith("orbax"):
        st = mgr.stats
        row["manager"] = {"saves": st.saves, "skipped": st.skipped, "waited_s": round(st.waited_s, 3),
                          "longest_wait_s": round(st.longest_wait_s, 3),
                          "longest_blocking_s": round(st.longest_blocking_s, 4)}
        mgr.close()
    elif mgr is not None:
        mgr.close()
    shutil.rmtree(where, ignore_errors=True)
    return state, row


# ---------------------------------------------------------------------- the blocking probe


def probe(a: argparse.Namespace, work: str, inputs: Any, jstep: Any) -> list[dict[str, Any]]:
    """save_async's blocking time on fresh arrays (128 of them, as a step makes them), idle and busy."""
    import jax
    import jax.numpy as jnp

    import cairn
    from cairn._tree import shardings

    n = 128
    side = max(8, int((a.probe_gib * (1 << 30) / n / 4) ** 0.5))
    fresh = jax.jit(lambda k: [jax.random.normal(jax.random.fold_in(k, i), (side, side), jnp.float32)
                               for i in range(n)])
    x, chain = inputs
    busy_fn = jax.jit(lambda c: [jnp.tanh(c @ c) for _ in range(1)][0])
    rows = []
    systems = ["cairn_device", "cairn_host", "orbax"]
    try:
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()
    except ImportError:
        systems.remove("orbax")
    for busy in (False, True):
        for rep in range(a.probe_reps):
            for system in systems:
                arrs = fresh(jax.random.key(1000 + rep))
                jax.block_until_ready(arrs)
                if busy:  # the chip computes while the save is asked for
                    y = chain
                    for _ in range(40):
                        y = busy_fn(y)
                path = os.path.join(work, f"probe-{system}-{int(busy)}-{rep}")
                shutil.rmtree(path, ignore_errors=True)
                t = time.perf_counter()
                if system == "orbax":
                    ckptr.save(path, {"a": arrs})
                    blocked = time.perf_counter() - t
                    ckptr.wait_until_finished()
                else:
                    shardings.DEVICE_SNAPSHOT = "auto" if system == "cairn_device" else "never"
                    f = cairn.save_async(path, {"a": arrs})
                    blocked = time.perf_counter() - t
                    f.result()
                    shardings.DEVICE_SNAPSHOT = "auto"
                total = time.perf_counter() - t
                if busy:
                    jax.block_until_ready(y)
                rows.append({"system": system, "busy": busy, "rep": rep, "blocking_s": blocked, "total_s": total})
                del arrs
                shutil.rmtree(path, ignore_errors=True)
    return rows


# ---------------------------------------------------------------------- the report


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| step s | mode | overhead | with drain | longest step / median | drain s | saved | median gap | "
           "GiB written | save call s (median, max) | save start to commit s (median) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["mode"] == "none":
            continue
        ref = r["reference"]
        over = r["loop_s"] / ref["loop_s"] - 1
        with_drain = (r["loop_s"] + r["drain_s"]) / ref["loop_s"] - 1
        longest = max(r["step_s"]) / _median(ref["step_s"])
        gib = r.get("bytes_written", 0) / (1 << 30)
        calls = r["save_call_s"]
        commit = _median(r.get("save_total_s", [])) if r.get("save_total_s") else float("nan")
        gap = r["median_gap_steps"]
        out.append(f"| {r['target_step_s']} | {r['mode']} | {over:+.1%} | {with_drain:+.1%} | {longest:.2f} | "
                   f"{r['drain_s']:.2f} | {len(r['saved'])}/{r['steps']} | {gap if gap is not None else '-'} | "
                   f"{gib:.2f} | {_median(calls):.3f}, {max(calls):.3f} | {commit:.2f} |")
    return "\n".join(out)


def probe_table(rows: list[dict[str, Any]]) -> str:
    out = ["| chip | system | blocking s (median; min-max) | to commit s (median) |", "|---|---|---|---|"]
    for busy in (False, True):
        for system in sorted({r["system"] for r in rows}):
            rs = [r for r in rows if r["system"] == system and r["busy"] == busy]
            if not rs:
                continue
            b = [r["blocking_s"] for r in rs]
            out.append(f"| {'busy' if busy else 'idle'} | {system} | {_median(b):.4f}; {min(b):.4f}-{max(b):.4f} | "
                       f"{_median([r['total_s'] for r in rs]):.2f} |")
    return "\n".join(out)


def _meminfo() -> dict[str, float]:
    """This process's resident memory and the machine's available memory, in GiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_gib"] = round(int(line.split()[1]) / (1 << 20), 2)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                out["available_gib"] = round(int(line.split()[1]) / (1 << 20), 2)
    return out


def _watchdog(least_gib: float, most_gib: float, dirs: list[str]) -> None:
    """Stop the run (exit 3, saying so) before the machine runs out of memory: when its available
    memory falls under `least_gib`, or this process's resident memory plus the files under `dirs`
    (which a sandbox may keep in memory) pass `most_gib`."""
    import threading

    def watch() -> None:
        while True:
            m = _meminfo()
            files = sum(_dir_bytes(d) for d in dirs if os.path.isdir(d)) / (1 << 30)
            if m.get("available_gib", 1e9) < least_gib or m.get("rss_gib", 0) + files > most_gib:
                print(f"benchmarks.training: stopping, memory nearly out: {m}, files {files:.1f} GiB", flush=True)
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> int:
    a = parse(argv)
    import jax


    cpu = jax.default_backend() == "cpu"
    _defaults(a, cpu)
    os.makedirs(a.out, exist_ok=True)
    work = a.workdir or os.path.join(a.out, "work")
    os.makedirs(work, exist_ok=True)
    _watchdog(a.least_free_gib, a.most_gib, [work, a.local_dir])
    info = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "cores": os.cpu_count(),
            "jax": jax.__version__, "args": {k: v for k, v in vars(a).items()}, "loadavg_start": os.getloadavg()}
    print(json.dumps(info), flush=True)
    t = time.perf_counter()
    state, inputs, jstep, layers = build(a)
    raw = sum(x.nbytes for x in jax.tree.leaves(state))
    print(f"state: {layers} layers of 4 x {a.dim}^2, {raw / (1 << 30):.2f} GiB, built in "
          f"{time.perf_counter() - t:.1f} s; {_meminfo()}", flush=True)
    info["state_bytes"] = raw
    rows: list[dict[str, Any]] = []
    probes: list[dict[str, Any]] = []

    def dump() -> None:
        with open(os.path.join(a.out, "training.json"), "w") as f:
            json.dump({"info": info, "rows": rows, "probe": probes}, f, indent=1, default=str)

    if a.probe_gib > 0:  # first: it holds the least memory, and a stopped run still has it
        probes = probe(a, work, inputs, jstep)
        print(probe_table(probes), flush=True)
        dump()
    step = 0
    for target in a.step_s:
        state, n_chain, t1 = calibrate(state, inputs, jstep, target)
        print(f"step {target} s: chain of {n_chain}, measured {t1:.3f} s", flush=True)
        state, ref = loop("none", state, inputs, jstep, n_chain, a.steps, step, work, a)
        step += a.steps
        for mode in a.modes:
            state, row = loop(mode, state, inputs, jstep, n_chain, a.steps, step, work, a)
            step += a.steps
            row.update(target_step_s=target, chain=n_chain, reference=ref)
            rows.append(row)
            dump()
            print(f"  {mode}: loop {row['loop_s']:.2f} s against {ref['loop_s']:.2f}, drain {row['drain_s']:.2f}, "
                  f"saved {len(row['saved'])}, manager {row.get('manager')}, {_meminfo()}", flush=True)
        state, ref2 = loop("none", state, inputs, jstep, n_chain, a.steps, step, work, a)
        step += a.steps
        print(f"  reference again: {ref2['loop_s']:.2f} s (first {ref['loop_s']:.2f})", flush=True)
        ref["loop_s_again"] = ref2["loop_s"]
    info["loadavg_end"] = os.getloadavg()
    dump()
    md = table(rows) + "\n\n" + (probe_table(probes) if probes else "")
    with open(os.path.join(a.out, "training.md"), "w") as f:
        f.write(md + "\n")
    print(md, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
