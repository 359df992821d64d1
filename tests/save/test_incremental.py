"""Incremental checkpoints (format version 4): only changed blocks are written, the rest referenced.

Round trips are bitwise; references are followed on resharded loads, by
`verify`, `copy` and `inspect`; a damaged or missing base is named; retention
keeps what kept steps refer to; two real processes and a real S3 server
(moto) save and load chains; a SIGKILL during incremental saves and
retention deletions leaves every committed step loadable.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from _parts import delta_kinds
from cairn._cli.main import inspect_data
from cairn._format import manifest as fmt
from cairn._sources.verify import verify

MiB = 1 << 20


def _state(seed: int, head: float = 0.0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "backbone": rng.standard_normal((1024, 1536)).astype(ml_dtypes.bfloat16),  # 3 MiB: 3 blocks
            "head": np.full((64, 64), head, np.float32),
            "ids": np.arange(100, dtype=np.int64),
            "mask": np.arange(50) % 3 == 0,
            "blob": b"tokenizer" * 10,
        },
        "step": int(head),
    }


def _same(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _same(a[k], b[k])
        elif isinstance(a[k], np.ndarray):
            got = np.asarray(b[k])
            assert got.dtype == a[k].dtype and got.tobytes() == a[k].tobytes(), k
        else:
            assert a[k] == b[k], k


def _own_bytes(path) -> int:
    return sum(os.path.getsize(f) for f in glob.glob(f"{path}/*/*.bin"))


def test_only_changed_blocks_are_written_and_loads_are_bitwise(tmp_path):
    s0, s1, s2 = _state(0, 0.0), _state(0, 1.0), _state(0, 2.0)
    cairn.save(tmp_path / "a", s0)  # plain: no hashes, format 2
    assert json.loads((tmp_path / "a" / "manifest.json").read_bytes())["version"] == 2
    # Against a base without hashes everything is written (with hashes): the next save can compare.
    full = cairn.save(tmp_path / "b", s1, base=tmp_path / "a")
    assert full.bytes_written >= s1["params"]["backbone"].nbytes
    s2["params"]["backbone"][1000, 7] += 1  # one element of the last of three 1 MiB blocks
    inc = cairn.save(tmp_path / "c", s2, base=tmp_path / "b")
    # The changed block (one element) and the head (1.0 -> 2.0 everywhere: a constant XOR) are written as
    # deltas against b's blocks, a few dozen bytes each; ids, mask, blob are referred to.
    assert 0 < inc.bytes_written < 1024
    m = fmt.Manifest.from_json((tmp_path / "c" / "manifest.json").read_bytes(), "c")
    # One element changed: its delta is sparse, so the checkpoint is format version 5 (FORMAT.md §6.6).
    assert m.version == 5 and 1 in delta_kinds(tmp_path / "c") and m.bases == ("b",)
    _same(s2, cairn.load(tmp_path / "c"))
    _same(s1, cairn.load(tmp_path / "b"))
    report = verify(tmp_path / "c")
    assert report.ok, report.problems


def test_references_are_one_hop_and_survive_a_compressed_base(tmp_path):
    s = _state(1)
    cairn.save(tmp_path / "s0", s, base=None, compression="zstd")
    cairn.save(tmp_path / "s1", s, base=tmp_path / "s0", compression="zstd")  # a v3 base: all written
    cairn.save(tmp_path / "s2", s, base=tmp_path / "s1", compression=False)  # refers to zstd blocks
    st = cairn.save(tmp_path / "s3", s, base=tmp_path / "s2")
    assert st.bytes_written == 0
    # s3's blocks point at s1's bytes directly, never at s2 (which holds references only).
    m = fmt.Manifest.from_json((tmp_path / "s3" / "manifest.json").read_bytes(), "s3")
    assert m.bases == ("s1",)
    _same(s, cairn.load(tmp_path / "s3"))
    data = inspect_data(str(tmp_path / "s3"))
    assert data["totals"]["file_bytes"] == 0 and data["totals"]["referenced_bytes"] > 0
    assert data["bases"] == ["s1"]


def test_resharded_and_read_once_loads(tmp_path, mesh8, mesh42):
    x = np.random.default_rng(2).standard_normal((256, 2048)).astype(np.float32)  # 2 MiB
    a = jax.device_put(x, NamedSharding(mesh8, P("x")))
    cairn.save(tmp_path / "0", {"w": a, "k": jax.random.key(3)}, base=None)
    cairn.save(tmp_path / "1", {"w": a, "k": jax.random.key(3)}, base=tmp_path / "0")
    y = x.copy()
    y[255, :] = 0
    b = jax.device_put(y, NamedSharding(mesh8, P("x")))
    st = cairn.save(tmp_path / "2", {"w": b, "k": jax.random.key(3)}, base=tmp_path / "1")
    # The shards are merged into one chunk of 2 blocks: the last one changed in one row of 256 (8 KiB of
    # random floats), written as a delta against 1's block (the loads below rebuild it, resharded).
    assert 0 < st.bytes_written < 16 << 10
    for sharding in (NamedSharding(mesh42, P("y", "x")), NamedSharding(mesh42, P(None, ("x", "y"))),
                     NamedSharding(mesh8, P())):
        for read_once in (None, True):
            got = cairn.load(tmp_path / "2", {"w": sharding, "k": None}, read_once=read_once)
            assert np.asarray(got["w"]).tobytes() == y.tobytes()
    region = cairn.load(tmp_path / "2", {"w": jax.ShapeDtypeStruct((256, 2048), np.float32,
                                                                    sharding=NamedSharding(mesh42, P("x", "y")))})
    assert np.asarray(region["w"]).tobytes() == y.tobytes()


def test_damaged_or_missing_base_is_named(tmp_path):
    s = _state(4)
    cairn.save(tmp_path / "base0", s, base=None)
    cairn.save(tmp_path / "base", s, base=tmp_path / "base0")
    cairn.save(tmp_path / "next", s, base=tmp_path / "base")
    data = sorted(glob.glob(str(tmp_path / "base" / "params" / "*.bin")))[0]
    raw = bytearray(Path(data).read_bytes())
    raw[10] ^= 0x40
    Path(data).write_bytes(raw)
    with pytest.raises(cairn.CorruptCheckpointError, match=r"next: checksum mismatch in its base checkpoint 'base'"):
        cairn.load(tmp_path / "next")
    report = verify(tmp_path / "next")
    assert not report.ok and "base 'base'" in report.problems[0].message
    shutil.rmtree(tmp_path / "base")
    with pytest.raises(cairn.CorruptCheckpointError, match=r"next refers to its base checkpoint 'base'.*missing"):
        cairn.load(tmp_path / "next")
    assert any("its base checkpoint 'base'" in p.message and "missing" in p.message
               for p in verify(tmp_path / "next").problems)


@pytest.mark.parametrize("removed", ["manifest", "index"])
def test_a_base_that_is_no_longer_committed_serves_no_references(tmp_path, removed):
    """A base whose manifest.json (or its checkpointable's index) was deleted is no committed checkpoint
    (`cairn gc` would remove it): a load of a step that refers to it is refused, naming both, though
    the base's data files are still there; so are a verify and a self-contained copy."""
    s = _state(4)
    cairn.save(tmp_path / "base0", s, base=None)
    cairn.save(tmp_path / "base", s, base=tmp_path / "base0")  # (writes every block, with hashes)
    cairn.save(tmp_path / "next", s, base=tmp_path / "base")
    assert fmt.Manifest.from_json((tmp_path / "next" / "manifest.json").read_bytes(), "next").bases == ("base",)
    _same(s, cairn.load(tmp_path / "next"))
    if removed == "manifest":
        os.remove(tmp_path / "base" / "manifest.json")
        said = r"which is not a committed checkpoint: its manifest.json is missing"
    else:
        (index,) = glob.glob(str(tmp_path / "base" / "params" / "index.*.json"))
        os.remove(index)
        said = r"which is not a committed checkpoint of it: the index params/index\.[0-9a-f]+\.json .* is missing"
    assert glob.glob(str(tmp_path / "base" / "params" / "*.bin"))  # the bytes are there, and not used
    with pytest.raises(cairn.CorruptCheckpointError, match=rf"next refers to its base checkpoint 'base' .*{said}"):
        cairn.load(tmp_path / "next")
    report = verify(tmp_path / "next")
    assert not report.ok and any("base checkpoint 'base'" in p.message for p in report.problems), report.problems
    with pytest.raises(cairn.CheckpointError, match="base"):
        cairn.copy(tmp_path / "next", tmp_path / "copy")


def test_bad_bases_are_refused(tmp_path):
    s = _state(5)
    with pytest.raises(cairn.CheckpointError, match="not committed"):
        cairn.save(tmp_path / "x", s, base=tmp_path / "nothing")
    assert not (tmp_path / "x").exists()
    (tmp_path / "sub").mkdir()
    cairn.save(tmp_path / "sub" / "a", s)
    with pytest.raises(ValueError, match="same folder"):
        cairn.save(tmp_path / "y", s, base=tmp_path / "sub" / "a")
    with pytest.raises(ValueError, match="its own base"):
        cairn.save(tmp_path / "z", s, base=tmp_path / "z")


def test_copy_is_self_contained(tmp_path):
    s = _state(6, 3.0)
    cairn.save(tmp_path / "a", s, base=None)
    cairn.save(tmp_path / "b", s, base=tmp_path / "a")
    cairn.save(tmp_path / "c", s, base=tmp_path / "b")
    cairn.copy(tmp_path / "c", tmp_path / "copy")
    with pytest.raises(cairn.CheckpointError, match="move=True"):
        cairn.copy(tmp_path / "c", tmp_path / "moved", move=True)
    for name in ("a", "b", "c"):
        shutil.rmtree(tmp_path / name)
    _same(s, cairn.load(tmp_path / "copy"))
    assert verify(tmp_path / "copy").ok


def _mgr_state(step: int) -> dict:
    rng = np.random.default_rng(7)
    frozen = rng.standard_normal((512, 1024)).astype(np.float32)  # 2 MiB, never changes
    return {"params": {"frozen": frozen, "head": np.full((128,), step, np.float32)}, "step": step}


def test_manager_retention_keeps_referenced_steps(tmp_path):
    with cairn.CheckpointManager(tmp_path, max_to_keep=2, incremental=True, full_every=3) as mgr:
        for step in range(8):
            mgr.save(step, _mgr_state(step))
        mgr.wait()
        # Saves 0, 3, 6 are self-contained; 7 refers to 6, which is newest-but-one anyway.
        assert mgr.steps() == [6, 7]
        bases = {s: fmt.Manifest.from_json((tmp_path / f"step_{s:08d}" / "manifest.json").read_bytes(), "m").bases
                 for s in mgr.steps()}
        assert bases == {6: (), 7: ("step_00000006",)}
        for step in range(8, 10):
            mgr.save(step, _mgr_state(step))
        mgr.wait()
        # 8 and 9 refer to 6 (one hop): it stays although max_to_keep=2.
        assert mgr.steps() == [6, 8, 9]
        for step in mgr.steps():
            _same(_mgr_state(step), mgr.restore(step))
        with pytest.raises(cairn.CheckpointError, match=r"step 6 holds data that steps 8-9|step 6 holds data"):
            mgr.delete(6)
        mgr.delete(9)
        mgr.delete(8)
        mgr.delete(6)  # nobody refers to it now
        assert mgr.steps() == []


def test_manager_falls_back_to_a_full_save_without_its_base(tmp_path):
    with cairn.CheckpointManager(tmp_path, incremental=True, async_save=False) as mgr:
        mgr.save(0, _mgr_state(0))
        shutil.rmtree(tmp_path / "step_00000000")  # gone behind the manager's back
        mgr.save(1, _mgr_state(1))
        assert fmt.Manifest.from_json((tmp_path / "step_00000001" / "manifest.json").read_bytes(), "m").bases == ()
        _same(_mgr_state(1), mgr.restore(1))


def test_s3_chain(s3):
    bucket = s3.new_bucket()
    opts = s3.options(part_size=5 * MiB, read_part_size=1 * MiB)
    root = f"s3://{bucket}/run"
    with cairn.CheckpointManager(root, storage_options=opts, incremental=True, max_to_keep=1) as mgr:
        for step in range(3):
            mgr.save(step, _mgr_state(step))
        mgr.wait()
        assert mgr.steps() == [0, 2]  # 2 refers to 0's frozen bytes (1 was deleted: nobody refers to it)
        _same(_mgr_state(2), mgr.restore(2))
    _same(_mgr_state(2), cairn.load(f"{root}/step_00000002", storage_options=opts))
    assert verify(f"{root}/step_00000002", storage_options=opts).ok
    st = cairn.save(f"{root}/extra", _mgr_state(2), storage_options=opts, base=f"{root}/step_00000002",
                    compression=False)
    assert st.bytes_written == 0 and st.files_written == 0
    _same(_mgr_state(2), cairn.load(f"{root}/extra", storage_options=opts))
    from cairn._storage.location import resolve

    loc = resolve(f"{root}/extra", opts)
    assert [k for k in loc.storage.list(loc.name) if k.endswith(".bin")] == []  # not even empty data files
    assert verify(f"{root}/extra", storage_options=opts).ok


@pytest.mark.slow
def test_two_processes(tmp_path):
    from _mp import run

    out = run(2, "incremental_scenarios:chain", {"directory": str(tmp_path)}, devices_per_process=2, timeout=240)
    assert all(r["ok"] for r in out), out
    # 8 MiB in 8 blocks; one row of process 0's first block changed: it writes that block as a delta against
    # the base's (a few hundred bytes), process 1 nothing.
    assert all(r["full_bytes"] == 8 * MiB and 0 < r["incremental_bytes"] < 4096 for r in out), out
    assert out[0]["own_bytes"] == out[0]["incremental_bytes"] and out[1]["own_bytes"] == 0, out
    assert [r["kept"] for r in out] == [0, 0], out  # (`_save.basecache`: single-process commits only)
    # This process (one, four devices fewer) loads what two processes wrote.
    want = np.arange(4 * 2048 * 256, dtype=np.float32).reshape(4 * 2048, 256)
    want[0, :] = 2
    got = cairn.load(tmp_path / "step_00000002")
    assert got["w"].tobytes() == want.tobytes()
    assert verify(tmp_path / "step_00000002").ok


SAVER = textwrap.dedent(
    """
    import sys, numpy as np, cairn
    directory, mode = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(0)
    frozen = {f"w{i}": rng.standard_normal((512, 1024)).astype(np.float32) for i in range(12)}
    if mode == "async-jax":  # unchanged jax.Arrays: decided before each snapshot, never copied
        import jax
        frozen = {k: jax.numpy.asarray(v) for k, v in frozen.items()}
    print("ready", flush=True)
    with cairn.CheckpointManager(directory, max_to_keep=2, incremental=True, full_every=3,
                                 async_save=mode == "async-jax") as mgr:
        for step in range(1000):
            mgr.save(step, {"frozen": frozen, "head": np.full((256, 1024), step, np.float32), "step": step})
            print("saved", step, flush=True)
            if mode == "async-jax" and step % 2:  # the next save finds its base committed: it decides
                mgr.wait()
    """
)


def _expected(step: int) -> dict:
    rng = np.random.default_rng(0)
    frozen = {f"w{i}": rng.standard_normal((512, 1024)).astype(np.float32) for i in range(12)}
    return {"frozen": frozen, "head": np.full((256, 1024), step, np.float32), "step": step}


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "after"), [("sync-numpy", 3), ("sync-numpy", 5), ("sync-numpy", 7),
                                             ("async-jax", 4), ("async-jax", 7)])
def test_sigkill_during_incremental_saves_and_retention(tmp_path, mode, after):
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path / "run"), mode], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    # An async save returns before it commits; once save `after + 2` has returned, `after` has committed
    # (at most two async saves are pending at once).
    wait_for = after if mode.startswith("sync") else after + 2
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # kill at a different point of the loop for each `after`
            line = proc.stdout.readline()
            if line.startswith("saved") and int(line.split()[1]) >= wait_for:
                break
        time.sleep(0.01 * after)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    mgr = cairn.CheckpointManager(tmp_path / "run", read_only=True)
    steps = mgr.steps()
    assert steps and steps[-1] >= after
    for step in steps:
        _same(_expected(step), mgr.restore(step))
        assert verify(mgr.path(step)).ok
    # A manager opened again cleans up, and carries on incrementally.
    with cairn.CheckpointManager(tmp_path / "run", max_to_keep=2, incremental=True, full_every=3) as mgr2:
        mgr2.save(steps[-1] + 1, _expected(steps[-1] + 1))
        mgr2.save(steps[-1] + 2, _expected(steps[-1] + 2))
        mgr2.wait()
        for step in mgr2.steps():
            _same(_expected(step), mgr2.restore(step))


# ------------------------------------------------------------------------- the v4 golden (tests/golden/v4)

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "v4", "chain")


def _golden_state(step: int) -> dict:
    """tests/golden/make_golden_v4.py's values, written out again."""
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    if step >= 2:
        w[40, :] = -2.0
    if step >= 3:
        w[3, :] = -3.0
    emb = (np.arange(128 * 64) % 251).astype(ml_dtypes.bfloat16).reshape(128, 64)
    return {"params": {"w": w, "emb": emb, "ids": np.arange(10, dtype=np.int32)}, "step": step}


@pytest.mark.parametrize("step", [1, 2, 3])
def test_golden_v4_loads_exactly(step, mesh8):
    path = os.path.join(GOLDEN, f"step_{step:08d}")
    _same(_golden_state(step), cairn.load(path))
    got = cairn.load(path, {"params": {"w": NamedSharding(mesh8, P(None, "x")), "emb": NamedSharding(mesh8, P("x")),
                                       "ids": None}})
    assert np.asarray(got["params"]["w"]).tobytes() == _golden_state(step)["params"]["w"].tobytes()
    assert verify(path).ok
    m = fmt.Manifest.from_json(Path(path, "manifest.json").read_bytes(), path)
    assert m.version == 4 and m.bases == {1: (), 2: ("step_00000001",), 3: ("step_00000001", "step_00000002")}[step]


def test_golden_v4_base_damage_is_named(tmp_path):
    shutil.copytree(GOLDEN, tmp_path / "chain")
    data = sorted(glob.glob(str(tmp_path / "chain" / "step_00000001" / "params" / "*.bin")))
    for f in data:  # every data file of step 1, one at a time: step 3 refers to each
        original = Path(f).read_bytes()
        Path(f).write_bytes(bytes(b ^ 1 for b in original))  # every block, so each one step 3 refers to
        with pytest.raises(cairn.CorruptCheckpointError, match="step_00000003.*'step_00000001'"):
            cairn.load(tmp_path / "chain" / "step_00000003")
        Path(f).write_bytes(original)
    _same(_golden_state(3), cairn.load(tmp_path / "chain" / "step_00000003"))


def test_save_async_metadata_and_plan(tmp_path, mesh8):
    x = np.random.default_rng(8).standard_normal((512, 1024)).astype(np.float32)
    cairn.save(tmp_path / "a", {"w": x, "b": np.ones(4)}, base=None)
    cairn.save_async(tmp_path / "b", {"w": x, "b": np.ones(4)}, base=tmp_path / "a").result()
    fut = cairn.save_async(tmp_path / "c", {"w": x, "b": np.ones(4) * 2}, base=tmp_path / "b")
    assert fut.result().bytes_written == 32  # `b`'s one block; `w` refers to a's bytes
    assert cairn.metadata(tmp_path / "c")["w"].shape == (512, 1024)
    plan = cairn.plan_load(tmp_path / "c", {"w": NamedSharding(mesh8, P("x")), "b": None})
    assert plan.bytes_read >= x.nbytes  # referred-to blocks are read like own ones (from the base's file)
    got = cairn.load(tmp_path / "c", {"w": NamedSharding(mesh8, P("x")), "b": None})
    assert np.asarray(got["w"]).tobytes() == x.tobytes() and got["b"].tobytes() == (np.ones(4) * 2).tobytes()


def test_part_v4_columns_are_checksummed(tmp_path):
    """A flipped byte in a version-4 part's hash or source column is corruption, named, never a wrong read."""
    from cairn._format.partfile import PART_VERSION_BLOCKS, block_columns, decode_part

    shutil.copytree(GOLDEN, tmp_path / "chain")
    step = tmp_path / "chain" / "step_00000003"
    part = next((step / "params").glob("index.p*.idx"))
    data = part.read_bytes()
    decode_part(data, "part", PART_VERSION_BLOCKS)  # every checksum holds
    hashes, sources = block_columns(data, PART_VERSION_BLOCKS)
    assert len(hashes) == 16 * len(sources) and sources["file"].tolist().count(0xFFFFFFFF) == 1  # w's block 0
    for at in (len(data) - 16 * len(sources) - 3,  # a hash byte
               len(data) - 8):  # a source's offset byte
        flipped = bytearray(data)
        flipped[at] ^= 1
        part.write_bytes(bytes(flipped))
        with pytest.raises(cairn.CorruptCheckpointError, match="do not match their checksum"):
            cairn.load(step)
        with pytest.raises(cairn.CorruptCheckpointError):
            decode_part(bytes(flipped), "part", PART_VERSION_BLOCKS)
    part.write_bytes(data)
    _same(_golden_state(3), cairn.load(step))


def test_retention_deletes_newest_first_so_a_crash_between_deletions_leaves_no_dangling_base(tmp_path, monkeypatch):
    """Steps 1 and 2 refer to step 0; keeping only step 4 (a full step) dooms 0 to 3. A crash after
    the first deletion must leave every committed step loadable: so the referrers go first."""
    from cairn._run import steps as steps_mod

    run = tmp_path / "run"
    with cairn.CheckpointManager(run, incremental=True, full_every=3, async_save=False) as mgr:
        for step in range(4):
            mgr.save(step, _expected(step))
    deleted: list[int] = []
    real = steps_mod.delete_step

    def crash_after_one(storage, step, folder=None):
        if deleted:
            raise OSError("simulated crash between two deletions")
        deleted.append(step)
        real(storage, step, folder)

    monkeypatch.setattr(steps_mod, "delete_step", crash_after_one)
    # (a failed retention pass is logged, not raised: the save itself committed)
    with cairn.CheckpointManager(run, max_to_keep=1, incremental=True, full_every=3, async_save=False) as mgr:
        mgr.save(4, _expected(4))
        mgr.wait()
    # (a reopened manager's first save is self-contained: step 4 keeps nothing else)
    assert deleted == [3], deleted  # the newest doomed step first
    monkeypatch.setattr(steps_mod, "delete_step", real)
    reader = cairn.CheckpointManager(run, read_only=True)
    assert reader.steps() == [0, 1, 2, 4]
    for step in reader.steps():
        _same(_expected(step), reader.restore(step))


# ---------------------------------------------------------------------- deltas (slowly changing leaves)


def _nudged(x: np.ndarray, frac: float, seed: int) -> np.ndarray:
    """A copy of bf16 `x` with `frac` of its elements moved to the next bf16 value (an lr-1e-6 step's kind
    of change: few elements, spread over every block)."""
    rng = np.random.default_rng(seed)
    y = x.copy()
    bits = y.view(np.uint16).reshape(-1)
    at = rng.choice(bits.size, size=int(bits.size * frac), replace=False)
    bits[at] += 1
    return y


def _codecs_of(step: Path) -> list[int]:
    """The codec ids of every block source in a checkpoint's parts."""
    from cairn._format.partfile import PART_VERSION_BLOCKS, block_columns

    out: list[int] = []
    for part in step.glob("*/index.p*.idx"):
        out += block_columns(part.read_bytes(), PART_VERSION_BLOCKS)[1]["codec"].tolist()
    return out


def _hashed(path: Path, state: dict, **kw) -> None:
    """A self-contained version-4 save (with hashes) of `state` at `path`: against a plain save beside it."""
    cairn.save(path.with_name(path.name + "_plain"), state, **kw)
    cairn.save(path, state, base=path.with_name(path.name + "_plain"), **kw)
    shutil.rmtree(path.with_name(path.name + "_plain"))


def _bf16(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1024, 2048)).astype(ml_dtypes.bfloat16)  # 4 MiB: 4 blocks


def test_deltas_store_a_slowly_changing_bf16_leaf_in_a_fraction_of_its_bytes(tmp_path, mesh8, mesh42):
    from cairn._format.blocks import DELTA

    w0 = _bf16(7)
    w1 = _nudged(w0, 0.005, 8)
    assert (w1 != w0).any() and all((w1[r : r + 256] != w0[r : r + 256]).any() for r in range(0, 1024, 256))
    _hashed(tmp_path / "s0", {"w": w0})
    st = cairn.save(tmp_path / "s1", {"w": w1}, base=tmp_path / "s0")
    assert 0 < st.bytes_written <= 0.1 * w1.nbytes, st.bytes_written  # every block changed, each a delta
    assert _codecs_of(tmp_path / "s1").count(DELTA) == 4
    assert np.asarray(cairn.load(tmp_path / "s1")["w"]).tobytes() == w1.tobytes()
    for sharding in (NamedSharding(mesh42, P("y", "x")), NamedSharding(mesh8, P(None, "x"))):
        for read_once in (None, True):
            got = cairn.load(tmp_path / "s1", {"w": sharding}, read_once=read_once)
            assert np.asarray(got["w"]).tobytes() == w1.tobytes()
    assert verify(tmp_path / "s1").ok
    data = inspect_data(str(tmp_path / "s1"))
    assert data["totals"]["file_bytes"] == st.bytes_written


def test_deltas_that_do_not_pay_are_not_kept(tmp_path):
    w0 = _bf16(9)
    _hashed(tmp_path / "s0", {"w": w0})
    w1 = _bf16(10)  # every value changes: an XOR of unrelated values codes no smaller than the block
    st = cairn.save(tmp_path / "s1", {"w": w1}, base=tmp_path / "s0")
    assert st.bytes_written == w1.nbytes and set(_codecs_of(tmp_path / "s1")) == {0}
    assert np.asarray(cairn.load(tmp_path / "s1")["w"]).tobytes() == w1.tobytes()


def test_deltas_are_not_tried_where_the_incremental_base_found_they_did_not_pay(tmp_path, monkeypatch):
    import cairn._save.incremental as inc

    tried: list[int] = []
    real = inc._try_delta
    monkeypatch.setattr(inc, "_try_delta", lambda *a: tried.append(1) or real(*a))
    frozen = _bf16(17)  # unchanged: s1 refers to s0 for it, so s1 is incremental, not self-contained
    _hashed(tmp_path / "s0", {"w": _bf16(9), "frozen": frozen})
    cairn.save(tmp_path / "s1", {"w": _bf16(10), "frozen": frozen}, base=tmp_path / "s0")  # samples, none pays
    assert tried and set(_codecs_of(tmp_path / "s1")) == {0}
    tried.clear()
    w2 = _nudged(_bf16(10), 0.005, 16)
    cairn.save(tmp_path / "s2", {"w": w2, "frozen": frozen}, base=tmp_path / "s1")  # s1 stored w's blocks as such
    assert not tried and set(_codecs_of(tmp_path / "s2")) == {0}
    assert np.asarray(cairn.load(tmp_path / "s2")["w"]).tobytes() == w2.tobytes()


def test_delta_chains_stay_one_hop_and_copy_self_contained(tmp_path):
    from cairn._format.blocks import DELTA

    w0 = _bf16(11)
    w1 = _nudged(w0, 0.005, 12)
    w2 = w1.copy()
    w2[:256] = _nudged(w1[:256], 0.005, 13)  # block 0 changes again; blocks 1-3 as in step 1
    _hashed(tmp_path / "s0", {"w": w0}, compression="zstd")  # a coded base: deltas decode it
    cairn.save(tmp_path / "s1", {"w": w1}, base=tmp_path / "s0")
    cairn.save(tmp_path / "s2", {"w": w2}, base=tmp_path / "s1")
    # Step 2's deltas (block 0 new, blocks 1-3 step 1's copied) are all against step 0's blocks.
    m = fmt.Manifest.from_json((tmp_path / "s2" / "manifest.json").read_bytes(), "s2")
    assert m.bases == ("s0",)
    assert _codecs_of(tmp_path / "s2").count(DELTA) == 4
    assert np.asarray(cairn.load(tmp_path / "s2")["w"]).tobytes() == w2.tobytes()
    cairn.copy(tmp_path / "s2", tmp_path / "copy")
    shutil.rmtree(tmp_path / "s1")  # step 2 never needs step 1
    assert np.asarray(cairn.load(tmp_path / "s2")["w"]).tobytes() == w2.tobytes()
    assert verify(tmp_path / "s2").ok
    shutil.rmtree(tmp_path / "s0")
    assert np.asarray(cairn.load(tmp_path / "copy")["w"]).tobytes() == w2.tobytes()
    assert set(_codecs_of(tmp_path / "copy")) <= {0, 1, 2} and verify(tmp_path / "copy").ok


def test_damaged_deltas_and_damaged_delta_bases_are_named(tmp_path):
    w0 = _bf16(14)
    _hashed(tmp_path / "s0", {"w": w0})
    cairn.save(tmp_path / "s1", {"w": _nudged(w0, 0.005, 15)}, base=tmp_path / "s0")
    # A flipped byte in a delta block of step 1 (its own data file holds only deltas).
    (own,) = glob.glob(str(tmp_path / "s1" / "*" / "*.bin"))
    original = Path(own).read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x10
    Path(own).write_bytes(bytes(flipped))
    report = verify(tmp_path / "s1")
    assert not report.ok and "CRC-32C" in report.problems[0].message
    with pytest.raises(cairn.CorruptCheckpointError, match="s1: checksum mismatch"):
        cairn.load(tmp_path / "s1")
    Path(own).write_bytes(original)
    # A flipped byte in the base block a delta is against: the error names both checkpoints.
    (base,) = glob.glob(str(tmp_path / "s0" / "*" / "*.bin"))
    flipped = bytearray(Path(base).read_bytes())
    flipped[5] ^= 0x01
    Path(base).write_bytes(bytes(flipped))
    with pytest.raises(cairn.CorruptCheckpointError, match=r"s1: .*a delta against its base checkpoint 's0'"):
        cairn.load(tmp_path / "s1")
    report = verify(tmp_path / "s1")
    assert not report.ok and "base 's0'" in report.problems[0].message


GOLDEN_DELTA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "v4", "delta")


def _golden_delta_state(step: int) -> dict:
    """tests/golden/make_golden_v4_delta.py's values, written out again."""
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    emb = (np.arange(128 * 64) % 251).astype(ml_dtypes.bfloat16).reshape(128, 64)
    if step >= 2:
        w[40, :] += 0.5
        emb[5, :4] = 7
    if step >= 3:
        w[3, :] += 0.25
    return {"params": {"w": w, "emb": emb}, "step": step}


@pytest.mark.parametrize("step", [1, 2, 3])
def test_golden_v4_deltas_load_exactly(step, mesh8):
    from cairn._format.blocks import DELTA

    path = Path(GOLDEN_DELTA, f"step_{step:08d}")
    _same(_golden_delta_state(step), cairn.load(path))
    got = cairn.load(path, {"params": {"w": NamedSharding(mesh8, P(None, "x")), "emb": NamedSharding(mesh8, P("x"))}})
    assert np.asarray(got["params"]["w"]).tobytes() == _golden_delta_state(step)["params"]["w"].tobytes()
    assert verify(path).ok
    # Step 2: w's block 2 and emb's block 0 are deltas against step 1's (planes-coded) blocks; step 3 adds w's
    # block 0 and copies step 2's delta of block 2, all against step 1 (one hop).
    assert _codecs_of(path).count(DELTA) == {1: 0, 2: 2, 3: 3}[step]
    m = fmt.Manifest.from_json(Path(path, "manifest.json").read_bytes(), str(path))
    assert m.bases == {1: (), 2: ("step_00000001",), 3: ("step_00000001",)}[step]


def test_manager_keeps_the_full_step_its_deltas_are_against(tmp_path):
    from cairn._format.blocks import DELTA

    ws = [_bf16(20)]
    for s in range(1, 4):
        ws.append(_nudged(ws[-1], 0.005, 20 + s))
    with cairn.CheckpointManager(tmp_path, max_to_keep=1, incremental=True, full_every=10) as mgr:
        for step, w in enumerate(ws):
            mgr.save(step, {"w": w})
        mgr.wait()
        # Step 0 is the full step every later delta is against (one hop): kept, although max_to_keep=1.
        assert mgr.steps() == [0, 3]
        m = fmt.Manifest.from_json((tmp_path / "step_00000003" / "manifest.json").read_bytes(), "m")
        assert m.bases == ("step_00000000",) and _codecs_of(tmp_path / "step_00000003").count(DELTA) == 4
        assert np.asarray(mgr.restore(3)["w"]).tobytes() == ws[3].tobytes()
        with pytest.raises(cairn.CheckpointError, match="step 0 holds data"):
            mgr.delete(0)


# ---------------------------------------------------------------------- sparse deltas (few elements change)


def _poked(x: np.ndarray, at: list[int]) -> np.ndarray:
    """A copy of `x` with the elements at flat positions `at` changed (their lowest bit flipped)."""
    y = x.copy()
    bits = y.reshape(-1).view(f"<u{x.dtype.itemsize}")
    bits[at] ^= 1
    return y


@pytest.mark.parametrize("dtype", [np.uint8, ml_dtypes.bfloat16, np.float32, np.float64])
def test_sparse_deltas_round_trip_for_each_element_size(tmp_path, dtype, mesh8):
    rng = np.random.default_rng(30)
    w0 = rng.standard_normal((512, 1024)).astype(dtype)  # 1, 2, 4 or 8 blocks of 1 MiB
    at = [0, 1, 77, w0.size // 2, w0.size - 1]  # a few elements, the first and last among them
    w1 = _poked(w0, at)
    _hashed(tmp_path / "s0", {"w": w0})
    st = cairn.save(tmp_path / "s1", {"w": w1}, base=tmp_path / "s0")
    blocks = -(-w0.nbytes // MiB)
    assert _codecs_of(tmp_path / "s1").count(3) == len({a * w0.itemsize // MiB for a in at})
    assert set(delta_kinds(tmp_path / "s1")) == {1}  # sparse
    assert st.bytes_written < 64 * blocks, st.bytes_written  # a header and a few bytes of zstd per delta
    assert np.asarray(cairn.load(tmp_path / "s1")["w"]).tobytes() == w1.tobytes()
    got = cairn.load(tmp_path / "s1", {"w": NamedSharding(mesh8, P(None, "x"))})
    assert np.asarray(got["w"]).tobytes() == w1.tobytes()
    assert verify(tmp_path / "s1").ok


def test_sparse_deltas_rebuild_against_a_coded_base_and_chain_one_hop(tmp_path):
    w0 = _bf16(31)
    w1 = _poked(w0, [5, 600_000])  # blocks 0 and 1 (of 4, 512 Ki elements each)
    w2 = _poked(w1, [1_500_000])  # block 2; blocks 0 and 1 as in step 1
    _hashed(tmp_path / "s0", {"w": w0}, compression="planes")
    cairn.save(tmp_path / "s1", {"w": w1}, base=tmp_path / "s0")
    cairn.save(tmp_path / "s2", {"w": w2}, base=tmp_path / "s1")
    assert delta_kinds(tmp_path / "s2") == [1, 1, 1]
    shutil.rmtree(tmp_path / "s1")  # step 2's deltas (step 1's copied, one new) are all against step 0
    assert np.asarray(cairn.load(tmp_path / "s2")["w"]).tobytes() == w2.tobytes()
    assert verify(tmp_path / "s2").ok


def test_xor_deltas_stay_where_they_store_far_less(tmp_path):
    w0 = _bf16(32)
    # A run of 50,000 elements of every 1 MiB block with the lowest bit flipped: their XOR (01 00 repeated)
    # codes to almost nothing, their new values (random) to 2 bytes each.
    w1 = _poked(w0, [e for b in range(0, w0.size, 1 << 19) for e in range(b, b + 50_000)])
    _hashed(tmp_path / "s0", {"w": w0})
    cairn.save(tmp_path / "s1", {"w": w1}, base=tmp_path / "s0")
    assert set(delta_kinds(tmp_path / "s1")) == {0}
    assert np.asarray(cairn.load(tmp_path / "s1")["w"]).tobytes() == w1.tobytes()


def test_a_sparse_delta_never_has_the_size_an_old_reader_would_take_for_an_xor_frame():
    # A cairn before sparse deltas decodes any delta's frame as an XOR frame of the block's raw size; it
    # rejects every other declared size, so the writer never makes a sparse content of exactly that size.
    from cairn._codecs import codecs as _codecs
    from cairn._save.incremental import _sparse_frame

    base = np.zeros(2048, np.uint16)  # a 4 KiB block of bf16: 4 + 682 * 6 == 4096
    for n, sparse in ((681, True), (682, False)):
        new = base.copy()
        new[: 3 * n : 3] = 1
        xor = (new ^ base).view(np.uint8)
        frame = _sparse_frame(new.view(np.uint8), xor, ml_dtypes.bfloat16)
        assert (frame is not None) == sparse
    new = base.copy()
    new[:3] = 1
    frame = _sparse_frame(new.view(np.uint8), (new ^ base).view(np.uint8), ml_dtypes.bfloat16)
    assert frame is not None
    with pytest.raises(cairn.CorruptCheckpointError, match="declares 22 decompressed bytes"):
        _codecs.decode("zstd", frame, np.uint8, 4096, np.empty(4096, np.uint8))  # what an old reader does


def test_verify_finds_a_flipped_byte_in_a_sparse_delta(tmp_path):
    w0 = _bf16(34)
    _hashed(tmp_path / "s0", {"w": w0})
    cairn.save(tmp_path / "s1", {"w": _poked(w0, [10, 2_000_000])}, base=tmp_path / "s0")
    assert set(delta_kinds(tmp_path / "s1")) == {1} and verify(tmp_path / "s1").ok
    (own,) = glob.glob(str(tmp_path / "s1" / "*" / "*.bin"))
    flipped = bytearray(Path(own).read_bytes())
    flipped[-3] ^= 0x04
    Path(own).write_bytes(bytes(flipped))
    report = verify(tmp_path / "s1")
    assert not report.ok and "CRC-32C" in report.problems[0].message
    with pytest.raises(cairn.CorruptCheckpointError, match="s1: checksum mismatch"):
        cairn.load(tmp_path / "s1")


GOLDEN_SPARSE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "v4", "sparse")


def _golden_sparse_state(step: int) -> dict:
    """tests/golden/make_golden_v4_sparse.py's values, written out again."""
    u8 = (np.arange(128 * 128) % 7).astype(np.uint8).reshape(128, 128)
    bf = (np.arange(64 * 128) % 251).astype(ml_dtypes.bfloat16).reshape(64, 128)
    f32 = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    f64 = np.arange(32 * 64, dtype=np.float64).reshape(32, 64)
    if step >= 2:
        u8[40, [0, 3, 100]] = 200
        bf[20, [1, 2, 90]] = -1.5
        f32[20, [0, 63]] = -7.25
        f64[10, [5, 6, 7]] = 1e300
    if step >= 3:
        u8[127, 127] = 255
        bf[60, 0] = 3.0
        f32[60, 10] = 0.5
        f64[31, 63] = -0.0
    return {"params": {"u8": u8, "bf16": bf, "f32": f32, "f64": f64}, "step": step}


@pytest.mark.parametrize("step", [1, 2, 3])
def test_golden_v4_sparse_deltas_load_exactly(step, mesh8):
    path = Path(GOLDEN_SPARSE, f"step_{step:08d}")
    want = _golden_sparse_state(step)
    _same(want, cairn.load(path))
    got = cairn.load(path, {"params": {k: NamedSharding(mesh8, P("x")) for k in want["params"]}})
    for k, v in want["params"].items():
        assert np.asarray(got["params"][k]).tobytes() == v.tobytes(), k
    assert verify(path).ok
    # Step 2: block 1 of each leaf is a sparse delta against step 1's (planes-coded) block; step 3 adds
    # block 3 and copies step 2's, all against step 1 (one hop). f64's block 3 changed one value in all its
    # 8 bytes: its XOR frame stores less, so it is an XOR delta (kind 0) beside the sparse ones.
    assert _codecs_of(path).count(3) == {1: 0, 2: 4, 3: 8}[step]
    assert delta_kinds(path) == {1: [], 2: [1] * 4, 3: [1] * 7 + [0]}[step]
    m = fmt.Manifest.from_json(Path(path, "manifest.json").read_bytes(), str(path))
    assert m.version == 4 and m.bases == {1: (), 2: ("step_00000001",), 3: ("step_00000001",)}[step]


# ------------------------------------------------------------------ copies that keep their references


def _chain(root: Path) -> dict[str, dict]:
    """a (self-contained, hashed) <- b (refers to a) <- c (refers to b only): c's closure is {a, b}."""
    rng = np.random.default_rng(21)
    f1, f2 = (rng.standard_normal((512, 1024)).astype(np.float32) for _ in range(2))  # 2 MiB each
    h1, h2 = (rng.standard_normal((256, 1024)).astype(np.float32) for _ in range(2))  # 1 MiB each
    states = {"a": {"frozen": f1, "head": h1}, "b": {"frozen": f2, "head": h1}, "c": {"frozen": f2, "head": h2}}
    _hashed(root / "a", states["a"])
    cairn.save(root / "b", states["b"], base=root / "a")
    cairn.save(root / "c", states["c"], base=root / "b")
    return states


def test_copy_keeping_references_copies_the_chain_as_is(tmp_path, capsys):
    states = _chain(tmp_path / "run")
    bases = {n: fmt.Manifest.from_json((tmp_path / "run" / n / "manifest.json").read_bytes(), n).bases for n in "bc"}
    assert bases == {"b": ("a",), "c": ("b",)}
    stats = cairn.copy(tmp_path / "run" / "c", tmp_path / "dst" / "c2", keep_references=True)
    assert stats.bases == ("a", "b")  # b's base too: every copy loads
    assert sorted(os.listdir(tmp_path / "dst")) == ["a", "b", "c2"]
    # As is: the copy keeps its references (its own files hold only the new head's block).
    assert _own_bytes(tmp_path / "dst" / "c2") == _own_bytes(tmp_path / "run" / "c") < 2 * MiB
    assert fmt.Manifest.from_json((tmp_path / "dst" / "c2" / "manifest.json").read_bytes(), "c2").bases == ("b",)
    shutil.rmtree(tmp_path / "run")
    for name, want in (("a", "a"), ("b", "b"), ("c2", "c")):
        _same(states[want], cairn.load(tmp_path / "dst" / name))
        assert verify(tmp_path / "dst" / name).ok
    # A second chain copy into the same folder finds its bases there: checked, kept, not written again.
    cairn.copy(tmp_path / "dst" / "c2", tmp_path / "dst2" / "c", keep_references=True)
    again = cairn.copy(tmp_path / "dst" / "c2", tmp_path / "dst2" / "c3", keep_references=True)
    assert again.bases == ("a", "b") and again.files_kept >= 4 and again.bytes_copied < 2 * MiB
    _same(states["c"], cairn.load(tmp_path / "dst2" / "c3"))
    # The command line, and a copy within one folder (its bases are already beside it).
    from cairn._cli.main import main

    assert main(["--plain", "cp", "--keep-references", str(tmp_path / "dst2" / "c3"), str(tmp_path / "dst3" / "c")]) == 0
    assert "with its bases a, b" in capsys.readouterr().out
    _same(states["c"], cairn.load(tmp_path / "dst3" / "c"))
    same = cairn.copy(tmp_path / "dst3" / "c", tmp_path / "dst3" / "d", keep_references=True)
    assert same.bases == () and sorted(os.listdir(tmp_path / "dst3")) == ["a", "b", "c", "d"]
    _same(states["c"], cairn.load(tmp_path / "dst3" / "d"))


def test_copy_keeping_references_refuses_what_it_cannot_resolve(tmp_path):
    _chain(tmp_path / "run")
    # Another checkpoint under a base's name at the destination: refused, naming it; nothing else written.
    cairn.save(tmp_path / "dst" / "a", {"other": np.zeros(3)})
    with pytest.raises(cairn.CheckpointExistsError, match=r"dst/a holds another checkpoint than .*run/a, which "
                                                           r".*run/c refers to"):
        cairn.copy(tmp_path / "run" / "c", tmp_path / "dst" / "c", keep_references=True)
    assert sorted(os.listdir(tmp_path / "dst")) == ["a"]
    # The destination's own name is a base's name.
    with pytest.raises(cairn.CheckpointError, match="refers to a base checkpoint of that name"):
        cairn.copy(tmp_path / "run" / "c", tmp_path / "dst2" / "b", keep_references=True)
    assert not (tmp_path / "dst2").exists()
    with pytest.raises(ValueError, match="keep_references"):
        cairn.copy(tmp_path / "run" / "c", tmp_path / "dst2" / "c", keep_references=True, move=True)
    with pytest.raises(ValueError, match="keep_references"):
        cairn.copy(tmp_path / "run" / "c", tmp_path / "dst2" / "c", keep_references=True, compression="zstd")
    # A base missing beside the source (b's base a, found through b): refused before anything is written.
    shutil.rmtree(tmp_path / "run" / "a")
    with pytest.raises(cairn.CorruptCheckpointError, match=r"run/b refers to the base checkpoint 'a', which is "
                                                           r"not committed at .*run/a"):
        cairn.copy(tmp_path / "run" / "c", tmp_path / "dst3" / "c", keep_references=True)
    assert not (tmp_path / "dst3").exists()


def test_plain_copy_of_a_self_contained_v4_step(tmp_path):
    """A hashed full step (a manager's every `full_every`-th) has no bases: copied as it is, hashes and all."""
    states = _chain(tmp_path / "run")
    cairn.copy(tmp_path / "run" / "a", tmp_path / "dst" / "a")
    _same(states["a"], cairn.load(tmp_path / "dst" / "a"))
    assert (tmp_path / "dst" / "a" / "manifest.json").read_bytes() == (tmp_path / "run" / "a" / "manifest.json").read_bytes()
    # ... and an incremental save can use the copy as its base.
    cairn.save(tmp_path / "dst" / "b", states["b"], base=tmp_path / "dst" / "a")
    _same(states["b"], cairn.load(tmp_path / "dst" / "b"))


def test_inspect_shows_own_bytes_beside_references_and_delta_bases(tmp_path, capsys):
    from cairn._cli.main import main

    w0 = _bf16(31)
    frozen = np.random.default_rng(32).standard_normal((256, 1024)).astype(np.float32)  # 1 MiB, unchanged
    _hashed(tmp_path / "s0", {"w": w0, "frozen": frozen})
    st = cairn.save(tmp_path / "s1", {"w": _nudged(w0, 0.005, 33), "frozen": frozen}, base=tmp_path / "s0")
    data = inspect_data(str(tmp_path / "s1"))
    # w's four blocks are deltas against s0's (own bytes); frozen's block is referred to in s0.
    assert data["by_base"] == {"s0": {"referenced_bytes": MiB, "delta_blocks": 4, "delta_bytes": st.bytes_written}}
    assert data["totals"]["file_bytes"] == st.bytes_written and data["totals"]["referenced_bytes"] == MiB
    assert main(["--plain", "inspect", str(tmp_path / "s1")]) == 0
    out = capsys.readouterr().out
    assert "referred to in s0" in out
    assert "base s0: 1.0 MiB referred to; 4 of its blocks are deltas against blocks there" in out, out


def test_run_copies_keep_references_and_run_moves_refuse_chains(tmp_path, capsys):
    from cairn._cli.main import main

    run = tmp_path / "run"
    with cairn.CheckpointManager(run, incremental=True, full_every=3, async_save=False) as mgr:
        for step in range(5):
            mgr.save(step, _mgr_state(step))
    # A run copied as is: each step keeps its references, to the copies of its bases.
    assert main(["--plain", "cp", "--keep-references", str(run), str(tmp_path / "copy")]) == 0
    capsys.readouterr()
    names = sorted(os.listdir(run))
    for name in names:
        a, b = (fmt.Manifest.from_json((d / name / "manifest.json").read_bytes(), name) for d in (run, tmp_path / "copy"))
        assert a.bases == b.bases
    assert any(fmt.Manifest.from_json((run / n / "manifest.json").read_bytes(), n).bases for n in names)
    # A run whose steps refer to each other is not moved step by step (its first, full step would go first).
    assert main(["--plain", "mv", str(run), str(tmp_path / "moved")]) != 0
    assert "refers to other steps" in capsys.readouterr().err
    assert sorted(os.listdir(run)) == names and not (tmp_path / "moved").exists()
    shutil.rmtree(run)
    reader = cairn.CheckpointManager(tmp_path / "copy", read_only=True)
    assert reader.steps() == list(range(5))
    for step in reader.steps():
        _same(_mgr_state(step), reader.restore(step))


def test_copy_keeping_references_to_and_from_s3(tmp_path, s3):
    states = _chain(tmp_path / "run")
    bucket = s3.new_bucket()
    opts = s3.options(part_size=5 * MiB, read_part_size=1 * MiB)
    stats = cairn.copy(tmp_path / "run" / "c", f"s3://{bucket}/backup/c", keep_references=True,
                       dst_storage_options=opts)
    assert stats.bases == ("a", "b")
    shutil.rmtree(tmp_path / "run")
    _same(states["c"], cairn.load(f"s3://{bucket}/backup/c", storage_options=opts))  # sibling prefixes
    assert verify(f"s3://{bucket}/backup/c", storage_options=opts).ok
    # ... and back: a chain copied from the object store into a folder.
    back = cairn.copy(f"s3://{bucket}/backup/c", tmp_path / "back" / "c", keep_references=True, storage_options=opts,
                      dst_storage_options={})
    assert back.bases == ("a", "b") and sorted(os.listdir(tmp_path / "back")) == ["a", "b", "c"]
    _same(states["c"], cairn.load(tmp_path / "back" / "c"))


# ---------------------------------------------------------------------- save and load time


@pytest.mark.parametrize("n", [0, 1, 4096, 64 << 10, (64 << 10) + 1, MiB, MiB + 7])
def test_block_hash_is_xxh3_128_on_either_side_of_the_gil_free_size(n):
    """Blocks above 64 KiB are hashed through a hasher object (which releases the GIL), smaller ones in one
    call: the digest is the format's xxh3-128 either way, for every kind of buffer a save hands it."""
    import xxhash

    from cairn._format.blocks import block_hash

    a = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    want = xxhash.xxh3_128_digest(a.tobytes())
    for data in (a, memoryview(a), a.tobytes(), bytearray(a.tobytes()), memoryview(a.view(np.uint8))):
        assert block_hash(data) == want


def test_delta_header_names_its_block_only_when_it_refuses_it():
    """A load passes the block's name as a function (formatting it for every delta cost more than the
    header's checks): it is called for an error only, and the error carries it."""
    from cairn._format.blocks import DELTA_HEADER
    from cairn._load.blocks import delta_header

    calls = []

    def where() -> str:
        calls.append(1)
        return "ckpt: leaf 'w' chunk 0 block 3"

    good = DELTA_HEADER.pack(0, 1, 0, 123, 4096) + b"\x28\xb5\x2f\xfd"
    assert delta_header(good, 4096, where) == (0, 123, 4096, 1) and not calls
    with pytest.raises(cairn.CorruptCheckpointError, match=r"ckpt: leaf 'w' chunk 0 block 3: .*pad bytes 0x0001"):
        delta_header(DELTA_HEADER.pack(0, 1, 1, 123, 4096), 4096, where)
    assert calls == [1]


def test_more_files_than_writer_threads_and_checkpointables_in_turn(tmp_path):
    """An incremental save starts a writer per data file (up to 2x `threads`: here 2 writers for 3 files),
    taking the checkpointables' files in turn: every step of a chain still loads bitwise, with references to
    the unchanged checkpointables and the changed one written."""
    rng = np.random.default_rng(3)
    frozen = {f"l{i}": rng.standard_normal((512, 1024)).astype(np.float32) for i in range(3)}  # 2 MiB each
    state = {"frozen": frozen, "head": {"w": np.zeros((256, 1024), np.float32)},
             "other": {"x": rng.standard_normal((256, 1024)).astype(np.float32)}}
    cairn.save(tmp_path / "s0", state, base=None, threads=1, compression=False)
    _hashed(tmp_path / "s1", state)
    prev = tmp_path / "s1"
    for step in range(2, 4):
        state["head"]["w"] += 1.0
        st = cairn.save(tmp_path / f"s{step}", state, base=prev, threads=1, compression=False)
        assert st.bytes_written < 2 * state["head"]["w"].nbytes  # the head (or its deltas) only
        _same(state, cairn.load(tmp_path / f"s{step}"))
        prev = tmp_path / f"s{step}"
    assert verify(prev).ok


def test_verify_false_skips_raw_block_checks_as_a_plain_load_does_but_never_a_deltas(tmp_path):
    """``verify=False`` skips the CRC-32C of raw blocks, own or referred to, as it does for a plain leaf;
    deltas and their base blocks are checked whatever it says (a delta is decoded, and its base block's
    CRC is what ties it to the block it was made against)."""
    rng = np.random.default_rng(5)
    frozen = rng.standard_normal((512, 512)).astype(np.float32)  # 1 MiB: one block, referred to
    _hashed(tmp_path / "s0", {"frozen": frozen, "w": _bf16(21)})
    w1 = _nudged(_bf16(21), 0.005, 22)
    cairn.save(tmp_path / "s1", {"frozen": frozen, "w": w1}, base=tmp_path / "s0", compression=False)

    def flip(item: str, at: int) -> None:
        (f,) = glob.glob(str(tmp_path / "s0" / item / "*.bin"))
        data = bytearray(Path(f).read_bytes())
        data[at] ^= 0x40
        Path(f).write_bytes(bytes(data))

    flip("frozen", 100)  # inside the block s1 refers to
    with pytest.raises(cairn.CorruptCheckpointError, match="checksum mismatch"):
        cairn.load(tmp_path / "s1")
    got = cairn.load(tmp_path / "s1", verify=False)  # as a plain leaf: not checked, the byte as stored
    assert got["frozen"].view(np.uint8).reshape(-1)[100] == frozen.view(np.uint8).reshape(-1)[100] ^ 0x40
    assert got["w"].tobytes() == w1.tobytes()
    flip("frozen", 100)
    flip("w", 5)  # inside the base block of a delta of s1
    with pytest.raises(cairn.CorruptCheckpointError, match="a delta against its base checkpoint 's0'"):
        cairn.load(tmp_path / "s1", verify=False)


def _counting_hashes(monkeypatch) -> list[int]:
    """Counts the blocks an incremental save hashes (one entry per `block_hash` call)."""
    import cairn._save.incremental as inc

    calls: list[int] = []
    real = inc.block_hash
    monkeypatch.setattr(inc, "block_hash", lambda data: calls.append(1) or real(data))
    return calls


def test_the_same_jax_array_is_referred_to_without_hashing_its_bytes(tmp_path, mesh8, monkeypatch):
    from cairn._format.blocks import DELTA

    frozen = jax.device_put(_bf16(21), NamedSharding(mesh8, P("x")))  # 4 MiB, sharded 8 ways
    cols = NamedSharding(mesh8, P(None, "x"))
    w0 = jax.device_put(_bf16(22), cols)
    w1 = jax.device_put(_nudged(np.asarray(w0), 0.005, 23), cols)  # deltas against s0
    _hashed(tmp_path / "s0", {"frozen": frozen, "w": w0, "head": np.zeros(64, np.float32)})
    cairn.save(tmp_path / "s1", {"frozen": frozen, "w": w1, "head": np.ones(64, np.float32)}, base=tmp_path / "s0")
    hashed = _counting_hashes(monkeypatch)
    s2 = {"frozen": frozen, "w": w1, "head": np.full(64, 2, np.float32)}
    st = cairn.save(tmp_path / "s2", s2, base=tmp_path / "s1")
    # Only the head (a numpy array: it may change in place) is hashed; frozen's references and w's deltas
    # (s1's, against s0's blocks) are taken from s1's index.
    assert len(hashed) == 1 and st.bytes_written < 1 << 16
    assert _codecs_of(tmp_path / "s2").count(DELTA) == _codecs_of(tmp_path / "s1").count(DELTA) > 0
    m = fmt.Manifest.from_json((tmp_path / "s2" / "manifest.json").read_bytes(), "s2")
    assert m.bases == ("s0",)
    got = cairn.load(tmp_path / "s2")
    assert np.asarray(got["frozen"]).tobytes() == np.asarray(frozen).tobytes()
    assert np.asarray(got["w"]).tobytes() == np.asarray(w1).tobytes() and got["head"][0] == 2
    assert verify(tmp_path / "s2").ok
    hashed.clear()  # a new array of the same bytes is hashed (and still referred to)
    again = jax.device_put(np.asarray(frozen), frozen.sharding)
    st = cairn.save(tmp_path / "s3", {**s2, "frozen": again}, base=tmp_path / "s2")
    assert len(hashed) == 4 + 1 and st.bytes_written < 1 << 16  # its 4 blocks, and the head


def test_a_base_replaced_under_its_name_is_not_trusted_for_an_unchanged_jax_array(tmp_path, monkeypatch):
    a, b = jax.numpy.asarray(_bf16(24)), jax.numpy.asarray(_bf16(25))
    _hashed(tmp_path / "s0", {"w": a})
    cairn.save(tmp_path / "s1", {"w": a}, base=tmp_path / "s0")
    # s0 deleted with the storage's tools and saved again: other bytes under the same name. (An
    # overwrite=True save is refused while s1 names s0 as its base: tests/save/test_replace_base.py.)
    shutil.rmtree(tmp_path / "s0")
    _hashed(tmp_path / "s0", {"w": b})
    hashed = _counting_hashes(monkeypatch)
    st = cairn.save(tmp_path / "s2", {"w": a}, base=tmp_path / "s0")
    assert len(hashed) == 4 and st.bytes_written == a.nbytes  # hashed, found changed, written
    assert np.asarray(cairn.load(tmp_path / "s2")["w"]).tobytes() == np.asarray(a).tobytes()


def test_a_numpy_array_changed_in_place_is_hashed_again(tmp_path, monkeypatch):
    w = _bf16(26)
    _hashed(tmp_path / "s0", {"w": w})
    w[5, 5] += 1  # the same object, other bytes
    hashed = _counting_hashes(monkeypatch)
    cairn.save(tmp_path / "s1", {"w": w}, base=tmp_path / "s0")
    assert len(hashed) == 4
    assert np.asarray(cairn.load(tmp_path / "s1")["w"]).tobytes() == w.tobytes()


def test_a_donated_jax_array_still_fails_its_save(tmp_path):
    a = jax.numpy.asarray(_bf16(27))
    _hashed(tmp_path / "s0", {"w": a})
    a.delete()
    with pytest.raises(Exception, match="delete"):
        cairn.save(tmp_path / "s1", {"w": a}, base=tmp_path / "s0")
    assert not (tmp_path / "s1" / "manifest.json").exists()


def _load_stats(path):
    from cairn._core.stats import LoadStats
    from cairn._load import engine as _load
    from cairn._load.source import CairnSource
    from cairn._storage.location import resolve

    stats = LoadStats()
    out = _load.load(CairnSource.open(resolve(str(path))), None, stats=stats)
    return out, stats


def test_small_referred_to_leaves_are_read_in_runs_like_small_own_ones(tmp_path):
    rng = np.random.default_rng(28)
    scales = {f"ln{i:02d}": rng.standard_normal(256).astype(np.float32) for i in range(30)}
    _hashed(tmp_path / "s0", {"p": {**scales, "head": np.zeros(64, np.float32)}})
    st1 = {"p": {**scales, "head": np.ones(64, np.float32)}}
    cairn.save(tmp_path / "s1", st1, base=tmp_path / "s0")
    got, stats = _load_stats(tmp_path / "s1")
    _same(st1, got)
    # The 30 unchanged scales lie back to back in s0's file: one run (and the head's delta reads apart).
    assert stats.reads <= 4, stats
    plan = cairn.plan_load(tmp_path / "s1")
    assert (plan.processes[0].requests, plan.processes[0].bytes_read) == (stats.reads, stats.bytes_read)
    # A damaged byte of a referred-to scale fails the load naming its leaf and its base's file.
    data = sorted((tmp_path / "s0" / "p").glob("*.bin"))[0]
    raw = bytearray(data.read_bytes())
    raw[256 * 4 * 3 + 5] ^= 1  # inside ln03
    data.write_bytes(bytes(raw))
    with pytest.raises(cairn.CorruptCheckpointError, match="ln03"):
        cairn.load(tmp_path / "s1")


def test_a_manager_refers_to_an_unchanged_jax_backbone_without_hashing_it(tmp_path, mesh8, monkeypatch):
    backbone = jax.device_put(_bf16(29), NamedSharding(mesh8, P("x")))
    hashed = _counting_hashes(monkeypatch)
    with cairn.CheckpointManager(tmp_path, incremental=True, max_to_keep=2, full_every=3) as mgr:
        counts = []
        for step in range(5):
            mgr.save(step, {"backbone": backbone, "head": np.full(64, step, np.float32)})  # async: snapshots
            mgr.wait()
            counts.append(len(hashed))
            hashed.clear()
        # Step 0 hashes everything; steps 1, 2 only the head; step 3 is self-contained (full_every): it
        # writes and hashes all; step 4 refers to it, hashing only the head again.
        assert counts[0] > 1 and counts[1] == counts[2] == counts[4] == 1 and counts[3] == counts[0], counts
        for step in mgr.steps():
            got = mgr.restore(step)
            assert np.asarray(got["backbone"]).tobytes() == np.asarray(backbone).tobytes() and got["head"][0] == step


def test_a_jax_array_sharing_host_memory_that_changes_is_hashed_again(tmp_path):
    buf = np.zeros((4 << 20) + 64, np.uint8)
    at = -buf.ctypes.data % 64  # JAX shares memory aligned to 64 bytes without a copy
    host = buf[at : at + (4 << 20)].view(np.float32).reshape(1024, 1024)  # 4 MiB: 4 blocks
    host[...] = np.random.default_rng(30).standard_normal((1024, 1024))
    shared = jax.dlpack.from_dlpack(host)  # on CPU a view of `host`: JAX's own arrays never change, this one may
    w0 = host.copy()
    _hashed(tmp_path / "s0", {"w": shared})
    host[900:902] += 1  # two rows (8 KiB) of the last block, behind JAX's back
    if np.asarray(shared).tobytes() == w0.tobytes():
        pytest.skip("this JAX copies on from_dlpack: nothing shares the array's memory")
    st = cairn.save(tmp_path / "s1", {"w": shared}, base=tmp_path / "s0")
    assert st.bytes_written > 0  # the changed block is found (as a delta) and written
    assert np.asarray(cairn.load(tmp_path / "s1")["w"]).tobytes() == host.tobytes()
    assert np.asarray(cairn.load(tmp_path / "s0")["w"]).tobytes() == w0.tobytes()


def test_an_async_save_does_not_copy_an_unchanged_jax_array_its_base_holds(tmp_path, mesh8):
    frozen = jax.device_put(_bf16(31), NamedSharding(mesh8, P("x")))  # 4 MiB, 8 chunks
    want = np.asarray(frozen).tobytes()
    head = np.full(64, 1, np.float32)
    _hashed(tmp_path / "s0", {"frozen": frozen, "head": np.zeros(64, np.float32)})
    f = cairn.save_async(tmp_path / "s1", {"frozen": frozen, "head": head}, base=tmp_path / "s0")
    # Only the head is copied; the backbone's chunks are decided before the snapshot and never read
    # again, so the caller may delete (or donate) the array at once.
    assert f.stats.snapshot_bytes == head.nbytes
    frozen.delete()
    st = f.result(timeout=60)
    assert st.bytes_written < 1 << 16
    got = cairn.load(tmp_path / "s1")
    assert np.asarray(got["frozen"]).tobytes() == want and got["head"][0] == 1
    assert verify(tmp_path / "s1").ok


@pytest.mark.parametrize("compression", [True, "zstd"])
def test_an_async_compressed_save_of_an_unchanged_jax_array_chooses_codecs_for_the_rest(tmp_path, compression):
    frozen = jax.numpy.asarray(_bf16(32))  # one chunk, in host memory (its sample is checked)
    rng = np.random.default_rng(33)
    _hashed(tmp_path / "s0", {"frozen": frozen, "w": _bf16(34)}, compression=compression)
    w = rng.standard_normal((512, 512)).astype(np.float32)
    f = cairn.save_async(tmp_path / "s1", {"frozen": frozen, "w": w}, base=tmp_path / "s0",
                         compression=compression)
    assert f.stats.snapshot_bytes == w.nbytes
    f.result(timeout=60)
    got = cairn.load(tmp_path / "s1")
    assert np.asarray(got["frozen"]).tobytes() == np.asarray(frozen).tobytes() and got["w"].tobytes() == w.tobytes()


def test_an_async_save_copies_an_unchanged_jax_array_where_its_base_cannot_show_it(tmp_path):
    a, b = jax.numpy.asarray(_bf16(35)), jax.numpy.asarray(_bf16(36))
    want = np.asarray(a).tobytes()
    _hashed(tmp_path / "s0", {"w": a})
    cairn.save(tmp_path / "s1", {"w": a}, base=tmp_path / "s0")
    # s0 deleted with the storage's tools and saved again: other bytes under the same name. (An
    # overwrite=True save is refused while s1 names s0 as its base: tests/save/test_replace_base.py.)
    shutil.rmtree(tmp_path / "s0")
    _hashed(tmp_path / "s0", {"w": b})
    f = cairn.save_async(tmp_path / "s2", {"w": a}, base=tmp_path / "s0")
    assert f.stats.snapshot_bytes == a.nbytes  # copied: its hashes are not the base's
    a.delete()
    assert f.result(timeout=60).bytes_written == len(want)
    assert np.asarray(cairn.load(tmp_path / "s2")["w"]).tobytes() == want
    # A base not committed when the snapshot runs (a save in flight, here a name nothing is saved at
    # yet, with a manager's fallback) decides nothing: the array is copied.
    from cairn._read.metadata import base_beside
    from cairn._save import future as _async
    from cairn._storage.location import resolve

    c = jax.numpy.asarray(_bf16(37))
    _hashed(tmp_path / "s3", {"w": c})
    loc = resolve(str(tmp_path / "s4"))
    f = _async.save_async(loc, {"w": c}, incremental={"base": base_beside(loc, tmp_path / "nothing"), "hashes": True,
                                                      "base_required": False})
    assert f.stats.snapshot_bytes == c.nbytes
    f.result(timeout=60)


@pytest.mark.parametrize("sizes", [[4096 * 20], [4096 * 8, 4096 * 8, 100], [4096 * 3, 5000, 4096], [30, 40], [4096 * 17, 10]])
def test_a_merged_chunks_sample_is_the_sample_of_its_joined_bytes(sizes):
    from cairn._save.hashmemo import sample, sample_parts

    rng = np.random.default_rng(38)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    assert sample_parts(parts) == sample(memoryview(np.concatenate(parts)))


def test_a_managers_async_saves_copy_only_what_the_base_does_not_hold(tmp_path, mesh8, monkeypatch):
    import cairn._save.snapshot as snap

    copied: list[int] = []
    real = snap.snapshot
    monkeypatch.setattr(snap, "snapshot", lambda job, budget=None: (real(job, budget),
                                                                     copied.append(job.stats.snapshot_bytes)))
    backbone = jax.device_put(_bf16(39), NamedSharding(mesh8, P("x")))
    with cairn.CheckpointManager(tmp_path, incremental=True, max_to_keep=2, full_every=3) as mgr:
        for step in range(4):
            mgr.save(step, {"backbone": backbone, "head": np.full(64, step, np.float32)})
            mgr.wait()
        # Step 0 copies all (nothing hashed yet); 1 and 2 only the head; 3 is self-contained: all again.
        assert copied == [backbone.nbytes + 256, 256, 256, backbone.nbytes + 256], copied
        for step in mgr.steps():
            got = mgr.restore(step)
            assert np.asarray(got["backbone"]).tobytes() == np.asarray(backbone).tobytes() and got["head"][0] == step


def test_an_async_save_against_a_base_still_being_saved_copies_and_reads_nothing_first(tmp_path, monkeypatch):
    import cairn._save.incremental as inc
    from cairn._save import future as _async

    a = jax.numpy.asarray(_bf16(41))
    _hashed(tmp_path / "s0", {"w": a})
    # As if this process were still saving s0 (a manager's previous step in flight): the snapshot does
    # not read the base at all, and copies the array.
    monkeypatch.setattr(_async._background, "in_flight", lambda: {str(tmp_path / "s0")})
    import threading

    reads: list[str] = []  # the threads that read the base's manifest
    real = inc.stored_manifest
    monkeypatch.setattr(inc, "stored_manifest", lambda loc: reads.append(threading.current_thread().name) or real(loc))
    f = cairn.save_async(tmp_path / "s1", {"w": a}, base=tmp_path / "s0")
    assert f.stats.snapshot_bytes == a.nbytes
    assert f.result(timeout=60).bytes_written == 0  # the job reads the base and refers to it
    assert reads == ["cairn-save"], reads  # in the background only
    assert np.asarray(cairn.load(tmp_path / "s1")["w"]).tobytes() == np.asarray(a).tobytes()


def test_an_async_save_on_an_object_store_decides_before_its_snapshot_only_for_large_arrays(s3):
    import cairn._save.incremental as inc

    bucket = s3.new_bucket()
    opts = s3.options(part_size=5 * MiB, read_part_size=1 * MiB)
    root = f"s3://{bucket}/run"
    a = jax.numpy.asarray(_bf16(42))  # 4 MiB: under REMOTE_DECIDE_BYTES
    cairn.save(f"{root}/p", {"w": a}, storage_options=opts)
    cairn.save(f"{root}/s0", {"w": a}, base=f"{root}/p", storage_options=opts)
    f = cairn.save_async(f"{root}/s1", {"w": a}, base=f"{root}/s0", storage_options=opts)
    assert f.stats.snapshot_bytes == a.nbytes  # copied: 4 MiB spares less than the base's round trips cost
    assert f.result(timeout=60).bytes_written == 0
    old = inc.REMOTE_DECIDE_BYTES
    try:
        inc.REMOTE_DECIDE_BYTES = 1 << 20
        f = cairn.save_async(f"{root}/s2", {"w": a}, base=f"{root}/s1", storage_options=opts)
        assert f.stats.snapshot_bytes == 0
        f.result(timeout=60)
    finally:
        inc.REMOTE_DECIDE_BYTES = old
    got = cairn.load(f"{root}/s2", storage_options=opts)
    assert np.asarray(got["w"]).tobytes() == np.asarray(a).tobytes()


def _frozen_and_head(head: float) -> dict:
    rng = np.random.default_rng(41)
    frozen = {f"l{i}": rng.standard_normal((512, 1024)).astype(np.float32) for i in range(4)}  # 2 MiB each
    w = np.random.default_rng(int(head)).standard_normal((256, 1024)).astype(np.float32)  # changes everywhere
    return {"frozen": frozen, "head": {"w": w}}


def _no_empty_data_files(path: Path) -> None:
    empty = [f for f in glob.glob(f"{path}/*/*.bin") if os.path.getsize(f) == 0]
    assert not empty, empty
    for item in glob.glob(f"{path}/*/index.*.json"):
        files = fmt.ItemIndex.from_json(Path(item).read_bytes(), item).files
        assert all(f.size > 0 for f in files if f.base is None), files


def test_a_data_file_of_references_only_is_not_written(tmp_path, mesh8):
    """A data file all of whose chunks are references holds no bytes: an incremental save writes no file for
    it (neither created nor fsync'd) and does not list it; its chunks' records name file 0 of the part, which
    exists. The step loads bitwise (resharded too), verifies, plans, and copies either way."""
    s0, s1 = _frozen_and_head(0.0), _frozen_and_head(1.0)
    _hashed(tmp_path / "s0", s0, threads=2, compression=False)
    st = cairn.save(tmp_path / "s1", s1, base=tmp_path / "s0", threads=2, compression=False)
    assert st.bytes_written == s1["head"]["w"].nbytes and st.files_written == 1
    _no_empty_data_files(tmp_path / "s1")
    assert glob.glob(f"{tmp_path}/s1/frozen/*.bin") == []  # the frozen checkpointable: references only
    assert len(glob.glob(f"{tmp_path}/s1/head/*.bin")) == 1
    index = fmt.ItemIndex.from_json(next((tmp_path / "s1" / "frozen").glob("index.*.json")).read_bytes(), "frozen")
    assert {f.base for f in index.files} == {"s0"}  # its files in s0, none of its own
    _same(s1, cairn.load(tmp_path / "s1"))
    got = cairn.load(tmp_path / "s1", {"frozen": {k: NamedSharding(mesh8, P("x")) for k in s1["frozen"]},
                                       "head": {"w": NamedSharding(mesh8, P(None, "x"))}})
    _same(s1, jax.tree.map(np.asarray, got))
    _same({"frozen": s1["frozen"]}, cairn.load(tmp_path / "s1", partial=True, target={"frozen": None}))
    assert verify(tmp_path / "s1").ok
    cairn.plan_load(tmp_path / "s1")
    assert inspect_data(str(tmp_path / "s1"))["totals"]["file_bytes"] == st.bytes_written
    cairn.copy(tmp_path / "s1", tmp_path / "self" / "s1")
    _same(s1, cairn.load(tmp_path / "self" / "s1"))
    cairn.copy(tmp_path / "s1", tmp_path / "kept" / "s1", keep_references=True)
    _same(s1, cairn.load(tmp_path / "kept" / "s1"))
    assert verify(tmp_path / "kept" / "s1").ok
    _no_empty_data_files(tmp_path / "kept" / "s1")
    # ... and the next step builds on it (its references point where s1's point: one hop).
    s2 = _frozen_and_head(2.0)
    cairn.save(tmp_path / "s2", s2, base=tmp_path / "s1", threads=2, compression=False)
    _no_empty_data_files(tmp_path / "s2")
    _same(s2, cairn.load(tmp_path / "s2"))
    assert verify(tmp_path / "s2").ok


def test_a_save_where_nothing_changed_writes_no_data_file(tmp_path):
    """Nothing changed: no data file at all, in any checkpointable; the records name the first base file."""
    s0 = _frozen_and_head(0.0)
    _hashed(tmp_path / "s0", s0, threads=2, compression=False)
    st = cairn.save(tmp_path / "s1", s0, base=tmp_path / "s0", threads=2, compression=False)
    assert st.bytes_written == 0 and st.files_written == 0
    assert glob.glob(f"{tmp_path}/s1/*/*.bin") == []
    _same(s0, cairn.load(tmp_path / "s1"))
    assert verify(tmp_path / "s1").ok
    cairn.copy(tmp_path / "s1", tmp_path / "kept" / "s1", keep_references=True)
    _same(s0, cairn.load(tmp_path / "kept" / "s1"))
    cairn.copy(tmp_path / "s1", tmp_path / "self" / "s1")
    _same(s0, cairn.load(tmp_path / "self" / "s1"))
    assert verify(tmp_path / "self" / "s1").ok


def test_chunks_the_base_found_unchanged_too_queue_behind_the_others(tmp_path, monkeypatch):
    """A chunk whose base chunk refers further back for every block (a frozen leaf) is hashed with a lower
    priority on the save's coder pool than a chunk that changed last time (`incremental.FROZEN_LAST`), so
    that the changed leaves' files are written and flushed first; the steps still load bitwise."""

    rng = np.random.default_rng(43)
    frozen = {f"f{i}": rng.standard_normal((2048, 1024)).astype(np.float32) for i in range(3)}  # 8 MiB each
    state = {"p": {**frozen, "head": rng.standard_normal((2048, 1024)).astype(np.float32)}}
    _hashed(tmp_path / "s0", state, compression=False)
    state["p"]["head"] = state["p"]["head"] + 1
    cairn.save(tmp_path / "s1", state, base=tmp_path / "s0", compression=False)  # frozen: refs into s0
    seen: list[tuple[int, np.ndarray]] = []
    from cairn._save import pipeline

    submit = pipeline.CodePool.submit

    def recording(self, fn, /, *args, priority=0):
        if getattr(fn, "__name__", "") == "_run":
            seen.append((priority, np.frombuffer(args[0], np.uint8)))  # (a view of the leaf's own memory)
        return submit(self, fn, *args, priority=priority)

    monkeypatch.setattr(pipeline.CodePool, "submit", recording)
    state["p"]["head"] = state["p"]["head"] + 1
    cairn.save(tmp_path / "s2", state, base=tmp_path / "s1", compression=False)
    by_leaf: dict[str, set[int]] = {}
    for priority, run in seen:
        by_leaf.setdefault(next(n for n, a in state["p"].items() if np.shares_memory(a, run)), set()).add(priority)
    assert by_leaf == {"f0": {1}, "f1": {1}, "f2": {1}, "head": {0}}, by_leaf
    _same(state, cairn.load(tmp_path / "s2"))
