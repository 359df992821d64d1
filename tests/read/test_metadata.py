"""Reading a committed checkpoint's metadata (`cairn._read.metadata`): manifests, indexes (also from the
bytes a commit kept) and the checkpoints beside one."""

from __future__ import annotations

import os

import numpy as np
import pytest

import cairn
from cairn._errors import CheckpointNotFoundError, CorruptCheckpointError
from cairn._read.metadata import base_beside, committed_manifest, read_index, read_manifest, sibling
from cairn._storage.location import resolve


def _saved(tmp_path, name: str = "ck0"):
    path = str(tmp_path / name)
    cairn.save(path, {"w": np.arange(1000, dtype=np.float32), "b": np.ones((4, 4), np.int16)})
    return resolve(path)


def test_sibling_is_beside():
    loc = resolve("/tmp/run/ck1")
    there = sibling(loc, "ck0")
    assert there.storage is loc.storage
    assert there.name == "ck0"
    assert there.path == "/tmp/run/ck0"


def test_committed_manifest_is_none_where_nothing_is_committed(tmp_path):
    loc = _saved(tmp_path)
    got = committed_manifest(loc)
    assert got is not None and got == read_manifest(loc)
    missing = sibling(loc, "nothing-here")
    assert committed_manifest(missing) is None
    with pytest.raises(CheckpointNotFoundError, match="nothing-here"):
        read_manifest(missing)


def test_base_beside_refuses_itself_and_other_folders(tmp_path):
    loc = resolve(str(tmp_path / "ck1"))
    assert base_beside(loc, str(tmp_path / "ck0")).name == "ck0"
    with pytest.raises(ValueError, match="its own base"):
        base_beside(loc, str(tmp_path / "ck1"))
    with pytest.raises(ValueError, match="same folder or prefix"):
        base_beside(loc, "memory://elsewhere/ck0")


class _Kept:
    """What a commit kept of a checkpoint's index files (`_save.basecache.Kept`'s shape)."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.parsed = files, {}

    def ranges(self, loc, folder, what="the index part"):
        def read(reqs):
            return [self.files[f"{folder}/{name}"][start : start + length] for name, start, length in reqs]

        return read


def test_read_index_takes_kept_bytes_before_storage(tmp_path):
    loc = _saved(tmp_path)
    info = next(iter(read_manifest(loc).items.values()))
    folder = tmp_path / "ck0" / info.dir
    kept = _Kept({f"{info.dir}/{f}": (folder / f).read_bytes() for f in os.listdir(folder)
                  if not f.endswith(".bin")})
    want = read_index(loc, info)
    want_chunks = [(list(leaf.chunks), list(leaf.crcs)) for leaf in want.leaves
                   if isinstance(leaf, cairn._format.manifest.ArrayLeaf)]  # (records fetched now)
    for f in os.listdir(folder):  # the index and its parts gone from storage: only the kept bytes remain
        if not f.endswith(".bin"):
            os.remove(folder / f)
    got = read_index(loc, info, kept)
    assert [leaf.path for leaf in got.leaves] == [leaf.path for leaf in want.leaves]
    got_chunks = [(list(leaf.chunks), list(leaf.crcs)) for leaf in got.leaves
                  if isinstance(leaf, cairn._format.manifest.ArrayLeaf)]
    assert got_chunks == want_chunks and len(got_chunks) == 1  # (each top-level key is a checkpointable)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        read_index(loc, info)
