"""CheckpointManager: naming, intervals, restore, checkpointables, failures, preemption, crashes."""

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tests._procs.train_loop import expected

import cairn
from cairn._save import future as _async
from cairn._storage.local import LocalStorage
from cairn._storage.memory import MemoryStorage

_PROCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_procs")
_ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")


@pytest.fixture(params=["local", "memory"])
def directory(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return f"memory://mgr-{uuid.uuid4().hex[:8]}/run"



def _mgr(directory, **kw):
    kw.setdefault("handle_sigterm", False)
    return cairn.CheckpointManager(directory, **kw)


def _state(step):
    return {"params": {"w": np.full((4, 3), step, np.float32)}, "opt": {"m": np.arange(5) * step}, "step": step}


# ---------------------------------------------------------------------- saving and listing


def test_intervals_naming_and_listing(directory):
    with _mgr(directory, save_every=5) as mgr:
        saved = [s for s in range(13) if mgr.save(s, _state(s))]
        assert saved == [0, 5, 10]
        assert mgr.save(12, _state(12), force=True)
        assert not mgr.should_save(13) and mgr.should_save(15)
        mgr.wait()
        assert mgr.steps() == [0, 5, 10, 12] and mgr.latest_step() == 12
        assert mgr.path(12) == f"{mgr.directory}/step_00000012"
        assert cairn.load(mgr.path(5))["step"] == 5  # each step is an ordinary checkpoint
        with pytest.raises(cairn.CheckpointExistsError):
            mgr.save(10, _state(10))
            mgr.wait()
    assert _mgr(directory).steps() == [0, 5, 10, 12]


def test_a_step_older_than_the_newest_is_refused_not_deleted(directory):
    """A resume script re-run from an earlier step on a directory that holds newer steps: its first save
    raises, naming the newest step, instead of returning True and retention deleting the step at once."""
    with _mgr(directory, max_to_keep=2, async_save=False) as mgr:
        for s in (11, 12, 13):
            assert mgr.save(s, _state(s))
        assert mgr.steps() == [12, 13]
    with _mgr(directory, max_to_keep=2) as mgr:  # the re-run, not restoring
        with pytest.raises(cairn.CheckpointError, match=r"step 5 is older than step 13, the newest this run has "
                                                        r"saved.*mgr.latest_step\(\) \(13\)"):
            mgr.save(5, _state(5))
        mgr.save(14, _state(14))  # an async save in flight counts as the newest too
        with pytest.raises(cairn.CheckpointError, match="step 10 is older than step 14"):
            mgr.save(10, _state(10))
        mgr.wait()
        assert mgr.steps() == [13, 14]
        mgr.delete(14)
        mgr.delete(13)
        assert mgr.steps() == []  # (max_to_keep=2 had kept 13 and 14)
        assert mgr.save(12, _state(12))  # nothing newer is left: saved
        mgr.wait()
        assert mgr.steps() == [12] and mgr.restore()["step"] == 12


def test_large_steps_sort_numerically(directory):
    with _mgr(directory) as mgr:
        for s in (7, 99999999, 100000000, 123456789):  # (named so, 100000000 lists before 99999999)
            mgr.save(s, {"s": s})
        mgr.wait()
        assert mgr.steps() == [7, 99999999, 100000000, 123456789]
        assert mgr.restore() == {"s": 123456789}


def test_sync_mode_commits_before_returning(directory):
    with _mgr(directory, async_save=False, max_to_keep=1) as mgr:
        for s in range(3):
            mgr.save(s, _state(s), metrics={"loss": 1.0 / (s + 1)})
            assert mgr.steps() == [s]
        assert mgr.metrics(2) == {"loss": 1 / 3}


def test_many_rapid_async_saves(directory, mesh8):
    w = jax.device_put(jnp.zeros((8, 512), jnp.float32), NamedSharding(mesh8, P("x")))
    inc = jax.jit(lambda w: w + 1.0, donate_argnums=0)
    with _mgr(directory, max_to_keep=3, keep_every=10) as mgr:
        for s in range(41):
            assert mgr.save(s, {"w": w, "step": s})
            w = inc(w)
        mgr.wait()
        assert mgr.steps() == [0, 10, 20, 30, 38, 39, 40]
        for s in mgr.steps():
            out = mgr.restore(s)
            assert out["step"] == s
            np.testing.assert_array_equal(out["w"], np.full((8, 512), s, np.float32))


def test_metrics_are_stored_and_validated(directory):
    with _mgr(directory, keep_best=1, best_metric="loss") as mgr:
        mgr.save(1, {"x": 1}, metrics={"loss": np.float32(0.5), "acc": jnp.asarray(0.75)})
        mgr.save(2, {"x": 2}, metrics={"loss": float("nan")})
        with pytest.raises(TypeError, match="'name'"):
            mgr.save(3, {"x": 3}, metrics={"name": "adam"})
        mgr.wait()
        assert mgr.metrics(1) == {"loss": 0.5, "acc": 0.75}
        assert mgr.metrics(2) == {"loss": None}  # NaN is stored as missing: never "best"
        assert mgr.steps() == [1, 2]  # 1 is best, 2 is the newest


# ---------------------------------------------------------------------- interrupted steps


def test_uncommitted_steps_are_never_listed_and_are_cleaned(tmp_path):
    d = tmp_path / "run"
    with _mgr(d) as mgr:
        mgr.save(1, {"x": 1})
        mgr.save(2, {"x": 2})
    # What crashes leave behind: an unfinished save, a half-finished deletion,
    # a step folder without manifest; plus things that are not ours.
    for leftover in (".step_00000003.cairn-tmp-ab12cd", ".step_00000001.cairn-tmp-del-0f0f", "step_00000004"):
        (d / leftover / "params").mkdir(parents=True)
        (d / leftover / "params" / "p00000-0.ab12cd.bin").write_bytes(b"x" * 10)
    (d / "step_5").mkdir()  # not the canonical spelling: not a step, not touched
    (d / "notes.txt").write_text("mine")
    storage = LocalStorage(str(d))
    mgr = _mgr(d, max_to_keep=1)
    assert sorted(os.listdir(d)) == ["notes.txt", "step_00000001", "step_00000002", "step_5"]
    assert mgr.steps() == [1, 2] and mgr.latest_step() == 2
    assert storage.exists("step_00000001/manifest.json")
    mgr.save(6, {"x": 6})  # retention runs only after this commit
    mgr.wait()
    assert mgr.steps() == [6] and sorted(os.listdir(d)) == ["notes.txt", "step_00000006", "step_5"]


def test_uncommitted_object_store_steps_are_cleaned():
    bucket = f"mgr-obj-{uuid.uuid4().hex[:8]}"
    d = f"memory://{bucket}/run"
    with _mgr(d) as mgr:
        mgr.save(1, {"x": 1})
    objects = MemoryStorage._named[bucket]
    objects["run/step_00000002/%root/p00000-0.ab12cd.bin"] = b"partial"  # an interrupted in-place save
    assert _mgr(d).steps() == [1]
    assert not [k for k in objects if "step_00000002" in k]


def test_a_failed_save_deletes_nothing_and_surfaces(monkeypatch):
    d = f"memory://mgr-fail-{uuid.uuid4().hex[:8]}/run"
    orig = MemoryStorage.write

    def write(self, key, parts):
        if "step_00000002" in key:
            raise OSError(5, "I/O error (injected)")
        return orig(self, key, parts)

    monkeypatch.setattr(MemoryStorage, "write", write)
    mgr = _mgr(d, max_to_keep=1)
    mgr.save(1, {"x": np.ones(3)})
    mgr.save(2, {"x": np.ones(3) * 2})
    _async._background.wait_all(60)
    assert mgr.steps() == [1], "the only good checkpoint survives a failed save"
    with pytest.raises(cairn.CheckpointError, match="step 2 failed.*I/O error"):
        mgr.save(3, {"x": np.ones(3) * 3})
    mgr.save(3, {"x": np.ones(3) * 3})  # the error was reported once; saving goes on
    mgr.wait()
    assert mgr.steps() == [3]
    mgr.save(4, {"x": np.ones(3) * 4})
    mgr.save(5, {"x": np.ones(3) * 2})
    mgr.wait()
    monkeypatch.setattr(MemoryStorage, "write", lambda self, key, parts: (_ for _ in ()).throw(OSError("down")))
    mgr.save(6, {"x": np.ones(3)})
    with pytest.raises(cairn.CheckpointError, match="step 6"):
        mgr.close()


# ---------------------------------------------------------------------- restore


def test_restore_subset_reads_only_what_is_asked(tmp_path, mesh8, monkeypatch):
    sharding = NamedSharding(mesh8, P("x"))
    w = jax.device_put(jnp.arange(64.0).reshape(8, 8), sharding)
    with _mgr(tmp_path / "run") as mgr:
        mgr.save(3, {"params": {"w": w}, "opt": {"m": np.zeros(10**5)}, "config": {"lr": 0.1}})
    opened = []
    orig = LocalStorage.open_read
    monkeypatch.setattr(LocalStorage, "open_read", lambda self, key: opened.append(key) or orig(self, key))
    mgr = _mgr(tmp_path / "run")
    target = {"params": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=sharding)}}
    out = mgr.restore(target=target)
    assert list(out) == ["params"] and out["params"]["w"].sharding == sharding
    np.testing.assert_array_equal(out["params"]["w"], np.arange(64.0).reshape(8, 8))
    assert opened and all("/params/" in k for k in opened)
    assert mgr.restore(target={"config": None}) == {"config": {"lr": 0.1}}
    with pytest.raises(cairn.CheckpointNotFoundError, match="step 4"):
        mgr.restore(4)


def test_restore_with_nothing_saved(directory):
    mgr = _mgr(directory)
    assert mgr.latest_step() is None and mgr.steps() == []
    with pytest.raises(cairn.CheckpointNotFoundError, match="no committed checkpoint"):
        mgr.restore()
    with pytest.raises(cairn.CheckpointNotFoundError):
        mgr.restore(fallback=True)


def _corrupt_newest_data(directory, step):
    if directory.startswith("memory://"):
        bucket = directory.split("/")[2]
        objects = MemoryStorage._named[bucket]
        key = next(k for k in objects if f"step_{step:08d}/" in k and k.endswith(".bin"))
        data = bytearray(objects[key])
        data[0] ^= 0xFF
        objects[key] = bytes(data)
        return
    for root, _dirs, files in os.walk(os.path.join(directory, f"step_{step:08d}")):
        for f in files:
            if f.endswith(".bin"):
                with open(os.path.join(root, f), "r+b") as fh:
                    b = fh.read(1)
                    fh.seek(0)
                    fh.write(bytes([b[0] ^ 0xFF]))
                return


def test_corrupt_newest_fails_clearly_and_fallback_finds_older(directory):
    with _mgr(directory) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, _state(s))
    _corrupt_newest_data(directory, 30)
    _corrupt_newest_data(directory, 20)
    mgr = _mgr(directory)
    with pytest.raises(cairn.CorruptCheckpointError, match="step_00000030.*checksum"):
        mgr.restore()
    out = mgr.restore(fallback=True)
    assert out["step"] == 10 and mgr.restored_step == 10
    np.testing.assert_array_equal(out["params"]["w"], _state(10)["params"]["w"])
    with pytest.raises(cairn.CorruptCheckpointError):
        mgr.restore(20, fallback=True)  # an explicit step never falls back
    _corrupt_newest_data(directory, 10)
    with pytest.raises(cairn.CorruptCheckpointError, match="no committed checkpoint verifies"):
        mgr.restore(fallback=True)


# ---------------------------------------------------------------------- checkpointables


class IterState:
    """A user type: a data iterator's position, stored as bytes by a handler."""

    def __init__(self, epoch, index):
        self.epoch, self.index = epoch, index

    def to_bytes(self):
        return f"{self.epoch}:{self.index}".encode()

    @classmethod
    def from_bytes(cls, data):
        return cls(*map(int, data.decode().split(":")))


def test_non_array_checkpointables_round_trip(directory):
    cairn.register_type(IterState, save=IterState.to_bytes, load=IterState.from_bytes, name="test.IterState")
    config = {"model": {"layers": 4, "act": "gelu"}, "lr": 3e-4, "tags": ["a", "b"], "seed": None}
    state = {
        "params": {"w": np.eye(3)},
        "config": config,
        "blob": b"\x00serialized iterator\xff",
        "iter": IterState(2, 1234),
    }
    with _mgr(directory) as mgr:
        mgr.save(7, state)
    out = _mgr(directory).restore()
    assert out["config"] == config and out["blob"] == state["blob"]
    assert isinstance(out["iter"], IterState) and (out["iter"].epoch, out["iter"].index) == (2, 1234)
    np.testing.assert_array_equal(out["params"]["w"], np.eye(3))
    assert _mgr(directory).restore(target={"blob": None}) == {"blob": state["blob"]}


# ---------------------------------------------------------------------- lifetime and preemption


def test_closed_manager_and_context(directory):
    with _mgr(directory) as mgr:
        mgr.save(1, {"x": 1})
    with pytest.raises(cairn.CheckpointError, match="closed"):
        mgr.save(2, {"x": 2})
    mgr.close()  # idempotent
    with pytest.raises(ValueError):
        _mgr(directory, save_every=0)


def test_preemption_check_forces_a_synchronous_save(directory):
    flag = {"stop": False}
    mgr = _mgr(directory, save_every=100, preemption_check=lambda: flag["stop"])
    assert mgr.save(0, {"x": 0}) and not mgr.save(1, {"x": 1})
    assert not mgr.reached_preemption(1)
    flag["stop"] = True
    assert not mgr.reached_preemption(1), "not before this preemption's checkpoint is committed"
    assert mgr.save(2, {"x": 2})
    assert mgr.steps() == [0, 2], "committed when save returns"
    assert mgr.reached_preemption(2)
    flag["stop"] = False
    assert mgr.reached_preemption(3), "preemption is latched"
    assert mgr.reached_preemption(), "without a step: has any preemption checkpoint been committed"
    assert not mgr.reached_preemption(1), "step 1 came before the preemption's checkpoint (step 2)"
    mgr.close()


def test_sigterm_in_process_sets_preemption_and_close_restores_handler(directory):
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def earlier(*a):
        seen.append(a[0])

    signal.signal(signal.SIGTERM, earlier)
    try:
        mgr = cairn.CheckpointManager(directory, save_every=1000)
        assert not mgr.save(3, {"x": 3})
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs between bytecodes of the main thread
        assert mgr.save(4, {"x": 4}) and mgr.steps() == [4] and mgr.reached_preemption(4)
        assert seen == [signal.SIGTERM], "the earlier handler is chained"
        mgr.close()
        assert signal.getsignal(signal.SIGTERM) is earlier, "close puts the earlier handler back"
    finally:
        signal.signal(signal.SIGTERM, before)


def _reader(proc):
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x.strip()) for x in proc.stdout], daemon=True).start()
    return lines


def _wait_for(lines, pred, timeout, proc):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if pred(line):
            return line
    proc.kill()
    raise AssertionError(f"child never printed the expected line; it printed {seen[-5:]}, rc={proc.poll()}")


def _check_restorable(directory, step):
    mgr = _mgr(directory)
    out = mgr.restore(step)
    want = expected(step)
    np.testing.assert_array_equal(out["params"]["w"], want["params"]["w"])
    np.testing.assert_array_equal(out["params"]["b"], want["params"]["b"])
    assert out["config"] == want["config"] and out["data"] == want["data"]


def test_sigterm_to_a_training_subprocess(tmp_path):
    d = str(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(_PROCS, "train_loop.py"), d, "1000", "5", "0.01"],
        env=_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines = _reader(proc)
    _wait_for(lines, lambda x: x == "saved 0", 120, proc)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    line = _wait_for(lines, lambda x: x.startswith("preempted"), 60, proc)
    assert proc.wait(60) == 0, proc.stderr.read()
    step = int(line.split()[1])
    assert 0 < step < 1000, "saved off the interval because of the preemption"
    assert _mgr(d).steps() == [0, step]
    _check_restorable(d, step)
    _check_restorable(d, 0)


@pytest.mark.slow
def test_sigkill_during_async_saves_leaves_a_clean_latest(tmp_path):
    """Kill a loop of async saves (max_to_keep=2) at random moments; resume each time."""
    d = str(tmp_path / "run")
    trials = 25 if os.environ.get("CAIRN_STRESS") else 5
    rng = random.Random(1234)
    last = -1
    for trial in range(trials):
        proc = subprocess.Popen(
            [sys.executable, os.path.join(_PROCS, "train_loop.py"), d, "1", "2", "0"],
            env=_ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        lines = _reader(proc)
        start = int(_wait_for(lines, lambda x: x.startswith("start"), 120, proc).split()[1])
        assert start == last + 1, "resumed right after the latest committed step"
        # Once save(start + 2) returned, save(start) has finished (two saves pending at most).
        _wait_for(lines, lambda x, s=start: x == f"saved {s + 2}", 120, proc)
        time.sleep(rng.uniform(0.0, 0.6))
        proc.kill()
        proc.wait(30)
        mgr = _mgr(d)
        steps = mgr.steps()
        assert steps and steps[-1] >= start, f"trial {trial}: steps {steps}"
        assert len(steps) <= 3, "retention kept up (at most one deletion interrupted)"
        for s in steps:
            _check_restorable(d, s)
        last = steps[-1]
        mgr.close()
    leftovers = [n for n in os.listdir(d) if not n.startswith("step_")]
    assert len(leftovers) <= 2, leftovers  # only what the last kill interrupted


def test_manager_user_metadata_and_its_deprecated_spellings(tmp_path):
    """``mgr.save(user_metadata=)`` / ``mgr.user_metadata(step)`` are the user's dict; ``metadata=`` and
    ``mgr.metadata(step)`` still work for one release and warn, naming the new spelling."""
    with cairn.CheckpointManager(tmp_path / "run", handle_sigterm=False, async_save=False) as mgr:
        mgr.save(1, {"w": np.ones(2)}, user_metadata={"epoch": 1})
        with pytest.warns(DeprecationWarning, match=r"CheckpointManager.save\(metadata=\.\.\.\) .* user_metadata="):
            mgr.save(2, {"w": np.ones(2)}, metadata={"epoch": 2})
        assert mgr.user_metadata(1) == {"epoch": 1} and mgr.user_metadata() == {"epoch": 2}
        with pytest.warns(DeprecationWarning, match=r"call CheckpointManager.user_metadata\(\)"):
            assert mgr.metadata(2) == {"epoch": 2}
        with pytest.raises(TypeError, match="both user_metadata= and"):
            mgr.save(3, {"w": np.ones(2)}, metadata={}, user_metadata={})
        assert mgr.steps() == [1, 2]
