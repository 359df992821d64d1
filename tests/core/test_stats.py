"""Load and save stats, their jax.monitoring events, the listeners and the log line (`_stats`)."""

from __future__ import annotations

import logging
import threading

import jax
import jax.monitoring
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn


def state_of(mesh):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype(np.float32)  # 8 KiB, sharded over the 8 devices
    return {
        "params": {"w": jax.device_put(w, NamedSharding(mesh, P("x"))),
                   "b": np.arange(32, dtype=np.int64)},
        "opt": {"m": np.ones((128, 16), np.float32), "step": 7},
    }


ARRAY_BYTES = 64 * 32 * 4 + 32 * 8 + 128 * 16 * 4


@pytest.fixture
def listen():
    """Events seen by a cairn listener, removed after the test."""
    events: list[cairn.StatsEvent] = []
    fn = cairn.add_listener(events.append)
    yield events
    cairn.remove_listener(fn)


def check_phases(stats: cairn.LoadStats) -> None:
    phases = stats.plan_s + stats.read_s + stats.transfer_s + stats.reshard_s
    assert all(x >= 0 for x in (stats.plan_s, stats.read_s, stats.transfer_s, stats.reshard_s))
    assert 0 < phases <= stats.total_s
    assert stats.gib_per_s == pytest.approx(stats.bytes_read / 2**30 / stats.total_s)


def test_full_load_reads_every_stored_byte_once(tmp_path, mesh8):
    state = state_of(mesh8)
    saved = cairn.save(tmp_path / "ck", state)
    assert saved.bytes_written >= ARRAY_BYTES  # the data files hold the arrays' bytes
    target = jax.tree.map(lambda x: x, state)  # the same shardings: every byte read exactly once
    stats = cairn.LoadStats()
    out = cairn.load(tmp_path / "ck", target, stats=stats)
    assert np.array_equal(np.asarray(out["params"]["w"]), np.asarray(state["params"]["w"]))
    assert stats.bytes_read == ARRAY_BYTES
    assert 0 < stats.reads <= stats.bytes_read and stats.direct_reads <= stats.reads
    assert stats.retries == 0 and stats.read_once_leaves == 0
    check_phases(stats)
    # Without a target (numpy) the same bytes; a reused LoadStats holds this load's numbers only.
    reads = stats.reads
    cairn.load(tmp_path / "ck", stats=stats)
    assert stats.bytes_read == ARRAY_BYTES and stats.reads <= 2 * reads
    check_phases(stats)
    assert stats.as_dict()["bytes_read"] == ARRAY_BYTES


def test_partial_load_reads_fewer_bytes(tmp_path, mesh8):
    state = state_of(mesh8)
    cairn.save(tmp_path / "ck", state)
    full, part = cairn.LoadStats(), cairn.LoadStats()
    cairn.load(tmp_path / "ck", stats=full)
    out = cairn.load(tmp_path / "ck", {"params": {"b": None}}, partial=True, stats=part)
    assert np.array_equal(out["params"]["b"], np.arange(32))
    assert part.bytes_read == 32 * 8 < full.bytes_read == ARRAY_BYTES
    assert 0 < part.reads < full.reads


def test_save_stats_gib_per_s(tmp_path):
    stats = cairn.save(tmp_path / "ck", {"x": np.zeros(1 << 16, np.float32)})
    assert stats.total_s > 0 and stats.files_written >= 1
    assert stats.gib_per_s == pytest.approx(stats.bytes_written / 2**30 / stats.total_s)
    assert cairn.SaveStats().gib_per_s == 0.0 and cairn.LoadStats().gib_per_s == 0.0


def test_jax_monitoring_events(tmp_path, mesh8):
    durations: dict[str, list[float]] = {}
    scalars: dict[str, list[float]] = {}

    def on_duration(event, secs, **kw):
        durations.setdefault(event, []).append(secs)

    def on_scalar(event, value, **kw):
        scalars.setdefault(event, []).append(value)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_scalar_listener(on_scalar)
    try:
        saved = cairn.save(tmp_path / "ck", state_of(mesh8))
        stats = cairn.LoadStats()
        cairn.load(tmp_path / "ck", stats=stats)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_scalar_listener(on_scalar)
    assert durations["/cairn/save/total_s"] == [saved.total_s]
    assert durations["/cairn/save/blocking_s"] == [saved.blocking_s]
    assert scalars["/cairn/save/bytes"] == [saved.bytes_written]
    assert durations["/cairn/load/total_s"] == [stats.total_s]
    assert durations["/cairn/load/read_s"] == [stats.read_s]
    assert {"/cairn/load/plan_s", "/cairn/load/transfer_s", "/cairn/load/reshard_s"} <= set(durations)
    assert scalars["/cairn/load/bytes"] == [ARRAY_BYTES]
    assert scalars["/cairn/load/requests"] == [stats.reads]


def test_listener_gets_saves_and_loads(tmp_path, mesh8, listen, caplog):
    with caplog.at_level(logging.INFO, logger="cairn"):
        saved = cairn.save(tmp_path / "ck", state_of(mesh8))
        stats = cairn.LoadStats()
        cairn.load(tmp_path / "ck", stats=stats)
    assert [(e.kind, e.path) for e in listen] == [("save", str(tmp_path / "ck")), ("load", str(tmp_path / "ck"))]
    assert listen[0].stats is saved and listen[1].stats is stats
    lines = [r.getMessage() for r in caplog.records if r.name == "cairn"]
    assert any(line.startswith(f"cairn: loaded {tmp_path / 'ck'}: ") and "requests" in line for line in lines)
    assert any(line.startswith(f"cairn: saved {tmp_path / 'ck'}: ") for line in lines)


def test_listener_sees_an_async_save_after_its_commit(tmp_path, mesh8):
    seen: list[tuple[cairn.StatsEvent, bool, str]] = []

    def on_event(event):  # the checkpoint is committed (loadable) by the time the listener runs
        seen.append((event, _loadable(event.path), threading.current_thread().name))

    cairn.add_listener(on_event)
    try:
        f = cairn.save_async(tmp_path / "ck", state_of(mesh8))
        stats = f.result(timeout=60)
    finally:
        cairn.remove_listener(on_event)
    assert len(seen) == 1  # before the future resolved
    event, committed, thread = seen[0]
    assert event.kind == "save" and event.stats is stats and committed and thread == "cairn-save"
    assert stats.bytes_written >= ARRAY_BYTES


def _loadable(path: str) -> bool:
    try:
        cairn.metadata(path)
        return True
    except cairn.CheckpointNotFoundError:
        return False


def test_a_raising_listener_breaks_nothing(tmp_path, mesh8, caplog):
    def broken(event):
        raise RuntimeError("logger down")

    after: list[str] = []
    cairn.add_listener(broken)
    cairn.add_listener(on := lambda e: after.append(e.kind))
    try:
        with caplog.at_level(logging.WARNING, logger="cairn"):
            cairn.save(tmp_path / "ck", state_of(mesh8))
            out = cairn.load(tmp_path / "ck")
            f = cairn.save_async(tmp_path / "ck2", {"x": np.arange(3)})
            f.result(timeout=60)
    finally:
        cairn.remove_listener(broken)
        cairn.remove_listener(on)
    assert out["opt"]["step"] == 7 and np.array_equal(out["params"]["b"], np.arange(32))
    assert after == ["save", "load", "save"]  # the listener after the broken one still ran
    assert cairn.load(tmp_path / "ck2")["x"].tolist() == [0, 1, 2]  # the async save committed
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("stats listener" in w and "logger down" in w for w in warned) == 3
    cairn.remove_listener(broken)  # removing one that is gone is no error
    with pytest.raises(TypeError, match="must be callable"):
        cairn.add_listener(42)  # type: ignore[arg-type]


def test_manager_restore_fills_stats(tmp_path, mesh8, listen):
    with cairn.CheckpointManager(tmp_path / "run", async_save=True) as mgr:
        mgr.save(1, state_of(mesh8))
        mgr.wait()
        stats = cairn.LoadStats()
        out = mgr.restore(target={"opt": None}, partial=True, stats=stats)
    assert out["opt"]["step"] == 7
    assert stats.bytes_read == 128 * 16 * 4 and stats.total_s > 0
    assert [e.kind for e in listen] == ["save", "load"] and listen[1].stats is stats
