"""Smoke test of an installed cairn wheel, run by .ci/wheel in a clean venv that has no JAX.

    python -I .ci/wheel_smoke.py DISTRIBUTION VERSION SOURCE_DIR WORK_DIR

Checks that `import cairn` comes from the venv's site-packages (the wheel), not from SOURCE_DIR
(the checkout), that the installed distribution has the expected name and version, and saves,
loads, compresses and manages a small state with numpy alone. Exits non-zero, saying what
differed, on the first failure.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import sysconfig
from pathlib import Path


def check(ok: object, what: str) -> None:
    if not ok:
        sys.exit(f"wheel smoke test FAILED: {what}")


def main() -> None:
    dist_name, version, source, work = sys.argv[1], sys.argv[2], Path(sys.argv[3]).resolve(), Path(sys.argv[4])
    check(importlib.util.find_spec("jax") is None, "jax is importable here; this test is meant to run without it")

    import cairn

    where = Path(cairn.__file__).resolve()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    check(where.is_relative_to(site), f"cairn was imported from {where}, not from the venv's {site}")
    check(not where.is_relative_to(source), f"cairn was imported from the source tree ({where})")
    dist = importlib.metadata.distribution(dist_name)
    check(dist.version == version == cairn.__version__,
          f"versions differ: distribution {dist_name} {dist.version}, expected {version}, "
          f"cairn.__version__ {cairn.__version__}")
    files = {str(f) for f in dist.files or ()}
    check("cairn/__init__.py" in files, f"{dist_name}'s RECORD does not list cairn/__init__.py")
    scripts = [ep for ep in dist.entry_points if ep.group == "console_scripts" and ep.name == "cairn"]
    check(scripts and scripts[0].value == "cairn._cli.main:main", f"console script 'cairn' is {scripts}")

    import ml_dtypes
    import numpy as np

    state = {
        "params": {"w": np.arange(48, dtype=np.float32).reshape(6, 8),
                   "b": np.linspace(-1, 1, 8).astype(ml_dtypes.bfloat16)},
        "step": 7,
        "data": b"iterator-state",
        "config": {"lr": 3e-4, "name": "smoke"},
    }
    ckpt = work / "ckpt" / "step_7"
    cairn.save(str(ckpt), state)
    got = cairn.load(str(ckpt))
    check(np.array_equal(got["params"]["w"], state["params"]["w"]), "params/w differs after a round trip")
    check(got["params"]["b"].dtype == state["params"]["b"].dtype
          and np.array_equal(got["params"]["b"].view(np.uint16), state["params"]["b"].view(np.uint16)),
          "params/b (bfloat16) differs after a round trip")
    check((got["step"], got["data"], got["config"]) == (7, b"iterator-state", state["config"]),
          f"plain values differ: {got['step']!r} {got['data']!r} {got['config']!r}")
    check(cairn.metadata(str(ckpt))["params"]["w"].shape == (6, 8), "metadata shape of params/w")

    # the codecs (zstandard, byte planes) that the wheel's dependencies bring
    big = {"x": np.tile(np.arange(4096, dtype=np.float32), 64)}
    for codec in ("zstd", "planes"):
        path = work / f"ckpt_{codec}"
        cairn.save(str(path), big, compression=codec)
        check(np.array_equal(cairn.load(str(path))["x"], big["x"]), f"compression={codec!r} round trip")

    run = work / "run"
    with cairn.CheckpointManager(str(run), max_to_keep=2, async_save=False) as mgr:
        for step in range(3):
            mgr.save(step, {"w": np.full(4, step, np.int32)})
    with cairn.CheckpointManager(str(run), read_only=True) as mgr:
        check(mgr.steps() == [1, 2], f"manager steps {mgr.steps()}, expected [1, 2]")
        check(np.array_equal(mgr.restore()["w"], np.full(4, 2, np.int32)), "manager restore of step 2")

    check("jax" not in sys.modules, "something imported jax")
    print(f"wheel smoke test passed: {dist_name} {dist.version} from {where.parent}")


if __name__ == "__main__":
    main()
