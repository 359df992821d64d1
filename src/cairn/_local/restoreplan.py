"""Where a local-tier restore gets its bytes: the step, who sends each saved blob, and what.

Pure: reports, shard tables and boxes in, decisions out. Every process runs
the same functions on the same gathered reports and reaches the same answer.

A step is restorable when every process that saved it (``saved_by`` of them)
has its blob held somewhere now: in a process's own directory, in another
``process_<q>`` directory on the same host, or as a peer replica. Each such
blob is *served* by one holder. Two cases:

- **Same layout** (same process count and array layout as the target):
  process q needs exactly blob q, which its server sends whole.
- **Reshard** (another process count or layout): each process needs the parts
  of the saved shards that overlap its target shards. Servers cut those
  `Segment`s out of the blobs they hold and send them, so every byte crosses
  the interconnect at most once. This needs the shard tables the saves wrote
  into their manifests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import CorruptCheckpointError, MismatchError
from .._format.values import dtype_from_name
from .._tree.pytree import display_path
from .replicas import Piece

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Choice:
    """The step a local-tier restore loads, and where from (``step`` None: the persistent tier serves)."""

    step: int | None
    saved_by: int = 0  # the process count that saved the step
    same: bool = False  # saved with this run's process count and layout
    servers: dict[int, int] = field(default_factory=dict)  # saved process q -> the process sending its bytes
    why: str = ""  # why no step (or why a newer one was passed over)


def choose(reports: Mapping[int, Any], count: int, newer_than: int | None = None) -> Choice:
    """The newest step whose every saved blob is held by some process now.

    `reports[p]` is ``{"count", "layout", "held": {step: {q: entry}}}``, an entry
    ``{"count", "layout", "length", "table"}`` describing saved blob q as process p
    holds it (``table``: whether its manifest has the shard table a reshard needs).
    """
    if any(r["count"] != count for r in reports.values()):
        return Choice(None, why="the processes disagree on the process count")
    layouts = {r["layout"] for r in reports.values()}
    steps = sorted({int(s) for r in reports.values() for s in r["held"]}, reverse=True)
    if not steps:
        return Choice(None)
    if len(layouts) != 1 or None in layouts:
        return Choice(None, why="the restore target has no shardings (or differs between processes)")
    layout = layouts.pop()
    why = ""
    for s in steps:
        held = {p: r["held"][str(s)] for p, r in sorted(reports.items()) if str(s) in r["held"]}
        entries = [e for h in held.values() for e in h.values()]
        counts = sorted({int(e["count"]) for e in entries})
        saved_layouts = {e["layout"] for e in entries}
        if len(counts) != 1 or len(saved_layouts) != 1:
            why = why or f"the copies of step {s} disagree on the process count or layout"
            continue
        saved_by = counts[0]
        same = saved_by == count and saved_layouts == {layout}
        holders = {q: [p for p, h in held.items() if str(q) in h and (same or h[str(q)].get("table"))]
                   for q in range(saved_by)}
        missing = [q for q, hs in holders.items() if not hs]
        if missing:
            why = why or (f"step {s} has no copy of process {missing} in any local directory or replica"
                          + ("" if same else " with the shard table a reshard needs"))
            continue
        if newer_than is not None and s < newer_than:
            return Choice(None, why=f"its newest complete step {s} is older than the persistent step {newer_than}")
        lengths = {q: int(held[holders[q][0]][str(q)]["length"]) for q in range(saved_by)}
        return Choice(s, saved_by, same, _servers(holders, lengths), why)
    return Choice(None, why=why)


def _servers(holders: dict[int, list[int]], lengths: dict[int, int]) -> dict[int, int]:
    """One holder per blob: the process of the same index when it holds it, else the least loaded."""
    load: dict[int, int] = {}
    out: dict[int, int] = {}
    for q in sorted(holders, key=lambda q: (q not in holders[q], -lengths[q], q)):
        p = q if q in holders[q] else min(holders[q], key=lambda p: (load.get(p, 0), p))
        out[q] = p
        load[p] = load.get(p, 0) + lengths[q]
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------- shard tables


def encode_table(paths: list[str], shapes: list[tuple[int, ...]], dtypes: list[str],
                 tables: Mapping[int, list[Piece]]) -> dict[str, Any]:
    """The manifest form of the shard tables of the blobs in `tables` (by saved process)."""
    return {"leaves": [[p, list(s), d] for p, s, d in zip(paths, shapes, dtypes)],
            "pieces": {str(q): [[pc.leaf, *[v for ab in pc.box for v in ab]] for pc in pieces]
                       for q, pieces in tables.items()}}


@dataclass(frozen=True)
class Table:
    """A saved step's leaves and, per saved blob, its pieces in blob order."""

    paths: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    pieces: dict[int, list[Piece]]


def decode_table(parts: list[dict[str, Any]], where: str) -> Table:
    """One `Table` from the manifest tables of several holders (each names some blobs)."""
    try:
        leaves = parts[0]["leaves"]
        paths = [str(p) for p, _, _ in leaves]
        shapes = [tuple(int(n) for n in s) for _, s, _ in leaves]
        dtypes = [str(d) for _, _, d in leaves]
        itemsizes = [dtype_from_name(d, where).itemsize for d in dtypes]
        pieces: dict[int, list[Piece]] = {}
        for part in parts:
            if part["leaves"] != leaves:
                raise ValueError("the holders disagree on the leaves")
            for q, rows in part["pieces"].items():
                pieces[int(q)] = [_piece(row, shapes, itemsizes) for row in rows]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CorruptCheckpointError(f"{where}: a local-tier shard table is malformed ({e})") from None
    return Table(paths, shapes, dtypes, pieces)


def _piece(row: list[int], shapes: list[tuple[int, ...]], itemsizes: list[int]) -> Piece:
    leaf = int(row[0])
    box = tuple((int(row[1 + 2 * d]), int(row[2 + 2 * d])) for d in range(len(shapes[leaf])))
    if len(row) != 1 + 2 * len(box) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, shapes[leaf])):
        raise ValueError(f"piece {row} does not fit leaf {leaf} of shape {list(shapes[leaf])}")
    return Piece(leaf, box, int(np.prod([b - a for a, b in box], dtype=np.int64)) * itemsizes[leaf])


# ---------------------------------------------------------------------- segments


@dataclass(frozen=True)
class Segment:
    """A region of saved blob `blob`'s piece `old` that `receiver` needs in its piece `new`."""

    server: int
    receiver: int
    blob: int
    old: int
    new: int
    box: Box  # global (start, stop) per dimension
    nbytes: int


def segments(saved: Table, servers: dict[int, int], target_paths: list[str], target_shapes: list[tuple[int, ...]],
             target_dtypes: list[str], wanted: Mapping[int, list[Piece]], where: str) -> list[Segment]:
    """The segments every receiver in `wanted` (receiver -> its target pieces) gets, in sending order.

    A saved box held by several blobs (a replicated array) is taken from the
    receiver's own blob when it serves one, else from the lowest-numbered blob.
    """
    index = {p: i for i, p in enumerate(saved.paths)}
    for path, shape, dtype in zip(target_paths, target_shapes, target_dtypes):
        i = index.get(path)
        if i is None:
            raise MismatchError(f"{where}: the target's leaf {display_path(path)!r} is not in the local step")
        if saved.shapes[i] != tuple(shape) or saved.dtypes[i] != dtype:
            raise MismatchError(f"{where}: leaf {display_path(path)!r} was saved as {saved.dtypes[i]}"
                                f"{list(saved.shapes[i])}; the target is {dtype}{list(shape)}")
    # Per saved leaf: its distinct boxes (as arrays) and the blobs (and piece numbers) holding each.
    boxes: dict[int, dict[Box, list[tuple[int, int]]]] = {}
    for q in sorted(saved.pieces):
        for j, pc in enumerate(saved.pieces[q]):
            boxes.setdefault(pc.leaf, {}).setdefault(pc.box, []).append((q, j))
    arrays = {leaf: (list(bs), np.array([[a for a, _ in b] for b in bs], np.int64).reshape(len(bs), -1),
                     np.array([[z for _, z in b] for b in bs], np.int64).reshape(len(bs), -1))
              for leaf, bs in boxes.items()}
    out: list[Segment] = []
    for r in sorted(wanted):
        for n, pc in enumerate(wanted[r]):
            leaf = index[target_paths[pc.leaf]]
            if leaf not in arrays:
                raise CorruptCheckpointError(f"{where}: no saved shard of leaf "
                                             f"{display_path(saved.paths[leaf])!r}")
            keys, lo, hi = arrays[leaf]
            want_lo = np.array([a for a, _ in pc.box], np.int64)
            want_hi = np.array([b for _, b in pc.box], np.int64)
            o_lo, o_hi = np.maximum(lo, want_lo), np.minimum(hi, want_hi)
            hits = np.flatnonzero(np.all(o_hi > o_lo, axis=1))  # a 0-d leaf: its one box
            covered = int(np.prod(o_hi[hits] - o_lo[hits], axis=1).sum())
            if covered != int(np.prod(want_hi - want_lo)):
                raise CorruptCheckpointError(f"{where}: the saved shards of leaf {display_path(saved.paths[leaf])!r}"
                                             f" do not tile the target box {list(pc.box)}")
            itemsize = dtype_from_name(saved.dtypes[leaf], where).itemsize
            for h in hits:
                holders = boxes[leaf][keys[h]]
                q, j = next(((q, j) for q, j in holders if servers[q] == r), holders[0])
                box = tuple((int(a), int(b)) for a, b in zip(o_lo[h], o_hi[h]))
                size = int(np.prod([b - a for a, b in box], dtype=np.int64)) * itemsize
                out.append(Segment(servers[q], r, q, j, n, box, size))
    return out


def sizes(segs: list[Segment]) -> dict[int, dict[int, int]]:
    """Bytes per (server, receiver)."""
    out: dict[int, dict[int, int]] = {}
    for g in segs:
        row = out.setdefault(g.server, {})
        row[g.receiver] = row.get(g.receiver, 0) + g.nbytes
    return out


def local_box(box: Box, within: Box) -> tuple[Any, ...]:
    """`box` as an index of the array that holds `within` (a view, for 0-d arrays too)."""
    return (*(slice(a - w0, b - w0) for (a, b), (w0, _) in zip(box, within)), Ellipsis)
