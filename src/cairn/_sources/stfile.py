"""The safetensors file layout, read: its header, the tensors of one file, and the cairn metadata an export records in it.

A safetensors file is an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the tensors' bytes.
The Hugging Face source (`hf`) and the conversion into cairn
(`_exports.safetensors`) both read files through this module.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import CheckpointError, CorruptCheckpointError
from .._format import manifest as fmt
from .._format import values
from .._storage.location import Location
from .._tree.pytree import escape_key

ST_METADATA_KEY = "cairn"
ST_FORMAT = "cairn-safetensors"
MAX_ST_HEADER = 100 << 20

# cairn dtype name -> safetensors dtype name (the subset safetensors can hold).
TO_ST = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32",
    "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16",
    "float32": "F32", "float64": "F64", "complex64": "C64", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}
FROM_ST = {v: k for k, v in TO_ST.items()}


def parse_safetensors_header(head: bytes, size: int, where: str) -> tuple[dict[str, Any], dict[str, str], int]:
    """Validate a safetensors header; returns (tensors, metadata, data start offset)."""
    if len(head) < 8:
        raise CorruptCheckpointError(f"{where}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_ST_HEADER or 8 + n > size:
        raise CorruptCheckpointError(f"{where}: safetensors header of {n} bytes is too large or truncated")
    try:
        header = json.loads(head[8 : 8 + n])
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(f"{where}: safetensors __metadata__ must map strings to strings")
    data_size = size - 8 - n
    for name, t in header.items():
        ok = (
            isinstance(t, dict) and t.get("dtype") in FROM_ST and isinstance(t.get("shape"), list)
            and all(isinstance(s, int) and s >= 0 for s in t["shape"])
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
        )
        if not ok:
            raise CorruptCheckpointError(f"{where}: tensor {name!r}: malformed or unsupported entry {t!r:.200}")
        lo, hi = t["data_offsets"]
        nbytes = math.prod(t["shape"]) * values.dtype_from_name(FROM_ST[t["dtype"]]).itemsize
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= data_size and hi - lo == nbytes):
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r}: data_offsets {[lo, hi]} do not fit its shape and the file"
            )
    return header, meta, 8 + n


@dataclass
class SrcTensor:
    storage: Any
    key: str
    start: int  # absolute file offset of the tensor's bytes
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def open_st_file(loc: Location, key: str) -> tuple[dict[str, SrcTensor], dict[str, str]]:
    storage = loc.storage
    where = storage.describe(key)
    try:
        size = storage.size(key)
        reader = storage.open_read(key)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise CheckpointError(f"no safetensors file at {where}") from None
    try:
        first = bytearray(8)
        reader.read_into(0, memoryview(first))
        (n,) = struct.unpack("<Q", first)
        if n > MAX_ST_HEADER or 8 + n > size:
            raise CorruptCheckpointError(f"{where}: safetensors header of {n} bytes is too large or truncated")
        head = bytearray(8 + n)
        reader.read_into(0, memoryview(head))
    except EOFError:
        raise CorruptCheckpointError(f"{where}: truncated safetensors file") from None
    finally:
        reader.close()
    header, meta, data_start = parse_safetensors_header(bytes(head), size, where)
    tensors = {
        name: SrcTensor(storage, key, data_start + t["data_offsets"][0],
                         values.dtype_from_name(FROM_ST[t["dtype"]]), tuple(t["shape"]))
        for name, t in header.items()
    }
    return tensors, meta


def items_of_st(tensors: dict[str, SrcTensor], meta: dict[str, str], where: str, fallback: str | None):
    """(root, user metadata, {item: (structure, [leaf specs])}) described by one file."""
    raw = meta.get(ST_METADATA_KEY)
    if raw is None:
        # A plain safetensors file: one flat dict, tensor name -> array.
        names = list(tensors)
        structure = {"dict": [[n, {"leaf": i}] for i, n in enumerate(names)]} if names else {"dict": []}
        flat: list[Any] = [("array", escape_key(n), tensors[n], {}) for n in names]
        return fallback is None, {}, {fallback or "": (structure, flat)}
    try:
        cm = json.loads(raw)
        if cm.get("format") != ST_FORMAT or cm.get("version") != fmt.FORMAT_VERSION:
            raise ValueError(f"unknown format {cm.get('format')!r} version {cm.get('version')!r}")
        items = {}
        for item, d in cm["items"].items():
            leaves: list[Any] = []
            for e in d["leaves"]:
                if "tensor" in e:
                    if e["tensor"] not in tensors:
                        raise ValueError(f"tensor {e['tensor']!r} named by the metadata is missing")
                    extra = {"handler": e.get("handler")}
                    if "impl" in e:
                        extra.update(impl=e["impl"], impl_shape=tuple(e["impl_shape"]))
                    leaves.append((e["kind"], e["path"], tensors[e["tensor"]], extra))
                else:
                    leaves.append(fmt.ValueLeaf(e["path"], e["kind"], values.decode_value(e["kind"], e["value"], where)))
            items[item] = (d["structure"], leaves)
        return bool(cm.get("root")), cm.get("metadata") or {}, items
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{where}: bad cairn metadata in the safetensors header ({e})") from None
