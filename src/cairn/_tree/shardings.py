"""The few places that need JAX objects: shardings, boxes and device transfers.

JAX is imported lazily, so that numpy-only loads work without it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .._core.boxes import Box
from .._core.memo import Memo
from .._errors import MismatchError


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


_dmap_cache: Memo[tuple[list[Any], list[Box]]] = Memo()


def device_boxes(sharding: Any, shape: tuple[int, ...]) -> tuple[list[Any], list[Box]]:
    """All devices of `sharding` in its order, and the box each holds."""
    hit = _dmap_cache.get((sharding, shape))
    if hit is not None:
        return hit
    dmap = sharding.devices_indices_map(shape)
    devices = list(dmap)
    return _dmap_cache.put((sharding, shape), (devices, [slices_to_box(dmap[d], shape) for d in devices]))


_array_cache: Memo[tuple[tuple[Any, ...], Any, np.ndarray]] = Memo()
_mesh_cache: Memo[tuple[tuple[Any, ...], np.ndarray]] = Memo(64)


def device_box_array(sharding: Any, shape: tuple[int, ...]) -> tuple[tuple[Any, ...], Any, np.ndarray]:
    """`device_boxes` for the save planner: ``(devices, boxes, processes)``.

    For a `NamedSharding` over a concrete mesh the boxes are an array
    ``(devices, ndim, 2)`` computed by arithmetic (`_grid.spec_boxes`), and the
    devices and their processes are the mesh's, memoised per mesh, so that
    nothing per device runs in Python. Other shardings, and specs the
    arithmetic does not handle, take `device_boxes` (a list of boxes).
    """
    hit = _array_cache.get((sharding, shape))
    if hit is not None:
        return hit
    hit = _named(sharding, shape)
    if hit is None:
        devices, boxes = device_boxes(sharding, shape)
        hit = (tuple(devices), boxes, np.fromiter((d.process_index for d in devices), np.int64, len(devices)))
    return _array_cache.put((sharding, shape), hit)


def _named(sharding: Any, shape: tuple[int, ...]) -> tuple[tuple[Any, ...], np.ndarray, np.ndarray] | None:
    import jax

    from .._plan.grid import spec_boxes

    if type(sharding) is not jax.sharding.NamedSharding or type(sharding.mesh) is not jax.sharding.Mesh:
        return None
    spec = sharding.spec
    if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None) or not shape:
        return None
    mesh = sharding.mesh
    boxes = spec_boxes(shape, mesh.devices.shape, tuple(mesh.axis_names), tuple(spec))
    if boxes is None:
        return None
    held = _mesh_cache.get(mesh)
    if held is None:
        devices = tuple(mesh.devices.flat)  # the sharding's device order (`_device_assignment`)
        held = _mesh_cache.put(mesh, (devices, np.fromiter((d.process_index for d in devices), np.int64,
                                                           len(devices))))
    return held[0], boxes, held[1]


_placement_cache: Memo[tuple[list[Box], dict[Box, list[Any]]]] = Memo()


def misfit(sharding: Any, shape: tuple[int, ...]) -> str | None:
    """Why `sharding` cannot lay out an array of `shape` (None if it can), in words for an error.

    JAX decides (a JAX that allows uneven shards allows them here too); its
    own errors (``IndivisibleError``, an ``IndexError`` for a PartitionSpec
    longer than the array) name neither the checkpoint nor the leaf, so the
    caller adds both, and a NamedSharding's misfit is said in its terms.
    """
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is not None and len(spec) > len(shape):
        return (f"its PartitionSpec {spec} names {len(spec)} dimension{'s' if len(spec) != 1 else ''}, but "
                f"the array has {len(shape)} (shape {shape})")
    try:
        sharding.shard_shape(tuple(shape))
    except Exception as e:  # JAX refuses this shape
        if spec is not None and mesh is not None:
            sizes = dict(mesh.shape)
            for dim, (n, entry) in enumerate(zip(shape, spec)):
                axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
                ways = int(np.prod([sizes.get(a, 1) for a in axes])) if axes else 1
                if ways > 1 and n % ways:
                    return (f"its PartitionSpec {spec} splits dimension {dim} (size {n}, shape {shape}) {ways} "
                            f"ways (mesh axes {', '.join(map(repr, axes))}), which does not divide it")
        return f"JAX cannot lay out shape {shape} with it: {e}"
    return None


def addressable_boxes(sharding: Any, shape: tuple[int, ...]) -> tuple[list[Box], dict[Box, list[Any]]]:
    """The distinct boxes `sharding` puts on this process's devices, and the devices of each.

    Memoised per (sharding, shape), like `device_boxes`: a load of thousands of
    leaves asks it for a few shardings over and over. Callers must not modify the result.
    """
    hit = _placement_cache.get((sharding, shape))
    if hit is None:
        by_box: dict[Box, list[Any]] = {}
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            by_box.setdefault(slices_to_box(index, shape), []).append(device)
        hit = _placement_cache.put((sharding, shape), (list(by_box), by_box))
    return hit


#: A leaf up to this size whose target sharding lies wholly on this process is read into one host
#: buffer and placed by a batched `jax.device_put` (JAX slices it per device in C++): below this,
#: a device_put and a read per shard cost more than the bytes (2,000 leaves of 2 KiB over 8
#: devices: 0.9-1.5 ms per leaf put shard by shard, 0.15-0.24 ms whole); above it, the
#: per-shard buffers are adopted without a copy on CPU.
WHOLE_PUT_BYTES = 1 << 20

_whole: Memo[bool] = Memo()


def puts_whole(sharding: Any) -> bool:
    """Whether every device of `sharding` is this process's (then a load may place it from one host array)."""
    hit = _whole.get(sharding)
    if hit is None:
        hit = _whole.put(sharding, bool(sharding.is_fully_addressable))
    return hit


# A `PutBatch` flushes at this many pending arrays or bytes (the load's plan counts them as held memory).
PUT_BATCH_ITEMS, PUT_BATCH_BYTES = 1024, 64 << 20


class PutBatch:
    """Host arrays waiting for one batched `jax.device_put` onto their shardings."""

    def __init__(self, max_items: int = PUT_BATCH_ITEMS, max_bytes: int = PUT_BATCH_BYTES) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._hosts: list[np.ndarray] = []
        self._shardings: list[Any] = []
        self._outs: list[tuple[dict[Any, Any], Any]] = []
        self._bytes = 0

    def add(self, out: dict[Any, Any], key: Any, host: np.ndarray, sharding: Any) -> None:
        """Set ``out[key]`` to `host` placed on `sharding`, at the latest when `flush` runs."""
        self._hosts.append(host)
        self._shardings.append(sharding)
        self._outs.append((out, key))
        self._bytes += host.nbytes
        if len(self._hosts) >= self.max_items or self._bytes >= self.max_bytes:
            self.flush()

    @property
    def pending(self) -> tuple[int, int]:
        """How many arrays wait for the next `flush`, and their bytes."""
        return len(self._hosts), self._bytes

    def flush(self) -> None:
        if not self._hosts:
            return
        import jax

        arrays = jax.device_put(self._hosts, self._shardings)
        for (out, key), x in zip(self._outs, arrays):
            out[key] = x
        self._hosts, self._shardings, self._outs, self._bytes = [], [], [], 0


_order_cache: Memo[dict[Any, int]] = Memo()


def shard_arrays(x: Any) -> tuple[list[Any], dict[Any, int]]:
    """The single-device arrays of `x`'s addressable shards, and each device's position among them.

    `x.addressable_shards` builds a `Shard` per device and looks each one's
    device up through a new sharding object: about 10 µs per shard, which a
    state of thousands of small sharded leaves pays thousands of times. JAX
    keeps an array's buffers in the fixed device order of its sharding, so
    the device positions are memoised per sharding and the buffers are taken
    from the array's own list (`_arrays`, what `addressable_shards` walks),
    with `addressable_shards` as the fallback.
    """
    sharding = x.sharding
    arrays = getattr(x, "_arrays", None)
    order = _order_cache.get(sharding)  # (None for an unhashable sharding: never remembered)
    if order is not None and isinstance(arrays, list) and len(arrays) == len(order):
        return arrays, order
    shards = x.addressable_shards
    order = {s.device: i for i, s in enumerate(shards)}
    _order_cache.put(sharding, order)
    return [s.data for s in shards], order


_described: Memo[dict[str, Any]] = Memo()


def describe_sharding(sharding: Any) -> dict[str, Any]:
    """A JSON description of a sharding, for humans and tools; a load reads it only for ``mesh=`` (`on_mesh`).

    Memoised per sharding (a state repeats a few); callers must not modify it.
    """
    hit = _described.get(sharding)
    return hit if hit is not None else _described.put(sharding, _describe(sharding))


def _describe(sharding: Any) -> dict[str, Any]:
    import jax

    out: dict[str, Any] = {"type": type(sharding).__name__, "num_devices": len(sharding.device_set)}
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        out["mesh"] = {"axis_names": [str(a) for a in mesh.axis_names], "shape": [int(s) for s in mesh.devices.shape]}
        out["spec"] = [_spec_entry(p) for p in sharding.spec]
    elif isinstance(sharding, jax.sharding.SingleDeviceSharding):
        out["device"] = str(next(iter(sharding.device_set)))
    return out


def on_mesh(saved: dict[str, Any], mesh: Any, where: str) -> Any:
    """The sharding an array saved with sharding description `saved` (`describe_sharding`) gets on `mesh`:
    its saved PartitionSpec over the same axis names (whatever their sizes now); replicated where it was
    not saved with a NamedSharding. `where` names the checkpoint and leaf in the error."""
    import jax

    entries = saved.get("spec") if saved.get("type") == "NamedSharding" else None
    if not isinstance(entries, list):
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    spec = jax.sharding.PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in entries])
    names = [str(a) for a in mesh.axis_names]
    used = [a for e in entries if e is not None for a in (e if isinstance(e, list) else [e])]
    lacking = [a for a in dict.fromkeys(used) if a not in names]
    if lacking:
        saved_mesh = saved.get("mesh") or {}
        was = dict(zip(saved_mesh.get("axis_names", []), saved_mesh.get("shape", [])))
        raise MismatchError(
            f"{where} was saved with PartitionSpec {spec} on a mesh with axes {was}; the mesh given has axes "
            f"{dict(mesh.shape)}, without {', '.join(map(repr, lacking))}. Pass a mesh with those axis names "
            "(of any sizes), or a target with a sharding for this leaf")
    return jax.sharding.NamedSharding(mesh, spec)


def _spec_entry(p: Any) -> Any:
    if p is None:
        return None
    if isinstance(p, (tuple, list)):
        return [str(x) for x in p]
    return str(p)


def host_view(a: Any) -> np.ndarray:
    """A host numpy view of single-device array `a`; zero-copy on CPU.

    On an accelerator the bytes are copied into a new host array first
    (`start_to_host`), so that the host copy is freed as soon as the caller
    drops it (numpy views of device arrays are cached on the array for its
    whole life). A `ToHost` gives the bytes its transfer brought.
    """
    if type(a) is ToHost:
        return a.get()
    if on_cpu(a) or a.sharding.memory_kind in _HOST_KINDS:  # (a transfer `start_to_host` began: waits for it)
        return np.asarray(a)
    return np.asarray(start_to_host([a])[0])


_HOST_KINDS = ("pinned_host", "unpinned_host")

#: How accelerator chunks come to host memory (see `start_to_host`); None: `TO_HOST_BY_PLATFORM`.
#: `python -m benchmarks.probe gpu_save` compares the methods.
TO_HOST: str | None = None
#: The method per platform, measured (docs/performance-gpu.md): on an H200 pinned host memory took
#: 0.024 s for 1000 MiB against 1.4-1.7 s onto the CPU backend; on a TPU v5e (under the gVisor
#: sandbox of the machine lent here) the CPU backend took 0.39 s for 495 MiB against 1.12 s.
TO_HOST_BY_PLATFORM = {"gpu": "pinned", "cuda": "pinned", "rocm": "pinned"}


def start_to_host(arrays: list[Any], method: str | None = None) -> list[Any]:
    """Start device-to-host copies of single-device `arrays`, all before any is waited for; each
    result gives a host copy to ``np.asarray`` (which waits for its transfer) that no later
    donation or deletion of the array can change.

    - ``"pinned"`` (the default on GPUs): one batched ``device_put`` into each device's pinned host
      memory (``memory_kind="pinned_host"``): DMA at the link's speed, into new arrays that are
      freed with the snapshot. Where the platform has no pinned host memory, as ``"cpu"``.
    - ``"cpu"`` (the default elsewhere, TPUs included): one batched ``device_put`` onto the CPU backend.
    - ``"own"``: for arrays no one else holds (a save's own on-device copies, `device_snapshot`):
      ``copy_to_host_async`` on each, wrapped in a `ToHost` that frees the device copy once its
      bytes are on host (the fastest way to host measured on a TPU v5e: ``jax.device_get``'s).
    - ``"async"``: ``copy_to_host_async`` on each array. For measurement only: JAX keeps the host
      value on the array for the array's life, so the caller's arrays would hold a host copy.
    """
    import jax

    if not arrays:
        return []
    method = method or TO_HOST or TO_HOST_BY_PLATFORM.get(arrays[0].device.platform, "cpu")
    if method == "own":
        return [ToHost(a) for a in arrays]
    if method == "async":
        for a in arrays:
            a.copy_to_host_async()
        return arrays
    if method == "pinned":
        try:
            pinned = [jax.sharding.SingleDeviceSharding(a.device, memory_kind="pinned_host") for a in arrays]
            return list(jax.device_put(arrays, pinned))
        except (ValueError, TypeError, RuntimeError, NotImplementedError):  # no pinned host memory here
            pass
    elif method != "cpu":
        raise ValueError(f"unknown device-to-host method {method!r}")
    return list(jax.device_put(arrays, jax.devices("cpu")[0]))


class ToHost:
    """An on-device array of the save's own whose copy to host memory has started.

    `get` waits for the bytes and returns them as a numpy array; the device copy is dropped then
    (its device memory freed), and later calls return the same host array.
    """

    __slots__ = ("array", "host")

    def __init__(self, array: Any) -> None:
        array.copy_to_host_async()
        self.array: Any = array
        self.host: np.ndarray | None = None

    def get(self) -> np.ndarray:
        host = self.host
        if host is None:
            array = self.array
            if array is None:  # another thread got it meanwhile (it sets host before it drops array)
                return self.host  # type: ignore[return-value]
            host = self.host = np.asarray(array)
            self.array = None
        return host

    @property
    def nbytes(self) -> int:
        return int(self.host.nbytes if self.host is not None else self.array.nbytes)


#: How `device_snapshot` decides: "auto" (on accelerators, where device memory has room), "always"
#: (every jax.Array, CPU ones too: for tests), "never" (the host copies of `start_to_host`). Set by
#: the environment variable CAIRN_DEVICE_SNAPSHOT.
DEVICE_SNAPSHOT = os.environ.get("CAIRN_DEVICE_SNAPSHOT", "auto")
#: Device memory `device_snapshot` leaves free beyond the copies: this share of the device's
#: memory, and at least `HEADROOM_MIN_BYTES`.
HEADROOM_SHARE = 0.02
HEADROOM_MIN_BYTES = 256 << 20


def device_snapshot(arrays: list[Any]) -> list[Any] | None:
    """On-device copies of single-device `arrays` (`_copy_all`), not waited for; or None
    where `DEVICE_SNAPSHOT` or a device's free memory says no.

    A copy is a new buffer that no later donation, update or deletion of its source can change (the
    runtime orders those after the copy, as after any computation that reads the source), so the
    caller need not wait for it: the blocking phase of a save costs the dispatch, not the bytes (on a
    TPU v5e, 2 GiB in 128 arrays: 8 ms, against 0.15-0.6 s for any copy to host memory).

    Device memory: the copies of a device's arrays are made only where the device's limit minus its
    *peak* use so far leaves room for them and the headroom (`HEADROOM_SHARE`), so the training
    step that runs while they exist, whose peak that already counts, still fits. Platforms that
    report no memory statistics (the CPU backend) get no copies under "auto".
    """
    if DEVICE_SNAPSHOT == "never" or not arrays:
        return None
    by_device: dict[Any, list[int]] = {}
    for i, a in enumerate(arrays):
        by_device.setdefault(a.device, []).append(i)
    if DEVICE_SNAPSHOT != "always":
        for device, idx in by_device.items():
            if device.platform == "cpu":
                return None
            try:
                stats = device.memory_stats() or {}
            except Exception:  # a platform without the call: no statistics
                stats = {}
            limit = stats.get("bytes_limit")
            peak = stats.get("peak_bytes_in_use", stats.get("bytes_in_use"))
            if not limit or peak is None:
                return None
            need = sum(int(arrays[i].nbytes) for i in idx)
            if limit - peak < need + max(HEADROOM_MIN_BYTES, HEADROOM_SHARE * limit):
                return None
    out: list[Any] = [None] * len(arrays)
    for idx in by_device.values():
        copies = _copy_all(*[arrays[i] for i in idx])
        for i, c in zip(idx, copies):
            out[i] = c
    return out


def _copy_one(x: Any) -> Any:
    import jax.numpy as jnp

    return jnp.copy(x)


_copy_jit: list[Any] = []


def _copy_all(*xs: Any) -> list[Any]:
    """New buffers holding `xs` (arrays on one device), one jitted copy each.

    One jitted computation per array, not one for all: each is compiled once per shape and dtype
    (a state has few), where a computation over all of them would be compiled anew for each new
    structure of the state (on a TPU v5e, 1.5-2.2 s at the first save of a 181-array state), and
    the dispatch of a compiled one costs microseconds.
    """
    if not _copy_jit:
        import jax

        _copy_jit.append(jax.jit(_copy_one))
    copy = _copy_jit[0]
    return [copy(x) for x in xs]


_cpu: Memo[bool] = Memo()


def on_cpu(a: Any) -> bool:
    """Whether single-device array `a` lives in host memory (memoised per sharding: `a.device` costs ~1 µs)."""
    sharding = a.sharding
    hit = _cpu.get(sharding)
    return hit if hit is not None else _cpu.put(sharding, a.device.platform == "cpu")


def device_copy(a: Any) -> Any:
    """A copy of single-device array `a` in a new buffer on the same device.

    Donating or deleting `a` afterwards cannot change the copy.
    """
    import jax.numpy as jnp

    return jnp.array(a, copy=True)


def concrete_sharding(sharding: Any, where: str) -> Any:
    """`sharding`, or where it is laid over an abstract mesh (what ``jax.eval_shape`` gives under a
    mesh with Explicit axes), the same spec over the concrete mesh set with ``jax.set_mesh``.

    An abstract mesh names no devices, so without a matching concrete mesh in scope there is
    nowhere to put the array: that is a `MismatchError` naming `where` and what to do.
    """
    import jax

    mesh = getattr(sharding, "mesh", None)
    abstract = getattr(jax.sharding, "AbstractMesh", None)
    if mesh is None or abstract is None or not isinstance(mesh, abstract):
        return sharding
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    current = get_mesh() if get_mesh is not None else None
    if current is not None and not current.empty and current.abstract_mesh == mesh:
        return jax.sharding.NamedSharding(current, sharding.spec)
    from .._errors import MismatchError

    raise MismatchError(
        f"{where}: the target's sharding {sharding} is over an abstract mesh (jax.eval_shape under a mesh "
        "with Explicit axes gives these), which names no devices; load inside `with jax.set_mesh(mesh):` "
        "for that mesh, or give NamedSharding(mesh, spec) leaves")
