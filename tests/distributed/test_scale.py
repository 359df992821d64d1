"""Many real processes, one CPU device each, on 127.0.0.1: every operation exact, none hangs, and the
coordination a non-primary process makes does not grow with the process count.

Two clusters per test (tests/_mp/scale_scenarios.py): N processes run save, a same-sharding load, a
resharded (read-once) load, metadata, a manager with async saves and retention, per-process values
and the local tier (save and restore); then N/2 processes run the same on the same state, restore
the local tier the N processes saved (onto another process count), and lose their last process in a
save: every survivor must raise `CoordinationError` naming it within CAIRN_PEER_TIMEOUT + 10 s.
Each process counts its calls to JAX's coordination client and their bytes (the heartbeat
thread's apart), and its storage requests. `make test` runs 8 and 4 processes; `make stress`
(CAIRN_STRESS=1) 32 and 16. Set CAIRN_SCALE_REPORT to a file to keep the counts
(benchmarks/probes/coord_scale.py compares its model with them).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

from _mp import start, wait
from _mp.scale_scenarios import state_bytes, summarize

OPS = ["save", "load", "load_resharded", "metadata", "manager", "per_process", "local_tier"]
#: Operations whose coordination per non-primary process must not grow with the process count.
FLAT = OPS
PEER_TIMEOUT = 10


def _cluster(n: int, root: str, ops: list[str], unit: int, timeout: float, tier_from: str | None = None,
             dead: bool = False) -> list[Any]:
    procs = start(n, "scale_scenarios:scale", {"root": root, "ops": ops, "unit": unit, "tier_from": tier_from},
                  devices_per_process=1, recoverable=dead, heartbeat_s=60 if dead else 10,
                  sync_exit=list(range(n - 1)) if dead else None)
    out = wait(procs, timeout, expect_exit=(lambda i: i != n - 1) if dead else None)
    if dead:  # what the dead process measured before it died
        with open(os.path.join(root, f"dead-{n - 1}.json")) as f:
            out[-1] = json.load(f)
    return out


def _scale(tmp_path, monkeypatch, big: int) -> None:
    monkeypatch.setenv("CAIRN_PEER_TIMEOUT", str(PEER_TIMEOUT))
    small = big // 2
    t0 = time.monotonic()
    a = _cluster(big, str(tmp_path / "a"), [*OPS, "local_tier_shared"], big, timeout=60 + 6 * big)
    t1 = time.monotonic()
    b = _cluster(small, str(tmp_path / "b"), [*OPS, "local_restore_other", "dead_peer"], big,
                 timeout=60 + 6 * big, tier_from=str(tmp_path / "a" / "shared"), dead=True)
    t2 = time.monotonic()
    report = {"clusters_s": {big: round(t1 - t0, 1), small: round(t2 - t1, 1)},
              big: summarize(a), small: summarize(b)}
    print(json.dumps(report, indent=1))
    if os.environ.get("CAIRN_SCALE_REPORT"):
        with open(os.environ["CAIRN_SCALE_REPORT"], "w") as f:
            json.dump(report, f, indent=1)

    for results, n in ((a, big), (b, small)):
        ops = [r["ops"] for r in results]
        # Each byte written once; read once, same-sharding or resharded, but for the replicated leaf
        # "b" and the host-local table, which every process reads whole (a direct read is as cheap).
        everywhere = (n - 1) * (4 * 16 + 8 * 6)
        assert sum(o["save"]["bytes_written"] for o in ops) == state_bytes(big), n
        assert sum(o["load"]["bytes_read"] for o in ops) == state_bytes(big) + everywhere, n
        assert sum(o["load_resharded"]["bytes_read"] for o in ops) == state_bytes(big) + everywhere, n
        assert all(o["load_resharded"]["read_once_leaves"] > 0 for o in ops), n
        assert all(o["load"]["calls"] == 0 for o in ops), n  # a same-sharding load talks to no one
        assert all(o["manager"]["steps"] == [2, 3] for o in ops), n
    assert all(r["ops"]["local_restore_other"]["restored_step"] == 2 for r in b[:-1])

    # Coordination per non-primary process: flat from N/2 to N processes.
    for op in FLAT:
        at_big = max(r["ops"][op]["calls"] for r in a[1:])
        at_small = max(r["ops"][op]["calls"] for r in b[1:])
        assert at_big <= 1.2 * at_small, (op, at_small, at_big)

    # The dead peer: every survivor names it, within the peer timeout and 10 s.
    for r in b[:-1]:
        err, seconds = r["ops"]["dead_peer"]["error"], r["ops"]["dead_peer"]["seconds"]
        assert err.startswith("CoordinationError") and f"process {small - 1} " in err, err
        assert seconds < PEER_TIMEOUT + 10, (r["process"], seconds, err)


@pytest.mark.timeout(400)
def test_8_processes_then_4(tmp_path, monkeypatch):
    _scale(tmp_path, monkeypatch, 8)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not os.environ.get("CAIRN_STRESS"), reason="32 processes: make stress (CAIRN_STRESS=1)")
def test_32_processes_then_16(tmp_path, monkeypatch):
    _scale(tmp_path, monkeypatch, 32)
