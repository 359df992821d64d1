"""``cairn plan``: the dry run of a load (`_dryrun`) onto a mesh given on the command line; with
``--save DEST``, the dry run of a save (`_save.plan.plan_save`) of the checkpoint's arrays to DEST.

The mesh is made of virtual CPU devices (the planner needs only each
sharding's ``devices_indices_map``), ``--processes`` splits it into processes by
device id, ``--storage-gbps``/``--interconnect-gbps``/``--host-gbps``/``--platform`` price
each leaf's route, and ``--sharding`` gives every array the same spec: ``fsdp`` (axis 0
over every mesh axis), ``replicated``, or a PartitionSpec; or ``saved``, its saved spec. An array the spec
does not fit (too few axes, or not divisible) is planned replicated, and the
output says which.
"""

from __future__ import annotations

import math
import re
from typing import Any

from .._load import engine as _load
from .._sources import registry as _sources
from .._sources.dryrun import LoadPlan, plan_load
from .._storage.location import resolve
from .._tree.pytree import map_with_path
from .._tree.shardings import on_mesh


def add_command(sub: Any, parse_bytes: Any) -> None:
    """Register ``cairn plan`` on the command line's subparsers."""
    s = sub.add_parser("plan", help="dry run of a load onto a mesh: bytes, requests, peak host memory and time "
                       "per process (reads no array data); or, with --compression, what compression= decided and "
                       "what \"auto\" would decide saving the arrays to a storage")
    s.add_argument("path")
    s.add_argument("--mesh", help="a device count (8: one axis 'data') or axes (data=4,model=2), "
                   "made of virtual CPU devices (required unless --compression)")
    s.add_argument("--compression", nargs="?", const="", default=None, metavar="URL",
                   help="instead of a load: what compression= decided for each array, and what \"auto\" would "
                   "decide saving it to URL (default: where it is) and why: bandwidth, cores, codec speeds, each "
                   "leaf's sample ratio (reads a sample of each array's first chunk)")
    s.add_argument("--save", metavar="URL", help="instead of a load: the dry run of a save of the checkpoint's "
                   "arrays (their shapes and dtypes; no array data is read or written) to URL: this process's "
                   "files, chunks and bytes per checkpointable, each leaf's codec decision (fixed, or measured on "
                   "its first chunk), as cairn.save plans them")
    s.add_argument("--save-compression", default="auto", metavar="C", help="with --save: compression= as "
                   "cairn.save takes it (auto, none, zstd, planes, blosc2, blosc2-lz4, true; default auto)")
    s.add_argument("--gbps", type=float, metavar="GB/s", help="with --compression: the storage bandwidth (each "
                   "way) \"auto\" prices with (default: the storage's own, or its kind's default)")
    s.add_argument("--cores", type=int, help="with --compression: the cores \"auto\" counts (default: this host's)")
    s.add_argument("--sharding", default="fsdp", help="for every array: fsdp (axis 0 over every mesh axis), "
                   "replicated, saved (its saved PartitionSpec, as cairn.load(mesh=)), or a PartitionSpec such as "
                   "'data,model' or \"P(('data', 'model'), None)\"")
    s.add_argument("--processes", type=int, default=1, help="plan for N processes, each holding 1/N of the "
                   "mesh's devices (default 1)")
    s.add_argument("--bandwidth", type=float, metavar="GB/s", help="the same as --storage-gbps (the older name)")
    s.add_argument("--storage-gbps", type=float, metavar="GB/s", help="storage read bandwidth per process that "
                   "routes are priced with (default: per storage kind, as cairn.load)")
    s.add_argument("--interconnect-gbps", type=float, metavar="GB/s", help="interconnect bandwidth per process "
                   "that routes are priced with (default: per --platform)")
    s.add_argument("--request-ms", type=float, metavar="ms", help="effective time per storage request")
    s.add_argument("--host-gbps", type=float, metavar="GB/s", help="rate per process at which the host checks "
                   "(CRC-32C) and copies out bytes read (0: leave host work out)")
    s.add_argument("--platform", choices=["cpu", "gpu", "tpu"], help="the platform whose interconnect default "
                   "prices the routes (default cpu: the plan's virtual devices)")
    s.add_argument("--budget", type=parse_bytes, default=1 << 30, help="the load's budget_bytes (default 1G)")
    s.add_argument("--read-once", choices=["auto", "on", "off"], default="auto")
    s.add_argument("--format", choices=_sources.FORMATS, help="the source's format (default: detected)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_plan)


def cmd_plan(args: Any, out: Any) -> int:
    if args.save is not None:
        return _save_plan(args, out)
    if args.compression is not None:
        from .._core.units import human_bytes
        from .compression import compression_plan, print_plan

        data = compression_plan(args.path, args.compression or args.path, args.gbps, args.cores)
        if args.json:
            import json

            print(json.dumps(data, indent=2))
        else:
            print_plan(data, out, human_bytes)
        return 0
    if not args.mesh:
        raise ValueError("cairn plan: give --mesh (a load's dry run) or --compression (what compression decides)")
    names, sizes = parse_mesh(args.mesh)
    jax = _cpu_jax(math.prod(sizes))
    import numpy as np

    devices = sorted(jax.devices(), key=lambda d: d.id)[: math.prod(sizes)]
    mesh = jax.sharding.Mesh(np.array(devices).reshape(sizes), names)
    target, odd = cli_target(args.path, mesh, args.sharding, args.format)
    declared = {k: v for k, v in (("storage_gbps", args.storage_gbps), ("interconnect_gbps", args.interconnect_gbps),
                                  ("request_ms", args.request_ms), ("host_gbps", args.host_gbps)) if v is not None}
    if args.bandwidth is not None:  # the older flag: the storage bandwidth, as --storage-gbps gives it
        declared.setdefault("storage_gbps", args.bandwidth)
    plan = plan_load(args.path, target, processes=args.processes, budget_bytes=args.budget,
                     read_once={"auto": None, "on": True, "off": False}[args.read_once], format=args.format,
                     bandwidths=declared or None, platform=args.platform)
    where = f"mesh {dict(zip(names, sizes))} of virtual CPU devices, sharding {args.sharding!r}"
    notes = [where] + ([f"{len(odd)} array{'s' if len(odd) != 1 else ''} replicated, the sharding does not fit: "
                        + ", ".join(odd[:3]) + (" ..." if len(odd) > 3 else "")] if odd else [])
    plan = LoadPlan(**{**vars(plan), "notes": tuple(notes)})
    if args.json:
        import json

        print(json.dumps(plan.to_json(), indent=2))
    else:
        for line in str(plan).splitlines():
            out.line(line)
    return 0


def _save_plan(args: Any, out: Any) -> int:
    """``cairn plan PATH --save DEST``: `plan_save` of the arrays of PATH to DEST, summed (`SavePlan.describe`)."""
    import json

    import numpy as np

    from .._core.units import human_bytes
    from .._dist.coord import SingleProcess
    from .._save.plan import plan_save

    compression: Any = {"true": True, "false": False, "none": None}.get(args.save_compression.lower(),
                                                                         args.save_compression)

    def stand_in(x: Any) -> Any:
        # An array of the stored shape and dtype that holds no bytes (every element the one zero): the
        # plan looks at shapes and dtypes only.
        if not isinstance(x, _load.ArrayMetadata):
            return x
        dtype = x.dtype if isinstance(x.dtype, np.dtype) else np.dtype(np.uint8)
        shape = x.shape if isinstance(x.dtype, np.dtype) else (x.nbytes,)
        return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=shape, strides=(0,) * len(shape),
                                               writeable=False)

    meta = _load.metadata(_sources.open_source(resolve(args.path), format=args.format, locate=False),
                          per_process=lambda subs, build: None)
    state = map_with_path(lambda _p, x: stand_in(x), meta, is_leaf=lambda x: isinstance(x, _load.ArrayMetadata))
    plan = plan_save(resolve(args.save), state, coordinator=SingleProcess(), compression=compression).describe()
    if args.json:
        print(json.dumps(plan, indent=2))
        return 0
    base = f", against {plan['base']}" if plan["base"] else ""
    out.line(f"save of {args.path}'s arrays to {plan['path']}: compression {plan['compression']}, "
             f"block {human_bytes(plan['block_size'])}{base}")
    for name, item in plan["items"].items():
        leaves = ", ".join(f"{n} {c}" for c, n in sorted(item["leaves"].items())) or "no arrays"
        out.line(f"  {name}: {item['files']} file(s), {item['chunks']} chunk(s), {human_bytes(item['bytes'])}; "
                 f"leaves: {leaves}")
    return 0


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``8`` -> one axis "data"; ``data=4,model=2`` -> those axes."""
    if text.strip().isdigit():
        return ("data",), (int(text),)
    names, sizes = [], []
    for part in text.split(","):
        name, eq, size = part.partition("=")
        if not eq or not name.strip().isidentifier() or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--mesh: {text!r} is not a device count (8) or axes like data=4,model=2")
        names.append(name.strip())
        sizes.append(int(size))
    return tuple(names), tuple(sizes)


def parse_spec(text: str, axes: tuple[str, ...]) -> tuple[tuple[str, ...], ...] | str:
    """``fsdp`` / ``replicated``, or a PartitionSpec as entries (each a tuple of mesh axes)."""
    t = text.strip()
    if t in ("fsdp", "replicated"):
        return t
    if t.startswith("P(") and t.endswith(")"):
        t = t[2:-1]
    entries: list[tuple[str, ...]] = []
    for m in re.finditer(r"\s*(\([^)]*\)|[^,]+)\s*(?:,|$)", t):
        names = tuple(x.strip().strip("'\"") for x in m.group(1).strip("()").split(",") if x.strip())
        names = tuple(x for x in names if x not in ("None", "_"))
        unknown = [x for x in names if x not in axes]
        if unknown:
            raise ValueError(f"--sharding {text!r}: {unknown} are not axes of the mesh {list(axes)}")
        entries.append(names)
    return tuple(entries)


def cli_target(path: str, mesh: Any, sharding: str, format: str | None) -> tuple[Any, list[str]]:
    """The checkpoint's tree with `sharding` on `mesh` for every array (replicated where it does not fit);
    ``saved``: each array's recorded PartitionSpec on `mesh`, as ``cairn.load(mesh=)`` (its errors too)."""
    import jax

    loc = resolve(path)
    # A per-process value (cairn.PerProcess) is host-local: None in the target, so each process plans to read
    # its own value, or every saved one on another process count, as a load without a target does.
    meta = _load.metadata(_sources.open_source(loc, format=format, locate=False),
                          per_process=lambda subs, build: None)
    spec = "saved" if sharding.strip() == "saved" else parse_spec(sharding, tuple(mesh.axis_names))
    odd: list[str] = []

    def leaf(p: str, x: Any) -> Any:
        if not isinstance(x, _load.ArrayMetadata) or x.kind not in ("array", "prng_key"):
            return None
        if spec == "saved":
            return on_mesh(x.sharding, mesh, f"{loc.path}: leaf {p!r}") if x.sharding is not None else None
        entries = ((tuple(mesh.axis_names),) if x.shape else ()) if spec == "fsdp" else () if spec == "replicated" \
            else spec
        fits = len(entries) <= len(x.shape) and all(
            n % math.prod(mesh.shape[a] for a in e) == 0 for n, e in zip(x.shape, entries))
        if not fits:
            odd.append(p)
            entries = ()
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*[e or None for e in entries]))

    return map_with_path(leaf, meta, is_leaf=lambda x: isinstance(x, _load.ArrayMetadata)), odd


def _cpu_jax(count: int) -> Any:
    """JAX with at least `count` virtual CPU devices (set up here unless JAX is already imported)."""
    import os
    import sys

    if "jax" not in sys.modules:
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
        os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])
    import jax

    if len(jax.devices()) < count:
        raise ValueError(f"the mesh needs {count} devices, this process has {len(jax.devices())} "
                         "(JAX was set up before the plan)")
    return jax


__all__ = ["add_command", "cli_target", "cmd_plan", "parse_mesh", "parse_spec"]
