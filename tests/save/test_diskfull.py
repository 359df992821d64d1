"""Disk full and I/O errors during a save: a clear error, nothing visible, earlier checkpoints intact.

ENOSPC comes from a real, small tmpfs that the test mounts when it runs as
root and ``mount -t tmpfs`` works (the save's data does not fit); otherwise
those tests are skipped, and ENOSPC and EIO are injected at every storage
step (data, index and index part writes, manifest put, fsync, rename) through a wrapper
around the storage, on the local (rename) and the object-store (manifest
put) commit paths. After each failure the earlier checkpoint loads bitwise,
nothing is visible at the failed path, cleanup leaves no temporary files,
and the next save succeeds.
"""

from __future__ import annotations

import errno
import os
import subprocess
import uuid

import numpy as np
import pytest

import cairn
from cairn._cli import main as _cli
from cairn._load import engine as _load
from cairn._save import engine as _save
from cairn._storage import LocalStorage, MemoryStorage
from cairn._storage.location import Location

MiB = 1 << 20


def state(tag, mib=0.25):
    rng = np.random.default_rng(tag)
    n = int(mib * MiB) // 4
    return {"params": {"w": rng.standard_normal(n).astype(np.float32), "b": np.arange(tag, tag + 4)},
            "meta": {"step": tag}}


def assert_same(got, want):
    assert got["meta"] == want["meta"]
    for k, v in want["params"].items():
        assert got["params"][k].dtype == v.dtype and got["params"][k].tobytes() == v.tobytes(), k


def leftovers(directory):
    return [os.path.relpath(os.path.join(d, n), directory) for d, ds, fs in os.walk(directory) for n in ds + fs
            if cairn._format.manifest.TMP_MARK in n or ".tmp-" in n]


# ---------------------------------------------------------------------- a real full filesystem


@pytest.fixture
def tiny_fs(tmp_path):
    """A 2 MiB tmpfs mounted for the test (root only), unmounted afterwards."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_enospc_on_a_full_filesystem(tiny_fs):
    cairn.save(tiny_fs / "prev", state(0))
    with pytest.raises(cairn.CheckpointError) as e:
        cairn.save(tiny_fs / "ckpt", state(1, mib=3))  # 3 MiB into what is left of 2 MiB
    msg = str(e.value)
    assert str(tiny_fs / "ckpt") in msg and "No space left" in msg, msg
    assert sorted(os.listdir(tiny_fs)) == ["prev"]  # the failed attempt removed its files itself
    with pytest.raises(cairn.CheckpointNotFoundError):
        cairn.load(tiny_fs / "ckpt")
    assert_same(cairn.load(tiny_fs / "prev"), state(0))
    cairn.save(tiny_fs / "ckpt", state(2))  # the space came back
    assert_same(cairn.load(tiny_fs / "ckpt"), state(2))


def test_enospc_through_the_manager(tiny_fs):
    run = tiny_fs / "run"
    with cairn.CheckpointManager(run, max_to_keep=1, handle_sigterm=False) as mgr:
        mgr.save(0, state(0))
        mgr.wait()
        mgr.save(1, state(1, mib=3))  # async: fails in the background
        with pytest.raises(cairn.CheckpointError, match="No space left") as e:
            mgr.wait()
        assert "step 1" in str(e.value) and str(run) in str(e.value)
        assert mgr.steps() == [0]  # retention never ran for the failed step: step 0 survives
        assert_same(mgr.restore(), state(0))
        mgr.save(2, state(2))
        mgr.wait()
        assert mgr.steps() == [2]
    assert leftovers(run) == [] and sorted(os.listdir(run)) == ["step_00000002"]


def test_enospc_overwriting_keeps_the_old_checkpoint(tiny_fs):
    cairn.save(tiny_fs / "ckpt", state(0))
    with pytest.raises(cairn.CheckpointError, match="No space left"):
        cairn.save(tiny_fs / "ckpt", state(1, mib=3), overwrite=True)
    assert_same(cairn.load(tiny_fs / "ckpt"), state(0))
    assert leftovers(tiny_fs) == []


# ---------------------------------------------------------------------- injected errors at every step


class Faulty:
    """Wraps a storage; the first call of `method` whose key matches raises OSError(`code`)."""

    def __init__(self, inner, method, code, match=""):
        self.inner, self.method, self.code, self.match = inner, method, code, match
        self.fired = 0

    def __getattr__(self, name):
        real = getattr(self.inner, name)
        if name == "dirs":  # the folder operations (sync_dir, rename_dir) are the wrapper's too
            return None if real is None else self
        if name != self.method:
            return real

        def call(key, *args, **kwargs):
            if self.match in (key if isinstance(key, str) else " ".join(key)) and not self.fired:  # delete_keys: a list
                self.fired += 1
                raise OSError(self.code, f"{os.strerror(self.code)} (injected)", key)
            return real(key, *args, **kwargs)

        return call


STEPS = [  # (method, key fragment): every storage step of a local save and its commit (the indexes and
    # index parts are written in place in the hidden attempt folder, `RenameCommit.put_all`)
    ("write", ".bin"), ("write", "index."), ("write", ".idx"), ("put", "manifest.json"), ("sync_dir", ""),
    ("rename_dir", ""),
]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize(("method", "match"), STEPS)
def test_injected_error_local(tmp_path, method, match, code):
    storage = LocalStorage(str(tmp_path))
    cairn.save(tmp_path / "prev", state(0))
    faulty = Faulty(storage, method, code, match)
    loc = Location(faulty, "ckpt", str(tmp_path / "ckpt"))
    with pytest.raises(cairn.CheckpointError) as e:
        _save.prepare(loc, state(1)).run()
    assert faulty.fired == 1
    msg = str(e.value)
    assert str(tmp_path / "ckpt") in msg and os.strerror(code) in msg, msg
    assert sorted(os.listdir(tmp_path)) == ["prev"], os.listdir(tmp_path)
    assert_same(cairn.load(tmp_path / "prev"), state(0))
    assert _cli.main(["--plain", "--quiet", "gc", "--min-age", "0", str(tmp_path)]) == 0
    assert leftovers(tmp_path) == []
    cairn.save(tmp_path / "ckpt", state(2))
    assert_same(cairn.load(tmp_path / "ckpt"), state(2))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize(("method", "match"), [("write", ".bin"), ("put", "index."), ("put", "manifest.json")])
@pytest.mark.parametrize("overwrite", [False, True])
def test_injected_error_object_store(method, match, code, overwrite):
    storage = MemoryStorage.named(f"memory://diskfull-{uuid.uuid4().hex}")
    base = storage.url
    cairn.save(f"{base}/prev", state(0))
    if overwrite:
        cairn.save(f"{base}/ckpt", state(3))
    faulty = Faulty(storage, method, code, match)
    loc = Location(faulty, "ckpt", f"{base}/ckpt")
    with pytest.raises(cairn.CheckpointError) as e:
        _save.prepare(loc, state(1), overwrite=overwrite).run()
    assert f"{base}/ckpt" in str(e.value) and os.strerror(code) in str(e.value)
    if overwrite:
        assert_same(cairn.load(f"{base}/ckpt"), state(3))
        tokens = {i.index.split(".")[1] for i in _load.read_manifest(loc).items.values()}
        assert all(any(f".{t}." in k for t in tokens) or k.endswith("manifest.json") for k in storage.list("ckpt"))
    else:
        with pytest.raises(cairn.CheckpointNotFoundError):
            cairn.load(f"{base}/ckpt")
        assert storage.list("ckpt") == []  # the failed attempt deleted what it wrote
    assert_same(cairn.load(f"{base}/prev"), state(0))


@pytest.mark.parametrize("method", ["delete_keys"])
def test_failing_cleanup_after_an_object_store_commit_keeps_the_checkpoint(method):
    """Once the manifest is put the save is committed: a failing cleanup must not undo it. (The cleanup
    lists nothing after the commit: it deletes the other attempts' files found by the commit's own
    listing before the manifest, whose failure leaves no checkpoint, in one `Storage.delete_keys`:
    tests/storage/test_s3.py.)"""
    storage = MemoryStorage.named(f"memory://diskfull-{uuid.uuid4().hex}")
    cairn.save(f"{storage.url}/ckpt", state(0))

    before = storage.read("ckpt/manifest.json")

    class AfterCommit(Faulty):
        """Fails only once the new manifest (the commit) is in place."""

        def __getattr__(self, name):
            if name == self.method and storage.read("ckpt/manifest.json") == before:
                return getattr(self.inner, name)
            return super().__getattr__(name)

    faulty = AfterCommit(storage, method, errno.EIO)
    loc = Location(faulty, "ckpt", f"{storage.url}/ckpt")
    _save.prepare(loc, state(1), overwrite=True).run()  # a warning is logged; the save stands
    assert faulty.fired == 1
    assert_same(cairn.load(f"{storage.url}/ckpt"), state(1))


def test_eio_while_loading_is_a_clear_error(tmp_path, monkeypatch):
    cairn.save(tmp_path / "ckpt", state(0))
    from cairn._storage import local as _local

    read_into, read_into_many = _local._FileReader.read_into, _local._FileReader.read_into_many
    index_part_too = True

    def broken(original):
        def read(self, offset, out):
            if index_part_too or not os.path.basename(self.path).startswith("index."):
                raise OSError(errno.EIO, "Input/output error (injected)", self.path)
            return original(self, offset, out)

        return read

    monkeypatch.setattr(_local._FileReader, "read_into", broken(read_into))
    monkeypatch.setattr(_local._FileReader, "read_into_many", broken(read_into_many))
    with pytest.raises(cairn.CheckpointError, match="Input/output error") as e:
        cairn.load(tmp_path / "ckpt")
    assert str(tmp_path / "ckpt") in str(e.value) and "index part 'ckpt/params/index.p00000." in str(e.value)
    index_part_too = False  # only the data files fail: the error names the leaf
    with pytest.raises(cairn.CheckpointError, match="Input/output error") as e:
        cairn.load(tmp_path / "ckpt")
    assert str(tmp_path / "ckpt") in str(e.value) and "'params/w'" in str(e.value)

    def no_manifest(self, key):
        raise OSError(errno.EIO, "Input/output error (injected)", key)

    monkeypatch.setattr(_local.LocalStorage, "read", no_manifest)
    with pytest.raises(cairn.CheckpointError, match="manifest.json.*Input/output error"):
        cairn.load(tmp_path / "ckpt")
