"""Safe copies (`cairn.copy`, `cairn cp` / `cairn mv`): between stores, verified, resumable, within a budget."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import cairn
from _trees import assert_same
from cairn._cli.main import main
from cairn._format import manifest as fmt
from cairn._save import commit as _commit
from cairn._storage import LocalStorage, MemoryStorage

MiB = 1 << 20
MIN_BUDGET = 128 << 10
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def make_state(seed: int = 0, n: int = 1 << 18) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "a": {"w": rng.standard_normal(n).astype(np.float32), "note": "first"},
        "b": rng.integers(0, 100, (n // 4, 4)).astype(np.int64),
        "step": 7 + seed,
    }


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "src" / "ck"
    cairn.save(path, make_state(), user_metadata={"note": "hello"})
    return path


def named_files(root: Path) -> set[str]:
    """Every file under checkpoint folder `root`, relative to it."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def data_file(path: Path, item: str) -> Path:
    (f,) = (path / item).glob("*.bin")
    return f


def flip_byte(f: Path, at: int) -> None:
    raw = bytearray(f.read_bytes())
    raw[at] ^= 0xFF
    f.write_bytes(bytes(raw))


# ---------------------------------------------------------------------- local and memory://


def test_local_copy_takes_exactly_the_named_files_and_loads_equal(src, tmp_path):
    (src / "a" / "leftover.other.bin").write_bytes(b"x" * 10)  # not named by the index: stays behind
    before = tree_bytes(src)
    dst = tmp_path / "dst" / "ck"
    stats = cairn.copy(src, dst)
    assert_same(cairn.load(dst), make_state())
    assert json.loads((dst / fmt.MANIFEST).read_text())["metadata"] == {"note": "hello"}
    got = named_files(dst)
    assert got == set(before) - {"a/leftover.other.bin"}
    assert any(n.endswith(".idx") for n in got)  # format 2's binary index parts travel too
    assert all((dst / n).read_bytes() == before[n] for n in got)  # byte for byte, manifest included
    assert tree_bytes(src) == before  # the source is untouched
    assert stats.files_copied == len(got) and stats.files_kept == 0 and not stats.moved
    assert stats.bytes_copied == sum(len(before[n]) for n in got)
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(".")]  # no attempt folder left


def test_format_1_checkpoint_copies(tmp_path):
    golden = GOLDEN / "v1" / "small_blocks"
    assert json.loads((golden / fmt.MANIFEST).read_text())["version"] == 1
    dst = tmp_path / "v1copy"
    stats = cairn.copy(golden, dst, budget_bytes=MIN_BUDGET)
    assert stats.files_copied == len(named_files(golden)) > 3
    assert tree_bytes(dst) == tree_bytes(golden)  # still format 1, byte for byte
    assert_same(cairn.load(dst), cairn.load(golden))


def test_copy_to_memory_store_and_back(src, tmp_path):
    url = "memory://copies/run/ck"
    stats = cairn.copy(src, url)
    assert stats.files_copied > 0
    store = MemoryStorage.named("memory://copies")
    assert {k[len("run/ck/"):] for k in store.list("run/ck")} == named_files(src)
    back = tmp_path / "back"
    cairn.copy(url, back)
    assert tree_bytes(back) == tree_bytes(src)


def test_refuses_to_replace_another_committed_checkpoint(src, tmp_path):
    dst = tmp_path / "dst"
    cairn.save(dst, make_state(seed=1))
    before = tree_bytes(dst)
    with pytest.raises(cairn.CheckpointExistsError, match=f"{dst}.*overwrite=True"):
        cairn.copy(src, dst)
    assert tree_bytes(dst) == before
    cairn.copy(src, dst, overwrite=True)
    assert_same(cairn.load(dst), make_state())
    assert tree_bytes(dst) == tree_bytes(src)  # the replaced checkpoint's files are gone


def test_an_identical_committed_copy_is_only_checked(src, tmp_path):
    dst = tmp_path / "dst"
    cairn.copy(src, dst)
    again = cairn.copy(src, dst)  # a finished copy: nothing to write, nothing refused
    assert again.files_copied == 0 and again.files_kept == len(named_files(dst))
    flip_byte(data_file(dst, "b"), 5)  # damage the committed copy: the check names it
    with pytest.raises(cairn.CorruptCheckpointError, match=r"does not match its source.*b/p00000"):
        cairn.copy(src, dst)


def test_bad_inputs_name_the_path_and_leave_nothing(tmp_path):
    dst = tmp_path / "dst"
    with pytest.raises(cairn.CheckpointNotFoundError, match="no checkpoint at .*nothing"):
        cairn.copy(tmp_path / "nothing", dst)
    half = tmp_path / "half"
    cairn.save(half, make_state())
    (half / fmt.MANIFEST).unlink()  # an interrupted save: not committed
    with pytest.raises(cairn.CheckpointNotFoundError, match=f"{half} holds no committed checkpoint"):
        cairn.copy(half, dst)
    with pytest.raises(cairn.CheckpointError, match="the same checkpoint"):
        cairn.copy(half, half)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half"]


@pytest.mark.parametrize("dst_kind", ["local", "memory"])
def test_corrupt_source_is_detected_and_nothing_is_committed(src, tmp_path, dst_kind):
    f = data_file(src, "b")
    flip_byte(f, f.stat().st_size // 2)
    before = tree_bytes(src)
    dst = str(tmp_path / "dst") if dst_kind == "local" else f"memory://corrupt-{os.getpid()}/dst"
    with pytest.raises(cairn.CorruptCheckpointError, match=rf"{src} \[b\]: checksum mismatch in leaf '<root>' chunk 0 .* of 'b/p00000-0\..*\.bin', block 1 "):
        cairn.copy(src, dst, budget_bytes=1 * MiB)
    with pytest.raises(cairn.CheckpointNotFoundError):
        cairn.load(dst)
    if dst_kind == "local":
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # not even an attempt folder
    else:
        assert MemoryStorage.named(f"memory://corrupt-{os.getpid()}").list("dst") == []
    assert tree_bytes(src) == before
    with pytest.raises(cairn.CorruptCheckpointError):  # a move of it keeps the source
        cairn.copy(src, dst, move=True)
    assert tree_bytes(src) == before


def test_truncated_or_missing_source_file_is_corruption(src, tmp_path):
    f = data_file(src, "a")
    f.write_bytes(f.read_bytes()[:-3])
    with pytest.raises(cairn.CorruptCheckpointError, match="has .* bytes, the index records"):
        cairn.copy(src, tmp_path / "dst")
    f.unlink()
    with pytest.raises(cairn.CorruptCheckpointError, match="is missing"):
        cairn.copy(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


# ---------------------------------------------------------------------- resume


class Unplugged(OSError):
    pass


def fail_writes_of(monkeypatch, cls, needle: str) -> list[str]:
    """Make `cls.write` of keys containing `needle` fail after consuming one piece (a disk or link lost midway)."""
    real = cls.write
    seen: list[str] = []

    def write(self, key, parts):
        if needle not in key:
            return real(self, key, parts)
        seen.append(key)

        def some():
            it = iter(parts)
            yield next(it)
            raise Unplugged("the destination went away mid-file")

        return real(self, key, some())

    monkeypatch.setattr(cls, "write", write)
    return seen


@pytest.mark.parametrize("dst_kind", ["local", "memory"])
def test_interrupted_copy_resumes(src, tmp_path, monkeypatch, dst_kind):
    cls = LocalStorage if dst_kind == "local" else MemoryStorage
    dst = str(tmp_path / "dst") if dst_kind == "local" else f"memory://resume-{os.getpid()}/dst"
    seen = fail_writes_of(monkeypatch, cls, "/b/p00000")
    with pytest.raises(cairn.CheckpointError, match="b/p00000-0.*the destination went away"):
        cairn.copy(src, dst, budget_bytes=256 << 10, threads=1)
    assert seen
    with pytest.raises(cairn.CheckpointNotFoundError):
        cairn.load(dst)  # nothing visible
    if dst_kind == "local":
        (attempt,) = [p for p in tmp_path.iterdir() if p.name.startswith(".dst.cairn-tmp-")]
        assert not list((attempt / "b").glob("*.bin"))  # files appear only once complete
        # What a kill leaves: a partial file under its own name (from a non-atomic writer), and a
        # temporary file of the interrupted write. The first is written again, the second left out.
        name = data_file(src, "b").name
        (attempt / "b" / name).write_bytes(data_file(src, "b").read_bytes()[:1000])
        (attempt / "b" / f"{name}.cairn-tmp-dead").write_bytes(b"partial")
    monkeypatch.undo()
    stats = cairn.copy(src, dst, budget_bytes=256 << 10, threads=1)
    assert stats.files_kept >= 1  # what the first attempt completed is kept ...
    assert stats.files_copied >= 1  # ... and the partial file is written again
    assert stats.files_kept + stats.files_copied == len(named_files(src))
    assert_same(cairn.load(dst), make_state())
    if dst_kind == "local":
        assert tree_bytes(tmp_path / "dst") == tree_bytes(src)
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_resume_rewrites_a_damaged_leftover_of_the_right_size(src, tmp_path, monkeypatch):
    fail_writes_of(monkeypatch, LocalStorage, "/b/p00000")
    with pytest.raises(cairn.CheckpointError):
        cairn.copy(src, tmp_path / "dst", threads=1)
    monkeypatch.undo()
    (attempt,) = [p for p in tmp_path.iterdir() if p.name.startswith(".dst.cairn-tmp-")]
    done = data_file(attempt, "a")
    assert done.stat().st_size == data_file(src, "a").stat().st_size
    flip_byte(done, 100)  # complete but wrong: its checksums tell
    stats = cairn.copy(src, tmp_path / "dst", threads=1)
    assert stats.files_copied >= 2
    assert tree_bytes(tmp_path / "dst") == tree_bytes(src)


KILLER = """
import os, signal, sys
import cairn
from cairn._storage import local as _local
src, dst, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
real, n = os.write, [0]
def write(fd, data):  # SIGKILL just before the k-th write of file bytes
    n[0] += 1
    if n[0] == k:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(fd, data)
_local.os.write = write
cairn.copy(src, dst, budget_bytes=256 << 10, threads=2)
"""


@pytest.mark.parametrize("k", [1, 4, 9])
def test_killed_copy_leaves_nothing_visible_and_resumes(src, tmp_path, k):
    import subprocess
    import sys

    dst = tmp_path / "dst"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", KILLER, str(src), str(dst), str(k)], env=env, timeout=120,
                          capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not dst.exists()  # killed before its commit: nothing there, only an attempt folder
    assert [p.name.startswith(".dst.cairn-tmp-") for p in tmp_path.iterdir() if p.name != "src"] == [True]
    stats = cairn.copy(src, dst)
    assert stats.files_kept + stats.files_copied == len(named_files(src))
    assert tree_bytes(dst) == tree_bytes(src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


# ---------------------------------------------------------------------- move


def test_move_deletes_the_source_only_after_the_commit(src, tmp_path, monkeypatch):
    dst = tmp_path / "dst"
    want = tree_bytes(src)
    real = _commit.RenameCommit.delete
    committed_at_delete: list[bool] = []

    def delete(self, name):
        committed_at_delete.append((dst / fmt.MANIFEST).exists())
        return real(self, name)

    monkeypatch.setattr(_commit.RenameCommit, "delete", delete)
    stats = cairn.copy(src, dst, move=True)
    assert stats.moved and committed_at_delete == [True]
    assert not src.exists() and not [p for p in src.parent.iterdir()]
    assert tree_bytes(dst) == want


def test_move_interrupted_before_deleting_finishes_on_rerun(src, tmp_path, monkeypatch):
    dst = tmp_path / "dst"

    def crash(self, name):
        raise KeyboardInterrupt  # killed between the commit and the source's deletion

    monkeypatch.setattr(_commit.RenameCommit, "delete", crash)
    with pytest.raises(KeyboardInterrupt):
        cairn.copy(src, dst, move=True)
    assert (src / fmt.MANIFEST).exists() and (dst / fmt.MANIFEST).exists()
    monkeypatch.undo()
    stats = cairn.copy(src, dst, move=True)
    assert stats.moved and stats.files_copied == 0 and not src.exists()
    assert_same(cairn.load(dst), make_state())


def test_move_onto_an_existing_checkpoint_keeps_the_source(src, tmp_path):
    dst = tmp_path / "dst"
    cairn.save(dst, make_state(seed=2))
    with pytest.raises(cairn.CheckpointExistsError):
        cairn.copy(src, dst, move=True)
    assert_same(cairn.load(src), make_state())
    assert_same(cairn.load(dst), make_state(seed=2))


# ---------------------------------------------------------------------- memory


def test_memory_stays_within_the_budget(tmp_path):
    src = tmp_path / "big"
    rng = np.random.default_rng(0)
    cairn.save(src, {f"w{i}": rng.standard_normal(1 << 21).astype(np.float32) for i in range(3)})  # 3 x 8 MiB
    budget = 2 * MiB
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        stats = cairn.copy(src, tmp_path / "dst", budget_bytes=budget, threads=4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stats.bytes_copied > 24 * MiB
    assert 0 < stats.peak_piece_bytes <= budget
    assert peak < budget + 1 * MiB, f"peak traced memory {peak / MiB:.1f} MiB for a budget of 2 MiB"
    assert tree_bytes(tmp_path / "dst") == tree_bytes(src)


# ---------------------------------------------------------------------- object stores


@pytest.fixture(params=["s3", "azure"])
def store(request):
    return request.getfixturevalue(request.param)


def test_local_to_object_store_and_back(src, tmp_path, store):
    bucket = store.new_bucket()
    opts = store.options(part_size=5 * MiB, read_part_size=1 * MiB)
    url = store.url(bucket, "run/ck")
    stats = cairn.copy(src, url, dst_storage_options=opts, budget_bytes=1 * MiB)
    assert stats.files_copied == len(named_files(src))
    keys = store.keys(bucket)
    assert {k[len("run/ck/"):] for k in keys} == named_files(src)
    for name, data in tree_bytes(src).items():
        assert store.get_object(bucket, f"run/ck/{name}") == data
    assert_same(cairn.load(url, storage_options=opts), make_state())
    with pytest.raises(cairn.CheckpointExistsError, match=url):
        cairn.copy(_other(tmp_path), url, dst_storage_options=opts)
    back = tmp_path / "back"
    cairn.copy(url, back, storage_options=opts, move=True)
    assert tree_bytes(back) == tree_bytes(src)
    assert store.keys(bucket) == []  # moved: the object-store source is gone


def test_between_two_object_stores(src, s3, azure):
    a_bucket, b_bucket = s3.new_bucket(), azure.new_bucket()
    a, b = s3.url(a_bucket, "ck"), azure.url(b_bucket, "copies/ck")
    cairn.copy(src, a, dst_storage_options=s3.options())
    stats = cairn.copy(a, b, storage_options=s3.options(), dst_storage_options=azure.options(), move=True)
    assert stats.moved and s3.keys(a_bucket) == []
    assert {k[len("copies/ck/"):] for k in azure.keys(b_bucket)} == named_files(src)
    assert_same(cairn.load(b, storage_options=azure.options()), make_state())


def _other(tmp_path: Path) -> Path:
    path = tmp_path / "other"
    cairn.save(path, make_state(seed=3))
    return path


def test_object_store_copy_resumes_after_a_failed_upload(src, tmp_path, s3, monkeypatch):
    from cairn._storage.obstore import ObjectStorage

    bucket = s3.new_bucket()
    opts = s3.options(part_size=5 * MiB)
    url = s3.url(bucket, "ck")
    fail_writes_of(monkeypatch, ObjectStorage, "/b/p00000")
    with pytest.raises(cairn.CheckpointError, match="went away"):
        cairn.copy(src, url, dst_storage_options=opts, threads=1, budget_bytes=256 << 10)
    assert "ck/manifest.json" not in s3.keys(bucket)
    monkeypatch.undo()
    stats = cairn.copy(src, url, dst_storage_options=opts, threads=1)
    assert stats.files_kept >= 1 and stats.files_copied >= 1
    assert_same(cairn.load(url, storage_options=opts), make_state())
    assert {k[len("ck/"):] for k in s3.keys(bucket)} == named_files(src)


# ---------------------------------------------------------------------- command line


def run(capsys, *argv):
    rc = main(["--plain", *map(str, argv)])
    got = capsys.readouterr()
    return rc, got.out, got.err


def test_cli_cp_and_mv(src, tmp_path, capsys):
    want = tree_bytes(src)
    rc, out, err = run(capsys, "cp", src, tmp_path / "c1")
    assert rc == 0, err
    assert f"copied {src} -> {tmp_path / 'c1'}" in out and "checksums verified" in out
    assert tree_bytes(tmp_path / "c1") == want

    rc, out, err = run(capsys, "cp", _other(tmp_path), tmp_path / "c1")
    assert rc == 1 and "already holds a checkpoint" in err and "overwrite" in err

    rc, out, err = run(capsys, "cp", src, tmp_path / "c2", "--json", "--budget", "1M", "--threads", "2")
    assert rc == 0, err
    report = json.loads(out)
    assert report["files_copied"] == len(want) and 0 < report["peak_piece_bytes"] <= MiB

    rc, out, err = run(capsys, "mv", src, tmp_path / "m1")
    assert rc == 0, err
    assert out.startswith("moved") and not src.exists()
    assert tree_bytes(tmp_path / "m1") == want

    rc, out, err = run(capsys, "mv", src, tmp_path / "m2")
    assert rc == 1 and "no checkpoint at" in err and str(src) in err
    assert not (tmp_path / "m2").exists()


def test_cli_cp_corrupt_source_fails_and_names_it(src, tmp_path, capsys):
    flip_byte(data_file(src, "a"), 10)
    rc, _, err = run(capsys, "cp", src, tmp_path / "dst")
    assert rc == 1 and "corrupt" in err and str(src) in err
    assert not (tmp_path / "dst").exists()


def test_run_copy_keeping_references_copies_and_checks_each_step_once(tmp_path, monkeypatch):
    """`cairn cp --keep-references RUN`: a base already copied as an earlier step of the run is neither
    copied nor read again for the later steps that refer to it (it was checked once already)."""
    from cairn._exports import copy as copy_mod

    run = tmp_path / "run"
    frozen = np.random.default_rng(3).standard_normal((512, 1024)).astype(np.float32)
    with cairn.CheckpointManager(run, incremental=True, full_every=4, async_save=False) as mgr:
        for step in range(6):
            mgr.save(step, {"frozen": frozen, "head": np.full((64,), step, np.float32)})
    assert any(fmt.Manifest.from_json((run / n / "manifest.json").read_bytes(), n).bases for n in os.listdir(run))
    calls: list[str] = []
    real = copy_mod._copy_as_is

    def counted(s, d, *args, **kwargs):
        calls.append(d.name)
        return real(s, d, *args, **kwargs)

    monkeypatch.setattr(copy_mod, "_copy_as_is", counted)
    assert main(["--plain", "cp", "--keep-references", str(run), str(tmp_path / "copy")]) == 0
    assert sorted(calls) == sorted(os.listdir(run)), calls  # each step once, bases not again
    reader = cairn.CheckpointManager(tmp_path / "copy", read_only=True)
    for step in reader.steps():
        assert_same({"frozen": frozen, "head": np.full((64,), step, np.float32)}, reader.restore(step))
    # One checkpoint copied on its own still copies (or checks) its bases beside it, and names them.
    calls.clear()
    last = sorted(os.listdir(run))[-1]
    stats = cairn.copy(run / last, tmp_path / "one" / last, keep_references=True)
    assert stats.bases and sorted(calls) == sorted([*stats.bases, last])


# ---------------------------------------------------------------------- moving a base


@pytest.mark.parametrize("where", ["local", "memory"])
def test_moving_a_checkpoint_others_refer_to_is_refused_naming_them(tmp_path, capsys, where):
    """References resolve by name beside the referrer (incremental saves): a move of their base would
    break them, so it is refused before anything is written, naming them; a move of anything else goes on."""
    run = str(tmp_path / "run") if where == "local" else f"memory://moves-{tmp_path.name}/run"
    s = make_state(3, 1 << 20)
    cairn.save(f"{run}/a", s)
    cairn.save(f"{run}/b", s, base=f"{run}/a")
    cairn.save(f"{run}/c", s, base=f"{run}/b")
    cairn.save(f"{run}/other", {"x": np.arange(5)})
    dst = str(tmp_path / "moved") if where == "local" else f"memory://moves-{tmp_path.name}/moved"
    # (a was saved without hashes, so b wrote every block and refers to nothing; c refers to b.)
    with pytest.raises(cairn.CheckpointError, match=r"run/b is the base of c \(incremental saves"):
        cairn.copy(f"{run}/b", f"{dst}/b", move=True)
    assert main(["--plain", "mv", f"{run}/b", f"{dst}/b"]) != 0
    assert "is the base of c" in capsys.readouterr().err
    with pytest.raises(cairn.CheckpointNotFoundError):  # nothing written at the destination
        cairn.load(f"{dst}/b")
    for name in ("a", "b", "c"):
        assert_same(cairn.load(f"{run}/{name}"), s)
    # Nothing refers to `other`: it moves.
    assert cairn.copy(f"{run}/other", f"{dst}/other", move=True).moved
    assert_same(cairn.load(f"{run}/c"), s)


def test_keeping_references_copies_a_step_with_a_delta_beside_own_and_referenced_blocks(tmp_path, capsys):
    """A raw chain's step whose checkpointable holds a leaf stored as a delta and a leaf with one own block and
    one reference: the copy checks each own block at its stored size (a delta's is not its raw size)."""
    import ml_dtypes

    rng = np.random.default_rng(11)
    d0 = rng.standard_normal((1024, 512)).astype(ml_dtypes.bfloat16)  # one 1 MiB block
    p0 = rng.standard_normal((1024, 512)).astype(np.float32)  # two blocks
    d1, p1 = d0.copy(), p0.copy()
    d1[0, :3] = 7  # three elements: the block is stored as a delta
    p1[512:] += 1  # block 1 the step's own, block 0 a reference
    chain = tmp_path / "run"
    with cairn.CheckpointManager(chain, incremental=True, compression=False, async_save=False) as mgr:
        mgr.save(0, {"params": {"d": d0, "p": p0}})
        mgr.save(1, {"params": {"d": d1, "p": p1}})
    step1 = chain / sorted(os.listdir(chain))[-1]
    own = [f.stat().st_size for f in (step1 / "params").glob("*.bin")]
    assert len(own) == 1 and MiB < own[0] < MiB + 4096, own  # p's block 1 and d's delta
    want = {"params": {"d": d1, "p": p1}}
    stats = cairn.copy(step1, tmp_path / "one" / step1.name, keep_references=True)
    assert stats.bases
    assert_same(want, cairn.load(tmp_path / "one" / step1.name))
    rc, _, err = run(capsys, "cp", "--keep-references", step1, tmp_path / "two" / step1.name)
    assert rc == 0, err
    assert_same(want, cairn.load(tmp_path / "two" / step1.name))
