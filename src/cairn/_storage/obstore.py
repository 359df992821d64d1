"""Object-store storage (S3, GCS, Azure) through obstore.

Writes of data files stream their parts as a multipart upload with several
parts in flight; small objects go up in one request. ``put(create=True)`` is
obstore's create mode (``If-None-Match: *`` on S3 and Azure, a generation
precondition on GCS), the primitive the commit needs. Reads are ranged gets
whose answers are streamed straight into the caller's buffers; a read larger
than ``read_part_size`` is split into parts fetched in parallel.

Retries: every request except the parts of a multipart upload is retried
here, with exponential backoff and jitter, a bounded number of times, and
counted in `ObjectStorage.retries` (the save reports the difference in its
stats). The parts of a multipart upload are retried inside obstore (the parts
of a stream cannot be replayed from here); those retries are bounded by the
same settings but not counted.

Options (the ``storage_options`` of `cairn.save` and friends) are obstore's
store settings (``endpoint``, ``region``, ``access_key_id``,
``secret_access_key``, ``account_name``, ``service_account_key``, ...), its
HTTP client settings (``allow_http``, ``timeout``, ...), and these cairn
settings:

``max_retries`` (5), ``retry_backoff`` (0.1 s, the first wait), ``max_backoff``
(10 s), ``part_size`` (16 MiB, multipart upload part), ``upload_concurrency``
(4 parts in flight per file), ``read_size`` (64 MiB, the read this store
prefers, which it states as `preferred_read`: a load plans reads of
consecutive bytes of a file, across boxes and leaves, up to that size, and
each goes out as one GET; a server that passes over the whole object for
every ranged GET, as moto does, loads fastest with reads as large as the data
files), ``read_concurrency`` (4 GETs in flight per read); ``read_part_size``
(the largest ranged GET) and ``plan_read_size`` (the largest read a load
plans) set the two halves of ``read_size`` apart.

Azure's emulator: ``{"use_emulator": True, "endpoint": "http://127.0.0.1:10000"}``
(obstore alone takes the emulator's address only from ``AZURITE_BLOB_STORAGE_URL``).

A write holds at most about ``part_size * (upload_concurrency + 1)`` bytes of
its own, a read about ``read_part_size * read_concurrency``, whatever the
object's size; a read holds one streamed chunk (4 MiB) per GET in flight, its
bytes landing in the caller's buffers.
"""

from __future__ import annotations

import bisect
import builtins
import functools
import itertools
import os
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Literal, TypeVar
from typing import Any as Buffer  # collections.abc.Buffer is Python 3.12+

import numpy as np

from .._errors import CheckpointError
from .base import split_url
from .obsettings import split_options

T = TypeVar("T")

# Errors are classified by obstore's error classes where it has them (see
# `_Classes`). What it has no class for arrives as a GenericError whose cause
# is only in the message: the HTTP status of a failed request (416, 5xx, 429,
# 408, other 4xx) and transport failures (checked against obstore 0.12: no
# status attribute either). So these two are matched on the text, and only
# for errors that no class decided:
#
# status codes and transport failures worth another attempt: server errors,
# throttling (S3 answers 503 SlowDown, others 429), request timeouts, dropped
# or refused connections;
_TRANSIENT = re.compile(
    r"status code: (5\d\d|429|408)\b|error sending request|HTTP error|timed? ?out|"
    r"connection (reset|refused|closed|aborted)|broken pipe|incomplete message|"
    r"error decoding response body|body error",
    re.IGNORECASE,
)
# The client found no credentials and asked a cloud VM's metadata service (AWS and Azure at
# 169.254.169.254, ECS at 169.254.170.2, GCP at metadata.google.internal), which failed.
# (Matched on the addresses and on the services' paths, which stay when `metadata_endpoint` moves them.)
_CREDENTIAL_FALLBACK = re.compile(r"169\.254\.169\.254|169\.254\.170\.2|metadata\.google\.internal|"
                                  r"/latest/api/token|/latest/meta-data/|/metadata/identity/oauth2/|computeMetadata/")
# a range that starts past the end of the object.
_RANGE_NOT_SATISFIABLE = "status code: 416"
_NO_BUCKET = re.compile(r"<Code>NoSuchBucket</Code>|ContainerNotFound|The specified bucket does not exist|"
                        r"The specified container does not exist")


# Parts of large reads in flight per storage, over all its readers (beyond, parts wait for a
# free thread): with 16 MiB parts at most 256 MiB of answers in flight, besides the reads of
# at most one part, which their calling threads send themselves.
_READ_THREADS = 16
# A streamed answer is handed over in chunks of at least this size (the last may be smaller).
_STREAM_CHUNK = 4 << 20


def _summary(e: BaseException) -> str:
    """obstore's message without its debug dump: the request, the status and the server's answer."""
    text = str(e).split("\n\nDebug source", 1)[0].strip()
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:400] + "..."


_ErrorTypes = tuple[type[BaseException], ...]


@dataclass(frozen=True)
class _Classes:
    """obstore's error classes, by what cairn makes of them.

    A missing object is the builtin FileNotFoundError (obstore's NotFoundError
    is deprecated and not raised), bad arguments ValueError or TypeError.
    """

    exists: _ErrorTypes  # a create-if-absent put found the object (412 on S3)
    denied: _ErrorTypes  # 403, 401
    final: _ErrorTypes  # the request itself is wrong: repeating it cannot help
    obstore: type[BaseException]  # the base of them all, GenericError among them


@functools.cache
def _classes() -> _Classes:
    from obstore import exceptions as ox

    return _Classes(
        exists=(ox.AlreadyExistsError, ox.PreconditionError),
        denied=(ox.PermissionDeniedError, ox.UnauthenticatedError),
        final=(ox.NotSupportedError, ox.InvalidPathError, ox.UnknownConfigurationKeyError, ox.NotModifiedError),
        obstore=ox.BaseError,
    )


def is_transient(e: BaseException) -> bool:
    """Whether `e` (raised by obstore) is worth retrying."""
    c = _classes()
    if isinstance(e, (FileNotFoundError, PermissionError, ValueError, TypeError, EOFError)):
        return False
    if isinstance(e, c.exists + c.denied + c.final):
        return False
    if not isinstance(e, (c.obstore, OSError, TimeoutError)):
        return False
    # Left: GenericError (and the transport's I/O errors), whose cause only the text names.
    return bool(_TRANSIENT.search(str(e).split("\n\nDebug source", 1)[0]))


class _ObjectReader:
    """Ranged reads of one object.

    Opening sends no request: a load opens every data file it touches, and a
    HEAD per file would cost a round trip each. A missing object shows up as
    FileNotFoundError on the first read; a read past its end (the server
    answers 416, or fewer bytes than asked) as EOFError.

    A read (of one buffer, or of several consecutive ones) is cut into ranged
    GETs of at most ``read_part_size`` bytes, at most ``read_concurrency`` of
    them in flight at once, each answer streamed and copied chunk by chunk
    straight into the buffers it covers (`_get`). ``on_part(a, b)``, if given,
    runs as each stretch [a, b) lands (stretches of one GET overlap by one
    chunk, so a block across two chunks is reported whole once), in the thread
    that received it (a reader verifies checksums there, while the bytes are in
    cache); an exception it raises fails the read and comes out unchanged.
    """

    # Consecutive buffers share requests, and each answer is copied straight into the buffers it
    # covers: filling several destination regions in one read costs no copy a scratch buffer would not.
    vectored: ClassVar[bool] = True
    reports_parts: ClassVar[bool] = True  # read_into_many takes on_part

    def __init__(self, storage: ObjectStorage, key: str):
        self.storage, self.key = storage, key
        self.size: int | None = None  # learning it would cost a HEAD request per file

    def read_into(self, offset: int, out: memoryview) -> None:
        self.read_into_many(offset, [out])

    def read_into_many(self, offset: int, outs: list[memoryview],
                       on_part: Callable[[int, int], None] | None = None) -> None:
        if offset < 0:
            raise EOFError(f"{self.storage.describe(self.key)}: negative offset {offset}")
        views = [v for v in map(_bytes_view, outs) if len(v)]
        total = sum(len(v) for v in views)
        if total == 0:
            return
        t = self.storage.tuning
        starts = range(offset, offset + total, t.read_part_size)
        if len(starts) == 1:
            self._get(offset, offset + total, offset, views, on_part)
            return
        # Parts in flight at once, through the storage's pool; this thread waits.
        pool = self.storage.read_pool()
        pending: set[Future[None]] = set()
        parts = iter(starts)
        error: BaseException | None = None
        while True:
            while error is None and len(pending) < t.read_concurrency:
                a = next(parts, None)
                if a is None:
                    break
                pending.add(pool.submit(self._get, a, min(a + t.read_part_size, offset + total), offset, views,
                                         on_part))
            if not pending:
                break
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                e = f.exception()
                if e is not None and error is None:
                    error = e  # send no more parts; let the ones in flight finish
        if error is not None:
            raise error

    def _get(self, a: int, b: int, base: int, views: list[memoryview],
             on_part: Callable[[int, int], None] | None) -> None:
        """Object bytes [a, b) into `views` (which hold the bytes from `base` on, one after another).

        One ranged GET whose answer is streamed: each chunk the client hands over (at least
        `_STREAM_CHUNK` bytes, or the rest) is copied straight into the views it covers, the only
        copy between the client and the destination, and its blocks are checked (`on_part`) while
        the next chunk is still on the wire. The client holds one chunk at a time, not the answer. A
        transient failure mid-answer resumes from the first byte not yet landed."""
        import obstore

        s, key = self.storage, self.key
        landed = a
        starts = list(itertools.accumulate((len(v) for v in views), initial=base))

        def fetch() -> None:
            nonlocal landed
            if landed >= b:
                return
            checked = landed
            result = obstore.get(s.store, key, options={"range": (landed, b)})
            for chunk in result.stream(min_chunk_size=_STREAM_CHUNK):
                got = memoryview(chunk)
                n = len(got)
                if n == 0:
                    continue
                if landed + n > b:
                    raise EOFError(f"{s.describe(key)}: asked for bytes {a}..{b}, the store sent more")
                _scatter(got, landed, views, starts)
                if on_part is not None:  # from the previous chunk on: the blocks across the boundary too
                    try:
                        on_part(checked, landed + n)
                    except BaseException as e:  # the caller's error (a checksum), not the store's
                        raise _Passthrough(e) from None
                checked = landed
                landed += n
            if landed != b:
                raise EOFError(f"{s.describe(key)}: asked for bytes {a}..{b}, the store returned "
                               f"{landed - a} bytes")

        try:
            s.call("read", key, fetch)
        except _Passthrough as p:
            raise p.error from None

    def close(self) -> None:
        pass


class ObjectStorage:
    """Storage rooted at an object-store prefix: ``s3://bucket/prefix``, ``gs://...``, ``az://...``.

    Example:

        storage = ObjectStorage("s3://bucket/runs/7", {"endpoint": "http://127.0.0.1:9000",
                                                      "allow_http": True})
        storage.put("a/manifest.json", b"{}", create=True)
    """

    atomic_rename = False
    kind = "object"
    bandwidth: float | None = None  # unless set: measured, else the kind's default (`base.bandwidth_of`)
    vectored_reads: ClassVar[bool] = _ObjectReader.vectored
    in_process: ClassVar[bool] = False
    batch_deletes: ClassVar[bool] = True  # S3 DeleteObjects, Azure blob batches (GCS: one per key, inside obstore)
    dirs: None = None  # keys under a prefix: no folders to rename

    def __init__(self, url: str, options: dict[str, Any] | None = None):
        try:
            from obstore.store import from_url
        except ImportError:
            raise ImportError(
                f"{url}: object-store paths need obstore; install it with `pip install 'cairn-ckpt[cloud]'`"
            ) from None
        scheme, rest = split_url(url)
        if not scheme or not rest.strip("/"):
            raise ValueError(f"{url!r} is not an object-store URL (like s3://bucket/prefix)")
        self.url = url.rstrip("/")
        self.tuning, client, config = split_options(options)
        self.preferred_read: int | None = self.tuning.plan_read_size  # what a load plans its reads up to (`read_size`)
        client_options: Any = client or None
        store_config: Any = config or None
        t = self.tuning
        backoff: Any = {
            "init_backoff": timedelta(seconds=t.retry_backoff),
            "max_backoff": timedelta(seconds=t.max_backoff),
            "base": 2,
        }
        try:
            # Requests cairn retries itself (and counts) go through a store that does not retry...
            self.store = from_url(self.url, config=store_config, client_options=client_options,
                                  retry_config={"max_retries": 0, "backoff": backoff})
            # ...and multipart uploads, whose parts only obstore can resend, through one that does.
            self.upload_store = from_url(self.url, config=store_config, client_options=client_options,
                                         retry_config={"max_retries": t.max_retries, "backoff": backoff})
        except Exception as e:
            raise ValueError(f"{url}: cannot configure the object store: {_summary(e)}") from None
        self._scheme, self._config = scheme, dict(config)
        self.retries = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def read_pool(self) -> ThreadPoolExecutor:
        """Threads for the parts of large reads (started on first use; idle ones cost nothing)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="cairn-get")
            return self._pool

    def __repr__(self) -> str:
        return f"ObjectStorage({self.url!r})"

    def describe(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    # ------------------------------------------------------------------ retries and errors

    def call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run one request, retrying transient failures with backoff; errors name the object."""
        t = self.tuning
        attempt = 0
        while True:
            try:
                return fn()
            except _Passthrough:
                raise
            except Exception as e:
                if _CREDENTIAL_FALLBACK.search(_summary(e)):
                    raise self._no_credentials(key) from None
                if attempt >= t.max_retries or not is_transient(e):
                    raise self._error(op, key, e, attempt) from e
            attempt += 1
            with self._lock:
                self.retries += 1
            wait = min(t.max_backoff, t.retry_backoff * 2 ** (attempt - 1))
            time.sleep(wait / 2 + random.uniform(0, wait / 2))  # jitter spreads out synchronized clients

    def _no_credentials(self, key: str) -> BaseException:
        """The client found no credentials in the settings or the environment and fell back on a cloud
        VM's metadata service, which did not answer: say which settings are missing."""
        env = os.environ
        if self._scheme == "s3":
            given = {k for k in self._config if k in ("access_key_id", "secret_access_key", "aws_access_key_id",
                                                       "aws_secret_access_key")}
            missing = "storage_options 'access_key_id' and 'secret_access_key'" if not given else \
                "storage_options 'access_key_id' or 'secret_access_key' (one of them is set)"
            if not given and not (env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_SECRET_ACCESS_KEY")):
                missing += " (or the environment's AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
            if not (self._config.get("endpoint") or self._config.get("aws_endpoint") or env.get("AWS_ENDPOINT_URL")
                    or env.get("AWS_ENDPOINT")):
                missing += ("; no 'endpoint' is set either (an S3-compatible server such as MinIO needs "
                            "storage_options 'endpoint', with 'allow_http' for http://)")
        elif self._scheme in ("az", "azure", "abfs", "abfss"):
            missing = ("storage_options 'account_name' with 'account_key' (or 'sas_key', or 'use_emulator' "
                       "with 'endpoint' for Azurite)")
        else:
            missing = ("storage_options 'service_account_key' or 'service_account_path' "
                       "(or the environment's GOOGLE_APPLICATION_CREDENTIALS)")
        return NoCredentialsError(
            f"{self.describe(key)}: no credentials for {self._scheme}://: missing {missing}. Without them "
            "the client asks a cloud VM's instance-metadata service, and none answered here. Nothing was written.")

    def _error(self, op: str, key: str, e: BaseException, retries: int) -> BaseException:
        where = self.describe(key)
        if isinstance(e, EOFError):
            return e
        c = _classes()
        if isinstance(e, FileNotFoundError):
            return FileNotFoundError(f"{where}: no such object")
        if isinstance(e, c.exists):
            return FileExistsError(f"{where}: the object already exists")
        if isinstance(e, c.denied):
            return PermissionError(f"{where}: {op} was refused: {_summary(e)}")
        if isinstance(e, ValueError):
            return ValueError(f"{where}: {op}: {_summary(e)}")
        if _NO_BUCKET.search(_summary(e)):  # S3's NoSuchBucket, Azure's ContainerNotFound, GCS's 404 text
            bucket = self.url.split("://", 1)[-1].split("/", 1)[0]
            return NoBucketError(
                f"{where}: the bucket (or container) {bucket!r} does not exist on this store; create it first, "
                f"or check the path and the 'endpoint' setting")
        if _RANGE_NOT_SATISFIABLE in _summary(e):  # a GenericError: no class says so
            return EOFError(f"{where}: {op}: the range starts past the end of the object")
        after = f" after {retries + 1} attempts" if retries else ""
        return OSError(f"{where}: {op} failed{after}: {_summary(e)}")

    # ------------------------------------------------------------------ reads

    def read(self, key: str) -> bytes:
        import obstore

        return bytes(self.call("read", key, lambda: obstore.get(self.store, key).bytes()))

    def open_read(self, key: str) -> _ObjectReader:
        return _ObjectReader(self, key)

    def size(self, key: str) -> int:
        import obstore

        return int(self.call("head", key, lambda: obstore.head(self.store, key))["size"])

    def exists(self, key: str) -> bool:
        """An object named `key`, or any object under ``key/`` (a "folder")."""
        import obstore

        if key:
            try:
                self.size(key)
                return True
            except FileNotFoundError:
                pass

        def any_under() -> bool:
            for chunk in obstore.list(self.store, prefix=key or None, chunk_size=1):
                if chunk:
                    return True
            return False

        return self.call("list", key, any_under)

    def list(self, prefix: str) -> builtins.list[str]:
        import obstore

        def keys() -> list[str]:
            return [m["path"] for chunk in obstore.list(self.store, prefix=prefix or None, chunk_size=1000)
                    for m in chunk]

        return sorted(self.call("list", prefix, keys))

    def list_dir(self, prefix: str) -> builtins.list[str]:
        import obstore

        p = prefix.strip("/")
        res = self.call("list", p, lambda: obstore.list_with_delimiter(self.store, prefix=p or None))
        names = {c.rstrip("/").rsplit("/", 1)[-1] for c in res["common_prefixes"]}
        names.update(m["path"].rsplit("/", 1)[-1] for m in res["objects"])
        return sorted(names)

    # ------------------------------------------------------------------ writes

    def put(self, key: str, data: bytes, *, create: bool = False) -> None:
        import obstore

        data = bytes(data)
        mode: Literal["create", "overwrite"] = "create" if create else "overwrite"
        first = True

        def attempt() -> None:
            nonlocal first
            retrying, first = not first, False
            try:
                obstore.put(self.store, key, data, mode=mode, use_multipart=False)
            except _classes().exists:
                # An earlier attempt may have landed although its answer was lost:
                # the object holding exactly our bytes means the put succeeded.
                if retrying and bytes(obstore.get(self.store, key).bytes()) == data:
                    return
                raise

        self.call("put", key, attempt)

    def write(self, key: str, parts: Iterable[Buffer]) -> int:
        import obstore

        part_size = self.tuning.part_size
        it = iter(parts)
        head: list[memoryview] = []
        size = 0
        for p in it:
            mv = _bytes_view(p)
            head.append(mv)
            size += len(mv)
            if size >= part_size:
                break
        else:
            # Smaller than one part: a single request, which (unlike a stream) can be retried here.
            data = head[0] if len(head) == 1 else b"".join(head)
            self.call("write", key, lambda: obstore.put(self.store, key, data, use_multipart=False))  # noqa: B023
            return size
        total = size
        pump = _Pump(it)

        def stream() -> Iterator[memoryview]:
            nonlocal total
            yield from head
            head.clear()
            for p in pump:
                mv = _bytes_view(p)
                total += len(mv)
                yield mv

        try:
            obstore.put(self.upload_store, key, stream(), use_multipart=True, chunk_size=part_size,
                        max_concurrency=self.tuning.upload_concurrency)
        except Exception as e:
            # Errors raised by `parts` itself come through unchanged; only the store's are ours to explain.
            # obstore also raises builtin OSErrors (FileNotFoundError, ...), told apart from those of
            # `parts` only by its message, which names the request ("Error performing PUT ...").
            if isinstance(e, _classes().obstore) or (isinstance(e, OSError) and "Error performing" in str(e)):
                # When a part fails, obstore aborts the upload and may report the abort's failure instead.
                op = "write (multipart upload failed, then its abort)" if "DELETE" in _summary(e) else "write"
                raise self._error(op, key, e, 0) from e
            raise
        finally:
            pump.close()
        return total

    def delete_prefix(self, prefix: str) -> None:
        """Delete `prefix` and everything under it, shallowest keys first.

        The objects directly under `prefix` go in a request of their own before
        the deeper ones, so a marker at the top of a prefix (a checkpoint's
        manifest) is gone before any of the data it describes: an interrupted
        delete never leaves something that looks complete but is not.
        """
        import obstore

        keys: builtins.list[str] = self.list(prefix)
        if prefix:
            try:
                self.size(prefix)
                keys.append(prefix)
            except FileNotFoundError:
                pass
        if not keys:
            return
        top = min(k.count("/") for k in keys)
        first = [k for k in keys if k.count("/") == top]
        rest = [k for k in keys if k.count("/") != top]
        for batch in (first, rest):
            if batch:
                self.call("delete", prefix, functools.partial(_delete, obstore, self.store, batch))

    def delete_keys(self, keys: builtins.list[str]) -> None:
        """Delete the objects `keys` (exact names; a missing one is no error) in batched requests
        (S3 and Azure: one request per 1000 and 256 keys), not a listing and a HEAD each as
        `delete_prefix` needs."""
        import obstore

        if keys:
            self.call("delete", keys[0], functools.partial(_delete, obstore, self.store, list(keys)))


class _Pump:
    """The parts of a multipart upload after its first, pulled on a thread of cairn's and handed over
    through a short queue to the stream obstore reads.

    obstore iterates a stream on a thread of its own runtime, where any call into obstore panics
    ("Cannot start a runtime from within a runtime"): and producing a part may need one (an
    incremental save reading its base's block to write a delta against it). Here that work runs on
    the pump's thread, and obstore's thread only waits on the queue. `close` stops the pump after at
    most the part it is producing and waits for its thread, so nothing runs on after the write.
    An error raised by the parts is raised, unchanged, from the stream."""

    _END = object()

    def __init__(self, parts: Iterator[Buffer], depth: int = 2) -> None:
        self._queue: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(parts,), name="cairn-upload-parts", daemon=True)
        self._thread.start()

    def _run(self, parts: Iterator[Buffer]) -> None:
        try:
            for p in parts:
                if self._stop.is_set():
                    return
                self._queue.put((p, None))
            self._queue.put((self._END, None))
        except BaseException as e:  # handed to the stream, raised there
            self._queue.put((None, e))

    def __iter__(self) -> Iterator[Buffer]:
        while True:
            p, error = self._queue.get()
            if error is not None:
                raise error
            if p is self._END:
                return
            yield p

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():  # (room in the queue for a part being handed over)
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()


def _delete(obstore: Any, store: Any, keys: list[str]) -> None:
    try:
        obstore.delete(store, keys)
    except FileNotFoundError:
        # GCS and Azure report a missing object (S3 does not); it is what we wanted anyway. But
        # obstore stops at the first error, so the keys after the missing one may still be there
        # (GCS deletes one request per key, Azure in batches of 256): delete them one by one.
        if len(keys) > 1:
            for key in keys:
                try:
                    obstore.delete(store, key)
                except FileNotFoundError:
                    pass


class NoCredentialsError(CheckpointError, PermissionError):
    """No credentials for an object store in the settings or the environment (see `ObjectStorage._no_credentials`)."""


class NoBucketError(CheckpointError):
    """The path's bucket or container does not exist on the object store (see `ObjectStorage._error`)."""


class _Passthrough(Exception):
    """Carries an exception of the caller's (raised in `on_part`) through `call` unchanged."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _scatter(got: memoryview, pos: int, views: list[memoryview], starts: list[int]) -> None:
    """Copy `got` (object bytes from `pos` on) into `views`, which hold the bytes from ``starts[0]`` on
    (``starts[i]``: where view i begins). numpy copies without holding the GIL."""
    i = max(bisect.bisect_right(starts, pos) - 1, 0)
    end = pos + len(got)
    while pos < end and i < len(views):
        lo, hi = pos, min(end, starts[i + 1])
        if lo < hi:
            off = lo - starts[i]
            src = got[lo - (end - len(got)) : hi - (end - len(got))]
            np.copyto(np.frombuffer(views[i][off : off + hi - lo], np.uint8), np.frombuffer(src, np.uint8))
            pos = hi
        i += 1


def _bytes_view(p: Buffer) -> memoryview:
    mv = memoryview(p)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
