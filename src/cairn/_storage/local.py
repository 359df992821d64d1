"""Local POSIX storage: positional reads, streamed writes, fsync, atomic rename."""

from __future__ import annotations

import builtins
import ctypes
import errno
import os
import shutil
from collections.abc import Iterable
from typing import Any as Buffer  # collections.abc.Buffer is Python 3.12+
from typing import ClassVar

from .base import split_url

_WRITE_PIECE = 64 << 20
_IOV_MAX = 1024  # the Linux limit on buffers per preadv


class _FileReader:
    vectored: ClassVar[bool] = True  # preadv

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
        self.size: int | None = os.fstat(self.fd).st_size

    def read_into(self, offset: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        done, n = 0, len(out)
        while done < n:
            got = os.preadv(self.fd, [out[done:]], offset + done)
            if got == 0:
                raise EOFError(f"{self.path}: file ends at byte {offset + done}, expected {offset + n}")
            done += got

    def read_into_many(self, offset: int, outs: list[memoryview]) -> None:
        """Fill `outs`, in order, with the consecutive bytes at `offset` (one vectored read)."""
        bufs = [o.cast("B") if o.format != "B" or o.ndim != 1 else o for o in outs]
        total = sum(len(b) for b in bufs)
        done, first, skip = 0, 0, 0  # bytes read; first unfilled buffer; bytes of it already filled
        while done < total:
            iov = [bufs[first][skip:], *bufs[first + 1 : first + _IOV_MAX]]
            got = os.preadv(self.fd, iov, offset + done)
            if got == 0:
                raise EOFError(f"{self.path}: file ends at byte {offset + done}, expected {offset + total}")
            done += got
            got += skip
            while first < len(bufs) and got >= len(bufs[first]):
                got -= len(bufs[first])
                first += 1
            skip = got

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class LocalStorage:
    """Storage rooted at a local directory."""

    atomic_rename = True
    retries = 0
    preferred_read: int | None = None
    batch_deletes: ClassVar[bool] = False
    vectored_reads: ClassVar[bool] = _FileReader.vectored
    in_process: ClassVar[bool] = False
    bandwidth: float | None = None  # unless set: measured, else the kind's default (`base.bandwidth_of`)

    def __init__(self, url: str):
        scheme, path = split_url(url)
        if scheme not in ("", "file"):
            raise ValueError(f"not a local path: {url!r}")
        self.root = os.path.abspath(os.path.expanduser(path))
        self.url = self.root
        self._network: bool | None = None

    @property
    def network(self) -> bool:
        """Whether the root is on a network filesystem (NFS, Lustre, a FUSE mount of an object
        store, ...: `fstype.is_network`), where `compression="auto"` compresses."""
        if self._network is None:
            from .fstype import is_network, mount_type

            self._network = is_network(mount_type(self.root))
        return self._network

    @property
    def dirs(self) -> LocalStorage:
        """Itself: a local directory has folders that rename (`base.LocalDirs`)."""
        return self

    @property
    def kind(self) -> str:
        """"network" on a network filesystem (`network`), else "local"."""
        return "network" if self.network else "local"

    def _p(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/")) if key else self.root

    def describe(self, key: str) -> str:
        return self._p(key)

    def _p_inside(self, key: str) -> str:
        """The path of `key` for reading; ELOOP if a folder below its first component is a link.

        The first component is a checkpoint (or a run's) folder, which a user
        may link on purpose. Nothing cairn writes inside one is a link, so a
        planted link (an item folder pointing elsewhere) cannot redirect a load
        out of the checkpoint. The last component is opened with O_NOFOLLOW.
        """
        parts = key.split("/")
        path = os.path.join(self.root, parts[0])
        for part in parts[1:-1]:
            path = os.path.join(path, part)
            if os.path.islink(path):
                raise OSError(errno.ELOOP, "a symbolic link inside a checkpoint", path)
        return os.path.join(path, parts[-1]) if len(parts) > 1 else path

    def read(self, key: str) -> bytes:
        nofollow = getattr(os, "O_NOFOLLOW", 0) if "/" in key else 0
        fd = os.open(self._p_inside(key), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | nofollow)
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def open_read(self, key: str) -> _FileReader:
        return _FileReader(self._p_inside(key))

    def write(self, key: str, parts: Iterable[Buffer]) -> int:
        path = self._p(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        total = 0
        try:
            for part in parts:
                mv = memoryview(part).cast("B")
                for i in range(0, len(mv), _WRITE_PIECE):
                    piece = mv[i : i + _WRITE_PIECE]
                    while len(piece):
                        n = os.write(fd, piece)
                        piece = piece[n:]
                total += len(mv)
            os.fsync(fd)
        finally:
            os.close(fd)
        return total

    def put(self, key: str, data: bytes, *, create: bool = False) -> None:
        path = self._p(key)
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}-{id(data):x}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            if create:
                os.link(tmp, path)  # fails with EEXIST: an atomic create-if-absent
            else:
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        fsync_dir(d)

    def exists(self, key: str) -> bool:
        return os.path.exists(self._p(key))

    def is_dir(self, key: str) -> bool:
        return os.path.isdir(self._p(key))

    def size(self, key: str) -> int:
        return os.stat(self._p(key)).st_size

    def list(self, prefix: str) -> list[str]:
        base = self._p(prefix)
        out = []
        for dirpath, _dirs, files in os.walk(base):
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            for f in files:
                out.append(f if rel == "." else f"{rel}/{f}")
        return sorted(out)

    def list_dir(self, prefix: str) -> builtins.list[str]:
        try:
            return sorted(os.listdir(self._p(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete_prefix(self, prefix: str) -> None:
        path = self._p(prefix)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=False, onerror=_ignore_missing)
        elif os.path.lexists(path):
            os.unlink(path)

    def delete_keys(self, keys: builtins.list[str]) -> None:
        for key in keys:  # a request per file costs nothing here: no batches (`batch_deletes`)
            self.delete_prefix(key)

    # ---- POSIX-only operations used by the rename commit

    def mtime(self, key: str) -> float | None:
        try:
            return os.path.getmtime(self._p(key))
        except OSError:
            return None

    def makedirs(self, key: str) -> None:
        os.makedirs(self._p(key), exist_ok=True)

    def sync_dir(self, key: str) -> None:
        fsync_dir(self._p(key))

    def rename_dir(self, src: str, dst: str, *, exchange: bool = False) -> None:
        """Move `src` to `dst` in one step; with `exchange`, swap them atomically.

        Without `exchange`, fails with FileExistsError if `dst` is a non-empty
        directory. Both cases fsync the parent directory.
        """
        s, d = self._p(src), self._p(dst)
        if exchange:
            _rename_exchange(s, d)
        else:
            try:
                os.rename(s, d)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise FileExistsError(errno.EEXIST, "destination exists", d) from None
                raise
        fsync_dir(os.path.dirname(d))
        if os.path.dirname(s) != os.path.dirname(d):
            fsync_dir(os.path.dirname(s))


def _ignore_missing(func, path, exc_info) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = None


def _rename_exchange(a: str, b: str) -> None:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), a)
