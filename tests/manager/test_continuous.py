"""Continuous checkpointing (save only when no save is in flight) and the default mode's bounded wait."""

import logging

import numpy as np
import pytest
from tests._hold import hold_writes

import cairn


def _mgr(directory, **kw):
    kw.setdefault("handle_sigterm", False)
    return cairn.CheckpointManager(directory, **kw)


def _state(step):
    return {"params": {"w": np.full((4, 3), step, np.float32)}, "step": step}


@pytest.fixture
def held(monkeypatch):
    """Data writes wait until the returned event is set: a save stays in flight for sure."""
    go = hold_writes(monkeypatch)
    yield go
    go.set()


def test_continuous_skips_steps_while_a_save_is_in_flight(tmp_path, held, caplog):
    with _mgr(tmp_path / "run", continuous=True) as mgr, caplog.at_level(logging.WARNING, "cairn"):
        assert mgr.save(0, _state(0)) is True
        # step 0 is still being written: these steps are skipped, and save does not wait for it
        assert [mgr.save(s, _state(s)) for s in (1, 2, 3)] == [False, False, False]
        assert mgr.stats.skipped == 3 and mgr.stats.skipped_steps == [1, 2, 3] and mgr.stats.saves == 1
        assert mgr.stats.waited_s == 0.0
        warned = [r.getMessage() for r in caplog.records if "not saved" in r.getMessage()]
        assert len(warned) == 1, "one warning, the later skips are counted"
        assert "step 1 not saved, the save of step 0 is still in flight" in warned[0]
        held.set()
        mgr.wait()
        assert mgr.save(4, _state(4)) is True  # nothing in flight: saved
        mgr.wait()
        assert mgr.steps() == [0, 4]
        np.testing.assert_array_equal(mgr.restore(4)["params"]["w"], _state(4)["params"]["w"])


def test_the_next_saves_stats_count_the_skipped_steps(tmp_path, held):
    with _mgr(tmp_path / "run", continuous=True) as mgr:
        mgr.save(0, _state(0))
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        held.set()
        mgr.wait()
        mgr.save(3, _state(3))
        [pending] = mgr._pending
        assert pending.future.stats.skipped_steps == 2
        mgr.wait()
    assert mgr.stats.skipped_steps == [1, 2]


def test_continuous_forced_and_synchronous_saves_still_write(tmp_path, held):
    with _mgr(tmp_path / "run", continuous=True) as mgr:
        mgr.save(0, _state(0))
        held.set()
        assert mgr.save(1, _state(1), force=True) is True  # force: saved whatever is in flight
        mgr.wait()
        assert mgr.steps() == [0, 1] and mgr.stats.skipped == 0


def test_the_default_mode_waits_at_most_max_wait_s(tmp_path, held):
    with _mgr(tmp_path / "run", max_wait_s=0.2) as mgr:
        assert mgr.save(0, _state(0)) and mgr.save(1, _state(1))  # one writing, one queued
        with pytest.raises(cairn.CheckpointError, match=r"step_00000002: step 2 was not saved: the save of step 0 "
                                                         r"is still in flight after max_wait_s=0.2 s"):
            mgr.save(2, _state(2))
        assert mgr.stats.waited_s >= 0.2 and mgr.stats.saves == 2
        held.set()
        mgr.wait()
        assert mgr.steps() == [0, 1]
        assert mgr.save(2, _state(2)) is True  # the step can be saved once there is room
        mgr.wait()
        assert mgr.steps() == [0, 1, 2]


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan")])
def test_max_wait_s_is_checked(tmp_path, bad):
    with pytest.raises(ValueError, match="max_wait_s must be a finite number of seconds"):
        _mgr(tmp_path / "run", max_wait_s=bad)
