"""The training-stack examples under examples/ run and pass their own checks (one subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STACKS = {
    "flax_nnx.py": "flax",
    "flax_linen.py": "flax",
    "equinox_model.py": "equinox",
    "optax_and_keys.py": "optax",
    "grain_iterator.py": "grain",
    "grain_elastic.py": "grain",  # 3 + 2 processes of its own, on 127.0.0.1
}


@pytest.mark.slow
def test_stack_examples_run():
    for module in set(STACKS.values()):
        pytest.importorskip(module)
    script = (
        "import runpy, sys\n"
        "for path in sys.argv[1:]:\n"
        "    runpy.run_path(path, run_name='__main__')\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", script, *(str(EXAMPLES / name) for name in STACKS)],
                       capture_output=True, text=True, timeout=280, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert p.stdout.count("OK:") == len(STACKS), p.stdout
