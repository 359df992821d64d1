"""Pure: the format's dtype names and its codec for values stored inline in an index.

Arrays are raw little-endian bytes named by dtype (numpy's names, plus the
ml_dtypes ones: bfloat16, float8_*, int4, ...). Scalars, strings and other
small leaves are JSON: integers as decimal strings (exact at any size),
floats as hex (exact, NaN and infinities included), numpy scalars as dtype
plus little-endian hex.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .._errors import CorruptCheckpointError

_STD_DTYPES = {
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
}
_ML_DTYPES = {
    "bfloat16", "int2", "int4", "uint2", "uint4", "float4_e2m1fn", "float6_e2m3fn",
    "float6_e3m2fn", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
}


_names: dict[Any, str | None] = {}


def dtype_name(dtype: np.dtype) -> str | None:
    """The format's name for `dtype`, or None if the format cannot store it."""
    try:
        return _names[dtype]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    name = np.dtype(dtype).name
    out = name if name in _STD_DTYPES or name in _ML_DTYPES else None
    if len(_names) < 1024:
        try:
            _names[dtype] = out
        except TypeError:
            pass
    return out


_parsed: dict[str, np.dtype] = {}


def dtype_from_name(name: Any, where: object = "") -> np.dtype:
    """Parse a dtype name written by `dtype_name` (little-endian)."""
    hit = _parsed.get(name) if type(name) is str else None
    if hit is not None:
        return hit
    dt = _parse_dtype(name, where)
    _parsed[name] = dt  # a few dozen names at most: only valid ones get here
    return dt


def _parse_dtype(name: Any, where: object) -> np.dtype:
    if isinstance(name, str):
        if name in _STD_DTYPES:
            dt = np.dtype(name)
            return dt if sys.byteorder == "little" else dt.newbyteorder("<")
        if name in _ML_DTYPES:
            import ml_dtypes

            t = getattr(ml_dtypes, name, None)
            if t is not None:
                return np.dtype(t)
    raise CorruptCheckpointError(f"{where}unknown or unsupported dtype {name!r}")


VALUE_KINDS = {"none", "bool", "int", "float", "complex", "str", "scalar"}


def value_kind(x: Any) -> str | None:
    """The inline kind for a non-array leaf, or None if it is not an inline value."""
    if x is None:
        return "none"
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int"
    if isinstance(x, float):
        return "float"
    if isinstance(x, complex):
        return "complex"
    if isinstance(x, str):
        return "str"
    if isinstance(x, np.generic) and dtype_name(x.dtype) is not None:
        return "scalar"
    return None


def encode_value(kind: str, x: Any) -> Any:
    if kind in ("none",):
        return None
    if kind in ("bool", "str"):
        return x
    if kind == "int":
        return str(int(x))  # exact for any size, in any JSON reader
    if kind == "float":
        return float(x).hex()
    if kind == "complex":
        return [x.real.hex(), x.imag.hex()]
    if kind == "scalar":
        arr = np.asarray(x)
        return {"dtype": dtype_name(arr.dtype), "hex": arr.astype(arr.dtype.newbyteorder("<")).tobytes().hex()}
    raise ValueError(kind)


def decode_value(kind: str, v: Any, where: object) -> Any:
    try:
        if kind == "none":
            if v is not None:
                raise ValueError("not null")
            return None
        if kind == "bool":
            if not isinstance(v, bool):
                raise ValueError("not a boolean")
            return v
        if kind == "str":
            if not isinstance(v, str):
                raise ValueError("not a string")
            return v
        if kind == "int":
            if not isinstance(v, str) or len(v) > 10_000:
                raise ValueError("not an integer string")
            return int(v)
        if kind == "float":
            return float.fromhex(v)
        if kind == "complex":
            return complex(float.fromhex(v[0]), float.fromhex(v[1]))
        if kind == "scalar":
            dt = dtype_from_name(v["dtype"], f"{where}: ")
            raw = bytes.fromhex(v["hex"])
            if len(raw) != dt.itemsize:
                raise ValueError("wrong byte count")
            return np.frombuffer(raw, dtype=dt)[0]
    except CorruptCheckpointError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
        raise CorruptCheckpointError(f"{where}: bad {kind} value {v!r:.80} ({e})") from None
    raise CorruptCheckpointError(f"{where}: unknown value kind {kind!r}")
