"""The synthetic Llama-style training state every system saves and loads.

The state is a flat mapping of weight matrices named like a Llama checkpoint
(embedding, per-layer attention q/k/v/o, MLP gate/up/down, RMS norms, output
head). Sizes are picked to land near a byte target; the same seed gives the
same values in every subprocess, so all systems write identical bytes.

Shardings over the 8 CPU devices follow what FSDP/TP would do on a 1-D mesh
`x`: column-parallel matrices (q, k, v, gate, up, lm_head) split along axis 1,
row-parallel ones (o, down, embedding) along axis 0, norms replicated. The
"resharded" layout swaps the two, and shards the norms.

The tree is ``{"params": {"embed_tokens": ..., "layers": {"00": {"attn":
{"q": ...}}}}}``: one checkpointable holding a nested parameter tree, as a
training state passes it (leaf names below are the dotted key paths).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

VOCAB = 32000
N_DEVICES = 8


@dataclass(frozen=True)
class Leaf:
    name: str
    shape: tuple[int, ...]
    axis: int | None  # the sharded axis as saved (None: replicated)
    fan_in: int


def _ffn(d: int) -> int:
    # Llama's SwiGLU width, rounded to a multiple of 256 so 8 devices divide it.
    return round(8 * d / 3 / 256) * 256


def _layer_params(d: int) -> int:
    kv = d // 4  # grouped-query attention: 4x fewer key/value heads
    return 2 * d * d + 2 * d * kv + 3 * d * _ffn(d) + 2 * d


def llama_spec(target_bytes: int, itemsize: int) -> list[Leaf]:
    """Leaves of a Llama-like model of about `target_bytes`.

    The widest model dimension (from 2048 down) that still gives at least four
    layers is chosen, then the layer count fills the target.
    """
    params = target_bytes // itemsize
    d = 256
    for cand in (2048, 1024, 512, 256):
        if params - 2 * VOCAB * cand - cand >= 4 * _layer_params(cand):
            d = cand
            break
    layers = max(1, round((params - 2 * VOCAB * d - d) / _layer_params(d)))
    kv, ffn = d // 4, _ffn(d)
    leaves = [Leaf("embed_tokens", (VOCAB, d), 0, d)]
    for i in range(layers):
        p = f"layers.{i:02d}."
        leaves += [
            Leaf(p + "attn.q", (d, d), 1, d),
            Leaf(p + "attn.k", (d, kv), 1, d),
            Leaf(p + "attn.v", (d, kv), 1, d),
            Leaf(p + "attn.o", (d, d), 0, d),
            Leaf(p + "mlp.gate", (d, ffn), 1, d),
            Leaf(p + "mlp.up", (d, ffn), 1, d),
            Leaf(p + "mlp.down", (ffn, d), 0, ffn),
            Leaf(p + "input_norm", (d,), None, 1),
            Leaf(p + "post_attn_norm", (d,), None, 1),
        ]
    leaves += [Leaf("final_norm", (d,), None, 1), Leaf("lm_head", (d, VOCAB), 1, d)]
    return leaves


def spec_bytes(spec: list[Leaf], itemsize: int) -> int:
    return sum(int(np.prod(leaf.shape)) * itemsize for leaf in spec)


def describe(spec: list[Leaf]) -> dict[str, Any]:
    d = spec[0].shape[1]
    layers = sum(1 for leaf in spec if leaf.name.endswith("attn.q"))
    return {"d_model": d, "layers": layers, "vocab": VOCAB, "ffn": _ffn(d), "leaves": len(spec)}


#: The states `make bench` measures: all float32, all bfloat16, or "mixed" (what
#: mixed-precision training keeps: bfloat16 attention and MLP matrices, float32
#: embedding, output head and norms; about 40% of the bytes in bfloat16).
DTYPES = ("float32", "bfloat16", "mixed")


def np_dtype(name: str) -> np.dtype:
    """The dtype of a uniform state; for "mixed", the dtype of its largest leaves (for sizing only)."""
    if name in ("bfloat16", "mixed"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def leaf_dtype(leaf: Leaf, dtype: Any) -> np.dtype:
    """The dtype `leaf` has in a state of `dtype` (a numpy dtype, or one of `DTYPES`)."""
    if isinstance(dtype, str) and dtype == "mixed":
        matrix = len(leaf.shape) == 2 and leaf.name not in ("embed_tokens", "lm_head")
        return np_dtype("bfloat16") if matrix else np.dtype(np.float32)
    return np_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)


def state_bytes(spec: list[Leaf], dtype: Any) -> int:
    return sum(int(np.prod(leaf.shape)) * leaf_dtype(leaf, dtype).itemsize for leaf in spec)


def sized_spec(target_bytes: int, dtype: str) -> list[Leaf]:
    """The Llama-like leaves of about `target_bytes` in a state of `dtype` (one of `DTYPES`)."""
    if dtype != "mixed":
        return llama_spec(target_bytes, np_dtype(dtype).itemsize)
    spec = llama_spec(target_bytes, 2)  # then scaled down to the bytes the float32 leaves add
    return llama_spec(round(target_bytes * target_bytes / state_bytes(spec, dtype)), 2)


def leaf_values(leaf: Leaf, index: int, dtype: np.dtype, seed: int = 0) -> np.ndarray:
    """Deterministic values shaped like trained weights, with random mantissas (plain zstd finds
    nothing to take; the byte-plane codec still codes their exponents, to 0.76x for float32).

    With ``CAIRN_BENCH_VALUES=trained`` (``python -m benchmarks.run --values
    trained``), the values of a trained layer instead (`trained_values`), so
    that sizes on disk and compression are measured on realistic bytes.

    Uniform in +-1/sqrt(fan_in) with all 23 mantissa bits random (built from
    raw PCG64 output, several times faster than drawing normals, which keeps
    state construction cheap next to the timed operations); norms near 1.
    """
    if os.environ.get("CAIRN_BENCH_VALUES", "random") == "trained":
        return trained_values(leaf, index, dtype, seed)
    n = int(np.prod(leaf.shape))
    bits = np.random.Generator(np.random.PCG64([seed, index])).bit_generator.random_raw((n + 1) // 2)
    u = bits.view(np.uint32)[:n]
    u >>= 9
    u |= np.uint32(0x3F800000)  # a float in [1, 2) with a random mantissa
    x = u.view(np.float32)
    x -= np.float32(1.5)
    if leaf.axis is None and len(leaf.shape) == 1:
        x *= np.float32(0.1)
        x += np.float32(1.0)
    else:
        x *= np.float32(2.0 / np.sqrt(leaf.fan_in))
    x = x.reshape(leaf.shape)
    return x if dtype == np.float32 else x.astype(dtype)


#: AdamW steps behind `trained_values` (few: a 2 GiB state must build in reasonable time; the bytes'
#: statistics, which is what compression sees, settle after the first steps).
TRAINED_STEPS = 3


def trained_values(leaf: Leaf, index: int, dtype: np.dtype, seed: int = 0) -> np.ndarray:
    """A parameter as `benchmarks.trained_state` makes one: initialised as a model would be (std 0.02
    for embeddings, 1/sqrt(fan_in) for matrices, ones for norm scales), then AdamW steps, in `dtype`."""
    from .trained_state import _leaf

    cache = os.environ.get("CAIRN_BENCH_VALUES_CACHE")  # set by benchmarks.run: built once per run, not per worker
    if cache:
        name = f"{index}-{np.dtype(dtype).name}-{seed}-{'x'.join(map(str, leaf.shape))}.npy"
        path = os.path.join(cache, name)
        if os.path.exists(path):  # stored as bytes: .npy has no bfloat16
            return np.load(path).view(np.dtype(dtype)).reshape(leaf.shape)
        os.makedirs(cache, exist_ok=True)
        os.environ.pop("CAIRN_BENCH_VALUES_CACHE")
        try:
            out = trained_values(leaf, index, dtype, seed)
        finally:
            os.environ["CAIRN_BENCH_VALUES_CACHE"] = cache
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(out).reshape(-1).view(np.uint8))
        os.replace(tmp, path)
        return out
    rng = np.random.Generator(np.random.PCG64([seed, index, 29]))
    if leaf.axis is None and len(leaf.shape) == 1:
        kind, std = "scale", 0.0
    else:
        kind, std = ("embed", 0.02) if "embed" in leaf.name else ("matrix", 1 / np.sqrt(leaf.fan_in))
    shape = leaf.shape if len(leaf.shape) <= 2 else (leaf.shape[0], int(np.prod(leaf.shape[1:])))
    p, _, _ = _leaf(rng, shape, kind, std, TRAINED_STEPS, np.dtype(dtype), np.dtype(np.float32))
    return p.reshape(leaf.shape)


def fingerprint(a: np.ndarray) -> str:
    """A cheap digest of an array's bytes (for checking loads, outside timed regions)."""
    import zlib

    b = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    step = max(1, len(b) // (1 << 20))
    return f"{zlib.crc32(b[::step].tobytes()):08x}-{zlib.crc32(b[-4096:].tobytes()):08x}"


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{"a.b.c": x} -> {"params": {"a": {"b": {"c": x}}}}."""
    root: dict[str, Any] = {}
    for name, x in flat.items():
        node = root
        *parents, last = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = x
    return {"params": root}


def unnest(tree: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else k)
        else:
            out[prefix] = node

    walk(tree["params"], "")
    return out


# ---------------------------------------------------------------------- JAX


def mesh() -> Any:
    import jax

    devices = np.array(jax.devices()[:N_DEVICES])
    return jax.sharding.Mesh(devices, ("x",))


def sharding_for(leaf: Leaf, m: Any, resharded: bool = False) -> Any:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    axis = leaf.axis
    if resharded:
        if axis is None:
            axis = 0
        elif len(leaf.shape) == 2:
            axis = 1 - axis
    if axis is None:
        return NamedSharding(m, P())
    spec = [None] * len(leaf.shape)
    spec[axis] = "x"
    return NamedSharding(m, P(*spec))


def build_jax(spec: list[Leaf], dtype: Any, seed: int = 0) -> tuple[dict[str, Any], dict[str, str]]:
    """The sharded jax state and a fingerprint per leaf."""
    import jax

    m = mesh()
    state, prints = {}, {}
    for i, leaf in enumerate(spec):
        host = leaf_values(leaf, i, leaf_dtype(leaf, dtype), seed)
        prints[leaf.name] = fingerprint(host)
        state[leaf.name] = jax.make_array_from_callback(
            leaf.shape, sharding_for(leaf, m), lambda idx, h=host: np.array(h[idx])
        )
        del host
    jax.block_until_ready(state)
    return nest(state), prints


def abstract_jax(spec: list[Leaf], dtype: Any, resharded: bool) -> dict[str, Any]:
    import jax

    m = mesh()
    return nest({
        leaf.name: jax.ShapeDtypeStruct(leaf.shape, leaf_dtype(leaf, dtype), sharding=sharding_for(leaf, m, resharded))
        for leaf in spec
    })


def check_jax(loaded: dict[str, Any], prints: dict[str, str], expect_resharded: bool,
              spec: list[Leaf]) -> None:
    """Every leaf has the fingerprint and sharding it should (run after timing)."""
    m = mesh()
    flat = unnest(loaded)
    for leaf in spec:
        a = flat[leaf.name]
        want = sharding_for(leaf, m, expect_resharded)
        if not a.sharding.is_equivalent_to(want, len(leaf.shape)):
            raise AssertionError(f"{leaf.name}: sharding {a.sharding} != {want}")
        got = fingerprint(np.asarray(a))
        if got != prints[leaf.name]:
            raise AssertionError(f"{leaf.name}: loaded values differ ({got} != {prints[leaf.name]})")


# ---------------------------------------------------------------------- torch


def build_torch(spec: list[Leaf], dtype_name: str, seed: int = 0) -> tuple[dict[str, Any], dict[str, str]]:
    """The same values as plain CPU torch tensors (DCP in one process holds whole tensors)."""
    import torch

    state, prints = {}, {}
    for i, leaf in enumerate(spec):
        dtype = leaf_dtype(leaf, dtype_name)
        host = leaf_values(leaf, i, dtype, seed)
        prints[leaf.name] = fingerprint(host)
        if dtype == np_dtype("bfloat16"):
            t = torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(host)
        state[leaf.name] = t
    return nest(state), prints


def torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
