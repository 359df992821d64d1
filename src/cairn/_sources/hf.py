"""Hugging Face safetensors as a load source: one file, or a sharded folder with its index.

A safetensors tensor is one C-order run of little-endian bytes at a known
offset, so each becomes a one-chunk `fmt.ArrayLeaf` and cairn's own planner
and `ChunkReader` read exactly the byte ranges each process's shards need.
Headers are parsed by `_safetensors` (with its limits). In a sharded folder
the index names every tensor's file, so only the files holding requested
tensors have their headers read.

Keys: tensor names split on '.' (``model.layers.0.self_attn.q_proj.weight``
is the key path ``model/layers/0/self_attn/q_proj/weight``). A file written
by ``cairn convert --to safetensors`` carries cairn's own tree in its
metadata and loads as that tree.
"""

from __future__ import annotations

import errno
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from .._errors import CheckpointError, CorruptCheckpointError
from .._format import manifest as fmt
from .._storage.location import Location
from .base import FlatLocation, Format, one_chunk, split_name
from .stfile import ST_METADATA_KEY, SrcTensor, items_of_st, open_st_file

INDEX_NAMES = ("model.safetensors.index.json",)
_TENSOR = {"type": "safetensors"}  # the sharding description of a tensor (none recorded)
_PLAIN_NAME = re.compile(r"^[^/\\]+$")


class Safetensors(Format):
    name = "safetensors"

    def __init__(self, loc: Location, files: list[str], weight_map: dict[str, str] | None, where: str):
        super().__init__(loc)
        self.where = where
        self.file_names = files
        self._sizes = dict.fromkeys(files, 0)
        self._headers: dict[str, dict[str, SrcTensor]] = {}
        self._cairn: dict[str, Any] | None = None
        self._meta: dict[str, Any] = {}
        if weight_map is None:  # one file: its header is the list of tensors
            tensors, meta = self._header(files[0])
            if ST_METADATA_KEY in meta:
                _root, self._meta, self._cairn = items_of_st(tensors, meta, where, None)
            else:
                self._meta = dict(meta)
            names = sorted(tensors, key=lambda n: tensors[n].start)
            weight_map = dict.fromkeys(names, files[0])
        self.weight_map = weight_map
        self._by_path = {split_name(n): n for n in weight_map}

    @property
    def files(self) -> tuple[fmt.FileInfo, ...]:  # type: ignore[override]
        return tuple(fmt.FileInfo(n, self._sizes[n]) for n in self.file_names)

    @property
    def from_cairn(self) -> bool:
        """Written by ``cairn convert --to safetensors``: cairn's own tree is in its metadata."""
        return self._cairn is not None

    def _header(self, name: str) -> tuple[dict[str, SrcTensor], dict[str, str]]:
        try:
            tensors, meta = open_st_file(self.loc, self.loc.key(name))
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise CheckpointError(
                f"{self.where}: {name!r} is a symbolic link, and cairn opens no links inside a checkpoint "
                "(a Hugging Face hub cache snapshot?); copy the folder with its files (cp -rL) and load the copy"
            ) from None
        self._headers[name] = tensors
        self._sizes[name] = max((t.start + t.nbytes for t in tensors.values()), default=0)
        return tensors, meta

    def items(self) -> dict[str, list[str]]:
        if self._cairn is not None:
            return {item: [leaf.path if isinstance(leaf, fmt.ValueLeaf) else leaf[1] for leaf in leaves]
                    for item, (_structure, leaves) in self._cairn.items()}
        return {"": list(self._by_path)}

    def structure(self, item: str) -> Any:
        return self._cairn[item][0] if self._cairn is not None else None

    def leaves(self, item: str, paths: list[str]) -> dict[str, fmt.Leaf]:
        out: dict[str, fmt.Leaf] = {}
        file_no = {n: i for i, n in enumerate(self.file_names)}
        if self._cairn is not None:
            wanted = set(paths)
            for leaf in self._cairn[item][1]:
                if isinstance(leaf, fmt.ValueLeaf):
                    if leaf.path in wanted:
                        out[leaf.path] = leaf
                    continue
                kind, path, t, extra = leaf
                if path in wanted:
                    out[path] = replace(one_chunk(path, t.dtype, t.shape, 0, t.start, kind), **(extra or {}))
            return out
        need = sorted({self.weight_map[self._by_path[p]] for p in paths} - set(self._headers))
        if len(need) > 1:
            with ThreadPoolExecutor(min(8, len(need)), thread_name_prefix="cairn-hf") as pool:
                list(pool.map(self._header, need))
        elif need:
            self._header(need[0])
        for p in paths:
            name = self._by_path[p]
            file = self.weight_map[name]
            t = self._headers[file].get(name)
            if t is None:
                raise CorruptCheckpointError(f"{self.where}: the index puts tensor {name!r} in {file!r}, "
                                             "whose header does not list it")
            # A tensor, an array to a JAX program: with load(mesh=) it comes back on the mesh, replicated
            # (safetensors records no sharding), never as numpy.
            out[p] = replace(one_chunk(p, t.dtype, t.shape, file_no[file], t.start), sharding=_TENSOR)
        return out

    def metadata(self) -> dict[str, Any]:
        return {"format": "safetensors", **({"safetensors_metadata": self._meta} if self._meta else {})}


def detect(loc: Location) -> bool:
    st, name = loc.storage, loc.name
    if name.endswith(".safetensors") and st.exists(name) and not st.list_dir(name):
        return True
    return bool(_folder_files(loc))


def _folder_files(loc: Location) -> tuple[str, list[str]] | None:
    """(kind, names) for a folder of safetensors: its index, or its one file."""
    names = loc.storage.list_dir(loc.name)
    for n in (*INDEX_NAMES, *sorted(n for n in names if n.endswith(".safetensors.index.json"))):
        if n in names:
            return "index", [n]
    files = [n for n in names if n.endswith(".safetensors")]
    if "model.safetensors" in files:
        return "file", ["model.safetensors"]
    if len(files) == 1:
        return "file", files
    return None


def open_safetensors(loc: Location) -> Safetensors:
    st, name = loc.storage, loc.name
    if name.endswith(".safetensors") and st.exists(name) and not st.list_dir(name):
        return Safetensors(FlatLocation(st, "", loc.path), [name], None, loc.path)
    found = _folder_files(loc)
    flat = FlatLocation(st, name, loc.path)
    if found is None:
        raise CheckpointError(f"{loc.path} holds no model.safetensors, no safetensors index and not exactly "
                              "one .safetensors file")
    kind, names = found
    if kind == "file":
        return Safetensors(flat, names, None, loc.path)
    where = st.describe(flat.key(names[0]))
    d = fmt.parse_json(st.read(flat.key(names[0])), where)
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CorruptCheckpointError(f"{where}: no weight_map of tensor names to file names")
    for v in set(wm.values()):
        if not _PLAIN_NAME.match(v) or v in (".", ".."):
            raise CorruptCheckpointError(f"{where}: weight_map names the file {v!r}, which is not a plain file name")
    files = sorted(set(wm.values()))
    return Safetensors(flat, files, wm, loc.path)
