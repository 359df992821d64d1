"""The few places that need JAX objects: shardings, boxes and device transfers.

JAX is imported lazily, so that numpy-only loads work without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._plan import Box


def slices_to_box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    out = []
    for sl, n in zip(index, shape):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {sl} is not supported")
        out.append((start, max(stop, start)))
    # Indices may omit trailing axes.
    out.extend((0, n) for n in shape[len(out):])
    return tuple(out)


def box_to_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


_dmap_cache: dict[tuple[Any, tuple[int, ...]], tuple[list[Any], list[Box]]] = {}


def device_boxes(sharding: Any, shape: tuple[int, ...]) -> tuple[list[Any], list[Box]]:
    """All devices of `sharding` in its order, and the box each holds."""
    key: tuple[Any, tuple[int, ...]] | None = (sharding, shape)
    try:
        hit = _dmap_cache.get(key)  # type: ignore[arg-type]
    except TypeError:  # unhashable sharding
        hit, key = None, None
    if hit is not None:
        return hit
    dmap = sharding.devices_indices_map(shape)
    devices = list(dmap)
    boxes = [slices_to_box(dmap[d], shape) for d in devices]
    if key is not None:
        if len(_dmap_cache) > 4096:
            _dmap_cache.clear()
        _dmap_cache[key] = (devices, boxes)
    return devices, boxes


def describe_sharding(sharding: Any) -> dict[str, Any]:
    """A JSON description of a sharding, for humans and tools (never used to load)."""
    import jax

    out: dict[str, Any] = {"type": type(sharding).__name__, "num_devices": len(sharding.device_set)}
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        out["mesh"] = {"axis_names": [str(a) for a in mesh.axis_names], "shape": [int(s) for s in mesh.devices.shape]}
        out["spec"] = [_spec_entry(p) for p in sharding.spec]
    elif isinstance(sharding, jax.sharding.SingleDeviceSharding):
        out["device"] = str(next(iter(sharding.device_set)))
    return out


def _spec_entry(p: Any) -> Any:
    if p is None:
        return None
    if isinstance(p, (tuple, list)):
        return [str(x) for x in p]
    return str(p)


def host_view(a: Any) -> np.ndarray:
    """A host numpy view of single-device array `a`; zero-copy on CPU.

    On an accelerator the bytes are copied into a CPU jax.Array first, so that
    the host copy is freed as soon as the caller drops it (numpy views of
    device arrays are cached on the array for its whole life).
    """
    if a.device.platform == "cpu":
        return np.asarray(a)
    import jax

    return np.asarray(jax.device_put(a, jax.devices("cpu")[0]))


def start_host_copy(a: Any) -> Any:
    """Begin a device-to-host copy of `a`; returns an object `host_view` accepts."""
    if a.device.platform == "cpu":
        return a
    import jax

    return jax.device_put(a, jax.devices("cpu")[0])


def device_copy(a: Any) -> Any:
    """A copy of single-device array `a` in a new buffer on the same device.

    Donating or deleting `a` afterwards cannot change the copy.
    """
    import jax.numpy as jnp

    return jnp.array(a, copy=True)
