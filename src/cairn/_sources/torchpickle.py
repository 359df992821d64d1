"""Reading what ``torch.save`` wrote, without torch and without running its pickles.

PyTorch DCP's default writer stores each item of a ``.distcp`` file as one
``torch.save`` blob: a zip archive (entries stored, not compressed) holding
``data.pkl`` (a pickle that rebuilds the tensor), ``byteorder`` and the raw
bytes of the tensor's storage in ``data/<key>``. A blob is parsed here from
two small reads (its head and its tail, where the zip's central directory
is), giving the absolute file offset of the tensor's bytes; the bytes
themselves are then read like any other chunk, by range.

``data.pkl`` is unpickled with an allow-list: the tensor rebuild functions
and storage types map to inert stubs that only record their arguments, and
any other global is refused. Plain Python values (an int, a list of dicts)
that DCP saved as bytes come back through a second allow-list of builtins.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from .._errors import CorruptCheckpointError
from .._storage import RandomReader

# torch.save's legacy storage classes, and torch dtypes by their pickled names -> cairn dtype names.
STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
TORCH_DTYPES = {
    n: n for n in (
        "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "uint16",
        "uint32", "uint64", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
        "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    )
}

_HEAD = 4096  # bytes of a blob read at once from each end: data.pkl and the central directory
_LOCAL = struct.Struct("<4s5H3L2H")


class Refused(pickle.UnpicklingError):
    """A pickle asked for something outside the allow-list."""


@dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: str | None  # None for an UntypedStorage (the tensor names its dtype)


@dataclass(frozen=True)
class TensorRef:
    storage: StorageRef
    offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


class _Dtype(str):
    """A torch dtype named in a pickle (only its name is kept)."""


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> TensorRef:
    if not isinstance(storage, StorageRef) or storage.dtype is None:
        raise Refused("_rebuild_tensor_v2 without a typed storage")
    return _tensor(storage, offset, size, stride, storage.dtype)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, _grad: Any, _hooks: Any, dtype: Any,
                *_rest: Any) -> TensorRef:
    if not isinstance(storage, StorageRef) or not isinstance(dtype, _Dtype):
        raise Refused("_rebuild_tensor_v3 without a storage and a dtype")
    return _tensor(storage, offset, size, stride, str(dtype))


def _tensor(storage: StorageRef, offset: Any, size: Any, stride: Any, dtype: str) -> TensorRef:
    ints = (offset, *size, *stride)
    if not all(isinstance(v, int) and v >= 0 for v in ints) or len(size) != len(stride):
        raise Refused("a tensor with a malformed shape or strides")
    return TensorRef(storage, offset, tuple(size), tuple(stride), dtype)


class _StorageType:
    def __init__(self, dtype: str | None):
        self.dtype = dtype


class _TensorUnpickler(pickle.Unpickler):
    """data.pkl of a saved tensor: the rebuild call, its storage and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageType(None)
        if module == "torch" and name in TORCH_DTYPES:
            return _Dtype(name)
        raise Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)):
            raise Refused(f"persistent id {pid!r:.80}")
        return StorageRef(pid[2], pid[1].dtype)


class _ValueUnpickler(pickle.Unpickler):
    """A plain Python value: builtin containers and scalars only."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "builtins" and name == "complex":
            return complex
        raise Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("a tensor inside a value")


class _BlobFile(io.RawIOBase):
    """Bytes [base, base + length) of a file, seekable, with its head and tail read once."""

    def __init__(self, reader: RandomReader, base: int, length: int):
        self.reader, self.base, self.length, self.pos = reader, base, length, 0
        self._cache: list[tuple[int, bytes]] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def _window(self, lo: int, hi: int) -> tuple[int, bytes] | None:
        for start, data in self._cache:
            if start <= lo and hi <= start + len(data):
                return start, data
        for start in (0, max(0, self.length - _HEAD)):
            end = min(self.length, start + _HEAD)
            if start <= lo and hi <= end:
                self._cache.append((start, self._fetch(start, end - start)))
                return self._cache[-1]
        return None

    def _fetch(self, start: int, n: int) -> bytes:
        buf = bytearray(n)
        self.reader.read_into(self.base + start, memoryview(buf))
        return bytes(buf)

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        if n:
            w = self._window(self.pos, self.pos + n)
            if w is not None:
                start, data = w
                b[:n] = data[self.pos - start : self.pos - start + n]
            else:
                b[:n] = self._fetch(self.pos, n)
            self.pos += n
        return n


@dataclass
class Blob:
    """One parsed torch.save blob: its pickle and where its storages' bytes are."""

    pickle: bytes
    data: dict[str, tuple[int, int]]  # storage key -> (absolute file offset, bytes)


def parse_blob(reader: RandomReader, base: int, length: int, where: str) -> Blob | None:
    """Parse the torch.save blob at `base`; None if it is not a zip (raw bytes)."""
    f = _BlobFile(reader, base, length)
    try:
        if length < 4 or f.read(4) != b"PK\x03\x04":
            return None
        zf = zipfile.ZipFile(f)  # reads the end record and central directory (the tail)
        infos = zf.infolist()
        pkl = next((i for i in infos if i.filename.rsplit("/", 1)[-1] == "data.pkl"), None)
        if pkl is None:
            raise CorruptCheckpointError(f"{where}: a torch.save blob without data.pkl")
        prefix = pkl.filename[: -len("data.pkl")]
        order = next((i for i in infos if i.filename == prefix + "byteorder"), None)
        if order is not None and zf.read(order).strip() not in (b"little", b""):
            raise CorruptCheckpointError(f"{where}: tensors stored big-endian are not supported")
        data = {}
        for i in infos:
            rest = i.filename[len(prefix):]
            if not i.filename.startswith(prefix) or not rest.startswith("data/"):
                continue
            if i.compress_type != zipfile.ZIP_STORED:
                raise CorruptCheckpointError(f"{where}: a compressed tensor record ({i.filename!r})")
            f.seek(i.header_offset)
            head = f.read(_LOCAL.size)
            if len(head) != _LOCAL.size or head[:4] != b"PK\x03\x04":
                raise CorruptCheckpointError(f"{where}: bad zip local header for {i.filename!r}")
            fields = _LOCAL.unpack(head)
            start = i.header_offset + _LOCAL.size + fields[-2] + fields[-1]
            if start + i.file_size > length:
                raise CorruptCheckpointError(f"{where}: record {i.filename!r} runs past its blob")
            data[rest[len("data/"):]] = (base + start, i.file_size)
        return Blob(zf.read(pkl), data)
    except (zipfile.BadZipFile, struct.error, ValueError, KeyError) as e:
        raise CorruptCheckpointError(f"{where}: not a readable torch.save blob ({e})") from None


def tensor_of(blob: Blob, where: str) -> tuple[TensorRef, int]:
    """The tensor a blob holds and the absolute offset of its first byte (C order checked)."""
    try:
        ref = _TensorUnpickler(io.BytesIO(blob.pickle)).load()
    except Refused as e:
        raise CorruptCheckpointError(f"{where}: the tensor's pickle refers to {e}, which cairn does not "
                                     "unpickle (it never runs code from a checkpoint)") from None
    except Exception as e:
        raise CorruptCheckpointError(f"{where}: unreadable tensor pickle ({type(e).__name__}: {e})") from None
    if not isinstance(ref, TensorRef):
        raise CorruptCheckpointError(f"{where}: the blob holds a {type(ref).__name__}, not a tensor")
    if ref.storage.key not in blob.data:
        raise CorruptCheckpointError(f"{where}: storage {ref.storage.key!r} is missing from the blob")
    return ref, blob.data[ref.storage.key][0]


def is_c_order(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    want = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n > 1 and s != want:
            return False
        want *= n
    return True


def storage_fits(ref: TensorRef, blob: Blob, itemsize: int) -> bool:
    _start, nbytes = blob.data[ref.storage.key]
    return (ref.offset + math.prod(ref.shape)) * itemsize <= nbytes


def value_of(data: bytes) -> Any:
    """A plain value from a pickle; `Refused` if it needs anything but builtins."""
    return _ValueUnpickler(io.BytesIO(data)).load()
