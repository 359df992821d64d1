"""A trainer and an evaluator on one manager directory, for tests/manager/test_watch.py.

Usage: watch_pair.py train|eval SPEC_JSON

SPEC: {"dir", "options" (storage options or null), "steps" (how many the
trainer saves: 0 .. steps-1), "keep" (max_to_keep), "sleep_s" (between
saves), "hold_s" (how long the evaluator holds each step), "poll_s",
"ttl_s"}.

The trainer saves `expected(step)` for each step (async), logging cairn's
retention decisions to stderr. The evaluator prints "ready", then for each
step `new_steps` hands it: loads it, checks every value, holds it `hold_s`,
and prints "loaded <step>"; it stops after the last step (exit 0), and exits
2 with a message on the first step it cannot load or that is wrong.
"""

import json
import logging
import sys
import time

import numpy as np

import cairn


def expected(step: int) -> dict:
    return {"w": np.full((64, 64), float(step), np.float32), "b": np.arange(16) * step, "step": step,
            "tag": f"step-{step}".encode()}


def train(spec: dict) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    with cairn.CheckpointManager(spec["dir"], max_to_keep=spec["keep"], storage_options=spec["options"],
                                 handle_sigterm=False) as mgr:
        for step in range(spec["steps"]):
            mgr.save(step, expected(step))
            print("saved", step, flush=True)
            time.sleep(spec["sleep_s"])
    print("done", flush=True)


def evaluate(spec: dict) -> None:
    ev = cairn.CheckpointManager(spec["dir"], read_only=True, storage_options=spec["options"])
    print("ready", flush=True)
    last = spec["steps"] - 1
    seen = []
    for step in ev.new_steps(timeout=60, poll_s=spec["poll_s"], lease_ttl_s=spec["ttl_s"]):
        if seen and step <= seen[-1]:
            sys.exit(f"new_steps handed step {step} after step {seen[-1]}")
        try:
            state = ev.restore(step)
        except Exception as e:  # the failure this test exists to rule out
            sys.exit(f"could not load step {step} that new_steps handed out: {type(e).__name__}: {e}")
        want = expected(step)
        if not (np.array_equal(state["w"], want["w"]) and np.array_equal(state["b"], want["b"])
                and state["step"] == step and state["tag"] == want["tag"]):
            sys.exit(f"step {step} loaded wrong values")
        seen.append(step)
        print("loaded", step, flush=True)
        time.sleep(spec["hold_s"])  # the lease is held meanwhile; the trainer keeps saving
        if step == last:
            break
    if not seen or seen[-1] != last:
        sys.exit(f"the evaluator stopped at {seen[-1:] or 'nothing'} before the last step {last}")
    ev.close()


if __name__ == "__main__":
    {"train": train, "eval": evaluate}[sys.argv[1]](json.loads(sys.argv[2]))
