"""Multi-process decisions of the CheckpointManager are made once and shared (real processes)."""

from __future__ import annotations

import pytest

from _mp import run

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_fallback_and_listing_agree_across_processes(tmp_path):
    # Process 1 alone reads the corrupt chunk of step 2 (its own shards): both processes
    # fall back to step 1 together. Process 1's directory listing is then made empty;
    # latest_step is still the primary's, 2, on both.
    out = run(2, "manager_agreement", {"directory": str(tmp_path / "run"), "mesh": [2, 2]}, timeout=180)
    assert [r["restored"] for r in out] == [1, 1], out
    assert [r["latest"] for r in out] == [2, 2], out
