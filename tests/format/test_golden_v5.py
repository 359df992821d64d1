"""Format version 5 (docs/FORMAT.md §6.6): the goldens of tests/golden/v5/ load bit for bit, and the writer
says 5 exactly where a block needs a reader that knows codec "blosc2" or sparse deltas.

The goldens were written once by tests/golden/make_golden_v5.py and are never regenerated; the expected
values are rebuilt here, not imported from that script. The goldens of versions 1-3 are checked in
test_golden.py, those of version 4 in tests/save/test_incremental.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from _parts import delta_kinds
from cairn._codecs import codecs as _codecs
from cairn._format import manifest as fmt
from cairn._sources.verify import verify

GOLDEN_V5 = Path(__file__).resolve().parents[1] / "golden" / "v5"
NEEDS_BLOSC2 = pytest.mark.skipif(not _codecs.blosc2_available(), reason="python-blosc2 is not installed")


# ------------------------------------------------------------------------- expected values


def _blosc2_state() -> dict:
    rng = np.random.default_rng(55)
    return {"params": {"w": rng.normal(0, 0.02, (64, 128)).astype(ml_dtypes.bfloat16),
                       "ids": np.arange(3000, dtype=np.int32) % 7,
                       "zeros": np.zeros((1024,), np.float32)},
            "step": 5}


def _chain_state(step: int) -> dict:
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    emb = (np.arange(128 * 64) % 251).astype(ml_dtypes.bfloat16).reshape(128, 64)
    if step >= 2:
        w[40, :] = -2.0
    if step >= 3:
        emb[0, :4] = 9.0
    return {"params": {"w": w, "emb": emb}, "step": step}


def _sparse_state(step: int) -> dict:
    i16 = (np.arange(64 * 128) % 1000).astype(np.int16).reshape(64, 128)
    f32 = np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64)
    if step >= 2:
        i16[20, [0, 7, 100]] = -300
        f32[20, [1, 62]] = 4.5
    if step >= 3:
        i16[40, 5] = 12345
        f32[40, [0, 1, 2]] = -0.125
    return {"params": {"i16": i16, "f32": f32}, "step": step}


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


def _versions(ckpt: Path) -> tuple[int, set[int]]:
    """The manifest's version and its indexes'."""
    manifest = json.loads((ckpt / fmt.MANIFEST).read_bytes())
    return manifest["version"], {json.loads(p.read_bytes())["version"] for p in ckpt.glob("*/index.*.json")}


def _codec_ids(ckpt: Path) -> list[int]:
    from cairn._format.partfile import PART_VERSION_BLOCKS, block_columns

    return sorted(c for part in ckpt.glob("*/index.p*.idx")
                  for c in block_columns(part.read_bytes(), PART_VERSION_BLOCKS)[1]["codec"].tolist())


# ------------------------------------------------------------------------- the goldens

GOLDENS = ["blosc2", *(f"{c}/step_{s:08d}" for c in ("blosc2_chain", "sparse") for s in (1, 2, 3))]


def _expected(name: str) -> dict:
    if name == "blosc2":
        return _blosc2_state()
    chain, step = name.split("/")
    return (_chain_state if chain == "blosc2_chain" else _sparse_state)(int(step[-1]))


def test_the_goldens_are_all_here():
    on_disk = sorted(p.parent.relative_to(GOLDEN_V5).as_posix() for p in GOLDEN_V5.rglob(fmt.MANIFEST))
    assert on_disk == sorted(GOLDENS)


@pytest.mark.parametrize("name", [pytest.param(n, marks=NEEDS_BLOSC2) if "blosc2" in n else n for n in GOLDENS])
def test_golden_v5_loads_bitwise(name, mesh8):
    ckpt, want = GOLDEN_V5 / name, _expected(name)
    _same(want, cairn.load(ckpt))
    _same(want, cairn.load(ckpt, verify=False))
    got = cairn.load(ckpt, {"params": {k: NamedSharding(mesh8, P("x")) for k in want["params"]}})
    for k, v in want["params"].items():
        assert np.asarray(got["params"][k]).tobytes() == v.tobytes(), k
    assert verify(ckpt).ok


def test_golden_v5_versions_and_blocks():
    """What each golden declares and holds: version 5 exactly where a blosc2 block (own, referred to, or a
    delta's base) or a sparse delta is; the indexes keep their layout's version (3 or 4)."""
    assert _versions(GOLDEN_V5 / "blosc2") == (5, {3})
    index = json.loads(next((GOLDEN_V5 / "blosc2" / "params").glob("index.*.json")).read_bytes())
    assert [leaf.get("codec") for leaf in index["leaves"]] == ["blosc2"] * 3
    chain, sparse = GOLDEN_V5 / "blosc2_chain", GOLDEN_V5 / "sparse"
    for step in (1, 2, 3):
        name = f"step_{step:08d}"
        assert _versions(chain / name) == (5, {4})
        assert _versions(sparse / name) == ({1: 4, 2: 5, 3: 5}[step], {4})
    assert set(_codec_ids(chain / "step_00000001")) == {4}  # blosc2's id in a part's source column
    assert 4 in _codec_ids(chain / "step_00000002") and 0 not in _codec_ids(chain / "step_00000002")
    assert delta_kinds(chain / "step_00000002") != []
    assert delta_kinds(sparse / "step_00000001") == []
    assert 1 in delta_kinds(sparse / "step_00000002") and 1 in delta_kinds(sparse / "step_00000003")


# ------------------------------------------------------------------------- the writer's choice


def test_saves_without_blosc2_or_sparse_deltas_keep_their_versions(tmp_path):
    x = np.random.default_rng(1).normal(0, 0.02, (256, 256)).astype(np.float32)
    cairn.save(tmp_path / "raw", {"p": {"w": x}})
    cairn.save(tmp_path / "zstd", {"p": {"w": x}}, compression="zstd")
    cairn.save(tmp_path / "planes", {"p": {"w": x}}, compression="planes")
    cairn.save(tmp_path / "base", {"p": {"w": x}}, compression="planes")
    cairn.save(tmp_path / "inc", {"p": {"w": x}}, base=tmp_path / "base")  # hashes, references: no delta
    y = x.copy()
    y[:64] += 1.0  # whole blocks changed: stored as themselves
    cairn.save(tmp_path / "inc2", {"p": {"w": y}}, base=tmp_path / "inc")
    assert {n: _versions(tmp_path / n) for n in ("raw", "zstd", "planes", "inc", "inc2")} == {
        "raw": (2, {2}), "zstd": (3, {3}), "planes": (3, {3}), "inc": (4, {4}), "inc2": (4, {4})}
    assert delta_kinds(tmp_path / "inc2") == []


def test_xor_deltas_stay_version_4_and_sparse_ones_make_it_5(tmp_path):
    w0 = np.random.default_rng(2).standard_normal((256, 1024)).astype(np.float32)  # 1 MiB: one block
    cairn.save(tmp_path / "a", {"w": w0})
    cairn.save(tmp_path / "b", {"w": w0}, base=tmp_path / "a")  # self-contained, with hashes
    few = w0.copy()
    few.reshape(-1)[[5, 9000, 200000]] = 7.0  # three elements: a sparse delta
    cairn.save(tmp_path / "c", {"w": few}, base=tmp_path / "b")
    assert delta_kinds(tmp_path / "c") == [1] and _versions(tmp_path / "c") == (5, {4})
    _same({"w": few}, cairn.load(tmp_path / "c"))
    # The low bit of a quarter of the elements (every fourth): the XOR frame is far smaller than the
    # sparse one (positions and whole values), so the delta is an XOR one: still version 4.
    many = w0.copy()
    many.reshape(-1).view("<u4")[::4] ^= 1
    cairn.save(tmp_path / "d", {"w": many}, base=tmp_path / "b")
    assert delta_kinds(tmp_path / "d") == [0] and _versions(tmp_path / "d") == (4, {4})
    _same({"w": many}, cairn.load(tmp_path / "d"))


@NEEDS_BLOSC2
def test_blosc2_anywhere_makes_version_5(tmp_path):
    x = np.random.default_rng(3).normal(0, 0.02, (256, 256)).astype(ml_dtypes.bfloat16)
    cairn.save(tmp_path / "b2", {"p": {"w": x}, "s": {"n": np.arange(10)}}, compression="blosc2")
    assert _versions(tmp_path / "b2") == (5, {3})
    # References to blosc2 blocks make a raw incremental save version 5 too: a reader follows them.
    cairn.save(tmp_path / "full", {"w": x}, compression="blosc2", base=tmp_path / "b2")
    cairn.save(tmp_path / "refs", {"w": x}, base=tmp_path / "full")
    assert 4 in _codec_ids(tmp_path / "refs") and _versions(tmp_path / "refs") == (5, {4})
    _same({"w": x}, cairn.load(tmp_path / "refs"))
    # A copy recoded by the stream writer: 5 with blosc2, back to 3 without.
    cairn.copy(tmp_path / "b2", tmp_path / "b2copy", compression="blosc2")
    cairn.copy(tmp_path / "b2", tmp_path / "zcopy", compression="zstd")
    assert _versions(tmp_path / "b2copy") == (5, {3}) and _versions(tmp_path / "zcopy") == (3, {3})


def test_the_primary_writes_5_when_any_process_reports_newer_blocks():
    """Each process's status says whether its part holds blosc2 blocks or sparse deltas; the primary's
    manifest version is 5 when any does (`SaveJob.manifest_version`), else the indexes' version."""
    from cairn._save.engine import SaveJob
    from cairn._save.incremental import Incremental

    job = SaveJob.__new__(SaveJob)
    job.inc, job.compression = Incremental.__new__(Incremental), "planes"  # an incremental save
    quiet = {"items": {"params": {"files": []}, "step": {"files": []}}, "ok": True}
    loud = {"items": {"params": {"files": []}, "step": {"files": [], "newer": True}}, "ok": True}
    assert job.manifest_version({0: quiet, 1: quiet}) == 4
    assert job.manifest_version({0: quiet, 1: loud}) == 5
    job.inc = None
    assert job.manifest_version({0: quiet}) == 3 and job.manifest_version({0: loud, 1: quiet}) == 5


# ------------------------------------------------------------------------- readers


def _rewrite(path: Path, change) -> None:
    d = json.loads(path.read_bytes())
    d.pop("crc32c")
    change(d)
    path.write_bytes(fmt.dump_checked_json(d))


def test_a_newer_version_says_a_newer_cairn_wrote_it(tmp_path):
    """A manifest of a version after the newest this cairn reads (6, docs/FORMAT.md §6.6): refused by its
    version, naming the writer's release and every version this cairn reads, and saying to upgrade."""
    cairn.save(tmp_path / "ck", {"w": np.arange(10)})
    _rewrite(tmp_path / "ck" / fmt.MANIFEST, lambda d: d.update(version=7, cairn_version="9.0.0"))
    with pytest.raises(cairn.CorruptCheckpointError) as e:
        cairn.load(tmp_path / "ck")
    msg = str(e.value)
    assert str(tmp_path / "ck" / fmt.MANIFEST) in msg
    assert "format version 7 is not supported: a newer cairn (9.0.0) wrote it" in msg and "upgrade cairn" in msg
    assert "reads format versions 1, 2, 3, 4, 5, 6;" in msg


def test_index_versions_name_layouts_and_5_is_none_yet(tmp_path):
    """Versions 5 and 6 are manifest versions: an index of version 5 (or more) is one this cairn cannot lay out."""
    cairn.save(tmp_path / "ck", {"w": np.arange(10)})
    (index,) = (tmp_path / "ck" / "w").glob("index.*.json")
    for version in (5, 6, 7):
        _rewrite(index, lambda d, v=version: d.update(version=v))
        with pytest.raises(cairn.CorruptCheckpointError, match=f"index version {version} is not supported: a "
                                                               "newer cairn wrote it, and this cairn reads index "
                                                               "versions 1, 2, 3, 4; upgrade") as e:
            cairn.load(tmp_path / "ck")
        assert str(index) in str(e.value)


def test_version_4_checkpoints_of_the_last_round_still_load():
    """v4/sparse holds sparse deltas in a version-4 checkpoint (written before version 5 existed): read as
    written (docs/FORMAT.md §6.6), its values checked in tests/save/test_incremental.py."""
    ckpt = Path(__file__).resolve().parents[1] / "golden" / "v4" / "sparse" / "step_00000002"
    assert _versions(ckpt) == (4, {4}) and delta_kinds(ckpt) == [1, 1, 1, 1]
    assert verify(ckpt).ok
