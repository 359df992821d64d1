"""Format version 5 across processes (docs/FORMAT.md §6.6): the primary writes the manifest, and learns from
every process's status whether its part holds a blosc2 block or a sparse delta."""

from __future__ import annotations

import json

import numpy as np
import pytest

import cairn


@pytest.mark.slow
def test_a_sparse_delta_of_another_process_makes_the_manifest_version_5(tmp_path):
    from _mp import run

    run(2, "version_scenarios:sparse_on_the_last", {"directory": str(tmp_path)}, devices_per_process=2,
        timeout=240)
    manifest = {n: json.loads((tmp_path / n / "manifest.json").read_bytes()) for n in ("a", "b")}
    assert manifest["a"]["version"] == 4 and manifest["b"]["version"] == 5
    # Only process 1 wrote data in `b` (its delta); process 0's part is references alone.
    own = sorted(p.name.split("-")[0] for p in (tmp_path / "b").glob("*/*.bin") if p.stat().st_size)
    assert own == ["p00001"]
    (index,) = (tmp_path / "b").glob("*/index.*.json")
    assert json.loads(index.read_bytes())["version"] == 4
    want = np.arange(4 * 2048 * 256, dtype=np.float32).reshape(4 * 2048, 256)
    want[-1, [3, 100, 200]] = -1.0
    assert np.asarray(cairn.load(tmp_path / "b")["w"]).tobytes() == want.tobytes()
