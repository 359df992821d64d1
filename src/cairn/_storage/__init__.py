"""Bytes only: the storage interface and its backends.

`open_storage(url)` picks a backend from the path: a plain or ``file://`` path
is local POSIX storage; ``s3://``, ``gs://``, ``az://`` (and friends) go
through obstore, an optional extra; ``memory://`` is an in-process store for
fast tests.
"""

from .base import LocalDirs, PartReader, RandomReader, Storage, split_url
from .local import LocalStorage
from .memory import MemoryStorage
from .staging import staged_file


def open_storage(url: str, options: dict | None = None) -> Storage:
    """The storage whose root is `url` (a directory or an object-store prefix)."""
    scheme, _ = split_url(url)
    if scheme in ("", "file"):
        return LocalStorage(url)
    if scheme == "memory":
        return MemoryStorage.named(url)
    from .obstore import ObjectStorage

    return ObjectStorage(url, options or {})


__all__ = ["LocalDirs", "LocalStorage", "MemoryStorage", "PartReader", "RandomReader", "Storage", "open_storage", "split_url", "staged_file"]
