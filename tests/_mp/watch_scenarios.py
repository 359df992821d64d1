"""Multi-process evaluator scenarios for tests/manager/test_watch.py (run by tests/_mp/worker.py)."""

from __future__ import annotations

import os

import numpy as np

import cairn
from cairn._dist.coord import SingleProcess, default_coordinator
from cairn._run.leases import LEASE_DIR


def _state(step: int) -> dict:
    return {"w": np.full(16, float(step), np.float32), "step": step}


def evaluate_together(directory: str) -> dict:
    """Every process evaluates through one read-only manager; process 0 is also a one-process trainer.

    While both processes hold their leases on step s, the trainer saves s + 1 with
    max_to_keep=1: retention must spare s. Every process must be handed the same steps.
    """
    coord = default_coordinator()
    ev = cairn.CheckpointManager(directory, read_only=True)
    trainer = None
    if coord.process_index == 0:
        trainer = cairn.CheckpointManager(directory, max_to_keep=1, async_save=False, handle_sigterm=False,
                                          coordinator=SingleProcess())
        trainer.save(0, _state(0))
    coord.barrier("watch/saved0", 60)
    assert ev.wait_for_step(timeout=0) == 0
    got, during = [], []
    for step in ev.new_steps(timeout=1.0, poll_s=0.05):
        state = ev.restore(step)
        assert state["step"] == step and np.array_equal(state["w"], _state(step)["w"]), step
        got.append(step)
        coord.barrier(f"watch/loaded{step}", 60)
        if trainer is not None and step < 2:
            leases = sorted(n for n in os.listdir(os.path.join(directory, LEASE_DIR)) if n.endswith(".lease"))
            assert len(leases) == 2 and all(n.startswith(f"step_{step:08d}.") for n in leases), leases
            trainer.save(step + 1, _state(step + 1))
            during.append(trainer.steps())
        coord.barrier(f"watch/next{step}", 60)
    final = None
    if trainer is not None:
        trainer.save(3, _state(3))
        final = trainer.steps()
        trainer.close()
    ev.close()
    return {"got": got, "during": during, "final": final}
