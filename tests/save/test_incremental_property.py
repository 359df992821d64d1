"""Version-4 records under random changes (hypothesis): chains of incremental saves load bit for bit, and
damage to what their references and deltas point at is a `CorruptCheckpointError` naming both steps.

Random trees of arrays (4 KiB checksum blocks, so that a leaf spans several) change block by block from
step to step: unchanged (a reference), a few bits flipped (a delta, where it pays) or rewritten (the
block's own bytes), under random compression settings. Every step of the chain loads bitwise and
verifies. Then one byte of the base is flipped: where a block of the next step refers to it or is a delta
against it, loading that step raises, naming both checkpoints; elsewhere it still loads bitwise.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cairn
from cairn._format import manifest as fmt
from cairn._format.blocks import DELTA
from cairn._load.blocks import block_places
from cairn._load.source import open_checkpoint
from cairn._save import engine as _save
from cairn._sources.verify import verify
from cairn._storage.location import resolve

BLOCK = 4096
DTYPES = [np.float32, ml_dtypes.bfloat16, np.int8, np.uint16, np.float64]
KINDS = ["same", "same", "slight", "changed"]  # how each block changes from one step to the next


@st.composite
def trees(draw) -> dict:
    """A dict (one level nested at most) of 1-4 arrays of 1-5 blocks and a bit."""
    out: dict = {}
    for i in range(draw(st.integers(1, 4))):
        dtype = np.dtype(draw(st.sampled_from(DTYPES)))
        n = (draw(st.integers(1, 5)) * BLOCK + draw(st.sampled_from([0, 8, 1000]))) // dtype.itemsize
        cols = draw(st.sampled_from([1, 8, 64]))
        raw = np.random.default_rng(draw(st.integers(0, 2**31))).integers(0, 256, (n // cols) * cols * dtype.itemsize,
                                                                       dtype=np.uint8)
        x = raw.view(dtype).reshape(-1, cols)
        if draw(st.booleans()):
            out.setdefault("sub", {})[f"a{i}"] = x
        else:
            out[f"a{i}"] = x
    return out


def _leaves(tree: dict, prefix: str = "") -> list[tuple[str, np.ndarray]]:
    return [x for k, v in tree.items() for x in (_leaves(v, f"{prefix}{k}/") if isinstance(v, dict)
                                                   else [(prefix + k, v)])]


def _step(tree: dict, kinds: list[str], seed: int) -> dict:
    """`tree` with each 4 KiB block of each array's bytes changed as `kinds` says (cycling)."""
    rng = np.random.default_rng(seed)
    out = {k: (_step(v, kinds, seed + 1) if isinstance(v, dict) else v.copy()) for k, v in tree.items()}
    j = 0
    for _, x in _leaves(out):
        flat = x.reshape(-1).view(np.uint8)
        for lo in range(0, flat.size, BLOCK):
            hi, kind = min(lo + BLOCK, flat.size), kinds[j % len(kinds)]
            j += 1
            if kind == "slight":  # a few low bits: what a small learning rate does to bf16 weights
                at = rng.integers(lo, hi, 3)
                flat[at] ^= 1
            elif kind == "changed":
                flat[lo:hi] = rng.integers(0, 256, hi - lo, dtype=np.uint8)
    return out


def _save_step(path: Path, state: dict, base: Path | None, compression: object) -> None:
    kw = {"base": resolve(base)} if base is not None else {}
    _save.prepare(resolve(path), state, block_size=BLOCK, compression=compression, hashes=True, **kw).run()


def _same(want: dict, got: dict) -> None:
    a, b = _leaves(want), _leaves(got)
    assert [k for k, _ in a] == [k for k, _ in b]
    for (k, x), (_, y) in zip(a, b):
        y = np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k


def _sources(path: Path) -> list[tuple[str, int, int, int, bool]]:
    """Every block of every array of the checkpoint: (data file, offset, stored size, codec id, own)."""
    ck = open_checkpoint(str(path))
    out = []
    for index in ck.indexes.values():
        if index.table is not None:
            index.table.fetch_all()
        for leaf in index.leaves:
            if not isinstance(leaf, fmt.ArrayLeaf):
                continue
            for cell in range(len(leaf.chunks)):
                if leaf.refs:
                    for f, off, size, _crc, codec, _against in block_places(leaf, cell, index.block_size):
                        out.append((index.files[f].name, off, size, codec, index.files[f].base is None))
                else:
                    f, pos = leaf.chunks[cell]
                    for size in leaf.stored_sizes(cell, index.block_size):
                        out.append((index.files[f].name, pos, size, -1, True))
                        pos += size
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees(), st.lists(st.lists(st.sampled_from(KINDS), min_size=1, max_size=6), min_size=1, max_size=3),
       st.lists(st.sampled_from([False, "zstd", True]), min_size=4, max_size=4))
def test_chains_of_random_changes_load_bitwise(tree, changes, compressions):
    d = Path(tempfile.mkdtemp())
    try:
        states, base = [tree], None
        for t, kinds in enumerate([[], *changes]):
            state = _step(states[-1], kinds, 100 + t) if kinds else tree
            states.append(state)
            _save_step(d / f"s{t}", state, base, compressions[t])
            base = d / f"s{t}"
        for t, state in enumerate(states[1:]):
            _same(state, cairn.load(d / f"s{t}"))
            assert verify(d / f"s{t}").ok
            m = fmt.Manifest.from_json((d / f"s{t}" / "manifest.json").read_bytes(), "m")
            assert set(m.bases) <= {f"s{u}" for u in range(t)}
    finally:
        shutil.rmtree(d)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees(), st.lists(st.sampled_from(KINDS), min_size=1, max_size=6), st.sampled_from([False, "zstd", True]),
       st.integers(0, 2**31), st.integers(0, 7))
def test_a_flipped_base_byte_is_named_where_the_next_step_needs_it(tree, kinds, compression, where, bit):
    d = Path(tempfile.mkdtemp())
    try:
        _save_step(d / "s0", tree, None, compression)
        nxt = _step(tree, kinds, 7)
        _save_step(d / "s1", nxt, d / "s0", False)
        # The bytes of s0 that s1 reads: its references (where they point: a block equal to another
        # leaf's may refer to that one), and the base blocks of its deltas (the block at the same
        # position in s0, whose own bytes they are: s0 is self-contained).
        mine, theirs = _sources(d / "s1"), _sources(d / "s0")
        assert len(mine) == len(theirs)
        needed = [(mf, moff, moff + msize) if not own else (f, off, off + size)
                  for (mf, moff, msize, codec, own), (f, off, size, _c, _o) in zip(mine, theirs)
                  if not own or codec == DELTA]
        files = sorted((d / "s0").glob("*/*.bin"))
        target = files[where % len(files)]
        data = bytearray(target.read_bytes())
        if not data:
            return
        at = (where // len(files)) % len(data)
        data[at] ^= 1 << bit
        target.write_bytes(bytes(data))
        hit = any(f == target.name and lo <= at < hi for f, lo, hi in needed)
        if hit:
            with pytest.raises(cairn.CorruptCheckpointError) as e:
                cairn.load(d / "s1")
            assert "'s0'" in str(e.value) and str(d / "s1") in str(e.value), str(e.value)
            assert not verify(d / "s1").ok
        else:
            _same(nxt, cairn.load(d / "s1"))
    finally:
        shutil.rmtree(d)
