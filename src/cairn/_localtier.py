"""The local tier: frequent checkpoints in a fast per-host directory, copied to peer processes.

Every `every` steps each process packs its distinct array shards and the
state's host values into one byte blob on its first device, sends it to
`replicas` other processes (XLA collectives, `_replicas`), and returns: that
is the blocking part (device copies and a small exchange of blob lengths
through the coordinator). A background thread then brings its own blob and
the peers' blobs it received to host and writes them as one ordinary cairn
checkpoint, committed by a single process into ``<directory>/process_<i>/
step_<N>``; the last `keep` steps are kept. A kill at any instant leaves a
torn attempt that is never listed (and is removed when the tier opens).

On restore every process reports what its directory holds; all of them pick
the newest step for which every process's blob exists somewhere (its own
directory or a replica), with the same process count and array layout as the
target. A process whose directory is empty receives its blob from a peer, again
by collectives; a blob's checksum is checked after any transfer. Without
such a step the caller falls back to the persistent tier.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from . import _load, _save, _steps
from ._agree import Decisions
from ._checksum import crc32c
from ._coord import Coordinator, SingleProcess
from ._errors import CheckpointError, CorruptCheckpointError, MismatchError, UnsupportedTypeError
from ._leaves import is_jax_array
from ._location import Location
from ._metadata import read_manifest
from ._replicas import (
    first_devices,
    header_bytes,
    layout_key,
    pack_on_device,
    placement,
    read_header,
    send_rows,
    shard_table,
    unpack,
)
from ._tree import display_path, map_with_path
from ._values import decode_value, dtype_from_name, dtype_name, encode_value, value_kind

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
    its peers. Arrays must be ``jax.Array``; host values may be numbers,
    strings, bytes and numpy arrays. The restore needs a `target` with
    shardings (``jax.ShapeDtypeStruct`` or arrays) laid out as saved.

    Example::

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
        paths, arrays, values = _split(state, self._where(step))
        shapes = [tuple(a.shape) for a in arrays]
        dtypes = [np.dtype(a.dtype) for a in arrays]
        shardings = [a.sharding for a in arrays]
        key = layout_key(shapes, dtypes, shardings, paths)
        pieces, _ = shard_table(shapes, dtypes, shardings, self._me)
        shards = [_shard_data(arrays[p.leaf], p.box) for p in pieces]
        header = header_bytes({"step": step, "process": self._me, "count": self._count, "layout": key,
                               "values": values})
        length = len(header) + sum(p.nbytes for p in pieces)
        info = self._decisions.gather(f"save-{step}", {"step": step, "length": length, "layout": key})
        odd = {p: v for p, v in info.items() if v["step"] != step or v["layout"] != key}
        if odd:
            raise CheckpointError(f"{self._where(step)}: processes disagree on the local save: process "
                                  f"{self._me} saves step {step} (layout {key}), but "
                                  + "; ".join(f"process {p} step {v['step']} (layout {v['layout']})"
                                              for p, v in sorted(odd.items())))
        lengths = {p: int(v["length"]) for p, v in info.items()}
        width = max(lengths.values())
        own = pack_on_device(header, shards, width, first_devices(self._count)[self._me])
        received = {}
        for dest in self._holders:
            received[dest.index(self._me)] = send_rows(own, width, dest, self._me)
        # Planned here, on the main thread, into host buffers the background fills: a save's
        # number comes from a sequence the persistent saves share, which every process must
        # draw from in the same order. The checksums join the manifest's metadata before commit.
        devs = {self._me: own, **received}
        host = {q: np.empty(lengths[q], np.uint8) for q in devs}
        meta = {META: {"step": step, "process": self._me, "count": self._count, "layout": key, "holds": sorted(host),
                       "lengths": {str(q): lengths[q] for q in host}, "crc": {}}}
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
            for q, dev in devs.items():
                # Waits for the device copy (own) or for the collective that brings it (a peer's).
                host[q][:] = np.asarray(dev)[:host[q].size]
                meta[META]["crc"][str(q)] = crc32c(host[q])
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

    def restore(self, target: Any, newer_than: int | None = None) -> tuple[int, Any] | None:
        """The newest complete local step and its state on `target`, if at least as new as
        `newer_than`; None (on every process alike) when the persistent tier must serve."""
        self.restored_step = None
        self._collect()
        layout = _target_layout(target, self.path)
        report = {"steps": self._holdings(), "layout": layout, "count": self._count}
        reports = self._decisions.gather("restore", report)
        step, sources, why = choose(reports, self._count, self._holders)
        if step is not None and newer_than is not None and step < newer_than:
            step, why = None, f"its newest complete step {step} is older than the persistent step {newer_than}"
        if step is None:
            if why and self._me == 0:
                log.warning("cairn: not restoring from the local tier in %s: %s; restoring from the persistent "
                            "tier instead", self.directory, why)
            return None
        width = max(int(v) for r in reports.values() if str(step) in r["steps"]
                    for v in r["steps"][str(step)]["lengths"].values())
        blob, error = None, None
        try:
            if sources[self._me][1] is None:
                n = reports[self._me]["steps"][str(step)]["lengths"][str(self._me)]
                blob = self._read_blob(step, "own", n)
        except (CorruptCheckpointError, OSError, CheckpointError) as e:
            error = f"{type(e).__name__}: {e}"
        blob = self._transfer(step, sources, reports, width, blob)
        if blob is not None and error is None:
            holder, _ = sources[self._me]
            want = reports[holder]["steps"][str(step)]["crc"][str(self._me)]
            if crc32c(blob) != want:
                error = f"the blob of process {self._me} from process {holder} fails its checksum"
        out = None
        if error is None:
            try:
                out = _rebuild(target, blob, step, self._me, layout, f"{self._where(step)}")
            except CheckpointError as e:
                error = f"{type(e).__name__}: {e}"
        outcomes = self._decisions.gather(f"restored-{step}", error)
        bad = {p: e for p, e in sorted(outcomes.items()) if e is not None}
        if bad:
            if self._me == 0:
                log.warning("cairn: the local step %d does not restore (%s); restoring from the persistent tier "
                            "instead", step, "; ".join(f"process {p}: {e}" for p, e in bad.items()))
            return None
        self.restored_step = step
        return step, out

    def _holdings(self) -> dict[str, Any]:
        out = {}
        for s in _steps.committed_steps(self._storage):
            try:
                meta = read_manifest(self._location(s)).metadata.get(META)
            except (CheckpointError, OSError) as e:
                log.warning("cairn: skipping the local step %d in %s: %s", s, self.path, e)
                continue
            if isinstance(meta, dict) and meta.get("process") == self._me and meta.get("step") == s:
                out[str(s)] = {k: meta[k] for k in ("count", "layout", "holds", "lengths", "crc")}
        return out

    def _read_blob(self, step: int, item: str, length: int, peer: int | None = None) -> np.ndarray:
        got = _load.load(self._location(step), {item: None}, partial=True, coordinator=SingleProcess(),
                         read_once=False, publish=False)  # part of a restore, not a load of its own
        blob = got[item] if peer is None else got[item][str(peer)]
        if not isinstance(blob, np.ndarray) or blob.dtype != np.uint8 or blob.size != int(length):
            raise CorruptCheckpointError(f"{self._where(step)}: the {item} blob is not {length} bytes")
        return blob

    def _transfer(self, step: int, sources: dict[int, tuple[int, int | None]], reports: dict[int, Any],
                  width: int, blob: np.ndarray | None) -> np.ndarray | None:
        """Move the blobs of processes without their own copy from their holders (collectives)."""
        import jax

        rounds = sorted({k for _, k in sources.values() if k is not None})
        device = first_devices(self._count)[self._me]
        for k in rounds:
            dest = self._holders[k]
            back = [0] * self._count  # holder r sends to the q whose replica k it keeps
            for q, r in enumerate(dest):
                back[r] = q
            q = back[self._me]
            row = np.zeros(width, np.uint8)
            if sources[q] == (self._me, k):
                n = reports[self._me]["steps"][str(step)]["lengths"][str(q)]
                try:
                    row[:n] = self._read_blob(step, "peers", n, peer=q)
                except (CheckpointError, OSError) as e:
                    log.error("cairn: reading the replica of process %d in %s: %s", q, self._where(step), e)
            got = send_rows(jax.device_put(row, device), width, back, self._me)
            if sources[self._me] == (dest[self._me], k):
                holder = dest[self._me]
                n = reports[holder]["steps"][str(step)]["lengths"][str(self._me)]
                blob = np.asarray(got)[:n].copy()
        return blob

    def close(self) -> None:
        self._collect()


# ---------------------------------------------------------------------- decisions (pure)


def choose(reports: dict[int, Any], count: int, holders: list[list[int]]
           ) -> tuple[int | None, dict[int, tuple[int, int | None]], str]:
    """The newest step whose every process's blob is held somewhere, and where from.

    `sources[q]` is ``(q, None)`` for its own copy or ``(holder, k)`` for replica k.
    Returns ``(None, {}, why)`` when no step qualifies (`why` empty when the tier is empty).
    """
    if any(r["count"] != count for r in reports.values()):
        return None, {}, "the processes disagree on the process count"
    layouts = {r["layout"] for r in reports.values()}
    steps = sorted({int(s) for r in reports.values() for s in r["steps"]}, reverse=True)
    if not steps:
        return None, {}, ""
    if len(layouts) != 1 or None in layouts:
        return None, {}, "the restore target has no shardings (or differs between processes)"
    layout = layouts.pop()
    why = ""
    for s in steps:
        have = {p: r["steps"][str(s)] for p, r in reports.items() if str(s) in r["steps"]}
        counts = {e["count"] for e in have.values()}
        if counts != {count}:
            return None, {}, (f"it was saved by {sorted(counts)} processes and this run has {count}; "
                              "the local tier cannot reshard across process counts")
        if any(e["layout"] != layout for e in have.values()):
            why = why or f"step {s} was saved with another array layout than the restore target's"
            continue
        sources: dict[int, tuple[int, int | None]] = {}
        for q in range(count):
            if q in have and q in have[q]["holds"]:
                sources[q] = (q, None)
                continue
            for k, dest in enumerate(holders):
                r = dest[q]
                if r in have and q in have[r]["holds"]:
                    sources[q] = (r, k)
                    break
        missing = [q for q in range(count) if q not in sources]
        if not missing:
            return s, sources, ""
        why = why or f"step {s} has no copy of process {missing} in any local directory or replica"
    return None, {}, why


# ---------------------------------------------------------------------- state <-> blob


def _split(state: Any, where: str) -> tuple[list[str], list[Any], dict[str, Any]]:
    paths: list[str] = []
    arrays: list[Any] = []
    values: dict[str, Any] = {}

    def visit(path: str, x: Any) -> None:
        if is_jax_array(x):
            if x.is_deleted():
                raise UnsupportedTypeError(f"{where}: leaf {display_path(path)!r} is a deleted (donated) jax.Array")
            if dtype_name(np.dtype(x.dtype)) is None or np.dtype(x.dtype).itemsize < 1:
                raise UnsupportedTypeError(f"{where}: leaf {display_path(path)!r}: the local tier cannot "
                                           f"store dtype {x.dtype}")
            paths.append(path)
            arrays.append(x)
        else:
            values[path] = _encode(path, x, where)

    map_with_path(visit, state)
    order = sorted(range(len(paths)), key=paths.__getitem__)  # by key path: the order a target gives too
    return [paths[i] for i in order], [arrays[i] for i in order], values


def _encode(path: str, x: Any, where: str) -> Any:
    kind = value_kind(x)
    if kind is not None:
        return {"k": kind, "v": encode_value(kind, x)}
    if isinstance(x, np.ndarray) and dtype_name(x.dtype) is not None:
        le = np.ascontiguousarray(x).astype(x.dtype.newbyteorder("<"), copy=False)
        return {"k": "ndarray", "dtype": dtype_name(x.dtype), "shape": list(x.shape), "hex": le.tobytes().hex()}
    if isinstance(x, (bytes, bytearray)):
        return {"k": "bytes", "hex": bytes(x).hex()}
    raise UnsupportedTypeError(f"{where}: leaf {display_path(path)!r} has type {type(x).__qualname__}; the local "
                               "tier stores jax.Arrays, numpy arrays, bytes, numbers and strings")


def _decode(v: Any, where: str) -> Any:
    if v["k"] == "ndarray":
        dt = dtype_from_name(v["dtype"], f"{where}: ")
        return np.frombuffer(bytes.fromhex(v["hex"]), dt.newbyteorder("<")).astype(dt).reshape(v["shape"])
    if v["k"] == "bytes":
        return bytes.fromhex(v["hex"])
    return decode_value(v["k"], v["v"], where)


def _shard_data(x: Any, box: tuple[tuple[int, int], ...]) -> Any:
    from ._jaxutil import slices_to_box

    for s in sorted(x.addressable_shards, key=lambda s: s.device.id):
        if tuple(slices_to_box(s.index, tuple(x.shape))) == box:
            return s.data
    raise CheckpointError(f"no addressable shard with box {box}")  # shard_table lists only local boxes


def _target_arrays(target: Any) -> tuple[list[str], list[Any]]:
    paths, leaves = [], []

    def visit(path: str, x: Any) -> None:
        if getattr(x, "sharding", None) is not None and getattr(x, "shape", None) is not None:
            paths.append(path)
            leaves.append(x)

    map_with_path(visit, target)
    order = sorted(range(len(paths)), key=paths.__getitem__)
    return [paths[i] for i in order], [leaves[i] for i in order]


def _target_layout(target: Any, where: str) -> str | None:
    if target is None:
        return None
    paths, leaves = _target_arrays(target)
    return layout_key([tuple(x.shape) for x in leaves], [np.dtype(x.dtype) for x in leaves],
                      [x.sharding for x in leaves], paths)


def _rebuild(target: Any, blob: np.ndarray | None, step: int, me: int, layout: str | None, where: str) -> Any:
    import jax

    if blob is None:
        raise CorruptCheckpointError(f"{where}: no blob of process {me} arrived")
    header, start = read_header(blob, where)
    if (header.get("step"), header.get("process"), header.get("layout")) != (step, me, layout):
        raise CorruptCheckpointError(f"{where}: the blob is of step {header.get('step')} process "
                                     f"{header.get('process')}, not step {step} process {me}")
    paths, leaves = _target_arrays(target)
    shapes = [tuple(x.shape) for x in leaves]
    dtypes = [np.dtype(x.dtype) for x in leaves]
    pieces, placed = shard_table(shapes, dtypes, [x.sharding for x in leaves], me)
    hosts = unpack(blob, start, pieces, dtypes, where)
    per_leaf: list[list[Any]] = [[] for _ in leaves]
    for p, host in zip(pieces, hosts):
        per_leaf[p.leaf] += [jax.device_put(host, d) for d in placed[p.leaf][p.box]]
    built = {path: jax.make_array_from_single_device_arrays(shapes[i], leaves[i].sharding, per_leaf[i])
             for i, path in enumerate(paths)}
    values = header.get("values", {})

    def fill(path: str, x: Any) -> Any:
        if path in built:
            return built[path]
        if path not in values:
            raise MismatchError(f"{where}: the target's leaf {display_path(path)!r} is not in the local step")
        return _decode(values[path], where)

    return map_with_path(fill, target)
