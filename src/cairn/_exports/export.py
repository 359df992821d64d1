"""Export a cairn checkpoint as sharded Hugging Face safetensors, from many processes at once.

The layout is Hugging Face's: tensors in checkpoint order, packed into files
of at most `max_shard_size` bytes (a larger tensor gets a file of its own),
named ``model-00001-of-00003.safetensors``, plus ``model.safetensors.index.json``
mapping every tensor name to its file (one file only: ``model.safetensors``,
no index). Every process computes the same packing and the same assignment
of files to processes from the checkpoint's index alone (largest files
first, each to the process with the fewest bytes so far), so nobody talks
before writing. Each process streams its files slab by slab, reading through
the load planner with checksums verified, and writes each through the
commit strategy's `write_whole`, so a file appears only complete. Then every
process publishes its status through the `Coordinator`; process 0 waits for
all of them and writes the index last, and everyone learns the outcome.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .._core.buffers import as_view
from .._core.stats import Progress
from .._dist.agree import sequence, settle
from .._dist.coord import Coordinator, default_coordinator
from .._errors import (
    CheckpointError,
    CheckpointExistsError,
    CoordinationError,
    UnsupportedTypeError,
    error_from_record,
    error_record,
)
from .._format import manifest as fmt
from .._format import values
from .._load.reader import DEFAULT_BUDGET, iter_array, make_reader, slab_bytes
from .._load.source import open_checkpoint
from .._save.commit import strategy_for
from .._sources.base import Rename, compile_rename, join_name, unmatched_rules
from .._storage.location import resolve
from .._tree.perprocess import check_export_choice, export_leaf_path, nodes_of, refuse_per_process
from .._tree.pytree import display_path, escape_key
from .safetensors import TO_ST, _st_header, check_names, refuse_several, tensor_item, tensor_items

log = logging.getLogger("cairn")

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(size: int | str) -> int:
    """A shard size as Hugging Face writes it: ``5GB`` (10^9), ``500MiB`` (2^20), or bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*", str(size).lower())
        if not m or m.group(2) not in _UNITS:
            raise ValueError(f"not a size: {size!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n < 1:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return n


@dataclass(frozen=True)
class _Tensor:
    name: str  # the safetensors tensor name
    item: str
    leaf: fmt.ArrayLeaf


PRNG_KEYS = ("error", "data", "drop")


def _tensors(ck: Any, item: str | None, rename: Rename | None, names: str = "hf",
             prng_keys: str = "error", per_process: str = "keys", all_items: bool = False) -> list[_Tensor]:
    fn = compile_rename(rename)
    if item is not None and item not in ck.manifest.items:
        raise CheckpointError(f"{ck.loc.path} has no checkpointable {item!r} (it has {sorted(ck.manifest.items)})")
    items = [item] if item is not None else list(ck.manifest.items)
    kinds = ("array", "prng_key") if prng_keys == "data" else ("array",)
    prefix = not ck.manifest.root and item is None and not (names == "hf" and tensor_item(
        ck, kinds, per_process=per_process != "drop") is not None)
    out: list[_Tensor] = []
    seen: dict[str, str] = {}
    for it in items:
        nodes = nodes_of(ck.indexes[it].structure)
        for leaf in ck.indexes[it].leaves:
            if not isinstance(leaf, fmt.ArrayLeaf) or leaf.kind not in ("array", "prng_key"):
                continue  # values, bytes and objects have no place in safetensors
            under = export_leaf_path(nodes, leaf.path)
            if under is not None:  # a PerProcess value's array: named by the process that saved it
                if per_process == "drop":
                    log.info("cairn: export of %s leaves out the per-process array %r", ck.loc.path,
                             display_path(under[1], it))
                    continue
                refuse_per_process(nodes, ck.loc.path, it, per_process)
            lpath = under[1] if under is not None else leaf.path
            path = f"{escape_key(it)}/{lpath}" if prefix and lpath else escape_key(it) if prefix else lpath
            new = fn(path) if fn is not None else path
            if new is None:
                continue
            if leaf.kind == "prng_key" and prng_keys != "data":
                if prng_keys == "drop":
                    log.info("cairn: export of %s leaves out the PRNG key %r", ck.loc.path, path)
                    continue
                raise UnsupportedTypeError(
                    f"{ck.loc.path}: leaf {display_path(leaf.path, it)!r} is a typed PRNG key ({leaf.impl}), which "
                    "safetensors cannot hold; prng_keys='data' (--prng-keys data) writes its uint32 key data, "
                    "'drop' leaves it out (or rename it to None, or export one item=)")
            if TO_ST.get(values.dtype_name(leaf.dtype) or "") is None:
                raise UnsupportedTypeError(f"{ck.loc.path}: leaf {path!r} has dtype {leaf.dtype}, "
                                           "which safetensors cannot hold")
            name = (new or "%root") if names == "raw" else join_name(new) or "%root"
            if name in seen:
                raise CheckpointError(f"{ck.loc.path}: leaves {seen[name]!r} and {path!r} both become "
                                      f"tensor {name!r}" + ("; names='raw' keeps key paths apart"
                                                            if names == "hf" else ""))
            seen[name] = path
            out.append(_Tensor(name, it, leaf))
    if prefix and names == "hf" and not all_items:
        refuse_several(ck.loc.path, tensor_items(ck, kinds, per_process=per_process != "drop"))
    unmatched = unmatched_rules(fn)
    if unmatched:
        some = ", ".join(repr(t) for t in list(seen.values())[:3])
        raise CheckpointError(
            f"{ck.loc.path}: rename rule{'s' if len(unmatched) > 1 else ''} {', '.join(unmatched)} matched no "
            f"tensor's key path (they look like {some}{', ...' if len(seen) > 3 else ''}); an export with a "
            "rule that renames nothing would write names the model does not expect. Fix or remove the rule "
            "(`cairn inspect` lists the key paths)")
    return out


def pack(sizes: list[int], limit: int) -> list[list[int]]:
    """Hugging Face's packing: in order, a new file when the next tensor would overflow this one."""
    shards: list[list[int]] = []
    used = 0
    for i, n in enumerate(sizes):
        if shards and used + n <= limit:
            shards[-1].append(i)
            used += n
        else:
            shards.append([i])
            used = n
    return shards


def assign(sizes: list[int], processes: int) -> list[int]:
    """The process that writes each file: largest first, to the least loaded (ties: lowest index)."""
    load = [0] * processes
    owner = [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        p = min(range(processes), key=lambda q: (load[q], q))
        owner[k] = p
        load[p] += sizes[k]
    return owner


def export_safetensors(
    path: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    item: str | None = None,
    rename: Rename | None = None,
    names: str = "hf",
    prng_keys: str = "error",
    per_process: str = "keys",
    all_items: bool = False,
    overwrite: bool = False,
    budget_bytes: int = DEFAULT_BUDGET,
    threads: int = 4,
    storage_options: dict[str, Any] | None = None,
    coordinator: Coordinator | None = None,
    timeout: float = 1800.0,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> list[str]:
    """Write checkpoint `path` as a Hugging Face safetensors folder `dst`; returns its files.

    Every process of a multi-process program calls it with the same
    arguments; the files are shared out among them (each writes whole files,
    reading only their tensors), and ``model.safetensors.index.json`` is
    written last, by process 0, once every file is complete. The result loads
    with ``safetensors`` and with ``transformers``' ``from_pretrained`` (add
    the model's ``config.json``).

    Tensor names (``names="hf"``, the default) are key paths joined with '.'
    as Hugging Face names them (``transformer.h.0.attn.weight``; a key
    ``"0.weight"`` stays whole), without the checkpointable's name when
    `item` picks one checkpointable, the state was not a mapping, or only
    one checkpointable holds arrays (``{"params": ..., "step": 3}`` exports
    ``params``' names bare). Where several hold arrays (``params`` and
    ``opt``) the export is refused (a `CheckpointError` naming them), since a
    model would find none of its weights under ``params.``: pass `item`, or
    ``all_items=True`` to write every checkpointable's arrays, its name
    first. ``names="raw"`` writes cairn's '/'-joined key paths,
    checkpointable first. `rename` maps the '/'-joined key path the name is
    made from, as in `cairn.load` (None drops a tensor); a
    ``(regex, replacement)`` rule that matches no exported tensor's key path
    is a `CheckpointError` naming it. Only arrays
    are written: scalars, strings and bytes leaves have no place in
    safetensors and are left out. A typed PRNG key is an
    `UnsupportedTypeError` unless ``prng_keys="data"`` (its uint32 key data,
    the implementation recorded in the header's ``__metadata__``) or
    ``"drop"``. The arrays of a `cairn.PerProcess` value are written for
    every process that saved one, named by it: ``data.process_1.window``
    is process 1's ``window`` (the key path `rename` sees is
    ``data/process_1/window``), whichever processes export;
    ``per_process="drop"`` leaves them out (and they no longer count as a
    checkpointable's arrays for the names), ``"error"`` refuses them
    (`UnsupportedTypeError` naming the leaf). `max_shard_size` follows
    Hugging Face (``"5GB"`` is 5*10^9 bytes, ``"5GiB"`` 5*2^30).

    `on_total(n)` gets the bytes of tensor data this process writes, `progress(n)` each `n` of
    them written; listeners added with ``progress=True`` (`cairn.add_listener`) get
    ``"export_safetensors"`` events (a `ProgressStats`) as it goes.

    Example:

        cairn.export_safetensors("/ckpt/step_100", "/export/hf", item="params",
                                 rename=[(r"^", "model/")], max_shard_size="2GB")
    """
    limit = parse_size(max_shard_size)
    check_names(names)
    if prng_keys not in PRNG_KEYS:
        raise ValueError(f"prng_keys must be one of {', '.join(PRNG_KEYS)}, got {prng_keys!r}")
    check_export_choice(per_process)
    coord = coordinator or default_coordinator()
    me, n = coord.process_index, coord.process_count
    seq = sequence("export")
    out = resolve(dst, storage_options)
    tracker = Progress("export_safetensors", os.fspath(dst))
    on_total, progress = tracker.wrap(on_total, progress)
    base = f"cairn/export/{seq}"
    status: dict[str, Any] = {"ok": True}
    own_error: BaseException | None = None
    tensors: list[_Tensor] = []
    shards: list[list[int]] = []
    files: list[str] = []
    try:  # a failure anywhere, planning included, is published: nobody waits for this process in vain
        ck = open_checkpoint(path, storage_options)
        tensors = _tensors(ck, item, rename, names, prng_keys, per_process, all_items)
        if not tensors:
            raise CheckpointError(f"{ck.loc.path}: no arrays to export")
        shards = pack([t.leaf.nbytes for t in tensors], limit)
        files = [SINGLE] if len(shards) == 1 else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                                                     for k in range(len(shards))]
        owner = assign([sum(tensors[i].leaf.nbytes for i in s) for s in shards], n)
        if not overwrite and (out.storage.exists(out.key(INDEX)) or out.storage.exists(out.key(SINGLE))):
            raise CheckpointExistsError(f"{out.path} already holds safetensors; pass overwrite=True to replace them")
        mine = [k for k in range(len(shards)) if owner[k] == me]
        on_total(sum(tensors[i].leaf.nbytes for k in mine for i in shards[k]))
        _write(ck, out, [[tensors[i] for i in shards[k]] for k in mine], [files[k] for k in mine],
               budget_bytes, threads, progress)
    except BaseException as e:
        own_error = e
        status = {"ok": False, "error": error_record(e, me)}
    try:
        outcome = settle(coord, f"{base}/status", status, timeout, finish=lambda _: _finish(out, tensors, shards, files),
                         forget=f"cairn/export/{seq - 1}" if seq > 0 else None)
    except CoordinationError as e:  # this process did not hear the primary
        if own_error is not None:
            raise own_error from e
        raise type(e)(f"exporting {os.fspath(path)} to {out.path}: {e}") from e
    if own_error is not None:
        raise own_error  # its own error is the most precise a process can raise
    if not outcome["ok"]:
        error = error_from_record(outcome["error"], f"exporting {os.fspath(path)} to {out.path} failed: "
                                                    f"{outcome['message']}")
        raise error
    tracker.finish()
    return [out.storage.describe(out.key(name)) for name in ([*files, INDEX] if len(files) > 1 else files)]


def _write(ck: Any, out: Any, files: list[list[_Tensor]], names: list[str], budget: int, threads: int,
           progress: Callable[[int], None] | None) -> None:
    slab = slab_bytes(budget)
    strategy = strategy_for(out.storage)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="cairn-export") as pool:
        readers = {it: make_reader(ck, it, pool) for it in {t.item for f in files for t in f}}
        try:
            for group, name in zip(files, names):
                entries = [(t.name, TO_ST[values.dtype_name(t.leaf.dtype) or ""], t.leaf.shape, t.leaf.nbytes)
                           for t in group]
                keys = {t.name: t.leaf.impl for t in group if t.leaf.kind == "prng_key"}
                header = _st_header(entries, {"format": "pt", **(
                    {"cairn.prng_keys": json.dumps(keys, separators=(",", ":"))} if keys else {})})

                def parts(group: list[_Tensor] = group, header: bytes = header) -> Any:
                    yield header
                    for t in group:
                        for arr in iter_array(readers[t.item], t.leaf, slab, pool):
                            nbytes = arr.nbytes
                            yield as_view(arr.reshape(-1).view("uint8"))
                            del arr
                            if progress is not None:
                                progress(nbytes)

                strategy.write_whole(out.key(name), parts())
        finally:
            for r in readers.values():
                r.close()


def _finish(out: Any, tensors: list[_Tensor], shards: list[list[int]], names: list[str]) -> None:
    """Process 0, once every process has written its shards: the index (sharded exports only)."""
    if len(names) > 1:
        weight_map = {tensors[i].name: names[k] for k, s in enumerate(shards) for i in s}
        index = {"metadata": {"total_size": sum(t.leaf.nbytes for t in tensors)},
                 "weight_map": dict(sorted(weight_map.items()))}
        out.storage.put(out.key(INDEX), json.dumps(index, indent=2).encode())
    _remove_stale(out, set(names))


def _remove_stale(out: Any, names: set[str]) -> None:
    """Shards of an earlier export that the new index does not name (overwrite only)."""
    pattern = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
    for name in out.storage.list_dir(out.name):
        if pattern.match(name) and name not in names:
            out.storage.delete_prefix(out.key(name))
    if len(names) == 1 and out.storage.exists(out.key(INDEX)):
        out.storage.delete_prefix(out.key(INDEX))
