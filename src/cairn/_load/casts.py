"""Casts on load: a stored array read into a target of another dtype, refused where values would change.

A load casts when the target's dtype differs from the saved one. Most casts
keep every value: widening (int8 -> int32, float32 -> float64), float to
float (float32 -> bfloat16 rounds but keeps magnitudes), int to float, bool
to anything. The ones that can destroy values silently are refused with a
`MismatchError` naming the leaf, both dtypes and one value, unless the load
says ``cast="unsafe"``:

- float (or complex) to integer, always: the fraction goes, and the target
  type says the value was never meant to be an integer;
- complex to float: the imaginary part goes;
- integer to a narrower or other-signed integer, or anything to bool, where
  some value does not fit (int64 steps into an int32 target load silently
  while they fit);
- any cast that overflows: a finite value that becomes inf or NaN (1e6 into
  float16, 70000 into float16, 1e300 into float32). float32 -> bfloat16 is
  not checked: their ranges differ only in rounding at the very top.

The decision is taken from the two dtypes first, so a cast that can never
lose values (widening, float32 -> bfloat16) costs no look at the data; only
casts that might lose values look at them: one vectorised pass over the
piece being cast (an `isfinite` over the cast values for float64 -> float32,
a min and max for int64 -> int32).
"""

from __future__ import annotations

import warnings
from typing import Any

import ml_dtypes
import numpy as np

from .._errors import MismatchError

#: The values of ``cast=`` (`cairn.load`, `LoadOptions`): "safe" refuses value-changing casts, "unsafe"
#: casts as numpy's ``astype`` does.
CASTS = ("safe", "unsafe")


def check_cast_option(cast: Any) -> None:
    if cast not in CASTS:
        raise ValueError(f"cast must be 'safe' (refuse casts that change values) or 'unsafe' (cast as "
                         f"numpy's astype does), got {cast!r}")


def _kind(d: np.dtype) -> str:
    """'b', 'i', 'u', 'f', 'c', or '' for a dtype this module does not judge."""
    if d.kind in "biufc":
        return d.kind
    if d.kind == "V":  # ml_dtypes
        if d.name.startswith(("float", "bfloat")):
            return "f"
        if d.name.startswith("uint"):
            return "u"
        if d.name.startswith("int"):
            return "i"
    return ""


def _largest(d: np.dtype, kind: str) -> float:
    """The largest finite value of `d`."""
    if kind in "iu":
        return float(ml_dtypes.iinfo(d).max)
    if kind == "c":
        d = np.dtype(np.float32 if d == np.complex64 else np.float64)
    return float(ml_dtypes.finfo(d).max)


def _show(x: Any) -> str:
    try:
        v = x.item()
    except (AttributeError, TypeError, ValueError):
        v = x
    return repr(v)


def _example(src: np.ndarray, out: np.ndarray | None, dtype: np.dtype, mask: np.ndarray | None) -> str:
    """'5610.0 becomes -22', for the first element `mask` marks (the first element without one)."""
    flat = src.reshape(-1)
    i = int(np.flatnonzero(mask.reshape(-1))[0]) if mask is not None else 0
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = out.reshape(-1)[i] if out is not None else flat[i:i + 1].astype(dtype)[0]
    return f"{_show(flat[i])} becomes {_show(got)}"


def cast(src: np.ndarray, dtype: np.dtype, where: str, unsafe: bool = False) -> np.ndarray:
    """`src` as `dtype`; a `MismatchError` (naming `where`: the checkpoint and the leaf) if the cast
    would change a value and not `unsafe`."""
    if src.dtype == dtype:
        return src
    if unsafe or src.size == 0:
        return src.astype(dtype)
    s, d = _kind(src.dtype), _kind(dtype)
    why: str | None = None
    mask: np.ndarray | None = None
    if not s or not d or s == "b":
        pass  # bool widens into anything; kinds this module does not know are numpy's business
    elif d == "b":
        mask = (src != 0) & (src != 1)
        why = "only 0 and 1 are bools"
    elif s in "fc" and d in "iu":
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            changed = np.asarray(src.astype(dtype) != src)
        what = "float" if s == "f" else "complex"
        why = (f"a {what} array loaded as integers loses what is not a whole number in range" if changed.any() else
               f"a {what} array loads as integers only when asked, even when (as here) every value fits")
        raise _refused(src, dtype, where, why, _example(src, None, dtype, changed if changed.any() else None))
    elif s == "c" and d == "f":
        nonzero = src.imag != 0
        raise _refused(src, dtype, where, "a complex array loaded as floats loses its imaginary part",
                       _example(src, None, dtype, nonzero if nonzero.any() else None))
    elif s in "iu" and d in "iu":
        sinfo, dinfo = ml_dtypes.iinfo(src.dtype), ml_dtypes.iinfo(dtype)
        dlo, dhi = int(dinfo.min), int(dinfo.max)
        if int(sinfo.min) < dlo or int(sinfo.max) > dhi:  # narrower, or another sign: the values decide
            wide = src if src.dtype.kind in "iu" else src.astype(np.int64)  # ml_dtypes' int2/int4
            if int(wide.min()) < dlo or int(wide.max()) > dhi:
                mask = (wide < dlo) | (wide > dhi)
                why = f"values outside {dtype.name}'s range [{dlo}, {dhi}] wrap"
    if why is not None and mask is not None and mask.any():
        raise _refused(src, dtype, where, why, _example(src, None, dtype, mask))
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported below, as an error
        out = src.astype(dtype)
    if s in ("i", "u", "f", "c") and d in ("f", "c") and 2 * _largest(dtype, d) < _largest(src.dtype, s) \
            and not np.isfinite(out).all():
        # Only a target of much smaller range can overflow (float16, float8, float64 -> float32; not
        # float32 -> bfloat16, whose largest finite is float32's rounded): the check runs on the cast values.
        over = ~np.isfinite(out) & np.isfinite(src)
        if over.any():
            raise _refused(src, dtype, where, f"values beyond {dtype.name}'s largest finite "
                           f"{_largest(dtype, d):g} become inf or nan", _example(src, out, dtype, over))
    return out


def _refused(src: np.ndarray, dtype: np.dtype, where: str, why: str, example: str) -> MismatchError:
    return MismatchError(
        f"{where} is {src.dtype.name} in the checkpoint but {np.dtype(dtype).name} in the target, and the cast "
        f"would change values: {why} (e.g. {example}). Give the target the checkpoint's dtype, or pass "
        "cast='unsafe' to cast as numpy does")


__all__ = ["CASTS", "cast", "check_cast_option"]
