"""Incremental against full saves, side by side in one run: ``python -m benchmarks.probe incremental``.

Three cases, each a sequence of training-like steps saved twice
per step: in full (``cairn.save``, format 2, raw) and incrementally
(``cairn.save(..., base=previous)``, format 4, raw), on local disk:

- ``frozen``: a frozen bf16 backbone (`--backbone-mib`, default 256 MiB)
  plus a trainable bf16 head with its AdamW moments (f32 mu and nu); every
  step changes the head and both moments everywhere.
- ``frozen-jax``: the same, the backbone a ``jax.Array`` (on the default
  device) passed unchanged, the same object, to every save: what a JAX
  training loop that does not update the backbone saves. An incremental save
  refers to its blocks without hashing them (`_save.hashmemo._HASHED`).
- ``frozen-jax-async``: the ``frozen-jax`` state saved with ``cairn.save_async``, in full and
  incrementally, each save finished before the next: the blocking time (``stats.blocking_s``) and the
  bytes the snapshot copied. An incremental async save decides before its snapshot which chunks of
  an unchanged jax.Array its base holds, and copies only the rest
  (`_save.incremental.Incremental.decide_unchanged`).
- ``frozen-jax-manager``: the same through two ``CheckpointManager`` objects (async saves), one
  ``incremental=True`` and one not, alternated step by step, each save finished before the next:
  the time ``mgr.save`` blocks.
- ``lr1e-6``: the bf16 parameters of a trained-like state
  (`benchmarks.trained_state`) under one AdamW step at learning rate 1e-6 per
  save (f32 moments updated alongside), the parameters' bytes reported apart.
- ``pretrain``: the same state at lr 3e-4: every value changes every step.

Per case: bytes and data files written per save after the first, save time (median of the
saves after the first, each save's own wall time with fsync, each started
after an ``os.sync()`` so that it pays for no earlier write, and the
median and range of the incremental/full ratio of each step), load time of
the last step (`--load-reps` loads of each, alternated, the order flipped
every rep: medians, and the median and range of the paired ratios), and
for ``lr1e-6`` the element and block change rates and what an
XOR-then-zstd delta of the changed parameter blocks stores
(computed here apart from the save, as a check of the incremental save's
own bytes: it writes such blocks as deltas against the base's blocks,
docs/FORMAT.md §6.5). The machine's load is printed beside the figures.
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

import ml_dtypes
import numpy as np
import zstandard

import cairn
from benchmarks.trained_state import B1, B2, EPS, WD, make_state

MiB = 1 << 20
BF16 = np.dtype(ml_dtypes.bfloat16)


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, np.ndarray]]:
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in _leaves(v, f"{prefix}{k}/")]
    return [(prefix[:-1], tree)]


def _adamw(state: dict, lr: float, rng: np.random.Generator, t: int) -> None:
    """One AdamW step in place: fresh gradients at the trained state's scale, f32 arithmetic, params cast back."""
    for (_, p), (_, mu), (_, nu) in zip(_leaves(state["params"]), _leaves(state["opt_state"]["mu"]),
                                           _leaves(state["opt_state"]["nu"])):
        g = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(3e-3)
        mu *= np.float32(B1)
        mu += np.float32(1 - B1) * g
        nu *= np.float32(B2)
        nu += np.float32(1 - B2) * g * g
        step = mu / np.float32(1 - B1**t) / (np.sqrt(nu / np.float32(1 - B2**t)) + np.float32(EPS))
        pf = p.astype(np.float32)
        if p.ndim == 2:
            step += np.float32(WD) * pf
        pf -= np.float32(lr) * step
        p[...] = pf.astype(p.dtype)


def _frozen_state(backbone_mib: int, head_mib: int) -> dict:
    rng = np.random.default_rng(0)
    cols = 4096
    backbone = {f"layer{i:02d}": (rng.standard_normal((backbone_mib * MiB // 2 // cols // 16, cols), np.float32)
                                  * np.float32(0.02)).astype(BF16) for i in range(16)}
    head = (rng.standard_normal((head_mib * MiB // 2 // 1024, 1024), np.float32) * np.float32(0.02)).astype(BF16)
    return {"params": {"backbone": backbone, "head": head},
            "opt_state": {"mu": {"head": np.zeros(head.shape, np.float32)},
                          "nu": {"head": np.zeros(head.shape, np.float32)}}}


def _frozen_step(state: dict, rng: np.random.Generator, t: int) -> None:
    sub = {"params": {"head": state["params"]["head"]}, "opt_state": state["opt_state"]}
    _adamw(sub, 3e-4, rng, t)


def _nbytes(tree: Any) -> int:
    return sum(x.nbytes for _, x in _leaves(tree))


def _own_bytes(path: str, prefix: str = "") -> int:
    """Bytes of the checkpoint's own data files (under `prefix`, an item folder, if given)."""
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(path, prefix))
               for f in fs if f.endswith(".bin"))


def _delta_estimate(old: list[np.ndarray], new: list[np.ndarray]) -> dict[str, float]:
    """Element and 1 MiB block change rates of the parameters, and the bytes of XOR-then-zstd (level 1)
    of every changed block: what the delta codec should store (computed apart, to check the saves' bytes)."""
    cctx = zstandard.ZstdCompressor(level=1)
    changed = total = blocks = changed_blocks = delta = 0
    for a, b in zip(old, new):
        ab, bb = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
        changed += int(np.count_nonzero(a.reshape(-1).view(np.uint16) != b.reshape(-1).view(np.uint16)))
        total += a.size
        for o in range(0, ab.size, MiB):
            blocks += 1
            x, y = ab[o : o + MiB], bb[o : o + MiB]
            if not np.array_equal(x, y):
                changed_blocks += 1
                delta += len(cctx.compress(np.bitwise_xor(x, y).tobytes()))
    return {"elements_changed": changed / max(total, 1), "blocks_changed": changed_blocks / max(blocks, 1),
            "xor_zstd_bytes": delta}


def run_case(name: str, state: dict, step_fn: Any, saves: int, root: str, load_reps: int = 9) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    loadavg_start = os.getloadavg()
    full_t, inc_t, full_b, inc_b, param_full, param_inc = [], [], [], [], [], []
    full_cpu, inc_cpu = [], []  # CPU seconds of this process (all its threads): what a busy host does not hide
    files: dict[str, list[int]] = {"full": [], "inc": []}  # data files written per save (`SaveStats.files_written`)
    extra: dict[str, Any] = {}
    prev = None
    for t in range(1, saves + 1):
        if t > 1:
            before = [x.copy() for _, x in _leaves(state["params"])] if name == "lr1e-6" else None
            step_fn(state, rng, t)
            if before is not None:
                est = _delta_estimate(before, [x for _, x in _leaves(state["params"])])
                for k, v in est.items():
                    extra.setdefault(k, []).append(v)
        full, inc = os.path.join(root, f"{name}_full_{t}"), os.path.join(root, f"{name}_inc_{t}")
        # Alternate which goes first, so that neither always meets a cold or a warm page cache.
        order = [("full", full), ("inc", inc)] if t % 2 else [("inc", inc), ("full", full)]
        for kind, path in order:
            # Each save starts on a quiet disk: neither inherits the writeback of the one before it (the
            # other kind's, or a deletion's), which on a shared disk would be charged to whichever came second.
            os.sync()
            time.sleep(0.2)
            t0, c0 = time.perf_counter(), time.process_time()
            if kind == "full":
                st = cairn.save(path, state, compression=False)
            else:
                st = cairn.save(path, state, compression=False, base=prev)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if t == 1:
                continue
            (full_t if kind == "full" else inc_t).append(dt)
            (full_cpu if kind == "full" else inc_cpu).append(dc)
            (full_b if kind == "full" else inc_b).append(st.bytes_written)
            files[kind].append(st.files_written)
            (param_full if kind == "full" else param_inc).append(_own_bytes(path, "params"))
        if t == 1:  # the chain starts with a self-contained save with hashes
            shutil.rmtree(inc)
            cairn.save(inc, state, compression=False, base=full)  # a format-2 base: everything written, hashed
        if prev is not None and t > 2:
            shutil.rmtree(os.path.join(root, f"{name}_full_{t - 1}"))
        prev = inc
    loads: dict[str, list[float]] = {"inc": [], "full": [], "inc_cpu": [], "full_cpu": []}
    last = (("inc", prev), ("full", os.path.join(root, f"{name}_full_{saves}")))
    for k in range(load_reps):  # alternated, the order flipped every rep; medians and paired ratios
        for kind, path in (last if k % 2 == 0 else last[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            cairn.load(path)
            loads[kind].append(time.perf_counter() - t0)
            loads[kind + "_cpu"].append(time.process_time() - c0)
    load_inc, load_full = statistics.median(loads["inc"]), statistics.median(loads["full"])
    out = {
        "case": name, "state_bytes": _nbytes(state), "saves_timed": len(inc_t), "loads_timed": load_reps,
        "save_ratios": [a / b for a, b in zip(inc_t, full_t)],
        "load_ratios": [a / b for a, b in zip(loads["inc"], loads["full"])],
        "load_cpu_ratios": [a / b for a, b in zip(loads["inc_cpu"], loads["full_cpu"])],
        "loadavg_end": os.getloadavg(),
        "full_bytes": statistics.median(full_b), "inc_bytes": statistics.median(inc_b),
        "full_files": statistics.median(files["full"]), "inc_files": statistics.median(files["inc"]),
        "full_save_s": statistics.median(full_t), "inc_save_s": statistics.median(inc_t),
        "params_full_bytes": statistics.median(param_full), "params_inc_bytes": statistics.median(param_inc),
        "load_full_s": load_full, "load_inc_s": load_inc,
        "full_save_cpu_s": statistics.median(full_cpu), "inc_save_cpu_s": statistics.median(inc_cpu),
        "load_full_cpu_s": statistics.median(loads["full_cpu"]), "load_inc_cpu_s": statistics.median(loads["inc_cpu"]),
    }
    out["loadavg_start"] = loadavg_start
    out.update({k: statistics.median(v) for k, v in extra.items()})
    return out


def run_async_case(name: str, state: dict, step_fn: Any, saves: int, root: str) -> dict[str, Any]:
    """Blocking time of ``cairn.save_async`` in full and incrementally (against the previous incremental
    step), alternated step by step, each save finished before the next is asked."""
    rng = np.random.default_rng(1)
    loadavg_start = os.getloadavg()
    block: dict[str, list[float]] = {"full": [], "inc": []}
    copied: dict[str, list[int]] = {"full": [], "inc": []}
    prev = None
    for t in range(1, saves + 1):
        if t > 1:
            step_fn(state, rng, t)
        full, inc = os.path.join(root, f"{name}_full_{t}"), os.path.join(root, f"{name}_inc_{t}")
        order = [("full", full), ("inc", inc)] if t % 2 else [("inc", inc), ("full", full)]
        for kind, path in order:
            os.sync()
            time.sleep(0.2)
            if kind == "full":
                f = cairn.save_async(path, state, compression=False)
            elif prev is None:  # the chain starts with a self-contained save with hashes
                cairn.save(path + "_plain", state, compression=False)
                f = cairn.save_async(path, state, compression=False, base=path + "_plain")
            else:
                f = cairn.save_async(path, state, compression=False, base=prev)
            f.result()
            if t > 1:
                block[kind].append(f.stats.blocking_s)
                copied[kind].append(f.stats.snapshot_bytes)
        if prev is not None:
            shutil.rmtree(os.path.join(root, f"{name}_full_{t - 1}"))
        prev = inc
    return {"case": name, "state_bytes": _nbytes(state), "saves_timed": len(block["inc"]), "async": True,
            "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(),
            "block_full_s": statistics.median(block["full"]), "block_inc_s": statistics.median(block["inc"]),
            "block_ratios": [a / b for a, b in zip(block["inc"], block["full"])],
            "snapshot_full_bytes": statistics.median(copied["full"]),
            "snapshot_inc_bytes": statistics.median(copied["inc"])}


def run_manager_case(name: str, state: dict, step_fn: Any, saves: int, root: str) -> dict[str, Any]:
    """Blocking time of a `CheckpointManager`'s async ``save``: incremental against not, alternated."""
    rng = np.random.default_rng(1)
    loadavg_start = os.getloadavg()
    block: dict[str, list[float]] = {"full": [], "inc": []}
    with cairn.CheckpointManager(os.path.join(root, "inc"), incremental=True, max_to_keep=2, full_every=1000,
                                 compression=False) as mi, \
            cairn.CheckpointManager(os.path.join(root, "full"), max_to_keep=2, compression=False) as mf:
        for step in range(saves):
            if step:
                step_fn(state, rng, step + 1)
            for kind, mgr in ((("full", mf), ("inc", mi)) if step % 2 else (("inc", mi), ("full", mf))):
                os.sync()
                time.sleep(0.2)
                t0 = time.perf_counter()
                mgr.save(step, state)
                dt = time.perf_counter() - t0
                mgr.wait()
                if step:
                    block[kind].append(dt)
    return {"case": name, "state_bytes": _nbytes(state), "saves_timed": len(block["inc"]), "async": True,
            "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(),
            "block_full_s": statistics.median(block["full"]), "block_inc_s": statistics.median(block["inc"]),
            "block_ratios": [a / b for a, b in zip(block["inc"], block["full"])]}


def _spread(ratios: list[float]) -> str:
    """Paired ratios as 'median [min-max]' (the VM is shared: one ratio is no measurement)."""
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]" if ratios else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone-mib", type=int, default=256)
    ap.add_argument("--head-mib", type=int, default=8, help="the trainable head's bf16 bytes (moments: 4x that)")
    ap.add_argument("--state-mib", type=int, default=256, help="the trained-like state of lr1e-6 and pretrain")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--load-reps", type=int, default=9, help="loads of the last step, incremental and full alternated")
    ap.add_argument("--cases", default="frozen,frozen-jax,lr1e-6,pretrain")
    ap.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="cairn-incr-", dir=args.dir)
    results = []
    try:
        for case in args.cases.split(","):
            if case in ("frozen", "frozen-jax", "frozen-jax-async", "frozen-jax-manager"):
                state, fn = _frozen_state(args.backbone_mib, args.head_mib), _frozen_step
                if case != "frozen":
                    import jax

                    bb = state["params"]["backbone"]
                    state["params"]["backbone"] = {k: jax.device_put(v) for k, v in bb.items()}
            elif case in ("lr1e-6", "pretrain"):
                lr = 1e-6 if case == "lr1e-6" else 3e-4
                state = make_state(args.state_mib * MiB, "bf16-f32")
                fn = (lambda lr_: lambda s, rng, t: _adamw(s, lr_, rng, 20 + t))(lr)
            else:
                raise SystemExit(f"unknown case {case!r}")
            if case == "frozen-jax-async":
                results.append(run_async_case(case, state, fn, args.saves, root))
            elif case == "frozen-jax-manager":
                results.append(run_manager_case(case, state, fn, args.saves, root))
            else:
                results.append(run_case(case, state, fn, args.saves, root, args.load_reps))
            shutil.rmtree(root)
            os.makedirs(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()
    if args.json:
        print(json.dumps({"loadavg": load, "results": results}, indent=1))
        return 0
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} cores")
    for r in results:
        print(f"\n{r['case']}: state {r['state_bytes'] / MiB:.0f} MiB, {r['saves_timed']} saves timed after the first"
              f" (load average {r['loadavg_start'][0]:.2f} at its start, {r['loadavg_end'][0]:.2f} at its end)")
        if r.get("async"):
            copied = (f"; snapshot copied: full {r['snapshot_full_bytes'] / MiB:.1f} MiB, incremental "
                      f"{r['snapshot_inc_bytes'] / MiB:.1f} MiB" if "snapshot_inc_bytes" in r else "")
            print(f"  {'save_async' if 'snapshot_inc_bytes' in r else 'manager save'} blocking time (median): full "
                  f"{r['block_full_s'] * 1e3:.1f} ms, incremental {r['block_inc_s'] * 1e3:.1f} ms "
                  f"({r['block_inc_s'] / r['block_full_s']:.2f}x), per step {_spread(r['block_ratios'])}{copied}")
            continue
        print(f"  bytes written per save: full {r['full_bytes'] / MiB:.1f} MiB, incremental {r['inc_bytes'] / MiB:.1f} MiB"
              f" ({r['inc_bytes'] / r['full_bytes']:.3f}x); data files: full {r['full_files']:g}, incremental "
              f"{r['inc_files']:g}")
        print(f"  parameters' own bytes: full {r['params_full_bytes'] / MiB:.1f} MiB, incremental "
              f"{r['params_inc_bytes'] / MiB:.1f} MiB ({r['params_inc_bytes'] / max(r['params_full_bytes'], 1):.3f}x)")
        print(f"  save time (median): full {r['full_save_s']:.3f} s, incremental {r['inc_save_s']:.3f} s "
              f"({r['inc_save_s'] / r['full_save_s']:.2f}x); CPU {r['full_save_cpu_s']:.3f} s vs "
              f"{r['inc_save_cpu_s']:.3f} s ({r['inc_save_cpu_s'] / r['full_save_cpu_s']:.2f}x); "
              f"per step {_spread(r['save_ratios'])}")
        print(f"  load of the last step (median of {r['loads_timed']}): full {r['load_full_s']:.3f} s, incremental "
              f"{r['load_inc_s']:.3f} s ({r['load_inc_s'] / r['load_full_s']:.2f}x); CPU {r['load_full_cpu_s']:.3f} s "
              f"vs {r['load_inc_cpu_s']:.3f} s ({r['load_inc_cpu_s'] / r['load_full_cpu_s']:.2f}x); paired "
              f"{_spread(r['load_ratios'])}, CPU {_spread(r['load_cpu_ratios'])}")
        if "elements_changed" in r:
            print(f"  parameters per step: {100 * r['elements_changed']:.2f}% of elements and "
                  f"{100 * r['blocks_changed']:.1f}% of 1 MiB blocks changed; XOR+zstd of the changed blocks "
                  f"{r['xor_zstd_bytes'] / MiB:.2f} MiB ({r['xor_zstd_bytes'] / max(r['params_full_bytes'], 1):.3f}x "
                  "the parameters, computed apart)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
