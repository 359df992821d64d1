"""Where a checkpoint lives: a storage root and the checkpoint's name under it."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

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
