"""What this process's last committed saves wrote of their metadata, kept for the next incremental save.

An incremental save opens its base (`incremental.Incremental.open`): it reads the base's manifest, each
checkpointable's JSON index and the records of its own chunks from the binary index parts. Where that
base is the checkpoint this same process committed a moment ago (a `CheckpointManager` with
``incremental=True``, a loop passing ``base=`` the previous path), those bytes are still in its memory:
the commit wrote them. `remember` keeps them, after the commit succeeded, for a single-process save only
(where the primary wrote every part itself); `lookup` gives them back to a save whose base is that
location, once the manifest found there now is byte for byte the one kept.

That one read is what keeps the records exact: a checkpoint committed again at that path, by this
process (``overwrite=True``) or by any other writer, or deleted, has another manifest or none (every
save's manifest names its own random token and creation time), and then nothing kept is used: the
save reads the base from storage as before. So a base on storage costs one small read (its manifest)
instead of three rounds of reads (manifest, indexes, then the parts' ranges).

Parsed ahead: where its parts hold at most `PARSE_BYTES`, the kept manifest and indexes are parsed, and every
record decoded, when the commit is kept (in the save's job: for an async save, in the background), so that the
next save, whose blocking phase may open its base (`Incremental.decide_unchanged`), finds them ready. A save
that opens its base once pays that parse either way; this moves it out of the next save's blocking phase.

Bounded: the last `KEEP` checkpoints, none whose index bytes exceed `MAX_BYTES` (1 MiB blocks: a 40-byte
record per block, so 64 MiB covers 1.6 TiB per process); anything larger is not kept and is read back.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._errors import CorruptCheckpointError
from .._format import manifest as fmt
from .._storage.location import Location

#: Checkpoints kept (the last committed first to go when a newer one comes): a manager's next save needs
#: only the one before it; two leave room for two runs saving side by side in one process.
KEEP = 2
#: At most this many bytes of indexes and parts per checkpoint kept.
MAX_BYTES = 64 << 20
#: Kept checkpoints whose indexes and parts hold at most this many bytes are parsed when kept (`Kept.parsed`):
#: about 100,000 blocks, whose decoded records take some tens of MB of Python objects.
PARSE_BYTES = 4 << 20


@dataclass(frozen=True)
class Kept:
    """One committed checkpoint's metadata as its commit wrote it: the manifest, and every index and
    index part by its key under the checkpoint (``"<item folder>/<file name>"``)."""

    manifest: bytes
    files: dict[str, bytes]
    # Parsed when kept (`PARSE_BYTES`): the manifest under "", each index (every record fetched) by its key.
    parsed: dict[str, Any] = field(default_factory=dict, compare=False)

    def ranges(self, loc: Location, folder: str, what: str = "the index part") -> Callable[
            [list[tuple[str, int, int]]], list[bytes]]:
        """`ranges_reader`'s twin over the kept bytes of `folder`'s files."""

        def read(reqs: list[tuple[str, int, int]]) -> list[bytes]:
            out = []
            for name, start, length in reqs:
                data = self.files.get(f"{folder}/{name}")
                if data is None:
                    raise CorruptCheckpointError(f"{loc.path}: {what} {loc.key(folder, name)!r} named by the "
                                                 "index is missing")
                if start + length > len(data):
                    raise CorruptCheckpointError(f"{loc.path}: {what} {loc.key(folder, name)!r} is truncated")
                out.append(data[start : start + length])
            return out

        return read


_kept: collections.OrderedDict[tuple[str, str], Kept] = collections.OrderedDict()
_lock = threading.Lock()
#: Lookups answered from memory (`lookup` found the manifest unchanged), for tests and benchmarks.
hits = 0


def _key(loc: Location) -> tuple[str, str] | None:
    url = getattr(loc.storage, "url", None)
    return None if url is None else (str(url), loc.name)


def forget(loc: Location) -> None:
    """Drop what is kept of the checkpoint at `loc` (`remember`: a newer commit there, kept or not)."""
    key = _key(loc)
    if key is not None:
        with _lock:
            _kept.pop(key, None)


def remember(loc: Location, manifest: bytes, files: dict[str, bytes]) -> None:
    """Keep what a commit of a single-process save just wrote at `loc` (call it only once the commit
    succeeded): `manifest`, and `files` ({"<item folder>/<name>": bytes}: every index and index part)."""
    key = _key(loc)
    if key is None:
        return
    forget(loc)
    size = sum(len(v) for v in files.values())
    if size > MAX_BYTES:
        return
    kept = Kept(bytes(manifest), {k: bytes(v) for k, v in files.items()})
    if size <= PARSE_BYTES:
        _parse(loc, kept)
    with _lock:
        _kept[key] = kept
        while len(_kept) > KEEP:
            _kept.popitem(last=False)


def _parse(loc: Location, kept: Kept) -> None:
    """Parse `kept`'s manifest and indexes, every record decoded, into `kept.parsed` (what `Incremental.open`
    would parse from the same bytes); where any of it fails, nothing is parsed ahead (the save that opens
    the base parses the bytes and meets the error there)."""
    try:
        parsed: dict[str, Any] = {"": fmt.Manifest.from_json(kept.manifest, loc.storage.describe(loc.key(fmt.MANIFEST)))}
        for info in parsed[""].items.values():
            rel = f"{info.dir}/{info.index}"
            data = kept.files.get(rel)
            if data is None:
                return
            index = fmt.ItemIndex.from_json(data, loc.storage.describe(loc.key(info.dir, info.index)))
            if index.table is not None:
                index.table.reader = kept.ranges(loc, info.dir)
                index.table.fetch_all()
            parsed[rel] = index
    except Exception:
        return
    kept.parsed.update(parsed)


def lookup(loc: Location, manifest: bytes) -> Kept | None:
    """What is kept of the checkpoint at `loc`, where `manifest` (just read there) is the one kept."""
    global hits
    key = _key(loc)
    if key is None:
        return None
    with _lock:
        got = _kept.get(key)
        if got is None:
            return None
        if got.manifest != bytes(manifest):  # committed again, by this process or another: not ours now
            del _kept[key]
            return None
        hits += 1
        return got


def _after_fork() -> None:  # a forked child: the lock may have been held by a thread it does not have
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def clear() -> None:
    """Forget everything kept (tests)."""
    with _lock:
        _kept.clear()
