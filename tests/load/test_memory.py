"""Peak host memory of a blocking save and of a load stays near the state size.

Measured in a fresh subprocess with VmHWM (the high-water mark of resident
memory), reset just before the operation, relative to the resident size then.
(ru_maxrss would not do: it survives exec, so a child inherits the peak of the
forked parent.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import cairn

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS

    def peak():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM")

    mode, path = sys.argv[1], sys.argv[2]
    mesh = jax.make_mesh((8,), ("x",))
    specs = [P("x"), P(None, "x")]
    shape = (2048, 4096)  # 32 MiB per array, 12 arrays = 384 MiB
    shardings = [NamedSharding(mesh, specs[i % 2]) for i in range(12)]
    if mode == "save":
        state = {f"w{i}": jax.device_put(np.full(shape, i, np.float32), shardings[i]) for i in range(12)}
        jax.block_until_ready(state)
        reset_peak()
        before = rss()
        cairn.save(path, {"params": state})
    else:
        target = {f"w{i}": jax.ShapeDtypeStruct(shape, np.float32, sharding=shardings[(i + int(mode == "reshard")) % 2])
                  for i in range(12)}
        x = np.ones(1, np.float32); jax.device_put(x, jax.devices()[0])  # initialise the runtime first
        reset_peak()
        before = rss()
        out = cairn.load(path, {"params": target})
        jax.block_until_ready(out)
    print(json.dumps({"before": before, "peak": peak(), "state": 12 * 2048 * 4096 * 4}))
    """
)


def run(mode, path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(path)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


BUDGET = 64 << 20  # fixed buffers: read/write pieces, checksum blocks, per-thread scratch


@pytest.mark.slow
def test_peak_memory_blocking_save_and_load(tmp_path):
    path = tmp_path / "c"
    r = run("save", path)
    extra = r["peak"] - r["before"]
    assert extra <= 0.10 * r["state"] + BUDGET, f"save used {extra / 2**20:.0f} MiB above its state"
    for mode in ("load", "reshard"):
        r = run(mode, path)
        extra = r["peak"] - r["before"]
        assert extra <= 1.10 * r["state"] + BUDGET, f"{mode} used {extra / 2**20:.0f} MiB for a {r['state'] / 2**20:.0f} MiB state"
