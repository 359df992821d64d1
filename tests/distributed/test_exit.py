"""After a dead peer, every survivor runs its handler, however soon process 0 (which hosts JAX's
coordination service) is done: process 0 leaves only after the others have left (`cairn.shutdown`,
or on its own at exit). Real processes on 127.0.0.1 with recoverability on; the last one dies in a
save. `make test` runs 4 processes; `make stress` (CAIRN_STRESS=1) 16.

Before this, process 0 exited right after its own (instant) handler, and JAX aborted the survivors
still in theirs ("Terminating process because the JAX distributed service detected fatal errors").
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from _mp import start, wait

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

N = 16 if os.environ.get("CAIRN_STRESS") == "1" else 4


@pytest.mark.parametrize("leave", ["exit", "shutdown"])
def test_every_survivor_of_a_dead_peer_runs_its_handler(tmp_path, monkeypatch, leave):
    monkeypatch.setenv("CAIRN_PEER_TIMEOUT", "4")
    procs = start(N, "exit_scenarios:dead_peer_handlers", {"root": str(tmp_path), "handler_s": 3.0, "leave": leave},
                  devices_per_process=1, recoverable=True, heartbeat_s=60, natural_exit=True)
    out = wait(procs, 200, expect_exit=lambda i: i != N - 1)
    assert procs[N - 1].popen.returncode == 9
    for i, r in enumerate(out[:-1]):
        assert r["error"].startswith("CoordinationError") and f"process {N - 1}" in r["error"], (i, r)
        # the handler ran to its end: its file is complete
        np.testing.assert_array_equal(np.load(tmp_path / f"handled-{i}.npy"), np.arange(1000) * i)
    assert [p.popen.returncode for p in procs[:-1]] == [0] * (N - 1)
    assert not os.path.exists(tmp_path / "bad")
