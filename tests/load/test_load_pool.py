"""The reader threads of loads: long-lived, shared by the loads of a process
(`_load.engine.reader_pool`), each load waiting for its own tasks on the way out, its scratch
buffers going back to `buffers.load_pool` for the next."""

from __future__ import annotations

import threading

from cairn._load import engine


def _blocking_tasks(pool, n):
    """Send `n` tasks that each wait until all `n` run: the pool must run them on `n` threads."""
    gate = threading.Barrier(n, timeout=10)
    return [pool.submit(gate.wait) for _ in range(n)]


def test_a_later_load_starts_no_thread(monkeypatch):
    started = []
    real = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), real(self))[1])
    shared = engine._shared_pool(3)
    with engine._LoadPool(shared) as pool:
        for f in _blocking_tasks(pool, 3):
            f.result(timeout=10)
    assert len([n for n in started if n.startswith("cairn-read3")]) <= 3
    started.clear()
    with engine._LoadPool(engine._shared_pool(3)) as pool:  # the same threads, idle now
        for f in _blocking_tasks(pool, 3):
            f.result(timeout=10)
    assert started == []


def test_leaving_a_load_waits_for_its_tasks_only():
    shared = engine._shared_pool(2)
    other_release, mine_release = threading.Event(), threading.Event()
    done = []
    other = engine._LoadPool(shared)
    slow = other.submit(other_release.wait, 10)  # another load's task, still running
    timer = threading.Timer(0.05, mine_release.set)
    timer.start()
    with engine._LoadPool(shared) as pool:
        pool.submit(lambda: (mine_release.wait(10), done.append(1)))
    assert done == [1]  # waited for its own task
    assert not slow.done()  # not for the other load's
    other_release.set()
    other.shutdown()
    assert slow.done()


def test_every_storage_shares_threads():
    """Local files, memory and object stores alike: a load's readers are a share of the process's threads."""
    for _ in range(2):
        pool = engine.reader_pool(4)
        try:
            assert isinstance(pool, engine._LoadPool)
            assert pool._pool is engine._shared_pool(4)
        finally:
            pool.shutdown()


def test_scratch_buffers_go_back_to_the_load_pool_with_the_load():
    """A reader thread's scratch buffer belongs to the load whose task took it, not to the thread: once
    the load is over it is back in `buffers.load_pool`, and the next load's reads take it from there
    (pages already mapped), not a new one."""
    from cairn._core import buffers
    from cairn._load import landing

    buffers.load_pool.clear()
    shared = engine._shared_pool(1)  # one thread: every task below runs on it
    made = buffers.load_pool.made
    with engine._LoadPool(shared) as pool:
        first = pool.submit(lambda: landing.scratch(3 << 20).ctypes.data).result(timeout=10)
        assert pool.submit(lambda: landing.scratch(1 << 20).ctypes.data).result(timeout=10) == first  # reused
        held = pool._scratch
        assert len(held) == 1
        assert buffers.load_pool.free_bytes == 0  # lent while the load runs
    assert held == {}
    assert shared.submit(lambda: getattr(landing._local, "buf", None)).result(timeout=10) is None
    assert buffers.load_pool.made == made + 1
    assert buffers.load_pool.free_bytes == 3 << 20  # back, kept for the next load
    reused = buffers.load_pool.reused
    with engine._LoadPool(shared) as pool:
        again = pool.submit(lambda: landing.scratch((3 << 20) - 5).ctypes.data).result(timeout=10)
    assert again == first and buffers.load_pool.made == made + 1 and buffers.load_pool.reused == reused + 1
    buffers.release_snapshot_buffers()  # what a caller who wants the memory back calls
    assert buffers.load_pool.free_bytes == 0


def test_scratch_sizes_come_in_classes():
    from cairn._load.landing import scratch_size

    mib = 1 << 20
    assert [scratch_size(n) for n in (1, mib, mib + 1, 4 * mib, 4 * mib + 1, 16 * mib + 1)] == [
        mib, mib, 2 * mib, 4 * mib, 5 * mib, 20 * mib]
    assert scratch_size(int(13.1 * mib)) == 14 * mib
    for n in range(1, 64 * mib, 997 * 1031):
        size = scratch_size(n)
        assert size >= n and size % mib == 0 and size <= max(mib, n * 1.25 + mib)


def test_a_loads_readers_are_freed_when_it_returns(tmp_path, monkeypatch):
    """No reference cycle keeps a load's readers (and what they hold) alive after it returns: they
    are freed at once, not by a later run of the cyclic collector (whose pause then falls in the next
    load). With the collector off, every reader is gone as soon as the load returns."""
    import gc
    import weakref

    import numpy as np

    import cairn
    from cairn._load import reader as reader_mod

    made = []
    real_init = reader_mod.ChunkReader.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(reader_mod.ChunkReader, "__init__", init)
    path = str(tmp_path / "ckpt")
    cairn.save(path, {"a": np.arange(1000.0), "b": {"c": np.ones((4, 5), np.int32)}})
    gc.collect()
    gc.disable()
    try:
        out = cairn.load(path)
        assert made and all(r() is None for r in made)
    finally:
        gc.enable()
    np.testing.assert_array_equal(out["a"], np.arange(1000.0))


def test_a_loaded_state_is_freed_with_the_callers_last_reference(tmp_path):
    """A loaded state holds no reference cycle: its arrays go as soon as the caller drops the result,
    not at the next run of the cyclic collector (which freed a 1 GiB state inside the next load,
    70-170 ms before its first GET). With the collector off, the arrays are gone at once."""
    import gc
    import weakref

    import numpy as np

    import cairn

    path = str(tmp_path / "ckpt")
    cairn.save(path, {"a": np.arange(1000.0), "b": {"c": np.ones((4, 5), np.int32)}, "d": [np.zeros(3)]})
    gc.collect()
    gc.disable()
    try:
        out = cairn.load(path)
        refs = [weakref.ref(out["a"]), weakref.ref(out["b"]["c"]), weakref.ref(out["d"][0])]
        del out
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_fresh_buffers_are_mapped_off_the_load_pool(monkeypatch):
    """Mapping fresh pages ahead (`ChunkReader.start_prefault`) runs on a thread of its own, never as a
    task of the load's pool, where a GET queued behind it would wait for it."""
    import numpy as np

    from cairn._load import decodepool
    from cairn._load import reader as reader_mod

    ran_on = []
    monkeypatch.setattr(reader_mod, "_prefault_all", lambda dests: ran_on.append(threading.current_thread().name))

    class NoPool:
        def submit(self, *a, **k):
            raise AssertionError("the prefault went to the load's pool")

    r = object.__new__(reader_mod.ChunkReader)
    r.pool, r._unmapped, r._unmapped_bytes = NoPool(), [np.empty(1 << 20, np.uint8)], 1 << 20
    r.start_prefault()
    decodepool.prefault_thread().submit(lambda: None).result(timeout=10)
    assert ran_on and ran_on[0].startswith("cairn-prefault") and r._unmapped == []


def test_stop_threads_leaves_none_and_the_next_load_starts_its_own(tmp_path, monkeypatch):
    """Loads leave their reader (and decoder) threads idle for the next one; `engine.stop_threads` stops
    them all, and a later load starts new ones."""
    import numpy as np

    import cairn
    from cairn._load import decodepool

    monkeypatch.setattr(decodepool, "DECODE_THREADS", 2)
    w = (np.random.default_rng(5).standard_normal((512, 1024)) * 0.02).astype(np.float32)
    cairn.save(tmp_path / "c", {"w": w}, compression="zstd")

    def ours() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith(("cairn-read", "cairn-decode"))]

    np.testing.assert_array_equal(cairn.load(tmp_path / "c")["w"], w)
    assert any(n.startswith("cairn-read") for n in ours())
    engine.stop_threads()
    assert ours() == []
    np.testing.assert_array_equal(cairn.load(tmp_path / "c")["w"], w)
    assert any(n.startswith("cairn-read") for n in ours())


def test_checkpointables_indexes_fetched_on_the_pool_and_parsed_by_the_loading_thread(tmp_path, monkeypatch):
    """Fetching is I/O (together: one round trip on object stores); parsing holds the GIL, so it runs on
    the loading thread alone (eight threads parsing at once took 2.2-2.4x as long on the 2-core VM)."""
    import numpy as np

    import cairn
    from cairn._load import source

    state = {f"t{i:02d}": np.full((4, 4), i, np.float32) for i in range(24)}
    cairn.save(tmp_path / "ck", state)
    fetched, parsed = [], []
    real_bytes, real_parse = source.index_bytes, source.parse_index
    monkeypatch.setattr(source, "index_bytes",
                        lambda loc, info: (fetched.append(threading.current_thread().name), real_bytes(loc, info))[1])
    monkeypatch.setattr(source, "parse_index",
                        lambda loc, info, data: (parsed.append(threading.current_thread().name),
                                                 real_parse(loc, info, data))[1])
    out = cairn.load(tmp_path / "ck")
    assert sorted(out) == sorted(state) and all(np.array_equal(out[k], v) for k, v in state.items())
    assert len(fetched) == len(parsed) == 24
    assert all(name.startswith("cairn-read") for name in fetched)
    assert set(parsed) == {threading.current_thread().name}
