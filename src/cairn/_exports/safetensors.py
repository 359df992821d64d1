"""Streaming conversion between cairn and safetensors, both ways.

Every conversion moves one bounded slab of one array at a time: arrays are
read (from cairn: through the load planner, with checksums verified; from
safetensors: by ranged reads) in C-order slabs of at most a quarter of the
memory budget, and each slab is written out before the next is read. So the
whole state is never in memory, whatever its size.

A cairn checkpoint holds more than tensors (the tree's containers, ints,
strings, bytes), which safetensors cannot. Converting to safetensors records
all of that as JSON under the header's ``__metadata__["cairn"]``, so that
converting back rebuilds the checkpoint exactly; a safetensors file without
it (from another tool) becomes a checkpoint holding one flat dict.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._core.buffers import as_view
from .._core.stats import Progress
from .._errors import CheckpointError, UnsupportedTypeError
from .._format import manifest as fmt
from .._format import values
from .._load.reader import DEFAULT_BUDGET, ChunkReader, iter_array, make_reader, slab_bytes
from .._load.source import open_checkpoint
from .._save.commit import strategy_for
from .._save.stream import StreamWriter
from .._sources.base import join_name
from .._sources.stfile import ST_FORMAT, ST_METADATA_KEY, TO_ST, items_of_st, open_st_file
from .._storage.location import resolve
from .._tree.perprocess import export_leaf_path, nodes_of
from .._tree.pytree import display_path, escape_key

SINGLE_FILE = "model.safetensors"  # the file of a one-file export into a folder  # what the safetensors reference implementation accepts


# ---------------------------------------------------------------------- safetensors header


#: How tensors are named: "hf" (Hugging Face's dotted names) or "raw" (cairn's '/'-joined key paths).
NAMES = ("hf", "raw")


def check_names(names: str) -> None:
    if names not in NAMES:
        raise ValueError(f"names must be 'hf' (dotted, as Hugging Face names tensors) or 'raw' (cairn's "
                         f"'/'-joined key paths), got {names!r}")


def tensor_item(ck: Any, kinds: tuple[str, ...], per_process: bool = True) -> str | None:
    """The one checkpointable holding tensors (leaves of `kinds`), if exactly one does; else None.

    HF names leave it out: ``cairn.save(p, {"params": hf_tree, "step": 3})``
    exports ``transformer.h.0.attn.weight``, not ``params.transformer...``.
    Without `per_process`, a `cairn.PerProcess` value's arrays (left out of the
    export) do not count.
    """
    holders = tensor_items(ck, kinds, per_process)
    return holders[0] if len(holders) == 1 and not ck.manifest.root else None


def tensor_items(ck: Any, kinds: tuple[str, ...], per_process: bool = True) -> list[str]:
    """The checkpointables holding tensors (leaves of `kinds`; see `tensor_item`)."""

    def holds(index: fmt.ItemIndex) -> bool:
        nodes = {} if per_process else nodes_of(index.structure)
        return any(isinstance(leaf, fmt.ArrayLeaf) and leaf.kind in kinds
                   and (not nodes or export_leaf_path(nodes, leaf.path) is None) for leaf in index.leaves)

    return [n for n, index in ck.indexes.items() if holds(index)]


def refuse_several(where: str, holders: list[str]) -> None:
    """Several checkpointables hold arrays and nothing said how to name them: Hugging Face names
    would start with the checkpointable's ("params.", "opt."), under which no model finds its weights."""
    if len(holders) < 2:
        return
    raise CheckpointError(
        f"{where}: checkpointables {', '.join(map(repr, holders))} all hold arrays, so the tensor names "
        f"would start with theirs ({', '.join(repr(h + '.') for h in holders[:2])}...), and a model loading "
        f"them (from_pretrained) would find none of its weights. Pass item={holders[0]!r} (--item "
        f"{holders[0]}) to export one, or all_items=True (--all-items) to write all of them, each name after "
        "its checkpointable's (right where they are the model's own top-level names, as 'model' and "
        "'lm_head' are in a Hugging Face state dict saved as it is)")


def tensor_name(item: str, path: str, prefix: bool, names: str) -> str:
    """A leaf's tensor name: its key path, after its checkpointable's name when `prefix`.

    ``names="hf"`` joins the components with '.' (unescaped: a key ``"0.weight"``
    stays as it is); ``"raw"`` keeps cairn's '/'-joined, escaped key path.
    """
    full = (f"{escape_key(item)}/{path}" if path else escape_key(item)) if prefix else path
    if names == "raw":
        return full or "%root"
    return join_name(full) or "%root"


def _flat_name(item: str, path: str, root: bool, per_item: bool, names: str = "raw", single: bool = False) -> str:
    return tensor_name(item, path, not (root or per_item or single), names)


def _st_header(entries: list[tuple[str, str, tuple[int, ...], int]], meta: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": meta}
    off = 0
    for name, st_dtype, shape, nbytes in entries:
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keeps the tensor data 8-byte aligned, as the reference writer does
    return struct.pack("<Q", len(raw)) + raw


# ---------------------------------------------------------------------- cairn -> safetensors


def _item_meta(index: fmt.ItemIndex, names: list[str | None]) -> dict[str, Any]:
    leaves = []
    for leaf, name in zip(index.leaves, names):
        if isinstance(leaf, fmt.ArrayLeaf):
            e: dict[str, Any] = {"path": leaf.path, "kind": leaf.kind, "tensor": name}
            if leaf.handler is not None:
                e["handler"] = leaf.handler
            if leaf.impl is not None:
                e["impl"], e["impl_shape"] = leaf.impl, list(leaf.impl_shape)
        else:
            e = {"path": leaf.path, "kind": leaf.kind, "value": values.encode_value(leaf.kind, leaf.value)}
        leaves.append(e)
    return {"structure": index.structure, "leaves": leaves}


def to_safetensors(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    per_item: bool = False,
    names: str = "hf",
    item: str | None = None,
    all_items: bool = False,
    budget_bytes: int = DEFAULT_BUDGET,
    threads: int = 4,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> list[str]:
    """Write checkpoint `src` as one safetensors file `dst` (or, with `per_item`, a
    folder `dst` holding ``<checkpointable>.safetensors`` files); returns the files written.

    A `dst` whose name does not end in ``.safetensors`` is a folder: the file
    is ``dst/model.safetensors``, the name Hugging Face and `cairn.load` look
    for in a folder.

    Tensor names (`names`): ``"hf"`` joins key paths with '.', as Hugging Face
    names tensors, bare when one checkpointable holds tensors (or `per_item`);
    where several do, a `CheckpointError` names them unless `item` picks one
    or `all_items` writes them all, each name after its checkpointable's.
    ``"raw"`` writes cairn's '/'-joined key paths, checkpointable first.
    Either converts back exactly. `item` writes that checkpointable only,
    its key paths bare. The arrays of a
    `cairn.PerProcess` value are named by the process that saved them
    (``data.process_1.window``); the cairn tree in the header keeps them
    per process, so converting back gives the per-process value again.

    `on_total(n)` gets the bytes of array data to write, `progress(n)` each `n` of them written;
    listeners added with ``progress=True`` get ``"export_safetensors"`` progress events.
    """
    check_names(names)
    ck = open_checkpoint(src, storage_options)
    root = ck.manifest.root
    if item is not None and (root or item not in ck.manifest.items):
        raise CheckpointError(f"{ck.loc.path} has no checkpointable {item!r} (it has {sorted(ck.manifest.items)})")
    single = item is not None or (names == "hf" and tensor_item(ck, fmt.ARRAY_KINDS) is not None)
    if names == "hf" and not (single or per_item or root or all_items):
        refuse_several(ck.loc.path, tensor_items(ck, fmt.ARRAY_KINDS))
    groups = [[item]] if item is not None else [[n] for n in ck.manifest.items] if per_item and not root else [
        list(ck.manifest.items)]
    out_loc = resolve(dst, storage_options)
    tracker = Progress("export_safetensors", os.fspath(dst))
    on_total, progress = tracker.wrap(on_total, progress)
    on_total(sum(leaf.nbytes for g in groups for it in g for leaf in ck.indexes[it].leaves
                 if isinstance(leaf, fmt.ArrayLeaf)))
    written = []
    slab = slab_bytes(budget_bytes)
    for group in groups:
        if per_item and not root:
            key = out_loc.key(fmt.item_dirname(group[0]) + ".safetensors")
        elif not out_loc.name.endswith(".safetensors"):
            key = out_loc.key(SINGLE_FILE)  # a folder, read back as one (by cairn and by from_pretrained)
        else:
            key = out_loc.name
        entries, plan, items_meta = [], [], {}
        for it in group:
            index = ck.indexes[it]
            nodes = nodes_of(index.structure)
            tnames: list[str | None] = []
            for leaf in index.leaves:
                if not isinstance(leaf, fmt.ArrayLeaf):
                    tnames.append(None)
                    continue
                st = TO_ST.get(values.dtype_name(leaf.dtype) or "")
                if st is None:
                    raise UnsupportedTypeError(
                        f"{ck.loc.path} [{it}]: leaf {display_path(leaf.path)!r} has dtype {leaf.dtype}, "
                        "which safetensors cannot hold"
                    )
                under = export_leaf_path(nodes, leaf.path)  # a PerProcess value's: named by its process
                name = _flat_name(it, under[1] if under is not None else leaf.path, root, per_item, names, single)
                tnames.append(name)
                entries.append((name, st, leaf.shape, leaf.nbytes))
                plan.append((it, leaf))
            items_meta[it] = _item_meta(index, tnames)
        seen: dict[str, str] = {}
        for (name, *_), (it, leaf) in zip(entries, plan):
            if name in seen:
                raise CheckpointError(f"{ck.loc.path}: leaves {seen[name]!r} and {display_path(leaf.path, it)!r} "
                                      f"both become tensor {name!r}; names='raw' (--names raw) keeps key paths apart")
            seen[name] = display_path(leaf.path, it)
        cmeta = {"format": ST_FORMAT, "version": fmt.FORMAT_VERSION, "root": root,
                 "metadata": ck.manifest.metadata, "items": items_meta}
        header = _st_header(entries, {ST_METADATA_KEY: json.dumps(cmeta, separators=(",", ":"))})
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="cairn-convert") as pool:
            readers = {i: make_reader(ck, i, pool) for i in group}
            try:
                # On local disk the file appears only once complete.
                strategy_for(out_loc.storage).write_whole(key, _st_parts(header, plan, readers, slab, pool, progress))
            finally:
                for r in readers.values():
                    r.close()
        written.append(out_loc.storage.describe(key))
    tracker.finish()
    return written


def _st_parts(header: bytes, plan: list[tuple[str, fmt.ArrayLeaf]], readers: dict[str, ChunkReader], slab: int,
              pool: ThreadPoolExecutor, progress: Callable[[int], None] | None) -> Iterator[Any]:
    yield header
    for item, leaf in plan:
        for arr in iter_array(readers[item], leaf, slab, pool):
            n = arr.nbytes
            yield as_view(arr.reshape(-1).view(np.uint8))
            del arr  # not alive while the next slab is read
            if progress is not None:
                progress(n)


# ---------------------------------------------------------------------- safetensors -> cairn


def from_safetensors(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    budget_bytes: int = DEFAULT_BUDGET,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> None:
    """Build checkpoint `dst` from a safetensors file, or a folder of them (one per checkpointable).

    `on_total`, `progress` and the ``"convert"`` progress events as for `convert_to_cairn`."""
    src_loc = resolve(src, storage_options)
    st = src_loc.storage
    if st.exists(src_loc.name) and st.list(src_loc.name):
        keys = [src_loc.key(n) for n in st.list_dir(src_loc.name) if n.endswith(".safetensors")]
        if not keys:
            raise CheckpointError(f"{src_loc.path} is a folder with no .safetensors files")
        per_file = True
    else:
        keys, per_file = [src_loc.name], False
    root = False
    metadata: dict[str, Any] = {}
    items: dict[str, Any] = {}
    for key in keys:
        tensors, meta = open_st_file(src_loc, key)
        stem = key.rsplit("/", 1)[-1][: -len(".safetensors")] if per_file else None
        if stem is not None:
            stem = _unescape_item(stem)
        r, m, its = items_of_st(tensors, meta, st.describe(key), stem)
        root, metadata = root or r, {**metadata, **m}
        for name in its:
            if name in items:
                raise CheckpointError(f"{src_loc.path}: checkpointable {name!r} appears in two files")
        items.update(its)
    if root and list(items) != [""]:
        raise CheckpointError(f"{src_loc.path}: a root checkpoint must come from exactly one file")
    tracker = Progress("convert", os.fspath(dst))
    on_total, progress = tracker.wrap(on_total, progress)
    on_total(sum(leaf[2].nbytes for _s, leaves in items.values() for leaf in leaves
                 if not isinstance(leaf, fmt.ValueLeaf)))
    writer = StreamWriter(resolve(dst, storage_options), fmt.DEFAULT_BLOCK_SIZE)
    slab = slab_bytes(budget_bytes)
    try:
        for name, (structure, leaves) in items.items():
            writer.write_item(name, root, structure, leaves, slab, progress)
        writer.commit(root, metadata)
    except BaseException:
        writer.abort()
        raise
    tracker.finish()


def _unescape_item(stem: str) -> str:
    from urllib.parse import unquote

    return unquote(stem)
