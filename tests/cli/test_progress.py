"""Progress of long work: "progress" events for the listeners that ask (`cairn.add_listener(fn,
progress=True)`) from copies, conversions and exports, and the CLI's bar for cp / mv of a run directory
and for convert (drawn on a terminal; none when stderr is no terminal, or with --quiet)."""

from __future__ import annotations

import numpy as np
import pytest

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


# ---------------------------------------------------------------------- convert and the exports


def _saved(tmp_path):
    """A checkpoint of two checkpointables whose arrays hold `nbytes`, and that number."""
    x = np.random.default_rng(1).standard_normal((4, 1 << 15)).astype(np.float32)
    state = {"params": {"w": x, "b": np.arange(100, dtype=np.int64)}, "step": 3}
    cairn.save(str(tmp_path / "ck"), state)
    return str(tmp_path / "ck"), x.nbytes + 800


def _safetensors_file(tmp_path):
    """A plain safetensors file (not written by cairn): what `cairn convert --to cairn` starts from."""
    from safetensors.numpy import save_file

    arrays = {"a": np.ones((256, 64), np.float32), "b": np.arange(1000, dtype=np.int16)}
    save_file(arrays, str(tmp_path / "plain.safetensors"))
    return str(tmp_path / "plain.safetensors"), sum(a.nbytes for a in arrays.values())


def _run_export(kind, tmp_path, **kw):
    """Run one conversion; returns (op its events should name, destination, array bytes)."""
    from cairn._exports.convert import convert_to_cairn
    from cairn._exports.safetensors import from_safetensors, to_safetensors
    from cairn._exports.statedict import to_torch_file

    pytest.importorskip({"torch": "torch", "orbax": "orbax.checkpoint"}.get(kind, "safetensors"))
    dst = str(tmp_path / f"out_{kind}")
    if kind == "convert":  # a foreign file through the generic path
        src, nbytes = _safetensors_file(tmp_path)
        convert_to_cairn(src, dst, **kw)
        return "convert", dst, nbytes
    src, nbytes = _saved(tmp_path)
    if kind == "from_safetensors":  # cairn's own safetensors back into cairn
        to_safetensors(src, str(tmp_path / "mid.safetensors"), item="params")
        from_safetensors(str(tmp_path / "mid.safetensors"), dst, **kw)
        return "convert", dst, nbytes
    if kind == "to_safetensors":
        to_safetensors(src, dst + ".safetensors", item="params", **kw)
        return "export_safetensors", dst + ".safetensors", nbytes
    if kind == "export_safetensors":
        cairn.export_safetensors(src, dst, item="params", max_shard_size="64KB", **kw)
        return "export_safetensors", dst, nbytes
    if kind == "torch":
        to_torch_file(src, dst + ".pt", **kw)
        return "export_torch", dst + ".pt", nbytes
    cairn.export_orbax(src, dst, **kw)
    return "export_orbax", dst, 2 * nbytes  # read, then written: Orbax's save reports nothing itself


KINDS = ["convert", "from_safetensors", "to_safetensors", "export_safetensors", "torch", "orbax"]


@pytest.mark.parametrize("kind", KINDS)
def test_convert_and_exports_report_progress(kind, tmp_path, monkeypatch):
    monkeypatch.setattr(_stats, "PROGRESS_INTERVAL", 0.0)  # every advance publishes
    events, totals, steps = [], [], []
    fn = cairn.add_listener(events.append, progress=True)
    try:
        op, dst, nbytes = _run_export(kind, tmp_path, on_total=totals.append, progress=steps.append)
    finally:
        cairn.remove_listener(fn)
    assert totals == [nbytes]  # the total, once, before any bytes
    assert sum(steps) == nbytes  # every array byte counted, none twice
    prog = [e.stats for e in events if e.kind == "progress" and e.path == dst]
    assert prog and all(p.op == op for p in prog), [(e.path, e.stats.op) for e in events]
    assert prog[-1].finished and not any(p.finished for p in prog[:-1])
    assert prog[-1].bytes_done == prog[-1].bytes_total == nbytes
    assert [p.bytes_done for p in prog] == sorted(p.bytes_done for p in prog)
    assert all(p.bytes_total == nbytes for p in prog)


def _recording_output(monkeypatch):
    """The CLI's `Output.progress` replaced by one that records what a bar would be given."""
    import contextlib

    from cairn._cli import main as cli

    seen = []

    @contextlib.contextmanager
    def progress(self, description, total):
        rec = {"description": description, "total": total, "done": 0}
        seen.append(rec)

        def set_total(n):
            rec["total"] = n

        def advance(n):
            rec["done"] += n

        yield set_total, advance

    monkeypatch.setattr(cli.Output, "progress", progress)
    return seen


@pytest.mark.parametrize("to", ["safetensors", "torch", "orbax", "cairn"])
def test_cli_convert_feeds_its_bar_the_total_and_every_byte(to, tmp_path, monkeypatch):
    pytest.importorskip({"torch": "torch", "orbax": "orbax.checkpoint"}.get(to, "safetensors"))
    seen = _recording_output(monkeypatch)
    if to == "cairn":
        src, nbytes = _safetensors_file(tmp_path)
    else:
        src, nbytes = _saved(tmp_path)
    if to == "orbax":
        nbytes *= 2
    extra = ["--item", "params"] if to == "safetensors" else []
    assert main(["convert", src, str(tmp_path / f"out.{to}"), "--to", to, *extra]) == 0
    assert seen == [{"description": f"converting to {to}", "total": nbytes, "done": nbytes}]


def test_cli_convert_shows_no_bar_without_a_terminal_or_with_quiet(tmp_path, capsys):
    pytest.importorskip("torch")
    src, _ = _saved(tmp_path)
    assert main(["convert", src, str(tmp_path / "a.safetensors"), "--to", "safetensors", "--item", "params"]) == 0
    out = capsys.readouterr()
    assert "wrote" in out.out and out.err == ""
    assert main(["--quiet", "convert", src, str(tmp_path / "b.pt"), "--to", "torch"]) == 0
    out = capsys.readouterr()
    assert "wrote" in out.out and out.err == ""


def test_cli_convert_draws_a_bar_on_a_terminal(tmp_path):
    """`cairn convert` run with its stderr on a pseudo-terminal draws the bar there, and not with --quiet."""
    import os
    import pty
    import subprocess
    import sys

    pytest.importorskip("rich")  # the bar is rich's
    pytest.importorskip("torch")
    src, _ = _saved(tmp_path)
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}

    def run(*flags):
        import threading

        leader, follower = pty.openpty()
        chunks: list[bytes] = []

        def drain():  # read while the child runs, so that it never blocks on a full terminal
            while True:
                try:
                    chunk = os.read(leader, 1 << 16)
                except OSError:  # the terminal closed
                    return
                if not chunk:
                    return
                chunks.append(chunk)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        try:
            proc = subprocess.run([sys.executable, "-m", "cairn._cli", *flags, "convert", src,
                                   str(tmp_path / f"o{len(flags)}.pt"), "--to", "torch"],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower, env=env,
                                  timeout=120)
        finally:
            os.close(follower)
            reader.join(timeout=30)
            os.close(leader)
        err = b"".join(chunks).decode(errors="replace")
        assert proc.returncode == 0, err
        return err

    assert "converting to torch" in run()
    assert "converting to" not in run("--quiet")
