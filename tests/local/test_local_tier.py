"""The local tier: placement and the restore decision (pure), and kill/wipe/restart on 4 real processes.

The multi-process tests run `tests/_mp/localtier_scenarios.py:train` on 4
processes with 2 CPU devices each: a deterministic training run saving to a
persistent directory every 6 steps and to one directory per "host" every 2
steps, each process's shards also held by the next process. A run dies
(``os._exit``) right after a save, possibly with the local save in flight; a
host directory is wiped (a replaced machine); the restarted run must resume
from the newest step complete on disk (own copy or replica), bitwise equal to
an uninterrupted run, and from the persistent tier when a process's own copy
and its replica are both gone.
"""

from __future__ import annotations

import os
import random
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from _mp import start, wait
from cairn import CheckpointError, CorruptCheckpointError, MismatchError
from cairn._local.blob import shard_data
from cairn._local.replicas import (
    Piece,
    header_bytes,
    layout_key,
    pack_rows,
    placement,
    process_devices,
    read_header,
    row_lengths,
    shard_tables,
    unpack,
)
from cairn._local.restoreplan import (
    Choice,
    Table,
    choose,
    decode_table,
    encode_table,
    local_box,
    segments,
    sizes,
)

N = 4
SCENARIO = "localtier_scenarios:train"


# ---------------------------------------------------------------------- pure parts


def test_placement_is_a_permutation_outside_the_own_domain():
    for count, domains in [(4, None), (6, [0, 0, 1, 1, 2, 2]), (8, [p // 2 for p in range(8)]), (5, None)]:
        fn = None if domains is None else domains.__getitem__
        holders = placement(count, 2, fn)
        dom = domains or list(range(count))
        assert len(holders) == 2
        for perm in holders:
            assert sorted(perm) == list(range(count))
            assert all(dom[perm[q]] != dom[q] for q in range(count))
        assert all(dom[holders[0][q]] != dom[holders[1][q]] for q in range(count))


def test_placement_refuses_what_the_domains_cannot_hold():
    with pytest.raises(CheckpointError, match="cannot place 2 replica"):
        placement(4, 2, [0, 0, 1, 1].__getitem__)  # only one other domain
    with pytest.raises(CheckpointError, match="other failure domains"):
        placement(2, 1, lambda p: "same-rack")
    assert placement(1, 1) == [] and placement(4, 0) == []


def _report(steps: dict[int, list[int]], count: int = 4, layout: str = "L", saved_by: int | None = None,
            table: bool = True) -> dict:
    saved_by = count if saved_by is None else saved_by
    return {"count": count, "layout": layout,
            "held": {str(s): {str(q): {"count": saved_by, "layout": layout, "length": 100 + q,
                                       "table": table} for q in h} for s, h in steps.items()}}


def test_choose_takes_the_newest_step_with_a_copy_of_every_process():
    reports = {p: _report({8: [p, (p - 1) % 4], 10: [p, (p - 1) % 4]}) for p in range(4)}
    reports[3] = _report({8: [3, 2]})  # step 10 torn on process 3: process 0's replica serves
    got = choose(reports, 4)
    assert (got.step, got.same, got.why) == (10, True, "")
    assert got.servers == {0: 0, 1: 1, 2: 2, 3: 0}
    reports[0] = _report({8: [0, 3]})  # torn on process 0 too: no copy of process 3's step 10 is left
    got = choose(reports, 4)
    assert got.step == 8 and got.servers == {q: q for q in range(4)}
    assert "step 10 has no copy of process [3]" in got.why  # why the newer step was passed over
    reports[3] = reports[0] = _report({})  # process 3's own copy and its replica are both gone
    got = choose(reports, 4)
    assert got.step is None and "no copy of process [3]" in got.why
    assert choose(reports, 4, newer_than=12).step is None


def test_choose_is_older_than_the_persistent_tier():
    reports = {p: _report({8: [p]}) for p in range(4)}
    got = choose(reports, 4, newer_than=9)
    assert got.step is None and "step 8 is older than the persistent step 9" in got.why
    assert choose(reports, 4, newer_than=8).step == 8


def test_choose_reshards_from_another_process_count_or_layout():
    # Saved by 4 processes, restored by 3: the blobs of 0-2 in their folders, 3's replica on process 0.
    reports = {p: _report({6: [p, (p - 1) % 4]}, count=3, saved_by=4) for p in range(3)}
    got = choose(reports, 3)
    assert (got.step, got.saved_by, got.same) == (6, 4, False)
    assert got.servers == {0: 0, 1: 1, 2: 2, 3: 0}
    # Saved by 2, restored by 4: the two old processes' folders hold everything; the least loaded serves.
    reports = {p: _report({6: [0, 1]} if p < 2 else {}, count=4, saved_by=2) for p in range(4)}
    got = choose(reports, 4)
    assert got.step == 6 and got.servers == {0: 0, 1: 1}
    other = {p: _report({4: [p]}, layout="other") | {"layout": "L"} for p in range(4)}
    got = choose(other, 4)
    assert got.step == 4 and not got.same  # same count, another layout: a reshard too
    untabled = {p: _report({4: [p]}, count=3, saved_by=4, table=False) for p in range(3)}
    got = choose(untabled, 3)
    assert got.step is None and "shard table" in got.why
    assert choose({p: _report({}) for p in range(4)}, 4) == Choice(None)


def _table(boxes_by_blob: dict[int, list[tuple]], shape=(8, 6), dtype="float32") -> Table:
    return decode_table([encode_table(["w"], [shape], [dtype],
                                      {q: [Piece(0, b, 0) for b in bs] for q, bs in boxes_by_blob.items()})], "t")


def test_segments_cut_saved_rows_into_target_columns_once():
    saved = _table({0: [((0, 4), (0, 6))], 1: [((4, 8), (0, 6))]})  # rows over 2 processes
    wanted = {0: [Piece(0, ((0, 8), (0, 3)), 0)], 1: [Piece(0, ((0, 8), (3, 6)), 0)]}  # columns
    segs = segments(saved, {0: 0, 1: 1}, ["w"], [(8, 6)], ["float32"], wanted, "t")
    assert [(g.server, g.receiver, g.box, g.nbytes) for g in segs] == [
        (0, 0, ((0, 4), (0, 3)), 48), (1, 0, ((4, 8), (0, 3)), 48),
        (0, 1, ((0, 4), (3, 6)), 48), (1, 1, ((4, 8), (3, 6)), 48)]
    assert sizes(segs) == {0: {0: 48, 1: 48}, 1: {0: 48, 1: 48}}
    assert local_box(((4, 8), (3, 6)), ((4, 8), (0, 6))) == (slice(0, 4), slice(3, 6), Ellipsis)
    # A replicated leaf held by both blobs: each receiver takes it from the blob it serves itself.
    both = _table({0: [((0, 8), (0, 6))], 1: [((0, 8), (0, 6))]})
    segs = segments(both, {0: 0, 1: 1}, ["w"], [(8, 6)], ["float32"], wanted, "t")
    assert [(g.server, g.receiver) for g in segs] == [(0, 0), (1, 1)]


def test_segments_refuse_what_the_saved_step_cannot_give():
    saved = _table({0: [((0, 4), (0, 6))]})  # rows 4-8 are nowhere
    want = {0: [Piece(0, ((0, 8), (0, 6)), 0)]}
    with pytest.raises(CorruptCheckpointError, match="do not tile the target box"):
        segments(saved, {0: 0}, ["w"], [(8, 6)], ["float32"], want, "t")
    with pytest.raises(MismatchError, match="saved as float32\\[8, 6\\]; the target is float32\\[8, 8\\]"):
        segments(saved, {0: 0}, ["w"], [(8, 8)], ["float32"], want, "t")
    with pytest.raises(MismatchError, match="'v' is not in the local step"):
        segments(saved, {0: 0}, ["v"], [(8, 6)], ["float32"], want, "t")


# ---------------------------------------------------------------------- one process, 8 devices


def _mesh_state(spec):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    sh = NamedSharding(mesh, P(*spec))
    rep = NamedSharding(mesh, P())
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    mask = (np.arange(16 * 8) % 3 == 0).reshape(16, 8)
    return ({"w": jax.device_put(w, sh), "m": jax.device_put(mask, sh), "s": jax.device_put(np.float32(2.5), rep),
             "n": 7},
            {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sh),
             "m": jax.ShapeDtypeStruct(mask.shape, mask.dtype, sharding=sh),
             "s": jax.ShapeDtypeStruct((), np.float32, sharding=rep), "n": 0})


def test_layout_key_is_the_crc_of_its_defining_description():
    """The memoised `layout_key` is, byte for byte, the CRC of the JSON it is defined by (so steps
    saved before the memo still match), and it tells layouts apart."""
    import json

    from cairn._core.checksum import crc32c
    from cairn._tree.shardings import slices_to_box

    def plain(shapes, dtypes, shardings, paths):
        desc = ["rows-by-device"]
        for path, shape, dtype, sharding in zip(paths, shapes, dtypes, shardings):
            boxes = sorted((d.id, d.process_index, [list(b) for b in slices_to_box(ix, shape)])
                           for d, ix in sharding.devices_indices_map(shape).items())
            desc.append([path, list(shape), np.dtype(dtype).name, boxes])
        return f"{crc32c(json.dumps(desc).encode()):08x}"

    keys = set()
    for spec in (("x", "y"), ("y", "x"), (None, "x")):
        state, _ = _mesh_state(spec)
        names = ["m", "s", "w"]
        args = ([state[k].shape for k in names], [state[k].dtype for k in names],
                [state[k].sharding for k in names], [f"['{k}']" for k in names])
        assert layout_key(*args) == layout_key(*args) == plain(*args)
        keys.add(layout_key(*args))
    assert len(keys) == 3


def test_each_device_packs_only_the_shards_it_holds():
    state, _ = _mesh_state(("x", "y"))  # "w" and "m": one 4x4 block per device; "s": replicated
    names = ["m", "s", "w"]
    arrays = [state[k] for k in names]
    devices = process_devices(1)[0]
    pieces, _ = shard_tables([a.shape for a in arrays], [a.dtype for a in arrays], [a.sharding for a in arrays],
                             [0])[0]
    header = header_bytes({"step": 1})
    lengths = row_lengths(pieces, len(header), len(devices))
    assert lengths == [len(header) + 16 + 4 + 64] + [16 + 64] * 7  # the replicated scalar once, on device 0
    rows = pack_rows(header, pieces, [shard_data(arrays[p.leaf], p.box) for p in pieces], max(lengths), devices)
    assert [set(r.devices()) for r in rows] == [{d} for d in devices]
    blob = np.concatenate([np.asarray(r)[:n] for r, n in zip(rows, lengths)])
    got = unpack(blob, read_header(blob, "t")[1], pieces, [np.dtype(a.dtype) for a in arrays], "t")
    for pc, host in zip(pieces, got):
        want = np.asarray(arrays[pc.leaf])[tuple(slice(a, b) for a, b in pc.box)]
        assert np.array_equal(host, want) and host.dtype == want.dtype


def _manager(tmp_path, tier=None, save_every=100):
    tier = tier or cairn.LocalTier(tmp_path / "l", every=2, replicas=0)
    return cairn.CheckpointManager(tmp_path / "p", save_every=save_every, local=tier, handle_sigterm=False)


def test_restore_onto_another_layout_reshards_from_the_local_tier(tmp_path, caplog):
    state, _ = _mesh_state(("x", "y"))
    _, columns = _mesh_state(("y", "x"))
    with _manager(tmp_path) as mgr:
        mgr.save(4, state)
    tier = cairn.LocalTier(tmp_path / "l", every=2, replicas=0)
    with caplog.at_level("INFO", logger="cairn"), _manager(tmp_path, tier) as mgr:
        got = mgr.restore(target=columns)
    assert tier.restored_step == 4 and "resharded from the local tier" in caplog.text
    for k in ("w", "m", "s"):
        assert got[k].sharding == columns[k].sharding and got[k].dtype == state[k].dtype
        assert np.array_equal(np.asarray(got[k]), np.asarray(state[k]))
    assert got["n"] == 7


def test_a_leaf_the_local_step_lacks_falls_back_to_the_persistent_tier(tmp_path, caplog):
    state, _ = _mesh_state(("x", "y"))
    _, columns = _mesh_state(("y", "x"))
    with _manager(tmp_path, save_every=2) as mgr:
        mgr.save(2, state)
    wider = dict(columns, w=jax.ShapeDtypeStruct((16, 16), np.float32, sharding=columns["w"].sharding))
    tier = cairn.LocalTier(tmp_path / "l", every=2, replicas=0)
    with caplog.at_level("INFO", logger="cairn"), _manager(tmp_path, tier, save_every=2) as mgr:
        with pytest.raises(MismatchError):  # neither tier has a 16x16 "w"
            mgr.restore(target=wider)
        assert tier.restored_step is None and "does not restore onto this target" in caplog.text
        assert "saved as float32[16, 8]; the target is float32[16, 16]" in caplog.text


def test_restore_keywords_that_keep_what_is_restored_are_served_by_the_local_tier(tmp_path, caplog):
    """bandwidths, read_once, budget_bytes, verify, threads, timeout, stats, and mesh= with a target
    that shards every array: the local step 4 serves (newer than the persistent step 2)."""
    state, rows = _mesh_state(("x", "y"))
    with _manager(tmp_path, save_every=2) as mgr:
        mgr.save(2, state)
        mgr.save(4, dict(state, n=8))  # save_every=2: steps 2 and 4 are persistent too...
    shutil.rmtree(tmp_path / "p" / "step_00000004")  # ...so the persistent tier's newest is 2
    mesh = rows["w"].sharding.mesh
    asks = [{"bandwidths": {"storage_gbps": 0.5}}, {"read_once": False}, {"read_once": True}, {"budget_bytes": 1 << 20},
            {"verify": False}, {"threads": 1}, {"timeout": 30.0}, {"mesh": mesh},
            {"rename": None, "drop": None, "fill_missing": False}]  # given, but as the defaults
    for kw in asks:
        tier = cairn.LocalTier(tmp_path / "l", every=2, replicas=0)
        stats = cairn.LoadStats()
        with caplog.at_level("INFO", logger="cairn"), _manager(tmp_path, tier) as mgr:
            got = mgr.restore(target=rows, stats=stats, **kw)
            assert (tier.restored_step, mgr.restored_step) == (4, 4), kw
        assert got["n"] == 8 and np.array_equal(np.asarray(got["w"]), np.asarray(state["w"])), kw
        assert got["w"].sharding == rows["w"].sharding, kw
        assert stats.bytes_read == 0, kw  # nothing read from the persistent tier
        assert "not restoring from the local tier" not in caplog.text, (kw, caplog.text)
    # A bad option fails as it would on the persistent path, before any tier is asked.
    with _manager(tmp_path, cairn.LocalTier(tmp_path / "l", every=2, replicas=0)) as mgr:
        with pytest.raises(ValueError, match="budget_bytes must be a positive integer, got 0"):
            mgr.restore(target=rows, budget_bytes=0)
        with pytest.raises(ValueError, match=r"bandwidths: unknown keys \['local'\]"):
            mgr.restore(target=rows, bandwidths={"local": 0.5})
        with pytest.raises(TypeError, match="read_onse"):
            mgr.restore(target=rows, read_onse=True)


def test_restore_keywords_the_local_tier_cannot_serve_fall_back_saying_why(tmp_path, caplog):
    state, rows = _mesh_state(("x", "y"))
    with _manager(tmp_path, save_every=2) as mgr:
        mgr.save(2, state)
    mesh = rows["w"].sharding.mesh
    unsharded = dict(rows, w=jax.ShapeDtypeStruct((16, 8), np.float32))
    cases = [({"partial": True}, "partial=True"),
             ({"rename": [(r"^w$", "w")]}, "rename= transform the saved tree"),
             ({"drop": [r"^nothing$"]}, "drop= transform"),
             ({"fill_missing": True}, "fill_missing= transform"),
             ({"report": cairn.RestoreReport()}, "report= records what transforms did")]
    for kw, why in cases:
        tier = cairn.LocalTier(tmp_path / "l", every=2, replicas=0)
        stats = cairn.LoadStats()
        caplog.clear()
        with caplog.at_level("INFO", logger="cairn"), _manager(tmp_path, tier) as mgr:
            got = mgr.restore(target=rows, stats=stats, **kw)
            assert tier.restored_step is None and mgr.restored_step == 2, kw
        assert np.array_equal(np.asarray(got["w"]), np.asarray(state["w"])), kw
        assert stats.bytes_read > 0, kw  # the persistent tier served
        lines = [r.getMessage() for r in caplog.records if "not restoring from the local tier" in r.getMessage()]
        assert len(lines) == 1 and why in lines[0] and "restoring from the persistent tier" in lines[0], (kw, lines)
    tier = cairn.LocalTier(tmp_path / "l", every=2, replicas=0)
    caplog.clear()
    with caplog.at_level("INFO", logger="cairn"), _manager(tmp_path, tier) as mgr:
        got = mgr.restore(target=unsharded, mesh=mesh)  # "w" takes its saved P("x", "y") on the mesh
    assert tier.restored_step is None and got["w"].sharding.spec == P("x", "y")
    assert "mesh= places leaves the target gives no sharding ('w')" in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="cairn"), _manager(tmp_path) as mgr:
        got = mgr.restore(target=rows, format="cairn", partial=True)  # format= reaches the persistent load
    assert mgr.restored_step == 2 and got["n"] == 7 and "partial=True" in caplog.text


def test_old_steps_of_processes_this_run_lacks_are_removed_once_it_saves_newer(tmp_path):
    state, rows = _mesh_state(("x", "y"))
    with _manager(tmp_path) as mgr:
        mgr.save(2, state)
    shutil.copytree(tmp_path / "l" / "process_0", tmp_path / "l" / "process_1")  # as a 2-process run left it
    tier = cairn.LocalTier(tmp_path / "l", every=2, replicas=0)
    with _manager(tmp_path, tier) as mgr:
        assert mgr.restore(target=rows) is not None and tier.restored_step == 2  # its own copy
        mgr.save(4, state)
    assert not (tmp_path / "l" / "process_1" / "step_00000002").exists()
    assert (tmp_path / "l" / "process_0" / "step_00000002").exists()  # kept: keep=2 of its own


# ---------------------------------------------------------------------- real processes


def _committed(root: str, host: int, step: int) -> bool:
    return os.path.exists(f"{root}/host{host}/process_{host}/step_{step:08d}/manifest.json")


def _persistent_latest(persist: str) -> int | None:
    steps = [int(n[5:]) for n in os.listdir(persist) if n.startswith("step_")
             and os.path.exists(f"{persist}/{n}/manifest.json")] if os.path.isdir(persist) else []
    return max(steps, default=None)


def _expected(root: str, persist: str, upto: int) -> tuple[str | None, int | None]:
    """Where the restart must resume from, judged from what is on disk."""
    local = None
    for s in range(upto, -1, -1):
        if all(_committed(root, q, s) or _committed(root, (q + 1) % N, s) for q in range(N)):
            local = s
            break
    p = _persistent_latest(persist)
    if local is not None and (p is None or local >= p):
        return "local", local
    return ("persistent", p) if p is not None else (None, None)


def _run(root: str, persist: str, total: int, die_at: int | None, timeout: float = 180, n: int = N,
         elastic: bool = False, restore_kw: dict | None = None) -> list:
    """Run the scenario; a run that dies returns, per process, the "resumed <tier> <step>" line it printed."""
    procs = start(n, SCENARIO, {"root": root, "persist": persist, "total": total, "die_at": die_at,
                                "elastic": elastic, "restore_kw": restore_kw})
    out = wait(procs, timeout, expect_exit=lambda i: die_at is None)
    if die_at is None:
        return out
    lines = [next((ln for ln in p.output().splitlines() if ln.startswith("resumed ")), "") for p in procs]
    return [ln.split()[1:] for ln in lines]


def _wipe(root: str, *hosts: int) -> None:
    for h in hosts:
        shutil.rmtree(f"{root}/host{h}", ignore_errors=True)


def _check_resumed(out: list, want: tuple[str | None, int | None]) -> None:
    for r in out:
        assert (r["tier"], r["restored"]) == want, (out, want)
        assert r["equal"], out


@pytest.mark.timeout(400)
def test_kill_wipe_a_host_restart_resumes_from_local_then_persistent(tmp_path):
    root, persist = str(tmp_path / "local"), str(tmp_path / "persist")
    _run(root, persist, 20, die_at=10)  # dies with the local save of step 10 in flight
    _wipe(root, 2)  # a replaced host: process 2's shards exist only as process 3's replica
    want = _expected(root, persist, 10)
    assert want[0] == "local" and want[1] >= 8, want
    resumed = _run(root, persist, 20, die_at=15)  # resumes and dies again
    assert resumed == [["local", str(want[1])]] * N, (resumed, want)
    _wipe(root, 1, 2)  # process 1's own copy and its replica (on process 2) are both gone
    want = _expected(root, persist, 15)
    # The persistent save of step 12 is asynchronous: the kill at step 15 may come before its commit.
    assert want[0] == "persistent" and want[1] in (6, 12), want
    _check_resumed(_run(root, persist, 20, die_at=None), want)


@pytest.mark.timeout(300)
def test_a_replaced_host_gets_its_shards_from_its_peer(tmp_path):
    root, persist = str(tmp_path / "local"), str(tmp_path / "persist")
    _run(root, persist, 12, die_at=9)  # local 6 complete, 8 perhaps; persistent 6
    _wipe(root, 3)
    want = _expected(root, persist, 9)
    assert want[0] == "local" and want[1] in (6, 8), want
    # Reading options change how bytes are read, not what is restored: the local tier still serves.
    kw = {"threads": 2, "read_once": True, "budget_bytes": 64 << 20, "bandwidths": {"storage_gbps": 1.0},
          "verify": True, "timeout": 120.0}
    _check_resumed(_run(root, persist, 12, die_at=None, restore_kw=kw), want)


@pytest.mark.timeout(400)
def test_lose_a_host_and_go_on_with_fewer_processes_from_the_local_tier(tmp_path):
    root, persist = str(tmp_path / "local"), str(tmp_path / "persist")
    _run(root, persist, 16, die_at=9, elastic=True)  # 4 processes; local 8 perhaps in flight, persistent 6
    _wipe(root, 3)  # a host is gone for good: 3 processes carry on; process 3's replica is on process 0
    local = max((s for s in range(10) if all(_committed(root, h, s) for h in range(3))), default=None)
    assert local is not None and local >= (_persistent_latest(persist) or 0), (local, _persistent_latest(persist))
    _check_resumed(_run(root, persist, 16, die_at=None, n=3, elastic=True), ("local", local))


@pytest.mark.timeout(400)
def test_grow_from_two_to_four_processes_from_the_local_tier(tmp_path):
    root, persist = str(tmp_path / "local"), str(tmp_path / "persist")
    _run(root, persist, 14, die_at=9, n=2, elastic=True)  # each of the 2 hosts holds both blobs
    local = max((s for s in range(10) if _committed(root, 0, s) or _committed(root, 1, s)), default=None)
    assert local is not None and local >= (_persistent_latest(persist) or 0)
    out = _run(root, persist, 14, die_at=None, n=4, elastic=True)  # hosts 2 and 3 are new and empty
    _check_resumed(out, ("local", local))
    assert all(r["local_steps"][-1] == 12 for r in out), out  # the 4-process run saves its own steps


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("seed", range(8))
def test_random_kills_and_wipes(tmp_path, seed):
    rng = random.Random(seed)
    root, persist = str(tmp_path / "local"), str(tmp_path / "persist")
    total, done = 30, -1
    want: tuple[str | None, int | None] = (None, None)
    for _ in range(3):
        if done + 1 > total - 2:
            break
        die_at = min(total - 2, done + 1 + rng.randrange(9))
        resumed = _run(root, persist, total, die_at=die_at)
        assert resumed == [[str(want[0]), str(want[1])]] * N, (resumed, want)
        lost = rng.sample(range(N), rng.choice([1, 1, 2]))
        _wipe(root, *lost)
        done = die_at
        want = _expected(root, persist, done)
    _check_resumed(_run(root, persist, total, die_at=None), want)
