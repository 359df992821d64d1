"""``cairn plan PATH --compression [URL]``: what `compression=` decided for a checkpoint, and what "auto"
would decide saving its arrays to a storage, and why.

The first part reads only metadata (each array's codec and stored size, as `cairn inspect`). The
second prices each array leaf as a save does (`_save.codecpolicy.decide_leaf`): the codec
`choose.choose` picks on a sample of the leaf's first chunk (read from the checkpoint: up to 256 KiB
in four runs spread over the chunk, as a save samples it, or the whole chunk if it is small), its
ratio, and whether it pays against the storage's bandwidth each way (declared with ``--gbps``, or
the storage's own: declared, measured by this process, else its kind's default; a fresh command
line has measured nothing, so it shows what a process's first save assumes), the cores and the
codecs' speed on them.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._codecs import choose as _choose
from .._format import manifest as fmt
from .._format import values

#: A first chunk up to this size is read whole for its sample; a larger one in four runs of rows.
WHOLE_CHUNK = 16 << 20


def compression_plan(path: str, to: str | None = None, gbps: float | None = None, cores: int | None = None,
                     storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report, as JSON-ready data: ``saved`` (what the checkpoint holds), and with `to` ``auto``
    (what "auto" would decide saving to `to`: the prices and each array leaf's decision)."""
    from .._load.source import open_checkpoint

    ck = open_checkpoint(path, storage_options)
    leaves: list[tuple[str, fmt.ArrayLeaf, int]] = []  # (item, leaf, block size)
    rows: list[dict[str, Any]] = []
    for name, index in ck.indexes.items():
        if index.version >= 3 and index.table is not None:
            index.table.fetch_all()  # stored sizes are in the binary parts
        for leaf in index.leaves:
            if not isinstance(leaf, fmt.ArrayLeaf):
                continue
            stored = leaf.nbytes if leaf.codec == "none" else sum(
                sum(leaf.stored_sizes(c, index.block_size)) for c in range(len(leaf.chunks)))
            key = leaf.path if ck.manifest.root else (f"{name}/{leaf.path}" if leaf.path else name)
            rows.append({"path": key or "<root>", "dtype": values.dtype_name(leaf.dtype), "nbytes": leaf.nbytes,
                         "codec": leaf.codec, "stored_bytes": stored})
            leaves.append((name, leaf, index.block_size))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["codec"]] = counts.get(r["codec"], 0) + 1
    out: dict[str, Any] = {
        "path": ck.loc.path, "format_version": ck.manifest.version,
        "saved": {"codecs": counts, "array_bytes": sum(r["nbytes"] for r in rows),
                  "stored_bytes": sum(r["stored_bytes"] for r in rows)},
        "leaves": rows,
    }
    if to is not None:
        out["auto"] = _auto(ck, leaves, rows, to, gbps, cores, storage_options)
    return out


def _auto(ck: Any, leaves: list[tuple[str, fmt.ArrayLeaf, int]], rows: list[dict[str, Any]], to: str,
          gbps: float | None, cores: int | None, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    from .._load.reader import make_reader
    from .._save import codecpolicy
    from .._save.codecpolicy import CODEC_SPEEDS, compression_can_pay, predicted_seconds
    from .._storage.location import resolve

    storage = resolve(to, storage_options).storage
    prices = codecpolicy.auto_prices(storage)
    if gbps is not None:
        prices.update(bandwidth=gbps * 1e9, read_bandwidth=gbps * 1e9, coded_bandwidth=gbps * 1e9,
                      coded_read_bandwidth=gbps * 1e9, bandwidth_source="declared: --gbps")
    n = cores or codecpolicy.coder_cores()
    bw, rbw, factor = prices["bandwidth"], prices["read_bandwidth"], prices["codec_factor"]
    args = codecpolicy.formula_args(prices)
    speeds = {c: [x * factor for x in s.on(n)] for c, s in CODEC_SPEEDS.items()}
    can = compression_can_pay(bw, n, **args)
    decided: dict[str, int] = {}
    plain_total = coded_total = stored_total = 0.0
    with ThreadPoolExecutor(4, thread_name_prefix="cairn-plan") as pool:
        readers: dict[str, Any] = {}
        try:
            for (name, leaf, _block), row in zip(leaves, rows):
                if name not in readers:
                    readers[name] = make_reader(ck, name, pool)
                d = (codecpolicy.decide_leaf("auto", leaf.dtype, _first_chunk(readers[name], leaf, pool), bw, prices, n)
                     if can and leaf.nbytes else codecpolicy.LeafDecision("none", "none", 0, 0))
                ratio = d.stored / d.raw if d.raw else 1.0
                plain, coded = (predicted_seconds(leaf.nbytes, leaf.nbytes * ratio, d.chosen, bw, n, **args)
                                if d.chosen != "none" else (0.0, 0.0))
                if d.chosen == "none":
                    plain = coded = leaf.nbytes / bw + leaf.nbytes / rbw
                row["auto"] = {"codec": d.codec, "sample_codec": d.chosen, "sample_ratio": ratio,
                               "raw_s": plain, "coded_s": coded}
                decided[d.codec] = decided.get(d.codec, 0) + 1
                plain_total += plain
                coded_total += coded if d.codec != "none" else plain
                stored_total += leaf.nbytes * ratio if d.codec != "none" else leaf.nbytes
        finally:
            for r in readers.values():
                r.close()
    return {
        "to": to, "kind": storage.kind, "bandwidth": bw, "read_bandwidth": rbw,
        "coded_bandwidth": prices["coded_bandwidth"], "coded_read_bandwidth": prices["coded_read_bandwidth"],
        "bandwidth_source": prices["bandwidth_source"], "cores": n, "codec_factor": factor,
        "codec_speeds": {c: {"encode": e, "decode": dd} for c, (e, dd) in speeds.items()},
        "any_leaf_can_pay": can, "codecs": decided, "stored_bytes": stored_total,
        "predicted_s": {"raw": plain_total, "auto": coded_total},
        "mode": "auto" if can else "raw (format version 2): no leaf could pay",
    }


def _first_chunk(reader: Any, leaf: fmt.ArrayLeaf, pool: Any) -> np.ndarray:
    """The first chunk's values, or four runs of its rows spread over it (a large chunk), as a save
    samples them (`choose.sample`)."""
    from .._load.reader import read_box

    box = leaf.chunk_box(0)
    shape = [hi - lo for lo, hi in box]
    nbytes = math.prod(shape) * leaf.dtype.itemsize
    if nbytes <= WHOLE_CHUNK or not shape:
        return read_box(reader, leaf, box, pool)
    row = nbytes // shape[0]
    per = max(1, _choose.SAMPLE_BYTES // _choose.SAMPLE_PIECES // max(1, row))
    starts = sorted({int(s) for s in np.linspace(0, max(0, shape[0] - per), _choose.SAMPLE_PIECES)})
    runs = [read_box(reader, leaf, ((box[0][0] + s, box[0][0] + min(shape[0], s + per)), *box[1:]), pool)
            for s in starts]
    return np.concatenate([r.reshape(-1) for r in runs])


def print_plan(data: dict[str, Any], out: Any, human_bytes: Any) -> None:
    """The report as text: a line on what was saved; with a target, the prices, a line per leaf, a summary."""
    s = data["saved"]
    codecs = ", ".join(f"{n} {c}" for c, n in sorted(s["codecs"].items())) or "no arrays"
    out.line(f"{data['path']}: format version {data['format_version']}; arrays {human_bytes(s['array_bytes'])} "
             f"stored in {human_bytes(s['stored_bytes'])} ({s['stored_bytes'] / max(1, s['array_bytes']):.3f}x): "
             f"{codecs}")
    a = data.get("auto")
    if a is None:
        return
    gib = float(1 << 30)
    speeds = ", ".join(f"{c} {v['encode'] / gib:.2f}/{v['decode'] / gib:.2f}" for c, v in a["codec_speeds"].items())
    out.line(f'"auto" saving to {a["to"]}: {a["kind"]} storage at {a["bandwidth"] / gib:.2f} GiB/s write, '
             f'{a["read_bandwidth"] / gib:.2f} read, coded transfers {a["coded_bandwidth"] / gib:.2f} / '
             f'{a["coded_read_bandwidth"] / gib:.2f} ({a["bandwidth_source"]}); {a["cores"]} cores, codecs at '
             f'{a["codec_factor"]:.2f}x their per-platform speed: {speeds} GiB/s encode/decode')
    rows: list[list[str]] = []
    for r in data["leaves"]:
        x = r.get("auto")
        if x is None:
            continue
        sample = "-" if x["sample_codec"] == "none" and x["sample_ratio"] == 1.0 else \
            f"{x['sample_codec']} {x['sample_ratio']:.3f}"
        rows.append([r["path"], r["dtype"], human_bytes(r["nbytes"]), r["codec"], sample, x["codec"],
                     f"{x['raw_s'] * 1e3:.3g}", f"{x['coded_s'] * 1e3:.3g}"])
    out.table(["key path", "dtype", "size", "saved as", "sample: codec, stored/raw", "auto", "raw ms", "coded ms"],
              rows, title="each array leaf (predicted milliseconds to save and load it)",
              right=["size", "raw ms", "coded ms"])
    decided = ", ".join(f"{n} {c}" for c, n in sorted(a["codecs"].items())) or "nothing"
    p = a["predicted_s"]
    out.line(f'"auto" would store {decided} ({a["mode"]}): {human_bytes(int(a["stored_bytes"]))} '
             f'({a["stored_bytes"] / max(1, s["array_bytes"]):.3f}x); predicted save and load {p["auto"]:.3g} s '
             f'against {p["raw"]:.3g} s raw')
