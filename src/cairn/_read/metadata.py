"""Reading a checkpoint's metadata: its manifest and its indexes (never array data).

Load, an incremental save's base, verify, the dry run, copy and the CLI all start here. Missing,
unreadable and malformed metadata become cairn errors that name the checkpoint; parsing (with its
limits) is `_format`'s. A checkpoint refers to its bases by their names beside it (`sibling`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from .._core.gcpause import paused
from .._errors import CheckpointNotFoundError, CorruptCheckpointError
from .._format import manifest as fmt
from .._storage import Storage
from .._storage.location import Location, ranges_reader, read_error, resolve


def read_manifest(loc: Location) -> fmt.Manifest:
    return parse_manifest(loc, manifest_bytes(loc))


def committed_manifest(loc: Location) -> fmt.Manifest | None:
    """The manifest at `loc`, None where nothing is committed there (a base not there, a folder beside)."""
    data = stored_manifest(loc)
    return None if data is None else parse_manifest(loc, data)


def parse_manifest(loc: Location, data: bytes) -> fmt.Manifest:
    """The manifest bytes `data` of the checkpoint at `loc`, parsed (errors name it)."""
    return fmt.Manifest.from_json(data, loc.storage.describe(loc.key(fmt.MANIFEST)))


def sibling(loc: Location, name: str) -> Location:
    """The checkpoint `name` beside `loc` (in the same folder or prefix), as references name it (§6.5)."""
    head, sep, _ = loc.path.rstrip("/").rpartition("/")
    return Location(loc.storage, name, f"{head}{sep}{name}" if sep else name)


def base_beside(loc: Location, base: Any, storage_options: dict | None = None) -> Location:
    """`base` (a path) as the `Location` of a checkpoint in the same folder or prefix as `loc`: the base of
    an incremental save at `loc` (ValueError where it is elsewhere, or `loc` itself)."""
    base_loc = resolve(base, storage_options)
    if getattr(base_loc.storage, "url", None) != getattr(loc.storage, "url", object()):
        raise ValueError(f"{loc.path}: the base {str(base)!r} must be in the same folder or prefix as the "
                         "checkpoint: references name it relative to the checkpoint")
    if base_loc.name == loc.name:
        raise ValueError(f"{loc.path}: a checkpoint cannot be its own base")
    return Location(loc.storage, base_loc.name, base_loc.path)



def bases_of(storage: Storage, folder: str) -> tuple[str, ...]:
    """The sibling checkpoints the committed checkpoint `folder` (under `storage`'s root) refers to
    (incremental saves, §6.5); none for a self-contained or foreign one, or one not there.

    Read afresh each time (one small read): a checkpoint deleted and saved again may refer to
    other checkpoints than before."""
    try:
        return read_manifest(Location(storage, folder, folder)).bases
    except CheckpointNotFoundError:  # not a cairn checkpoint (Orbax), or gone: refers to nothing
        return ()

def manifest_bytes(loc: Location) -> bytes:
    """The raw bytes of the manifest at `loc` (`CheckpointNotFoundError` if nothing is committed there)."""
    data = stored_manifest(loc)
    if data is None:
        raise not_committed(loc)
    return data


def stored_manifest(loc: Location) -> bytes | None:
    """The raw bytes of the manifest at `loc`, None if there is none (nothing committed there)."""
    try:
        return loc.storage.read(loc.key(fmt.MANIFEST))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        raise CorruptCheckpointError(f"{loc.path}: {fmt.MANIFEST} is not a file") from None
    except OSError as e:
        raise read_error(loc, fmt.MANIFEST, e) from e


def not_committed(loc: Location) -> CheckpointNotFoundError:
    """The error for `loc` where no manifest is: what is there, said so that the user knows what to do."""
    if loc.storage.exists(loc.name):
        return CheckpointNotFoundError(_no_manifest(loc))
    return CheckpointNotFoundError(f"no checkpoint at {loc.path}")


# The data files and indexes a save writes (`_format.manifest`'s names), also before it commits.
_SAVE_FILE = re.compile(r"(^|/)(p\d{5}-\d+\.[0-9a-f]+\.bin|index\.[0-9a-f]+\.json|index\.p\d{5}\.[0-9a-f]+\.idx)$")


def _no_manifest(loc: Location) -> str:
    """What is at `loc`, which exists but has no manifest: said so that the user knows what to do."""
    st = loc.storage
    head = f"{loc.path} holds no committed checkpoint"
    children = sorted(st.list_dir(loc.name))
    if not children:
        return f"{head}: it is a file or an empty folder (a cairn checkpoint is a folder holding {fmt.MANIFEST})"
    inside = [c for c in children[:64] if st.exists(f"{loc.key(c)}/{fmt.MANIFEST}")]
    if inside:
        return f"{head}: it is a directory of checkpoints (e.g. {inside[-1]}); `cairn ls {loc.path}` lists them"
    if any(_SAVE_FILE.search(k) for k in st.list(loc.name)):
        return f"{head} (no {fmt.MANIFEST}; an interrupted save?)"
    return f"{head}: no {fmt.MANIFEST}, and no files of a cairn save"


class KeptFiles(Protocol):
    """A checkpoint's index files as this process's commit wrote them (`_save.basecache.Kept`)."""

    @property
    def files(self) -> dict[str, bytes]: ...

    @property
    def parsed(self) -> dict[str, Any]: ...

    def ranges(self, loc: Location, folder: str, what: str = ...) -> Any: ...


def read_index(loc: Location, info: fmt.ItemInfo, kept: KeptFiles | None = None) -> fmt.ItemIndex:
    """The index of item `info` of the checkpoint at `loc`, its binary parts read in ranges on demand:
    from `kept` (what this process's commit of it wrote) where given and it has them, else from storage."""
    rel = f"{info.dir}/{info.index}"
    if kept is not None and rel in kept.parsed:
        return kept.parsed[rel]  # (parsed, every record decoded, when it was kept)
    data = kept.files.get(rel) if kept is not None else None
    if kept is None or data is None:
        return parse_index(loc, info, index_bytes(loc, info))
    index = parse_index(loc, info, data)
    if index.table is not None:
        index.table.reader = kept.ranges(loc, info.dir)  # (kept: `data` came from it)
    return index


def index_bytes(loc: Location, info: fmt.ItemInfo) -> bytes:
    """The raw bytes of the index of item `info` (`CorruptCheckpointError` if it is missing)."""
    key = loc.key(info.dir, info.index)
    try:
        data = loc.storage.read(key)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise CorruptCheckpointError(f"{loc.path}: the index {key!r} named by the manifest is missing") from None
    except OSError as e:
        raise read_error(loc, f"the index {key!r}", e) from e
    return data


def parse_index(loc: Location, info: fmt.ItemInfo, data: bytes) -> fmt.ItemIndex:
    """The index `data` of item `info` of `loc`, parsed, its binary parts (format 2) read from `loc`."""
    with paused():  # tens of thousands of containers, none of them garbage
        index = fmt.ItemIndex.from_json(data, loc.storage.describe(loc.key(info.dir, info.index)))
    if index.table is not None:
        index.table.reader = ranges_reader(loc, info.dir)
    return index


@dataclass
class Opened:
    """A committed checkpoint with its manifest and every index read (no array data)."""

    loc: Location
    manifest: fmt.Manifest
    indexes: dict[str, fmt.ItemIndex]


