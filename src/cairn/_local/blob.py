"""A process's state as a local-tier blob and back: which leaves are arrays, how host values
travel (in the blob's header), and how a restored process's shards become its arrays again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import CheckpointError, CorruptCheckpointError, MismatchError, UnsupportedTypeError
from .._format.values import decode_value, dtype_from_name, dtype_name, encode_value, value_kind
from .._tree.leaves import is_jax_array
from .._tree.perprocess import PerProcess
from .._tree.pytree import display_path, flatten, join_path, map_with_path, unflatten
from .replicas import Piece, layout_key, read_header, shard_table, unpack


def split(state: Any, where: str) -> tuple[list[str], list[Any], dict[str, Any]]:
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
            values[path] = encode(path, x, where)

    map_with_path(visit, state)
    order = sorted(range(len(paths)), key=paths.__getitem__)  # by key path: the order a target gives too
    return [paths[i] for i in order], [arrays[i] for i in order], values


def encode(path: str, x: Any, where: str) -> Any:
    if isinstance(x, PerProcess):  # this process's own value: each blob's header holds its process's
        structure, leaves = flatten(x.value)
        return {"k": "perprocess", "structure": structure,
                "leaves": [encode(join_path(path, p), v, where) for p, v in leaves]}
    kind = value_kind(x)
    if kind is not None:
        return {"k": kind, "v": encode_value(kind, x)}
    if isinstance(x, np.ndarray) and dtype_name(x.dtype) is not None:
        le = np.ascontiguousarray(x).astype(x.dtype.newbyteorder("<"), copy=False)
        return {"k": "ndarray", "dtype": dtype_name(x.dtype), "shape": list(x.shape), "hex": le.tobytes().hex()}
    if isinstance(x, (bytes, bytearray)):
        return {"k": "bytes", "hex": bytes(x).hex()}
    raise UnsupportedTypeError(f"{where}: leaf {display_path(path)!r} has type {type(x).__qualname__}; the local "
                               "tier stores jax.Arrays, numpy arrays, bytes, numbers, strings and PerProcess "
                               "values of those")


def decode(v: Any, where: str) -> Any:
    if v["k"] == "perprocess":
        return PerProcess(unflatten(v["structure"], [decode(x, where) for x in v["leaves"]]))
    if v["k"] == "ndarray":
        dt = dtype_from_name(v["dtype"], f"{where}: ")
        return np.frombuffer(bytes.fromhex(v["hex"]), dt.newbyteorder("<")).astype(dt).reshape(v["shape"])
    if v["k"] == "bytes":
        return bytes.fromhex(v["hex"])
    return decode_value(v["k"], v["v"], where)


def shard_data(x: Any, box: tuple[tuple[int, int], ...]) -> Any:
    from .._tree.shardings import slices_to_box

    for s in sorted(x.addressable_shards, key=lambda s: s.device.id):
        if tuple(slices_to_box(s.index, tuple(x.shape))) == box:
            return s.data
    raise CheckpointError(f"no addressable shard with box {box}")  # shard_table lists only local boxes


def target_arrays(target: Any) -> tuple[list[str], list[Any]]:
    paths, leaves = [], []

    def visit(path: str, x: Any) -> None:
        if getattr(x, "sharding", None) is not None and getattr(x, "shape", None) is not None:
            paths.append(path)
            leaves.append(x)

    map_with_path(visit, target)
    order = sorted(range(len(paths)), key=paths.__getitem__)
    return [paths[i] for i in order], [leaves[i] for i in order]


def target_layout(target: Any, where: str) -> str | None:
    if target is None:
        return None
    paths, leaves = target_arrays(target)
    return layout_key([tuple(x.shape) for x in leaves], [np.dtype(x.dtype) for x in leaves],
                      [x.sharding for x in leaves], paths)


def own_pieces(target: Any, blob: np.ndarray | None, step: int, me: int, layout: str | None, where: str
               ) -> tuple[list[np.ndarray], dict[str, Any]]:
    """The host arrays of this process's target pieces from its own saved blob, and the host values."""
    if blob is None:
        raise CorruptCheckpointError(f"{where}: no blob of process {me} arrived")
    header, start = read_header(blob, where)
    if (header.get("step"), header.get("process"), header.get("layout")) != (step, me, layout):
        raise CorruptCheckpointError(f"{where}: the blob is of step {header.get('step')} process "
                                     f"{header.get('process')}, not step {step} process {me}")
    pieces, _ = target_table(target, me)
    _, leaves = target_arrays(target)
    return unpack(blob, start, pieces, [np.dtype(x.dtype) for x in leaves], where), header.get("values", {})


def target_table(target: Any, me: int) -> tuple[list[Piece], list[dict[Any, list[Any]]]]:
    """This process's pieces of `target`, and per leaf its boxes with the devices holding each."""
    _, leaves = target_arrays(target)
    return shard_table([tuple(x.shape) for x in leaves], [np.dtype(x.dtype) for x in leaves],
                       [x.sharding for x in leaves], me)


def assemble(target: Any, hosts: list[np.ndarray], me: int, values: dict[str, Any], where: str,
             resolved: dict[str, Any] | None = None) -> Any:
    """`target` filled: its arrays from this process's piece arrays `hosts`, its host values from
    `values` (encoded) or `resolved` (decoded already)."""
    import jax

    paths, leaves = target_arrays(target)
    pieces, placed = target_table(target, me)
    xs, devs, owner = [], [], []
    for p, host in zip(pieces, hosts):
        for d in placed[p.leaf][p.box]:
            xs.append(host)
            devs.append(d)
            owner.append(p.leaf)
    per_leaf: list[list[Any]] = [[] for _ in leaves]
    for leaf, arr in zip(owner, jax.device_put(xs, devs)):  # one batched transfer
        per_leaf[leaf].append(arr)
    built = {path: jax.make_array_from_single_device_arrays(tuple(leaves[i].shape), leaves[i].sharding, per_leaf[i])
             for i, path in enumerate(paths)}

    def fill(path: str, x: Any) -> Any:
        if path in built:
            return built[path]
        if resolved is not None and path in resolved:
            got = resolved[path]
        elif path in values:
            got = decode(values[path], where)
        else:
            raise MismatchError(f"{where}: the target's leaf {display_path(path)!r} is not in the local step")
        if isinstance(got, PerProcess):  # as the persistent tier does: a PerProcess where the target has one
            return PerProcess(got.value, x.reshard) if isinstance(x, PerProcess) else got.value
        return got

    return map_with_path(fill, target)


def missing_values(target: Any, values: dict[str, Any]) -> list[str]:
    """The target's host-value leaves (not arrays) that `values` lacks."""
    arrays = set(target_arrays(target)[0])
    out: list[str] = []

    def visit(path: str, x: Any) -> None:
        if path not in arrays and path not in values:
            out.append(display_path(path))

    map_with_path(visit, target)
    return out
