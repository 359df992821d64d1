"""Golden checkpoints of format version 1 (tests/golden/v1/) still load, exactly.

The goldens were written once by tests/golden/make_golden.py and are never
regenerated: they stand for checkpoints users already have. The expected
values below are rebuilt here from scratch (np.arange and constants), not
imported from make_golden.py, so no edit to the writer can move them.
A failure here means an old checkpoint no longer loads as it did: fix the
reader, never the golden.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import cairn

GOLDEN_ROOT = Path(__file__).resolve().parents[1] / "golden"
GOLDEN = GOLDEN_ROOT / "v1"  # the cases that check one version only (FORMAT.md §11 shows v1's step_5)
VERSIONS = ("v1", "v2")  # every committed version's goldens: each must load, with the same values
FORMAT_MD = Path(__file__).resolve().parents[2] / "docs" / "FORMAT.md"
bf16, f8, i4 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.int4


# ------------------------------------------------------------------------- expected values


class Tag:
    """The user type of the `object_leaf` golden (handler "golden.Tag": UTF-8 of `text`)."""

    def __init__(self, text: str):
        self.text = text

    def __eq__(self, other: object) -> bool:
        return type(other) is Tag and other.text == self.text

    def __repr__(self) -> str:
        return f"Tag({self.text!r})"


@pytest.fixture(autouse=True)
def _tag_handler():
    cairn.register_type(Tag, save=lambda t: t.text.encode(), load=lambda b: Tag(b.decode()), name="golden.Tag")


def _jax_arrays() -> dict[str, np.ndarray]:
    return {
        "w": np.arange(192, dtype=np.float32).reshape(16, 12) / 2,
        "v": np.arange(40, dtype=np.int32) * 3 - 50,
        "cube": np.arange(96, dtype=np.int16).reshape(4, 4, 6) - 48,
        "cols": (np.arange(48, dtype=np.float32).reshape(8, 6) / 16).astype(bf16),
        "replicated": np.arange(15, dtype=np.float32).reshape(5, 3) - 7,
        "single": np.arange(6, dtype=np.uint32) * 1000,
    }


def _step(n: int) -> dict[str, Any]:
    return {"params": {"w": np.arange(6, dtype=np.float32) * n}, "step": n}


# What `cairn.load(path)` (numpy, no target) returns for each golden checkpoint.
# Namedtuples and registered nodes come back as dicts (FORMAT.md §7).
EXPECTED: dict[str, Any] = {
    "step_5": {
        "params": {"w": np.arange(8, dtype=np.float32).reshape(4, 2), "b": np.array([0.5, -1.0], bf16)},
        "step": 5,
        "lr": 0.001,
    },
    "numpy_arrays": {"arrays": {
        "f32": np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 8 - 1,
        "bf16": (np.arange(-8, 8, dtype=np.float32) / 4).astype(bf16),
        "i8": np.arange(-128, 128, dtype=np.int16).astype(np.int8).reshape(16, 16),
        "bool": np.arange(10) % 3 == 0,
        "scalar0d": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "f16": np.arange(12, dtype=np.float16).reshape(3, 4) - 6,
        "u16": np.arange(0, 65536, 4096, dtype=np.uint16),
        "i64": np.arange(6, dtype=np.int64) * -(2**40),
        "f64": np.arange(5, dtype=np.float64) / 3,
        "c64": (np.arange(4) + 1j * np.arange(4, 8)).astype(np.complex64),
        "f8": (np.arange(16, dtype=np.float32) - 8).astype(f8),
        "i4": (np.arange(16) - 8).astype(i4),
        "fortran": np.arange(12, dtype=np.int32).reshape(3, 4),
        "transposed": np.arange(12, dtype=np.uint8).reshape(3, 4).T.copy(),
    }},
    "jax_arrays": {"params": _jax_arrays()},
    "values": {
        "scalars": {
            "int": 7, "neg": -3, "big": 2**100 + 1, "float": 0.1, "negzero": -0.0,
            "inf": math.inf, "nan": math.nan, "complex": complex(1.5, -2.0), "true": True, "false": False,
            "none": None, "str": "héllo / wörld %", "empty_str": "", "bytes": bytes(range(256)),
            "empty_bytes": b"", "np_f32": np.float32(1.25), "np_i64": np.int64(-(2**62)),
            "np_bf16": bf16(-0.5), "np_bool": np.bool_(True),
        },
        "nested": {
            "list": [1, [2, [3, np.arange(3, dtype=np.int32)]], "x"],
            "tuple": (np.arange(4, dtype=np.float32), ("a", None), ()),
            "dict": {"a": {"b": {"c": np.arange(2, dtype=np.int64)}}, "empty": {}},
            "int_keys": {1: "one", 20: np.arange(2, dtype=np.uint8)},
            "odd/keys": {"a/b": 1, "50%": 2, "": 3, "é": 4},
            "empty_list": [],
            "point": {"x": np.arange(2, dtype=np.float32), "y": "y"},
            "pair": {"first": np.arange(3, dtype=np.int8), "second": [1.5]},
        },
    },
    "root_tree": (np.arange(6, dtype=np.int16).reshape(2, 3), "root", [None, 7]),
    "root_leaf": np.arange(10, dtype=np.float32) * 1.5,
    "two_items": {
        "params": {"dense": {"kernel": np.arange(64, dtype=np.float32).reshape(8, 8) / 10,
                             "bias": np.arange(8, dtype=np.float32) - 4}},
        "opt.state": {"count": np.array(3, dtype=np.int32), "mu": np.arange(8, dtype=np.float32) / 100},
    },
    "object_leaf": {"tags": {"one": Tag("first tag"), "two": [Tag("ü"), 5]}},
    "manager/step_00000010": _step(10),
    "manager/step_00000020": _step(20),
    "small_blocks": {"w": np.arange(24576, dtype=np.float32).reshape(128, 192),
                     "b": np.arange(128, dtype=np.int64) - 64},
    "two_processes": {
        "params": {
            "w": np.arange(128, dtype=np.float32).reshape(16, 8) - 64,
            "rows": np.arange(24, dtype=np.int32).reshape(8, 3) * 7,
            "rep": np.arange(6, dtype=np.float64) / 4,
        },
        "step": 3,
    },
}

# The user metadata in each manifest (FORMAT.md §3 `metadata`).
USER_METADATA: dict[str, Any] = {
    "step_5": {"note": "example"},
    "two_items": {"note": "two checkpointables",
                  "run": {"id": 42, "tags": ["a", "b"], "lr": 0.5, "none": None, "ok": True}, "unicode": "é✓"},
    "manager/step_00000010": {"cairn.manager": {"step": 10, "metrics": {"loss": 0.5}}},
    "manager/step_00000020": {"cairn.manager": {"step": 20, "metrics": {"loss": 0.25, "acc": None}}},
    "two_processes": {"processes": 2},
}

# The sharding recorded for each array leaf of the sharded goldens (FORMAT.md §6.1).
_M42 = {"axis_names": ["x", "y"], "shape": [4, 2]}
SAVED_SHARDING = {
    ("jax_arrays", "params", "w"): {"type": "NamedSharding", "num_devices": 8, "mesh": _M42, "spec": ["x", "y"]},
    ("jax_arrays", "params", "v"): {"type": "NamedSharding", "num_devices": 8,
                                    "mesh": {"axis_names": ["x"], "shape": [8]}, "spec": ["x"]},
    ("jax_arrays", "params", "cube"): {"type": "NamedSharding", "num_devices": 8, "mesh": _M42,
                                       "spec": ["x", None, "y"]},
    ("jax_arrays", "params", "cols"): {"type": "NamedSharding", "num_devices": 8, "mesh": _M42,
                                       "spec": [None, "y"]},
    ("jax_arrays", "params", "replicated"): {"type": "NamedSharding", "num_devices": 8, "mesh": _M42, "spec": []},
    ("jax_arrays", "params", "single"): {"type": "SingleDeviceSharding", "num_devices": 1, "device": "cpu:3"},
    ("step_5", "params", "w"): {"type": "NamedSharding", "num_devices": 2,
                                "mesh": {"axis_names": ["x"], "shape": [2]}, "spec": ["x"]},
}

# Goldens of version 2 only (the version-1 writer had no such leaves): their numpy loads.
EXPECTED_V2: dict[str, Any] = {
    # Typed PRNG keys load as their key data without a target (FORMAT.md §6.1, `prng_key`).
    "prng_keys": {"key": np.array([0, 42], np.uint32), "keys": np.arange(16, dtype=np.uint32).reshape(8, 2) * 3,
                  "rbg": np.arange(4, dtype=np.uint32) * 1000 + 1, "step": 1},
}


def _codecs_state() -> dict[str, Any]:
    rng = np.random.default_rng(29)
    weights = rng.normal(0, 0.02, (64, 256)).astype(ml_dtypes.bfloat16)
    return {"state": {"weights": weights, "moments": np.zeros((4096,), np.float32),
                      "ids": np.arange(6000, dtype=np.int64) % 7,
                      "noise": rng.integers(0, 256, 10000, dtype=np.uint8), "step": 3}}


# Goldens of version 3 only (compressed blocks, FORMAT.md §6.4). The other v3 goldens are the v1/v2
# cases saved with `compression=True` (a codec per leaf by measurement), all but two_processes.
EXPECTED_V3: dict[str, Any] = {"codecs": _codecs_state()}
V3_CASES = [n for n in EXPECTED if not n.startswith("two_processes")] + list(EXPECTED_V2) + list(EXPECTED_V3)
ALL_VERSIONS = (*VERSIONS, "v3")

CHECKPOINTS = sorted([f"{v}/{name}" for v in VERSIONS for name in EXPECTED] + [f"v2/{n}" for n in EXPECTED_V2]
                     + [f"v3/{n}" for n in V3_CASES])


def _base(name: str) -> str:
    return name.split("/", 1)[1]


def _expected(name: str) -> Any:
    base = _base(name)
    if base in EXPECTED_V3:
        return EXPECTED_V3[base]
    return EXPECTED_V2[base] if base in EXPECTED_V2 else EXPECTED[base]


def test_every_golden_is_checked():
    on_disk = sorted(
        p.parent.relative_to(GOLDEN_ROOT).as_posix() for p in GOLDEN_ROOT.rglob("manifest.json")
        if p.parent.parent.name in ALL_VERSIONS or p.parent.parent.parent.name in ALL_VERSIONS
    )
    assert on_disk == CHECKPOINTS, "a golden checkpoint without expected values in test_golden.py (or vice versa)"


# ------------------------------------------------------------------------- comparison


def assert_identical(got: Any, want: Any, where: str = "") -> None:
    """Same container types and key order, same leaf types, arrays equal bit for bit (dtype included)."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: got {type(got).__name__}, want numpy array"
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype}, want {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {got.shape}, want {want.shape}"
        np.testing.assert_array_equal(got, want, err_msg=where, strict=True)
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), f"{where}: bytes differ"
    elif isinstance(want, np.generic):
        assert type(got) is type(want), f"{where}: got {type(got)}, want {type(want)}"
        assert got.tobytes() == want.tobytes(), f"{where}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        assert type(got) is dict, f"{where}: got {type(got).__name__}, want dict"
        assert list(got) == list(want), f"{where}: keys {list(got)}, want {list(want)}"
        for k in want:
            assert_identical(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want), f"{where}: got {type(got).__name__}, want {type(want).__name__}"
        assert len(got) == len(want), f"{where}: length {len(got)}, want {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_identical(g, w, f"{where}/{i}")
    elif isinstance(want, float):
        assert type(got) is float, f"{where}: got {type(got).__name__}, want float"
        assert got.hex() == want.hex() or (math.isnan(want) and math.isnan(got)), f"{where}: {got!r} != {want!r}"
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def _leaves(tree: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in _leaves(v, (*path, k))]
    if isinstance(tree, (list, tuple)):
        return [x for i, v in enumerate(tree) for x in _leaves(v, (*path, i))]
    return [(path, tree)]


def _get(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


# ------------------------------------------------------------------------- loading


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_loads_as_numpy(name):
    assert_identical(cairn.load(GOLDEN_ROOT / name), _expected(name), name)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_loads_without_verification(name):
    assert_identical(cairn.load(GOLDEN_ROOT / name, verify=False), _expected(name), name)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_metadata(name):
    meta = cairn.metadata(GOLDEN_ROOT / name)
    want = _expected(name)
    if _base(name) == "prng_keys":
        for k, shape, impl, nbytes in (("key", (), "threefry2x32", 8), ("keys", (8,), "threefry2x32", 64),
                                       ("rbg", (), "rbg", 16)):
            m = meta[k]
            assert (m.kind, m.shape, m.impl, m.nbytes) == ("prng_key", shape, impl, nbytes), k
            assert jax.dtypes.issubdtype(m.dtype, jax.dtypes.prng_key), k
        assert meta["step"] == 1
        return
    assert [p for p, _ in _leaves(meta)] == [p for p, _ in _leaves(want)]
    for path, w in _leaves(want):
        m = _get(meta, path)
        where = f"{name}/{'/'.join(map(str, path))}"
        if isinstance(w, np.ndarray):
            assert isinstance(m, cairn.ArrayMetadata), where
            assert (m.shape, m.dtype, m.nbytes, m.kind) == (w.shape, w.dtype, w.nbytes, "array"), where
            assert m == cairn.ArrayMetadata(m.shape, m.dtype, m.nbytes, m.sharding, m.kind), where  # built alike
            assert (m.impl, m.size, m.ndim) == (None, w.size, w.ndim), where
            top = (name, *path[:2])
            if top in SAVED_SHARDING:
                assert m.sharding == SAVED_SHARDING[top], where
        elif isinstance(w, bytes):
            assert isinstance(m, cairn.ArrayMetadata), where
            assert (m.shape, m.dtype, m.kind) == ((len(w),), np.dtype(np.uint8), "bytes"), where
        elif isinstance(w, Tag):
            assert isinstance(m, cairn.ArrayMetadata), where
            assert (m.shape, m.dtype, m.kind) == ((len(w.text.encode()),), np.dtype(np.uint8), "object"), where
        else:
            assert_identical(m, w, where)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_user_metadata(name):
    """The manifest's `metadata`, read as FORMAT.md §3 says, and by `cairn.user_metadata`."""
    manifest = json.loads((GOLDEN_ROOT / name / "manifest.json").read_bytes())
    assert manifest["format"] == "cairn" and manifest["version"] == int(name[1])
    assert manifest["metadata"] == USER_METADATA.get(_base(name), {})
    manager = manifest["metadata"].get("cairn.manager")  # a manager's step: the user's part of its record
    want = manager.get("user", {}) if manager is not None else manifest["metadata"]
    assert cairn.user_metadata(GOLDEN_ROOT / name) == want
    assert manifest["root"] is _base(name).startswith("root_")


def test_root_checkpoints_use_the_root_folder():
    for name in ("root_tree", "root_leaf"):
        manifest = json.loads((GOLDEN / name / "manifest.json").read_bytes())
        assert list(manifest["items"]) == [""] and manifest["items"][""]["dir"] == "%root"


def test_loads_one_checkpointable():
    path = GOLDEN / "two_items"
    out = cairn.load(path, {"opt.state": cairn.metadata(path)["opt.state"]})
    assert_identical(out, {"opt.state": EXPECTED["two_items"]["opt.state"]})
    out = cairn.load(path, {"params": {"dense": {"bias": np.zeros(8, np.float32)}}}, partial=True)
    assert_identical(out, {"params": {"dense": {"bias": EXPECTED["two_items"]["params"]["dense"]["bias"]}}})


@pytest.fixture
def mesh24():
    return jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices()[::-1])


def _target_shardings(mesh) -> dict[str, dict[str, Any]]:
    """For each sharded golden: a layout on another mesh (2 x 4, devices reversed) per array leaf."""
    ns = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    one = SingleDeviceSharding(jax.devices()[5])
    return {
        "jax_arrays": {"params": {"w": ns("b", "a"), "v": ns(("a", "b")), "cube": ns(None, "b", "a"),
                                  "cols": ns("b"), "replicated": one, "single": ns()}},
        "step_5": {"params": {"w": ns(None, "a"), "b": one}},
        "two_items": {"params": {"dense": {"kernel": ns("a", "b"), "bias": ns("b")}},
                      "opt.state": {"count": ns(), "mu": one}},
        "small_blocks": {"w": ns("b", "a"), "b": ns(("b", "a"))},
        "two_processes": {"params": {"w": ns("b"), "rows": ns("b", None), "rep": ns("a")}},
        "root_tree": (ns("a", None), "root", [None, 7]),
        "root_leaf": ns(),
    }


@pytest.mark.parametrize("version", ALL_VERSIONS)
@pytest.mark.parametrize(
    "name", ["jax_arrays", "step_5", "two_items", "small_blocks", "two_processes", "root_tree", "root_leaf"]
)
def test_loads_onto_another_mesh(version, name, mesh24):
    """Each array comes back with the target's sharding on a mesh the checkpoint never saw."""
    if version == "v3" and name == "two_processes":
        pytest.skip("no two-process golden of version 3")
    shardings = _target_shardings(mesh24)[name]
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
    target = _map(lambda s, w: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=s) if is_sharding(s) else s,
                  shardings, EXPECTED[name])
    got = cairn.load(GOLDEN_ROOT / version / name, target)
    n = 0
    for path, s in _leaves(shardings):
        g, w = _get(got, path), _get(EXPECTED[name], path)
        where = f"{name}/{'/'.join(map(str, path))}"
        if not is_sharding(s):
            assert_identical(g, w, where)
            continue
        n += 1
        assert isinstance(g, jax.Array), where
        assert g.sharding == s and g.dtype == w.dtype and g.shape == w.shape, where
        assert_identical(np.asarray(g), w, where)
        for shard in g.addressable_shards:
            assert_identical(np.asarray(shard.data), np.asarray(w[shard.index]), f"{where} shard {shard.index}")
    assert n >= 1
    assert [p for p, _ in _leaves(got)] == [p for p, _ in _leaves(shardings)]


def test_prng_keys_load_as_keys_onto_another_mesh(mesh24):
    """With key targets the golden's keys come back as typed keys of their impl, on the target's
    sharding, with the saved key data."""
    one = SingleDeviceSharding(jax.devices()[5])
    fry, rbg = jax.random.key(0, impl="threefry2x32"), jax.random.key(0, impl="rbg")
    target = {"key": jax.ShapeDtypeStruct((), fry.dtype, sharding=one),
              "keys": jax.ShapeDtypeStruct((8,), fry.dtype, sharding=NamedSharding(mesh24, P("b"))),
              "rbg": jax.ShapeDtypeStruct((), rbg.dtype, sharding=one), "step": 0}
    got = cairn.load(GOLDEN_ROOT / "v2" / "prng_keys", target)
    want = EXPECTED_V2["prng_keys"]
    for k in ("key", "keys", "rbg"):
        assert jax.dtypes.issubdtype(got[k].dtype, jax.dtypes.prng_key) and got[k].dtype == target[k].dtype, k
        assert got[k].sharding == target[k].sharding, k
        assert_identical(np.asarray(jax.random.key_data(got[k])), want[k], k)
    assert got["step"] == 1


def _map(fn: Any, tree: Any, other: Any) -> Any:
    """`fn(leaf, other's subtree at the same path)` over the leaves of `tree` (dicts, lists, tuples)."""
    if isinstance(tree, dict):
        return {k: _map(fn, v, other[k]) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(fn, v, o) for v, o in zip(tree, other))
    return fn(tree, other)


# ------------------------------------------------------------------------- corruption


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name.replace("/", "_")
    shutil.copytree(GOLDEN_ROOT / name, dst)
    return dst


def _data_files(ckpt: Path) -> list[Path]:
    manifest = json.loads((ckpt / "manifest.json").read_bytes())
    out = []
    for item in manifest["items"].values():
        index = json.loads((ckpt / item["dir"] / item["index"]).read_bytes())
        out += [ckpt / item["dir"] / f["name"] for f in index["files"] if f["size"] > 0]
    return out


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_flipped_data_byte_is_corruption(name, tmp_path):
    ckpt = _copy(name, tmp_path)
    files = _data_files(ckpt)
    assert files, f"{name} has no data file"
    for f in files:  # the middle byte of every data file, one file at a time
        original = f.read_bytes()
        _flip(f, len(original) // 2)
        with pytest.raises(cairn.CorruptCheckpointError):
            cairn.load(ckpt)
        f.write_bytes(original)
    assert_identical(cairn.load(ckpt), _expected(name), name)  # the copy itself was sound


@pytest.mark.parametrize("name", [f"{v}/{n}" for v in VERSIONS for n in ("step_5", "values", "two_processes")]
                         + ["v3/step_5", "v3/values", "v3/codecs"])
def test_a_flipped_metadata_byte_is_corruption(name, tmp_path):
    ckpt = _copy(name, tmp_path)
    manifest = json.loads((ckpt / "manifest.json").read_bytes())
    item = next(iter(manifest["items"].values()))
    for f in (ckpt / "manifest.json", ckpt / item["dir"] / item["index"]):
        original = f.read_bytes()
        digit = re.search(rb'"version":[123]', original).end() - 1  # "version":1 -> "version":0 (2 -> 3)
        _flip(f, digit)
        with pytest.raises(cairn.CorruptCheckpointError):
            cairn.load(ckpt)
        with pytest.raises(cairn.CorruptCheckpointError):
            cairn.metadata(ckpt)
        f.write_bytes(original)


# ------------------------------------------------------------------------- manager and CLI


def test_manager_reads_its_old_directory(tmp_path):
    directory = tmp_path / "run"
    shutil.copytree(GOLDEN / "manager", directory)
    before = sorted(p.relative_to(directory) for p in directory.rglob("*"))
    mgr = cairn.CheckpointManager(directory, async_save=False, handle_sigterm=False)
    try:
        assert mgr.steps() == [10, 20]
        assert mgr.latest_step() == 20
        assert mgr.metrics(10) == {"loss": 0.5}
        assert mgr.metrics(20) == {"loss": 0.25, "acc": None}
        assert_identical(mgr.restore(), EXPECTED["manager/step_00000020"])
        assert_identical(mgr.restore(10), EXPECTED["manager/step_00000010"])
    finally:
        mgr.close()
    assert sorted(p.relative_to(directory) for p in directory.rglob("*")) == before, "opening deleted files"


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_cli_verify(name, capsys):
    from cairn._cli.main import main

    assert main(["--plain", "verify", str(GOLDEN_ROOT / name)]) == 0, capsys.readouterr()


# ------------------------------------------------------------------------- FORMAT.md §11


def _worked_example() -> str:
    text = FORMAT_MD.read_text()
    return text[text.index("## 11. Worked example"): text.index("\n## 12.")]


def _blocks(section: str, lang: str) -> list[str]:
    """The bodies of the fenced code blocks of language `lang` ("" for none), in order."""
    out, body, current = [], [], None
    for line in section.splitlines():
        if current is None and line.startswith("```"):
            current, body = line[3:].strip(), []
        elif current is not None and line == "```":
            if current == lang:
                out.append("\n".join(body) + "\n")
            current = None
        elif current is not None:
            body.append(line)
    assert current is None, "unclosed code block in FORMAT.md §11"
    return out


def _json_objects(block: str) -> list[Any]:
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(block):
        if block[i].isspace():
            i += 1
            continue
        obj, i = dec.raw_decode(block, i)
        out.append(obj)
    return out


def _compact(obj: Any) -> bytes:
    """How cairn serializes metadata (FORMAT.md §11 says so)."""
    return json.dumps(obj, separators=(",", ":")).encode()


def test_format_md_example_json_is_the_golden():
    ckpt = GOLDEN / "step_5"
    section = _worked_example()
    blocks = [obj for b in _blocks(section, "json") for obj in _json_objects(b)]
    manifest = (ckpt / "manifest.json").read_bytes()
    m = json.loads(manifest)
    files = [manifest] + [(ckpt / m["items"][k]["dir"] / m["items"][k]["index"]).read_bytes()
                          for k in ("params", "step", "lr")]
    assert len(blocks) == len(files) == 4
    for shown, on_disk in zip(blocks, files):
        assert shown == json.loads(on_disk)
        assert _compact(shown) == on_disk, "FORMAT.md §11 must show the file's fields in file order"
        assert shown["crc32c"] == on_disk[11:19].decode()  # {"crc32c":"XXXXXXXX",


def test_format_md_example_listing_and_bytes_are_the_golden():
    ckpt = GOLDEN / "step_5"
    section = _worked_example()
    token = re.search(r"writes \(token `([0-9a-f]+)`\)", section).group(1)
    listing, hexdump = _blocks(section, "")
    rows = [line.split() for line in listing.strip().splitlines()]
    shown = {name.removeprefix("step_5/"): int(size) for name, size, unit in rows}
    on_disk = {p.relative_to(ckpt).as_posix(): p.stat().st_size for p in ckpt.rglob("*") if p.is_file()}
    assert shown == on_disk
    assert all(token in name for name in shown if name != "manifest.json")
    data = b"".join(bytes.fromhex("".join(re.findall(r"\b[0-9a-f]{4,8}\b", line.split("   ")[0])))
                    for line in hexdump.strip().splitlines())
    (bin_file,) = [name for name in shown if name.endswith(".bin")]
    assert data == (ckpt / bin_file).read_bytes()


def test_writer_still_writes_the_format_example(tmp_path, monkeypatch):
    """FORMAT.md's code, run today, writes the golden's bytes (up to token, time and checksums).

    When this fails and the golden still loads, the writer changed what it
    writes for the example: either a bug, or a format change that needs its own
    version and a new worked example (the v1 golden stays as it is).
    """
    (code,) = _blocks(_worked_example(), "python")
    monkeypatch.chdir(tmp_path)
    exec(code, {"jax": jax, "np": np, "ml_dtypes": ml_dtypes, "cairn": cairn, "NamedSharding": NamedSharding,
                "P": P})

    def normalized(ckpt: Path) -> dict[str, Any]:
        m = json.loads((ckpt / "manifest.json").read_bytes())
        token = re.fullmatch(r"index\.(\w+)\.json", m["items"]["params"]["index"]).group(1)
        out = {}
        for p in sorted(ckpt.rglob("*")):
            if p.is_file():
                data = p.read_bytes()
                if p.suffix == ".json":
                    obj = json.loads(data)
                    obj.pop("crc32c")
                    obj.pop("created_unix", None)
                    obj.pop("cairn_version", None)  # the writer's release: informational, not the format
                    data = json.dumps(obj).replace(token, "<token>")
                out[p.relative_to(ckpt).as_posix().replace(token, "<token>")] = data
        return out

    assert normalized(tmp_path / "step_5") == normalized(GOLDEN_ROOT / "v2" / "step_5")


def test_format_md_version_2_example_is_the_v2_golden():
    """FORMAT.md §13 shows exactly the params index and binary part of tests/golden/v2/step_5."""
    text = FORMAT_MD.read_text()
    section = text[text.index("## 13. The worked example in version 2"):]
    (block,) = _blocks(section, "json")
    (hexdump,) = _blocks(section, "text")
    ckpt = GOLDEN_ROOT / "v2" / "step_5"
    m = json.loads((ckpt / "manifest.json").read_bytes())
    on_disk = json.loads((ckpt / "params" / m["items"]["params"]["index"]).read_bytes())
    assert json.loads(block) == on_disk
    part = ckpt / "params" / on_disk["parts"][0]["name"]
    shown = b"".join(bytes.fromhex("".join(line[:71].split())) for line in hexdump.strip().splitlines())
    assert shown == part.read_bytes()
