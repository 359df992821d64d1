"""The local tier: placement and the restore decision (pure), and kill/wipe/restart on 4 real processes.

The multi-process tests run `tests/_mp/localtier_scenarios.py:train` on 4
processes with 2 CPU devices each: a deterministic training run saving to a
persistent directory every 6 steps and to one directory per "host" every 2
steps, each process's shards also held by the next process. A run dies
(``os._exit``) right after a save, possibly with the local save in flight; a
host directory is wiped (a replaced machine); the restarted run must resume
from the newest step complete on disk (own copy or replica), bitwise equal to
an uninterrupted run, and from the persistent tier when a process's own copy
and its replica are both gone.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest

from _mp import start, wait
from cairn import CheckpointError
from cairn._localtier import choose
from cairn._replicas import placement

N = 4
SCENARIO = "localtier_scenarios:train"


# ---------------------------------------------------------------------- pure parts


def test_placement_is_a_permutation_outside_the_own_domain():
    for count, domains in [(4, None), (6, [0, 0, 1, 1, 2, 2]), (8, [p // 2 for p in range(8)]), (5, None)]:
        fn = None if domains is None else domains.__getitem__
        holders = placement(count, 2, fn)
        dom = domains or list(range(count))
        assert len(holders) == 2
        for perm in holders:
            assert sorted(perm) == list(range(count))
            assert all(dom[perm[q]] != dom[q] for q in range(count))
        assert all(dom[holders[0][q]] != dom[holders[1][q]] for q in range(count))


def test_placement_refuses_what_the_domains_cannot_hold():
    with pytest.raises(CheckpointError, match="cannot place 2 replica"):
        placement(4, 2, [0, 0, 1, 1].__getitem__)  # only one other domain
    with pytest.raises(CheckpointError, match="other failure domains"):
        placement(2, 1, lambda p: "same-rack")
    assert placement(1, 1) == [] and placement(4, 0) == []


def _report(steps: dict[int, list[int]], count: int = 4, layout: str = "L") -> dict:
    return {"count": count, "layout": layout,
            "steps": {str(s): {"count": count, "layout": layout, "holds": h, "lengths": {}, "crc": {}}
                      for s, h in steps.items()}}


def test_choose_takes_the_newest_step_with_a_copy_of_every_process():
    holders = placement(4, 1)  # q -> q + 1
    reports = {p: _report({8: [p, (p - 1) % 4], 10: [p, (p - 1) % 4]}) for p in range(4)}
    reports[3] = _report({8: [3, 2]})  # step 10 torn on process 3: process 0's replica serves
    step, sources, why = choose(reports, 4, holders)
    assert step == 10 and why == "" and sources[3] == (0, 0) and sources[2] == (2, None)
    reports[0] = _report({8: [0, 3]})  # torn on process 0 too: no copy of process 3's step 10 is left
    step, sources, why = choose(reports, 4, holders)
    assert step == 8 and why == "" and all(sources[q] == (q, None) for q in range(4))
    reports[3] = reports[0] = _report({})  # process 3's own copy and its replica are both gone
    step, _, why = choose(reports, 4, holders)
    assert step is None and "no copy of process [3]" in why


def test_choose_falls_back_on_another_process_count_or_layout():
    holders = placement(4, 1)
    saved_by_8 = {p: _report({4: [p]}, count=8) | {"count": 4} for p in range(4)}
    step, _, why = choose(saved_by_8, 4, holders)
    assert step is None and "saved by [8] processes and this run has 4" in why
    other = {p: _report({4: [p]}, layout="other") | {"layout": "L"} for p in range(4)}
    step, _, why = choose(other, 4, holders)
    assert step is None and "another array layout" in why
    assert choose({p: _report({}) for p in range(4)}, 4, holders) == (None, {}, "")


# ---------------------------------------------------------------------- real processes


def _committed(root: str, host: int, step: int) -> bool:
    return os.path.exists(f"{root}/host{host}/process_{host}/step_{step:08d}/manifest.json")


def _persistent_latest(persist: str) -> int | None:
    steps = [int(n[5:]) for n in os.listdir(persist) if n.startswith("step_")
             and os.path.exists(f"{persist}/{n}/manifest.json")] if os.path.isdir(persist) else []
    return max(steps, default=None)


def _expected(root: str, persist: str, upto: int) -> tuple[str | None, int | None]:
    """Where the restart must resume from, judged from what is on disk."""
    local = None
    for s in range(upto, -1, -1):
        if all(_committed(root, q, s) or _committed(root, (q + 1) % N, s) for q in range(N)):
            local = s
            break
    p = _persistent_latest(persist)
    if local is not None and (p is None or local >= p):
        return "local", local
    return ("persistent", p) if p is not None else (None, None)


def _run(root: str, persist: str, total: int, die_at: int | None, timeout: float = 180) -> list:
    """Run the scenario; a run that dies returns, per process, the "resumed <tier> <step>" line it printed."""
    procs = start(N, SCENARIO, {"root": root, "persist": persist, "total": total, "die_at": die_at})
    out = wait(procs, timeout, expect_exit=lambda i: die_at is None)
    if die_at is None:
        return out
    lines = [next((ln for ln in p.output().splitlines() if ln.startswith("resumed ")), "") for p in procs]
    return [ln.split()[1:] for ln in lines]


def _wipe(root: str, *hosts: int) -> None:
    for h in hosts:
        shutil.rmtree(f"{root}/host{h}", ignore_errors=True)


def _check_resumed(out: list, want: tuple[str | None, int | None]) -> None:
    for r in out:
        assert (r["tier"], r["restored"]) == want, (out, want)
        assert r["equal"], out


@pytest.mark.timeout(400)
def test_kill_wipe_a_host_restart_resumes_from_local_then_persistent(tmp_path):
    root, persist = str(tmp_path / "local"), str(tmp_path / "persist")
    _run(root, persist, 20, die_at=10)  # dies with the local save of step 10 in flight
    _wipe(root, 2)  # a replaced host: process 2's shards exist only as process 3's replica
    want = _expected(root, persist, 10)
    assert want[0] == "local" and want[1] >= 8, want
    resumed = _run(root, persist, 20, die_at=15)  # resumes and dies again
    assert resumed == [["local", str(want[1])]] * N, (resumed, want)
    _wipe(root, 1, 2)  # process 1's own copy and its replica (on process 2) are both gone
    want = _expected(root, persist, 15)
    # The persistent save of step 12 is asynchronous: the kill at step 15 may come before its commit.
    assert want[0] == "persistent" and want[1] in (6, 12), want
    _check_resumed(_run(root, persist, 20, die_at=None), want)


@pytest.mark.timeout(300)
def test_a_replaced_host_gets_its_shards_from_its_peer(tmp_path):
    root, persist = str(tmp_path / "local"), str(tmp_path / "persist")
    _run(root, persist, 12, die_at=9)  # local 6 complete, 8 perhaps; persistent 6
    _wipe(root, 3)
    want = _expected(root, persist, 9)
    assert want[0] == "local" and want[1] in (6, 8), want
    _check_resumed(_run(root, persist, 12, die_at=None), want)


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("seed", range(8))
def test_random_kills_and_wipes(tmp_path, seed):
    rng = random.Random(seed)
    root, persist = str(tmp_path / "local"), str(tmp_path / "persist")
    total, done = 30, -1
    want: tuple[str | None, int | None] = (None, None)
    for _ in range(3):
        if done + 1 > total - 2:
            break
        die_at = min(total - 2, done + 1 + rng.randrange(9))
        resumed = _run(root, persist, total, die_at=die_at)
        assert resumed == [[str(want[0]), str(want[1])]] * N, (resumed, want)
        lost = rng.sample(range(N), rng.choice([1, 1, 2]))
        _wipe(root, *lost)
        done = die_at
        want = _expected(root, persist, done)
    _check_resumed(_run(root, persist, total, die_at=None), want)
