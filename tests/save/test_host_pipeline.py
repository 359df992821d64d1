"""A blocking save's host-copy pipeline (`snapshot.HostPipeline`) and the grouped codec choosing of
small leaves (`codecpolicy._groups`).

The pipeline starts device-to-host copies ahead of the writers: in the order they take the chunks,
within a byte budget, each chunk at most once, and its failures reach the save. On this CPU-only
host a device chunk's copy is forced (`codecpolicy.fresh_copy`) so the pipeline runs on CPU arrays; the
copies are counted by wrapping the function that starts them. Nothing here depends on timing: the
threads in these tests wait on each other with timeouts, never on the clock.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest

import cairn
from cairn._save import codecpolicy, engine
from cairn._save import pipeline as block_pipeline
from cairn._save.snapshot import HostPipeline


def trained(shape, dtype: Any = ml_dtypes.bfloat16, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 0.02).astype(dtype)


class Starts:
    """A stand-in for `shardings.start_to_host`: records each batch, returns the arrays as their 'transfers'."""

    def __init__(self, fail_at: int | None = None):
        self.batches: list[list[Any]] = []
        self.fail_at = fail_at
        self.lock = threading.Lock()

    def __call__(self, srcs: list[Any]) -> list[Any]:
        with self.lock:
            self.batches.append(list(srcs))
            if self.fail_at is not None and len(self.batches) > self.fail_at:
                raise RuntimeError("transfer refused by the device")
        return [("host", s) for s in srcs]

    @property
    def started(self) -> list[Any]:
        return [s for b in self.batches for s in b]


def pipeline(sizes: list[int], budget: int, starts: Starts) -> HostPipeline:
    keys = [("x", (i, 0)) for i in range(len(sizes))]
    pipe = HostPipeline(keys, sizes, [f"dev{i}" for i in range(len(sizes))], budget, start=starts)
    pipe.fill()
    return pipe


def test_copies_start_in_order_within_the_budget_each_once():
    starts = Starts()
    pipe = pipeline([10] * 10, 35, starts)
    assert starts.started == ["dev0", "dev1", "dev2"]  # 30 bytes fit in 35, a fourth would not
    for i in range(10):
        assert pipe.take(("x", (i, 0))) == ("host", f"dev{i}")
        assert pipe.max_held <= 35
    assert starts.started == [f"dev{i}" for i in range(10)]  # in order, none twice
    assert pipe.started == 10 and pipe.take(("x", (3, 0))) is None  # taken already: the caller has it


def test_a_chunk_larger_than_the_budget_still_moves_alone():
    starts = Starts()
    pipe = pipeline([100, 5, 5], 10, starts)
    assert starts.batches == [["dev0"]]
    assert pipe.take(("x", (0, 0))) == ("host", "dev0")
    assert starts.batches[1] == ["dev1", "dev2"]


def test_a_consumer_ahead_of_the_budget_copies_itself_and_the_pipeline_skips_it():
    """A writer (take) or the codec choosing (peek) that comes to a chunk not started gets None and copies
    it itself; the pipeline never starts that chunk. A peeked transfer is the one its take gets."""
    starts = Starts()
    pipe = pipeline([10] * 6, 20, starts)
    assert pipe.peek(("x", (0, 0))) == ("host", "dev0")  # started: a look keeps it for the writer
    assert pipe.take(("x", (4, 0))) is None  # not started: the writer's own
    assert pipe.peek(("x", (3, 0))) is None  # likewise the codec choosing's
    assert ("x", (4, 0)) not in pipe and ("x", (3, 0)) not in pipe
    for i in (0, 1, 2, 5):
        assert pipe.take(("x", (i, 0))) == ("host", f"dev{i}")
    assert starts.started == ["dev0", "dev1", "dev2", "dev5"]


def test_a_failure_to_start_reaches_every_consumer_of_its_chunks():
    starts = Starts(fail_at=1)
    pipe = pipeline([10] * 4, 10, starts)
    box: list[BaseException] = []
    gate = threading.Event()

    def other() -> None:
        gate.wait(timeout=30)
        try:
            pipe.take(("x", (1, 0)))
        except BaseException as e:  # what the test looks at
            box.append(e)

    with pytest.raises(RuntimeError, match="refused"):
        pipe.take(("x", (0, 0)))  # its take starts the next batch, which fails
    t = threading.Thread(target=other)
    t.start()
    gate.set()
    t.join(timeout=30)
    assert len(box) == 1 and "refused" in str(box[0])
    pipe.close()


def test_concurrent_consumers_take_every_chunk_once():
    """Four writers over their own chunks, in their own order, with the budget smaller than their sum:
    every chunk reaches its writer once (a transfer, or None where the writer was ahead), none is
    started twice, the budget holds."""
    starts = Starts()
    sizes = [7 + i % 5 for i in range(200)]
    pipe = pipeline(sizes, 60, starts)
    got: dict[int, Any] = {}
    lock = threading.Lock()

    def writer(w: int) -> None:
        for i in range(w, 200, 4):
            x = pipe.take(("x", (i, 0)))
            with lock:
                got[i] = x

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(got) == list(range(200))
    started = starts.started
    assert len(started) == len(set(started))
    assert all(got[i] in (None, ("host", f"dev{i}")) for i in range(200))
    assert {f"dev{i}" for i in range(200) if got[i] is not None} == set(started)
    assert pipe.max_held <= 60


@pytest.fixture
def counted(monkeypatch):
    """Device chunks forced to count as fresh copies (as on an accelerator); each batch the pipeline
    starts recorded."""
    from cairn._tree import shardings

    monkeypatch.setattr(codecpolicy, "fresh_copy", lambda src: not isinstance(src, np.ndarray))
    real = shardings.start_to_host
    batches: list[list[Any]] = []

    def start(arrays, method=None):
        batches.append(list(arrays))
        return real(arrays, method)

    monkeypatch.setattr(shardings, "start_to_host", start)
    return batches


def state_of() -> dict[str, Any]:
    return {"params": {f"w{i}": jax.numpy.asarray(trained((64, 128), seed=i)) for i in range(6)},
            "opt": {f"m{i}": jax.numpy.asarray(trained((32, 128), np.float32, seed=10 + i)) for i in range(6)}}


@pytest.mark.parametrize("compression", [False, True])
def test_a_blocking_save_through_the_pipeline_writes_what_it_would_without(tmp_path, monkeypatch, counted,
                                                                           compression):
    """The same files, byte for byte, with the pipeline (a budget of a few chunks) and without; every
    device chunk started at most once; values come back."""
    from cairn._save import snapshot

    state = state_of()
    held: list[int] = []
    fill = snapshot.HostPipeline.fill

    def watched(self):
        fill(self)
        held.append(self.max_held)

    monkeypatch.setattr(snapshot.HostPipeline, "fill", watched)
    files = {}
    for budget in (0, 40 << 10):
        monkeypatch.setattr(engine, "HOST_PIPELINE_BYTES", budget)
        counted.clear()
        path = tmp_path / f"b{budget}"
        cairn.save(path, state, compression=compression)
        started = [id(a) for b in counted for a in b]
        assert len(started) == len(set(started))
        if budget:
            assert started and len(started) <= 12
            assert held and max(held) <= budget
        else:
            assert not counted
        files[budget] = sorted(p.read_bytes() for p in path.glob("*/*.bin"))
        back = cairn.load(path)
        for name, sub in state.items():
            for k, v in sub.items():
                np.testing.assert_array_equal(np.asarray(back[name][k]), np.asarray(v))
    assert files[0] == files[40 << 10]


def test_a_transfer_that_cannot_start_fails_the_save(tmp_path, monkeypatch, counted):
    from cairn._tree import shardings

    def refuse(arrays, method=None):
        raise RuntimeError("device-to-host transfer refused")

    monkeypatch.setattr(shardings, "start_to_host", refuse)
    with pytest.raises(Exception, match="refused"):
        cairn.save(tmp_path / "c", state_of(), compression=True)
    assert not (tmp_path / "c").exists()


def test_a_save_async_snapshot_is_not_piped_again(tmp_path, counted):
    """save_async's snapshot started every copy already (or, over its budget, made device copies its
    writers bring over one at a time, within that budget): the pipeline starts nothing more."""
    state = state_of()
    cairn.save_async(tmp_path / "a", state, compression=True).result(timeout=60)
    n = len(counted)
    cairn.save_async(tmp_path / "b", state, compression=True, snapshot_budget_bytes=0).result(timeout=60)
    assert len(counted) == n


# ------------------------------------------------------------------ small leaves: one decision per group


def test_small_leaves_alike_are_measured_once_per_group(tmp_path, monkeypatch):
    """Runs of small leaves of one dtype and size class share one decision, GROUP_LEAVES at most each;
    a leaf of another dtype or size, or a large one, starts its own; GROUP_LEAVES = 1 measures each
    leaf alone (as before). The stored values are the same."""
    calls: list[int] = []
    real = codecpolicy.leaf_codec

    def leaf_codec(mode, dtype, host, *a, **kw):
        calls.append(host.nbytes)
        return real(mode, dtype, host, *a, **kw)

    monkeypatch.setattr(codecpolicy, "leaf_codec", leaf_codec)
    monkeypatch.setattr(codecpolicy, "GROUP_LEAVES", 8)
    state = {"params": {**{f"a{i:02d}": trained((64, 64), seed=i) for i in range(20)},  # 8 KiB bf16: 8 + 8 + 4
                        "b": trained((64, 128), seed=50),  # 16 KiB: its own size class
                        **{f"c{i}": trained((64, 64), np.float32, seed=60 + i) for i in range(3)},  # f32
                        "big": trained((1024, 1024), seed=70)}}  # 2 MiB: alone
    cairn.save(tmp_path / "g", state, compression=True)
    assert len(calls) == 3 + 1 + 1 + 1, calls
    from cairn._load.source import open_checkpoint

    index = open_checkpoint(str(tmp_path / "g")).indexes["params"]
    if index.table is not None:
        index.table.fetch_all()
    codecs = {str(leaf.path).rsplit("/", 1)[-1].strip("'\"]"): leaf.codec for leaf in index.leaves}
    assert len({codecs[f"a{i:02d}"] for i in range(8)}) == 1
    calls.clear()
    monkeypatch.setattr(codecpolicy, "GROUP_LEAVES", 1)
    cairn.save(tmp_path / "one", state, compression=True)
    assert len(calls) == 25
    back = cairn.load(tmp_path / "g")["params"]
    for k, v in state["params"].items():
        np.testing.assert_array_equal(np.asarray(back[k]), v)


def test_groups_cut_runs_by_dtype_size_class_and_count(monkeypatch):
    monkeypatch.setattr(codecpolicy, "GROUP_LEAVES", 3)
    bf, f4 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)

    def t(n, dt):
        return ({}, 0, np.zeros(n // dt.itemsize, dt), dt, None)

    todo = [t(1000, bf)] * 4 + [t(1000, f4), t(1000, f4), t(3000, f4), t(2 << 20, bf), t(2 << 20, bf)]
    sizes = [len(g) for g in codecpolicy._groups(todo)]
    assert sizes == [3, 1, 2, 1, 1, 1]
    assert codecpolicy._picked(1) == [0] and codecpolicy._picked(64) == [0, 21, 42, 63] and codecpolicy._picked(3) == [0, 1, 2]


def test_a_leaf_is_coded_while_a_later_leaf_of_its_file_is_still_measured(tmp_path, monkeypatch):
    """Codecs chosen in the background release each leaf to its writer as it is measured, not each file
    once all its leaves are: leaf "b"'s measuring waits (up to 30 s) for "a", before it in the same
    file, to be coded. (Released per file, "a" would wait for "b": the wait would time out.)"""
    monkeypatch.setattr(codecpolicy, "coder_cores", lambda: 4)
    monkeypatch.setattr(codecpolicy, "GROUP_LEAVES", 1)
    coded_a = threading.Event()
    seen: list[bool] = []
    code, choose = block_pipeline.code_task, codecpolicy._choose_leaf

    def code_task(task, *args):
        coded_a.set()  # "b" is not measured yet, so whatever is coded first is "a"'s
        return code(task, *args)

    def choose_leaf(job, first, dtype):
        if np.asarray(first).shape == (128, 96):  # "b"
            seen.append(coded_a.wait(timeout=30))
        return choose(job, first, dtype)

    monkeypatch.setattr(block_pipeline, "code_task", code_task)
    monkeypatch.setattr(codecpolicy, "_choose_leaf", choose_leaf)
    state = {"a": trained((128, 128)), "b": trained((128, 96), seed=1)}
    cairn.save(tmp_path / "c", {"params": state}, compression=True)
    assert seen == [True]
    back = cairn.load(tmp_path / "c")["params"]
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(back[k]), v)


def test_copies_start_in_batches_of_at_most_batch_bytes(monkeypatch):
    from cairn._save import snapshot

    monkeypatch.setattr(snapshot, "BATCH_BYTES", 20)
    starts = Starts()
    pipe = pipeline([10] * 5, 45, starts)
    assert starts.batches == [["dev0", "dev1"], ["dev2", "dev3"]]
    for i in range(5):
        assert pipe.take(("x", (i, 0))) == ("host", f"dev{i}")
    assert starts.started == [f"dev{i}" for i in range(5)]


def test_a_failed_batch_fails_the_chunks_reserved_after_it(monkeypatch):
    from cairn._save import snapshot

    monkeypatch.setattr(snapshot, "BATCH_BYTES", 20)
    starts = Starts(fail_at=1)  # the second call fails
    with pytest.raises(RuntimeError, match="refused"):
        pipeline([10] * 6, 60, starts)
    assert len(starts.batches) == 2
