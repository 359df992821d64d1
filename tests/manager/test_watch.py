"""Evaluators beside a trainer: polling for committed steps, reader leases that retention honours.

In-process cases on local disk and memory:// check each rule on its own; the
process cases run a real trainer and a real evaluator (tests/_procs/watch_pair.py)
on local disk and on S3 (moto), where a save in progress is a step prefix
without a manifest.
"""

import json
import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

import cairn
from _mp import run
from cairn._run import leases as _leases
from cairn._run.steps import open_directory

_PAIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_procs", "watch_pair.py")
_ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")


@pytest.fixture(params=["local", "memory"])
def directory(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return f"memory://watch-{uuid.uuid4().hex[:8]}/run"


def _trainer(directory, **kw):
    kw.setdefault("handle_sigterm", False)
    kw.setdefault("async_save", False)
    return cairn.CheckpointManager(directory, **kw)


def _state(step):
    return {"w": np.full(8, step, np.float32), "step": step}


def _storage(directory):
    return open_directory(directory)[1]


def _lease_files(directory):
    return sorted(_storage(directory).list_dir(_leases.LEASE_DIR))


# ---------------------------------------------------------------------- polling


def test_wait_for_step_returns_only_committed_steps(directory):
    ev = cairn.CheckpointManager(directory, read_only=True)
    t0 = time.monotonic()
    assert ev.wait_for_step(timeout=0.3, poll_s=0.05) is None  # an empty (even absent) directory
    assert 0.3 <= time.monotonic() - t0 < 5
    assert ev.wait_for_step(timeout=0) is None
    storage = _storage(directory)
    # What an interrupted or in-progress save looks like: no manifest, or a hidden attempt folder.
    storage.put("step_00000009/p00000-0.abcd.bin", b"x")
    storage.put(".step_00000010.cairn-tmp-1234/manifest.json", b"{}")
    assert ev.wait_for_step(timeout=0.2, poll_s=0.05) is None
    with _trainer(directory) as mgr:
        mgr.save(3, _state(3))
        mgr.save(5, _state(5))
    assert ev.wait_for_step(timeout=0) == 5
    assert ev.wait_for_step(after=3, timeout=0) == 5
    assert ev.wait_for_step(after=5, timeout=0.2, poll_s=0.05) is None


def test_wait_for_step_wakes_on_a_commit(directory):
    ev = cairn.CheckpointManager(directory, read_only=True)
    with _trainer(directory) as mgr:
        mgr.save(0, _state(0))
        timer = threading.Timer(0.3, lambda: mgr.save(1, _state(1)))
        timer.start()
        try:
            t0 = time.monotonic()
            assert ev.wait_for_step(after=0, timeout=30, poll_s=0.05) == 1
            assert time.monotonic() - t0 < 10
        finally:
            timer.join()


def test_bad_arguments(directory):
    ev = cairn.CheckpointManager(directory, read_only=True)
    with pytest.raises(ValueError, match="poll_s"):
        ev.wait_for_step(poll_s=0)
    with pytest.raises(ValueError, match="timeout"):
        ev.wait_for_step(timeout=-1)
    with pytest.raises(ValueError, match="ttl_s"):
        _leases.take(_storage(directory), 0, directory, ttl_s=0)
    with pytest.raises(cairn.CheckpointError, match="read-only"):
        ev.save(0, _state(0))
    with pytest.raises(cairn.CheckpointNotFoundError, match="no committed"), ev.reading():
        pass


def test_read_only_manager_leaves_a_save_in_progress_alone(tmp_path):
    d = str(tmp_path / "run")
    os.makedirs(f"{d}/.step_00000004.cairn-tmp-abcd")  # another process's save in progress
    cairn.CheckpointManager(d, read_only=True).close()
    assert os.path.isdir(f"{d}/.step_00000004.cairn-tmp-abcd")
    _trainer(d).close()  # a trainer's manager takes it for an interrupted save
    assert not os.path.exists(f"{d}/.step_00000004.cairn-tmp-abcd")


def test_new_steps_yields_the_newest_each_time_and_ends_on_timeout(directory):
    ev = cairn.CheckpointManager(directory, read_only=True)
    with _trainer(directory) as mgr:
        for s in (0, 1, 2):
            mgr.save(s, _state(s))
        seen = []
        for step in ev.new_steps(timeout=0.3, poll_s=0.05):
            seen.append(step)
            held = _lease_files(directory)
            assert len(held) == 1 and held[0].startswith(f"step_{step:08d}.") and held[0].endswith(".lease")
            np.testing.assert_array_equal(ev.restore(step)["w"], _state(step)["w"])
            if step == 2:
                mgr.save(3, _state(3))
                mgr.save(4, _state(4))
        assert seen == [2, 4]  # 3 was skipped: an evaluator gets the latest
    assert _lease_files(directory) == []  # every lease was released
    assert list(ev.new_steps(after=4, timeout=0)) == []


def test_breaking_out_releases_the_lease(directory):
    with _trainer(directory) as mgr:
        mgr.save(0, _state(0))
    ev = cairn.CheckpointManager(directory, read_only=True)
    for step in ev.new_steps(timeout=0):
        assert step == 0 and len(_lease_files(directory)) == 1
        break
    assert _lease_files(directory) == []


# ---------------------------------------------------------------------- leases and retention


def test_retention_spares_a_leased_step_and_deletes_it_after_release(directory):
    ev = cairn.CheckpointManager(directory, read_only=True)
    with _trainer(directory, max_to_keep=1) as mgr:
        mgr.save(0, _state(0))
        with ev.reading(0) as state:
            assert state["step"] == 0
            mgr.save(1, _state(1))
            mgr.save(2, _state(2))
            assert mgr.steps() == [0, 2]  # 0 is leased; 1 was not
            assert ev.restore(0)["step"] == 0
        assert _lease_files(directory) == []
        assert mgr.steps() == [0, 2]  # nothing deletes until the next save's retention
        mgr.save(3, _state(3))
        assert mgr.steps() == [3]
    assert [n for n in _storage(directory).list_dir("") if "deleting" in n] == []


def test_reading_the_newest_step(directory):
    with _trainer(directory, max_to_keep=2) as mgr:
        for s in range(3):
            mgr.save(s, _state(s))
        ev = cairn.CheckpointManager(directory, read_only=True)
        with ev.reading(target={"w": np.zeros(8, np.float32)}, partial=True) as state:
            assert set(state) == {"w"} and state["w"][0] == 2
        with pytest.raises(cairn.CheckpointNotFoundError, match="step 0"), ev.reading(0):
            pass


def test_a_crashed_readers_lease_expires(directory):
    storage = _storage(directory)
    with _trainer(directory, max_to_keep=1) as mgr:
        mgr.save(0, _state(0))
        # A reader that took a lease with a 0.5 s lifetime and then died (it never renews nor releases).
        lease = _leases.take(storage, 0, directory, ttl_s=0.5)
        assert lease is not None
        lease._stop.set()
        mgr.save(1, _state(1))
        assert mgr.steps() == [0, 1]  # still live
        time.sleep(0.6)
        mgr.save(2, _state(2))
        assert mgr.steps() == [2]
        assert _lease_files(directory) == []  # the expired lease file was removed too
        # An unreadable lease pins nothing either.
        mgr.save(3, _state(3))
        storage.put(f"{_leases.LEASE_DIR}/step_00000003.junk.lease", b"not json")
        mgr.save(4, _state(4))
        assert mgr.steps() == [4] and _lease_files(directory) == []


def test_a_held_lease_is_renewed(directory):
    storage = _storage(directory)
    with _trainer(directory, max_to_keep=1) as mgr:
        mgr.save(0, _state(0))
        with _leases.take(storage, 0, directory, ttl_s=0.3) as lease:
            first = json.loads(storage.read(lease.key))["expires_unix"]
            time.sleep(0.8)  # over two lifetimes: only renewals keep it live
            assert json.loads(storage.read(lease.key))["expires_unix"] > first + 0.3
            assert not lease.lost
            mgr.save(1, _state(1))
            assert mgr.steps() == [0, 1]
        mgr.save(2, _state(2))
        assert mgr.steps() == [2]


def test_the_handshake_each_side_sees_the_other(directory):
    """The two orders of the race, played out by hand (module docstring of cairn._run.leases)."""
    storage = _storage(directory)
    with _trainer(directory) as mgr:
        for s in (0, 1):
            mgr.save(s, _state(s))
    # The trainer put its deletion marker first: the reader backs off and leaves no lease behind.
    with _leases.spare_leased(storage, [0], directory) as free:
        assert free == [0]
        assert _leases.take(storage, 0, directory) is None
        assert _lease_files(directory) == []
    # The reader put its lease first: the trainer's pass spares the step.
    lease = _leases.take(storage, 0, directory)
    assert lease is not None
    with _leases.spare_leased(storage, [0, 1], directory) as free:
        assert free == [1]
    lease.release()
    # A step already deleted cannot be leased.
    cairn.CheckpointManager(directory, max_to_keep=1, handle_sigterm=False, async_save=False).save(2, _state(2))
    assert _leases.take(storage, 0, directory) is None and _lease_files(directory) == []


def test_stale_deletion_markers_are_removed_when_a_trainer_opens(directory):
    storage = _storage(directory)
    with _trainer(directory) as mgr:
        mgr.save(0, _state(0))
    storage.put(".cairn-deleting.step_00000000", b"{}")  # a retention pass killed midway
    assert _leases.take(storage, 0, directory) is None
    cairn.CheckpointManager(directory, read_only=True).close()
    assert _leases.take(storage, 0, directory) is None  # an evaluator does not clean up
    _trainer(directory).close()
    lease = _leases.take(storage, 0, directory)
    assert lease is not None
    lease.release()


# ---------------------------------------------------------------------- a real trainer and evaluator


def _run_pair(spec, env):
    ev = subprocess.Popen([sys.executable, _PAIR, "eval", json.dumps(spec)], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert ev.stdout.readline().strip() == "ready", ev.stderr.read()
        tr = subprocess.run([sys.executable, _PAIR, "train", json.dumps(spec)], env=env, text=True,
                            capture_output=True, timeout=120)
        out, err = ev.communicate(timeout=120)
    finally:
        if ev.poll() is None:
            ev.kill()
    assert tr.returncode == 0, tr.stderr
    assert ev.returncode == 0, err
    loaded = [int(line.split()[1]) for line in out.splitlines() if line.startswith("loaded")]
    return loaded, tr.stderr


def _check_pair(directory, options, spec, loaded, trainer_log):
    assert loaded and loaded == sorted(set(loaded)) and loaded[-1] == spec["steps"] - 1
    spared = {int(line.split("keeps step ")[1].split()[0]) for line in trainer_log.splitlines()
              if "a reader holds a lease" in line}
    # The evaluator held each step for longer than the trainer took to save several more, so
    # retention met a lease and spared a step that max_to_keep alone would have deleted.
    # (A spared step need not be one the evaluator loaded: both sides may back off at once.)
    assert spared, trainer_log
    # Leases are released: the next save deletes every spared step.
    with cairn.CheckpointManager(directory, max_to_keep=1, storage_options=options, handle_sigterm=False,
                                 async_save=False) as mgr:
        mgr.save(spec["steps"], {"step": spec["steps"]})
        assert mgr.steps() == [spec["steps"]]
    storage = open_directory(directory, options)[1]
    assert storage.list_dir(_leases.LEASE_DIR) == []


def _spec(directory, options=None):
    return {"dir": directory, "options": options, "steps": 30, "keep": 1, "sleep_s": 0.02, "hold_s": 0.3,
            "poll_s": 0.02, "ttl_s": 3.0}


def test_trainer_and_evaluator_processes_local(tmp_path):
    d = str(tmp_path / "run")
    spec = _spec(d)
    loaded, log = _run_pair(spec, _ENV)
    _check_pair(d, None, spec, loaded, log)


def test_trainer_and_evaluator_processes_s3(s3):
    url = s3.url(s3.new_bucket(), "run")
    spec = _spec(url, s3.options())
    loaded, log = _run_pair(spec, _ENV)
    _check_pair(url, s3.options(), spec, loaded, log)


def test_evaluator_processes_under_jax_distributed(tmp_path):
    out = run(2, "watch_scenarios:evaluate_together", {"directory": str(tmp_path / "run")}, timeout=180)
    assert [o["got"] for o in out] == [[0, 1, 2], [0, 1, 2]]
    assert out[0]["during"] == [[0, 1], [1, 2]]  # the leased step survived; the released one went
    assert out[0]["final"] == [3]
