"""A realistic "trained" training state for size and codec measurements (numpy only).

Random bytes hide what compression does to a checkpoint; tiled or repeated
values flatter it. This module builds what a short training run leaves behind,
with neither: the parameters of a small GPT-like model initialised as a model
would be, then `steps` AdamW steps (optax's ``adamw`` arithmetic, weight decay
on matrices only) with gradients at a realistic scale, and the optimizer state
optax keeps (first and second moments, the step count).

- Initialisation: matrices normal with std 0.02 (embedding, output head) or
  fan-in scaling ``1/sqrt(fan_in)`` (attention and MLP, with the GPT-2 style
  ``1/sqrt(2 * layers)`` on the residual projections); layer-norm scales 1,
  layer-norm offsets and biases 0.
- Gradients: per tensor, a log-uniform scale in [1e-3, 1e-2]; per row a
  log-normal factor (rows differ); each step a persistent direction plus fresh
  noise (so the first moment is not pure noise). Embedding rows are touched
  only when their token is in the batch (Zipf token frequencies): rare
  tokens' rows keep zero moments and unchanged parameters, as in real runs.
- Updates in float32 from the stored parameters, then cast back to the
  parameter dtype each step (pure-bf16 training: small updates may round away,
  as they do on a device).

Variants (`VARIANTS`): ``"bf16-f32"`` bf16 params with f32 moments (mixed
precision, optax's default moment dtype), ``"bf16-bf16"`` bf16 params and
moments (``mu_dtype=bf16`` style), ``"f32"`` everything f32.

``make_state(total_bytes, variant, seed)`` returns a nested dict of numpy
arrays ``{"params": {...}, "opt_state": {"mu": {...}, "nu": {...}, "count":
int32 array}}`` of about `total_bytes` raw bytes; the same arguments give the
same bytes. `flatten` gives ``{dotted key: array}``.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)

#: variant -> (parameter dtype, moment dtype)
VARIANTS: dict[str, tuple[np.dtype, np.dtype]] = {
    "bf16-f32": (BF16, F32),
    "bf16-bf16": (BF16, BF16),
    "f32": (F32, F32),
}

LR, B1, B2, EPS, WD = 3e-4, 0.9, 0.95, 1e-8, 0.1


def model_spec(n_params: int) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], str, float]]]:
    """Dimensions and leaves ``(name, shape, kind, init std)`` of a GPT-like model of about `n_params`.

    kind is "matrix" (decayed), "embed" (sparse gradient rows), "scale" (init 1) or "bias" (init 0).
    """
    d = 64
    for cand in (1024, 768, 512, 384, 256, 128, 64):
        vocab = min(32768, 32 * cand)
        if n_params >= 2 * vocab * cand + 2 * 12 * cand * cand:  # at least two layers
            d = cand
            break
    vocab = min(32768, 32 * d)
    per_layer = 12 * d * d + 13 * d
    layers = max(1, round((n_params - 2 * vocab * d - 2 * d) / per_layer))
    leaves: list[tuple[str, tuple[int, ...], str, float]] = [("embed", (vocab, d), "embed", 0.02)]
    resid = 1 / math.sqrt(d) / math.sqrt(2 * layers)
    for i in range(layers):
        p = f"layers.{i:02d}."
        leaves += [
            (p + "ln1.scale", (d,), "scale", 0.0), (p + "ln1.bias", (d,), "bias", 0.0),
            (p + "attn.qkv", (d, 3 * d), "matrix", 1 / math.sqrt(d)), (p + "attn.qkv_bias", (3 * d,), "bias", 0.0),
            (p + "attn.out", (d, d), "matrix", resid), (p + "attn.out_bias", (d,), "bias", 0.0),
            (p + "ln2.scale", (d,), "scale", 0.0), (p + "ln2.bias", (d,), "bias", 0.0),
            (p + "mlp.up", (d, 4 * d), "matrix", 1 / math.sqrt(d)), (p + "mlp.up_bias", (4 * d,), "bias", 0.0),
            (p + "mlp.down", (4 * d, d), "matrix", resid / 2), (p + "mlp.down_bias", (d,), "bias", 0.0),
        ]
    leaves += [("final_ln.scale", (d,), "scale", 0.0), ("final_ln.bias", (d,), "bias", 0.0),
               ("lm_head", (d, vocab), "matrix", 0.02)]
    return {"d_model": d, "layers": layers, "vocab": vocab}, leaves


def _leaf(rng: np.random.Generator, shape: tuple[int, ...], kind: str, std: float, steps: int,
          pdt: np.dtype, mdt: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = int(np.prod(shape))
    if kind == "scale":
        p = np.ones(shape, F32)
    elif kind == "bias":
        p = np.zeros(shape, F32)
    else:
        p = rng.standard_normal(shape, dtype=F32)
        p *= np.float32(std)
    p = p.astype(pdt)
    rows = shape[0] if len(shape) == 2 else 1
    scale = np.float32(10 ** rng.uniform(-3, -2))
    row_scale = np.exp(rng.normal(0, 0.5, size=(rows, 1))).astype(F32)
    persistent = rng.standard_normal((rows, n // rows), dtype=F32)
    touched = None
    if kind == "embed":  # token frequencies ~ Zipf; a row gets a gradient when its token is in the batch
        freq = 1.0 / np.arange(1, rows + 1)
        freq /= freq.sum()
        p_row = 1.0 - np.exp(-8192 * freq)  # 8192 tokens a batch
        touched = rng.random((steps, rows)) < p_row[rng.permutation(rows)]
    mu = np.zeros((rows, n // rows), F32)
    nu = np.zeros((rows, n // rows), F32)
    for t in range(1, steps + 1):
        g = rng.standard_normal((rows, n // rows), dtype=F32)
        g *= np.float32(0.8)
        g += np.float32(0.6) * persistent
        g *= row_scale * scale
        if touched is not None:
            g *= touched[t - 1][:, None]
        mu *= np.float32(B1)
        mu += np.float32(1 - B1) * g
        g *= g
        nu *= np.float32(B2)
        nu += np.float32(1 - B2) * g
        if mdt != F32:  # the optimizer stores its moments in mdt between steps
            mu = mu.astype(mdt).astype(F32)
            nu = nu.astype(mdt).astype(F32)
        mhat = mu / np.float32(1 - B1**t)
        vhat = nu / np.float32(1 - B2**t)
        np.sqrt(vhat, out=vhat)
        vhat += np.float32(EPS)
        mhat /= vhat
        pf = p.reshape(rows, -1).astype(F32)
        if kind in ("matrix", "embed"):
            mhat += np.float32(WD) * pf
        pf -= np.float32(LR) * mhat
        p = pf.reshape(shape).astype(pdt)
    return p, mu.reshape(shape).astype(mdt), nu.reshape(shape).astype(mdt)


def make_state(total_bytes: int = 64 << 20, variant: str = "bf16-f32", seed: int = 0,
               steps: int = 20) -> dict[str, Any]:
    """A trained-like state of about `total_bytes` raw bytes (params + moments); see the module doc."""
    pdt, mdt = VARIANTS[variant]
    _, leaves = model_spec(total_bytes // (pdt.itemsize + 2 * mdt.itemsize))
    params: dict[str, Any] = {}
    mu: dict[str, Any] = {}
    nu: dict[str, Any] = {}

    def one(i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        _, shape, kind, std = leaves[i]
        return _leaf(np.random.Generator(np.random.PCG64([seed, i])), shape, kind, std, steps, pdt, mdt)

    # Each leaf has its own generator, so building them on threads (numpy releases the GIL for large
    # arrays) gives the same bytes in a fraction of the time on a many-core host.
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        built = list(pool.map(one, range(len(leaves))))
    for (name, _, _, _), (p, m, v) in zip(leaves, built):
        _put(params, name, p)
        _put(mu, name, m)
        _put(nu, name, v)
    return {"params": params, "opt_state": {"mu": mu, "nu": nu, "count": np.array(steps, np.int32)}}


def _put(root: dict[str, Any], name: str, x: Any) -> None:
    *parents, last = name.split(".")
    for p in parents:
        root = root.setdefault(p, {})
    root[last] = x


def flatten(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """{"a.b.c": array} for a nested dict of arrays."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, np.ndarray] = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else k))
    return out


def leaf_kind(name: str) -> str:
    """"params", "mu", "nu" or "count": which part of the state a dotted key belongs to."""
    if name.startswith("opt_state.mu."):
        return "mu"
    if name.startswith("opt_state.nu."):
        return "nu"
    return "count" if name == "opt_state.count" else "params"


def raw_bytes(tree: Any) -> int:
    return sum(a.nbytes for a in flatten(tree).values())



def tiles(flat: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    """Up to `count` 256x256 tiles cut from the 2-d leaves of a flattened state, keyed "leaf.row.col"."""
    out: dict[str, np.ndarray] = {}
    for name, a in flat.items():
        if a.ndim != 2:
            continue
        for i in range(0, a.shape[0] - 255, 256):
            for j in range(0, a.shape[1] - 255, 256):
                out[f"{name}.{i}.{j}"] = np.ascontiguousarray(a[i:i + 256, j:j + 256])
                if len(out) >= count:
                    return out
    if count > 0 and not out:
        shapes = sorted({a.shape for a in flat.values() if a.ndim == 2}, key=min)
        raise ValueError(f"no 256x256 tile fits in a 2-d leaf of this state (the squarest: "
                         f"{shapes[-1] if shapes else 'none'}): make the state larger")
    return out

if __name__ == "__main__":
    import sys
    import time

    t0 = time.perf_counter()
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
    for v in VARIANTS:
        s = make_state(size, v)
        dims, _ = model_spec(size // (VARIANTS[v][0].itemsize + 2 * VARIANTS[v][1].itemsize))
        print(v, dims, f"{raw_bytes(s) / 2**20:.1f} MiB", f"{time.perf_counter() - t0:.1f} s")
