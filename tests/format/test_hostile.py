"""Hostile checkpoints: escaping names, planted symlinks, absurd shapes and offsets, unknown versions.

Each is rejected with a clear error naming the checkpoint, and loading never
executes anything stored in a checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest

import cairn
from _forge import as_version_1
from cairn._format import manifest as fmt


def index_file(path, item):
    m = json.loads((path / fmt.MANIFEST).read_bytes())
    return path / m["items"][item]["dir"] / m["items"][item]["index"]


def rewrite(file, edit):
    """Edit a manifest or index and re-checksum it, as a forger would."""
    doc = json.loads(file.read_bytes())
    doc.pop("crc32c", None)
    edit(doc)
    file.write_bytes(fmt.dump_checked_json(doc))


def files_under(path):
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, _, ns in os.walk(path) for n in ns)


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "run" / "ckpt"
    cairn.save(path, {"params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, "blob": b"abc"})
    return path


# ---------------------------------------------------------------------- names that try to escape


@pytest.mark.parametrize("name", ["..", "../escape", "/abs/olute", "a/../../b", ".", "~", "%2e%2e", "x\x00y"])
def test_item_and_key_names_stay_inside(tmp_path, name):
    path = tmp_path / "ckpt"
    cairn.save(path, {name: {name: np.ones(3), "../k": 1}, "ok": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing was written beside the checkpoint
    for rel in files_under(path):
        assert ".." not in rel.split(os.sep) and not rel.startswith("/")
    out = cairn.load(path)
    np.testing.assert_array_equal(out[name][name], np.ones(3))
    assert out[name]["../k"] == 1


@pytest.mark.parametrize(("field", "value"), [
    ("dir", "../../outside"), ("dir", "/etc"), ("dir", "params/../../x"),
    ("index", "../../../etc/passwd"), ("index", "/etc/passwd"), ("index", ".hidden.json"),
])
def test_manifest_paths_that_escape_are_rejected(ckpt, field, value):
    rewrite(ckpt / fmt.MANIFEST, lambda d: d["items"]["params"].__setitem__(field, value))
    with pytest.raises(cairn.CorruptCheckpointError, match="manifest.json") as e:
        cairn.load(ckpt)
    assert str(ckpt) in str(e.value)


@pytest.mark.parametrize("name", ["../../outside.bin", "/etc/passwd", "sub/file.bin", ".."])
def test_index_data_file_names_that_escape_are_rejected(ckpt, name):
    rewrite(index_file(ckpt, "params"), lambda d: d["files"][0].__setitem__("name", name))
    with pytest.raises(cairn.CorruptCheckpointError, match="file name"):
        cairn.load(ckpt)


# ---------------------------------------------------------------------- planted symlinks


def _outside_copy(ckpt, tmp_path):
    """A copy of the checkpoint's params folder outside it: a link to it would load 'fine'."""
    import shutil

    out = tmp_path / "elsewhere"
    shutil.copytree(ckpt / "params", out)
    return out


def test_symlinked_item_folder_is_refused(ckpt, tmp_path):
    outside = _outside_copy(ckpt, tmp_path)
    import shutil

    shutil.rmtree(ckpt / "params")
    os.symlink(outside, ckpt / "params")
    with pytest.raises(cairn.CorruptCheckpointError, match="symbolic link") as e:
        cairn.load(ckpt)
    assert str(ckpt) in str(e.value)
    with pytest.raises(cairn.CorruptCheckpointError, match="symbolic link"):
        cairn.metadata(ckpt)
    # The other checkpointable is not behind a link and still loads on its own.
    assert cairn.load(ckpt, {"blob": None})["blob"] == b"abc"


@pytest.mark.parametrize("which", ["data", "index", "manifest"])
def test_symlinked_files_are_refused(ckpt, tmp_path, which):
    if which == "manifest":
        victim = ckpt / fmt.MANIFEST
    elif which == "index":
        victim = index_file(ckpt, "params")
    else:
        victim = next((ckpt / "params").glob("p*.bin"))
    target = tmp_path / f"outside-{which}"
    target.write_bytes(victim.read_bytes())  # identical bytes: only the link itself is wrong
    victim.unlink()
    os.symlink(target, victim)
    with pytest.raises(cairn.CorruptCheckpointError, match="symbolic link") as e:
        cairn.load(ckpt)
    assert str(ckpt) in str(e.value)


def test_linked_checkpoint_folder_itself_is_allowed(ckpt, tmp_path):
    # A link *to* a checkpoint (e.g. "latest") is the user's choice, not planted content.
    os.symlink(ckpt, tmp_path / "latest")
    assert cairn.load(tmp_path / "latest")["blob"] == b"abc"


def test_retention_and_cleanup_never_follow_links_out(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    run = tmp_path / "run"
    with cairn.CheckpointManager(run, max_to_keep=1, async_save=False, handle_sigterm=False) as mgr:
        mgr.save(0, {"x": np.ones(2)})
        # A linked step and a linked "interrupted save" pointing at someone else's data.
        os.symlink(precious, run / ".step_00000005.cairn-tmp-abcdef")
        os.symlink(precious, run / "step_00000007")
        (run / "step_00000001").mkdir()
        os.symlink(precious, run / "step_00000001" / "params")
        mgr.save(8, {"x": np.zeros(2)})
    with cairn.CheckpointManager(run, max_to_keep=1, async_save=False, handle_sigterm=False):
        pass
    assert (precious / "keep.txt").read_text() == "mine"
    assert sorted(os.listdir(precious)) == ["keep.txt"]


# ---------------------------------------------------------------------- absurd shapes, offsets, versions


@pytest.mark.parametrize(("edit", "match"), [
    (lambda leaf, d: leaf.__setitem__("shape", [2**40, 2**40]), "limit|integer"),
    (lambda leaf, d: leaf.__setitem__("shape", [-3, 4]), "integer"),
    (lambda leaf, d: leaf.__setitem__("shape", [1] * 65), "dimensions|grid"),
    (lambda leaf, d: leaf.__setitem__("shape", [3, 4.5]), "integer"),
    (lambda leaf, d: leaf["chunks"][0].__setitem__(1, 2**60), "integer|outside"),
    (lambda leaf, d: leaf["chunks"][0].__setitem__(1, -8), "integer"),
    (lambda leaf, d: leaf["chunks"][0].__setitem__(1, 1), "outside"),
    (lambda leaf, d: leaf["chunks"][0].__setitem__(0, 7), "integer"),
    (lambda leaf, d: leaf.__setitem__("grid", [[0, 5], [0, 4]]), "tile|integer"),
    (lambda leaf, d: leaf.__setitem__("dtype", "object"), "dtype"),
    (lambda leaf, d: leaf.__setitem__("dtype", "|O"), "dtype"),
    (lambda leaf, d: d.__setitem__("block_size", 1), "integer"),
    (lambda leaf, d: d["files"][0].__setitem__("size", 2**62), "integer"),
    (lambda leaf, d: d["files"][0].__setitem__("size", 10**9), "claims"),  # a bigger file than is there
])
def test_absurd_shapes_and_offsets(ckpt, allocations, edit, match):
    as_version_1(ckpt)  # the forged fields are those of an explicit chunk table
    rewrite(index_file(ckpt, "params"), lambda d: edit(d["leaves"][0], d))
    with pytest.raises(cairn.CorruptCheckpointError, match=match) as e:
        cairn.load(ckpt)
    assert str(ckpt) in str(e.value)
    assert allocations == []


@pytest.fixture
def allocations(monkeypatch):
    sizes: list[int] = []
    real = cairn._core.buffers.aligned_empty

    def spy(shape, dtype, align=64, **kw):
        sizes.append(int(np.prod(shape, dtype=object)))
        return real(shape, dtype, align, **kw)

    monkeypatch.setattr(cairn._load.reader, "aligned_empty", spy)  # where the chunk reader looks it up
    return sizes


@pytest.mark.parametrize("which", ["manifest", "index"])
@pytest.mark.parametrize("version", [0, 7, 99, "1", None])  # 7: after the newest (6, FORMAT.md §6.6)
def test_unknown_format_versions(ckpt, which, version):
    file = ckpt / fmt.MANIFEST if which == "manifest" else index_file(ckpt, "params")
    rewrite(file, lambda d: d.__setitem__("version", version))
    with pytest.raises(cairn.CorruptCheckpointError, match="version") as e:
        cairn.load(ckpt)
    assert str(ckpt) in str(e.value)


def test_foreign_format_name(ckpt):
    rewrite(ckpt / fmt.MANIFEST, lambda d: d.__setitem__("format", "orbax"))
    with pytest.raises(cairn.CorruptCheckpointError, match="not a cairn manifest"):
        cairn.load(ckpt)


# ---------------------------------------------------------------------- no code execution


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_loading_never_executes_code(ckpt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    payload = pickle.dumps(_Boom())
    # A pickle stored as bytes comes back as those bytes, never unpickled.
    cairn.save(tmp_path / "p", {"blob": payload, "x": np.frombuffer(payload, np.uint8)})
    out = cairn.load(tmp_path / "p")
    assert out["blob"] == payload
    # An object leaf naming a handler nobody registered (or a Python callable) is refused.
    for handler in ["os.system", "builtins.eval", "pickle.loads", "__import__"]:
        def edit(d, handler=handler):
            leaf = next(x for x in d["leaves"] if x["kind"] in ("bytes", "object"))
            leaf["kind"], leaf["handler"] = "object", handler
        rewrite(index_file(tmp_path / "p", "blob"), edit)
        with pytest.raises(cairn.CheckpointError, match="register"):
            cairn.load(tmp_path / "p")
    assert not (tmp_path / "PWNED").exists()


def test_no_code_loading_primitives_in_the_loader():
    """The read path uses no pickle, eval or dynamic import (a cheap guard against regressions).

    `marshal.dumps` may appear (the index parser keys its layout memo with the
    bytes of values it parsed itself); nothing may *load* marshalled data."""
    import inspect

    for mod in (cairn._load.engine, cairn._format.manifest, cairn._tree.pytree, cairn._tree.leaves, cairn._storage.local):
        src = inspect.getsource(mod)
        for banned in ("pickle", "eval(", "exec(", "importlib", "__import__", "allow_pickle=True", "marshal.load"):
            assert banned not in src, (mod.__name__, banned)


# ---------------------------------------------------------------------- hostile sizes of compressed blocks (v3)


@pytest.fixture
def coded(tmp_path):
    """A compressed checkpoint (format version 3) whose leaf 'w' has chunks of several 4 KiB blocks."""
    from cairn._save import engine
    from cairn._storage.location import resolve

    path = tmp_path / "run" / "coded"
    w = (np.random.default_rng(3).normal(0, 0.02, (64, 512))).astype(np.float32)  # 128 KiB: 32 blocks
    engine.prepare(resolve(str(path)), {"params": {"w": w}}, block_size=4096, compression="zstd").run()
    return path


HOSTILE_SIZES = [0, 1, 4095, 2**31, 2**32 - 1]


@pytest.mark.parametrize("value", [*HOSTILE_SIZES, -1, 2.5, "7", None, 4096 + 4096 // 8 + 4097])
@pytest.mark.parametrize("block", [0, 5, -1])
def test_hostile_stored_sizes_in_the_json(coded, allocations, value, block):
    """A forged ``stored`` size (with a valid index checksum) is refused or caught by the block checks."""
    from _forge import as_explicit

    as_explicit(coded)
    rewrite(index_file(coded, "params"), lambda d: d["leaves"][0]["stored"][0].__setitem__(block, value))
    with pytest.raises(cairn.CorruptCheckpointError) as e:
        cairn.load(coded)
    assert str(coded) in str(e.value)
    assert sum(allocations) <= 64 * 512 * 4


@pytest.mark.parametrize("edit", [
    lambda leaf: leaf.__setitem__("codec", "lz4"),
    lambda leaf: leaf.__setitem__("codec", 3),
    lambda leaf: leaf.__setitem__("codec", "none"),  # the stored blocks are then read as raw
    lambda leaf: leaf.__delitem__("stored"),
    lambda leaf: leaf["stored"].pop(),
    lambda leaf: leaf["stored"][0].pop(),
    lambda leaf: leaf.__setitem__("stored", {"a": 1}),
])
def test_hostile_codec_fields(coded, edit):
    from _forge import as_explicit

    as_explicit(coded)
    rewrite(index_file(coded, "params"), lambda d: edit(d["leaves"][0]))
    with pytest.raises(cairn.CorruptCheckpointError):
        cairn.load(coded)


def _forge_part_sizes(path, edit) -> None:
    """Rewrite the size column of params' binary part with `edit(sizes)`, re-checksummed as a forger would."""
    from cairn._core.checksum import crc32c
    from cairn._format.partfile import HEADER_BYTES, RECORD, RECORD_BYTES

    part = next((path / "params").glob("index.p*.idx"))
    data = bytearray(part.read_bytes())
    n, m = (int(v) for v in np.frombuffer(bytes(data[24:40]), "<u8"))
    crc_at = HEADER_BYTES + n * RECORD_BYTES
    sizes = np.frombuffer(bytes(data[crc_at + 4 * m : crc_at + 8 * m]), "<u4").astype(np.int64)
    sizes = np.asarray(edit(sizes.copy()), dtype=np.int64) & 0xFFFFFFFF
    data[crc_at + 4 * m : crc_at + 8 * m] = sizes.astype("<u4").tobytes()
    rec = np.frombuffer(bytes(data[HEADER_BYTES:crc_at]), RECORD).copy()
    starts = rec["crc_start"].astype(np.int64)
    ends = np.append(starts[1:], m)
    for i in range(n):
        s, e = int(starts[i]) * 4, int(ends[i]) * 4
        col = bytes(data[crc_at + s : crc_at + e])
        rec["crcs_crc"][i] = crc32c(bytes(data[crc_at + 4 * m + s : crc_at + 4 * m + e]), crc32c(col))
        raw = rec[i : i + 1].tobytes()
        rec["rec_crc"][i] = crc32c(raw[: RECORD_BYTES - 4])
    data[HEADER_BYTES:crc_at] = rec.tobytes()
    part.write_bytes(bytes(data))


@pytest.mark.parametrize("value", HOSTILE_SIZES)
@pytest.mark.parametrize("block", [0, 7, -1])
def test_hostile_stored_sizes_in_the_binary_part(coded, allocations, value, block):
    """The stored-size column of a version-3 part, forged with valid checksums: a clean error, no allocation
    beyond the real data."""

    def edit(sizes):
        sizes[block] = value
        return sizes

    _forge_part_sizes(coded, edit)
    with pytest.raises(cairn.CorruptCheckpointError) as e:
        cairn.load(coded)
    assert str(coded) in str(e.value)
    assert sum(allocations) <= 64 * 512 * 4


def test_swapped_stored_sizes_are_caught_by_the_block_checksums(coded):
    """Two blocks' sizes swapped (the sum unchanged, every index checksum valid): the CRCs of the stored
    blocks no longer match, so the load fails instead of decoding the wrong bytes."""
    def swap(sizes):
        sizes[[0, 1]] = sizes[[1, 0]]
        return sizes

    _forge_part_sizes(coded, swap)
    with pytest.raises(cairn.CorruptCheckpointError):
        cairn.load(coded)


def test_an_uncompressed_leaf_of_a_version_3_part_must_store_raw_sizes(tmp_path):
    """In a version-3 part a leaf of codec "none" still lists its blocks' sizes: they must be the raw ones
    (a forged split of the same total would otherwise move block boundaries)."""
    from cairn._save import engine
    from cairn._storage.location import resolve

    path = tmp_path / "run" / "raw3"
    noise = np.random.default_rng(4).integers(0, 256, 3 * 4096, dtype=np.uint8)
    engine.prepare(resolve(str(path)), {"params": {"n": noise}}, block_size=4096, compression=True).run()
    assert json.loads((path / fmt.MANIFEST).read_bytes())["version"] == 3

    def shift(sizes):
        sizes[0] += 8
        sizes[1] -= 8
        return sizes

    _forge_part_sizes(path, shift)
    with pytest.raises(cairn.CorruptCheckpointError, match="uncompressed"):
        cairn.load(path)
