"""The local tier: frequent checkpoints in a fast per-host directory, copied to peer processes.

Every `every` steps each process packs its distinct array shards and the
state's host values into a byte blob, one row per device (each device packs
the shards it holds, so none holds more than one extra copy of its own),
sends the rows to `replicas` other processes (XLA collectives, `_replicas`),
and returns: that is the blocking part (device copies and a small exchange
of row lengths through the coordinator). A background thread then brings its own blob and
the peers' blobs it received to host and writes them as one ordinary cairn
checkpoint, committed by a single process into ``<directory>/process_<i>/
step_<N>``; the last `keep` steps are kept. A kill at any instant leaves a
torn attempt that is never listed (and is removed when the tier opens).

On restore every process reports what its host directory holds (its own
``process_<i>`` folder and any other one there, such as a previous run's);
all of them pick the newest step for which every saved blob exists somewhere
(`_localplan.choose`). Saved with this run's process count and layout, each
process gets its own blob whole, from its directory or from a peer. Saved by
another process count or layout, the holders cut out the parts of the saved
shards that each process's target shards need and send them (a reshard,
every byte sent once). Transfers are XLA collectives and are checksummed end
to end. Without such a step the caller falls back to the persistent tier.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from .._dist.agree import Decisions
from .._dist.coord import Coordinator, SingleProcess
from .._errors import CheckpointError, CorruptCheckpointError
from .._format.values import dtype_name
from .._load import engine as _load
from .._load.source import CairnSource
from .._read.metadata import read_manifest
from .._run import steps as _steps
from .._save import engine as _save
from .._storage import Storage
from .._storage.location import Location
from .._tree.perprocess import PerProcess
from .._tree.pytree import display_path, map_with_path
from .blob import assemble, decode, missing_values, shard_data, split, target_layout
from .replicas import (
    header_bytes,
    layout_key,
    pack_rows,
    placement,
    process_devices,
    row_lengths,
    send_rows,
    shard_tables,
)
from .restoreplan import Choice, choose, encode_table
from .transfer import Exchange

log = logging.getLogger("cairn")

META = "cairn_local"


class LocalTier:
    """A fast checkpoint tier in a per-host directory, with copies held by peer processes.

    Give it to `CheckpointManager` (``local=``): the manager then also saves
    every `every` steps into `directory` (a path on this host: /dev/shm, a
    local NVMe; each process uses ``process_<index>`` under it), keeping the
    last `keep` steps, and each process's shards are also held by `replicas`
    other processes, in other failure domains: ``domain(process_index)``
    names a process's domain (default: each process its own). `restore`
    resumes from the newest step complete across the local directories and
    the replicas when it is at least as new as the persistent tier's, and a
    process with an empty directory (a replaced host) gets its shards from
    its peers. A target on another process count or sharding is resharded
    from the local copies (each process gets only the parts it needs). Arrays
    must be ``jax.Array``; host values may be numbers, strings, bytes and
    numpy arrays. The restore needs a `target` with shardings
    (``jax.ShapeDtypeStruct`` or arrays).

    Example:

        local = cairn.LocalTier("/dev/shm/run1", every=10, keep=2, replicas=1)
        with cairn.CheckpointManager("s3://bucket/run1", save_every=500, local=local) as mgr:
            state = mgr.restore(target=abstract_state)   # local, peer or persistent copy
    """

    def __init__(self, directory: str | os.PathLike[str], *, every: int, keep: int = 2, replicas: int = 1,
                 domain: Callable[[int], Hashable] | None = None, storage_options: dict[str, Any] | None = None):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        self.directory = os.fspath(directory)
        self.every, self.keep, self.replicas, self.domain = every, keep, replicas, domain
        self._options = storage_options
        self._coord: Coordinator | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._busy: set[int] = set()
        #: The step the last `restore` loaded from this tier (None: it fell back or found nothing).
        self.restored_step: int | None = None
        #: Timings of the last save (seconds): blocking, and the background write.
        self.last_save: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"<cairn.LocalTier {self.directory!r} every={self.every} keep={self.keep} replicas={self.replicas}>"

    # ------------------------------------------------------------------ setup

    def attach(self, coord: Coordinator, threads: int = 4) -> LocalTier:
        """Bind to the program's processes (the manager calls it); clean up torn saves."""
        if self._coord is not None:
            raise CheckpointError(f"{self.directory}: this LocalTier already belongs to a CheckpointManager")
        self._coord, self._threads = coord, threads
        self._me, self._count = coord.process_index, coord.process_count
        self._holders = placement(self._count, self.replicas, self.domain) if self._count > 1 else []
        process_devices(self._count)  # the same number of devices on every process, or a clear error
        self.path, self._storage = _steps.open_directory(f"{self.directory.rstrip('/')}/process_{self._me}",
                                                         self._options)
        self._decisions = Decisions(coord, "cairn-local-tier")
        self._cleanup()
        return self

    def _where(self, step: int | None = None) -> str:
        return self.path if step is None else f"{self.path}/{_steps.step_dirname(step)}"

    def _location(self, step: int) -> Location:
        return Location(self._storage, _steps.step_dirname(step), self._where(step))

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: Any) -> bool:
        """Save `state` as `step` if it is on the interval; every process calls it. Returns whether it did."""
        if step % self.every:
            return False
        t0 = time.perf_counter()
        self._collect()  # one local save in flight: bounded memory
        paths, arrays, values = split(state, self._where(step))
        shapes = [tuple(a.shape) for a in arrays]
        dtypes = [np.dtype(a.dtype) for a in arrays]
        shardings = [a.sharding for a in arrays]
        key = layout_key(shapes, dtypes, shardings, paths)
        kept = sorted({self._me, *(dest.index(self._me) for dest in self._holders)})  # own blob, replicas
        tables = {q: t[0] for q, t in shard_tables(shapes, dtypes, shardings, kept).items()}
        pieces = tables[self._me]
        shards = [shard_data(arrays[p.leaf], p.box) for p in pieces]
        header = header_bytes({"step": step, "process": self._me, "count": self._count, "layout": key,
                               "values": values})
        devices = process_devices(self._count)[self._me]
        holders = self._holders

        def decide(info: dict[int, Any]) -> dict[int, Any]:
            """On the primary: one check of every process, then each its width and the row lengths of the
            blobs it keeps (its own, the replicas it holds): its part does not grow with the processes."""
            odd = {p: v for p, v in info.items() if v["step"] != step or v["layout"] != key}
            if odd:
                why = (f"process 0 saves step {step} (layout {key}), but "
                       + "; ".join(f"process {p} step {v['step']} (layout {v['layout']})" for p, v in sorted(odd.items())))
                return {p: {"odd": why} for p in info}
            width = max(max(v["rows"]) for v in info.values())
            return {p: {"width": width, "rows": {str(q): info[q]["rows"] for q in {p, *(d.index(p) for d in holders)}}}
                    for p in info}

        mine = self._decisions.each(f"save-{step}", {"step": step, "layout": key,
                                                     "rows": row_lengths(pieces, len(header), len(devices))}, decide)
        if "odd" in mine:
            raise CheckpointError(f"{self._where(step)}: processes disagree on the local save: {mine['odd']}")
        rows = {int(q): [int(n) for n in r] for q, r in mine["rows"].items()}
        width = int(mine["width"])
        own = pack_rows(header, pieces, shards, width, devices)  # one row per device: no device holds more
        received = {}
        for dest in self._holders:
            received[dest.index(self._me)] = send_rows(own, width, dest, self._me)
        # Planned here, on the main thread, into host buffers the background fills: a save's
        # number comes from a sequence the persistent saves share, which every process must
        # draw from in the same order. The data files carry block checksums, as any checkpoint.
        devs = {self._me: own, **received}
        host = {q: np.empty(sum(rows[q]), np.uint8) for q in devs}
        meta = {META: {"step": step, "process": self._me, "count": self._count, "layout": key, "holds": sorted(host),
                       "lengths": {str(q): int(host[q].size) for q in host},
                       "rows": {str(q): rows[q] for q in host},
                       "table": encode_table(paths, shapes, [str(dtype_name(d)) for d in dtypes], tables)}}
        tree: dict[str, Any] = {"own": host[self._me]}
        if received:
            tree["peers"] = {str(q): host[q] for q in received}
        self._busy.add(step)
        try:
            job = _save.prepare(self._location(step), tree, coordinator=SingleProcess(), metadata=meta,
                                overwrite=True, threads=self._threads)  # a step redone after a fallback
        except BaseException:
            self._busy.discard(step)
            raise
        blocking = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._write, args=(step, job, devs, host, meta, blocking),
                                        name="cairn-local-save", daemon=True)
        self._thread.start()
        return True

    def _write(self, step: int, job: Any, devs: dict[int, Any], host: dict[int, np.ndarray], meta: dict[str, Any],
               blocking: float) -> None:
        t0 = time.perf_counter()
        try:
            for q, rows in devs.items():
                off = 0
                for row, n in zip(rows, meta[META]["rows"][str(q)]):
                    # Waits for the device copy (own) or for the collective that brings it (a peer's).
                    host[q][off:off + n] = np.asarray(row)[:n]
                    off += n
            job.run()
            self._retain()
        except BaseException as e:
            log.error("cairn: the local-tier save of step %d to %s failed: %s", step, self._where(step), e)
            self._error = e
        finally:
            self._busy.discard(step)
            self.last_save = {"blocking_s": blocking, "write_s": time.perf_counter() - t0}

    def _retain(self) -> None:
        steps = _steps.committed_steps(self._storage)
        for s in steps[:-self.keep]:
            try:
                _steps.delete_step(self._storage, s)
            except OSError as e:
                log.warning("cairn: could not delete local step %d in %s: %s", s, self.path, e)
        # Folders of processes this run does not have (a larger run before it) are only ever read by
        # a restore; once this process has a newer step of its own, their older steps are dead weight.
        for k, storage, path in self._visible()[1:]:
            if k < self._count or not steps:
                continue
            try:
                for s in _steps.committed_steps(storage):
                    if s < steps[-1]:
                        _steps.delete_step(storage, s)
            except OSError as e:
                log.warning("cairn: could not remove old local steps in %s: %s", path, e)
        self._cleanup()

    def _cleanup(self) -> None:
        for name in _steps.leftovers(self._storage, self._busy):
            try:
                _steps.remove_leftover(self._storage, name)
            except OSError:
                pass  # removed meanwhile, or unremovable: it is never listed either way

    def _collect(self) -> None:
        """Wait for the local save in flight; raise its error (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise CheckpointError(f"{self.path}: the background local-tier save failed: {err}") from err

    def wait(self) -> None:
        """Block until the local save in flight is committed (raising its error)."""
        self._collect()

    def steps(self) -> list[int]:
        """The committed local steps of this process's directory, oldest first."""
        return _steps.committed_steps(self._storage)

    # ------------------------------------------------------------------ restoring

    def restore(self, target: Any, newer_than: int | None = None, **reading: Any) -> tuple[int, Any] | None:
        """The newest complete local step and its state on `target`, if at least as new as
        `newer_than`; None (on every process alike) when the persistent tier must serve.

        `reading`: ``verify``, ``threads`` and ``budget_bytes``, as `cairn.load` takes them, for
        the reads of the blobs from disk (the transfers between processes are checksummed anyway).
        """
        unknown = reading.keys() - {"verify", "threads", "budget_bytes"}
        if unknown:
            raise TypeError(f"LocalTier.restore got unexpected keywords {sorted(unknown)}")
        self.restored_step = None
        self._collect()
        layout = target_layout(target, self.path)
        held, found = self._holdings()
        count = self._count

        def decide(reports: dict[int, Any]) -> dict[str, Any]:
            """On the primary: the step and who serves each blob, and the blobs' lengths (the
            others need no one's report: a process receives O(processes) numbers, not every report)."""
            c = choose(reports, count, newer_than)
            lengths = {} if c.step is None else {
                str(q): int(reports[p]["held"][str(c.step)][str(q)]["length"]) for q, p in c.servers.items()}
            return {"choice": [c.step, c.saved_by, c.same, {str(q): p for q, p in c.servers.items()}, c.why],
                    "lengths": lengths}

        got = self._decisions.decide("restore", {"held": held, "layout": layout, "count": count}, decide)
        step_, saved_by, same, servers, why = got["choice"]
        choice = Choice(step_, saved_by, same, {int(q): int(p) for q, p in servers.items()}, why)
        lengths = {int(q): int(n) for q, n in got["lengths"].items()}
        if choice.step is None:
            if choice.why and self._me == 0:
                log.warning("cairn: not restoring from the local tier in %s: %s; restoring from the persistent "
                            "tier instead", self.directory, choice.why)
            return None
        step, where = choice.step, self._where(choice.step)
        mine = [q for q, p in choice.servers.items() if p == self._me]
        parts: dict[str, Any] = {"leaves": None, "pieces": {}}  # the shard tables a reshard needs
        for q in mine if not choice.same else ():
            table = found[(step, q)][2]["table"]
            parts["leaves"] = table["leaves"]
            parts["pieces"][str(q)] = table["pieces"][str(q)]
        tables = {} if choice.same else self._decisions.gather(f"tables-{step}", parts)
        error, blobs = None, {}
        try:
            blobs = {q: self._read_blob(step, q, found[(step, q)], reading) for q in mine}
        except (CorruptCheckpointError, OSError, CheckpointError) as e:
            error = f"{type(e).__name__}: {e}"
        try:
            plan = Exchange(choice, lengths, target, tables, self._me, self._count, layout, where)
        except CheckpointError as e:  # the same on every process: all fall back, none sends
            if self._me == 0:
                log.warning("cairn: the local step %d does not restore onto this target (%s); restoring from the "
                            "persistent tier instead", step, e)
            return None
        outcome = plan.run(blobs, error)

        def verdict(outcomes: dict[int, Any]) -> dict[str, Any]:
            """On the primary: which processes failed (their error, or bytes that arrived other than
            sent), the shared values, and the saved per-process values (a reshard needs them all)."""
            bad = {p: o["error"] for p, o in sorted(outcomes.items()) if o["error"] is not None}
            for s_, o in outcomes.items():
                for r, c in o["sent"].items():
                    if outcomes[int(r)]["got"].get(str(s_)) != c:
                        bad.setdefault(int(r), f"the bytes from process {s_} fail their checksum")
            values = next((o["values"] for o in outcomes.values() if o.get("values") is not None), None)
            held = {q: v for o in outcomes.values() for q, v in o.get("per_process", {}).items()}
            return {"bad": {str(p): e for p, e in sorted(bad.items())}, "values": values, "per_process": held}

        told = self._decisions.decide(f"restored-{step}", outcome, verdict)
        bad = {int(p): e for p, e in told["bad"].items()}
        if bad:
            if self._me == 0:
                log.warning("cairn: the local step %d does not restore (%s); restoring from the persistent tier "
                            "instead", step, "; ".join(f"process {p}: {e}" for p, e in sorted(bad.items())))
            return None
        values = (told["values"] if told["values"] is not None else plan.values) or {}
        if lost := missing_values(target, values):  # a reshard: the same values on every process
            if self._me == 0:
                log.warning("cairn: the local step %d lacks the target's leaves %s; restoring from the persistent "
                            "tier instead", step, lost)
            return None
        resolved = None if choice.same else self._per_process(target, told["per_process"], choice.saved_by, step)
        if resolved is None and not choice.same:
            return None  # logged
        out = assemble(target, plan.hosts, self._me, values, where, resolved)
        if not choice.same and self._me == 0:
            log.info("cairn: restored local step %d, saved by %d processes, onto %d processes (resharded "
                     "from the local tier)", step, choice.saved_by, self._count)
        self.restored_step = step
        return step, out

    def _per_process(self, target: Any, by_process: dict[str, Any], saved_by: int, step: int) -> dict[str, Any] | None:
        """A reshard's `PerProcess` values for this process: its own saved one on the same process
        count, else the target's ``reshard(saved, index, count)``; None (logged) when neither serves.
        `by_process`: each saved process's per-process values, by its index."""
        held = {int(q): v for q, v in by_process.items()}
        wanted: dict[str, Any] = {}
        map_with_path(lambda p, x: wanted.__setitem__(p, x) if isinstance(x, PerProcess) else None, target)
        out: dict[str, Any] = {}
        for path, x in wanted.items():
            if any(path not in held.get(q, {}) for q in range(saved_by)):
                continue  # not saved per process: the shared value (or its absence) decides
            saved = [decode(held[q][path], self._where(step)) for q in range(saved_by)]
            if saved_by == self._count:
                out[path] = saved[self._me]
            elif x.reshard is not None:
                out[path] = PerProcess(x.reshard([v.value for v in saved], self._me, self._count))
            else:
                if self._me == 0:
                    log.warning("cairn: the local step %d was saved by %d processes and %r is per process, with "
                                "no PerProcess(reshard=...) in the target; restoring from the persistent tier "
                                "instead", step, saved_by, display_path(path))
                return None
        return out

    def _visible(self) -> list[tuple[int, Storage, str]]:
        """The ``process_<k>`` folders of this host directory: this process's first."""
        out = [(self._me, self._storage, self.path)]
        try:
            names = _steps.open_directory(self.directory, self._options)[1].list_dir("")
        except OSError:
            names = []
        for name in sorted(names):
            k = name[8:] if name.startswith("process_") else ""
            if k.isdigit() and int(k) != self._me:
                path, storage = _steps.open_directory(f"{self.directory.rstrip('/')}/{name}", self._options)
                out.append((int(k), storage, path))
        return out

    def _holdings(self) -> tuple[dict[str, Any], dict[tuple[int, int], tuple[Location, str, dict[str, Any]]]]:
        """What this host holds: per step, per saved process, its entry; and where each blob lies."""
        held: dict[str, dict[str, Any]] = {}
        found: dict[tuple[int, int], tuple[Location, str, dict[str, Any]]] = {}
        for k, storage, path in self._visible():
            try:
                steps = _steps.committed_steps(storage)
            except OSError:
                continue
            for s in steps:
                loc = Location(storage, _steps.step_dirname(s), f"{path}/{_steps.step_dirname(s)}")
                try:
                    meta = read_manifest(loc).metadata.get(META)
                except (CheckpointError, OSError) as e:
                    log.warning("cairn: skipping the local step %d in %s: %s", s, path, e)
                    continue
                if not (isinstance(meta, dict) and meta.get("process") == k and meta.get("step") == s):
                    continue
                for q in meta["holds"]:
                    if (s, q) in found:
                        continue
                    held.setdefault(str(s), {})[str(q)] = {
                        "count": meta["count"], "layout": meta["layout"], "length": meta["lengths"][str(q)],
                        "table": "table" in meta}
                    found[(s, q)] = (loc, "own" if q == k else "peers", meta)
        return held, found

    def _read_blob(self, step: int, q: int, at: tuple[Location, str, dict[str, Any]],
                   reading: dict[str, Any]) -> np.ndarray:
        loc, item, meta = at
        got = _load.load(CairnSource.open(loc), {item: None}, partial=True, coordinator=SingleProcess(), read_once=False,
                         publish=False, **{"threads": self._threads, **reading})  # part of a restore
        blob = got[item] if item == "own" else got[item][str(q)]
        if not isinstance(blob, np.ndarray) or blob.dtype != np.uint8 or blob.size != int(meta["lengths"][str(q)]):
            raise CorruptCheckpointError(f"{loc.path}: the blob of process {q} is not {meta['lengths'][str(q)]} bytes")
        return blob

    def close(self) -> None:
        self._collect()
