"""What a load reads from: an opened checkpoint, as the engine sees it (the `Source` protocol).

A load needs the checkpoint's manifest, the indexes of the checkpointables it
asks for, a reader for their bytes, and whether those bytes carry checksums it
can verify. A cairn checkpoint gives them directly (`CairnSource`); every
other format describes itself in the same terms in its own file of
`_sources/`, and restore transforms (rename, drop, fill) rewrite the
description before the engine sees it. Opening one (which format, which
transforms) happens in one place, `_sources.registry.open_source`; the engine
reads every source alike.

`checkpointables` forms what a target asks for, with the errors for names the
checkpoint does not hold: the engine, the dry run and the foreign sources'
description all use it.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._core.stats import LoadStats
from .._errors import MismatchError
from .._format import manifest as fmt
from .._read.metadata import (
    Opened,
    index_bytes,
    not_committed,
    parse_index,
    read_index,
    stored_manifest,
)
from .._storage.location import Location, resolve
from .reader import ChunkReader


class Source(Protocol):
    """An opened checkpoint: what a load reads instead of a path.

    `loc` is where it is (errors name ``loc.path``; the load's storage
    figures are ``loc.storage``'s). `verify` says whether its bytes carry
    checksums a load checks (cairn's do; other formats' do not). `moved`,
    `filled`, `added` and `unmatched` are what restore transforms changed
    (empty without transforms): full key paths that a rename moved ``(from,
    to)`` or a drop removed ``(from, None)``, target leaves filled from the
    target, checkpointables made of filled leaves only, and rename rules
    that matched no key path.
    """

    loc: Location
    manifest: fmt.Manifest
    verify: bool
    moved: list[tuple[str, str | None]]
    filled: list[str]
    added: set[str]
    unmatched: list[str]

    @property
    def format_name(self) -> str:
        """The format it was read from ("cairn", "orbax", "dcp", "safetensors")."""
        ...

    def indexes_of(self, names: Sequence[str], pool: ThreadPoolExecutor | None) -> list[fmt.ItemIndex]:
        """The indexes of checkpointables `names`, in order (fetched together on `pool`, if given)."""
        ...

    def reader(self, name: str, index: fmt.ItemIndex, verify: bool, pool: ThreadPoolExecutor,
               stats: LoadStats) -> ChunkReader:
        """A reader of checkpointable `name`'s bytes (`verify`: check checksums, where there are any)."""
        ...


@dataclass
class CairnSource:
    """A cairn checkpoint as a `Source`: its manifest read, its indexes read when asked for.

    `raw` is the manifest's bytes as stored (a copy compares and commits them as they are).

    Example:

        src = CairnSource.open(resolve("/ckpt/step_100"))
        (index,) = src.indexes_of([""], None)
    """

    loc: Location
    manifest: fmt.Manifest
    raw: bytes = b""
    verify: bool = True
    moved: list[tuple[str, str | None]] = field(default_factory=list)
    filled: list[str] = field(default_factory=list)
    added: set[str] = field(default_factory=set)
    unmatched: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, loc: Location) -> CairnSource:
        """The checkpoint at `loc` (`CheckpointNotFoundError` if nothing is committed there)."""
        src = cls.find(loc)
        if src is None:
            raise not_committed(loc)
        return src

    @classmethod
    def find(cls, loc: Location) -> CairnSource | None:
        """The checkpoint at `loc`, None if no cairn checkpoint is committed there."""
        raw = stored_manifest(loc)
        if raw is None:
            return None
        return cls(loc, fmt.Manifest.from_json(raw, loc.storage.describe(loc.key(fmt.MANIFEST))), raw)

    @property
    def format_name(self) -> str:
        return "cairn"

    def indexes_of(self, names: Sequence[str], pool: ThreadPoolExecutor | None) -> list[fmt.ItemIndex]:
        # Indexes are independent small reads: fetched together on `pool` (one round trip on object
        # stores), each parsed on this thread as it arrives. Parsing holds the GIL: parsed on the pool's
        # eight threads, 2,449 checkpointables' indexes took 0.60-0.68 s on the 2-core VM, against
        # 0.24-0.28 s on one thread (docs/PERFORMANCE.md, "Thousands of checkpointables").
        infos = [self.manifest.items[n] for n in names]
        if pool is None:
            return [read_index(self.loc, info) for info in infos]
        fetched = pool.map(lambda info: index_bytes(self.loc, info), infos)
        return [parse_index(self.loc, info, data) for info, data in zip(infos, fetched)]

    def opened(self) -> Opened:
        """The checkpoint with every index read (`Opened`, as the tools that read a whole one take it)."""
        names = list(self.manifest.items)
        return Opened(self.loc, self.manifest, dict(zip(names, self.indexes_of(names, None))))

    def reader(self, name: str, index: fmt.ItemIndex, verify: bool, pool: ThreadPoolExecutor,
               stats: LoadStats) -> ChunkReader:
        return ChunkReader(self.loc, name, self.manifest.items[name], index, verify, pool, stats)


def open_checkpoint(path: str | os.PathLike[str], storage_options: dict | None = None) -> Opened:
    """The cairn checkpoint at `path` with every index read (`CheckpointNotFoundError` if none is committed).

    Example:

        ck = open_checkpoint("/ckpt/step_100")
        ck.indexes[""].leaves
    """
    return CairnSource.open(resolve(path, storage_options)).opened()


def checkpointables(where: str, names: Collection[str], root: bool, target: Any) -> list[tuple[str, Any]]:
    """The checkpointables a load of `target` asks for, each with its part of the target, in order.

    `names` are the checkpoint's checkpointables; `root`: it holds one plain
    tree (name ""), which the whole target is for. Without a target, every
    checkpointable, whole. A target of a checkpoint of named checkpointables
    must be a mapping from some of those names (`MismatchError` otherwise,
    naming `where`).

    Example:

        checkpointables("/ckpt", ["params", "opt"], False, {"params": abstract})   # [("params", abstract)]
    """
    if root:
        return [("", target)]
    if target is None:
        return [(name, None) for name in names]
    if not isinstance(target, Mapping):
        raise MismatchError(
            f"{where}: the checkpoint holds named checkpointables {sorted(names)}; "
            "pass a mapping from (some of) those names to targets"
        )
    unknown = [k for k in target if k not in names]
    if unknown:
        raise MismatchError(
            f"{where}: the target asks for checkpointables {unknown} that the checkpoint does not "
            f"hold (it holds {sorted(names)})"
        )
    return list(target.items())


__all__ = ["CairnSource", "Source", "checkpointables", "open_checkpoint"]
