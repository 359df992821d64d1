"""Write the golden checkpoints of a cairn format version (tests/golden/v1/, tests/golden/v2/).

Run once, by hand, and commit what it writes; never regenerate a committed
golden (they stand for checkpoints users already have on disk; every later
cairn must still load them). Only a new golden for a new case is added:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        .venv/bin/python tests/golden/make_golden.py NAME [NAME ...]

refuses to overwrite an existing folder. With no NAME it writes every golden
that is missing. Writing `step_5` also rewrites the worked example of
docs/FORMAT.md from its files (§11 from v1's, §13 from v2's; see format_example.py).
`--out tests/golden/v2` writes the version-2 goldens (what today's cairn writes).

Every value is a deterministic function of nothing (np.arange and constants);
tests/format/test_golden.py rebuilds the expected values on its own, independently of
this file, so editing this file can never change what the tests expect.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import format_example

jax.config.update("jax_enable_x64", True)  # int64/float64 jax.Arrays stay 64-bit (as in the tests)

HERE = Path(__file__).resolve().parent
V1 = HERE / "v1"


# ----------------------------------------------------------------------------- the goldens


def step_5(path: Path) -> None:
    """docs/FORMAT.md §11, verbatim (on the first two of the 8 CPU devices)."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    w = jax.device_put(np.arange(8, dtype=np.float32).reshape(4, 2), NamedSharding(mesh, P("x")))
    cairn.save(path, {"params": {"w": w, "b": np.array([0.5, -1.0], ml_dtypes.bfloat16)},
                      "step": 5, "lr": 0.001}, user_metadata={"note": "example"})


def numpy_arrays(path: Path) -> None:
    """numpy arrays of many dtypes, 0-d, empty, non-contiguous; one checkpointable."""
    arrays = {
        "f32": np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 8 - 1,
        "bf16": (np.arange(-8, 8, dtype=np.float32) / 4).astype(ml_dtypes.bfloat16),
        "i8": np.arange(-128, 128, dtype=np.int16).astype(np.int8).reshape(16, 16),
        "bool": np.arange(10) % 3 == 0,
        "scalar0d": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "f16": np.arange(12, dtype=np.float16).reshape(3, 4) - 6,
        "u16": np.arange(0, 65536, 4096, dtype=np.uint16),
        "i64": np.arange(6, dtype=np.int64) * -(2**40),
        "f64": np.arange(5, dtype=np.float64) / 3,
        "c64": (np.arange(4) + 1j * np.arange(4, 8)).astype(np.complex64),
        "f8": (np.arange(16, dtype=np.float32) - 8).astype(ml_dtypes.float8_e4m3fn),
        "i4": (np.arange(16) - 8).astype(ml_dtypes.int4),
        "fortran": np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4)),
        "transposed": np.arange(12, dtype=np.uint8).reshape(3, 4).T,
    }
    cairn.save(path, {"arrays": arrays})


def jax_arrays(path: Path) -> None:
    """jax.Arrays over 8 CPU devices: multi-chunk grids, partial and full replication."""
    devs = jax.devices()
    assert len(devs) == 8, "needs 8 (virtual CPU) devices"
    mesh42 = jax.make_mesh((4, 2), ("x", "y"))
    mesh8 = jax.make_mesh((8,), ("x",))
    state = {
        "w": jax.device_put(np.arange(192, dtype=np.float32).reshape(16, 12) / 2,
                            NamedSharding(mesh42, P("x", "y"))),
        "v": jax.device_put(np.arange(40, dtype=np.int32) * 3 - 50, NamedSharding(mesh8, P("x"))),
        "cube": jax.device_put(np.arange(96, dtype=np.int16).reshape(4, 4, 6) - 48,
                               NamedSharding(mesh42, P("x", None, "y"))),
        "cols": jax.device_put((np.arange(48, dtype=np.float32).reshape(8, 6) / 16).astype(ml_dtypes.bfloat16),
                               NamedSharding(mesh42, P(None, "y"))),
        "replicated": jax.device_put(np.arange(15, dtype=np.float32).reshape(5, 3) - 7,
                                     NamedSharding(mesh42, P())),
        "single": jax.device_put(np.arange(6, dtype=np.uint32) * 1000, devs[3]),
    }
    cairn.save(path, {"params": state})


class Point(collections.namedtuple("Point", ["x", "y"])):
    __slots__ = ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pair:
    first: object
    second: object


Point.__module__ = Pair.__module__ = "golden"  # the names recorded in the structure


def values(path: Path) -> None:
    """Python scalars, str, bytes, None, numpy scalars, nested containers of every kind."""
    state = {
        "scalars": {
            "int": 7,
            "neg": -3,
            "big": 2**100 + 1,
            "float": 0.1,
            "negzero": -0.0,
            "inf": float("inf"),
            "nan": float("nan"),
            "complex": complex(1.5, -2.0),
            "true": True,
            "false": False,
            "none": None,
            "str": "héllo / wörld %",
            "empty_str": "",
            "bytes": bytes(range(256)),
            "empty_bytes": b"",
            "np_f32": np.float32(1.25),
            "np_i64": np.int64(-(2**62)),
            "np_bf16": ml_dtypes.bfloat16(-0.5),
            "np_bool": np.bool_(True),
        },
        "nested": {
            "list": [1, [2, [3, np.arange(3, dtype=np.int32)]], "x"],
            "tuple": (np.arange(4, dtype=np.float32), ("a", None), ()),
            "dict": {"a": {"b": {"c": np.arange(2, dtype=np.int64)}}, "empty": {}},
            "int_keys": {1: "one", 20: np.arange(2, dtype=np.uint8)},
            "odd/keys": {"a/b": 1, "50%": 2, "": 3, "é": 4},
            "empty_list": [],
            "point": Point(np.arange(2, dtype=np.float32), "y"),
            "pair": Pair(first=np.arange(3, dtype=np.int8), second=[1.5]),
        },
    }
    cairn.save(path, state)


def root_tree(path: Path) -> None:
    """A state that is not a mapping: a root checkpoint (item "" in folder %root)."""
    cairn.save(path, (np.arange(6, dtype=np.int16).reshape(2, 3), "root", [None, 7]))


def root_leaf(path: Path) -> None:
    """A root checkpoint of one array leaf (key path "")."""
    cairn.save(path, np.arange(10, dtype=np.float32) * 1.5)


def two_items(path: Path) -> None:
    """Two checkpointables (one with a name that needs escaping) and custom metadata."""
    mesh8 = jax.make_mesh((8,), ("x",))
    state = {
        "params": {"dense": {"kernel": jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8) / 10,
                                                      NamedSharding(mesh8, P("x"))),
                             "bias": np.arange(8, dtype=np.float32) - 4}},
        "opt.state": {"count": np.array(3, dtype=np.int32), "mu": np.arange(8, dtype=np.float32) / 100},
    }
    meta = {"note": "two checkpointables", "run": {"id": 42, "tags": ["a", "b"], "lr": 0.5,
                                                      "none": None, "ok": True}, "unicode": "é✓"}
    cairn.save(path, state, user_metadata=meta)


class Tag:
    """A user type stored through a registered handler (leaf kind "object")."""

    def __init__(self, text: str):
        self.text = text


def object_leaf(path: Path) -> None:
    """A leaf of kind "object": the bytes of handler "golden.Tag" (UTF-8 of the text)."""
    cairn.register_type(Tag, save=lambda t: t.text.encode(), load=lambda b: Tag(b.decode()), name="golden.Tag")
    cairn.save(path, {"tags": {"one": Tag("first tag"), "two": [Tag("ü"), 5]}})


def manager(path: Path) -> None:
    """A CheckpointManager directory: steps 10 and 20 with metrics in their manifests."""
    mgr = cairn.CheckpointManager(path, async_save=False, handle_sigterm=False)
    mgr.save(10, {"params": {"w": np.arange(6, dtype=np.float32) * 10}, "step": 10}, metrics={"loss": 0.5})
    mgr.save(20, {"params": {"w": np.arange(6, dtype=np.float32) * 20}, "step": 20},
             metrics={"loss": 0.25, "acc": float("nan")})
    mgr.close()


def small_blocks(path: Path) -> None:
    """96 KiB in chunks of 12 KiB with 4 KiB checksum blocks (3 CRCs a chunk), in 4 data files.

    Block size and file split are not public options: this calls the save
    engine (`cairn._save.engine.prepare`) of the commit the goldens were written at.
    """
    from cairn._save import engine as _save
    from cairn._storage import location as _location

    mesh = jax.make_mesh((4, 2), ("x", "y"))
    w = jax.device_put(np.arange(24576, dtype=np.float32).reshape(128, 192), NamedSharding(mesh, P("x", "y")))
    b = jax.device_put(np.arange(128, dtype=np.int64) - 64, NamedSharding(mesh, P("x")))
    job = _save.prepare(_location.resolve(path), {"w": w, "b": b}, block_size=4096, threads=4,
                        min_file_bytes=16384)
    job.run()


def two_processes(path: Path) -> None:
    """A save by 2 JAX processes (4 CPU devices each): data files p00000-* and p00001-*."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), str(port), str(path)], env=env)
             for i in range(2)]
    codes = [p.wait(300) for p in procs]
    assert codes == [0, 0], f"worker exit codes {codes}"


def _two_processes_worker(index: int, port: int, path: str) -> None:
    addr = f"127.0.0.1:{port}"
    jax.distributed.initialize(coordinator_address=addr, coordinator_bind_address=addr, num_processes=2,
                               process_id=index, initialization_timeout=60)
    assert jax.process_count() == 2 and len(jax.devices()) == 8
    mesh = jax.make_mesh((4, 2), ("x", "y"))

    def global_array(full: np.ndarray, spec: P) -> jax.Array:
        return jax.make_array_from_callback(full.shape, NamedSharding(mesh, spec), lambda idx: full[idx])

    state = {
        "params": {
            "w": global_array(np.arange(128, dtype=np.float32).reshape(16, 8) - 64, P("x", "y")),
            "rows": global_array(np.arange(24, dtype=np.int32).reshape(8, 3) * 7, P("x")),
            "rep": global_array(np.arange(6, dtype=np.float64) / 4, P()),
        },
        "step": 3,
    }
    cairn.save(path, state, split_replicas=True, user_metadata={"processes": 2})
    jax.distributed.shutdown()


def prng_keys(path: Path) -> None:
    """Typed PRNG keys (format version 2 only; the version-1 writer had no `prng_key` leaves). The
    key data are np.arange values wrapped as keys, so no RNG algorithm decides them."""
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    keys = jax.random.wrap_key_data(np.arange(16, dtype=np.uint32).reshape(8, 2) * 3, impl="threefry2x32")
    cairn.save(path, {
        "key": jax.random.wrap_key_data(np.array([0, 42], np.uint32), impl="threefry2x32"),
        "keys": jax.device_put(keys, NamedSharding(mesh, P("x"))),
        "rbg": jax.random.wrap_key_data(np.arange(4, dtype=np.uint32) * 1000 + 1, impl="rbg"),
        "step": 1,
    })


GOLDENS = {f.__name__: f for f in (step_5, numpy_arrays, jax_arrays, values, root_tree, root_leaf,
                                     two_items, object_leaf, manager, small_blocks, two_processes, prng_keys)}
#: Goldens of a later format version only: never written into v1/.
NOT_IN_V1 = {"prng_keys"}


def codecs(path: Path) -> None:
    """Format version 3 only: one save whose leaves get each codec by measurement (`compression=True`),
    sharded over 4 devices, with 4 KiB blocks so that chunks hold several compressed blocks."""
    from cairn._save import engine as _save
    from cairn._storage import location as _location

    rng = np.random.default_rng(29)
    mesh = jax.make_mesh((4,), ("x",))
    weights = jax.device_put((rng.normal(0, 0.02, (64, 256))).astype(ml_dtypes.bfloat16),
                             NamedSharding(mesh, P("x")))
    state = {"weights": weights,  # trained-like bf16: "planes"
             "moments": np.zeros((4096,), np.float32),  # zeros
             "ids": (np.arange(6000, dtype=np.int64) % 7),  # small integers
             "noise": rng.integers(0, 256, 10000, dtype=np.uint8),  # incompressible: "none"
             "step": 3}
    job = _save.prepare(_location.resolve(path), {"state": state}, block_size=4096, threads=2,
                        min_file_bytes=16384, compression=True)
    job.run()


GOLDENS["codecs"] = codecs
NOT_IN_V1.add("codecs")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        _two_processes_worker(int(argv[1]), int(argv[2]), argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"goldens to write (default: every missing one of {list(GOLDENS)})")
    ap.add_argument("--out", type=Path, default=V1, help="folder of the goldens (default: %(default)s)")
    ap.add_argument("--compression", default=None,
                    help="the `compression=` of every save (v3: True, i.e. a codec per leaf by measurement)")
    args = ap.parse_args(argv)
    if args.compression is not None:
        import functools

        from cairn._save import engine as _engine

        comp = True if args.compression == "True" else args.compression
        real = _engine.prepare

        @functools.wraps(real)
        def forced(*a, **kw):  # every save goes through it
            return real(*a, **{**kw, "compression": comp})

        _engine.prepare = forced
    names = args.names or [n for n in GOLDENS if not (args.out / n).exists() and not (args.out == V1 and n in NOT_IN_V1)]
    for name in names:
        if name not in GOLDENS:
            ap.error(f"unknown golden {name!r}; known: {list(GOLDENS)}")
        if (args.out / name).exists():
            ap.error(f"{args.out / name} exists; goldens are never regenerated (add a new one instead)")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"writing with cairn {cairn.__version__} from {Path(cairn.__file__).parent}")
    for name in names:
        GOLDENS[name](args.out / name)
        size = sum(f.stat().st_size for f in (args.out / name).rglob("*") if f.is_file())
        print(f"wrote {args.out / name} ({size} bytes)")
    if "step_5" in names and args.out == V1:
        format_example.update_format_md(V1 / "step_5")
        print(f"rewrote the worked example of {format_example.FORMAT_MD}")
    if "step_5" in names and args.out.resolve() == (HERE / "v2").resolve():
        format_example.update_format_md_v2(args.out / "step_5")
        print(f"rewrote the version-2 worked example of {format_example.FORMAT_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
