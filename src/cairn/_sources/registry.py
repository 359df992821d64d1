"""Which format a path holds, and the one function that opens it: `open_source`.

`open_source` reads a path as a cairn checkpoint, or recognises another format
(Hugging Face safetensors, PyTorch DCP, Orbax), or takes ``format=``, and
applies the restore transforms (rename, drop, fill): the `Source`
(`_load.source`) that `_load.engine` reads, the same for every format: same
target matching, errors, `partial` and planning (`base` says how a foreign
format is described). `cairn.load`, `cairn.metadata`,
`CheckpointManager.restore` (both through `load` here), `plan_load`,
`verify`, `diff` and `copy` all open through it, so detection, its errors
and the transforms are written once. `inspect_data` describes a checkpoint
of another format for `cairn inspect`; `_exports/convert` turns any of them
into a cairn checkpoint.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .._errors import CheckpointNotFoundError, MismatchError
from .._format import manifest as fmt
from .._format import values
from .._load import engine as _engine
from .._load.options import LoadOptions
from .._load.reader import ChunkReader
from .._load.source import CairnSource, Source
from .._read.metadata import not_committed
from .._storage.location import Location
from . import transforms as _transforms
from .base import FORMATS, Format, FormatSource, Rename, open_format
from .dcp import detect as _is_dcp
from .dcp import open_dcp
from .hf import detect as _is_hf
from .hf import open_safetensors
from .orbax import detect as _is_orbax
from .orbax import manager_steps, open_orbax
from .transforms import Patterns, RestoreReport


def detect(loc: Location) -> str | None:
    """The format of the checkpoint at `loc`, or None if it is none cairn reads."""
    if loc.storage.exists(loc.key(fmt.MANIFEST)):
        return "cairn"
    return _other_format(loc)


def _other_format(loc: Location) -> str | None:
    """The format of the checkpoint at `loc` among those not cairn's (None: none of them)."""
    for name, probe in _PROBES.items():
        if probe(loc):
            return name
    return None


_PROBES = {"dcp": _is_dcp, "orbax": _is_orbax, "safetensors": _is_hf}


class _Cairn(Format):
    """A cairn checkpoint described as a format: only to load it into a renamed, dropped or filled tree."""

    name = "cairn"
    verified = True

    def __init__(self, src: CairnSource):
        super().__init__(src.loc)
        self.src, self.manifest = src, src.manifest
        self.indexes = src.opened().indexes

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
        return self.src.reader(item, index, verify, pool, stats)

    def metadata(self) -> dict[str, Any]:
        return self.manifest.metadata

    def item_index(self, item: str, structure: Any, leaves: tuple[fmt.Leaf, ...]) -> fmt.ItemIndex:
        # Its own block size stays, and while no leaf is dropped (leaf numbers unchanged) so does the
        # chunk table, which the load's prefetch asks by leaf number; otherwise records come leaf by leaf.
        own = self.indexes[item]
        same = len(leaves) == len(own.leaves)
        return replace(own, structure=structure, leaves=leaves, table=own.table if same else None)


def open_foreign(loc: Location, format: str | None, cairn_checked: bool = False) -> Format:
    """The checkpoint at `loc` as a `Format` (CheckpointNotFoundError if none is recognised).

    `cairn_checked`: `loc` is known to hold no cairn checkpoint; if no other
    format is recognised either, the error says what is there (as a cairn
    load's does) and that it is none of the others.
    """
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if format in _PROBES and not _PROBES[format](loc):
        raise CheckpointNotFoundError(f"{loc.path} is not a {format} checkpoint (format={format!r} was given)")
    found = format or (_other_format(loc) if cairn_checked else detect(loc))
    if found == "cairn":
        return _Cairn(CairnSource.open(loc))
    if found == "dcp":
        return open_dcp(loc)
    if found == "orbax":
        return open_orbax(loc)
    if found == "safetensors":
        return open_safetensors(loc)
    raise not_found(loc, cairn_checked)


def not_found(loc: Location, cairn_checked: bool = False) -> CheckpointNotFoundError:
    """The error for a path where no format is recognised (`cairn_checked`: start from what a cairn
    load says is there)."""
    steps = manager_steps(loc)
    if steps:
        return CheckpointNotFoundError(
            f"{loc.path} is an Orbax CheckpointManager directory (steps {', '.join(steps[-3:])}); "
            f"load one of its step folders, e.g. {loc.path.rstrip('/')}/{steps[-1]}"
        )
    if not loc.storage.exists(loc.name):
        return CheckpointNotFoundError(f"no checkpoint at {loc.path}")
    if cairn_checked:
        return CheckpointNotFoundError(f"{not_committed(loc)}; nor is it an Orbax, DCP or safetensors checkpoint")
    return CheckpointNotFoundError(
        f"{loc.path} is not a checkpoint cairn reads: no cairn manifest.json, DCP .metadata, Orbax "
        "_METADATA or _CHECKPOINT_METADATA, and no safetensors file or index"
    )


def open_source(loc: Location, target: Any = None, *, format: str | None = None, rename: Rename | None = None,
                drop: Patterns | None = None, fill_missing: bool | Patterns = False,
                locate: bool = True) -> Source:
    """The checkpoint at `loc` opened for a load of `target` (None: all of it): the one way in.

    A cairn checkpoint is read as such (its manifest, once); where there is
    none, the other formats are recognised (`CheckpointNotFoundError` naming
    what is there if none is), unless ``format=`` says which it is. `rename`,
    `drop` and `fill_missing` (`transforms`) describe the checkpoint as the
    tree the target expects; a cairn checkpoint without them is read as it is
    stored. `locate=False` describes a foreign checkpoint without finding
    where each array's bytes start (for metadata only).

    Example:

        src = open_source(resolve("/ckpt/step_100"), {"params": abstract}, rename=[(r"/enc/", "/encoder/")])
        state = _load.engine.load(src, {"params": abstract})
    """
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    cairn = CairnSource.open(loc) if format == "cairn" else CairnSource.find(loc) if format is None else None
    if cairn is not None and not _transforms.wanted(rename, drop, fill_missing):
        return cairn
    # Not a cairn checkpoint (format None): perhaps one of another format.
    f = _Cairn(cairn) if cairn is not None else open_foreign(loc, format, cairn_checked=format is None)
    f.locate = locate
    return _transforms.describe(f, target, loc.path, rename=rename, drop=drop, fill_missing=fill_missing)


def load(loc: Location, target: Any, options: LoadOptions, *, report: RestoreReport | None = None,
         stats: Any = None, started: float | None = None) -> Any:
    """`cairn.load` of `loc` with `options` (`CheckpointManager.restore` too): opened by `open_source`,
    read by `_load.engine.load`; `report` gets what the transforms changed.

    Example:

        state = load(resolve("/ckpt/step_100"), None, LoadOptions(rename=[(r"^enc/", "encoder/")]))
    """
    retries = loc.storage.retries
    src = open_source(loc, target, format=options.format, **options.transforms)
    try:
        out = _engine.load(src, target, options, stats=stats, started=started,
                           retried=loc.storage.retries - retries)
    except MismatchError as e:
        raise _transforms.explained(src, e) from None
    _transforms.finish(src, loc.path, report)
    return out


def inspect_data(path: str, format: str | None = None) -> dict[str, Any] | None:
    """`cairn inspect`'s data for a checkpoint of another format; None for a cairn checkpoint."""
    from .._storage.location import resolve

    loc = resolve(path)
    found = format or detect(loc)
    if found in ("cairn", None):
        return None
    src = open_source(loc, None, format=found, locate=False)
    assert isinstance(src, FormatSource)  # a cairn checkpoint was answered above
    f = src.format
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


__all__ = ["FORMATS", "Rename", "Source", "detect", "inspect_data", "load", "not_found", "open_foreign",
           "open_format", "open_source"]
