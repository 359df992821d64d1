"""Choosing a leaf's codec by measuring: each candidate codes a sample of the leaf (`sample`), and the
smallest stored size wins within margins that prefer the faster codec (`choose_sized`). The save's
policy around it (which candidates, "auto"'s predicted time) is `_save.codecpolicy`'s."""

from __future__ import annotations

from typing import Any

import numpy as np

from .codecs import CODECS, _check_dtype, blosc2_available, encode

#: `choose` keeps "none" unless a codec stores at most this fraction of the raw sample bytes.
MIN_SAVING = 0.04
#: Among codecs within this fraction of the smallest, `choose` takes the first of `CODECS`.
NEAR = 0.01
#: How many bytes of a leaf `sample` takes (in up to `SAMPLE_PIECES` pieces spread over it).
SAMPLE_BYTES = 256 << 10
SAMPLE_PIECES = 4
#: `choose` takes "blosc2" (where it is a candidate: compression="fast") when its sample stores within this
#: fraction of the smallest codec's: it decodes 3x and encodes 1.3x as fast as "planes" on the TPU
#: host's 12 threads, and stores 0-2% more on f32 moments and 3% (1 MiB blocks) to 4.7% (32 KiB
#: chunks) more on bf16 parameters, whose exponent planes "planes" codes with zstd settings tuned for
#: them (docs/compression.md, "On one core").
BLOSC2_NEAR = 0.05

def sample(a: np.ndarray, nbytes: int = SAMPLE_BYTES, pieces: int = SAMPLE_PIECES) -> np.ndarray:
    """Up to `nbytes` of `a`'s elements, in `pieces` contiguous runs spread evenly over it (flat)."""
    flat = np.ascontiguousarray(a).reshape(-1)
    per = max(1, nbytes // max(1, flat.itemsize) // pieces)
    if flat.size <= per * pieces:
        return flat
    starts = np.linspace(0, flat.size - per, pieces).astype(np.int64)
    return np.concatenate([flat[s:s + per] for s in starts])


def _sample_bytes(sample: np.ndarray, dt: np.dtype) -> np.ndarray:
    raw = np.ascontiguousarray(sample).reshape(-1).view(np.uint8)
    return raw[: raw.nbytes - raw.nbytes % dt.itemsize]


def stored_size(codec: str, dtype: Any, sample: np.ndarray) -> int:
    """How many bytes `sample` (elements of `dtype`) stores as under `codec`, cut into pieces of at most
    1 MiB, each coded as a block."""
    dt = _check_dtype(dtype)
    raw = _sample_bytes(sample, dt)
    step = (1 << 20) - (1 << 20) % dt.itemsize
    return sum(len(encode(codec, raw[i:i + step], dt)) for i in range(0, raw.nbytes, step))


def choose(dtype: Any, sample: np.ndarray) -> str:
    """The codec for a leaf of `dtype`, measured on `sample`: `choose_sized`'s codec."""
    return choose_sized(dtype, sample)[0]


def choose_sized(dtype: Any, sample: np.ndarray, blosc2: bool | None = None) -> tuple[str, int, int]:
    """The codec for a leaf of `dtype`, measured on `sample` (a few blocks' worth of its elements).

    Rule: encode the sample with each codec ("planes" and "zstd", and
    "blosc2" where python-blosc2 is importable and `blosc2` is not False: the
    save passes whether it codes faster than "planes" on the host's cores,
    `_save.codecpolicy.blosc2_faster`; the sample cut into pieces of
    at most 1 MiB, each coded as a block) and take the smallest stored size S.
    If S > (1 - MIN_SAVING) x the raw size (saving under 4%), "none". Else
    "blosc2" if its size is within BLOSC2_NEAR (5%) of S (it codes fastest on
    many cores); else the first of `CODECS` ("planes" before "zstd") whose
    size is within NEAR (1%) of S: planes is the faster of the two at equal
    size, since it skips near-random planes. Never by the dtype alone.
    Returns (codec, the sample's raw bytes, their stored size under that codec).
    """
    dt = _check_dtype(dtype)
    raw = _sample_bytes(sample, dt)
    if raw.nbytes == 0:
        return "none", 0, 0
    candidates = ("planes", "zstd", "blosc2") if blosc2 is not False and blosc2_available() else ("planes", "zstd")
    sizes = {c: stored_size(c, dt, raw) for c in candidates}
    best = min(sizes.values())
    if best > (1 - MIN_SAVING) * raw.nbytes:
        return "none", raw.nbytes, raw.nbytes
    if "blosc2" in sizes and sizes["blosc2"] <= best * (1 + BLOSC2_NEAR):
        return "blosc2", raw.nbytes, sizes["blosc2"]
    codec = next(c for c in CODECS if c in sizes and sizes[c] <= best * (1 + NEAR))
    return codec, raw.nbytes, sizes[codec]
