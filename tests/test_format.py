"""Manifest and index codecs: round trips, and rejection of anything outside the spec."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn import CorruptCheckpointError
from cairn import _format as fmt
from cairn._tree import flatten, unflatten


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
        (("version",), 2, "version"),
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
    doc = small_index().to_json()
    with pytest.raises(CorruptCheckpointError, match=msg):
        fmt.ItemIndex.from_json(mutate(doc, path, value), "idx")


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
