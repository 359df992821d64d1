"""The storage protocol: a few explicit operations on keys under one root.

Keys are ``/``-separated and relative to the root. Backends raise the builtin
errors (`FileNotFoundError`, `FileExistsError`, `OSError`); the engine turns
them into cairn errors that name the checkpoint.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable
from typing import Any as Buffer  # collections.abc.Buffer is Python 3.12+
from typing import ClassVar, Protocol, runtime_checkable


def split_url(url: str) -> tuple[str, str]:
    """``"s3://b/p"`` -> ``("s3", "b/p")``; a plain path -> ``("", path)``."""
    if "://" in url:
        scheme, rest = url.split("://", 1)
        return scheme.lower(), rest
    return "", url


@runtime_checkable
class RandomReader(Protocol):
    """Positional reads of one file or object, and what they cost."""

    #: Whether `read_into_many` is one vectored read (one system call or
    #: request for many buffers), so that scattering a read straight into many
    #: destination regions beats reading into one buffer and copying.
    vectored: ClassVar[bool]
    #: The object's size, when opening learnt it for free (a local file's
    #: fstat); None when it would cost a request (object stores).
    size: int | None

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill `out` with the bytes at `offset`; raise EOFError if the object is shorter."""

    def read_into_many(self, offset: int, outs: list[memoryview]) -> None:
        """Fill `outs`, in order, with the consecutive bytes at `offset`; EOFError as `read_into`.

        Without `vectored`, this is one `read_into` per buffer: correct, not faster.
        """

    def close(self) -> None: ...


@runtime_checkable
class PartReader(RandomReader, Protocol):
    """A reader that fetches a read in parallel parts and says when each has landed (object stores).

    A `RandomReader` that does not set `reports_parts` need not take `on_part`.
    """

    reports_parts: ClassVar[bool]

    def read_into_many(self, offset: int, outs: list[memoryview],
                       on_part: Callable[[int, int], None] | None = None) -> None:
        """As `RandomReader.read_into_many`; `on_part(a, b)` runs once each part has landed.

        The parts (object bytes [a, b)) tile the read. Each is reported in the
        thread that received it, with its bytes in `outs` (and likely still in
        cache). An exception from `on_part` fails the read, once the parts in
        flight have landed.
        """


#: The kinds of storage (`Storage.kind`): a local disk, a network filesystem mounted locally (NFS,
#: Lustre, a FUSE mount of a bucket), an object store (S3, GCS, Azure, and ``memory://``, which
#: stands in for one in tests).
KINDS = ("local", "network", "object")

#: The bandwidth one process is assumed to get from a storage of each kind, in bytes per second,
#: where the storage declares none (`Storage.bandwidth`): what `compression="auto"` weighs the
#: codecs' speed against (`_save.codecpolicy.compression_pays`). A local disk: 8 GiB/s, what writer
#: threads copy into the page cache at (NVMe gen4 drives sustain 5-7 GB/s). A network filesystem:
#: 1 GiB/s (a 10 GbE link). An object store: 0.5 GiB/s per process (S3 gives 0.1-0.2 GiB/s per
#: connection; cairn keeps a few in flight).
DEFAULT_BANDWIDTH = {"local": 8.0 * (1 << 30), "network": 1.0 * (1 << 30), "object": 0.5 * (1 << 30)}


def bandwidth_of(storage: Storage, direction: str = "write", coded: bool = False, codec: str | None = None) -> float:
    """The bandwidth (bytes/s) one process gets from `storage` in `direction` ("write" or "read"),
    for raw transfers or `coded` ones (by `codec`, where given): the storage's declared `bandwidth` (the same for all), else
    what this process measured on its earlier saves and loads over the same link
    (`measured.measured_bandwidth`; object stores and network filesystems), else its kind's default
    (`DEFAULT_BANDWIDTH`)."""
    declared = storage.bandwidth
    if declared is not None:
        return float(declared)
    from .measured import measured_bandwidth

    measured = measured_bandwidth(storage, direction, coded, codec)
    if measured is not None:
        return measured
    return DEFAULT_BANDWIDTH[storage.kind]


def bandwidth_source(storage: Storage, direction: str = "write") -> str:
    """Where `bandwidth_of` takes its figure from: "declared", "measured" or "default"."""
    if storage.bandwidth is not None:
        return "declared"
    from .measured import measured_bandwidth

    return "measured" if measured_bandwidth(storage, direction) is not None else "default"


@runtime_checkable
class Storage(Protocol):
    """Bytes under one root, and what the storage declares of itself.

    What the save engine, the commit and the load planner may ask of a storage is declared here,
    by every backend, and read as attributes, never probed (``getattr``) or guessed from the class
    (tests/package/test_layers.py checks): `kind`, `atomic_rename` (and `dirs`), `bandwidth`,
    `preferred_read`, `vectored_reads`, `in_process`, `batch_deletes`.
    """

    url: str
    #: Whole directories can be renamed atomically (POSIX); otherwise commit by
    #: a create-if-absent put of the manifest.
    atomic_rename: bool
    @property
    def kind(self) -> str:
        """What kind of storage this is, one of `KINDS` (declared by the backend; a local path's
        depends on the filesystem it is on)."""
    #: The bandwidth (bytes/s) one process gets from this storage, where known (declared by the
    #: backend or set by the user: ``storage.bandwidth = 2e9``); None: measured on this process's
    #: earlier transfers, else the kind's default (`bandwidth_of`).
    bandwidth: float | None
    #: The read size this storage prefers, or None for the reader's default (4 MiB): a load plans its
    #: reads up to it (adjacent chunks of a file merged, across boxes and leaves) and the storage's
    #: reader sends each in as few requests. Object stores, which charge per request, ask for more
    #: (``read_size``, `_storage.obsettings.Tuning`).
    preferred_read: int | None
    #: Whether `delete_keys` deletes many keys per request (object stores' batched deletes), so that a
    #: cleanup should gather its keys into one call; else it deletes them one by one.
    batch_deletes: ClassVar[bool]
    #: Whether this storage's readers are `RandomReader.vectored` (one request for many buffers).
    vectored_reads: ClassVar[bool]
    #: Whether the bytes live in this process's memory (the ``memory://`` store of tests): a read
    #: is a copy, with no request to pay for. The load's route estimates price it so.
    in_process: ClassVar[bool]
    #: Requests retried after transient failures so far (object stores; 0 elsewhere).
    retries: int

    def read(self, key: str) -> bytes: ...

    def open_read(self, key: str) -> RandomReader:
        """A reader of `key`; FileNotFoundError if it is missing, at the latest on the first read.

        (Object stores send no request to open, saving a round trip per file.)
        """

    def write(self, key: str, parts: Iterable[Buffer]) -> int:
        """Write an object from `parts` in order; durable when it returns. Returns its size."""

    def put(self, key: str, data: bytes, *, create: bool = False) -> None:
        """Atomically write a small object; with `create`, raise FileExistsError if it exists."""

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int: ...

    def list(self, prefix: str) -> list[str]:
        """Every key under ``prefix/`` (recursively), relative to the root."""

    def list_dir(self, prefix: str) -> builtins.list[str]:
        """Names directly under ``prefix/`` (files and folders), or of the root for ``""``."""

    def delete_prefix(self, prefix: str) -> None:
        """Delete `prefix` and everything under it; a missing prefix is not an error."""

    def delete_keys(self, keys: builtins.list[str]) -> None:
        """Delete the objects or files `keys` (exact names, no prefixes; a missing one is not an
        error): in batched requests where `batch_deletes`, else one by one."""

    def describe(self, key: str) -> str:
        """A human-readable location for messages."""

    @property
    def dirs(self) -> LocalDirs | None:
        """This storage's POSIX folder operations, or None where folders are only key prefixes
        (object stores). Not None exactly where `atomic_rename` is true."""


@runtime_checkable
class LocalDirs(Protocol):
    """Operations only a POSIX filesystem has, used by the rename commit (`_commit.RenameCommit`)."""

    def is_dir(self, key: str) -> bool: ...

    def makedirs(self, key: str) -> None: ...

    def sync_dir(self, key: str) -> None:
        """fsync the directory `key`, so the entries created in it are durable."""

    def rename_dir(self, src: str, dst: str, *, exchange: bool = False) -> None:
        """Move `src` to `dst` in one step (FileExistsError if `dst` is a non-empty folder);
        with `exchange`, swap the two atomically. Both fsync the parent directories."""

    def mtime(self, key: str) -> float | None:
        """The modification time of `key` (seconds since the epoch), or None if it is gone."""
