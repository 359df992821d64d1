"""Turn worker results into medians, ratios, target checks, a markdown report and a plot."""

from __future__ import annotations

import statistics
from typing import Any

GiB = 2**30

# (operation, label, the physical limit it is compared with)
OPS = [
    ("save", "save, blocking (committed, fsync'd)", "raw_write"),
    ("async_return", "async save: call returns (blocking time)", "memcpy"),
    ("async_commit", "async save: committed", "raw_write"),
    ("async_return_again", "async save again, same process: call returns", "memcpy_hot"),
    ("load_cold", "load, same sharding, cold cache", "raw_read_cold"),
    ("load_warm", "load, same sharding, warm cache", "raw_read_warm"),
    ("reshard_cold", "load, resharded, cold cache", "raw_read_cold"),
    ("reshard_warm", "load, resharded, warm cache", "raw_read_warm"),
]
LIMITS = [
    ("memcpy", "memcpy into fresh memory, right after the raw writes (the limit for async blocking)"),
    ("memcpy_best", "memcpy into fresh memory, best of 3"),
    ("memcpy_hot", "memcpy into already-touched memory"),
    ("raw_write_1", "raw write: 1 file, 64 MiB pwrites, fsync"),
    ("raw_write_4", "raw write: 4 files by 4 threads, each fsync'd"),
    ("raw_write", "raw write limit (faster of the two, per rep)"),
    ("raw_read_cold_1", "raw sequential read, 1 file, cold cache"),
    ("raw_read_cold_4", "raw read, 4 files by 4 threads, cold cache"),
    ("raw_read_cold", "raw read limit, cold (faster of the two)"),
    ("raw_read_warm_1", "raw sequential read, 1 file, warm cache"),
    ("raw_read_warm_4", "raw read, 4 files by 4 threads, warm cache"),
    ("raw_read_warm", "raw read limit, warm (faster of the two)"),
]
SYSTEMS = ["cairn", "cairn_compressed", "orbax", "dcp", "dcp_jax"]
MEM_OPS = ["save", "async_commit", "load_cold", "reshard_cold"]
# The buffer budget the memory targets allow on top of state + 10%: cairn's load
# keeps at most this many bytes of reads in flight (_load.load budget_bytes); a
# blocking save on CPU writes straight from the device buffers, so it gets none.
LOAD_BUDGET = 1 << 30
SAVE_BUDGET = 0


def _stats(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarize(runs: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    by: dict[str, Any] = {}
    for r in runs:
        if not r.get("ok"):
            continue
        cell = by.setdefault(r["dtype"], {}).setdefault(str(r["size"]), {}).setdefault(r["system"], {
            "times": {}, "mem": {}, "bytes": {}, "state_bytes": r["state_bytes"], "settings": r.get("settings"),
            "model": r.get("model"), "process_peak_rss": [],
        })
        cell["process_peak_rss"].append(r.get("process_peak_rss"))
        for op, v in r["ops"].items():
            cell["times"].setdefault(op, []).append(v["seconds"])
            if "peak_rss" in v:
                cell["mem"].setdefault(op, []).append(v["peak_rss"])
            if "bytes_written" in v:
                cell["bytes"][op] = (v["bytes_written"], v["files_written"])
    for sizes in by.values():
        for systems in sizes.values():
            for cell in systems.values():
                cell["times"] = {op: _stats(xs) for op, xs in cell["times"].items()}
                cell["mem"] = {op: _stats(xs) for op, xs in cell["mem"].items()}
    failures = [{k: r.get(k) for k in ("system", "dtype", "size", "rep", "error")} for r in runs if not r.get("ok")]
    out = {"by": by, "failures": failures, "checks": {}, "ratios": {}}
    main = str(meta["main_size"])
    for dtype, sizes in by.items():
        if main in sizes:
            out["ratios"][dtype] = _ratios(sizes[main])
            out["checks"][dtype] = _checks(sizes[main])
    return out


def _med(systems: dict[str, Any], system: str, op: str, what: str = "times") -> float | None:
    s = systems.get(system, {}).get(what, {}).get(op)
    return s["median"] if s else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ratios(systems: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for op, label, limit in OPS:
        c = _med(systems, "cairn", op)
        lim = _med(systems, "limits", limit)
        rows.append({
            "op": op, "label": label, "limit": limit,
            "cairn/orbax": _div(c, _med(systems, "orbax", op)),
            "cairn/dcp": _div(c, _med(systems, "dcp", op)),
            "cairn/dcp_jax": _div(c, _med(systems, "dcp_jax", op)),
            "cairn/limit": _div(c, lim),
            "orbax/limit": _div(_med(systems, "orbax", op), lim),
            "dcp/limit": _div(_med(systems, "dcp", op), lim),
        })
    return rows


def _checks(systems: dict[str, Any]) -> list[dict[str, Any]]:
    """Each performance target, with the measured value (medians) and whether it is met."""
    state = next(iter(systems.values()))["state_bytes"]
    c = lambda op: _med(systems, "cairn", op)  # noqa: E731
    lim = lambda op: _med(systems, "limits", op)  # noqa: E731
    o = lambda op: _med(systems, "orbax", op)  # noqa: E731
    d = lambda op: _med(systems, "dcp", op)  # noqa: E731
    mem = lambda op: _div(_med(systems, "cairn", op, "mem"), state)  # noqa: E731
    rows = [
        ("save <= 1.15x raw write", _div(c("save"), lim("raw_write")), 1.15),
        ("save faster than Orbax (cairn/orbax < 1)", _div(c("save"), o("save")), 1.0),
        ("save faster than DCP (cairn/dcp < 1)", _div(c("save"), d("save")), 1.0),
        ("async blocking <= 1.3x memcpy (fresh memory, after a write)", _div(c("async_return"), lim("memcpy")), 1.3),
        ("async blocking <= 1.3x memcpy (best of 3)", _div(c("async_return"), lim("memcpy_best")), 1.3),
        ("async blocking, repeated save <= 1.3x memcpy into touched memory",
         _div(c("async_return_again"), lim("memcpy_hot")), 1.3),
        ("async blocking, first save, below DCP's (cairn/dcp < 1)", _div(c("async_return"), d("async_return")), 1.0),
        ("async blocking, first save, below DCP's in a process holding the JAX state (cairn/dcp_jax < 1)",
         _div(c("async_return"), _med(systems, "dcp_jax", "async_return")), 1.0),
        ("async blocking, repeated save, below DCP's (cairn/dcp < 1)",
         _div(c("async_return_again"), d("async_return_again")), 1.0),
        ("cold load <= 1.15x raw cold read", _div(c("load_cold"), lim("raw_read_cold")), 1.15),
        ("cold load >= 2x faster than Orbax (cairn/orbax <= 0.5)", _div(c("load_cold"), o("load_cold")), 0.5),
        ("resharding load <= 1.3x same-sharding load (cold)", _div(c("reshard_cold"), c("load_cold")), 1.3),
        ("resharding load <= 1.3x same-sharding load (warm)", _div(c("reshard_warm"), c("load_warm")), 1.3),
        ("resharding load >= 2x faster than Orbax (cold, cairn/orbax <= 0.5)",
         _div(c("reshard_cold"), o("reshard_cold")), 0.5),
        (f"peak RSS, blocking save <= state + 10% + {SAVE_BUDGET >> 20} MiB (x state)", mem("save"),
         1.1 + SAVE_BUDGET / state),
        ("peak RSS, async save <= 2x state (x state)", mem("async_commit"), 2.0),
        (f"peak RSS, load <= state + 10% + {LOAD_BUDGET >> 20} MiB budget (x state)", mem("load_cold"),
         1.1 + LOAD_BUDGET / state),
        (f"peak RSS, resharding load <= state + 10% + {LOAD_BUDGET >> 20} MiB budget (x state)",
         mem("reshard_cold"), 1.1 + LOAD_BUDGET / state),
    ]
    if "cairn_compressed" in systems:  # compression on (cairn_compressed) against the run's setting
        z = lambda op: _med(systems, "cairn_compressed", op)  # noqa: E731
        zb = systems["cairn_compressed"].get("bytes", {}).get("save")
        ob = systems.get("orbax", {}).get("bytes", {}).get("save")
        rows += [
            ("compression on: async blocking <= 1.05x the run's setting's (first save)",
             _div(z("async_return"), c("async_return")), 1.05),
            ("compression on: async blocking <= 1.05x the run's setting's (repeated save)",
             _div(z("async_return_again"), c("async_return_again")), 1.05),
            ("compression on: bytes <= 0.9x Orbax's", _div(zb[0], ob[0]) if zb and ob else None, 0.9),
        ]
    strict = {name for name, _, _ in rows if "< 1)" in name}
    out = []
    for name, value, bound in rows:
        met = None if value is None else (value < bound if name in strict else value <= bound)
        out.append({"target": name, "measured": value, "bound": bound, "met": met})
    return out


# ---------------------------------------------------------------------- markdown


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _t(s: dict[str, float] | None) -> str:
    if not s:
        return "n/a"
    if s["n"] == 1:
        return f"{s['median']:.2f}"
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        "# cairn benchmark results", "",
        f"Run {meta['started']} - {meta.get('finished', '?')} (git {m.get('git', '?')}), "
        f"{m['cpus']} CPUs, {m['memory_gib']} GiB RAM, Linux {m['kernel']}, Python {m['python']}. "
        f"Load average at start {tuple(round(x, 2) for x in m['loadavg_start'])}, "
        f"at end {tuple(round(x, 2) for x in m.get('loadavg_end', ()))}"
        + (f"; uncommitted changes under src/: {', '.join(m['src_dirty'])}." if m.get("src_dirty") else "."),
        "Page cache dropped before every cold operation: "
        + ("yes (`/proc/sys/vm/drop_caches` writable)." if m["drop_caches_writable"]
           else "**no** (`/proc/sys/vm/drop_caches` not writable: 'cold' rows are really warm)."),
        "Times are seconds, median [min-max] over the repetitions; ratios use medians. "
        "Each system ran in its own subprocess; systems alternated across repetitions.", "",
    ]
    main = str(meta["main_size"])
    for dtype, sizes in summary["by"].items():
        if main not in sizes:
            continue
        systems = sizes[main]
        any_cell = next(iter(systems.values()))
        state = any_cell["state_bytes"]
        model = next((c["model"] for c in systems.values() if c.get("model")), None)
        lines += [f"## {dtype}, {state / GiB:.2f} GiB state", ""]
        if model:
            lines += [f"Model: d_model {model['d_model']}, {model['layers']} layers, vocab {model['vocab']}, "
                      f"ffn {model['ffn']}, {model['leaves']} arrays, sharded over {8} CPU devices.", ""]
        present = [s for s in SYSTEMS if s in systems]
        lines += ["| operation | " + " | ".join(present) + " | limit |",
                  "|---|" + "---|" * len(present) + "---|"]
        for op, label, limit in OPS:
            cells = [_t(systems[s]["times"].get(op)) for s in present]
            lim = systems.get("limits", {}).get("times", {}).get(limit)
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {_t(lim)} ({limit}) |")
        lines += ["", "Physical limits, same run:", "", "| limit | seconds | GiB/s |", "|---|---|---|"]
        for key, label in LIMITS:
            s = systems.get("limits", {}).get("times", {}).get(key)
            gbps = _f(state / GiB / s["median"]) if s else "n/a"
            lines.append(f"| {label} | {_t(s)} | {gbps} |")
        lines += ["", "Ratios (medians; < 1 means cairn is faster):", "",
                  "| operation | cairn/orbax | cairn/dcp | cairn/dcp_jax | cairn/limit | orbax/limit | dcp/limit |",
                  "|---|---|---|---|---|---|---|"]
        for r in summary["ratios"].get(dtype, []):
            lines.append(f"| {r['label']} (limit: {r['limit']}) | {_f(r['cairn/orbax'])} | {_f(r['cairn/dcp'])} | "
                         f"{_f(r.get('cairn/dcp_jax'))} | {_f(r['cairn/limit'])} | {_f(r['orbax/limit'])} | "
                         f"{_f(r['dcp/limit'])} |")
        lines += ["", "Targets (cairn):", "", "| target | measured | bound | met |", "|---|---|---|---|"]
        for c in summary["checks"].get(dtype, []):
            met = "n/a" if c["met"] is None else ("yes" if c["met"] else "**no**")
            lines.append(f"| {c['target']} | {_f(c['measured'])} | {_f(c['bound'])} | {met} |")
        lines += ["", "Peak RSS during the operation, above the process's RSS before the state existed "
                  "(so it includes the state itself), as a multiple of the state size:", "",
                  "| operation | " + " | ".join(present) + " |", "|---|" + "---|" * len(present)]
        for op in MEM_OPS:
            cells = []
            for s in present:
                v = systems[s]["mem"].get(op)
                cells.append("n/a" if not v else f"{v['median'] / state:.2f}x ({v['median'] / GiB:.2f} GiB)")
            lines.append(f"| {op} | " + " | ".join(cells) + " |")
        lines += ["", "Bytes and files written (blocking save):", "", "| system | bytes | x state | files |",
                  "|---|---|---|---|"]
        for s in present:
            b = systems[s]["bytes"].get("save")
            if b:
                lines.append(f"| {s} | {b[0]:,} | {b[0] / state:.3f} | {b[1]} |")
        lines.append("")
    lines += _sweep(summary)
    if summary["failures"]:
        lines += ["## Failures", ""] + [f"- {f}" for f in summary["failures"]] + [""]
    lines += ["## Settings", ""]
    for sizes in summary["by"].values():
        cell = sizes.get(main) or next(iter(sizes.values()))
        for s in SYSTEMS:
            if s in cell and cell[s].get("settings"):
                lines.append(f"- **{s}**: " + "; ".join(f"{k}: {v}" for k, v in cell[s]["settings"].items()))
        break
    lines.append("")
    return "\n".join(lines)


def _sweep(summary: dict[str, Any]) -> list[str]:
    out = []
    for dtype, sizes in summary["by"].items():
        if len(sizes) < 2:
            continue
        keys = sorted(sizes, key=int)
        present = [s for s in SYSTEMS if any(s in sizes[k] for k in keys)]
        out += [f"## Time vs size ({dtype}; median seconds)", "",
                "| size GiB | " + " | ".join(f"{s} {op}" for s in present for op in ("save", "load_cold"))
                + " | raw_write | raw_read_cold |",
                "|---|" + "---|" * (2 * len(present) + 2)]
        for k in keys:
            systems = sizes[k]
            cells = [_f(_med(systems, s, op)) for s in present for op in ("save", "load_cold")]
            cells += [_f(_med(systems, "limits", "raw_write")), _f(_med(systems, "limits", "raw_read_cold"))]
            state = next(iter(systems.values()))["state_bytes"]
            out.append(f"| {state / GiB:.2f} | " + " | ".join(cells) + " |")
        out.append("")
    return out


# ---------------------------------------------------------------------- plot


def plot(summary: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not summary["by"]:
        return False
    dtype, sizes = next(iter(summary["by"].items()))
    keys = sorted(sizes, key=int)
    panels = [("save", "save (blocking, fsync'd)", "raw_write"), ("async_return", "async save: blocking time", "memcpy"),
              ("load_cold", "load, cold cache", "raw_read_cold"), ("reshard_cold", "resharding load, cold", "raw_read_cold")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for ax, (op, title, limit) in zip(axes, panels):
        for s, style in (("cairn", "o-"), ("orbax", "s-"), ("dcp", "^-"), ("limits", "k--")):
            name = limit if s == "limits" else op
            xs, ys = [], []
            for k in keys:
                v = _med(sizes[k], s, name)
                if v is not None:
                    xs.append(next(iter(sizes[k].values()))["state_bytes"] / GiB)
                    ys.append(v)
            if xs:
                ax.plot(xs, ys, style, label=limit if s == "limits" else s)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("state size (GiB)")
        ax.set_ylabel("seconds (median)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"cairn vs Orbax vs DCP vs limits ({dtype}, 8 CPU devices)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
