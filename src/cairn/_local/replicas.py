"""Peer replicas for the local tier: where each process's copies go, and how bytes get there.

Placement is pure: processes are ordered by failure domain, and replica k of
process q goes to the process a fixed shift further along that order. A shift
is a permutation of the processes, so every process sends one row and
receives one row per replica, and the shifts are chosen so that a process's
copies sit in domains other than its own and other than each other's.

The transport is XLA's: every device contributes one row (a uint8 vector)
of a global ``(devices, length)`` array, and a ``ppermute`` under
``shard_map`` moves device j of process q's row to device j of the process
holding it. No device ever holds more than its own row and the rows it
receives. It is called on the main thread, like any collective, by every
process with the same arguments.

Process blobs are packed here too: a small JSON header (the step, the
process and the host values) followed by the raw little-endian bytes of the
process's distinct array shards, grouped by the local device that packs
each (the first holding it), in an order every process derives from the
shardings alone (`shard_tables`). Row j of a process holds device j's part
(row 0 starts with the header); the blob is the rows' bytes back to back.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._core.checksum import crc32c
from .._core.memo import Memo
from .._errors import CheckpointError, CorruptCheckpointError
from .._tree.shardings import device_boxes

_MAGIC = b"CAIRNLT2"  # 2: shards grouped by packing device
_HEAD = struct.Struct("<8sQ")  # magic, header length


# ---------------------------------------------------------------------- placement (pure)


def placement(count: int, replicas: int, domain_of: Callable[[int], Hashable] | None = None) -> list[list[int]]:
    """``holders[k][q]``: the process that keeps replica k of process q's shards.

    Each ``holders[k]`` is a permutation of ``range(count)``. Raises
    `CheckpointError` when the domains cannot place `replicas` copies of
    every process outside its own domain (and apart from each other).
    """
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    if replicas == 0 or count == 1:
        return []
    domains = [domain_of(p) if domain_of is not None else p for p in range(count)]
    first: dict[Hashable, int] = {}
    for p, d in enumerate(domains):
        first.setdefault(d, p)
    order = sorted(range(count), key=lambda p: (first[domains[p]], p))  # grouped by domain
    chosen: list[list[int]] = []
    for shift in range(1, count):
        perm = [0] * count
        for t, q in enumerate(order):
            perm[q] = order[(t + shift) % count]
        if all(domains[perm[q]] != domains[q] and all(domains[perm[q]] != domains[c[q]] for c in chosen)
               for q in range(count)):
            chosen.append(perm)
            if len(chosen) == replicas:
                return chosen
    raise CheckpointError(
        f"the local tier cannot place {replicas} replica(s) of each of {count} processes in other failure "
        f"domains (domains by process: {domains}); lower `replicas` or spread the domains"
    )


# ---------------------------------------------------------------------- shard tables (pure on shardings)


@dataclass(frozen=True)
class Piece:
    """One distinct shard of one array leaf held by a process, in the blob."""

    leaf: int  # index among the array leaves
    box: tuple[tuple[int, int], ...]  # (start, stop) per dimension
    nbytes: int
    row: int = 0  # the local device (by position) that packs it


def shard_table(shapes: list[tuple[int, ...]], dtypes: list[np.dtype], shardings: list[Any],
                process: int) -> tuple[list[Piece], list[dict[tuple[tuple[int, int], ...], list[Any]]]]:
    """The pieces of `process`'s blob, and per leaf its boxes with the devices holding each."""
    return shard_tables(shapes, dtypes, shardings, [process])[process]


Boxes = dict[tuple[tuple[int, int], ...], list[Any]]


def shard_tables(shapes: list[tuple[int, ...]], dtypes: list[np.dtype], shardings: list[Any],
                 processes: list[int]) -> dict[int, tuple[list[Piece], list[Boxes]]]:
    """`shard_table` for several processes, walking each distinct (sharding, shape)'s devices once.

    A process's pieces come grouped by the local device that packs them (the
    first, by id, holding the box), in leaf order within a device. The boxes
    per leaf are shared between leaves of one layout: callers must not change them.
    """
    procs = tuple(processes)
    groups: dict[int, dict[int, list[Piece]]] = {p: {} for p in procs}
    where: dict[int, list[Boxes]] = {p: [] for p in procs}
    for i, (shape, dtype, sharding) in enumerate(zip(shapes, dtypes, shardings)):
        itemsize = np.dtype(dtype).itemsize
        for p, (boxes, packed) in _placed(sharding, tuple(shape), procs).items():
            where[p].append(boxes)
            for row, box, elems in packed:
                groups[p].setdefault(row, []).append(Piece(i, box, elems * itemsize, row))
    return {p: ([pc for r in sorted(groups[p]) for pc in groups[p][r]], where[p]) for p in procs}


_placed_cache: Memo[dict[int, tuple[Boxes, list[tuple[int, tuple[tuple[int, int], ...], int]]]]] = Memo()


def _placed(sharding: Any, shape: tuple[int, ...], procs: tuple[int, ...],
            ) -> dict[int, tuple[Boxes, list[tuple[int, tuple[tuple[int, int], ...], int]]]]:
    """Per process: its boxes with their devices (by id), and ``(row, box, elements)`` of each
    distinct box, row being the position of the first holding device. Memoised: a local save
    asks this for every leaf at every save, and at 1,024 devices one walk of the devices costs
    milliseconds per leaf."""
    hit = _placed_cache.get((sharding, shape, procs))
    if hit is not None:
        return hit
    rows = {d: i for devs in process_devices() for i, d in enumerate(devs)}
    out: dict[int, tuple[Boxes, list[tuple[int, tuple[tuple[int, int], ...], int]]]] = {p: ({}, []) for p in procs}
    for d, box in _by_id(sharding, shape):
        mine = out.get(d.process_index)
        if mine is None:
            continue
        if box not in mine[0]:
            mine[0][box] = []
            mine[1].append((rows[d], box, int(np.prod([b - a for a, b in box], dtype=np.int64))))
        mine[0][box].append(d)
    return _placed_cache.put((sharding, shape, procs), out)


def row_lengths(pieces: list[Piece], header: int, rows: int) -> list[int]:
    """The bytes of each of a process's `rows` rows: row 0 carries the `header` bytes."""
    out = [0] * rows
    out[0] = header
    for pc in pieces:
        out[pc.row] += pc.nbytes
    return out


def layout_key(shapes: list[tuple[int, ...]], dtypes: list[np.dtype], shardings: list[Any], paths: list[str]) -> str:
    """A fingerprint of the arrays' global layout: paths, shapes, dtypes, which device holds what.

    It is the CRC-32C of ``json.dumps(["rows-by-device", [path, shape, dtype name, sorted
    (device id, process, box) triples], ...])``, built from per-(sharding, shape) pieces that
    are memoised, since every local save computes it.
    """
    parts = ['"rows-by-device"']  # blob layout 2: a step of layout 1 never matches
    for path, shape, dtype, sharding in zip(paths, shapes, dtypes, shardings):
        parts.append(f"[{json.dumps(path)}, {json.dumps(list(shape))}, {json.dumps(np.dtype(dtype).name)}, "
                     f"{_boxes_json(sharding, tuple(shape))}]")
    return f"{crc32c(('[' + ', '.join(parts) + ']').encode()):08x}"


_boxes_json_cache: Memo[str] = Memo()


def _boxes_json(sharding: Any, shape: tuple[int, ...]) -> str:
    hit = _boxes_json_cache.get((sharding, shape))
    if hit is None:
        hit = _boxes_json_cache.put((sharding, shape), json.dumps(
            [(d.id, d.process_index, [list(b) for b in box]) for d, box in _by_id(sharding, shape)]))
    return hit


def _by_id(sharding: Any, shape: tuple[int, ...]) -> list[tuple[Any, tuple[tuple[int, int], ...]]]:
    """``(device, box)`` of every device of `sharding`, by device id (from the memoised `device_boxes`)."""
    return sorted(zip(*device_boxes(sharding, shape)), key=lambda db: db[0].id)


# ---------------------------------------------------------------------- blobs


def header_bytes(header: dict[str, Any]) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    raw = _HEAD.pack(_MAGIC, len(body)) + body
    return raw + b"\0" * (-len(raw) % 8)


def read_header(blob: np.ndarray, where: str) -> tuple[dict[str, Any], int]:
    """The header of `blob` and the offset of its first shard byte."""
    raw = memoryview(blob.tobytes()) if not blob.flags.c_contiguous else memoryview(blob.data)
    if len(raw) < _HEAD.size:
        raise CorruptCheckpointError(f"{where}: a local-tier blob of {len(raw)} bytes is too short")
    magic, n = _HEAD.unpack(raw[:_HEAD.size])
    if magic != _MAGIC or _HEAD.size + n > len(raw):
        raise CorruptCheckpointError(f"{where}: not a local-tier blob (bad magic or header length {n})")
    try:
        header = json.loads(bytes(raw[_HEAD.size:_HEAD.size + n]))
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: the local-tier blob's header is not JSON ({e})") from None
    start = _HEAD.size + n
    return header, start + (-start % 8)


def pack_rows(header: bytes, pieces: list[Piece], shards: list[Any], width: int, devices: list[Any]) -> list[Any]:
    """Row j on ``devices[j]``: (row 0: `header`) then the shards device j packs, zero-padded to `width`.

    The rows are new buffers: donating or updating the shards later cannot change them.
    """
    import jax

    parts: list[list[Any]] = [[] for _ in devices]
    parts[0].append(jax.device_put(np.frombuffer(header, np.uint8), devices[0]))
    for pc, x in zip(pieces, shards):
        parts[pc.row].append(x)
    out = []
    for j, (dev, xs) in enumerate(zip(devices, parts)):
        used = sum(int(x.size) * np.dtype(x.dtype).itemsize for x in xs)
        if used > width:
            raise ValueError(f"row {j} of {used} bytes does not fit in {width}")
        out.append(_packer(len(xs), width - used)(*xs) if xs else jax.device_put(np.zeros(width, np.uint8), dev))
    return out


_packers: dict[tuple[int, int], Any] = {}


def _packer(n: int, pad: int) -> Any:
    import jax
    import jax.numpy as jnp

    key = (n, pad)
    if key not in _packers:
        def pack(*xs: Any) -> Any:
            flat = [_as_bytes(x) for x in xs]
            if pad:
                flat.append(jnp.zeros((pad,), jnp.uint8))
            return jnp.concatenate(flat)

        _packers[key] = jax.jit(pack)
    return _packers[key]


def _as_bytes(x: Any) -> Any:
    import jax
    import jax.numpy as jnp

    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype != jnp.uint8:
        x = jax.lax.bitcast_convert_type(x, jnp.uint8)  # little-endian bytes per element, last axis
    return x.reshape(-1)


def unpack(blob: np.ndarray, start: int, pieces: list[Piece], dtypes: list[np.dtype], where: str) -> list[np.ndarray]:
    """The host arrays of `pieces` from `blob` (views, no copy)."""
    out, off = [], start
    for p in pieces:
        if off + p.nbytes > blob.size:
            raise CorruptCheckpointError(f"{where}: the local-tier blob ends before its shards do")
        dt = np.dtype(dtypes[p.leaf])
        raw = blob[off:off + p.nbytes]
        arr = raw.view(np.uint8) if dt == np.bool_ else raw.view(dt.newbyteorder("<"))
        if dt == np.bool_:
            arr = arr.astype(np.bool_)
        out.append(arr.reshape(tuple(b - a for a, b in p.box)))
        off += p.nbytes
    return out


# ---------------------------------------------------------------------- the transport


def process_devices(count: int | None = None) -> list[list[Any]]:
    """Each process's devices, by id; all processes must have as many."""
    import jax

    by: dict[int, list[Any]] = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        by.setdefault(d.process_index, []).append(d)
    if count is not None and sorted(by) != list(range(count)):
        raise CheckpointError(f"the local tier needs devices on every one of {count} processes; found {sorted(by)}")
    if len({len(v) for v in by.values()}) > 1:
        raise CheckpointError("the local tier needs the same number of devices on every process; found "
                              + ", ".join(f"process {p}: {len(v)}" for p, v in sorted(by.items())))
    return [by[p] for p in sorted(by)]


_movers: dict[tuple[Any, ...], Any] = {}


def send_rows(rows: list[Any], length: int, dest: list[int], me: int) -> list[Any]:
    """Send this process's `rows` (a uint8 vector of `length` on each of its devices, in order)
    to the same devices of process ``dest[me]``; return the rows that arrive here (from the q
    with ``dest[q] == me``), on the same devices.

    Every process calls it with the same `length` and `dest` (a permutation).
    """
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    count = len(dest)
    devs = process_devices(count)
    per = len(devs[0])
    flat = [d for ds in devs for d in ds]
    mesh = Mesh(np.array(flat), ("d",))
    key = (tuple(dest), tuple(d.id for d in flat))
    if key not in _movers:
        pairs = [(q * per + j, dest[q] * per + j) for q in range(count) if dest[q] != q for j in range(per)]
        smap: Any = getattr(jax, "shard_map", None)
        if smap is None:  # older JAX
            from jax.experimental.shard_map import shard_map as smap
        _movers[key] = jax.jit(smap(lambda x: jax.lax.ppermute(x, "d", pairs), mesh=mesh,
                                         in_specs=P("d"), out_specs=P("d")))
    glob = jax.make_array_from_single_device_arrays((count * per, length), NamedSharding(mesh, P("d")),
                                                    [r.reshape(1, length) for r in rows])
    out = _movers[key](glob)
    got = {s.device: s.data for s in out.addressable_shards}
    return [got[d].reshape(length) for d in devs[me]]


def send_bytes(data: np.ndarray, width: int, dest: list[int], me: int) -> np.ndarray:
    """Host bytes `data` (at most `width`) to process ``dest[me]``, spread over all devices;
    the `width` bytes that arrive here (pad included)."""
    import jax

    devs = process_devices(len(dest))[me]
    per = -(-width // len(devs))
    buf = np.zeros(per * len(devs), np.uint8)
    buf[:data.size] = data
    rows = jax.device_put([buf[j * per:(j + 1) * per] for j in range(len(devs))], devs)
    got = send_rows(rows, per, dest, me)
    return np.concatenate([np.asarray(r) for r in got])[:width]
