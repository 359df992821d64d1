"""Framework-neutral reading: cairn without JAX, and a reader written from docs/FORMAT.md alone."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn

# ---------------------------------------------------------------------- a reader from the spec
# Everything below this line up to the tests uses only json and numpy, and
# follows docs/FORMAT.md; it shares no code with cairn.


def crc32c_reference(data: bytes) -> int:
    """CRC-32C as FORMAT.md §6.1 defines it (reflected 0x82F63B78, init and xor 0xFFFFFFFF)."""
    table = _crc_table()
    crc = 0xFFFFFFFF
    for byte in data:
        crc = (crc >> 8) ^ table[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


_TABLE: list[int] = []


def _crc_table() -> list[int]:
    if not _TABLE:
        for n in range(256):
            c = n
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            _TABLE.append(c)
    return _TABLE


# The §6.2 dtypes numpy knows; the 2-byte and 1-byte low-precision floats come back as raw bits.
_NUMPY_DTYPES = {n: np.dtype(n).newbyteorder("<") for n in (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)}
_NUMPY_DTYPES["bfloat16"] = np.dtype("<u2")
for _n in ("float8_e4m3fn", "float8_e5m2", "int4", "uint4"):
    _NUMPY_DTYPES[_n] = np.dtype("u1")


def _item_dir(name: str) -> str:
    out = "".join(
        chr(b) if chr(b).isascii() and (chr(b).isalnum() or chr(b) in "_-") else f"%{b:02X}"
        for b in name.encode()
    )
    return out or "%"


def _decode_value(kind, v):
    if kind in ("none", "bool", "str"):
        return v
    if kind == "int":
        return int(v)
    if kind == "float":
        return float.fromhex(v)
    if kind == "complex":
        return complex(float.fromhex(v[0]), float.fromhex(v[1]))
    if kind == "scalar":
        return np.frombuffer(bytes.fromhex(v["hex"]), dtype=_NUMPY_DTYPES[v["dtype"]])[0]
    raise ValueError(kind)


_RECORD = np.dtype([("cell", "<u8"), ("offset", "<u8"), ("crc_start", "<u8"), ("leaf", "<u4"),
                    ("file", "<u4"), ("crcs_crc", "<u4"), ("rec_crc", "<u4")])


def _read_parts(folder, index):
    """Versions 2 and 3 (§5.2): every part read whole, its records by (leaf, cell) -> [file, offset, *crcs]."""
    table = {}
    v3 = index["version"] == 3
    for part in index.get("parts", []):
        with open(os.path.join(folder, part["name"]), "rb") as f:
            raw = f.read()
        assert raw[:8] == b"CAIRNIDX" and crc32c_reference(raw[:60]) == int.from_bytes(raw[60:64], "little")
        assert int.from_bytes(raw[8:12], "little") == (3 if v3 else 2)
        n, m = part["records"], part["crcs"]
        assert np.frombuffer(raw, "<u8", 4, 16).tolist() == [part["process"], n, m, 64 + 40 * n]
        assert len(raw) == 64 + 40 * n + (8 if v3 else 4) * m
        records = np.frombuffer(raw, _RECORD, n, 64)
        column = np.frombuffer(raw, "<u4", m, 64 + 40 * n)
        if v3:  # the stored-size column follows the CRC column; keep both, side by side
            assert int.from_bytes(raw[48:56], "little") == 64 + 40 * n + 4 * m
            column = np.stack([column, np.frombuffer(raw, "<u4", m, 64 + 40 * n + 4 * m)], axis=1)
        for k, r in enumerate(records):
            assert crc32c_reference(raw[64 + 40 * k : 64 + 40 * k + 36]) == int(r["rec_crc"]), f"bad record {k}"
            if k:
                assert (int(r["leaf"]), int(r["cell"])) > (int(records[k - 1]["leaf"]), int(records[k - 1]["cell"]))
            table[int(r["leaf"]), int(r["cell"])] = (r, column, part)
    return table


def _boundaries(index, axis_grid):
    if index["version"] == 1:
        return axis_grid
    bounds = [0]
    for count, extent in axis_grid:  # §5.2: runs of equal cell extents
        for _ in range(count):
            bounds.append(bounds[-1] + extent)
    return bounds


def _read_array(folder, index, leaf, number=0, parts=None):
    dtype = _NUMPY_DTYPES[leaf["dtype"]]
    shape = tuple(leaf["shape"])
    out = np.zeros(shape, dtype=dtype)
    grid = [_boundaries(index, g) for g in leaf["grid"]]
    counts = [len(b) - 1 for b in grid]
    block = index["block_size"]
    if "chunks" in leaf:
        entries = leaf["chunks"]
    else:
        entries = []
        for cell in range(int(np.prod(counts))):
            r, column, part = parts[number, cell]
            entries.append(None if r is None else (part["file_base"] + int(r["file"]), int(r["offset"]),
                                                   (int(r["crc_start"]), column, int(r["crcs_crc"]))))
    for cell, entry in enumerate(entries):
        if isinstance(entry, tuple):  # a record of a part: its CRCs are the next ceil(nbytes / block) of the column
            file_no, offset, (first, column, crcs_crc) = entry
        else:
            file_no, offset, *crcs = entry
        # C order over the grid: the last axis varies fastest.
        idx, rest = [], cell
        for m in reversed(counts):
            idx.append(rest % m)
            rest //= m
        idx.reverse()
        box = [(grid[a][i], grid[a][i + 1]) for a, i in enumerate(idx)]
        extents = tuple(hi - lo for lo, hi in box)
        nbytes = int(np.prod(extents, dtype=np.int64)) * dtype.itemsize
        codec = leaf.get("codec", "none")
        raws = [min(block, nbytes - j * block) for j in range(-(-nbytes // block))]  # §6.4: raw block sizes
        stored = leaf["stored"][cell] if "stored" in leaf else raws
        if isinstance(entry, tuple):
            cols = column[first : first + len(raws)]
            if index["version"] == 3:
                crcs, stored = cols[:, 0].tolist(), cols[:, 1].tolist()
                check = np.asarray(crcs, "<u4").tobytes() + np.asarray(stored, "<u4").tobytes()
            else:
                crcs = cols.tolist()
                check = np.asarray(crcs, "<u4").tobytes()
            assert crc32c_reference(check) == crcs_crc, f"bad checksums of chunk {cell}"
        if nbytes == 0:
            continue
        assert codec != "none" or stored == raws
        with open(os.path.join(folder, index["files"][file_no]["name"]), "rb") as f:
            f.seek(offset)
            data = f.read(sum(stored))
        assert len(data) == sum(stored), "truncated data file"
        assert len(crcs) == len(raws)
        pieces, pos = [], 0
        for j, crc in enumerate(crcs):  # each block: its stored bytes, checked, then decoded on its own
            s = data[pos : pos + stored[j]]
            pos += stored[j]
            assert crc32c_reference(s) == crc, f"bad block {j} of chunk {cell}"
            pieces.append(_decode_block(codec, s, dtype.itemsize, raws[j]))
        raw = b"".join(pieces)
        out[tuple(slice(lo, hi) for lo, hi in box)] = np.frombuffer(raw, dtype=dtype).reshape(extents)
    return out


def _decode_block(codec: str, stored: bytes, itemsize: int, raw_size: int) -> bytes:
    """One block by FORMAT.md §6.4, with numpy and a zstd library alone."""
    if codec == "none":
        return stored
    import zstandard

    if codec == "zstd":
        out = zstandard.ZstdDecompressor().decompress(stored)
        assert len(out) == raw_size
        return out
    if codec in ("blosc2", "blosc2-lz4"):  # one C-Blosc2 chunk (§6.4), either codec's: python-blosc2 decodes it
        import blosc2

        out = blosc2.decompress2(stored)
        assert len(out) == raw_size
        return out
    assert codec == "planes"
    k, n = itemsize, raw_size // itemsize
    got_k, mask = struct.unpack_from("<BH", stored)
    assert got_k == k and mask >> k == 0
    coded = [p for p in range(k) if mask >> p & 1]
    lengths = dict(zip(coded, struct.unpack_from(f"<{len(coded)}I", stored, 3)))
    pos, out = 3 + 4 * len(coded), np.empty((n, k), np.uint8)
    for p in range(k):
        ln = lengths.get(p, n)
        piece = stored[pos : pos + ln]
        plane = zstandard.ZstdDecompressor().decompress(piece) if p in lengths else piece
        assert len(plane) == n
        out[:, p] = np.frombuffer(plane, np.uint8)
        pos += ln
    assert pos == len(stored)
    return out.tobytes()


def _build(node, values):
    if "leaf" in node:
        return values[node["leaf"]]
    if "dict" in node:
        return {k: _build(child, values) for k, child in node["dict"]}
    if "list" in node:
        return [_build(c, values) for c in node["list"]]
    if "tuple" in node:
        return tuple(_build(c, values) for c in node["tuple"])
    names = node.get("fields", node.get("keys"))
    return {k: _build(c, values) for k, c in zip(names, node["children"])}


def undelta_spec(stored: bytes, base_raw: bytes, itemsize: int) -> bytes:
    """A delta block (§6.5, codec 3) rebuilt from its stored bytes and its base block's raw bytes (its header
    already used to find and check them), with numpy and zstandard alone: an XOR (kind 0) or sparse (kind 1)."""
    import zstandard

    _codec, kind, pad, _crc, _size = struct.unpack_from("<BBHIQ", stored)
    assert pad == 0 and kind in (0, 1), (kind, pad)
    content = zstandard.ZstdDecompressor().decompress(stored[16:])
    r = len(base_raw)
    if kind == 0:
        assert len(content) == r
        return np.bitwise_xor(np.frombuffer(content, np.uint8), np.frombuffer(base_raw, np.uint8)).tobytes()
    k = itemsize
    assert k in (1, 2, 4, 8) and r % k == 0
    (n,) = struct.unpack_from("<I", content)
    assert n <= r // k and len(content) == 4 + n * (4 + k)
    gaps = np.frombuffer(content, "<u4", n, 4)
    idx = np.cumsum(gaps, dtype=np.int64)
    assert (gaps[1:] >= 1).all() and (n == 0 or idx[-1] < r // k)
    out = np.frombuffer(base_raw, f"<u{k}").copy()
    out[idx] = np.frombuffer(content, f"<u{k}", n, 4 + 4 * n)
    return out.tobytes()


def _v4_blocks(folder: str, index: dict) -> dict:
    """A version-4 index's blocks (§5.2, §6.5): (leaf, cell) -> [(file, codec, offset, stored size, a delta's
    base (file, offset), CRC-32C)] per block, own blocks and deltas back to back from the record's offset."""
    out = {}
    for part in index["parts"]:
        with open(os.path.join(folder, part["name"]), "rb") as f:
            raw = f.read()
        n, m = part["records"], part["crcs"]
        records = np.frombuffer(raw, _RECORD, n, 64)
        at = 64 + 40 * n
        crcs, sizes = np.frombuffer(raw, "<u4", m, at), np.frombuffer(raw, "<u4", m, at + 4 * m)
        src = np.frombuffer(raw, [("file", "<u4"), ("codec", "u1"), ("pad", "V3"), ("offset", "<u8")], m,
                            at + 8 * m + 16 * m)
        ends = [int(r["crc_start"]) for r in records[1:]] + [m]
        for r, end in zip(records, ends):
            pos, blocks = int(r["offset"]), []
            for b in range(int(r["crc_start"]), end):
                f, codec, off = int(src["file"][b]), int(src["codec"][b]), int(src["offset"][b])
                if f == 0xFFFFFFFF or codec == 3:  # own bytes (a delta's too): the next in the record's file
                    blocks.append((part["file_base"] + int(r["file"]), codec, pos, int(sizes[b]),
                                   None if codec != 3 else (part["file_base"] + f, off), int(crcs[b])))
                    pos += int(sizes[b])
                else:
                    blocks.append((part["file_base"] + f, codec, off, int(sizes[b]), None, int(crcs[b])))
            out[int(r["leaf"]), int(r["cell"])] = blocks
    return out


#: §6.5: a part's source column's codec ids (3, a delta, is no codec a block is decoded by).
_SPEC_CODECS = ("none", "zstd", "planes", None, "blosc2", "blosc2-lz4")

GOLDEN_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden")


@pytest.mark.parametrize("version", ["v4", "v5"])
@pytest.mark.parametrize("step", [2, 3])
def test_spec_rebuilds_the_golden_sparse_and_xor_deltas(version, step):
    """Every delta block of the v4/sparse and v5/sparse goldens rebuilt by `undelta_spec` (its base block
    decoded by `_decode_block`) is the bytes cairn loads there."""
    ckpt = os.path.join(GOLDEN_ROOT, version, "sparse", f"step_{step:08d}")
    folder = os.path.join(ckpt, "params")
    (name,) = [f for f in os.listdir(folder) if f.startswith("index.") and f.endswith(".json")]
    with open(os.path.join(folder, name)) as f:
        index = json.load(f)
    loaded = cairn.load(ckpt)["params"]
    kinds = []
    for (leaf_no, _cell), blocks in _v4_blocks(folder, index).items():
        leaf = index["leaves"][leaf_no]
        want = np.asarray(loaded[leaf["path"]]).tobytes()
        for b, (file_no, codec, off, size, against, crc) in enumerate(blocks):
            if codec != 3:
                continue
            with open(os.path.join(folder, index["files"][file_no]["name"]), "rb") as f:
                f.seek(off)
                stored = f.read(size)
            assert crc32c_reference(stored) == crc
            base_codec, kind, _pad, base_crc, base_size = struct.unpack_from("<BBHIQ", stored)
            entry = index["files"][against[0]]
            with open(os.path.join(ckpt, "..", entry["base"], "params", entry["name"]), "rb") as f:
                f.seek(against[1])
                base = f.read(base_size)
            assert crc32c_reference(base) == base_crc
            k = _NUMPY_DTYPES[leaf["dtype"]].itemsize
            r = min(index["block_size"], len(want) - b * index["block_size"])
            base_raw = _decode_block(_SPEC_CODECS[base_codec], base, k, r)
            got = undelta_spec(stored, base_raw, k)
            assert got == want[b * index["block_size"] : b * index["block_size"] + r], (leaf["path"], b)
            kinds.append(kind)
    if version == "v4":
        assert sorted(kinds) == {2: [1] * 4, 3: [0] + [1] * 7}[step]
    else:  # two leaves: step 2 changed block 1 of each, step 3 block 2 too (step 2's deltas copied)
        assert sorted(kinds) == {2: [1] * 2, 3: [1] * 4}[step]


def spec_reader(ckpt: str):
    """Read a whole checkpoint following docs/FORMAT.md: {item: tree} (or the tree, for a root one)."""
    with open(os.path.join(ckpt, "manifest.json"), "rb") as f:
        manifest = json.loads(f.read())
    # Versions 5 and 6 (§6.6) name no layout of their own: their indexes' versions do, and those of 1-3 are
    # read here (a "blosc2" or "blosc2-lz4" leaf needs python-blosc2, `_decode_block`).
    assert manifest["format"] == "cairn" and manifest["version"] in (1, 2, 3, 5, 6)
    out = {}
    for name, item in manifest["items"].items():
        assert item["dir"] == ("%root" if manifest["root"] else _item_dir(name))
        folder = os.path.join(ckpt, item["dir"])
        with open(os.path.join(folder, item["index"]), "rb") as f:
            index = json.loads(f.read())
        assert index["format"] == "cairn-index" and index["version"] in (1, 2, 3)
        for f_ in index["files"]:
            assert os.path.getsize(os.path.join(folder, f_["name"])) == f_["size"]
        parts = _read_parts(folder, index)
        values = []
        for number, leaf in enumerate(index["leaves"]):
            if leaf["kind"] in ("array", "bytes", "object", "prng_key"):  # prng_key: the uint32 key data
                arr = _read_array(folder, index, leaf, number, parts)
                values.append(arr.tobytes() if leaf["kind"] == "bytes" else arr)
            else:
                values.append(_decode_value(leaf["kind"], leaf["value"]))
        assert len(values) == item["num_leaves"]
        out[name] = _build(index["structure"], values)
    return out[""] if manifest["root"] else out


# ---------------------------------------------------------------------- tests


def test_reference_crc_matches_the_check_value():
    assert crc32c_reference(b"123456789") == 0xE3069283


def _state(mesh42):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((12, 6)).astype(np.float32)
    return {
        "params": {
            "w": jax.device_put(x, NamedSharding(mesh42, P("x", "y"))),  # a 4 x 2 grid of chunks
            "e": jax.device_put(x.astype(ml_dtypes.bfloat16), NamedSharding(mesh42, P(None, "y"))),
            "i": np.arange(-5, 5, dtype=np.int64).reshape(2, 5),
            "empty": np.zeros((3, 0), np.float32),
            "s0": np.array(1.5, np.float16),
        },
        "opt.state": [np.ones(3, np.uint8), (np.float32(2.0), None)],
        "step": 9,
        "rng": jax.device_put(jax.random.split(jax.random.key(1, impl="rbg"), 4), NamedSharding(mesh42, P("x"))),
        "conf": {"name": "é/x", "lr": 3e-4, "z": 1 + 2j, "flag": True, "blob": b"\x00\x01\x02", "big": -(2**80)},
    }


def test_spec_reader_reads_what_cairn_writes(tmp_path, mesh42):
    state = _state(mesh42)
    cairn.save(tmp_path / "ck", state)
    got = spec_reader(str(tmp_path / "ck"))
    want = cairn.load(tmp_path / "ck")
    p = got["params"]
    np.testing.assert_array_equal(p["w"], np.asarray(state["params"]["w"]))
    assert p["e"].tobytes() == np.asarray(state["params"]["e"]).tobytes()  # bfloat16 as raw bits
    np.testing.assert_array_equal(p["i"], state["params"]["i"])
    assert p["empty"].shape == (3, 0) and p["s0"].shape == () and p["s0"] == 1.5
    assert got["opt.state"][0].tobytes() == b"\x01\x01\x01"
    assert got["opt.state"][1] == (np.float32(2.0), None)
    assert got["step"] == 9 and got["conf"] == want["conf"]
    key_data = np.asarray(jax.random.key_data(state["rng"]))
    assert got["rng"].dtype == np.uint32 and got["rng"].shape == (4, 4) and np.array_equal(got["rng"], key_data)
    assert sorted(os.listdir(tmp_path / "ck")) == sorted(["manifest.json", "params", "opt%2Estate", "step", "rng", "conf"])


@pytest.mark.parametrize("explicit", [False, True])
def test_spec_reader_reads_compressed_checkpoints(tmp_path, mesh42, explicit):
    """Format version 3 (§6.4) read from the spec with numpy and zstandard: the same values cairn loads."""
    from _forge import as_explicit

    state = _state(mesh42)
    rng = np.random.default_rng(1)
    state["params"]["trained"] = rng.normal(0, 0.02, (64, 300)).astype(np.float32)
    state["params"]["zeros"] = np.zeros((3000,), np.int16)
    cairn.save(tmp_path / "ck", state, compression=True)
    if explicit:
        as_explicit(tmp_path / "ck")
    got = spec_reader(str(tmp_path / "ck"))
    want = cairn.load(tmp_path / "ck")
    for k, v in want["params"].items():
        assert got["params"][k].tobytes() == np.asarray(v).tobytes(), k
    index = json.loads(next((tmp_path / "ck" / "params").glob("index.*.json")).read_bytes())

    fast = "planes"  # what True picks for trained floats, python-blosc2 installed or not
    assert index["version"] == 3 and {leaf.get("codec", "none") for leaf in index["leaves"]} >= {fast}
    assert explicit == any("stored" in leaf for leaf in index["leaves"])


def test_spec_reader_reads_the_v5_blosc2_golden():
    """tests/golden/v5/blosc2: a version-5 manifest over a version-3 index of "blosc2" leaves (§6.4, §6.6)."""
    pytest.importorskip("blosc2", reason="the blosc2 leaves need python-blosc2")
    ckpt = os.path.join(GOLDEN_ROOT, "v5", "blosc2")
    got, want = spec_reader(ckpt), cairn.load(ckpt)
    for k, v in want["params"].items():
        assert got["params"][k].tobytes() == np.asarray(v).tobytes(), k
    assert got["step"] == want["step"] == 5


def test_spec_reader_reads_the_v6_blosc2_lz4_golden():
    """tests/golden/v6/blosc2_lz4: a version-6 manifest over a version-3 index of "blosc2-lz4" leaves of 1-16
    byte elements (§6.4, §6.6), each block decoded by python-blosc2's plain `decompress2`."""
    pytest.importorskip("blosc2", reason="the blosc2-lz4 leaves need python-blosc2")
    ckpt = os.path.join(GOLDEN_ROOT, "v6", "blosc2_lz4")
    with open(os.path.join(ckpt, "params", next(n for n in os.listdir(os.path.join(ckpt, "params"))
                                               if n.startswith("index.") and n.endswith(".json")))) as f:
        index = json.load(f)
    assert {leaf["codec"] for leaf in index["leaves"]} == {"blosc2-lz4"} and index["version"] == 3
    got, want = spec_reader(ckpt), cairn.load(ckpt)
    assert sorted(got["params"]) == sorted(want["params"]) and len(got["params"]) == 6
    for k, v in want["params"].items():
        assert got["params"][k].tobytes() == np.asarray(v).tobytes(), k
    assert got["step"] == want["step"] == 6


@pytest.mark.parametrize("name", ["blosc2_lz4_chain/step_00000002", "blosc2_lz4_chain/step_00000003",
                                  "mixed/step_00000002"])
def test_spec_reads_the_v6_incremental_goldens(name):
    """Every block of the v6 incremental goldens read from the spec (§6.5): own blocks, references to a
    base's "blosc2-lz4" (or "blosc2") blocks, and deltas against them, each checked by its CRC-32C,
    decoded by `_decode_block` (python-blosc2's `decompress2` for a C-Blosc2 chunk) or rebuilt by
    `undelta_spec` from its base block: the bytes cairn loads."""
    pytest.importorskip("blosc2", reason="the blosc2-lz4 blocks need python-blosc2")
    ckpt = os.path.join(GOLDEN_ROOT, "v6", name)
    folder = os.path.join(ckpt, "params")
    (index_name,) = [f for f in os.listdir(folder) if f.startswith("index.") and f.endswith(".json")]
    with open(os.path.join(folder, index_name)) as f:
        index = json.load(f)
    loaded = cairn.load(ckpt)["params"]
    block, seen = index["block_size"], set()

    def read(file_no: int, off: int, size: int) -> bytes:
        entry = index["files"][file_no]
        where = os.path.join(ckpt, "..", entry["base"], "params") if "base" in entry else folder
        with open(os.path.join(where, entry["name"]), "rb") as f:
            f.seek(off)
            return f.read(size)

    for (leaf_no, _cell), blocks in _v4_blocks(folder, index).items():
        leaf = index["leaves"][leaf_no]
        want = np.asarray(loaded[leaf["path"]]).tobytes()
        k = _NUMPY_DTYPES[leaf["dtype"]].itemsize
        assert len(blocks) == -(-len(want) // block)
        for b, (file_no, codec, off, size, against, crc) in enumerate(blocks):
            stored = read(file_no, off, size)
            assert crc32c_reference(stored) == crc
            r = min(block, len(want) - b * block)
            if codec == 3:
                base_codec, _kind, _pad, base_crc, base_size = struct.unpack_from("<BBHIQ", stored)
                base = read(against[0], against[1], base_size)
                assert crc32c_reference(base) == base_crc
                got = undelta_spec(stored, _decode_block(_SPEC_CODECS[base_codec], base, k, r), k)
                seen.add(("delta", _SPEC_CODECS[base_codec]))
            else:
                got = _decode_block(_SPEC_CODECS[codec], stored, k, r)
                seen.add((_SPEC_CODECS[codec], "referred" if "base" in index["files"][file_no] else "own"))
            assert got == want[b * block : b * block + r], (leaf["path"], b)
    lz4 = "blosc2-lz4"
    assert seen == ({("blosc2", "referred"), ("delta", "blosc2"), (lz4, "own")} if name.startswith("mixed")
                    else {(lz4, "referred"), ("delta", lz4)})


def test_spec_reader_detects_a_flipped_byte(tmp_path):
    cairn.save(tmp_path / "ck", np.arange(100, dtype=np.int32))
    (name,) = [n for n in os.listdir(tmp_path / "ck" / "%root") if n.endswith(".bin")]
    path = tmp_path / "ck" / "%root" / name
    raw = bytearray(path.read_bytes())
    np.testing.assert_array_equal(spec_reader(str(tmp_path / "ck")), np.arange(100))
    raw[7] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(AssertionError, match="bad block 0 of chunk 0"):
        spec_reader(str(tmp_path / "ck"))


_NOJAX_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["jax"] = None  # `import jax` now raises ImportError
    sys.modules["jaxlib"] = None
    import json
    import numpy as np
    import cairn
    from cairn._cli.main import main

    ck = sys.argv[1]
    got = cairn.load(ck)
    meta = cairn.metadata(ck)
    out = {
        "w": got["params"]["w"].tolist(),
        "w_type": type(got["params"]["w"]).__name__,
        "e_bytes": got["params"]["e"].tobytes().hex(),
        "e_dtype": str(got["params"]["e"].dtype),
        "step": got["step"],
        "conf": repr(got["conf"]),
        "meta_shape": list(meta["params"]["w"].shape),
        "rng": [str(got["rng"].dtype), list(got["rng"].shape), got["rng"].tobytes().hex()],
        "meta_rng": [meta["rng"].kind, meta["rng"].impl, list(meta["rng"].shape), str(meta["rng"].dtype)],
        "cli_verify": main(["--plain", "-q", "verify", ck]),
        "cli_inspect": main(["--plain", "inspect", ck, "--json"]),
    }
    try:
        import torch
    except ImportError:
        pass
    else:
        t = cairn.load(ck, framework="torch")["params"]["e"]
        out["torch_dtype"] = str(t.dtype)
        out["torch_bytes"] = t.view(torch.int16).numpy().tobytes().hex()
    loaded = sorted(m for m in sys.modules if (m == "jax" or m.startswith(("jax.", "jaxlib"))) and sys.modules[m] is not None)
    out["jax_modules"] = loaded
    print("RESULT " + json.dumps(out))
    """
)


def test_load_without_jax(tmp_path, mesh42):
    state = _state(mesh42)
    cairn.save(tmp_path / "ck", state)
    script = tmp_path / "nojax.py"
    script.write_text(_NOJAX_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert out["jax_modules"] == []
    assert out["w_type"] == "ndarray" and out["w"] == np.asarray(state["params"]["w"]).tolist()
    assert out["e_dtype"] == "bfloat16" and out["e_bytes"] == np.asarray(state["params"]["e"]).tobytes().hex()
    assert out["step"] == 9 and out["meta_shape"] == [12, 6]
    key_data = np.asarray(jax.random.key_data(state["rng"]))
    assert out["rng"] == ["uint32", [4, 4], key_data.tobytes().hex()]
    assert out["meta_rng"] == ["prng_key", "rbg", [4, 4], "uint32"]  # without JAX: the key data's shape
    assert out["conf"] == repr(cairn.load(tmp_path / "ck")["conf"])
    assert out["cli_verify"] == 0 and out["cli_inspect"] == 0
    if "torch_dtype" in out:
        assert out["torch_dtype"] == "torch.bfloat16" and out["torch_bytes"] == out["e_bytes"]
