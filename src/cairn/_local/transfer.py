"""The transfers of one local-tier restore: round by round, each process sends what it serves.

Round ``d`` moves bytes from every process ``s`` to ``(s + d) % count`` with
one collective (`_replicas.send_rows`), its width the largest of that
round's transfers, which every process derives from the same plan; a round
nobody needs is skipped, and round 0 (a process's own bytes) is a copy. Each
transfer's checksum is taken on both sides and compared once all rounds are
done, so a process whose bytes arrived wrong makes every process fall back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.checksum import crc32c
from .._errors import CorruptCheckpointError
from .._format.values import dtype_from_name, dtype_name
from .blob import missing_values, own_pieces, target_arrays
from .replicas import read_header, send_bytes, shard_tables, unpack
from .restoreplan import Choice, Segment, decode_table, local_box, segments, sizes


class Exchange:
    """What this process sends and receives in a restore of `choice`, and the arrays it ends with."""

    def __init__(self, choice: Choice, lengths: dict[int, int], target: Any, tables: dict[int, Any], me: int,
                 count: int, layout: str | None, where: str):
        """`lengths`: each saved blob's length, by its saved process."""
        self.choice, self.me, self.count, self.where, self.layout = choice, me, count, where, layout
        self.target = target
        self.values: dict[str, Any] | None = None
        self.per_process: dict[int, dict[str, Any]] = {}  # reshard: each served blob's PerProcess values
        self.hosts: list[np.ndarray] = []
        self._blob: np.ndarray | None = None
        if choice.same:  # process q receives blob q, whole
            self._sizes: dict[int, dict[int, int]] = {}
            for q, s in choice.servers.items():
                self._sizes.setdefault(s, {})[q] = int(lengths[q])
            return
        self._saved = decode_table([t for t in tables.values() if t.get("leaves") is not None], where)
        paths, leaves = target_arrays(target)
        shapes = [tuple(x.shape) for x in leaves]
        dtypes = [np.dtype(x.dtype) for x in leaves]
        wanted = {p: t[0] for p, t in shard_tables(shapes, dtypes, [x.sharding for x in leaves],
                                                   list(range(count))).items()}
        segs = segments(self._saved, choice.servers, paths, shapes, [str(dtype_name(d)) for d in dtypes],
                        wanted, where)
        self._sizes = sizes(segs)
        self._mine = wanted[me]
        self._dtypes = dtypes
        self._by_pair: dict[tuple[int, int], list[Segment]] = {}
        for g in segs:
            self._by_pair.setdefault((g.server, g.receiver), []).append(g)

    def _n(self, s: int, r: int) -> int:
        return self._sizes.get(s, {}).get(r, 0)

    def run(self, blobs: dict[int, np.ndarray], error: str | None) -> dict[str, Any]:
        """Every round (a collective call on every process alike); the outcome to share with all."""
        views: dict[int, list[np.ndarray]] = {}
        if not self.choice.same:
            self.hosts = [np.empty(tuple(b - a for a, b in pc.box), self._dtypes[pc.leaf]) for pc in self._mine]
            if error is None:
                try:
                    views = self._open(blobs)
                except CorruptCheckpointError as e:
                    error = f"{type(e).__name__}: {e}"
        sent: dict[str, int] = {}
        got: dict[str, int] = {}
        for d in range(self.count):
            width = max(self._n(s, (s + d) % self.count) for s in range(self.count))
            if width == 0:
                continue
            r, src = (self.me + d) % self.count, (self.me - d) % self.count
            n_out, n_in = self._n(self.me, r), self._n(src, self.me)
            row = self._row(r, blobs, views) if n_out and error is None else np.zeros(n_out, np.uint8)
            if n_out and d:  # a process's bytes to itself do not travel
                sent[str(r)] = crc32c(row)
            if d == 0:
                arrived = row
            else:  # spread over every device of both processes
                arrived = send_bytes(row, width, [(i + d) % self.count for i in range(self.count)], self.me)[:n_in]
            if n_in:
                if d:
                    got[str(src)] = crc32c(arrived)
                if error is None:
                    self._take(src, arrived)
        if error is None and self.choice.same:
            try:
                self.hosts, self.values = own_pieces(self.target, self._blob, int(self.choice.step or 0), self.me,
                                                     self.layout, self.where)
                if lost := missing_values(self.target, self.values):
                    error = f"the target's leaves {lost} are not in the local step"
            except CorruptCheckpointError as e:
                error = f"{type(e).__name__}: {e}"
        shared = self.values if not self.choice.same and self.choice.servers.get(0) == self.me else None
        return {"error": error, "sent": sent, "got": got, "values": shared,
                "per_process": {str(q): v for q, v in self.per_process.items()}}

    def _open(self, blobs: dict[int, np.ndarray]) -> dict[int, list[np.ndarray]]:
        """The piece arrays of the saved blobs this process serves (views); blob 0's host values."""
        dtypes = [dtype_from_name(n, self.where) for n in self._saved.dtypes]
        out = {}
        for q, blob in blobs.items():
            header, start = read_header(blob, self.where)
            if (header.get("step"), header.get("process")) != (self.choice.step, q):
                raise CorruptCheckpointError(f"{self.where}: the blob held for process {q} is of step "
                                             f"{header.get('step')} process {header.get('process')}")
            out[q] = unpack(blob, start, self._saved.pieces[q], dtypes, self.where)
            values = header.get("values", {})
            if q == 0:
                self.values = values
            self.per_process[q] = {k: v for k, v in values.items() if v.get("k") == "perprocess"}
        return out

    def _row(self, r: int, blobs: dict[int, np.ndarray], views: dict[int, list[np.ndarray]]) -> np.ndarray:
        if self.choice.same:
            return blobs[r]
        row = np.empty(self._n(self.me, r), np.uint8)
        off = 0
        for g in self._by_pair[(self.me, r)]:
            src = views[g.blob][g.old]
            part = src[local_box(g.box, self._saved.pieces[g.blob][g.old].box)]
            row[off:off + g.nbytes].view(src.dtype).reshape(part.shape)[...] = part
            off += g.nbytes
        return row

    def _take(self, src: int, arrived: np.ndarray) -> None:
        if self.choice.same:
            self._blob = arrived if src == self.me else arrived.copy()
            return
        off = 0
        for g in self._by_pair[(src, self.me)]:
            dest = self.hosts[g.new]
            part = dest[local_box(g.box, self._mine[g.new].box)]
            part[...] = arrived[off:off + g.nbytes].view(dest.dtype).reshape(part.shape)
            off += g.nbytes
