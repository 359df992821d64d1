"""Grain across processes, elastic: iterator states saved by 3 processes, resumed on 2.

    python examples/grain_elastic.py

Process p of n reads its shard of one global order: elements start + p,
start + p + n, ... . The processes step in lockstep, so after k steps the first
start + k * n elements are read. The checkpoint holds each process's iterator
state, declared with `cairn.PerProcess`. Restored on another number of
processes, the `reshard` hook turns the saved states into a new start and
fresh iterators for the new shards. The script runs both phases as real
processes on 127.0.0.1 (`jax.distributed`) and checks that the elements read
before and after the restore are the global order, none skipped or repeated.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any

import grain

TOTAL = 60  # elements in the global order
STEPS = 4  # steps before the checkpoint


def shard(start: int, index: int, count: int) -> grain.IterDataset:
    """Process `index` of `count`: every count-th element from start + index."""
    return grain.MapDataset.range(start + index, TOTAL, count).to_iter_dataset()


def reshard(saved: list[dict[str, Any]], index: int, count: int) -> dict[str, Any]:
    """The saved per-process states (one per old process) -> this process's new state."""
    steps = min(s["iter"]["next_index"] for s in saved)  # equal in lockstep; the least re-reads, never skips
    start = saved[0]["start"] + steps * len(saved)  # the first element no old process had reached
    return {"start": start, "iter": iter(shard(start, index, count)).get_state()}


def worker(phase: str, index: int, count: int, port: int, directory: str) -> None:
    import jax

    addr = f"127.0.0.1:{port}"
    jax.distributed.initialize(addr, count, index, coordinator_bind_address=addr, initialization_timeout=60)
    import cairn

    path = f"{directory}/step_{STEPS}"
    if phase == "save":
        it = iter(shard(0, index, count))
        seen = [int(next(it)) for _ in range(STEPS)]
        cairn.save(path, {"data": cairn.PerProcess({"start": 0, "iter": it.get_state()}), "step": STEPS})
    else:
        restored = cairn.load(path, {"data": cairn.PerProcess(reshard=reshard), "step": None})
        state = restored["data"].value
        it = iter(shard(state["start"], index, count))
        it.set_state(state["iter"])
        seen = [int(x) for x in it]  # to the end of this process's new shard
    with open(f"{directory}/{phase}-{index}.json", "w") as f:
        json.dump(seen, f)
    jax.distributed.shutdown()


def run_phase(phase: str, count: int, directory: str) -> list[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", phase, str(i), str(count), str(port), directory],
                              env=env) for i in range(count)]
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * count, f"{phase}: exit codes {codes}"
    seen: list[int] = []
    for i in range(count):
        with open(f"{directory}/{phase}-{i}.json") as f:
            seen += json.load(f)
    return sorted(seen)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        before = run_phase("save", 3, tmp)
        after = run_phase("restore", 2, tmp)
    print(f"3 processes read {len(before)} elements and saved; 2 processes read the other {len(after)}")
    assert before == list(range(3 * STEPS)), before
    assert after == list(range(3 * STEPS, TOTAL)), after
    print("OK: resumed on 2 processes where 3 stopped, no element skipped or read twice")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        main()
