"""Manifest and index codecs: round trips, and rejection of anything outside the spec."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import CorruptCheckpointError
from cairn._format import manifest as fmt
from cairn._tree.pytree import flatten, unflatten


def small_index():
    leaf = fmt.ArrayLeaf(
        path="w", dtype=np.dtype(np.float32), shape=(4, 2), grid=((0, 2, 4), (0, 2)),
        chunks=((0, 0), (0, 16)), crcs=((1,), (2,)), sharding={"type": "NamedSharding"},
    )
    vals = [fmt.ValueLeaf("n", "int", 2**70), fmt.ValueLeaf("f", "float", float("inf")),
            fmt.ValueLeaf("s", "str", "x"), fmt.ValueLeaf("z", "none", None),
            fmt.ValueLeaf("b", "scalar", ml_dtypes.bfloat16(2.5))]
    structure, _ = flatten({"w": 0, "n": 0, "f": 0, "s": 0, "z": 0, "b": 0})
    return fmt.ItemIndex(structure, (leaf, *vals), (fmt.FileInfo("p00000-0.ab.bin", 32),), 1 << 20)


def test_index_roundtrip():
    idx = small_index()
    back = fmt.ItemIndex.from_json(idx.to_json(), "idx")
    assert back.leaves[0] == idx.leaves[0]
    assert [v.value for v in back.leaves[1:4]] == [2**70, float("inf"), "x"]
    assert back.leaves[5].value == ml_dtypes.bfloat16(2.5) and back.leaves[5].value.dtype == ml_dtypes.bfloat16


def mutate(doc, path, value):
    """Change one field and re-seal the file's checksum, so that the field itself is what is tested."""
    d = json.loads(doc)
    d.pop("crc32c")
    node = d
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return fmt.dump_checked_json(d)


@pytest.mark.parametrize(
    "path,value,msg",
    [
        (("version",), 5, "version"),
        (("block_size",), 7, "block_size|integer"),
        (("files", 0, "name"), "../../etc/passwd", "file name"),
        (("files", 0, "size"), 8, "outside"),
        (("leaves", 0, "shape"), [2**60, 2**60], "limit|integer"),
        (("leaves", 0, "dtype"), "object", "dtype"),
        (("leaves", 0, "grid"), [[0, 4, 2], [0, 2]], "tile|integer"),
        (("leaves", 0, "chunks"), [[0, 0, 1]], "chunks"),
        (("leaves", 0, "chunks", 1), [0, 24, 2], "outside"),
        (("leaves", 0, "chunks", 1), [5, 0, 2], "integer"),
        (("leaves", 0, "chunks", 1), [0, 16], "checksums"),
        (("leaves", 0, "kind"), "pickle", "kind"),
        (("leaves", 1, "value"), "12abc", "int"),
        (("structure",), {"leaf": 99}, "integer"),
        (("structure",), {"dict": [["w", {"leaf": 0}]]}, "names 1 of"),
    ],
)
def test_index_rejects(path, value, msg):
    doc = small_index().to_json(version=1)  # an explicit chunk table, grid as boundaries
    with pytest.raises(CorruptCheckpointError, match=msg):
        fmt.ItemIndex.from_json(mutate(doc, path, value), "idx")


def test_index_v2_explicit_chunks_roundtrip_with_grid_runs():
    doc = small_index().to_json()
    assert json.loads(doc)["version"] == 2 and json.loads(doc)["leaves"][0]["grid"] == [[[2, 2]], [[1, 2]]]
    back = fmt.ItemIndex.from_json(doc, "idx")
    assert back.leaves[0] == small_index().leaves[0] and back.version == 2


def part_index():
    """A version-2 index whose leaf's records live in two processes' binary parts."""
    from cairn._format.partfile import PartInfo, encode_part

    # w: 4 x 2 float32 on a 4 x 1 grid; process 0 wrote cells 0 and 2, process 1 cells 1 and 3.
    parts = {
        "index.p00000.ab.idx": encode_part(0, [0, 0], [0, 2], [0, 0], [0, 8], [(11,), (12,)]),
        "index.p00001.ab.idx": encode_part(1, [0, 0], [1, 3], [0, 0], [8, 0], [(21,), (22,)]),
    }
    leaf = fmt.ArrayLeaf(path="w", dtype=np.dtype(np.float32), shape=(4, 2), grid=((0, 1, 2, 3, 4), (0, 2)),
                         chunks=(), crcs=(), writers=[[2, 0, 1, 1], [2, 0, 1, 1]])
    index = fmt.ItemIndex({"leaf": 0}, (leaf,), (fmt.FileInfo("p00000-0.ab.bin", 16),
                                                  fmt.FileInfo("p00001-0.ab.bin", 16)), 1 << 20,
                          parts=(PartInfo("index.p00000.ab.idx", 0, 2, 2, 0, 1),
                                 PartInfo("index.p00001.ab.idx", 1, 2, 2, 1, 1)), processes=2)
    return index.to_json(), parts


def _bound(doc, parts):
    index = fmt.ItemIndex.from_json(doc, "idx")
    seen = []

    def read(requests):
        seen.extend(requests)
        return [parts[name][start : start + n] for name, start, n in requests]

    index.table.reader = read
    return index, seen


def test_index_v2_finds_records_by_arithmetic():
    doc, parts = part_index()
    index, seen = _bound(doc, parts)
    leaf = index.leaves[0]
    assert leaf.writers == [[2, 0, 1, 1], [2, 0, 1, 1]] and len(leaf.chunks) == 4
    index.table.fetch({0: np.array([3])})  # one chunk: process 1's second record, and nothing of process 0
    assert {name for name, _, _ in seen} == {"index.p00001.ab.idx"}
    assert leaf.chunks[3] == (1, 0) and leaf.crcs[3] == (22,)  # file 0 of process 1 is the index's file 1
    assert [leaf.chunks[c] for c in range(4)] == [(0, 0), (1, 8), (0, 8), (1, 0)]
    assert [leaf.crcs[c] for c in range(4)] == [(11,), (21,), (12,), (22,)]


@pytest.mark.parametrize(("breakage", "msg"), [
    (lambda p: p.__setitem__("index.p00001.ab.idx", p["index.p00001.ab.idx"][:-4]), "shorter"),
    (lambda p: p.__setitem__("index.p00001.ab.idx", _flip(p["index.p00001.ab.idx"], 64 + 40 + 9)), "checksum"),
    (lambda p: p.__setitem__("index.p00001.ab.idx", _flip(p["index.p00001.ab.idx"], 20)), "header"),
    (lambda p: p.__setitem__("index.p00001.ab.idx", _flip(p["index.p00001.ab.idx"], 64 + 80 + 4 + 2)), "checksums"),
    # records of another part (other process, other cells): caught by the header and the records' own fields
    (lambda p: p.__setitem__("index.p00001.ab.idx", p["index.p00000.ab.idx"]), "header|record"),
])
def test_index_v2_rejects_broken_parts(breakage, msg):
    doc, parts = part_index()
    breakage(parts)
    index, _ = _bound(doc, parts)
    with pytest.raises(CorruptCheckpointError, match=msg):
        index.table.fetch({0: np.array([3])})


def _flip(data: bytes, pos: int) -> bytes:
    return data[:pos] + bytes([data[pos] ^ 0x04]) + data[pos + 1 :]


@pytest.mark.parametrize(("path", "value", "msg"), [
    (("leaves", 0, "writers"), [[5, 0, 1, 1]], "cover"),
    (("leaves", 0, "writers"), [[4, 0, 1, 1]], "outside"),
    (("leaves", 0, "writers"), [[4, 0, 0, 0]], "bad writer run"),
    (("leaves", 0, "writers"), [0, "x"], "bad writer run"),
    (("leaves", 0, "writers"), {"x": 1}, "writers"),
    (("leaves", 0, "grid"), [[[3, 1]], [[1, 2]]], "tile"),
    (("leaves", 0, "grid"), [[[4, 1]], [[1, 2], [0, 1]]], "run"),
    (("parts", 0, "file_base"), 5, "outside"),
    (("parts", 1, "process"), 0, "repeated"),
    (("parts", 0, "name"), "../x", "part name"),
    (("processes",), 0, "integer"),
])
def test_index_v2_rejects(path, value, msg):
    doc, _ = part_index()
    with pytest.raises(CorruptCheckpointError, match=msg):
        fmt.ItemIndex.from_json(mutate(doc, path, value), "idx")


def twin_index():
    """`part_index`'s leaf and a second leaf of the very same layout (whose checks the parser memoises)."""
    doc, _ = part_index()
    d = json.loads(doc)
    d.pop("crc32c")
    d["leaves"].append({**d["leaves"][0], "path": "v"})
    d["structure"] = {"dict": [["w", {"leaf": 0}], ["v", {"leaf": 1}]]}
    return fmt.dump_checked_json(d)


def test_leaves_of_one_layout_parse_alike():
    index = fmt.ItemIndex.from_json(twin_index(), "idx")
    w, v = index.leaves
    assert (v.path, v.shape, v.grid, v.dtype, v.writers) == ("v", w.shape, w.grid, w.dtype, w.writers)
    assert v.grid is w.grid  # checked once, shared
    assert list(index.table.leaves[1].writers) == [0, 1, 0, 1]
    # A parsed leaf is the leaf the constructor builds from the same fields.
    assert fmt.ArrayLeaf(**{f: getattr(v, f) for f in fmt.ArrayLeaf.__dataclass_fields__}) == v
    assert (v.impl, v.impl_shape, v.kind, v.handler) == (None, (), "array", None)


@pytest.mark.parametrize(("field", "value", "msg"), [
    ("shape", [4.0, 2], "integer"),  # equal to [4, 2] in Python, not of the same type
    ("shape", [4, True], "integer"),
    ("grid", [[[4, 1.0]], [[1, 2]]], "grid|integer|run"),
    ("writers", [[2, 0, 1, 1], [2, 0, 1, True]], "bad writer run"),
])
def test_a_memoised_layout_does_not_excuse_a_later_leaf(field, value, msg):
    """The second leaf's layout equals the first's by `==` but not in type: it is checked, and rejected."""
    with pytest.raises(CorruptCheckpointError, match=msg):
        fmt.ItemIndex.from_json(mutate(twin_index(), ("leaves", 1, field), value), "idx")


def key_index():
    leaf = fmt.ArrayLeaf(
        path="rng", dtype=np.dtype(np.uint32), shape=(3, 2), grid=((0, 3), (0, 2)), chunks=((0, 0),),
        crcs=((7,),), kind="prng_key", impl="threefry2x32", impl_shape=(2,),
    )
    return fmt.ItemIndex({"leaf": 0}, (leaf,), (fmt.FileInfo("p00000-0.ab.bin", 24),), 1 << 20)


def test_key_leaf_roundtrip():
    back = fmt.ItemIndex.from_json(key_index().to_json(), "idx").leaves[0]
    assert back == key_index().leaves[0]
    assert (back.kind, back.impl, back.impl_shape, back.key_shape) == ("prng_key", "threefry2x32", (2,), (3,))


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("impl", None, "impl"),
        ("impl", "", "impl"),
        ("impl_shape", None, "impl_shape"),
        ("impl_shape", [4], "ends with impl_shape"),
        ("impl_shape", [3, 2, 1], "ends with impl_shape"),
        ("impl_shape", [0], "positive"),
        ("dtype", "int32", "uint32"),
    ],
)
def test_key_leaf_rejects(field, value, msg):
    doc = key_index().to_json()
    with pytest.raises(CorruptCheckpointError, match=msg):
        fmt.ItemIndex.from_json(mutate(doc, ("leaves", 0, field), value), "idx")


def test_manifest_rejects_foreign_folder_names():
    m = fmt.Manifest({"params": fmt.ItemInfo("params", "index.ab.json", 0, 0)}).to_json()
    fmt.Manifest.from_json(m, "m")
    with pytest.raises(CorruptCheckpointError, match="folder"):
        fmt.Manifest.from_json(mutate(m, ("items", "params", "dir"), "../other"), "m")
    with pytest.raises(CorruptCheckpointError, match="index file name"):
        fmt.Manifest.from_json(mutate(m, ("items", "params", "index"), "../x.json"), "m")


def test_metadata_checksum_is_required_and_checked():
    doc = small_index().to_json()
    assert doc.startswith(b'{"crc32c":"')
    with pytest.raises(CorruptCheckpointError, match="checksum field"):
        fmt.ItemIndex.from_json(b"{" + doc[21:], "idx")  # the field removed
    flipped = doc.replace(b'"size":32', b'"size":33')
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        fmt.ItemIndex.from_json(flipped, "idx")


def test_huge_metadata_is_refused_before_parsing():
    with pytest.raises(CorruptCheckpointError, match="exceeds"):
        fmt.parse_json(b" " * (fmt.MAX_METADATA_BYTES + 1), "m")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_index_parser_never_crashes(data):
    try:
        fmt.ItemIndex.from_json(data, "idx")
    except CorruptCheckpointError:
        pass


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5))


@settings(max_examples=100, deadline=None)
@given(st.recursive(json_scalars, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=4), c, max_size=3)), max_leaves=12))
def test_fuzz_structured_json_never_crashes(doc):
    base = json.loads(small_index().to_json())
    base.pop("crc32c")
    for key in ("leaves", "files", "structure"):
        mutated = dict(base, **{key: doc})
        try:
            fmt.ItemIndex.from_json(fmt.dump_checked_json(mutated), "idx")
        except CorruptCheckpointError:
            pass


def test_item_dirnames_are_safe_and_distinct():
    names = ["params", "..", ".", "a/b", "a%2Fb", "", "~x", "x" * 500, "x" * 501, "%root", "UPPER", "ü"]
    dirs = [fmt.item_dirname(n) for n in names]
    assert len(set(dirs)) == len(dirs)
    for d in dirs:
        assert "/" not in d and not d.startswith(".") and 0 < len(d) <= 200 and d != fmt.ROOT_ITEM_DIR


@settings(max_examples=100, deadline=None)
@given(st.recursive(
    st.one_of(st.none(), st.integers(), st.text(max_size=3)),
    lambda c: st.one_of(st.lists(c, max_size=3), st.tuples(c, c), st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 5)), c, max_size=3)),
    max_leaves=15,
))
def test_tree_structure_roundtrip(tree):
    try:
        structure, leaves = flatten(tree)
    except ValueError:
        return  # e.g. {"1": .., 1: ..} would give two leaves one key path: refused, by design
    back = unflatten(json.loads(json.dumps(structure)), [v for _, v in leaves])
    assert back == tree
