"""The "blosc2-lz4" codec in saves: format version 6 exactly where a block needs it, in plain
and incremental saves and across processes' statuses, and "auto" weighing it against the leaf's smallest
codec by predicted time (docs/FORMAT.md §6.4, §6.6; docs/compression.md)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import cairn
from cairn._codecs import choose as _choose
from cairn._codecs import codecs as _codecs
from cairn._format import manifest as fmt
from cairn._load.source import open_checkpoint
from cairn._save import codecpolicy

pytestmark = pytest.mark.skipif(not _codecs.blosc2_available(), reason="python-blosc2 is not installed")


def _state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(0, 0.02, (256, 512)).astype(ml_dtypes.bfloat16),
            "m": rng.normal(0, 1e-3, (128, 256)).astype(np.float32), "step": 3}


def _version(path) -> int:
    return json.loads((path / "manifest.json").read_bytes())["version"]


def _codecs_of(path) -> dict[str, str]:
    ck = open_checkpoint(path)
    return {leaf.path: leaf.codec for index in ck.indexes.values() for leaf in index.leaves
            if isinstance(leaf, fmt.ArrayLeaf)}


def _same(got: dict, want: dict) -> None:
    for k in ("w", "m"):
        assert np.asarray(got[k]).tobytes() == want[k].tobytes(), k


def test_a_bit_shuffled_save_is_version_6_and_reads_back(tmp_path):
    state = _state()
    cairn.save(tmp_path / "lz4", state, compression="blosc2-lz4")
    cairn.save(tmp_path / "zstd", state, compression="blosc2")
    assert _version(tmp_path / "lz4") == 6 and _version(tmp_path / "zstd") == 5
    assert set(_codecs_of(tmp_path / "lz4").values()) == {"blosc2-lz4"}
    for index in open_checkpoint(tmp_path / "lz4").indexes.values():
        assert index.version == 3  # a manifest version only: the index keeps its layout's
    _same(cairn.load(tmp_path / "lz4"), state)
    # it stores a little more than "blosc2" and much less than raw
    lz4 = sum(f.stat().st_size for f in (tmp_path / "lz4").rglob("*.bin"))
    zstd = sum(f.stat().st_size for f in (tmp_path / "zstd").rglob("*.bin"))
    raw = state["w"].nbytes + state["m"].nbytes
    assert zstd < lz4 < 0.9 * raw


def test_a_reader_of_version_5_refuses_it_by_its_version(tmp_path, monkeypatch):
    cairn.save(tmp_path / "c", _state(), compression="blosc2-lz4")
    monkeypatch.setattr(fmt, "READ_VERSIONS", (1, 2, 3, 4, 5))
    with pytest.raises(cairn.CheckpointError, match="version 6"):
        cairn.load(tmp_path / "c")


def test_incremental_saves_are_version_6_while_a_block_is_bit_shuffled(tmp_path):
    """Own blocks, references to a base's and deltas against them all need version 6; a chain that
    refers to none (recompressed with "blosc2") is version 5 again."""
    run = tmp_path / "run"
    state = _state()
    cairn.save(run / "s1", state, compression="blosc2-lz4", base=None)
    cairn.save(run / "s2", state, compression="blosc2-lz4", base=run / "s1")  # every block a reference
    assert _version(run / "s1") in (4, 6) and _version(run / "s2") == 6
    changed = dict(state, m=state["m"].copy())
    changed["m"][0, :3] = 1.0  # a few elements: a delta against a bit-shuffled block
    cairn.save(run / "s3", changed, compression="blosc2-lz4", base=run / "s2")
    assert _version(run / "s3") == 6
    _same(cairn.load(run / "s3"), changed)
    other = _state(1)  # every block changed, coded anew by "blosc2": no reference to a bit-shuffled block
    cairn.save(run / "s4", other, compression="blosc2", base=run / "s3")
    assert _version(run / "s4") == 5
    _same(cairn.load(run / "s4"), other)


def test_the_manifest_version_is_the_highest_any_process_needs():
    """The primary's `manifest_version` over the processes' statuses: an int per item (this version), or
    True from a cairn before version 6 (5); absent or 0: the indexes' layout."""
    from cairn._save.engine import SaveJob

    job = SimpleNamespace(version=3)

    def of(*said):
        return SaveJob.manifest_version(job, {i: {"items": {"a": {"newer": s} if s is not None else {}}}
                                              for i, s in enumerate(said)})

    assert of(None, None) == 3 and of(0, None) == 3
    assert of(None, True) == 5 and of(5, None) == 5
    assert of(True, 6) == 6 and of(6, None, 5) == 6
    job.version = 4
    assert of(None) == 4 and of(6) == 6


def test_fast_weighs_the_fast_codec_by_predicted_time(monkeypatch):
    """`decide_leaf` in "fast": on a slow link the smaller codec wins (bytes are time); on a fast one, with
    many cores, "blosc2-lz4" does (its coding is the time); True ("choose") and "auto" never take it: they
    pick only codecs every install reads."""
    from cairn._save.codecpolicy import predicted_seconds

    w = _state()["w"]
    gib = float(1 << 30)
    slow = codecpolicy.decide_leaf("fast", w.dtype, w, 0.05 * gib, cores=12)
    fast = codecpolicy.decide_leaf("fast", w.dtype, w, 4 * gib, cores=12)
    chosen = codecpolicy.decide_leaf("choose", w.dtype, w, 4 * gib, cores=12)
    assert slow.codec in ("blosc2", "planes") and fast.codec == "blosc2-lz4" and chosen.codec == "planes"
    for bandwidth in (0.05 * gib, 4 * gib):
        assert codecpolicy.decide_leaf("auto", w.dtype, w, bandwidth, cores=12).codec in ("planes", "none")
    lz4 = _choose.stored_size("blosc2-lz4", w.dtype, _choose.sample(w, codecpolicy.sample_bytes(w.nbytes)))
    assert fast.stored == lz4 > slow.stored  # it stores more, and is still predicted sooner there
    assert (predicted_seconds(fast.raw, lz4, "blosc2-lz4", 4 * gib, 12)[1]
            < predicted_seconds(fast.raw, slow.stored, slow.codec, 4 * gib, 12)[1])
    monkeypatch.setattr(_codecs, "_blosc2_found", False)  # without python-blosc2: never
    assert codecpolicy.decide_leaf("fast", w.dtype, w, 4 * gib, cores=12).codec != "blosc2-lz4"


def test_auto_prices_each_codec_with_its_own_measured_figures(tmp_path):
    """`auto_prices` carries each codec's coded figures (`_storage.measured`); `decide_leaf` prices each
    candidate with its own: a slow end-to-end figure measured while "blosc2" coded does not hold the
    faster codec back, and a slow figure of its own does."""
    from cairn._save.codecpolicy import CODEC_SPEEDS

    w = _state()["w"]
    gib = float(1 << 30)
    slow, link = 0.02 * gib, 0.25 * gib
    prices = {"bandwidth": link, "read_bandwidth": link, "coded_bandwidth": slow, "coded_read_bandwidth": slow,
              "codec_factor": 1.0, "coded_by_codec": {"blosc2": [slow, slow], "planes": [slow, slow],
                                                      "blosc2-lz4": [link, link]}}
    assert codecpolicy.decide_leaf("fast", w.dtype, w, link, prices, cores=12).codec == "blosc2-lz4"
    prices["coded_by_codec"]["blosc2-lz4"] = [slow / 2, slow / 2]  # measured slower still: not it
    assert codecpolicy.decide_leaf("fast", w.dtype, w, link, prices, cores=12).codec != "blosc2-lz4"
    got = codecpolicy.auto_prices(cairn._storage.MemoryStorage(f"memory://prices-{tmp_path.name}"))
    assert set(got["coded_by_codec"]) == set(CODEC_SPEEDS)
    assert all(len(v) == 2 and v[0] > 0 for v in got["coded_by_codec"].values())
