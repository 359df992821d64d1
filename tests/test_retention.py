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
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cairn
from cairn._retention import CheckpointInfo, retained

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
