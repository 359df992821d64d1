"""Progress of long work: "progress" events for the listeners that ask (`cairn.add_listener(fn,
progress=True)`), and the CLI's bar for cp / mv of a run directory (none when stderr is no terminal)."""

from __future__ import annotations

import numpy as np

import cairn
from cairn._cli.main import main
from cairn._core import stats as _stats


def _save(path, n=3):
    x = np.random.default_rng(0).standard_normal((n, 1 << 16)).astype(np.float32)
    cairn.save(str(path), {"x": x, "y": np.arange(7)})
    return x


def test_copy_reports_progress_to_the_listeners_that_ask(tmp_path, monkeypatch):
    monkeypatch.setattr(_stats, "PROGRESS_INTERVAL", 0.0)  # every advance publishes
    _save(tmp_path / "a")
    events, plain = [], []
    fn = cairn.add_listener(events.append, progress=True)
    other = cairn.add_listener(plain.append)
    try:
        stats = cairn.copy(str(tmp_path / "a"), str(tmp_path / "b"))
    finally:
        cairn.remove_listener(fn)
        cairn.remove_listener(other)
    prog = [e for e in events if e.kind == "progress"]
    assert prog and all(isinstance(e.stats, cairn.ProgressStats) for e in prog)
    assert all(e.path == str(tmp_path / "b") and e.stats.op == "copy" for e in prog)
    last = prog[-1].stats
    assert last.finished and not any(e.stats.finished for e in prog[:-1])
    # every byte counted (copy's count also takes in the manifest, which its total leaves out)
    assert last.bytes_total is not None and last.bytes_total <= last.bytes_done <= last.bytes_total + 4096
    assert last.bytes_done == stats.bytes_copied
    done = [e.stats.bytes_done for e in prog]
    assert done == sorted(done)  # it only grows
    assert last.eta_s == 0.0 and last.gib_per_s > 0
    assert not [e for e in plain if e.kind == "progress"]  # a plain listener gets none
    cairn.remove_listener(fn)  # removing twice is harmless


def test_progress_is_throttled(monkeypatch):
    monkeypatch.setattr(_stats, "PROGRESS_INTERVAL", 3600.0)
    events = []
    fn = cairn.add_listener(events.append, progress=True)
    try:
        p = _stats.Progress("copy", "/x")
        total, step = p.wrap(None, None)
        total(100)
        for _ in range(100):
            step(1)
        assert events == []  # nothing within the interval...
        p.finish()
    finally:
        cairn.remove_listener(fn)
    assert [(e.stats.bytes_done, e.stats.bytes_total, e.stats.finished) for e in events] == [(100, 100, True)]


def test_cp_of_a_run_directory_shows_no_bar_without_a_terminal(tmp_path, capsys):
    for step in (10, 20):
        _save(tmp_path / "run" / f"step_{step:08d}")
    assert main(["cp", str(tmp_path / "run"), str(tmp_path / "copy")]) == 0
    out = capsys.readouterr()
    assert "copied 2 committed steps" in out.out
    assert out.err == ""  # stderr is no terminal here: no bar
    for step in (10, 20):
        got = cairn.load(str(tmp_path / "copy" / f"step_{step:08d}"))
        np.testing.assert_array_equal(got["y"], np.arange(7))
    assert main(["--quiet", "mv", str(tmp_path / "copy"), str(tmp_path / "moved")]) == 0
    out = capsys.readouterr()
    assert "moved 2 committed steps" in out.out and out.err == ""
