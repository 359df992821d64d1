"""Soak: the memory of a loop that async-saves every step stays flat and within its snapshot buffers.

Runs the soak probe (`benchmarks/probes/soak.py`: two subprocesses, the same donating train loop with
and without `CheckpointManager(max_to_keep=2)` saving every step). Under
`make stress` (CAIRN_STRESS=1) it is a loop of 16 leaves of 8 MiB,
1,000 steps; otherwise a short one. Target: RSS of the saving loop <= the
no-save loop + two snapshots (the saves that may be in flight) + 10%, and no
growth between the first and the last reported step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_rss_of_a_save_every_step_loop_is_flat_and_bounded(tmp_path):
    stress = bool(os.environ.get("CAIRN_STRESS"))
    steps, report = (1000, "100,500,1000") if stress else (150, "50,100,150")
    out = tmp_path / "soak.json"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    p = subprocess.run(
        [sys.executable, "-m", "benchmarks.probe", "soak", "--steps", str(steps), "--report", report, "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3500,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(out.read_text())
    rss, state = res["rss"], res["state_bytes"]
    marks = report.split(",")
    for k in marks:
        limit = (rss["nosave"][k] + 2 * state) * 1.1
        assert rss["save"][k] <= limit, (k, rss, p.stdout)
    growth = rss["save"][marks[-1]] - rss["save"][marks[0]]
    assert growth <= state // 4, (growth, rss, p.stdout)
