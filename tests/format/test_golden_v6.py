"""Format version 6 (docs/FORMAT.md §6.6): the goldens of tests/golden/v6/ load bit for bit, their blocks are
what §6.4 says a "blosc2-lz4" block is, and the writer says 6 exactly where a block needs a reader that
knows codec "blosc2-lz4" (C-Blosc2 chunks with the bit shuffle, which a reader of version 5 rejects).

The goldens were written once by tests/golden/make_golden_v6.py and are never regenerated; the expected
values are rebuilt here, not imported from that script. Version 5's goldens are checked in
test_golden_v5.py.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from _parts import delta_kinds
from cairn._codecs import codecs as _codecs
from cairn._errors import CorruptCheckpointError
from cairn._format import manifest as fmt
from cairn._format.blocks import CODEC_IDS, CODEC_NAMES
from cairn._sources.verify import verify

GOLDEN_V6 = Path(__file__).resolve().parents[1] / "golden" / "v6"
NEEDS_BLOSC2 = pytest.mark.skipif(not _codecs.blosc2_available(), reason="python-blosc2 is not installed")
BLOCK = 4096  # every v6 golden's block size
LZ4, B2 = CODEC_IDS["blosc2-lz4"], CODEC_IDS["blosc2"]
#: What a chunk of each C-Blosc2 codec names in its header (§6.4): the Blosc filter at byte 16 (1 the byte
#: shuffle, 2 the bit shuffle), the compressor code in bits 5-7 of byte 2 (1 LZ4, 4 zstd).
HEADER = {"blosc2-lz4": (2, 1), "blosc2": (1, 4)}


# ------------------------------------------------------------------------- expected values


def _lz4_state() -> dict:
    rng = np.random.default_rng(66)
    return {"params": {"w": rng.normal(0, 0.02, (64, 128)).astype(ml_dtypes.bfloat16),
                       "ids": np.arange(3000, dtype=np.int32) % 7,
                       "mask": (np.arange(5000) % 13 == 0).astype(np.uint8),
                       "f64": np.linspace(-1, 1, 600),
                       "c128": np.arange(300) * (1 + 2j) / 7,
                       "zeros": np.zeros((1024,), np.float32)},
            "step": 6}


def _chain_state(step: int) -> dict:
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    emb = (np.arange(128 * 64) % 251).astype(ml_dtypes.bfloat16).reshape(128, 64)
    if step >= 2:
        w[40, :] = -2.0
    if step >= 3:
        emb[0, :4] = 9.0
    return {"params": {"w": w, "emb": emb}, "step": step}


def _mixed_state(step: int) -> dict:
    state = _chain_state(step)
    if step >= 2:
        state["params"]["new"] = (np.arange(64 * 64) % 97 - 48).astype(np.int16).reshape(64, 64)
    return state


GOLDENS = ["blosc2_lz4", *(f"blosc2_lz4_chain/step_{s:08d}" for s in (1, 2, 3)),
           *(f"mixed/step_{s:08d}" for s in (1, 2))]


def _expected(name: str) -> dict:
    if name == "blosc2_lz4":
        return _lz4_state()
    chain, step = name.split("/")
    return (_chain_state if chain == "blosc2_lz4_chain" else _mixed_state)(int(step[-1]))


def _same(want, got, where: str = "") -> None:
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            _same(want[k], got[k], f"{where}/{k}")
    elif isinstance(want, np.ndarray):
        got = np.asarray(got)
        assert (got.dtype, got.shape) == (want.dtype, want.shape) and got.tobytes() == want.tobytes(), where
    else:
        assert type(got) is type(want) and got == want, where


# ------------------------------------------------------------------------- the files, read by hand


def _manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / fmt.MANIFEST).read_bytes())


def _versions(ckpt: Path) -> tuple[int, set[int]]:
    """The manifest's version and its indexes'."""
    return _manifest(ckpt)["version"], {json.loads(p.read_bytes())["version"] for p in ckpt.glob("*/index.*.json")}


def _index(ckpt: Path) -> dict:
    (path,) = (ckpt / "params").glob("index.*.json")
    return json.loads(path.read_bytes())


_RECORD = np.dtype([("cell", "<u8"), ("offset", "<u8"), ("crc_start", "<u8"), ("leaf", "<u4"),
                    ("file", "<u4"), ("crcs_crc", "<u4"), ("rec_crc", "<u4")])
_SOURCE = np.dtype([("file", "<u4"), ("codec", "u1"), ("pad", "V3"), ("offset", "<u8")])
_OWN = 0xFFFFFFFF


def _blocks(ckpt: Path) -> list[dict]:
    """Every block of the `params` item, read from its index parts and data files as FORMAT.md §5.2, §6.4
    and §6.5 lay them out (no cairn reader): its leaf, number, codec id, raw size, the stored bytes it
    names (a reference's: the base's block) and the checkpoint those bytes are in; a delta's also the
    stored bytes of its base block and that block's checkpoint."""
    index = _index(ckpt)
    folder = ckpt / "params"

    def file_of(no: int) -> tuple[bytes, str]:
        entry = index["files"][no]
        step = entry.get("base", ckpt.name)
        return (ckpt.parent / step / "params" / entry["name"]).read_bytes(), step

    out = []
    for part in index["parts"]:
        raw = (folder / part["name"]).read_bytes()
        n, m = part["records"], part["crcs"]
        records = np.frombuffer(raw, _RECORD, n, 64)
        at = 64 + 40 * n
        sizes = np.frombuffer(raw, "<u4", m, at + 4 * m)
        src = np.frombuffer(raw, _SOURCE, m, at + 8 * m + 16 * m) if index["version"] == 4 else None
        ends = [int(r["crc_start"]) for r in records[1:]] + [m]
        for r, end in zip(records, ends):
            leaf = index["leaves"][int(r["leaf"])]
            nbytes = int(np.prod(leaf["shape"])) * np.dtype(_expected_dtype(leaf["dtype"])).itemsize
            own, own_step = file_of(part["file_base"] + int(r["file"]))
            pos = int(r["offset"])
            for j, b in enumerate(range(int(r["crc_start"]), end)):
                size = int(sizes[b])
                block = {"leaf": leaf["path"], "dtype": leaf["dtype"], "number": j,
                         "raw_size": min(BLOCK, nbytes - j * BLOCK)}
                codec = CODEC_IDS[leaf.get("codec", "none")] if src is None else int(src["codec"][b])
                if src is None or src["file"][b] == _OWN or codec == 3:  # own bytes, a delta's too: next in its file
                    block.update(codec=codec, stored=own[pos:pos + size], step=own_step)
                    pos += size
                    if codec == 3:  # the delta's base block: the source's file and offset, its size in its header
                        base, base_step = file_of(part["file_base"] + int(src["file"][b]))
                        base_size = int.from_bytes(block["stored"][8:16], "little")
                        off = int(src["offset"][b])
                        block.update(base=base[off:off + base_size], base_step=base_step)
                else:  # a reference: the base's bytes
                    data, step = file_of(part["file_base"] + int(src["file"][b]))
                    off = int(src["offset"][b])
                    block.update(codec=codec, stored=data[off:off + size], step=step)
                out.append(block)
    return out


def _expected_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _raw_block(state: dict, block: dict) -> bytes:
    """The raw bytes of `block` in `state` (each v6 golden's array leaf is one chunk, in C order)."""
    data = np.ascontiguousarray(state["params"][block["leaf"]]).tobytes()
    return data[block["number"] * BLOCK:block["number"] * BLOCK + block["raw_size"]]


def _is_chunk_of(codec: str, stored: bytes, raw: bytes, k: int) -> None:
    """`stored` is one C-Blosc2 chunk of `codec` as §6.4 describes it: the extended header (version 5,
    flags naming the codec's compressor), its element size, raw and stored sizes, one filter, the
    codec's; and python-blosc2's plain `decompress2`, told nothing else, decodes it to `raw`."""
    import blosc2

    filter_, compressor = HEADER[codec]
    assert stored[0] == 5 and stored[3] == k, stored[:32].hex()
    assert int.from_bytes(stored[4:8], "little") == len(raw) and int.from_bytes(stored[12:16], "little") == len(stored)
    assert stored[16:22] == bytes([filter_, 0, 0, 0, 0, 0]), stored[:32].hex()
    assert stored[2] >> 5 == compressor, stored[:32].hex()
    assert blosc2.decompress2(stored) == raw


# ------------------------------------------------------------------------- the goldens


def test_the_goldens_are_all_here():
    on_disk = sorted(p.parent.relative_to(GOLDEN_V6).as_posix() for p in GOLDEN_V6.rglob(fmt.MANIFEST))
    assert on_disk == sorted(GOLDENS)


@NEEDS_BLOSC2
@pytest.mark.parametrize("name", GOLDENS)
def test_golden_v6_loads_bitwise(name, mesh8):
    ckpt, want = GOLDEN_V6 / name, _expected(name)
    _same(want, cairn.load(ckpt))
    _same(want, cairn.load(ckpt, verify=False))
    # onto 8 devices: split along the first axis where it divides, else replicated (`c128`'s 300)
    target = {k: NamedSharding(mesh8, P("x") if v.shape[0] % 8 == 0 else P()) for k, v in want["params"].items()}
    got = cairn.load(ckpt, {"params": target})
    for k, v in want["params"].items():
        assert np.asarray(got["params"][k]).tobytes() == v.tobytes(), k
    assert verify(ckpt).ok


def test_golden_v6_versions_codecs_and_deltas():
    """What each golden declares and holds: version 6 exactly where a blosc2-lz4 block is (own, referred
    to, or a delta's base), 5 for blosc2 blocks alone; the indexes keep their layout's version (3 without
    block hashes, 4 with); the leaves name "blosc2-lz4", a part's source column id 5."""
    assert CODEC_NAMES[LZ4] == "blosc2-lz4" and LZ4 == 5 and B2 == 4  # the format's ids: never renumbered
    lz4, chain, mixed = GOLDEN_V6 / "blosc2_lz4", GOLDEN_V6 / "blosc2_lz4_chain", GOLDEN_V6 / "mixed"
    assert _versions(lz4) == (6, {3})
    assert [leaf.get("codec") for leaf in _index(lz4)["leaves"]] == ["blosc2-lz4"] * 6
    assert _manifest(lz4)["bases"] == []
    ids = {name: sorted(b["codec"] for b in _blocks(GOLDEN_V6 / name)) for name in GOLDENS}
    for step in (1, 2, 3):
        name = f"blosc2_lz4_chain/step_{step:08d}"
        assert _versions(GOLDEN_V6 / name) == (6, {4})
        assert _manifest(GOLDEN_V6 / name)["bases"] == ([] if step == 1 else ["step_00000001"])
    assert [leaf.get("codec") for leaf in _index(chain / "step_00000001")["leaves"]] == ["blosc2-lz4"] * 2
    assert set(ids["blosc2_lz4_chain/step_00000001"]) == {LZ4}  # every block its own, coded
    # steps 2 and 3 code nothing themselves: deltas against blosc2-lz4 blocks, references to them
    assert ids["blosc2_lz4_chain/step_00000002"] == [3] + [LZ4] * 7
    assert ids["blosc2_lz4_chain/step_00000003"] == [3, 3] + [LZ4] * 6
    assert delta_kinds(chain / "step_00000002") == [1] and delta_kinds(chain / "step_00000003") == [1, 1]
    assert _versions(mixed / "step_00000001") == (5, {4}) and set(ids["mixed/step_00000001"]) == {B2}
    # blosc2 blocks referred to and a delta against one (5), beside the new leaf's own blosc2-lz4 blocks (6)
    assert _versions(mixed / "step_00000002") == (6, {4})
    assert ids["mixed/step_00000002"] == [3] + [B2] * 7 + [LZ4] * 2
    assert _manifest(mixed / "step_00000002")["bases"] == ["step_00000001"]


@NEEDS_BLOSC2
@pytest.mark.parametrize("name", GOLDENS)
def test_golden_v6_blocks_are_the_spec_chunks(name):
    """Every C-Blosc2 block of each golden, read by hand from the parts and data files, its own or one it
    refers to: a chunk of its codec as §6.4 says (a blosc2-lz4 block names the bit shuffle, filter 2, and
    LZ4, compressor code 1; a blosc2 block the byte shuffle and zstd), of the leaf's element size, that
    python-blosc2's `decompress2` alone decodes to the block's raw bytes; every delta's header names its
    base block's codec, and that base block is such a chunk of the base's values."""
    ckpt, state = GOLDEN_V6 / name, _expected(name)
    seen = set()
    for block in _blocks(ckpt):
        k = np.dtype(_expected_dtype(block["dtype"])).itemsize
        codec = block["codec"]
        if codec == 3:
            base_codec = block["stored"][0]
            assert base_codec == (B2 if name.startswith("mixed") else LZ4), block["leaf"]
            assert int.from_bytes(block["stored"][8:16], "little") == len(block["base"])
            base_state = _expected(f"{ckpt.parent.name}/{block['base_step']}")
            _is_chunk_of(CODEC_NAMES[base_codec], block["base"], _raw_block(base_state, block), k)
            seen.add(("delta", CODEC_NAMES[base_codec]))
            continue
        assert codec in (LZ4, B2), (block["leaf"], codec)
        _is_chunk_of(CODEC_NAMES[codec], block["stored"], _raw_block(state, block), k)
        seen.add((CODEC_NAMES[codec], "own" if block["step"] == ckpt.name else "referred"))
    assert seen == {
        "blosc2_lz4": {("blosc2-lz4", "own")},
        "blosc2_lz4_chain/step_00000001": {("blosc2-lz4", "own")},
        "blosc2_lz4_chain/step_00000002": {("blosc2-lz4", "referred"), ("delta", "blosc2-lz4")},
        "blosc2_lz4_chain/step_00000003": {("blosc2-lz4", "referred"), ("delta", "blosc2-lz4")},
        "mixed/step_00000001": {("blosc2", "own")},
        "mixed/step_00000002": {("blosc2", "referred"), ("delta", "blosc2"), ("blosc2-lz4", "own")},
    }[name]


def test_golden_v6_covers_every_element_size_and_short_blocks():
    """`blosc2_lz4` holds blocks of 1, 2, 4, 8 and 16-byte elements, short last blocks and a block of zeros."""
    blocks = _blocks(GOLDEN_V6 / "blosc2_lz4")
    assert {np.dtype(_expected_dtype(b["dtype"])).itemsize for b in blocks} == {1, 2, 4, 8, 16}
    assert {b["raw_size"] for b in blocks} >= {4096, 3808, 904, 704}
    (zeros,) = [b for b in blocks if b["leaf"] == "zeros"]
    assert zeros["raw_size"] == 4096 and len(zeros["stored"]) == 32  # a header alone (Blosc2 flags: zeros)


@NEEDS_BLOSC2
def test_a_version_5_reader_finds_the_blocks_corrupt():
    """Why version 6 exists: a blosc2-lz4 block read by version 5's rules (a "blosc2" block: filters 0 and
    1 only) is a corrupt block, not a value, so an older reader must stop at the manifest instead."""
    for block in _blocks(GOLDEN_V6 / "blosc2_lz4"):
        with pytest.raises(CorruptCheckpointError, match=r"names Blosc filters \[2, 0, 0, 0, 0, 0\]"):
            _codecs.decode("blosc2", block["stored"], _expected_dtype(block["dtype"]), block["raw_size"])
        assert bytes(_codecs.decode("blosc2-lz4", block["stored"], _expected_dtype(block["dtype"]),
                                    block["raw_size"])) == _raw_block(_lz4_state(), block)


@pytest.mark.parametrize("name", [n for n in GOLDENS if n != "mixed/step_00000001"])
def test_a_reader_of_versions_up_to_5_refuses_it_by_its_version(name, monkeypatch):
    """A cairn that reads versions 1-5 refuses each version-6 golden at its manifest, naming the file, the
    version, the writer and the versions it reads, before it opens any index (`READ_VERSIONS` patched: the
    reader before version 6); the golden of version 5 beside them it still loads."""
    monkeypatch.setattr(fmt, "READ_VERSIONS", (1, 2, 3, 4, 5))
    opened = []
    real = fmt.ItemIndex.from_json
    parse = classmethod(lambda cls, *a, **kw: opened.append(a) or real(*a, **kw))
    monkeypatch.setattr(fmt.ItemIndex, "from_json", parse)
    ckpt = GOLDEN_V6 / name
    for read in (cairn.load, cairn.metadata):
        with pytest.raises(cairn.CorruptCheckpointError) as e:
            read(ckpt)
        msg = str(e.value)
        assert str(ckpt / fmt.MANIFEST) in msg
        assert ("format version 6 is not supported: a newer cairn (0.3.0) wrote it, and this cairn reads format "
                "versions 1, 2, 3, 4, 5; upgrade cairn to read it") in msg
    assert opened == []
    if _codecs.blosc2_available():
        _same(_mixed_state(1), cairn.load(GOLDEN_V6 / "mixed" / "step_00000001"))
        assert opened  # (the patched parser is the one a load uses)


# ------------------------------------------------------------------------- the writer's choice


def test_the_codecs_versions():
    """The manifest version each codec's blocks need beyond their index's layout (`codecs_version`): none
    for the codecs of version 3, 5 for "blosc2", 6 for "blosc2-lz4", the highest for several."""
    assert fmt.READ_VERSIONS == (1, 2, 3, 4, 5, 6) and fmt.INDEX_VERSIONS == (1, 2, 3, 4)
    assert fmt.codecs_version([]) == fmt.codecs_version(["none", "zstd", "planes"]) == 0
    assert fmt.codecs_version(["zstd", "blosc2"]) == fmt.NEWER_BLOCKS_VERSION == 5
    assert fmt.codecs_version(["blosc2-lz4"]) == fmt.codecs_version(["blosc2", "blosc2-lz4", "none"]) == 6
    assert fmt.BIT_SHUFFLE_VERSION == 6 and set(fmt.CODECS) == set(_codecs.CODECS)


@NEEDS_BLOSC2
def test_blosc2_lz4_anywhere_makes_version_6(tmp_path):
    x = np.random.default_rng(3).normal(0, 0.02, (1024, 2048)).astype(ml_dtypes.bfloat16)  # 4 MiB: 4 blocks
    cairn.save(tmp_path / "lz4", {"p": {"w": x}, "s": {"n": np.arange(10)}}, compression="blosc2-lz4")
    assert _versions(tmp_path / "lz4") == (6, {3})
    _same({"p": {"w": x}, "s": {"n": np.arange(10)}}, cairn.load(tmp_path / "lz4"))
    # References to blosc2-lz4 blocks make a raw incremental save version 6 too: a reader follows them.
    cairn.save(tmp_path / "full", {"w": x}, compression="blosc2-lz4", base=tmp_path / "lz4")
    cairn.save(tmp_path / "refs", {"w": x}, base=tmp_path / "full")
    assert {b["codec"] for b in _blocks_of(tmp_path / "full")} == {LZ4}
    assert {b["codec"] for b in _blocks_of(tmp_path / "refs")} == {LZ4} and _versions(tmp_path / "refs") == (6, {4})
    _same({"w": x}, cairn.load(tmp_path / "refs"))
    # A blosc2 save against it: its unchanged blocks refer to blosc2-lz4 ones, so 6, not blosc2's 5.
    y = x.copy()
    y[:16] += 1  # block 0 changed; blocks 1-3 refer to the base's
    cairn.save(tmp_path / "b2", {"w": y}, compression="blosc2", base=tmp_path / "full")
    assert LZ4 in {b["codec"] for b in _blocks_of(tmp_path / "b2")} and _versions(tmp_path / "b2") == (6, {4})
    _same({"w": y}, cairn.load(tmp_path / "b2"))
    # A copy recoded by the stream writer: 6 with blosc2-lz4, 5 with blosc2, 3 with neither.
    for codec, version in (("blosc2-lz4", 6), ("blosc2", 5), ("zstd", 3)):
        cairn.copy(tmp_path / "lz4", tmp_path / f"copy-{codec}", compression=codec)
        assert _versions(tmp_path / f"copy-{codec}") == (version, {3}), codec
        _same({"p": {"w": x}, "s": {"n": np.arange(10)}}, cairn.load(tmp_path / f"copy-{codec}"))


def _blocks_of(ckpt: Path) -> list[dict]:
    """The codec id of every block of a checkpoint of one item (the leaf `w` here), from its parts' source
    columns (§6.5), in the parts' order."""
    (folder,) = [p for p in ckpt.iterdir() if p.is_dir()]
    index = json.loads(next(folder.glob("index.*.json")).read_bytes())
    out = []
    for part in index["parts"]:
        raw = (folder / part["name"]).read_bytes()
        n, m = part["records"], part["crcs"]
        src = np.frombuffer(raw, _SOURCE, m, 64 + 40 * n + 8 * m + 16 * m)
        out += [{"codec": int(c)} for c in src["codec"]]
    return out


def test_the_primary_writes_the_highest_version_any_process_reports():
    """Each process's status says which manifest version its part's blocks need (5 or 6; True from a cairn
    before version 6, meaning 5); the primary writes the highest (`SaveJob.manifest_version`), else the
    indexes' version; a part's need is its codecs' (`SaveJob.newer_blocks`)."""
    from cairn._save.engine import SaveJob
    from cairn._save.incremental import Incremental

    job = SaveJob.__new__(SaveJob)
    job.inc, job.compression = Incremental.__new__(Incremental), "planes"  # an incremental save

    def status(*newer):
        return {"items": {f"i{j}": {"files": [], **({"newer": v} if v else {})} for j, v in enumerate(newer)},
                "ok": True}

    assert job.manifest_version({0: status(None), 1: status(None)}) == 4
    assert job.manifest_version({0: status(None), 1: status(6)}) == 6
    assert job.manifest_version({0: status(5), 1: status(None, 6)}) == 6
    assert job.manifest_version({0: status(True), 1: status(6)}) == 6
    assert job.manifest_version({0: status(True), 1: status(5)}) == 5
    job.inc = None
    assert job.manifest_version({0: status(None)}) == 3 and job.manifest_version({0: status(6), 1: status(None)}) == 6
    item = types.SimpleNamespace(name="params")
    for codecs, need in (({0: "planes", 1: "none"}, 0), ({0: "blosc2"}, 5), ({0: "blosc2", 1: "blosc2-lz4"}, 6),
                         ({1: "blosc2-lz4"}, 6)):
        job.codecs = {"params": codecs, "other": {0: "blosc2-lz4"}}
        assert job.newer_blocks(item) == need, codecs
