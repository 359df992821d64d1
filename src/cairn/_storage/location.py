"""Where a checkpoint lives: a storage root and the checkpoint's name under it."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .._errors import CheckpointError, CorruptCheckpointError
from . import Storage, open_storage, split_url

_cache: dict[tuple[str, str], Storage] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class Location:
    storage: Storage
    name: str  # the checkpoint's folder or prefix, relative to the storage root
    path: str  # as the user wrote it, for messages

    def key(self, *parts: str) -> str:
        return "/".join((self.name, *parts))


def resolve(path: str | os.PathLike[str], options: dict | None = None) -> Location:
    """Split `path` into the storage of its parent and its last component."""
    text = os.fspath(path)
    scheme, rest = split_url(text)
    rest = rest.rstrip("/")
    if scheme in ("", "file"):
        full = os.path.abspath(os.path.expanduser(rest))
        parent, name = os.path.split(full)
        root = parent
    else:
        parent, _, name = rest.rpartition("/")
        if not parent:
            raise ValueError(f"{text!r}: an object-store checkpoint path needs a bucket and a name")
        root = f"{scheme}://{parent}"
    if not name or name in (".", ".."):
        raise ValueError(f"{text!r} does not name a checkpoint (it has no final path component)")
    key = (root, repr(sorted((options or {}).items())))
    with _lock:
        storage = _cache.get(key)
        if storage is None:
            storage = open_storage(root, options)
            if scheme not in ("", "file"):  # object-store clients hold connection pools worth reusing
                _cache[key] = storage
    return Location(storage, name, text)


def read_error(loc: Location, what: str, e: OSError) -> CheckpointError:
    """The error for reading `what` of the checkpoint at `loc` failing with `e`."""
    if e.errno == errno.ELOOP:
        return CorruptCheckpointError(
            f"{loc.path}: {what} is a symbolic link (or lies under one); cairn never follows links inside a checkpoint"
        )
    return CheckpointError(f"{loc.path}: reading {what} failed: {e}")


def ranges_reader(loc: Location, folder: str, what: str = "the index part") -> Callable[
        [list[tuple[str, int, int]]], list[bytes]]:
    """``read([(name, start, length), ...]) -> [bytes, ...]``: byte ranges of files in `folder` of the
    checkpoint at `loc` (an item's binary index parts), read in parallel, one request per range. A
    missing or short file is a `CorruptCheckpointError` naming the checkpoint and the file (`what`).

    Example:

        read = ranges_reader(loc, "params")
        (head,) = read([("index.p00000.abc.idx", 0, 64)])
    """

    def one(req: tuple[str, int, int]) -> bytes:
        name, start, length = req
        key = loc.key(folder, name)
        out = bytearray(length)
        try:
            r = loc.storage.open_read(key)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise CorruptCheckpointError(f"{loc.path}: {what} {key!r} named by the index is missing") from None
        try:
            r.read_into(start, memoryview(out))
        except EOFError:
            raise CorruptCheckpointError(f"{loc.path}: {what} {key!r} is truncated") from None
        except OSError as e:
            raise read_error(loc, f"{what} {key!r}", e) from e
        finally:
            r.close()
        return bytes(out)

    def read(requests: list[tuple[str, int, int]]) -> list[bytes]:
        if len(requests) == 1:
            return [one(requests[0])]
        with ThreadPoolExecutor(min(16, len(requests)), thread_name_prefix="cairn-index") as pool:
            return list(pool.map(one, requests))

    return read
