"""Planner at scale: a Llama-3.1-405B-shaped state on a simulated 4,096-device cluster.

cairn's planner is pure (shapes, boxes and the index in; plans out), so it
can be run for a cluster that does not exist. This script does what each of
512 processes (8 devices each) would do in a save from an FSDP layout and a
resharding load onto a differently shaped mesh, with the real planning code
(`_layout.layout_for` -> `_plan.chunk_layout`, `_plan.assign_files`,
`_plan.plan_reads`, `_format.ItemIndex.to_json/from_json`). No JAX objects
are built: a mesh is a device grid numbered row-major, device ``d`` belongs
to process ``d // devices_per_process``, and the box each device holds under
a partition spec is computed arithmetically, as `cairn.save` does for a ``NamedSharding``
(`_grid.spec_boxes`, checked against JAX in tests/plan/test_grid.py).

    python -m benchmarks.probe plan_scale                   # full model, 4,096 devices, plus a scaling sweep
    python -m benchmarks.probe plan_scale --layers 8 --quick

Shapes (Llama 3.1 405B): 126 layers, hidden 16384, 128 query heads and 8
key/value heads of dim 128, SwiGLU MLP width 53248, vocabulary 128256,
untied embedding and output head; about 405.9e9 parameters.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from cairn._core.boxes import Box
from cairn._format import manifest as fmt
from cairn._format.binindex import cell_bytes, cells_in
from cairn._plan.chunking import assign_files
from cairn._plan.estimate import estimate_read_work
from cairn._plan.grid import spec_boxes as grid_spec_boxes
from cairn._plan.leafreads import DEFAULT_MAX_READ
from cairn._plan.readmemo import PlanMemo
from cairn._plan.reads import plan_reads
from cairn._plan.routes import HOST_DEFAULTS, Bandwidths, Layout, choose, received_elements
from cairn._save.assign import SaveItem, layout_cache, layout_for
from cairn._save.indexparts import build_part, item_index, own_cells
from cairn._tree.pytree import flatten

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, LAYERS = 16384, 128, 8, 128, 53248, 128256, 126
Spec = tuple[Any, ...]  # per array axis: None, a mesh axis name, or a tuple of names


@dataclass(frozen=True)
class Mesh:
    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    devices_per_process: int = 8

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def coords(self, device: int) -> dict[str, int]:
        out, rest = {}, device
        for name, n in reversed(list(zip(self.axis_names, self.shape))):
            out[name] = rest % n
            rest //= n
        return out

    def process(self, device: int) -> int:
        return device // self.devices_per_process


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    save: Spec  # partition spec in the FSDP save layout
    load: Spec  # partition spec in the resharded load layout


def llama_405b(layers: int = LAYERS) -> list[Param]:
    """The parameter shapes, with an FSDP save layout and a 2-D (fsdp, tp) load layout.

    Save: every matrix sharded over all devices ("fsdp") along a divisible
    axis, norms too (ZeRO-3 style). Load: Megatron-style tensor parallelism
    over "tp" (column-parallel q/k/v/gate/up/head, row-parallel o/down/embed)
    with FSDP over "fsdp" on the other axis, norms replicated.
    """
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    col, row = ("fsdp", "tp"), ("tp", "fsdp")
    out = [Param("embed_tokens", (VOCAB, HIDDEN), (None, "fsdp"), row)]
    for i in range(layers):
        p = f"layers.{i:03d}."
        out += [
            Param(p + "attn.q", (HIDDEN, q), ("fsdp", None), col),
            Param(p + "attn.k", (HIDDEN, kv), ("fsdp", None), col),
            Param(p + "attn.v", (HIDDEN, kv), ("fsdp", None), col),
            Param(p + "attn.o", (q, HIDDEN), ("fsdp", None), row),
            Param(p + "mlp.gate", (HIDDEN, MLP), ("fsdp", None), col),
            Param(p + "mlp.up", (HIDDEN, MLP), ("fsdp", None), col),
            Param(p + "mlp.down", (MLP, HIDDEN), ("fsdp", None), row),
            Param(p + "attn_norm", (HIDDEN,), ("fsdp",), (None,)),
            Param(p + "mlp_norm", (HIDDEN,), ("fsdp",), (None,)),
        ]
    out += [
        Param("norm", (HIDDEN,), ("fsdp",), (None,)),
        Param("lm_head", (HIDDEN, VOCAB), ("fsdp", None), col),
    ]
    return out


def fit_fsdp(prm: Param, devices: int) -> Param:
    """`prm` with its FSDP save axis moved to the first axis the device count divides, where the
    one it names is not divisible (8,192 devices: the MLP width 53,248 is not), as a user would."""
    axis = next((a for a, e in enumerate(prm.save) if e == "fsdp"), None)
    if axis is None or prm.shape[axis] % devices == 0:
        return prm
    for a, n in enumerate(prm.shape):
        if n % devices == 0:
            spec = [None] * len(prm.shape)
            spec[a] = "fsdp"
            return Param(prm.name, prm.shape, tuple(spec), prm.load)
    raise ValueError(f"{prm.name}: no axis of {prm.shape} is divisible by {devices} devices")


def spec_array(shape: Sequence[int], mesh: Mesh, spec: Spec) -> np.ndarray:
    """The box of every device (in device order) under `spec`: what `cairn.save` computes for a
    NamedSharding (`_jaxutil.device_box_array` -> `_grid.spec_boxes`), as an array."""
    boxes = grid_spec_boxes(shape, mesh.shape, mesh.axis_names, tuple(spec))
    if boxes is None:
        raise ValueError(f"{spec} does not divide {tuple(shape)} evenly over {mesh}")
    return boxes


def spec_boxes(shape: Sequence[int], mesh: Mesh, spec: Spec) -> list[Box]:
    """`spec_array` as a list of boxes, the form the load planner takes."""
    return [tuple(map(tuple, b)) for b in spec_array(shape, mesh, spec).tolist()]


@dataclass(frozen=True)
class _FakeDevice:
    process_index: int


class Cluster:
    """The save mesh, the load mesh and the boxes of each distinct (shape, spec)."""

    def __init__(self, save_mesh: Mesh, load_mesh: Mesh):
        self.save_mesh, self.load_mesh = save_mesh, load_mesh
        self.devices = [_FakeDevice(save_mesh.process(d)) for d in range(save_mesh.size)]
        # A save memoises the processes of a mesh's devices once (`_jaxutil._mesh_cache`).
        self.procs = np.fromiter((d.process_index for d in self.devices), np.int64, len(self.devices))
        self._boxes: dict[Any, list[Box]] = {}

    def boxes(self, mesh: Mesh, shape: tuple[int, ...], spec: Spec) -> list[Box]:
        key = (mesh, shape, spec)
        if key not in self._boxes:
            self._boxes[key] = spec_boxes(shape, mesh, spec)
        return self._boxes[key]

    @property
    def processes(self) -> int:
        return self.save_mesh.size // self.save_mesh.devices_per_process


# ---------------------------------------------------------------------- save


def plan_save(cluster: Cluster, params: list[Param], itemsize: int, me: int, memo: bool = True):
    """What process `me` plans in `cairn.save`: every array's boxes, layout, own chunks and files.

    Returns (layouts by leaf, this process's files). The boxes of each distinct
    (shape, spec) are computed as a save computes them for a NamedSharding
    (by arithmetic, memoised per sharding and shape) and timed with the rest.
    The caller empties `layout_cache` first, as in a process's first save (outside
    the timing: freeing the previous sample's layouts is not planning).
    """
    mesh = cluster.save_mesh
    layouts, mine = [], []
    boxes_of: dict[Any, np.ndarray] = {}
    for i, prm in enumerate(params):
        key = (prm.shape, prm.save)
        if key not in boxes_of or not memo:
            boxes_of[key] = spec_array(prm.shape, mesh, prm.save)
        if not memo:
            layout_cache.clear()
        layout, own = layout_for((mesh, prm.save), prm.shape, boxes_of[key], cluster.devices, me, False, i,
                                 merge_itemsize=itemsize, procs=cluster.procs)
        layouts.append(layout)
        mine.extend((i, cell, elems * itemsize) for cell, _d, elems in own)
    files = assign_files(mine, 4, 32 << 20)
    return layouts, files


@dataclass(frozen=True)
class _Src:
    """What the index writer reads of a saved array leaf (a real save has `_leaves.ArraySource`)."""

    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    kind: str = "array"
    handler: Any = None
    impl: Any = None
    impl_shape: tuple[int, ...] = ()
    is_jax: bool = False


TOKEN = "0123456789ab"


def build_index(cluster: Cluster, params: list[Param], itemsize: int, block: int,
                timed: Sequence[int] = ()) -> dict[str, Any]:
    """What a save writes of the index (format version 2): each process's binary part, built by
    `_indexparts.build_part` as that process would, then the primary's JSON index (`item_index`),
    built from the layouts and each process's reported files. Returns the bytes and the timings."""
    layout_cache.clear()
    mesh = cluster.save_mesh
    dtype = np.dtype("float32") if itemsize == 4 else np.dtype(ml_dtypes.bfloat16)
    structure, flat = flatten({prm.name: 0 for prm in params})
    item = SaveItem("", "%root", structure, [_Src(path, dtype, prm.shape) for (path, _), prm in zip(flat, params)])
    for i, prm in enumerate(params):
        layout, _ = layout_for((mesh, prm.save), prm.shape, cluster.boxes(mesh, prm.shape, prm.save),
                               cluster.devices, 0, False, i, merge_itemsize=itemsize)
        item.layouts[i] = layout
    parts: dict[str, bytes] = {}
    statuses: dict[int, Any] = {}
    part_t = []
    for p in range(cluster.processes):
        t0 = time.perf_counter()
        mine = []
        for i, layout in item.layouts.items():
            sizes = cell_bytes(layout.grid, itemsize)
            mine.extend((i, c, int(sizes[c])) for c in own_cells(layout.writer, p).tolist())
        files = assign_files(mine, 4, 32 << 20)
        rows = [(slot.leaf, slot.cell, k, slot.offset, *([0x1234ABCD] * fmt.num_blocks(slot.nbytes, block)))
                for k, slots in enumerate(files) for slot in slots]
        built = build_part(item, p, TOKEN, rows, "plan_scale")
        if p in timed:
            part_t.append(time.perf_counter() - t0)
        assert built is not None
        name, data, records, crcs = built
        parts[name] = data
        statuses[p] = {"items": {"": {
            "files": [[fmt.data_file_name(p, k, TOKEN), sum(s.nbytes for s in slots)] for k, slots in enumerate(files)],
            "part": [name, records, crcs]}}}
    gc.collect()
    t0 = time.perf_counter()
    index = item_index(item, statuses, cluster.processes, block)
    data = index.to_json()
    commit_s = time.perf_counter() - t0
    return {"json": data, "parts": parts, "commit_s": commit_s,
            "part_build_s": statistics.median(part_t) if part_t else None,
            "parts_bytes": sum(map(len, parts.values()))}


def open_index(built: dict[str, Any]) -> tuple[fmt.ItemIndex, dict[str, int]]:
    """What a loading process does first: parse the JSON index and bind its reader to the parts (in
    memory here), counting what it reads."""
    data, parts = built["json"], built["parts"]
    seen = {"bytes": len(data), "requests": 1}
    index = fmt.ItemIndex.from_json(data, "index")

    def read(requests: list[tuple[str, int, int]]) -> list[bytes]:
        seen["requests"] += len(requests)
        seen["bytes"] += sum(n for _, _, n in requests)
        return [parts[name][start : start + n] for name, start, n in requests]

    assert index.table is not None
    index.table.reader = read
    return index, seen


def prefetch_for(cluster: Cluster, index: fmt.ItemIndex, mesh: Mesh, specs: Sequence[Spec], me: int) -> None:
    """`_prefetch.prefetch`, for process `me` reading each leaf with spec `specs[i]` on `mesh`."""
    assert index.table is not None
    need = {}
    for i, (leaf, spec) in enumerate(zip(index.leaves, specs)):
        assert isinstance(leaf, fmt.ArrayLeaf)
        need[i] = cells_in(leaf.grid, _process_boxes(cluster, mesh, leaf.shape, spec, me))
    index.table.fetch(need)


# ---------------------------------------------------------------------- load


def plan_load(cluster: Cluster, built: dict[str, Any], params: list[Param], me: int, verify: bool = True,
              small_read: int = 1 << 20, same: bool = False):
    """What process `me` plans in a direct `cairn.load` onto the load mesh (the save mesh with `same`):
    parse the index, fetch the records of its chunks, plan its reads."""
    mesh = cluster.save_mesh if same else cluster.load_mesh
    index, seen = open_index(built)
    prefetch_for(cluster, index, mesh, [prm.save if same else prm.load for prm in params], me)
    mine = range(me * mesh.devices_per_process, (me + 1) * mesh.devices_per_process)
    reads = read_bytes = needed = 0
    files: set[int] = set()
    plans = PlanMemo()  # as `ChunkReader.read_array` plans (the memo needs the default split rule)
    for leaf, prm in zip(index.leaves, params):
        assert isinstance(leaf, fmt.ArrayLeaf)
        all_boxes = cluster.boxes(mesh, prm.shape, prm.save if same else prm.load)
        boxes = list(dict.fromkeys(all_boxes[d] for d in mine))
        plan = (plans.plan(leaf, boxes, index.block_size, verify, DEFAULT_MAX_READ) if small_read == 1 << 20
                else plan_reads(leaf, boxes, index.block_size, verify, small_read=small_read))
        reads += len(plan)
        read_bytes += sum(r.nbytes for r in plan)
        needed += sum(math.prod(hi - lo for lo, hi in b) for b in boxes) * leaf.dtype.itemsize
        files.update(r.file for r in plan)
    return {"reads": reads, "bytes": read_bytes, "needed": needed, "files": len(files),
            "index_bytes_read": seen["bytes"], "index_requests": seen["requests"]}


def _layout(mesh: Mesh, shape: tuple[int, ...], spec: Spec) -> Layout:
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    axes = tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)
    return Layout(mesh.axis_names, mesh.shape, axes)


def _spec(layout: Layout) -> Spec:
    return tuple(None if not e else e[0] if len(e) == 1 else e for e in layout.spec)


def _process_boxes(cluster: Cluster, mesh: Mesh, shape: tuple[int, ...], spec: Spec, p: int) -> list[Box]:
    boxes = cluster.boxes(mesh, shape, spec)
    mine = range(p * mesh.devices_per_process, (p + 1) * mesh.devices_per_process)
    return sorted(dict.fromkeys(boxes[d] for d in mine))


def plan_read_once(cluster: Cluster, built: dict[str, Any], params: list[Param], me: int, verify: bool = True,
                   bandwidths: Bandwidths | None = None):
    """What process `me` plans in a multi-process `cairn.load` onto the load mesh (`_readonce.route`):
    parse the index, a route per leaf (computed by every process alike, from process 0's boxes; by
    bytes, or priced in seconds with `bandwidths`), fetch the records of the chunks it reads, then
    its own reads."""
    mesh = cluster.load_mesh
    index, seen = open_index(built)
    procs = mesh.size // mesh.devices_per_process
    routes = []
    memo: dict[Any, Any] = {}  # as `_readonce.route` memoises: one decision per (grid, layout)
    for leaf, prm in zip(index.leaves, params):
        assert isinstance(leaf, fmt.ArrayLeaf)
        isz = leaf.dtype.itemsize
        key = (leaf.grid, isz, prm.shape, prm.load)
        if key in memo:
            routes.append(memo[key])
            continue

        def cost(layout: Layout, leaf: fmt.ArrayLeaf = leaf, isz: int = isz) -> tuple[int, int, int]:
            # `_readonce.read_cost`: storage bytes, requests, host bytes (checked, and copied out strided)
            boxes = _process_boxes(cluster, mesh, leaf.shape, _spec(layout), 0)
            w = estimate_read_work(leaf.grid, isz, boxes, index.block_size, verify, DEFAULT_MAX_READ)
            return procs * w.nbytes, procs * w.requests, procs * ((w.nbytes if verify else 0) + w.scattered)

        def moved(a: Layout, b: Layout, leaf: fmt.ArrayLeaf = leaf, isz: int = isz) -> int:
            # `_readonce.moved_bytes`: each device of process 0 less what process 0 holds already.
            have = _process_boxes(cluster, mesh, leaf.shape, _spec(a), 0)
            want = cluster.boxes(mesh, leaf.shape, _spec(b))[:mesh.devices_per_process]
            return procs * received_elements(want, have) * isz

        memo[key] = choose(_layout(mesh, prm.shape, prm.load), prm.shape, leaf.nbytes, cost, forced=False,
                           moved=moved, bandwidths=bandwidths, processes=procs)
        routes.append(memo[key])
    prefetch_for(cluster, index, mesh, [_spec(r.read) for r in routes], me)
    reads = read_bytes = 0
    plans = PlanMemo()
    for leaf, plan in zip(index.leaves, routes):
        assert isinstance(leaf, fmt.ArrayLeaf)
        boxes = _process_boxes(cluster, mesh, leaf.shape, _spec(plan.read), me)
        planned = plans.plan(leaf, boxes, index.block_size, verify, DEFAULT_MAX_READ)
        reads += len(planned)
        read_bytes += sum(r.nbytes for r in planned)
    return routes, {"reads": reads, "bytes": read_bytes, "index_bytes_read": seen["bytes"],
                    "index_requests": seen["requests"]}


def global_read_once(cluster: Cluster, params: list[Param], itemsize: int, routes: list[Any]) -> dict[str, Any]:
    """Cluster-wide figures of the read-once routes: storage bytes, collective bytes, route kinds."""
    mesh = cluster.load_mesh
    total = sum(r.cost for r in routes)
    direct_total = sum(r.direct_cost for r in routes)
    leaves = [_Src(prm.name, np.dtype(np.uint8 if itemsize == 1 else f"u{itemsize}"), prm.shape) for prm in params]
    # What a process receives over the interconnect is at most its boxes of every layout it
    # moves through (an upper bound: the part it read itself need not move).
    collective = 0
    for leaf, r in zip(leaves, routes):
        for step in r.steps:
            boxes = _process_boxes(cluster, mesh, leaf.shape, _spec(step), 0)
            collective += sum(math.prod(hi - lo for lo, hi in b) for b in boxes) * leaf.dtype.itemsize
    kinds = {k: sum(r.kind == k for r in routes) for k in ("direct", "refined", "staged")}
    procs = mesh.size // mesh.devices_per_process
    out = {"storage_bytes_read_total": total, "direct_storage_bytes_read_total": direct_total,
           "collective_bytes_per_process_max": collective, "routes": kinds,
           "interconnect_bytes_per_process": sum(r.interconnect for r in routes) // procs}
    if routes and all(r.seconds is not None for r in routes):
        # Predicted seconds per process: the chosen routes, every leaf direct, every leaf on its
        # fewest-storage-bytes route (read_once=True).
        def fewest(r: Any) -> Any:
            return min(r.alternatives, key=lambda a: (a.storage_bytes, a.kind != "direct"))
        out["seconds"] = {"chosen": sum(r.seconds for r in routes),
                          "all_direct": sum(r.alternatives[0].seconds for r in routes),
                          "read_once_true": sum(fewest(r).seconds for r in routes)}
    return out


# ---------------------------------------------------------------------- driver


#: --route-cases: (label, storage GB/s, interconnect GB/s, ms per request), per process; host work
#: at an accelerator host's default rate (`HOST_DEFAULTS["gpu"]`: 4,096 devices on 512 processes).
ROUTE_CASES = {
    "object": ("object store 2 GB/s per host, 100 GB/s interconnect", 2.0, 100.0, 2.0),
    "slow-net": ("fast local disk 8 GB/s, 1 GB/s interconnect", 8.0, 1.0, 0.02),
}


def route_cases(devices: int, layers: int, itemsize: int, block: int, cases: dict[str, Bandwidths],
                verify: bool = True) -> dict[str, Any]:
    """The routes of the FSDP -> TP load priced under each of `cases`: route kinds, cluster storage
    reads, interconnect bytes and predicted seconds per process (process 0's plan)."""
    save_mesh = Mesh(("fsdp",), (devices,))
    load_mesh = Mesh(("fsdp", "tp"), (devices // 16, 16))
    cluster = Cluster(save_mesh, load_mesh)
    params = [fit_fsdp(prm, devices) for prm in llama_405b(layers)]
    built = build_index(cluster, params, itemsize, block)
    nbytes = sum(math.prod(p.shape) for p in params) * itemsize
    out: dict[str, Any] = {"bytes": nbytes, "cases": {}}
    for name, bw in cases.items():
        t, (routes, mine) = _timed(plan_read_once, cluster, built, params, 0, verify, bw)
        g = global_read_once(cluster, params, itemsize, routes)
        read_once = [r for r in routes if r.kind != "direct"]
        g.update(bandwidths=bw.as_dict(), plan_s=t, storage_ratio=g["storage_bytes_read_total"] / nbytes,
                 read_once_storage_ratio=(sum(r.cost for r in read_once) / sum(
                     _nbytes(prm, itemsize) for r, prm in zip(routes, params) if r.kind != "direct"))
                 if read_once else None, process0=mine)
        out["cases"][name] = g
    return out


def _nbytes(prm: Param, itemsize: int) -> int:
    return math.prod(prm.shape) * itemsize


def _timed(fn, *a, **kw):
    gc.collect()
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - t0, out


def _sample(processes: int, k: int) -> list[int]:
    return sorted({round(i * (processes - 1) / max(k - 1, 1)) for i in range(k)})


def run_scale(devices: int, layers: int, itemsize: int, block: int, samples: int,
              verify: bool = True, unmemoised: bool = False, small_read: int = 1 << 20) -> dict[str, Any]:
    procs = devices // 8
    # Save: ZeRO-3 over every device. Load: "tp" of 16 (two processes) x "fsdp" over the rest.
    save_mesh = Mesh(("fsdp",), (devices,))
    load_mesh = Mesh(("fsdp", "tp"), (devices // 16, 16))
    cluster = Cluster(save_mesh, load_mesh)
    params = [fit_fsdp(prm, devices) for prm in llama_405b(layers)]
    for prm in params:  # the boxes the index builder and the load planner take (plan_save makes its own)
        cluster.boxes(save_mesh, prm.shape, prm.save)
        cluster.boxes(load_mesh, prm.shape, prm.load)
    shards = sum(len(cluster.boxes(save_mesh, p.shape, p.save)) for p in params)
    chunks_per_proc = shards // procs
    save_t = []
    for p in _sample(procs, samples):
        layout_cache.clear()
        save_t.append(_timed(plan_save, cluster, params, itemsize, p)[0])
    out: dict[str, Any] = {
        "devices": devices, "processes": procs, "layers": layers, "leaves": len(params),
        "bytes": sum(math.prod(p.shape) for p in params) * itemsize,
        "shards": shards, "chunks_per_process": chunks_per_proc,
        "save_plan_s": statistics.median(save_t), "save_plan_max_s": max(save_t),
    }
    if unmemoised:
        layout_cache.clear()
        out["save_plan_unmemoised_s"] = _timed(plan_save, cluster, params, itemsize, 0, memo=False)[0]
    built = build_index(cluster, params, itemsize, block, _sample(procs, samples))
    out["commit_s_primary"] = built["commit_s"]
    out["part_build_s_per_process"] = built["part_build_s"]
    out["index_bytes"] = len(built["json"])
    out["index_parts_bytes"] = built["parts_bytes"]
    out["index_parse_s"], _ = _timed(open_index, built)
    same = [(p, *_timed(plan_load, cluster, built, params, p, verify, small_read, same=True))
            for p in _sample(procs, samples)]
    out["same_sharding"] = {p: r for p, _, r in same}
    out["same_sharding_load_plan_s"] = statistics.median(t for _, t, _ in same)
    loads = [(p, *_timed(plan_load, cluster, built, params, p, verify, small_read))
             for p in _sample(procs, samples)]
    out["load_plan_s"] = statistics.median(t for _, t, _ in loads)
    out["load_plan_max_s"] = max(t for _, t, _ in loads)
    out["load"] = {p: r for p, _, r in loads}
    once = [(p, *_timed(plan_read_once, cluster, built, params, p, verify)) for p in _sample(procs, samples)]
    routes = once[0][2][0]
    # The key figures: the worst process of the same-sharding load and the read-once FSDP -> TP reshard
    # (a multi-process load's default route); the direct reshard's figures are under "load".
    out["save_plan_s_per_process"] = out["save_plan_s"] + (out["part_build_s_per_process"] or 0.0)
    out["index_bytes_read_per_process"] = max(
        max(r["index_bytes_read"] for r in out["same_sharding"].values()),
        max(r[1]["index_bytes_read"] for _, _, r in once))
    out["load_plan_s_per_process"] = max(out["same_sharding_load_plan_s"], statistics.median(t for _, t, _ in once))
    out["read_once"] = {
        **global_read_once(cluster, params, itemsize, routes),
        "checkpoint_bytes": out["bytes"],
        "load_plan_s_per_process": statistics.median(t for _, t, _ in once),
        "load_plan_max_s": max(t for _, t, _ in once),
        "per_process": {p: r[1] for p, _, r in once},
    }
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--devices", type=int, default=4096)
    ap.add_argument("--sweep", default="512,1024,2048,4096", help="device counts for the scaling sweep")
    ap.add_argument("--sweep-layers", type=int, default=16, help="layers in the sweep's model")
    ap.add_argument("--samples", type=int, default=3, help="processes whose plans are timed")
    ap.add_argument("--block", type=int, default=fmt.DEFAULT_BLOCK_SIZE)
    ap.add_argument("--quick", action="store_true", help="skip the sweep")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--route-cases", metavar="CASES", help="only price the FSDP -> TP load's routes under "
                    f"bandwidth cases, a comma list of {sorted(ROUTE_CASES)} or storage:interconnect[:ms[:host]] "
                    "figures in GB/s per process (e.g. 2:100:2; host 0 leaves host work out)")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {}
    if args.route_cases:
        cases = {}
        for c in args.route_cases.split(","):
            host = HOST_DEFAULTS["gpu"]
            if c in ROUTE_CASES:
                label, sto, net, ms = ROUTE_CASES[c]
            else:
                figs = [float(x) for x in c.split(":")]
                sto, net, ms = [*figs, 0.0][:3]
                host = figs[3] if len(figs) > 3 else host
                label = f"storage {sto:g} GB/s, interconnect {net:g} GB/s"
            cases[c] = Bandwidths(sto, net, ms, label + f", host {host:g} GB/s", host)
        r = route_cases(args.devices, args.layers, 2, args.block, cases)
        print(f"Llama-3.1-405B-shaped parameters (bf16), {args.layers} layers, {_fmt_bytes(r['bytes'])}; FSDP save "
              f"on {args.devices} devices / {args.devices // 8} processes, load onto ({args.devices // 16}, 16) "
              "fsdp x tp; routes priced per process")
        for g in r["cases"].values():
            secs = g["seconds"]
            ro = g["read_once_storage_ratio"]
            print(f"  {g['bandwidths']['source']}: routes {g['routes']}; cluster storage reads "
                  f"{g['storage_ratio']:.3f}x the checkpoint"
                  + (f" (read-once leaves {ro:.3f}x their bytes)" if ro is not None else "")
                  + f", direct everywhere {g['direct_storage_bytes_read_total'] / r['bytes']:.2f}x; interconnect "
                  f"{_fmt_bytes(g['interconnect_bytes_per_process'])} per process; predicted "
                  f"{secs['chosen']:.2f} s per process (all direct {secs['all_direct']:.2f} s, read_once=True "
                  f"{secs['read_once_true']:.2f} s); routes planned in {g['plan_s'] * 1e3:.0f} ms")
        results["route_cases"] = r
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
        return

    full = run_scale(args.devices, args.layers, 2, args.block, args.samples, unmemoised=True)
    results["full"] = full
    print(f"Llama-3.1-405B-shaped parameters (bf16), {args.layers} layers, {full['leaves']} arrays, "
          f"{_fmt_bytes(full['bytes'])}; save on {full['devices']} devices / {full['processes']} processes "
          f"(FSDP), load onto ({full['devices'] // 16}, 16) fsdp x tp")
    print(f"  shards (chunks) in the checkpoint : {full['shards']:,} ({full['chunks_per_process']:,} per process)")
    print(f"  save planning per process          : {full['save_plan_s'] * 1e3:.0f} ms median, "
          f"{full['save_plan_max_s'] * 1e3:.0f} ms max (without the layout memo: "
          f"{full['save_plan_unmemoised_s']:.1f} s)")
    print(f"  index (format 2)                   : JSON {_fmt_bytes(full['index_bytes'])}, binary parts "
          f"{_fmt_bytes(full['index_parts_bytes'])} in all; a process builds its part in "
          f"{full['part_build_s_per_process'] * 1e3:.0f} ms; the primary's commit work "
          f"{full['commit_s_primary'] * 1e3:.0f} ms; parse {full['index_parse_s'] * 1e3:.0f} ms per loading process")
    print(f"  key figures                        : save_plan_s_per_process {full['save_plan_s_per_process']:.3f}, "
          f"commit_s_primary {full['commit_s_primary']:.3f}, index_bytes_read_per_process "
          f"{_fmt_bytes(full['index_bytes_read_per_process'])}, load_plan_s_per_process "
          f"{full['load_plan_s_per_process']:.3f}")
    for p, r in full["same_sharding"].items():
        print(f"    same-sharding load, process {p:4d}: {r['reads']:,} reads, index {_fmt_bytes(r['index_bytes_read'])} "
              f"in {r['index_requests']} requests")
    print(f"  load planning per process          : {full['load_plan_s'] * 1e3:.0f} ms median, "
          f"{full['load_plan_max_s'] * 1e3:.0f} ms max")
    for p, r in full["load"].items():
        print(f"    process {p:4d}: {r['reads']:,} reads from {r['files']} files, {_fmt_bytes(r['bytes'])} read "
              f"for {_fmt_bytes(r['needed'])} needed ({r['bytes'] / r['needed']:.2f}x); index "
              f"{_fmt_bytes(r['index_bytes_read'])} in {r['index_requests']} requests")
    ro = full["read_once"]
    print(f"  read-once load (routes {ro['routes']}): the cluster reads "
          f"{_fmt_bytes(ro['storage_bytes_read_total'])} for a {_fmt_bytes(ro['checkpoint_bytes'])} checkpoint "
          f"({ro['storage_bytes_read_total'] / ro['checkpoint_bytes']:.3f}x; direct reads: "
          f"{ro['direct_storage_bytes_read_total'] / ro['checkpoint_bytes']:.1f}x); planning "
          f"{ro['load_plan_s_per_process'] * 1e3:.0f} ms per process; at most "
          f"{_fmt_bytes(ro['collective_bytes_per_process_max'])} received over the interconnect per process")
    for p, r in ro["per_process"].items():
        print(f"    process {p:4d}: {r['reads']:,} reads, {_fmt_bytes(r['bytes'])} read; index "
              f"{_fmt_bytes(r['index_bytes_read'])} in {r['index_requests']} requests")
    small = plan_small_block(args)
    results["small_block"] = small

    if not args.quick:
        sweep = []
        print(f"\nScaling ({args.sweep_layers} layers; time per shard should not grow faster than log(shards)):")
        print(f"  {'devices':>7} {'shards':>10} {'save plan':>10} {'commit':>8} {'parse':>7} {'load plan':>10} "
              f"{'index read':>11} {'JSON index':>11}")
        for dev in [int(x) for x in args.sweep.split(",")]:
            r = run_scale(dev, args.sweep_layers, 2, args.block, 2)
            sweep.append(r)
            print(f"  {dev:>7} {r['shards']:>10,} {r['save_plan_s_per_process'] * 1e3:>8.0f}ms "
                  f"{r['commit_s_primary'] * 1e3:>6.0f}ms {r['index_parse_s'] * 1e3:>5.0f}ms "
                  f"{r['load_plan_s_per_process'] * 1e3:>8.0f}ms {_fmt_bytes(r['index_bytes_read_per_process']):>11} "
                  f"{_fmt_bytes(r['index_bytes']):>11}")
        results["sweep"] = sweep
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


def plan_small_block(args: argparse.Namespace) -> dict[str, Any]:
    """Read amplification of the resharding load: checksum block size x whole-span reads (2 layers)."""
    out = {}
    for block in (fmt.DEFAULT_BLOCK_SIZE, 64 << 10):
        for small in (1 << 20, 0):
            r = run_scale(args.devices, 2, 2, block, 1, small_read=small)
            load = next(iter(r["load"].values()))
            out[f"{block}/{small}"] = load
            print(f"  checksum block {_fmt_bytes(block):>9}, whole-span reads under {_fmt_bytes(small):>9}: "
                  f"{load['bytes'] / load['needed']:5.2f}x read amplification, {load['reads']:,} reads "
                  f"(process 0, 2-layer model)")
    return out


if __name__ == "__main__":
    main()
