"""Peer replicas for the local tier: where each process's copies go, and how bytes get there.

Placement is pure: processes are ordered by failure domain, and replica k of
process q goes to the process a fixed shift further along that order. A shift
is a permutation of the processes, so every process sends one row and
receives one row per replica, and the shifts are chosen so that a process's
copies sit in domains other than its own and other than each other's.

The transport is XLA's: each process contributes one row (a uint8 vector on
its first local device) of a global ``(processes, length)`` array, and a
``ppermute`` under ``shard_map`` moves row q to the process holding it. It is
called on the main thread, like any collective, by every process with the
same arguments.

Process blobs are packed here too: a small JSON header (the step, the
process and the host values) followed by the raw little-endian bytes of the
process's distinct array shards, in an order every process derives from the
shardings alone (`shard_table`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._checksum import crc32c
from ._errors import CheckpointError, CorruptCheckpointError
from ._jaxutil import slices_to_box

_MAGIC = b"CAIRNLT1"
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


def shard_table(shapes: list[tuple[int, ...]], dtypes: list[np.dtype], shardings: list[Any],
                process: int) -> tuple[list[Piece], list[dict[tuple[tuple[int, int], ...], list[Any]]]]:
    """The pieces of `process`'s blob, and per leaf its boxes with the devices holding each."""
    return shard_tables(shapes, dtypes, shardings, [process])[process]


def shard_tables(shapes: list[tuple[int, ...]], dtypes: list[np.dtype], shardings: list[Any],
                 processes: list[int]) -> dict[int, tuple[list[Piece], list[dict[tuple[tuple[int, int], ...], list[Any]]]]]:
    """`shard_table` for several processes, walking each leaf's devices once."""
    out: dict[int, tuple[list[Piece], list[dict[Any, list[Any]]]]] = {p: ([], []) for p in processes}
    for i, (shape, dtype, sharding) in enumerate(zip(shapes, dtypes, shardings)):
        devs: dict[int, dict[tuple[tuple[int, int], ...], list[Any]]] = {p: {} for p in processes}
        for d, index in sorted(sharding.devices_indices_map(shape).items(), key=lambda kv: kv[0].id):
            mine = devs.get(d.process_index)
            if mine is None:
                continue
            box = tuple((int(a), int(b)) for a, b in slices_to_box(index, shape))
            if box not in mine:
                mine[box] = []
                n = int(np.prod([b - a for a, b in box], dtype=np.int64)) * np.dtype(dtype).itemsize
                out[d.process_index][0].append(Piece(i, box, n))
            mine[box].append(d)
        for p in processes:
            out[p][1].append(devs[p])
    return out


def layout_key(shapes: list[tuple[int, ...]], dtypes: list[np.dtype], shardings: list[Any], paths: list[str]) -> str:
    """A fingerprint of the arrays' global layout: paths, shapes, dtypes, which device holds what."""
    desc = []
    for path, shape, dtype, sharding in zip(paths, shapes, dtypes, shardings):
        boxes = sorted((d.id, d.process_index, [list(b) for b in slices_to_box(ix, shape)])
                       for d, ix in sharding.devices_indices_map(shape).items())
        desc.append([path, list(shape), np.dtype(dtype).name, boxes])
    return f"{crc32c(json.dumps(desc).encode()):08x}"


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


def pack_on_device(header: bytes, shards: list[Any], length: int, device: Any) -> Any:
    """One uint8 vector of `length` bytes on `device`: `header`, the shards' bytes, zero padding.

    The result is a new buffer: donating or updating the shards later cannot change it.
    """
    import jax

    parts = [jax.device_put(np.frombuffer(header, np.uint8), device)]
    parts += [jax.device_put(s, device) for s in shards]
    used = len(header) + sum(int(s.size) * np.dtype(s.dtype).itemsize for s in shards)
    if used > length:
        raise ValueError(f"blob of {used} bytes does not fit in {length}")
    return _packer(len(parts), length - used)(*parts)


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


def first_devices(count: int) -> list[Any]:
    import jax

    firsts: dict[int, Any] = {}
    for d in jax.devices():
        if d.process_index not in firsts or d.id < firsts[d.process_index].id:
            firsts[d.process_index] = d
    if sorted(firsts) != list(range(count)):
        raise CheckpointError(f"the local tier needs devices on every one of {count} processes; found {sorted(firsts)}")
    return [firsts[p] for p in range(count)]


_movers: dict[tuple[Any, ...], Any] = {}


def send_rows(row: Any, length: int, dest: list[int], me: int) -> Any:
    """Send this process's `row` (a uint8 vector of `length` on its first device) to ``dest[me]``;
    return the row that arrives here (from the q with ``dest[q] == me``), on the same device.

    Every process calls it with the same `length` and `dest` (a permutation).
    """
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    count = len(dest)
    devs = first_devices(count)
    mesh = Mesh(np.array(devs), ("p",))
    key = (tuple(dest), tuple(d.id for d in devs))
    if key not in _movers:
        pairs = [(q, dest[q]) for q in range(count) if dest[q] != q]
        smap: Any = getattr(jax, "shard_map", None)
        if smap is None:  # older JAX
            from jax.experimental.shard_map import shard_map as smap
        _movers[key] = jax.jit(smap(lambda x: jax.lax.ppermute(x, "p", pairs), mesh=mesh,
                                         in_specs=P("p"), out_specs=P("p")))
    local = row.reshape(1, length)
    glob = jax.make_array_from_single_device_arrays((count, length), NamedSharding(mesh, P("p")), [local])
    out = _movers[key](glob)
    return out.addressable_shards[0].data.reshape(length)
