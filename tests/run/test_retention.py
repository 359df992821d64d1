"""Retention policies, checked against a simple model of what must be kept.

The model: after any sequence of saves, the surviving steps are exactly
    the n newest of all saved steps
  | every saved step divisible by k
  | the n best of all saved steps by the metric (ties: newer wins)
  | every saved step the user's predicate accepts
  | the newest step,
or every step when no rule is given. Because the manager re-applies the
policies after each commit to the surviving steps only, this closed form is
a real claim about the incremental process (a step dropped once could never
qualify again), which the tests check both on the pure function and through
a CheckpointManager on memory:// storage, across restarts.
"""

import itertools
import math
import time
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cairn
from cairn._run.retention import CheckpointInfo, retained

_ids = itertools.count()


def _model(saved, metrics, latest_n, every, best_n, mode, pred):
    if latest_n is None and every is None and best_n is None and pred is None:
        return set(saved)
    keep = {max(saved)}
    if latest_n is not None:
        keep |= set(sorted(saved)[-latest_n:])
    if every is not None:
        keep |= {s for s in saved if s % every == 0}
    if best_n is not None:
        sign = 1 if mode == "min" else -1
        scored = sorted((sign * metrics[s], -s) for s in saved if metrics.get(s) is not None)
        keep |= {-neg for _, neg in scored[:best_n]}
    if pred is not None:
        keep |= {s for s in saved if pred(s)}
    return keep


def _policy(latest_n, every, best_n, mode, pred):
    parts = []
    if latest_n is not None:
        parts.append(cairn.KeepLatest(latest_n))
    if every is not None:
        parts.append(cairn.KeepEvery(every))
    if best_n is not None:
        parts.append(cairn.KeepBest(best_n, "loss", mode))
    if pred is not None:
        parts.append(cairn.KeepIf(lambda c: pred(c.step)))
    if not parts:
        return None
    policy = parts[0]
    for p in parts[1:]:
        policy = policy | p
    return policy


def _pred(s):
    return s % 7 == 3


scenarios = st.fixed_dictionaries(
    {
        "steps": st.lists(st.integers(0, 60), min_size=1, max_size=14, unique=True).map(sorted),
        "losses": st.lists(
            st.one_of(st.none(), st.sampled_from([0.5, 1.0, 2.0]), st.floats(0, 10, allow_nan=False)),
            min_size=14, max_size=14,
        ),
        "latest_n": st.one_of(st.none(), st.integers(1, 4)),
        "every": st.one_of(st.none(), st.integers(1, 12)),
        "best_n": st.one_of(st.none(), st.integers(1, 3)),
        "mode": st.sampled_from(["min", "max"]),
        "pred": st.sampled_from([None, _pred]),
        "restart_at": st.integers(0, 14),
    }
)


@settings(max_examples=400, deadline=None)
@given(sc=scenarios)
def test_incremental_retention_matches_the_model(sc):
    steps, args = sc["steps"], (sc["latest_n"], sc["every"], sc["best_n"], sc["mode"], sc["pred"])
    metrics = {s: sc["losses"][i] for i, s in enumerate(steps)}
    policy = _policy(*args)
    alive: list[int] = []
    for i, s in enumerate(steps):
        alive.append(s)
        infos = [CheckpointInfo(t, {} if metrics[t] is None else {"loss": metrics[t]}) for t in alive]
        keep = retained(policy, infos)
        assert max(alive) in keep, "the newest checkpoint always survives"
        alive = sorted(keep)
        assert set(alive) == _model(steps[: i + 1], metrics, *args)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=scenarios)
def test_manager_keeps_what_the_model_says(sc):
    """Real saves on memory://, with a restart (a new manager) in the middle."""
    steps, args = sc["steps"], (sc["latest_n"], sc["every"], sc["best_n"], sc["mode"], sc["pred"])
    metrics = {s: sc["losses"][i] for i, s in enumerate(steps)}
    directory = f"memory://retention-{uuid.uuid4().hex[:8]}/run"

    def open_mgr():
        return cairn.CheckpointManager(directory, retention=_policy(*args), async_save=next(_ids) % 2 == 0,
                                       handle_sigterm=False)

    mgr = open_mgr()
    for i, s in enumerate(steps):
        if i == sc["restart_at"]:
            mgr.close()
            mgr = open_mgr()  # best-N must come from the stored metrics
        m = {} if metrics[s] is None else {"loss": metrics[s]}
        assert mgr.save(s, {"x": np.full(2, s), "step": s}, metrics=m)
        mgr.wait()
        assert set(mgr.steps()) == _model(steps[: i + 1], metrics, *args)
    mgr.close()
    newest = max(steps)
    assert cairn.CheckpointManager(directory, handle_sigterm=False).restore()["step"] == newest


# ---------------------------------------------------------------------- the policies one by one


def _infos(**metric_by_step):
    return [CheckpointInfo(int(k[1:]), {} if v is None else {"loss": v}) for k, v in metric_by_step.items()]


def test_policies_individually():
    infos = _infos(s1=3.0, s2=1.0, s3=None, s4=1.0, s10=math.inf, s20=0.5)
    assert cairn.KeepLatest(2).keep(infos) == {10, 20}
    assert cairn.KeepEvery(10).keep(infos) == {10, 20}
    assert cairn.KeepBest(2, "loss").keep(infos) == {20, 4}  # 4 beats 2 on the tie: newer
    assert cairn.KeepBest(1, "loss", mode="max").keep(infos) == {1}  # inf is not a value
    assert cairn.KeepIf(lambda c: c.step < 3).keep(infos) == {1, 2}
    assert (cairn.KeepLatest(1) | cairn.KeepEvery(2)).keep(infos) == {2, 4, 10, 20}
    assert cairn.KeepAny(cairn.KeepLatest(1), cairn.KeepBest(1, "loss")).keep(infos) == {20}


def test_a_user_policy_class():
    class KeepOdd(cairn.RetentionPolicy):
        def keep(self, checkpoints):
            return {c.step for c in checkpoints if c.step % 2}

    assert retained(KeepOdd(), _infos(s1=None, s2=None, s4=None)) == {1, 4}


def test_never_deletes_the_only_good_checkpoint():
    # No checkpoint has the metric: KeepBest keeps nothing, the newest survives.
    assert retained(cairn.KeepBest(3, "loss"), _infos(s1=None, s2=None)) == {2}
    assert retained(cairn.KeepIf(lambda c: False), _infos(s5=None)) == {5}
    assert retained(None, _infos(s1=None, s2=None)) == {1, 2}
    assert retained(cairn.KeepLatest(1), []) == set()


def test_bad_parameters():
    with pytest.raises(ValueError):
        cairn.KeepLatest(0)
    with pytest.raises(ValueError):
        cairn.KeepEvery(0)
    with pytest.raises(ValueError, match="mode"):
        cairn.KeepBest(1, "loss", mode="lowest")
    with pytest.raises(ValueError, match="best_metric"):
        cairn.CheckpointManager("memory://bad-params/run", keep_best=2, handle_sigterm=False)
    with pytest.raises(ValueError, match="keep_best"):
        cairn.CheckpointManager("memory://bad-params/run", best_metric="loss", handle_sigterm=False)
    with pytest.raises(TypeError, match="RetentionPolicy"):
        cairn.CheckpointManager("memory://bad-params/run", retention=[3], handle_sigterm=False)


# ---------------------------------------------------------------------- time-based policies

H = 3600.0
T0 = 1_700_000_000.0 - 1_700_000_000.0 % (24 * H)  # a UTC midnight (windows are fixed to the epoch)


def _timed(*pairs):
    return [CheckpointInfo(step, {}, t) for step, t in pairs]


def test_keep_one_per_window_keeps_the_first_of_each_epoch_aligned_window():
    infos = _timed((10, T0 + 1 * H), (20, T0 + 5.9 * H), (30, T0 + 6 * H), (40, T0 + 7 * H),
                   (50, T0 + 13 * H), (60, T0 + 17.99 * H), (70, T0 + 18 * H))
    # Windows [T0, T0+6h), [T0+6h, T0+12h), [T0+12h, T0+18h), [T0+18h, ...): the first of each.
    assert cairn.KeepOnePer(hours=6).keep(infos) == {10, 30, 50, 70}
    assert cairn.KeepOnePer(days=1).keep(infos) == {10}
    assert cairn.KeepOnePer(hours=12).keep(infos) == {10, 50}
    assert cairn.KeepOnePer(minutes=30).keep(infos) == {10, 20, 30, 40, 50, 60, 70}
    assert cairn.KeepOnePer(hours=1, minutes=30).period_s == 5400
    # The first by commit time, not by step; equal times: the lower step. Unknown times: never kept.
    assert cairn.KeepOnePer(hours=6).keep(_timed((5, T0 + 2 * H), (3, T0 + 3 * H), (4, T0 + 2 * H))) == {4}
    assert cairn.KeepOnePer(hours=6).keep(_timed((1, 0.0), (2, T0))) == {2}
    assert repr(cairn.KeepOnePer(hours=6)) == "KeepOnePer(hours=6)"
    assert repr(cairn.KeepOnePer(seconds=90)) == "KeepOnePer(seconds=90)"


def test_keep_one_per_window_is_stable_under_deletion():
    infos = _timed((1, T0 + 1), (2, T0 + 2), (3, T0 + 6 * H + 1), (4, T0 + 6 * H + 2))
    kept = cairn.KeepOnePer(hours=6).keep(infos)
    assert kept == {1, 3}
    # Deleting what it did not keep changes nothing (windows do not move with the first step).
    assert cairn.KeepOnePer(hours=6).keep([c for c in infos if c.step in kept]) == kept


def test_keep_newer_than_measures_age_against_the_newest_checkpoint():
    infos = _timed((1, T0), (2, T0 + 1 * H), (3, T0 + 2 * H), (4, T0 + 26 * H), (5, 0.0))
    assert cairn.KeepNewerThan(days=1).keep(infos) == {3, 4, 5}  # exactly 1 day old: kept; unknown: kept
    assert cairn.KeepNewerThan(hours=24, seconds=-1).keep(infos) == {4, 5}
    assert cairn.KeepNewerThan(seconds=1).keep(_timed((1, 0.0), (2, 0.0))) == {1, 2}
    assert repr(cairn.KeepNewerThan(days=14)) == "KeepNewerThan(days=14)"


def test_time_policies_compose():
    infos = _timed(*[(s, T0 + s * H) for s in range(0, 49, 2)])  # a step every 2 hours for 2 days
    one_per_day_for_a_day = cairn.KeepOnePer(hours=12) & cairn.KeepNewerThan(days=1)
    assert one_per_day_for_a_day.keep(infos) == {24, 36, 48}
    policy = cairn.KeepLatest(2) | one_per_day_for_a_day
    assert policy.keep(infos) == {24, 36, 46, 48}
    assert retained(cairn.KeepOnePer(hours=12) & cairn.KeepNewerThan(hours=1), infos) == {48}
    assert (cairn.KeepEvery(10) & cairn.KeepNewerThan(hours=20)).keep(infos) == {30, 40}
    assert cairn.KeepAll(cairn.KeepLatest(3)).keep(infos) == {44, 46, 48}
    assert repr(policy) == "(KeepLatest(2) | (KeepOnePer(hours=12) & KeepNewerThan(days=1)))"


def test_time_policies_bad_parameters():
    for bad in ({}, {"hours": 0}, {"hours": -1}, {"seconds": math.inf}, {"minutes": math.nan}):
        with pytest.raises(ValueError, match="duration"):
            cairn.KeepOnePer(**bad)
        with pytest.raises(ValueError, match="duration"):
            cairn.KeepNewerThan(**bad)
    with pytest.raises(ValueError, match="at least one"):
        cairn.KeepAll()


@settings(max_examples=300, deadline=None)
@given(gaps=st.lists(st.floats(0, 5 * H, allow_nan=False), min_size=1, max_size=20),
       latest_n=st.integers(1, 3), hours=st.sampled_from([1, 2, 6]))
def test_incremental_one_per_window_matches_the_closed_form(gaps, latest_n, hours):
    """After each save the survivors are: the n newest | the first of each window of all saved | the newest."""
    times = list(itertools.accumulate([T0 + 0.5, *gaps]))
    policy = cairn.KeepLatest(latest_n) | cairn.KeepOnePer(hours=hours)
    alive: list[CheckpointInfo] = []
    for i, t in enumerate(times):
        alive.append(CheckpointInfo(i, {}, t))
        keep = retained(policy, alive)
        alive = [c for c in alive if c.step in keep]
        first = {}
        for s, ts in enumerate(times[: i + 1]):
            first.setdefault(math.floor(ts / (hours * H)), s)
        assert keep == set(range(i + 1)[-latest_n:]) | set(first.values())


def test_manager_applies_time_policies_to_commit_times(tmp_path):
    directory = str(tmp_path / "run")
    seen: list[CheckpointInfo] = []

    class Record(cairn.RetentionPolicy):
        def keep(self, checkpoints):
            seen[:] = checkpoints
            return set()

    before = time.time()
    with cairn.CheckpointManager(directory, retention=cairn.KeepNewerThan(seconds=0.5) & Record(),
                                 async_save=False, handle_sigterm=False) as mgr:
        mgr.save(0, {"x": np.zeros(2)})
        time.sleep(0.8)
        mgr.save(1, {"x": np.ones(2)})
        assert mgr.steps() == [1]  # step 0 was committed over 0.5 s before step 1
        assert [c.step for c in seen] == [0, 1] and before < seen[0].created_unix < seen[1].created_unix
        assert seen[1].created_unix - seen[0].created_unix >= 0.8 and seen[1].created_unix <= time.time()
    with cairn.CheckpointManager(directory, retention=cairn.KeepNewerThan(seconds=30), async_save=False,
                                 handle_sigterm=False) as mgr:
        mgr.save(2, {"x": np.ones(2)})
        assert mgr.steps() == [1, 2]  # a restart reads the commit times back from the manifests
        mgr.save(3, {"x": np.ones(2)})
        assert mgr.steps() == [1, 2, 3]
