"""Checkpoints of other formats: Hugging Face safetensors, PyTorch DCP, Orbax.

`open_source` recognises a path's format (or takes ``format=``) and opens it
as a `Source` that `_load.load` reads like a cairn checkpoint: same target
matching, errors, `partial` and planning (`_base` says how). cairn's own
checkpoints are read by `_load` directly, unless a `rename` asks for a
different tree. `metadata` and `inspect_data` describe any of them without
reading array data; `_convert` turns any of them into a cairn checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .._errors import CheckpointNotFoundError
from .._format import manifest as fmt
from .._format import values
from .._load.metadata import read_index, read_manifest
from .._load.reader import ChunkReader
from .._storage.location import Location
from .base import FORMATS, Format, Rename, Source, open_format
from .dcp import detect as _is_dcp
from .dcp import open_dcp
from .hf import detect as _is_hf
from .hf import open_safetensors
from .orbax import detect as _is_orbax
from .orbax import manager_steps, open_orbax


def detect(loc: Location) -> str | None:
    """The format of the checkpoint at `loc`, or None if it is none cairn reads."""
    if loc.storage.exists(loc.key(fmt.MANIFEST)):
        return "cairn"
    for name, probe in _PROBES.items():
        if probe(loc):
            return name
    return None


_PROBES = {"dcp": _is_dcp, "orbax": _is_orbax, "safetensors": _is_hf}


class _Cairn(Format):
    """A cairn checkpoint as a source: only to load it into a renamed tree."""

    name = "cairn"
    verified = True

    def __init__(self, loc: Location):
        super().__init__(loc)
        self.manifest = read_manifest(loc)
        self.indexes = {n: read_index(loc, info) for n, info in self.manifest.items.items()}

    @property
    def root(self) -> bool:
        return self.manifest.root

    def items(self) -> dict[str, list[str]]:
        return {n: [leaf.path for leaf in index.leaves] for n, index in self.indexes.items()}

    def item_files(self, item: str) -> tuple[fmt.FileInfo, ...]:
        return self.indexes[item].files

    def structure(self, item: str) -> Any:
        return self.indexes[item].structure

    def leaves(self, item: str, paths: list[str]) -> dict[str, fmt.Leaf]:
        wanted = set(paths)
        return {leaf.path: leaf for leaf in self.indexes[item].leaves if leaf.path in wanted}

    def reader(self, item: str, index: fmt.ItemIndex, verify: bool, pool: Any, stats: Any) -> ChunkReader:
        return ChunkReader(self.loc, item, self.manifest.items[item], index, verify, pool, stats)

    def metadata(self) -> dict[str, Any]:
        return self.manifest.metadata

    def item_index(self, item: str, structure: Any, leaves: tuple[fmt.Leaf, ...]) -> fmt.ItemIndex:
        # Its own block size stays, and while no leaf is dropped (leaf numbers unchanged) so does the
        # chunk table, which the load's prefetch asks by leaf number; otherwise records come leaf by leaf.
        own = self.indexes[item]
        same = len(leaves) == len(own.leaves)
        return replace(own, structure=structure, leaves=leaves, table=own.table if same else None)


def open_foreign(loc: Location, format: str | None,
                 missing: CheckpointNotFoundError | None = None) -> Format:
    """The checkpoint at `loc` as a `Format` (CheckpointNotFoundError if none is recognised)."""
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if format in _PROBES and not _PROBES[format](loc):
        raise CheckpointNotFoundError(f"{loc.path} is not a {format} checkpoint (format={format!r} was given)")
    found = format or detect(loc)
    if found == "cairn":
        return _Cairn(loc)
    if found == "dcp":
        return open_dcp(loc)
    if found == "orbax":
        return open_orbax(loc)
    if found == "safetensors":
        return open_safetensors(loc)
    raise not_found(loc, missing)


def not_found(loc: Location, missing: CheckpointNotFoundError | None = None) -> CheckpointNotFoundError:
    """The error for a path where no format is recognised (`missing`: cairn's own, if it has one)."""
    steps = manager_steps(loc)
    if steps:
        return CheckpointNotFoundError(
            f"{loc.path} is an Orbax CheckpointManager directory (steps {', '.join(steps[-3:])}); "
            f"load one of its step folders, e.g. {loc.path.rstrip('/')}/{steps[-1]}"
        )
    if missing is not None and not loc.storage.exists(loc.name):
        return missing
    if missing is not None:
        return CheckpointNotFoundError(f"{missing}; nor is it an Orbax, DCP or safetensors checkpoint")
    if loc.storage.exists(loc.name):
        return CheckpointNotFoundError(
            f"{loc.path} is not a checkpoint cairn reads: no cairn manifest.json, DCP .metadata, Orbax "
            "_METADATA or _CHECKPOINT_METADATA, and no safetensors file or index"
        )
    return CheckpointNotFoundError(f"no checkpoint at {loc.path}")


def open_source(loc: Location, target: Any, *, format: str | None = None, rename: Rename | None = None,
                missing: CheckpointNotFoundError | None = None, drop: str | Sequence[str] | None = None) -> Source:
    """`loc` opened for a load of `target` (see `_base.open_format`).

    `missing`: the error reading it as a cairn checkpoint gave, raised again if
    no other format is recognised either.
    """
    return open_format(open_foreign(loc, format, missing), target, rename, loc.path, drop)


def metadata(loc: Location, format: str | None = None, missing: CheckpointNotFoundError | None = None) -> Any:
    """`cairn.metadata` of any format: the tree with `ArrayMetadata` for arrays (no data read)."""
    from .._load.engine import ArrayMetadata
    from .._tree.pytree import unflatten

    f = open_foreign(loc, format, missing)
    f.locate = False
    src = open_format(f, None, None, loc.path)
    out = {}
    for name, index in src.indexes.items():
        leaves = [ArrayMetadata(leaf.shape, leaf.dtype, leaf.nbytes, leaf.sharding, leaf.kind)
                  if isinstance(leaf, fmt.ArrayLeaf) else leaf.value for leaf in index.leaves]
        out[name] = unflatten(index.structure, leaves)
    return out[""] if src.manifest.root else out


def inspect_data(path: str, format: str | None = None) -> dict[str, Any] | None:
    """`cairn inspect`'s data for a checkpoint of another format; None for a cairn checkpoint."""
    from .._storage.location import resolve

    loc = resolve(path)
    if format == "cairn" or (format is None and detect(loc) in ("cairn", None)):
        return None
    f = open_foreign(loc, format)
    f.locate = False
    src = open_format(f, None, None, loc.path)
    items: dict[str, Any] = {}
    totals = {"leaves": 0, "arrays": 0, "array_bytes": 0, "files": 0, "file_bytes": 0}
    for name, index in src.indexes.items():
        leaves: list[dict[str, Any]] = []
        for leaf in index.leaves:
            if isinstance(leaf, fmt.ArrayLeaf):
                leaves.append({"path": leaf.path, "kind": leaf.kind, "dtype": values.dtype_name(leaf.dtype),
                               "shape": list(leaf.shape), "nbytes": leaf.nbytes, "grid": list(leaf.grid_shape),
                               "chunks": len(leaf.chunks)})
                totals["arrays"] += 1
                totals["array_bytes"] += leaf.nbytes
            else:
                v = leaf.value
                leaves.append({"path": leaf.path, "kind": leaf.kind,
                               "value": v.item() if hasattr(v, "item") else v if not isinstance(v, complex) else repr(v)})
        files = [] if f.name == "orbax" else [{"name": x.name, "size": x.size} for x in index.files]
        totals["leaves"] += len(leaves)
        totals["files"] += len(files)
        totals["file_bytes"] += sum(x.size for x in index.files) if files else 0
        items[name] = {"dir": "", "index": "", "block_size": 0, "files": files, "leaves": leaves}
    return {"path": loc.path, "format": f.name, "format_version": None, "cairn_version": "",
            "created_unix": 0.0, "process_count": None, "root": src.manifest.root,
            "metadata": src.manifest.metadata, "items": items, "totals": totals}


__all__ = ["FORMATS", "Rename", "Source", "detect", "inspect_data", "metadata", "not_found", "open_foreign",
           "open_format", "open_source"]
