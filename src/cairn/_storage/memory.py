"""An in-process object store, for fast tests of the object-store commit path."""

from __future__ import annotations

import builtins
import threading
from collections.abc import Iterable
from typing import Any as Buffer  # collections.abc.Buffer is Python 3.12+
from typing import ClassVar

from .base import split_url


class _MemReader:
    vectored: ClassVar[bool] = False

    def __init__(self, data: bytes):
        self.data = data
        # Known, but withheld: this store stands in for an object store, whose
        # readers learn of a short object only when they read past its end.
        self.size: int | None = None

    def read_into(self, offset: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        if offset + len(out) > len(self.data):
            raise EOFError(f"object ends at byte {len(self.data)}, expected {offset + len(out)}")
        out[:] = self.data[offset : offset + len(out)]

    def read_into_many(self, offset: int, outs: list[memoryview]) -> None:
        for out in outs:
            self.read_into(offset, out)
            offset += out.nbytes

    def close(self) -> None:
        pass


class MemoryStorage:
    """A dict of keys to bytes; behaves like an object store (no rename)."""

    atomic_rename = False
    kind = "object"  # it stands in for an object store
    bandwidth: float | None = None
    retries = 0
    preferred_read: int | None = None
    batch_deletes: ClassVar[bool] = False
    vectored_reads: ClassVar[bool] = _MemReader.vectored
    in_process: ClassVar[bool] = True
    dirs: None = None  # keys only, like an object store
    _named: ClassVar[dict[str, dict[str, bytes]]] = {}

    def __init__(self, url: str = "memory://", objects: dict[str, bytes] | None = None, prefix: str = ""):
        self.url = url
        self.objects = objects if objects is not None else {}
        self.prefix = prefix.strip("/")
        self.lock = threading.Lock()

    @classmethod
    def named(cls, url: str) -> MemoryStorage:
        """The store for ``memory://bucket/prefix``; buckets live as long as the process."""
        _, rest = split_url(url)
        bucket, _, prefix = rest.partition("/")
        objects = cls._named.setdefault(bucket, {})
        return cls(url, objects, prefix)

    def _k(self, key: str) -> str:
        if not key:  # the root itself: listing "" must not look under "<prefix>//"
            return self.prefix
        return f"{self.prefix}/{key}" if self.prefix else key

    def describe(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    def read(self, key: str) -> bytes:
        try:
            return self.objects[self._k(key)]
        except KeyError:
            raise FileNotFoundError(self.describe(key)) from None

    def open_read(self, key: str) -> _MemReader:
        return _MemReader(self.read(key))

    def write(self, key: str, parts: Iterable[Buffer]) -> int:
        data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        with self.lock:
            self.objects[self._k(key)] = data
        return len(data)

    def put(self, key: str, data: bytes, *, create: bool = False) -> None:
        with self.lock:
            if create and self._k(key) in self.objects:
                raise FileExistsError(self.describe(key))
            self.objects[self._k(key)] = bytes(data)

    def exists(self, key: str) -> bool:
        k = self._k(key)
        return k in self.objects or any(o.startswith(k + "/") for o in list(self.objects))

    def size(self, key: str) -> int:
        return len(self.read(key))

    def list(self, prefix: str) -> list[str]:
        p = self._k(prefix)
        p = p + "/" if p else ""
        n = len(self.prefix) + 1 if self.prefix else 0
        return sorted(k[n:] for k in list(self.objects) if k.startswith(p))

    def list_dir(self, prefix: str) -> builtins.list[str]:
        p = prefix.strip("/")
        out = set()
        for k in self.list(p) if p else self.list(""):
            rest = k[len(p) + 1 :] if p else k
            out.add(rest.split("/", 1)[0])
        return sorted(out)

    def delete_prefix(self, prefix: str) -> None:
        k = self._k(prefix)
        with self.lock:
            for o in [o for o in self.objects if o == k or o.startswith(k + "/")]:
                del self.objects[o]

    def delete_keys(self, keys: builtins.list[str]) -> None:
        with self.lock:
            for key in keys:
                self.objects.pop(self._k(key), None)
