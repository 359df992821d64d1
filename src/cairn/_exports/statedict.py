"""cairn -> a PyTorch state-dict file, streamed one slab at a time.

The file is written in the zip layout ``torch.save`` writes (a pickle that
names each tensor's storage, then each storage's raw bytes as a stored zip
member, 64-byte aligned), so ``torch.load(..., weights_only=True, mmap=True)``
reads it. The pickle holds placeholders that pickle as the calls torch makes
to rebuild its tensors; the tensor bytes are read from the checkpoint and
written to the zip in slabs, so the whole state is never in memory.
"""

from __future__ import annotations

import collections
import math
import os
import secrets
import struct
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._core.buffers import as_view
from .._core.stats import Progress
from .._errors import CheckpointError, UnsupportedTypeError
from .._format import manifest as fmt
from .._format import values
from .._load.reader import DEFAULT_BUDGET, ChunkReader, iter_array, make_reader, slab_bytes
from .._load.source import open_checkpoint
from .._read.metadata import Opened
from .._storage import staged_file
from .._storage.location import resolve
from .._tree.pytree import display_path, unescape_key
from .._tree.torchconv import import_torch

_LEGACY_STORAGE = {
    "float32": "FloatStorage", "float64": "DoubleStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage",
    "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage",
    "complex64": "ComplexFloatStorage", "complex128": "ComplexDoubleStorage",
}
_TORCH_ONLY_V3 = {
    "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2", "float8_e4m3fnuz": "float8_e4m3fnuz", "float8_e5m2fnuz": "float8_e5m2fnuz",
    "float8_e8m0fnu": "float8_e8m0fnu",
}


class _StorageRef:
    def __init__(self, key: str, dtype_name: str, numel: int, nbytes: int):
        self.key, self.dtype_name, self.numel, self.nbytes = key, dtype_name, numel, nbytes


class _TensorRef:
    """Pickles as the call ``torch.load`` makes to rebuild a CPU tensor from storage `key`."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce__(self) -> Any:
        torch = import_torch()
        strides = tuple(int(s) for s in np.cumprod((1, *self.shape[:0:-1]))[::-1]) if self.shape else ()
        args: tuple[Any, ...] = (self.storage, 0, tuple(self.shape), strides, False, collections.OrderedDict())
        name = self.storage.dtype_name
        if name in _LEGACY_STORAGE:
            return torch._utils._rebuild_tensor_v2, args
        return torch._utils._rebuild_tensor_v3, (*args, getattr(torch, _TORCH_ONLY_V3[name]))


def to_torch_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    sep: str = ".",
    budget_bytes: int = DEFAULT_BUDGET,
    threads: int = 4,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> str:
    """Write checkpoint `src` as a PyTorch state-dict file for ``torch.load(dst)``.

    The file holds one flat dict: key paths joined with `sep` (prefixed by the
    checkpointable's name) map to tensors, and to Python values for the
    non-array leaves. It is written in the format ``torch.save`` writes, one
    slab at a time, so it loads with ``weights_only=True`` and ``mmap=True``.

    `on_total(n)` gets the bytes of tensor data to write, `progress(n)` each `n` of them written;
    listeners added with ``progress=True`` get ``"export_torch"`` progress events.
    """
    import io
    import pickle

    torch = import_torch()
    ck = open_checkpoint(src, storage_options)
    out_loc = resolve(dst, storage_options)
    slab = slab_bytes(budget_bytes)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="cairn-convert") as pool:
        readers = {i: make_reader(ck, i, pool) for i in ck.indexes}
        try:
            state, plan = _torch_state(ck, readers, sep)
            tracker = Progress("export_torch", os.fspath(dst))
            on_total, progress = tracker.wrap(on_total, progress)
            on_total(sum(leaf.nbytes for _item, leaf, _key in plan))

            class _Pickler(pickle.Pickler):
                def persistent_id(self, obj: Any) -> Any:
                    if isinstance(obj, _StorageRef):
                        if obj.dtype_name in _LEGACY_STORAGE:
                            cls = getattr(torch, _LEGACY_STORAGE[obj.dtype_name])
                        else:
                            cls = torch.storage.UntypedStorage
                        return ("storage", cls, obj.key, "cpu", obj.numel)
                    return None

            pkl = io.BytesIO()
            _Pickler(pkl, protocol=2).dump(state)
            # The member names and small records are the ones torch.save writes. The
            # archive needs a seekable file; it appears at `dst` only once complete.
            with staged_file(out_loc.storage, out_loc.name, slab) as f, \
                    zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
                _zip_put(zf, "archive/data.pkl", pkl.getvalue())
                _zip_put(zf, "archive/.format_version", b"1")
                _zip_put(zf, "archive/.storage_alignment", b"64")
                _zip_put(zf, "archive/byteorder", b"little")
                for item, leaf, skey in plan:
                    with _zip_open_aligned(zf, f"archive/data/{skey}", leaf.nbytes) as w:
                        for arr in iter_array(readers[item], leaf, slab, pool):
                            w.write(as_view(arr.reshape(-1).view(np.uint8)))
                            n = arr.nbytes
                            del arr  # not alive while the next slab is read
                            if progress is not None:
                                progress(n)
                _zip_put(zf, "archive/version", b"3\n")
                _zip_put(zf, "archive/.data/serialization_id", secrets.token_hex(20).encode())
        finally:
            for r in readers.values():
                r.close()
    tracker.finish()
    return out_loc.storage.describe(out_loc.name)


def _torch_state(ck: Opened, readers: dict[str, ChunkReader], sep: str):
    """The flat state dict to pickle (with tensor placeholders) and the tensors to stream."""
    state: dict[str, Any] = {}
    plan: list[tuple[str, fmt.ArrayLeaf, str]] = []
    for item, index in ck.indexes.items():
        for leaf in index.leaves:
            comps = [unescape_key(c) for c in leaf.path.split("/")] if leaf.path else []
            if not ck.manifest.root:
                comps.insert(0, item)
            key = sep.join(comps) or "%root"
            if key in state:
                raise CheckpointError(f"{ck.loc.path}: two leaves map to the state-dict key {key!r}; choose another sep")
            if isinstance(leaf, fmt.ValueLeaf):
                v = leaf.value
                state[key] = v.item() if isinstance(v, np.generic) else v
                continue
            if leaf.kind in ("bytes", "object"):  # their (small) bytes, as Python bytes; keys: their uint32 data
                state[key] = readers[item].read_bytes(leaf)
                continue
            name = values.dtype_name(leaf.dtype) or ""
            if name not in _LEGACY_STORAGE and name not in _TORCH_ONLY_V3:
                raise UnsupportedTypeError(
                    f"{ck.loc.path}: leaf {display_path(leaf.path)!r} has dtype {name}, which PyTorch cannot hold"
                )
            skey = str(len(plan))
            numel = math.prod(leaf.shape)
            ref = _StorageRef(skey, name, numel if name in _LEGACY_STORAGE else leaf.nbytes, leaf.nbytes)
            state[key] = _TensorRef(ref, leaf.shape)
            plan.append((item, leaf, skey))
    return state, plan


def _zip_put(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    with _zip_open_aligned(zf, name, len(data)) as w:
        w.write(data)


def _zip_open_aligned(zf: zipfile.ZipFile, name: str, size: int, align: int = 64) -> Any:
    """Open a stored zip member whose data starts at a multiple of `align` (for mmap loads)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    info.CRC = info.compress_size = 0  # set for real when the member is closed
    zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # the rule ZipFile.open applies
    start = zf.start_dir
    header = len(info.FileHeader(zip64))
    pad = -(start + header + 4) % align  # 4: the padding field's own id and length
    info.extra = struct.pack("<HH", 0xCA1D, pad) + b"\0" * pad
    return zf.open(info, "w", force_zip64=zip64)
