"""Round trips through real files: leaf types, containers, targets, errors."""

from __future__ import annotations

import collections
import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn


def sharded(mesh, spec, shape, dtype=jnp.float32, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    return jax.device_put(x, NamedSharding(mesh, spec))


def assert_bitwise(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert a.tobytes() == b.tobytes()


Point = collections.namedtuple("Point", ["x", "y"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: dict
    step: int = dataclasses.field(metadata={"static": False})


# --------------------------------------------------------------------------- leaves

ALL_DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
    ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4,
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_dtypes_roundtrip_bitwise(tmp_path, dtype):
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=5 * 7 * np.dtype(dtype).itemsize, dtype=np.uint8)
    x = raw.view(dtype).reshape(5, 7) if np.dtype(dtype).itemsize else raw
    if np.dtype(dtype) == np.bool_:
        x = raw[:35].reshape(5, 7) % 2 == 1
    if np.dtype(dtype).name == "int4":
        x = (raw[:35].astype(np.int8) % 8).astype(dtype).reshape(5, 7)
    cairn.save(tmp_path / "c", {"a": x})
    assert_bitwise(cairn.load(tmp_path / "c")["a"], x)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (2, 3, 4, 5)])
def test_odd_shapes(tmp_path, shape):
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    cairn.save(tmp_path / "c", {"a": {"x": x}})
    out = cairn.load(tmp_path / "c")["a"]["x"]
    assert_bitwise(out, x)


def test_scalars_strings_bytes_none(tmp_path):
    state = {
        "vals": {
            "int": 7, "big": 2**80 + 1, "neg": -3, "float": 0.1, "nan": float("nan"), "inf": -float("inf"),
            "bool": True, "complex": 1 + 2j, "str": "héllo/../x", "none": None, "bytes": b"\x00\xffdata",
            "np_f32": np.float32(1.5), "np_i64": np.int64(-9), "np_bf16": ml_dtypes.bfloat16(3.0),
            "np_bool": np.bool_(True), "empty_bytes": b"", "empty_str": "",
        }
    }
    cairn.save(tmp_path / "c", state)
    out = cairn.load(tmp_path / "c")["vals"]
    for k, v in state["vals"].items():
        got = out[k]
        if isinstance(v, float) and np.isnan(v):
            assert np.isnan(got)
            continue
        assert type(got) is type(v), k
        assert got == v, k
        if isinstance(v, np.generic):
            assert got.dtype == v.dtype


def test_containers_plain_without_target(tmp_path, mesh8):
    w = sharded(mesh8, P("x"), (16, 4))
    state = {
        "tree": {
            "list": [1, np.zeros(2), [None, "s"]],
            "tuple": (np.ones(3), 2),
            "point": Point(x=np.int32(1), y=np.arange(3)),
            "ordered": collections.OrderedDict(b=1, a=2),
            "intkeys": {0: "zero", 1: "one"},
            "dc": TrainState(params={"w": w}, step=5),
            "empty": {}, "empty_list": [], "empty_tuple": (),
        }
    }
    cairn.save(tmp_path / "c", state)
    out = cairn.load(tmp_path / "c")["tree"]
    assert isinstance(out["list"], list) and out["list"][2] == [None, "s"]
    assert isinstance(out["tuple"], tuple)
    assert set(out["point"]) == {"x", "y"}  # namedtuples come back as plain dicts
    assert list(out["ordered"]) == ["b", "a"]
    assert out["intkeys"] == {0: "zero", 1: "one"}
    assert_bitwise(out["dc"]["params"]["w"], w)
    assert out["dc"]["step"] == 5
    assert out["empty"] == {} and out["empty_list"] == [] and out["empty_tuple"] == ()


def test_target_structure_comes_back(tmp_path, mesh8):
    w = sharded(mesh8, P("x"), (16, 4))
    state = {"s": TrainState(params={"w": w, "p": Point(np.ones(2), 3)}, step=4)}
    cairn.save(tmp_path / "c", state)
    out = cairn.load(tmp_path / "c", state)["s"]
    assert isinstance(out, TrainState) and isinstance(out.params["p"], Point)
    assert isinstance(out.params["w"], jax.Array) and out.params["w"].sharding == w.sharding
    assert_bitwise(out.params["w"], w)


def test_root_state_not_a_mapping(tmp_path, mesh8):
    w = sharded(mesh8, P("x"), (8, 8))
    cairn.save(tmp_path / "c", [w, 3])
    out = cairn.load(tmp_path / "c")
    assert isinstance(out, list) and out[1] == 3
    assert_bitwise(out[0], w)
    out2 = cairn.load(tmp_path / "c", [jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding), 0])
    assert out2[0].sharding == w.sharding


def test_single_array_root(tmp_path):
    cairn.save(tmp_path / "c", np.arange(5))
    assert_bitwise(cairn.load(tmp_path / "c"), np.arange(5))


# --------------------------------------------------------------------------- resharding


SPECS = [P("x"), P(None, "x"), P("x", "y"), P("y", "x"), P(), P(("x", "y")), P(None, ("y", "x"))]


@pytest.mark.parametrize("save_spec", [P("x"), P("x", "y"), P(None, "y"), P()], ids=str)
def test_resharding_matrix(tmp_path, mesh42, save_spec):
    x = sharded(mesh42, save_spec, (32, 24))
    cairn.save(tmp_path / "c", {"p": {"x": x}})
    meshes = [mesh42, jax.make_mesh((2, 4), ("x", "y")), jax.make_mesh((8, 1), ("x", "y"))]
    for m in meshes:
        for spec in SPECS:
            target = {"p": {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, spec))}}
            got = cairn.load(tmp_path / "c", target)["p"]["x"]
            assert got.sharding.is_equivalent_to(NamedSharding(m, spec), 2)
            assert_bitwise(got, x)


def test_load_on_fewer_devices_and_single_device(tmp_path, mesh8):
    x = sharded(mesh8, P("x"), (64, 8))
    cairn.save(tmp_path / "c", {"x": x})
    m2 = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    got = cairn.load(tmp_path / "c", {"x": NamedSharding(m2, P(None, "x"))})["x"]
    assert len(got.sharding.device_set) == 2
    assert_bitwise(got, x)
    one = cairn.load(tmp_path / "c", {"x": jax.sharding.SingleDeviceSharding(jax.devices()[3])})["x"]
    assert one.devices() == {jax.devices()[3]}
    assert_bitwise(one, x)


def test_uneven_shards(tmp_path, mesh8):
    # 10 rows over 4 devices: JAX pads the last shards; the grid must follow the real boxes.
    m4 = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    x = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    try:
        xs = jax.device_put(x, NamedSharding(m4, P("x")))
    except ValueError:
        pytest.skip("this JAX does not allow uneven sharding")
    cairn.save(tmp_path / "c", {"x": xs})
    assert_bitwise(cairn.load(tmp_path / "c")["x"], x)
    got = cairn.load(tmp_path / "c", {"x": NamedSharding(mesh8, P(None, None))})["x"]
    assert_bitwise(got, x)


def test_dtype_cast_on_load(tmp_path, mesh8):
    x = sharded(mesh8, P("x"), (16, 8))
    cairn.save(tmp_path / "c", {"x": x})
    got = cairn.load(tmp_path / "c", {"x": jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding)})["x"]
    assert got.dtype == jnp.bfloat16
    assert_bitwise(got, np.asarray(x).astype(ml_dtypes.bfloat16))
    npy = cairn.load(tmp_path / "c", {"x": np.zeros((16, 8), np.float64)})["x"]
    assert isinstance(npy, np.ndarray) and npy.dtype == np.float64
    np.testing.assert_array_equal(npy, np.asarray(x).astype(np.float64))


def test_array_template_targets(tmp_path, mesh8, mesh42):
    x = sharded(mesh8, P("x"), (16, 8))
    cairn.save(tmp_path / "c", {"x": x})
    template = jax.device_put(jnp.zeros((16, 8), jnp.float32), NamedSharding(mesh42, P("y", "x")))
    got = cairn.load(tmp_path / "c", {"x": template})["x"]
    assert got.sharding == template.sharding
    assert_bitwise(got, x)


# --------------------------------------------------------------------------- partial loads


class CountingReads:
    """Counts bytes read per file through the local storage's reader."""

    def __init__(self, monkeypatch):
        from cairn._storage import local as _local

        self.by_file: collections.Counter[str] = collections.Counter()
        orig = _local._FileReader.read_into
        counter = self

        def read_into(reader, offset, out):
            orig(reader, offset, out)
            counter.by_file[reader.path] += len(memoryview(out).cast("B"))

        orig_many = _local._FileReader.read_into_many

        def read_into_many(reader, offset, outs):
            orig_many(reader, offset, outs)
            counter.by_file[reader.path] += sum(len(memoryview(o).cast("B")) for o in outs)

        monkeypatch.setattr(_local._FileReader, "read_into", read_into)
        monkeypatch.setattr(_local._FileReader, "read_into_many", read_into_many)

    @property
    def total(self):
        """Bytes of data files read (the binary index parts are counted in `index_bytes`)."""
        return sum(n for f, n in self.by_file.items() if not os.path.basename(f).startswith("index."))

    @property
    def index_bytes(self):
        return sum(n for f, n in self.by_file.items() if os.path.basename(f).startswith("index."))


def test_load_one_checkpointable_reads_only_its_bytes(tmp_path, mesh8, monkeypatch):
    params = {"w": sharded(mesh8, P("x"), (64, 32)), "b": np.ones(32, np.float32)}
    opt = {"mu": sharded(mesh8, P("x"), (64, 32), seed=2), "nu": sharded(mesh8, P("x"), (64, 32), seed=3)}
    cairn.save(tmp_path / "c", {"params": params, "opt": opt, "config": {"lr": 0.1}})
    counter = CountingReads(monkeypatch)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)), params)
    out = cairn.load(tmp_path / "c", {"params": abstract})
    assert set(out) == {"params"}
    assert_bitwise(out["params"]["w"], params["w"])
    opt_dir = tmp_path / "c" / "opt"
    opt_files = {str(opt_dir / f) for f in os.listdir(opt_dir) if f.endswith(".bin")}
    assert opt_files and not (opt_files & set(counter.by_file))
    assert counter.total == 64 * 32 * 4 + 32 * 4  # exactly the params' bytes, each once
    # and of the binary index, the part's 64-byte header and the records (40 bytes) and block
    # checksums (4) of the 2 chunks read (w's 8 shards, one process's, are one chunk): nothing of
    # the other checkpointable's
    assert counter.index_bytes == 64 + 2 * (40 + 4)


def test_missing_and_extra_leaves(tmp_path):
    cairn.save(tmp_path / "c", {"p": {"a": np.ones(2), "b": np.zeros(3)}})
    with pytest.raises(cairn.MismatchError, match="'p/b'.*partial=True"):
        cairn.load(tmp_path / "c", {"p": {"a": np.ones(2)}})
    out = cairn.load(tmp_path / "c", {"p": {"a": np.ones(2)}}, partial=True)
    assert list(out["p"]) == ["a"]
    with pytest.raises(cairn.MismatchError, match="'p/c'"):
        cairn.load(tmp_path / "c", {"p": {"a": np.ones(2), "b": np.ones(3), "c": np.ones(1)}})
    with pytest.raises(cairn.MismatchError, match="'q'"):
        cairn.load(tmp_path / "c", {"q": {}})
    with pytest.raises(cairn.MismatchError, match="shape"):
        cairn.load(tmp_path / "c", {"p": {"a": np.ones(3), "b": np.ones(3)}})


def test_partial_subtree_reads_only_requested_leaves(tmp_path, monkeypatch):
    a, b = np.arange(1000, dtype=np.float32), np.arange(2000, dtype=np.float32)
    cairn.save(tmp_path / "c", {"p": {"a": a, "b": b}})
    counter = CountingReads(monkeypatch)
    out = cairn.load(tmp_path / "c", {"p": {"b": np.empty(2000, np.float32)}}, partial=True)
    assert_bitwise(out["p"]["b"], b)
    assert counter.total == b.nbytes


# --------------------------------------------------------------------------- metadata


def test_metadata_reads_no_array_data(tmp_path, mesh8, monkeypatch):
    x = sharded(mesh8, P("x"), (16, 8))
    cairn.save(tmp_path / "c", {"p": {"x": x, "n": 3}, "s": "hi"})
    counter = CountingReads(monkeypatch)
    info = cairn.metadata(tmp_path / "c")
    assert counter.total == 0
    meta = info["p"]["x"]
    assert meta.shape == (16, 8) and meta.dtype == np.float32 and meta.nbytes == 16 * 8 * 4
    assert meta.sharding["type"] == "NamedSharding" and meta.sharding["spec"] == ["x"]
    assert info["p"]["n"] == 3 and info["s"] == "hi"
    # A metadata tree works as a numpy target.
    out = cairn.load(tmp_path / "c", info)
    assert_bitwise(out["p"]["x"], x)


# --------------------------------------------------------------------------- keys and paths


def test_escaping_keys_stay_inside(tmp_path):
    state = {
        "../../evil": {"../x": np.ones(2), "a/b": np.zeros(2), "%2F": np.arange(2), "": 1},
        "with/slash": np.ones(1), ".hidden": 2, "..": 3, "%root": 4, "~": 5,
    }
    cairn.save(tmp_path / "inner" / "c", state)
    # Nothing was written outside the checkpoint folder.
    assert sorted(os.listdir(tmp_path)) == ["inner"]
    assert sorted(os.listdir(tmp_path / "inner")) == ["c"]
    for _dirpath, dirs, _files in os.walk(tmp_path / "inner" / "c"):
        for d in dirs:
            assert not d.startswith(".") and "/" not in d
    out = cairn.load(tmp_path / "inner" / "c")
    assert set(out) == set(state)
    assert_bitwise(out["../../evil"]["a/b"], np.zeros(2))
    assert_bitwise(out["../../evil"]["%2F"], np.arange(2))
    assert out["../../evil"][""] == 1 and out[".."] == 3 and out["%root"] == 4


def test_unsupported_leaf_names_path(tmp_path):
    with pytest.raises(cairn.UnsupportedTypeError, match=r"'p/obj'.*object"):
        cairn.save(tmp_path / "c", {"p": {"obj": object()}})
    with pytest.raises(cairn.UnsupportedTypeError, match=r"'p/s'.*dtype"):
        cairn.save(tmp_path / "c", {"p": {"s": np.array(["a", "b"])}})
    assert not (tmp_path / "c").exists()
    assert os.listdir(tmp_path) == []


def test_register_type(tmp_path):
    class Cursor:
        def __init__(self, pos):
            self.pos = pos

    cairn.register_type(Cursor, save=lambda c: str(c.pos).encode(), load=lambda b: Cursor(int(b)), name="test.Cursor")
    cairn.save(tmp_path / "c", {"data": {"it": Cursor(41)}})
    assert cairn.load(tmp_path / "c")["data"]["it"].pos == 41


# --------------------------------------------------------------------------- existing paths


def test_existing_checkpoint_and_overwrite(tmp_path):
    cairn.save(tmp_path / "c", {"a": np.ones(2)})
    with pytest.raises(cairn.CheckpointExistsError) as e:
        cairn.save(tmp_path / "c", {"a": np.zeros(2)})
    assert isinstance(e.value, FileExistsError) and str(tmp_path / "c") in str(e.value)
    assert_bitwise(cairn.load(tmp_path / "c")["a"], np.ones(2))
    cairn.save(tmp_path / "c", {"a": np.zeros(2)}, overwrite=True)
    assert_bitwise(cairn.load(tmp_path / "c")["a"], np.zeros(2))
    assert [n for n in os.listdir(tmp_path) if n != "c"] == []  # old copy removed


def test_existing_foreign_folder_is_not_touched(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(cairn.CheckpointExistsError, match="not a committed"):
        cairn.save(tmp_path / "c", {"a": np.ones(2)})
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"


def test_not_found(tmp_path):
    with pytest.raises(cairn.CheckpointNotFoundError) as e:
        cairn.load(tmp_path / "nope")
    assert isinstance(e.value, FileNotFoundError) and "nope" in str(e.value)
    (tmp_path / "half").mkdir()
    with pytest.raises(cairn.CheckpointNotFoundError, match="no committed"):
        cairn.metadata(tmp_path / "half")


# --------------------------------------------------------------------------- corruption


def _data_files(path):
    out = []
    for dirpath, _dirs, files in os.walk(path):
        out += [os.path.join(dirpath, f) for f in files if f.endswith(".bin") and not f.startswith("index.")]
    return sorted(out)


def flip_byte(path, pos, mask=0x10):
    """XOR the byte at `pos` of file `path` with `mask` (applying it twice restores the file)."""
    with open(path, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ mask]))


def test_flipped_byte_is_caught(tmp_path, mesh8):
    x = sharded(mesh8, P("x"), (256, 64))
    cairn.save(tmp_path / "c", {"x": x})
    f = _data_files(tmp_path / "c")[0]
    size = os.path.getsize(f)
    for pos in (0, size // 2, size - 1):
        flip_byte(f, pos)
        with pytest.raises(cairn.CorruptCheckpointError, match="checksum"):
            cairn.load(tmp_path / "c")
        with pytest.raises(cairn.CorruptCheckpointError, match="checksum"):
            cairn.load(tmp_path / "c", {"x": NamedSharding(mesh8, P(None, "x"))})
        flip_byte(f, pos)  # restore
    assert_bitwise(cairn.load(tmp_path / "c")["x"], x)
    # Without verification the flipped byte goes through: that is what verify is for.
    with open(f, "r+b") as fh:
        fh.write(b"\xff")
    cairn.load(tmp_path / "c", verify=False)


def test_truncated_and_missing_files(tmp_path):
    cairn.save(tmp_path / "c", {"x": np.arange(100_000, dtype=np.float32)})
    f = _data_files(tmp_path / "c")[0]
    with open(f, "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(cairn.CorruptCheckpointError, match="truncated"):
        cairn.load(tmp_path / "c")
    os.unlink(f)
    with pytest.raises(cairn.CorruptCheckpointError, match="missing"):
        cairn.load(tmp_path / "c")


def test_bad_manifest_and_index(tmp_path):
    cairn.save(tmp_path / "c", {"x": np.arange(10)})
    m = tmp_path / "c" / "manifest.json"
    good = m.read_bytes()
    for bad in [b"", b"{", b"[]", good.replace(b'"version":2', b'"version":99'), b'{"format":"other"}']:
        m.write_bytes(bad)
        with pytest.raises(cairn.CorruptCheckpointError, match="manifest.json"):
            cairn.load(tmp_path / "c")
    m.write_bytes(good)
    idx = next((tmp_path / "c" / "x").glob("index.*.json"))
    idx.write_bytes(idx.read_bytes().replace(b'"shape":[10]', b'"shape":[1000000000000000]'))
    with pytest.raises(cairn.CorruptCheckpointError):
        cairn.load(tmp_path / "c")


def test_leftover_tmp_dirs_are_ignored(tmp_path):
    cairn.save(tmp_path / "c", {"x": np.arange(3)})
    (tmp_path / ".c.cairn-tmp-deadbeef" / "x").mkdir(parents=True)
    (tmp_path / ".c.cairn-tmp-deadbeef" / "x" / "p00000-0.deadbeef.bin").write_bytes(b"junk")
    assert_bitwise(cairn.load(tmp_path / "c")["x"], np.arange(3))
    with pytest.raises(cairn.CheckpointNotFoundError):
        cairn.load(tmp_path / ".c.cairn-tmp-deadbeef")


def test_vectored_reads_fill_consecutive_buffers(tmp_path):
    from cairn._storage.local import _IOV_MAX, _FileReader

    data = np.random.default_rng(0).integers(0, 256, 3 * _IOV_MAX + 17, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    r = _FileReader(str(tmp_path / "f"))
    sizes = [1] * (2 * _IOV_MAX) + [_IOV_MAX + 10]  # more buffers than one preadv takes
    outs = [np.empty(n, np.uint8) for n in sizes]
    r.read_into_many(7, [memoryview(o) for o in outs])
    np.testing.assert_array_equal(np.concatenate(outs), data[7 : 7 + sum(sizes)])
    with pytest.raises(EOFError):
        r.read_into_many(len(data) - 4, [memoryview(np.empty(3, np.uint8)), memoryview(np.empty(3, np.uint8))])
    r.close()


def test_merged_small_chunks_land_directly_and_are_verified(tmp_path, mesh8, monkeypatch):
    x = sharded(mesh8, P("x"), (64, 16))  # eight 512-byte chunks, read as one vectored read
    cairn.save(tmp_path / "c", {"x": x})
    from cairn._load import engine as _load
    from cairn._load.source import CairnSource
    from cairn._storage.location import resolve

    stats = _load.LoadStats()
    target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)}
    got = _load.load(CairnSource.open(resolve(tmp_path / "c")), target, stats=stats)["x"]
    assert_bitwise(got, x)
    assert stats.reads == 1 and stats.direct_reads == 1
    f = _data_files(tmp_path / "c")[0]
    flip_byte(f, 1500, 1)
    with pytest.raises(cairn.CorruptCheckpointError, match="checksum"):
        cairn.load(tmp_path / "c", target)


def test_resharding_with_long_rows_reads_straight_into_the_target_rows(tmp_path, mesh8):
    # Saved as column blocks, loaded as row blocks: each overlap is contiguous in the
    # file and a block of 8 KiB rows in the target shard; it is read row by row in place.
    x = sharded(mesh8, P(None, "x"), (64, 16384))
    cairn.save(tmp_path / "c", {"x": x})
    from cairn._load import engine as _load
    from cairn._load.source import CairnSource
    from cairn._storage.location import resolve

    stats = _load.LoadStats()
    target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh8, P("x")))}
    got = _load.load(CairnSource.open(resolve(tmp_path / "c")), target, stats=stats)["x"]
    assert_bitwise(got, x)
    assert stats.reads >= 1 and stats.direct_reads == stats.reads  # no read went through a temporary buffer
    f = _data_files(tmp_path / "c")[0]
    flip_byte(f, 100_000, 4)  # a flipped byte inside a scattered read is still caught
    with pytest.raises(cairn.CorruptCheckpointError, match="checksum"):
        cairn.load(tmp_path / "c", target)


def test_a_user_coordinator_without_drop(tmp_path):
    """`Coordinator.drop` is optional: a coordinator without it saves and loads again and again
    (the keys of earlier saves stay in its store)."""

    class Keys:
        process_index, process_count = 0, 1

        def __init__(self):
            self.kv = {}

        def publish(self, key, value):
            assert key not in self.kv, f"key {key} written twice"
            self.kv[key] = value

        def fetch(self, key, timeout):
            return self.kv[key]

        def fetch_all(self, prefix, count, timeout):
            got = {k: v for k, v in self.kv.items() if k.startswith(prefix + "/")}
            assert len(got) == count
            return got

    coord = Keys()
    for i in range(3):
        cairn.save(tmp_path / f"c{i}", {"x": np.full(4, i)}, coordinator=coord)
    assert [cairn.load(tmp_path / f"c{i}", coordinator=coord)["x"][0] for i in range(3)] == [0, 1, 2]
    saves = {k.split("/")[2] for k in coord.kv if k.startswith("cairn/save/")}
    assert len(saves) == 3  # nothing dropped the keys of the earlier saves


def test_eval_shape_targets_over_an_abstract_mesh(tmp_path):
    """jax.eval_shape under a mesh with Explicit axes gives shardings over an AbstractMesh: they load
    onto the concrete mesh set with jax.set_mesh, and without one the error names the leaf and the fix."""
    if not hasattr(jax.sharding, "AbstractMesh") or not hasattr(jax, "set_mesh"):
        pytest.skip("this JAX has no abstract meshes")
    mesh = jax.make_mesh((8,), ("x",))
    s = NamedSharding(mesh, P("x"))
    w = jax.device_put(np.arange(32, dtype=np.float32), s)
    cairn.save(tmp_path / "c", {"w": w})
    target = jax.eval_shape(lambda: {"w": jax.device_put(np.zeros(32, np.float32), s)})
    if not isinstance(target["w"].sharding.mesh, jax.sharding.AbstractMesh):
        pytest.skip("this JAX's eval_shape keeps the concrete mesh")
    with pytest.raises(cairn.MismatchError, match=r"c: leaf 'w'.*abstract mesh.*jax.set_mesh"):
        cairn.load(tmp_path / "c", target)
    with jax.set_mesh(mesh):
        got = cairn.load(tmp_path / "c", target)["w"]
    assert got.sharding == s
    np.testing.assert_array_equal(np.asarray(got), np.arange(32, dtype=np.float32))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_user_metadata_reads_back_what_save_was_given(tmp_path, where):
    import uuid

    base = str(tmp_path) if where == "local" else f"memory://meta-{uuid.uuid4().hex}"
    given = {"data_epoch": 3, "git": "abc123", "nested": {"lr": [0.1, 0.01], "ok": True, "none": None}, "é": "ü"}
    cairn.save(f"{base}/with", {"x": np.arange(3)}, user_metadata=given)
    cairn.save_async(f"{base}/async", {"x": np.arange(3)}, user_metadata={"k": 1}).result(timeout=60)
    cairn.save(f"{base}/without", {"x": np.arange(3)})
    assert cairn.user_metadata(f"{base}/with") == given
    assert cairn.user_metadata(f"{base}/async") == {"k": 1}
    assert cairn.user_metadata(f"{base}/without") == {}
    got = cairn.user_metadata(f"{base}/with")
    got["git"] = "changed"  # a copy: reading again gives the saved value
    assert cairn.user_metadata(f"{base}/with")["git"] == "abc123"
    with pytest.raises(cairn.CheckpointNotFoundError, match=f"{base}/nothing"):
        cairn.user_metadata(f"{base}/nothing")


def test_save_metadata_is_the_deprecated_spelling_of_user_metadata(tmp_path):
    """``save(metadata=)`` and ``save_async(metadata=)`` still store the user's dict for one release, with a
    DeprecationWarning naming ``user_metadata=``; both spellings at once is a TypeError (nothing saved)."""
    with pytest.warns(DeprecationWarning, match=r"save\(metadata=\.\.\.\) is deprecated .* pass user_metadata="):
        cairn.save(tmp_path / "old", {"x": np.arange(3)}, metadata={"k": 1})
    with pytest.warns(DeprecationWarning, match=r"save_async\(metadata=\.\.\.\) is deprecated"):
        cairn.save_async(tmp_path / "old_async", {"x": np.arange(3)}, metadata={"k": 2}).result(timeout=60)
    assert cairn.user_metadata(tmp_path / "old") == {"k": 1}
    assert cairn.user_metadata(tmp_path / "old_async") == {"k": 2}
    with pytest.raises(TypeError, match="both user_metadata= and its deprecated spelling metadata="):
        cairn.save(tmp_path / "both", {"x": np.arange(3)}, metadata={"k": 1}, user_metadata={"k": 1})
    assert not (tmp_path / "both").exists()


def test_a_data_file_batch_keeps_bytes_and_order():
    """`SaveJob._write_file`'s one batching rule: small pieces gathered into writes of about
    BATCH_BYTES, a large piece alone after the batch before it; the file's bytes are the pieces'."""
    from cairn._save.pipeline import BATCH_BYTES, SMALL_CHUNK, Batch

    rng = np.random.default_rng(0)
    sizes = [10, SMALL_CHUNK, SMALL_CHUNK + 1, 3, *([SMALL_CHUNK] * (BATCH_BYTES // SMALL_CHUNK + 1)), 7, 5 << 20]
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    batch, flushed = Batch(), []

    def run():
        for p in pieces:
            flushed.append((yield from batch.add(memoryview(p))))
        yield from batch.rest()

    writes = [bytes(w) for w in run()]
    assert b"".join(writes) == b"".join(pieces)
    assert writes[0] == pieces[0] + pieces[1] and writes[1] == pieces[2]  # the batch, then the large piece alone
    assert all(len(w) <= BATCH_BYTES + SMALL_CHUNK for w in writes if len(w) not in (SMALL_CHUNK + 1, 5 << 20))
    assert flushed[:3] == [False, False, True] and any(flushed[4:-2])  # a full batch is written as it fills
    assert writes[-1] == pieces[-1] and not batch.buf
