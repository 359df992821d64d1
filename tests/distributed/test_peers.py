"""Dead and stuck peers are noticed within CAIRN_PEER_TIMEOUT, named, and nothing is committed.

Real processes on 127.0.0.1 (tests/_mp). Process 1 dies (SIGKILL) or hangs in
a data-file write half way through a save whose own timeout is 300 s; the
survivor must raise `CoordinationError` naming process 1 within seconds,
through the heartbeats each process keeps in JAX's coordination service.
"""

from __future__ import annotations

import json
import os
import time

import pytest

import cairn
from _mp import start, wait

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

MESH_2 = [2, 2]


def _run(tmp_path, monkeypatch, action, recoverable=True):
    monkeypatch.setenv("CAIRN_PEER_TIMEOUT", "4")
    t0 = time.monotonic()
    procs = start(2, "save_twice", {"path": str(tmp_path), "mesh": MESH_2, "fail_on": 1, "action": action,
                                    "timeout": 300}, recoverable=recoverable, heartbeat_s=60)
    return procs, t0


def test_a_dead_peer_is_named_within_the_peer_timeout(tmp_path, monkeypatch):
    procs, _ = _run(tmp_path, monkeypatch, "kill")
    out = wait(procs, 150, expect_exit=lambda i: i != 1)
    err, seconds = out[0]["error"], out[0]["seconds"]
    assert err is not None and err.startswith("CoordinationError"), err
    assert "process 1" in err and "no heartbeat" in err, err
    assert seconds < 60, seconds  # not the save's 300 s timeout
    assert not os.path.exists(tmp_path / "bad")
    cairn.load(tmp_path / "good")


def test_a_stuck_peer_is_named_with_what_it_was_doing(tmp_path, monkeypatch):
    procs, _ = _run(tmp_path, monkeypatch, "hang")
    out = wait(procs, 150, expect_exit=lambda i: i != 1)
    err, seconds = out[0]["error"], out[0]["seconds"]
    assert err is not None and "process 1" in err and "made no progress" in err and "saving" in err, err
    assert seconds < 60, seconds
    assert not os.path.exists(tmp_path / "bad")


def test_without_recoverability_the_survivor_still_raises_first(tmp_path, monkeypatch):
    # With JAX's defaults a dead peer makes the coordination service end the survivors
    # (after its heartbeat timeout, 60 s here); cairn's 4 s peer timeout comes first, so
    # the survivor raises a CoordinationError naming the dead process.
    procs, _ = _run(tmp_path, monkeypatch, "kill", recoverable=False)
    wait(procs, 150, expect_exit=lambda i: False)
    with open(procs[0].result) as f:
        out = json.load(f)
    assert out["error"] is not None and "process 1" in out["error"] and "no heartbeat" in out["error"], out
    assert not os.path.exists(tmp_path / "bad")
