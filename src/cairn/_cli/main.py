"""The ``cairn`` command line: ls, inspect, verify, diff, convert, cp, mv, plan, gc.

Every command reaches checkpoints through `cairn._storage.location.resolve` (``ls``
and ``gc`` through `cairn._run.steps`, which the manager shares), so it works the
same on local paths and object-store URLs. Output is a rich table
when rich is installed (the ``cli`` extra) and aligned plain text otherwise
(or with ``--plain``); ``--json`` gives machine-readable output. A failure is
one line on stderr and a non-zero exit status; ``--debug`` shows the
traceback instead.

Exit status: 0 success (for ``verify``: intact; for ``diff``: no
differences), 1 the check found problems or the command failed, 2 bad usage.

Example:

    $ cairn ls /ckpt/run1
    $ cairn inspect /ckpt/run1/step_00001000
    $ cairn verify s3://bucket/run1/step_00001000
    $ cairn convert /ckpt/run1/step_00001000 model.safetensors --to safetensors
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._core.units import human_bytes
from .._errors import CheckpointError, CheckpointNotFoundError
from .._exports.copy import add_commands as add_copy_commands
from .._format import manifest as fmt
from .._format import values
from .._run import steps as _steps
from .._sources.registry import FORMATS
from .._storage.location import resolve
from .plan import add_command as add_plan_command

# ---------------------------------------------------------------------- output


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f}{unit}"
    return f"{s:.0f}s"


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512M, 2G, 1048576)")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)]
    n = int(float(m.group(1)) * scale)
    if n < 1 << 20:
        raise argparse.ArgumentTypeError(f"a budget of {text!r} is below the minimum of 1M")
    return n


class Output:
    """Tables, messages and progress bars: rich if available and wanted, plain text otherwise."""

    def __init__(self, plain: bool = False, quiet: bool = False):
        self.quiet = quiet
        self.console: Any = None
        self.err_console: Any = None
        if not plain:
            try:
                from rich.console import Console
            except ImportError:
                pass
            else:
                width = None if sys.stdout.isatty() else 200
                self.console = Console(file=sys.stdout, width=width, highlight=False)
                self.err_console = Console(file=sys.stderr, highlight=False)

    def line(self, text: str = "") -> None:
        if self.console is not None:
            self.console.print(text, markup=False)
        else:
            print(text, file=sys.stdout)

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None,
              right: Sequence[str] = ()) -> None:
        cells = [["" if c is None else str(c) for c in row] for row in rows]
        if self.console is not None:
            from rich.table import Table

            t = Table(title=title, title_justify="left", show_edge=False, header_style="bold")
            for c in columns:
                t.add_column(c, justify="right" if c in right else "left", overflow="fold")
            for row in cells:
                t.add_row(*row)
            self.console.print(t)
            return
        if title:
            print(title)
        widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]

        def fmt_row(row: Sequence[str]) -> str:
            parts = [v.rjust(w) if c in right else v.ljust(w) for v, w, c in zip(row, widths, columns)]
            return "  ".join(parts).rstrip()

        print(fmt_row(list(columns)))
        print("  ".join("-" * w for w in widths))
        for row in cells:
            print(fmt_row(row))

    @contextlib.contextmanager
    def progress(self, description: str, total: int | None) -> Iterator[tuple[Callable[[int], None], Callable[[int], None]]]:
        """Yields (set_total, advance); a rich bar on stderr, or nothing in plain mode."""
        if self.quiet or self.err_console is None or not sys.stderr.isatty():
            yield (lambda n: None), (lambda n: None)
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(binary_units=True),
                      TransferSpeedColumn(), TimeRemainingColumn(), console=self.err_console,
                      transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield (lambda n: bar.update(task, total=n)), (lambda n: bar.advance(task, n))


def _dump_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=_json_default))


def _json_default(x: Any) -> Any:
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, bytes):
        return {"bytes_hex": x.hex()}
    if isinstance(x, complex):
        return [x.real, x.imag]
    return repr(x)


# ---------------------------------------------------------------------- ls / gc


def _fmt_metrics(metrics: dict[str, Any]) -> str:
    parts = []
    for k, v in metrics.items():
        parts.append(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


def cmd_ls(args: argparse.Namespace, out: Output) -> int:
    loc, entries = _steps.scan(args.dir, None)
    if not entries and not loc.storage.list_dir(loc.name) and not loc.storage.exists(loc.name):
        what = "no such directory" if loc.storage.dirs is not None else "nothing is stored under that prefix"
        print(f"cairn: {loc.path}: {what}", file=sys.stderr)
        return 1
    if args.json:
        _dump_json({"dir": loc.path, "entries": [{k: v for k, v in e.items() if k != "key"} for e in entries]})
        return 0
    if not entries:
        from .._sources.registry import detect

        kind = detect(loc)
        if kind is not None:
            what = "a checkpoint" if kind == "cairn" else f"a checkpoint in {kind} format"
            out.line(f"{loc.path} is {what} itself, not a directory of them; try: cairn inspect {loc.path}")
        else:
            out.line(f"no checkpoints in {loc.path}")
        return 0
    # Orbax step folders and DCP checkpoints are listed too, with their format.
    foreign = any(e["format"] != "cairn" for e in entries)
    rows = [
        [e["step"] if e["step"] is not None else "", e["name"], *([e["format"]] if foreign else []), e["status"],
         human_bytes(e["bytes"]), human_age(e["age_s"]), _fmt_metrics(e["metrics"])]
        for e in entries
    ]
    out.table(["step", "name", *(["format"] if foreign else []), "status", "size", "age", "metrics"], rows,
              title=loc.path, right=["step", "size", "age"])
    committed = sum(e["status"] == "committed" for e in entries)
    leftovers = sum(e["status"] in ("temporary", "uncommitted") for e in entries)
    for e in entries:
        if e["status"] == "broken":
            out.line(f"{e['name']} is broken: {e['error']}")
    summary = f"{committed} committed"
    broken = sum(e["status"] == "broken" for e in entries)
    if broken:
        summary += f", {broken} broken (a base they refer to is gone: they do not load)"
    if leftovers:
        summary += f", {leftovers} leftover (interrupted or in progress; `cairn gc` removes them)"
    out.line(summary)
    # A step committed in two folders (two namings, or an Orbax and a cairn save of it): two rows that look
    # alike, of which a manager uses one; say so rather than leave it to be found.
    by_step: dict[int, list[str]] = {}
    for e in entries:
        if e["status"] == "committed" and e["step"] is not None:
            by_step.setdefault(e["step"], []).append(e["name"])
    for step, names in sorted(by_step.items()):
        if len(names) > 1:
            out.line(f"step {step} is committed in {len(names)} folders ({', '.join(names)}): a CheckpointManager "
                     "uses the one its step_format spells and passes over the others with a warning; "
                     "delete the ones you do not want")
    return 0


def cmd_gc(args: argparse.Namespace, out: Output) -> int:
    loc, entries = _steps.scan(args.dir, None)
    leftovers = [e for e in entries if e["status"] in ("temporary", "uncommitted")]
    # A leftover younger than --min-age may be a save still in progress: keep it.
    # Where the age is unknown (object stores have no modification times here),
    # only --min-age 0 removes it.
    doomed = [e for e in leftovers if args.min_age <= 0 or (e["age_s"] is not None and e["age_s"] >= args.min_age)]
    kept = [e for e in leftovers if e not in doomed]
    storage = _steps.open_directory(args.dir)[1] if doomed and not args.dry_run else None
    for e in [] if args.json else kept:
        age = "unknown age" if e["age_s"] is None else f"{e['age_s']:.0f} s old"
        out.line(f"kept {e['name']} ({e['status']}, {age}: may be a save in progress; --min-age 0 removes it)")
    if args.json:
        if storage is not None:
            for e in doomed:
                _remove(storage, e)
        _dump_json({"dir": loc.path, "dry_run": args.dry_run,
                    "removed": [{"name": e["name"], "status": e["status"], "bytes": e["bytes"]} for e in doomed],
                    "kept": [{"name": e["name"], "status": e["status"], "age_s": e["age_s"]} for e in kept]})
        return 0
    if not doomed:
        if not kept:
            out.line(f"nothing to remove in {loc.path}")
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for e in doomed:
        if storage is not None:
            _remove(storage, e)
        out.line(f"{verb} {e['name']} ({e['status']}, {e['files']} files, {human_bytes(e['bytes'])})")
    out.line(f"{verb} {len(doomed)} entries, {human_bytes(sum(e['bytes'] for e in doomed))}")
    return 0


def _remove(storage: Any, e: dict[str, Any]) -> None:
    """Remove leftover `e` through the directory's own storage (`_steps.remove_leftover`)."""
    try:
        _steps.remove_leftover(storage, e["name"])
    except FileNotFoundError:
        pass  # removed meanwhile


# ---------------------------------------------------------------------- inspect


def _sharding_text(s: dict[str, Any] | None) -> str:
    if not s:
        return ""
    if "spec" in s and "mesh" in s:
        mesh = ",".join(f"{a}={n}" for a, n in zip(s["mesh"]["axis_names"], s["mesh"]["shape"]))
        spec = ",".join("None" if p is None else "+".join(p) if isinstance(p, list) else str(p) for p in s["spec"])
        return f"P({spec}) mesh({mesh})"
    if "device" in s:
        return s["device"]
    return f"{s.get('type', '?')} on {s.get('num_devices', '?')} devices"


def _value_json(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, complex):
        return repr(v)
    try:
        import numpy as np

        if isinstance(v, np.generic):
            return _value_json(v.item())
    except ImportError:  # pragma: no cover
        pass
    return v


def inspect_data(path: str, format: str | None = None) -> dict[str, Any]:
    from .._load.source import open_checkpoint
    from .._sources.registry import inspect_data as foreign

    other = foreign(path, format)  # Orbax, DCP, safetensors
    if other is not None:
        return other
    ck = open_checkpoint(path)
    m = ck.manifest
    items: dict[str, Any] = {}
    totals = {"leaves": 0, "arrays": 0, "array_bytes": 0, "files": 0, "file_bytes": 0}
    by_base: dict[str, dict[str, int]] = {}  # incremental: per base, the bytes referred to and the deltas
    for name, index in ck.indexes.items():
        leaves = []
        if index.version >= 3 and index.table is not None:
            index.table.fetch_all()  # stored sizes are in the binary parts
        for leaf in index.leaves:
            if isinstance(leaf, fmt.ArrayLeaf):
                d: dict[str, Any] = {
                    "path": leaf.path, "kind": leaf.kind, "dtype": values.dtype_name(leaf.dtype),
                    "shape": list(leaf.shape), "nbytes": leaf.nbytes, "grid": list(leaf.grid_shape),
                    "chunks": len(leaf.chunks), "codec": leaf.codec,
                    "stored_bytes": leaf.nbytes if leaf.codec == "none" else sum(
                        sum(leaf.stored_sizes(c, index.block_size)) for c in range(len(leaf.chunks))),
                }
                if index.version >= fmt.INCREMENTAL_VERSION:  # incremental: own bytes, bytes in its bases
                    from .._load.blocks import own_and_referenced

                    d["stored_bytes"], d["referenced_bytes"] = own_and_referenced(leaf, index.block_size)
                    totals["referenced_bytes"] = totals.get("referenced_bytes", 0) + d["referenced_bytes"]
                    _add_by_base(by_base, index, leaf)
                if leaf.sharding is not None:
                    d["sharding"] = leaf.sharding
                if leaf.handler is not None:
                    d["handler"] = leaf.handler
                if leaf.impl is not None:
                    d["impl"] = leaf.impl
                totals["arrays"] += 1
                totals["array_bytes"] += leaf.nbytes
            else:
                d = {"path": leaf.path, "kind": leaf.kind, "value": _value_json(leaf.value)}
            leaves.append(d)
        totals["leaves"] += len(leaves)
        totals["files"] += sum(f.base is None for f in index.files)  # a base's files are not its own
        totals["file_bytes"] += sum(f.size for f in index.files if f.base is None)
        items[name] = {
            "dir": m.items[name].dir, "index": m.items[name].index, "block_size": index.block_size,
            "files": [{"name": f.name, "size": f.size, **({"base": f.base} if f.base else {})} for f in index.files],
            "leaves": leaves,
            "index_parts": [p.name for p in index.parts],
        }
    return {
        "path": ck.loc.path, "format_version": m.version, "cairn_version": m.cairn_version,
        "created_unix": m.created_unix, "process_count": m.process_count, "root": m.root,
        "metadata": m.metadata, "items": items, "totals": totals, **({"bases": list(m.bases)} if m.bases else {}),
        **({"by_base": by_base} if by_base else {}),
    }


def _add_by_base(by_base: dict[str, dict[str, int]], index: Any, leaf: fmt.ArrayLeaf) -> None:
    """Count a version-4 leaf's references and deltas per base checkpoint (`inspect`'s ``by_base``)."""
    from .._load.blocks import by_base_file

    for f, (ref, deltas, delta_bytes) in by_base_file(leaf, index.block_size).items():
        row = by_base.setdefault(index.files[f].base or "?", {"referenced_bytes": 0, "delta_blocks": 0,
                                                              "delta_bytes": 0})
        row["referenced_bytes"] += ref
        row["delta_blocks"] += deltas
        row["delta_bytes"] += delta_bytes


def cmd_inspect(args: argparse.Namespace, out: Output) -> int:
    data = inspect_data(args.path, args.format)
    if args.json:
        _dump_json(data)
        return 0
    rows = []
    for name, item in data["items"].items():
        for leaf in item["leaves"]:
            key = leaf["path"] if data["root"] else (f"{name}/{leaf['path']}" if leaf["path"] else name)
            if "dtype" in leaf:
                shape = "(" + ", ".join(map(str, leaf["shape"])) + ("," if len(leaf["shape"]) == 1 else "") + ")"
                grid = "x".join(map(str, leaf["grid"])) or "1"
                dtype = leaf["dtype"] if leaf["kind"] == "array" else leaf["kind"]
                dtype = f"key<{leaf['impl']}> data" if "impl" in leaf else dtype
                stored = leaf.get("stored_bytes", leaf["nbytes"])
                rows.append([key or "<root>", dtype, shape, human_bytes(leaf["nbytes"]), human_bytes(stored),
                             leaf.get("codec", "none"), grid, _sharding_text(leaf.get("sharding"))])
            else:
                text = repr(leaf["value"])
                rows.append([key or "<root>", leaf["kind"], text if len(text) <= 60 else text[:57] + "...", "", "",
                             "", "", ""])
    out.table(["key path", "dtype", "shape / value", "size", "stored", "codec", "chunks", "saved sharding"], rows,
              title=data["path"], right=["size", "stored"])
    t = data["totals"]
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["created_unix"])) if data["created_unix"] else "?"
    origin = (f"a checkpoint in {data['format']} format, read in place" if data.get("format") else
              f"format version {data['format_version']}, saved {created} by cairn {data['cairn_version'] or '?'} "
              f"from {data['process_count']} process(es)")
    out.line(
        f"{t['leaves']} leaves ({t['arrays']} arrays, {human_bytes(t['array_bytes'])}) in {len(data['items'])} "
        f"checkpointable(s), {t['files']} data files ({human_bytes(t['file_bytes'])}); {origin}"
    )
    codecs: dict[str, int] = {}
    for item in data["items"].values():
        for leaf in item["leaves"]:
            if "codec" in leaf:
                codecs[leaf["codec"]] = codecs.get(leaf["codec"], 0) + 1
    if set(codecs) - {"none"}:  # what the save's `compression=` decided, leaf by leaf
        stored = sum(leaf.get("stored_bytes", leaf["nbytes"]) for item in data["items"].values()
                     for leaf in item["leaves"] if "codec" in leaf)
        out.line(f"compression: {', '.join(f'{n} {c}' for c, n in sorted(codecs.items()))} (arrays stored in "
                 f"{human_bytes(stored)}, {stored / max(1, t['array_bytes']):.3f}x raw)")
    elif codecs:
        out.line("compression: none (every array stored raw)")
    if "referenced_bytes" in t:  # incremental (format 4)
        out.line(f"incremental: {human_bytes(t['file_bytes'])} of its own, {human_bytes(t['referenced_bytes'])} "
                 f"referred to in {', '.join(data.get('bases', [])) or 'no base'}")
        for base, row in sorted(data.get("by_base", {}).items()):
            deltas = (f"; {row['delta_blocks']} of its blocks are deltas against blocks there "
                      f"({human_bytes(row['delta_bytes'])} of its own bytes)") if row["delta_blocks"] else ""
            out.line(f"  base {base}: {human_bytes(row['referenced_bytes'])} referred to{deltas}")
    if data["metadata"]:
        out.line("metadata: " + json.dumps(data["metadata"], default=_json_default))
    return 0


# ---------------------------------------------------------------------- verify / diff


#: `cairn verify`'s exit status where a block's codec library is missing: not damage, nothing was decided.
EXIT_CODEC_MISSING = 3


def cmd_verify(args: argparse.Namespace, out: Output) -> int:
    from .._errors import CodecUnavailableError
    from .._sources.verify import verify

    try:
        with out.progress("verifying", None) as (set_total, advance):
            report = verify(args.path, threads=args.threads, on_total=set_total, progress=advance)
    except CodecUnavailableError as e:
        if args.json:
            _dump_json({"path": args.path, "ok": None, "codec_missing": str(e)})
        print(f"cairn: cannot verify {args.path}: {e}. Nothing was found damaged; install the library and run "
              f"it again (exit status {EXIT_CODEC_MISSING})", file=sys.stderr)
        return EXIT_CODEC_MISSING
    if args.json:
        _dump_json({"path": report.path, "format": report.format, "ok": report.ok, "bytes_checked": report.bytes_checked,
                    "chunks_checked": report.chunks_checked, "files": report.files, "leaves": report.leaves,
                    "problems": [p.as_dict() for p in report.problems]})
        return 0 if report.ok else 1
    for p in report.problems:
        print(f"CORRUPT: {p.message}", file=sys.stderr)
    summary = (f"{report.leaves} leaves, {report.chunks_checked} chunks, {report.files} files, "
               f"{human_bytes(report.bytes_checked)} checked")
    if report.format != "cairn":  # Orbax, DCP, safetensors: read whole, no checksums to compare
        name = {"dcp": "PyTorch DCP", "orbax": "Orbax"}.get(report.format, report.format)
        summary = (f"{'an' if name[0] in 'AEIOU' else 'a'} {name} checkpoint, {report.leaves} leaves, {report.files} files, "
                   f"{human_bytes(report.bytes_checked)} read")
    if report.ok and report.format != "cairn":
        out.line(f"OK: {report.path}: {summary}; every array reads (the format has no checksums: "
                 f"`cairn convert {report.path} DST --to cairn` makes a checkpoint that has them)")
        return 0
    if report.ok:
        out.line(f"OK: {report.path}: {summary}; every checksum matches")
        return 0
    out.line(f"FAILED: {report.path}: {len(report.problems)} problem(s); {summary}")
    return 1


def cmd_diff(args: argparse.Namespace, out: Output) -> int:
    from .._sources.verify import diff

    entries = diff(args.a, args.b, budget_bytes=args.budget)
    same = all(e.status == "equal" for e in entries)
    if args.json:
        _dump_json({"a": args.a, "b": args.b, "equal": same, "entries": [e.as_dict() for e in entries]})
        return 0 if same else 1
    shown = entries if args.all else [e for e in entries if e.status != "equal"]
    rows = [
        [e.item if e.item else "", e.path or "<root>", e.status,
         "" if e.max_abs_diff is None else f"{e.max_abs_diff:.6g}", e.detail]
        for e in shown
    ]
    if rows:
        out.table(["checkpointable", "key path", "status", "max abs diff", "detail"], rows, right=["max abs diff"])
    counts: dict[str, int] = {}
    for e in entries:
        counts[e.status] = counts.get(e.status, 0) + 1
    out.line(", ".join(f"{n} {s}" for s, n in counts.items()) or "both checkpoints are empty")
    return 0 if same else 1


# ---------------------------------------------------------------------- cp / mv of a run


def cmd_copy(args: argparse.Namespace, out: Output) -> int:
    """``cairn cp`` / ``cairn mv``: one checkpoint, or every committed step of a run directory.

    A directory that is no checkpoint itself but holds committed cairn
    checkpoints (a manager's run) is copied step by step into DST, each step
    as ``cairn cp`` copies one (resumable, verified); leftovers of
    interrupted saves are not copied, and Orbax or DCP folders are named as
    skipped (cairn copies only what a cairn manifest names).
    """
    from .._exports.copy import copy, one_run, refuse_foreign, run_copy
    from .._read.metadata import manifest_bytes

    src = resolve(args.src)
    try:
        manifest_bytes(src)
        return run_copy(args, out)
    except CheckpointNotFoundError:
        refuse_foreign(src, "mv" if args.move else "cp")  # an Orbax or DCP checkpoint: say so, and what to do
        _, entries = _steps.scan(args.src, None)
    steps = [e for e in entries if e["status"] == "committed" and e["format"] == "cairn"]
    foreign = [e for e in entries if e["status"] == "committed" and e["format"] != "cairn"]
    if not steps:
        if foreign:
            raise CheckpointNotFoundError(
                f"{src.path} holds only {foreign[0]['format']} checkpoints ({', '.join(e['name'] for e in foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}); cairn cp copies cairn checkpoints: convert them "
                "(cairn convert ... --to cairn) or copy the folders with your storage's tools")
        return run_copy(args, out)  # its error says what SRC is
    if args.move:  # incremental steps: moving a base away first would break the steps that refer to it
        from .._run.refs import bases_of

        chained = [e["name"] for e in steps if bases_of(src.storage, f"{src.name}/{e['name']}")]
        if chained:
            raise CheckpointError(
                f"{src.path}: {chained[0]} ({len(chained)} steps in all) refers to other steps (incremental "
                "saves): moving step by step would leave steps that refer to moved ones; copy the run "
                "(`cairn cp --keep-references` keeps the references), then delete it")
    done = []
    # One bar over every step (on a terminal; nothing otherwise or with --quiet), its total grown step by step.
    with out.progress("moving" if args.move else "copying", None) as (set_total, advance), one_run():
        before = 0  # the totals of the steps done
        for e in steps:
            last = [0]

            def step_total(n: int, before: int = before, last: list[int] = last) -> None:
                last[0] = n
                set_total(before + n)

            stats = copy(f"{src.path.rstrip('/')}/{e['name']}", f"{args.dst.rstrip('/')}/{e['name']}",
                         overwrite=args.overwrite, move=args.move, verify=not args.no_verify,
                         budget_bytes=args.budget, threads=args.threads, on_total=step_total, progress=advance,
                         keep_references=getattr(args, "keep_references", False))
            before += last[0]
            done.append(stats)
            if not args.json:
                kept = f", {stats.files_kept} already there" if stats.files_kept else ""
                out.line(f"{'moved' if stats.moved else 'copied'} {e['name']}: {stats.files_copied} files, "
                         f"{stats.bytes_copied / (1 << 20):.1f} MiB{kept}")
    skipped = [e["name"] for e in entries if e not in steps]
    if args.json:
        _dump_json({"src": src.path, "dst": args.dst, "steps": [s.as_dict() for s in done], "skipped": skipped})
        return 0
    verb = "moved" if args.move else "copied"
    out.line(f"{verb} {len(done)} committed steps of {src.path} to {args.dst}"
             + ("; checksums verified" if not args.no_verify else ""))
    if foreign:
        out.line(f"skipped {len(foreign)} {'/'.join(sorted({e['format'] for e in foreign}))} checkpoints "
                 f"({', '.join(e['name'] for e in foreign[:5])}): cairn copies cairn checkpoints only")
    if len(skipped) > len(foreign):
        out.line(f"skipped {len(skipped) - len(foreign)} leftovers of interrupted saves")
    return 0


# ---------------------------------------------------------------------- convert


def cmd_convert(args: argparse.Namespace, out: Output) -> int:
    from .._exports.convert import run_convert

    return run_convert(args, out)


# ---------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cairn", description="Look at, check and convert cairn checkpoints (local paths or object-store URLs).",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    p.add_argument("--plain", action="store_true", help="plain text output, even when rich is installed")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("ls", help="list the checkpoints of a directory, committed or not")
    s.add_argument("dir")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_ls)

    s = sub.add_parser("inspect", help="show a checkpoint's tree (reads no array data)")
    s.add_argument("path")
    s.add_argument("--json", action="store_true")
    s.add_argument("--format", choices=FORMATS, help="the source's format (default: detected)")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("verify", help="read everything and check every checksum; exit 1 if anything is corrupt, "
                                      "3 if a codec library it needs is missing")
    s.add_argument("path")
    s.add_argument("--threads", type=int, default=8)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("diff", help="compare two checkpoints per key path; exit 1 if they differ")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--all", action="store_true", help="also list equal leaves")
    s.add_argument("--budget", type=parse_bytes, default=256 << 20, help="memory budget (default 256M)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_diff)

    s = sub.add_parser("convert", help="convert between cairn, safetensors (also sharded, for Hugging Face), "
                       "PyTorch files and Orbax (--to orbax writes through orbax-checkpoint); --to cairn also "
                       "reads Orbax and DCP checkpoints. --to safetensors: a DST not ending in .safetensors "
                       "is a folder, written as DST/model.safetensors")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--to", required=True, choices=["safetensors", "cairn", "torch", "orbax"])
    s.add_argument("--format", choices=FORMATS, help="--to cairn: the source's format (default: detected)")
    s.add_argument("--max-shard-size", help="safetensors: a Hugging Face folder of shards of at most this "
                   "size (5GB = 5*10^9 bytes, 5GiB = 5*2^30), written by every process in parallel")
    s.add_argument("--per-item", action="store_true",
                   help="safetensors: one file per checkpointable in folder DST")
    s.add_argument("--sep", default=".", help="torch: separator joining key-path components (default '.')")
    s.add_argument("--overwrite", action="store_true", help="orbax, sharded safetensors: replace DST's files")
    s.add_argument("--names", choices=["hf", "raw"], default="hf",
                   help="safetensors tensor names: hf (default) joins key paths with '.', without the "
                   "checkpointable when only one holds arrays; raw keeps cairn's '/'-joined key paths")
    s.add_argument("--item", help="safetensors: this checkpointable only, its key paths as names")
    s.add_argument("--all-items", action="store_true",
                   help="safetensors: where several checkpointables hold arrays, write them all, each name "
                   "after its checkpointable's (params.w, opt.mu.w); without it (or --item) that is an error")
    s.add_argument("--prng-keys", choices=["error", "data", "drop"], default="error",
                   help="sharded safetensors: a typed PRNG key is an error (default), its uint32 data, or left out")
    s.add_argument("--per-process", choices=["keys", "drop", "error"], default="keys",
                   help="orbax, sharded safetensors: a cairn.PerProcess value is written for every saving "
                   "process under process_<p> (default), left out, or an error")
    s.add_argument("--budget", type=parse_bytes, default=256 << 20,
                   help="memory budget for data in flight (default 256M)")
    s.set_defaults(fn=cmd_convert)
    add_copy_commands(sub, parse_bytes)  # cp and mv
    for name in ("cp", "mv"):
        sub.choices[name].set_defaults(fn=cmd_copy)
    add_plan_command(sub, parse_bytes)  # plan: a dry run of a load

    s = sub.add_parser("gc", help="remove leftovers of interrupted saves (temporary and uncommitted folders)")
    s.add_argument("dir")
    s.add_argument("--dry-run", action="store_true", help="only show what would be removed")
    s.add_argument("--min-age", type=float, default=3600.0, metavar="SECONDS",
                   help="keep leftovers younger than this, or of unknown age (default 3600; 0 removes all)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_gc)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``cairn`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    out = Output(plain=args.plain, quiet=args.quiet)
    try:
        return int(args.fn(args, out))
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("cairn: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1  # e.g. `cairn inspect ... | head`
    except Exception as e:
        if args.debug:
            raise
        known = isinstance(e, (CheckpointError, OSError, ValueError, TypeError))
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if hasattr(args, "overwrite"):  # the library's keyword, as this command spells it
            text = text.replace("overwrite=True", "--overwrite")
        prefix = "error" if known else f"internal error ({type(e).__name__}; rerun with --debug for the traceback)"
        print(f"cairn: {prefix}: {text}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
