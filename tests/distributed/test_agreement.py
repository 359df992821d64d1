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


def test_one_sequence_per_kind_numbers_operations_alike_on_every_process():
    """`sequence(name)` is the one counter that names a save's, export's, load's or measurement's
    coordination keys: each kind counts from 0 on its own, and threads never get the same number."""
    import threading
    import uuid

    from cairn._dist.agree import sequence

    a, b = f"test-a-{uuid.uuid4().hex}", f"test-b-{uuid.uuid4().hex}"
    assert [sequence(a), sequence(a), sequence(b), sequence(a)] == [0, 1, 0, 2]
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.extend(sequence(b) for _ in range(200))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(got) == list(range(1, 801))
