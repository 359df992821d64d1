"""Multi-process saves and loads: real JAX processes on 127.0.0.1, 2 virtual CPU devices each.

Each test starts a small cluster with the harness in `tests/_mp`; the
scenario functions it runs live in `tests/_mp/scenarios.py`. The state's
values are a pure function of each array's name and shape, so every process
builds only its own shards and checks what it loads against the same function.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import cairn
from _mp import run, scenarios, start, wait
from cairn._codecs import codecs as _codecs

pytestmark = pytest.mark.timeout(240)

MESH_4 = [4, 2]  # 4 processes x 2 devices
MESH_2 = [2, 2]  # 2 processes x 2 devices
# Loading on 4 processes onto a differently shaped mesh, every leaf resharded.
OTHER_MESH_4 = [2, 4]
OTHER_SPECS = {"w": ["y", "x"], "e": [["y", "x"], None], "b": ["y"], "v": [None, "y", None]}


def _total_nbytes() -> int:
    arrays = sum(
        int(np.prod(shape)) * jnp.dtype(dtype).itemsize
        for name, (shape, dtype, _) in scenarios.LEAVES.items()
    )
    return arrays + 10 * 8  # extra/table: 10 int64


def _data_bytes_on_disk(path: str) -> int:
    total = 0
    for root, _, names in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, n)) for n in names if n.endswith(".bin"))
    return total


def _check_numpy(out: dict) -> None:
    for name, (shape, dtype, _) in scenarios.LEAVES.items():
        got = out["params"][name]
        assert isinstance(got, np.ndarray), name
        np.testing.assert_array_equal(got, scenarios.expected(name, shape, dtype), err_msg=name)
    assert out["extra"]["step"] == 7 and out["extra"]["tag"] == "mp"
    np.testing.assert_array_equal(out["extra"]["table"], np.arange(10))


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mp") / "ckpt4")
    results = run(4, "save", {"path": path, "mesh": MESH_4, "big_mb": 4})
    return path, results


def test_coordinator_client_calls_and_timeouts():
    out = run(3, "coordinator_basics")
    for me, r in enumerate(out):
        assert r["keys"] == ["t/hello/0", "t/hello/1", "t/hello/2"]
        assert r["values"] == ["from 0", "from 1", "from 2"] and r["first"] == "from 0"
        # The timeout names the process expected to publish the key, and its last step.
        assert f"process {me} got no value under 't/never' from process 2 (last step:" in r["never"], r["never"]
        if me < 2:  # the punctual processes name the late one, and where it was
            assert r["late"] is not None and "process 2 (last step" in r["late"], r["late"]
            assert "got 't/hello/0'" in r["late"], r["late"]  # its last step before it lagged
        else:  # the late one learns the barrier failed although everyone came
            assert r["late"] is not None and "every process arrived" in r["late"], r["late"]
    assert "processes 0, 1, 2 (last steps: 0: waiting for 3 values" in out[0]["partial"] and "t/hello-again" in out[0]["partial"]


def test_save_on_4_writes_each_byte_once(saved_on_4):
    path, results = saved_on_4
    big = 4 << 20
    # Replicated leaves ("b" on every device, "e" along x) are written once in total.
    assert sum(r["bytes_written"] for r in results) == _total_nbytes() + big
    assert _data_bytes_on_disk(path) == _total_nbytes() + big
    # Each process wrote its own quarter of the big sharded array...
    for r in results:
        assert r["bytes_written"] >= big // 4
    # ...and sent only metadata through the coordinator, far less than its data.
    for r in results:
        assert r["published_bytes"] < 2000, r
    # The per-process index parts were merged at commit and removed.
    names = [n for _, _, files in os.walk(path) for n in files]
    assert not [n for n in names if n.startswith("_index.")], names
    manifest = cairn.metadata(path)
    assert manifest["params"]["w"].sharding["num_devices"] == 8


def test_save_on_4_load_on_2(saved_on_4):
    path, _ = saved_on_4
    out = run(2, "load", {"path": path, "mesh": MESH_2, "big": ["x", "y"]})
    for r in out:
        assert r["shards_checked"] == 8
        # Each process reads exactly its half of the big array, from 4 writers' files.
        assert r["big_bytes_read"] == r["big_bytes_needed"] == 2 << 20, r


def test_save_on_4_load_on_1_as_numpy(saved_on_4):
    path, _ = saved_on_4
    out = cairn.load(path, {"params": None, "extra": None})
    _check_numpy(out)


def test_save_on_4_load_on_4_other_mesh(saved_on_4):
    path, _ = saved_on_4
    # "big" is saved as P("x", "y") on a 4x2 mesh; loaded as P("y", "x") on 2x4 its shards
    # change devices and processes, and each process still reads only its quarter.
    out = run(4, "load", {"path": path, "mesh": OTHER_MESH_4, "specs": OTHER_SPECS, "big": ["y", "x"]})
    for r in out:
        assert r["shards_checked"] == 8
        assert r["big_bytes_read"] == r["big_bytes_needed"] == 1 << 20, r


def test_save_on_2_load_on_4(tmp_path):
    path = str(tmp_path / "ckpt2")
    saved = run(2, "save", {"path": path, "mesh": MESH_2})
    assert sum(r["bytes_written"] for r in saved) == _total_nbytes() == _data_bytes_on_disk(path)
    loaded = run(4, "load", {"path": path, "mesh": MESH_4})
    assert all(r["shards_checked"] == 8 for r in loaded)
    _check_numpy(cairn.load(path))


def _compressed_version(ck) -> int:
    """A compressed save's manifest version: 6 where any leaf is "blosc2-lz4", else 5 where any is "blosc2",
    whichever process wrote it (the primary learns it from every process's status, FORMAT.md §6.6), else 3."""
    codecs = {getattr(leaf, "codec", "none") for index in ck.indexes.values() for leaf in index.leaves}
    return 6 if "blosc2-lz4" in codecs else 5 if "blosc2" in codecs else 3


def test_compressed_save_on_2_agrees_on_codecs_and_loads_on_4(tmp_path):
    """Each leaf's codec is chosen by the writer of its first chunk and learnt by the other writers
    (replicated leaves split between processes), so every chunk of a leaf is stored alike."""
    from cairn._load.source import open_checkpoint

    path = str(tmp_path / "ckpt2z")
    saved = run(2, "save", {"path": path, "mesh": MESH_2, "split_replicas": True, "compression": True})
    on_disk = _data_bytes_on_disk(path)
    assert sum(r["bytes_written"] for r in saved) == on_disk < _total_nbytes()
    ck = open_checkpoint(path)
    assert ck.manifest.version == _compressed_version(ck)
    index = ck.indexes["params"]
    index.table.fetch_all()
    assert any(leaf.codec != "none" for leaf in index.leaves)
    loaded = run(4, "load", {"path": path, "mesh": MESH_4})
    assert all(r["shards_checked"] == 8 for r in loaded)
    _check_numpy(cairn.load(path))


@pytest.mark.skipif(not _codecs.blosc2_available(), reason="python-blosc2 is not installed")
def test_a_bit_shuffled_save_on_2_is_version_6_and_loads_on_4(tmp_path):
    """Every process's status says the version its part needs (an integer); the primary writes the
    highest: "blosc2-lz4" blocks written by both processes make the manifest 6 (FORMAT.md §6.6)."""
    from cairn._load.source import open_checkpoint

    path = str(tmp_path / "ckpt2lz4")
    saved = run(2, "save", {"path": path, "mesh": MESH_2, "split_replicas": True, "compression": "blosc2-lz4"})
    assert sum(r["bytes_written"] for r in saved) == _data_bytes_on_disk(path) < _total_nbytes()
    ck = open_checkpoint(path)
    assert ck.manifest.version == 6 == _compressed_version(ck)
    assert all(index.version == 3 for index in ck.indexes.values())
    loaded = run(4, "load", {"path": path, "mesh": MESH_4})
    assert all(r["shards_checked"] == 8 for r in loaded)
    _check_numpy(cairn.load(path))


def test_auto_compression_is_the_primarys_answer(tmp_path):
    """What "auto" means depends on the mounts a process sees; the primary's answer holds for all
    (here it sees a network filesystem, the other process a local disk), so the index parts agree.
    (On 12 cores, where the codecs are faster than a network filesystem's default 1 GiB/s.)"""
    from cairn._load.source import open_checkpoint

    path = str(tmp_path / "ckpt_auto")
    real = os.path.realpath(tmp_path)
    views = []
    for p, kind in enumerate(("nfs4", "ext4")):
        views.append(str(tmp_path / f"mountinfo{p}"))
        with open(views[-1], "w") as f:
            f.write(f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n40 22 0:50 / {real} rw - {kind} srv:/x rw\n")
    saved = run(2, "save", {"path": path, "mesh": MESH_2, "mountinfo": views, "cores": 12})
    assert sum(r["bytes_written"] for r in saved) == _data_bytes_on_disk(path) < _total_nbytes()
    ck = open_checkpoint(path)
    assert ck.manifest.version == _compressed_version(ck)
    _check_numpy(cairn.load(path))


def test_split_replicas_spreads_replicated_writes(tmp_path):
    plain = run(4, "save", {"path": str(tmp_path / "plain"), "mesh": MESH_4})
    split = run(4, "save", {"path": str(tmp_path / "split"), "mesh": MESH_4, "split_replicas": True})
    total = _total_nbytes()
    for name, results in (("plain", plain), ("split", split)):
        assert sum(r["bytes_written"] for r in results) == total == _data_bytes_on_disk(str(tmp_path / name))
    plain_bytes = [r["bytes_written"] for r in plain]
    split_bytes = [r["bytes_written"] for r in split]
    # Without splitting, process 0 writes every replicated chunk; with it, the load spreads.
    assert plain_bytes[0] == max(plain_bytes) and plain_bytes[0] > 2 * min(plain_bytes)
    assert max(split_bytes) < max(plain_bytes)
    assert sum(1 for b in split_bytes if b > min(plain_bytes)) >= 2, split_bytes
    _check_numpy(cairn.load(tmp_path / "split"))


def test_async_save_then_donating_step(tmp_path):
    path = str(tmp_path / "async")
    out = run(2, "async_then_donate", {"path": path, "mesh": MESH_2})
    for r in out:
        assert r["donated"] == ["b", "e", "v", "w"]  # the step really reused the saved buffers
        assert r["keys_left_of_first_save"] == 0  # the service forgot the first save's keys
    # The checkpoint holds the values from before the donating step.
    _check_numpy(cairn.load(path))
    assert all(r["shards_checked"] == 8 for r in run(2, "load", {"path": path, "mesh": MESH_2}))


@pytest.mark.parametrize(("n", "fail_on", "use_async"), [(4, 2, True), (2, 0, False)])
def test_one_process_raising_fails_every_process(tmp_path, n, fail_on, use_async):
    mesh = MESH_4 if n == 4 else MESH_2
    out = run(n, "save_twice", {"path": str(tmp_path), "mesh": mesh, "fail_on": fail_on, "use_async": use_async})
    for r in out:
        assert r["error"] is not None
        assert f"process {fail_on}: OSError" in r["error"] and "No space left" in r["error"], r["error"]
        assert str(tmp_path / "bad") in r["error"]
        assert not r["bad_exists"]
    # Nothing of the failed attempt is visible, or left behind; the earlier checkpoint is intact.
    assert sorted(os.listdir(tmp_path)) == ["good"]
    with pytest.raises(cairn.CheckpointNotFoundError):
        cairn.load(tmp_path / "bad")
    _check_numpy(cairn.load(tmp_path / "good"))


@pytest.mark.slow
def test_killed_process_fails_the_save_and_leaves_it_invisible(tmp_path):
    # Recoverability keeps the survivors alive when a peer dies; the save's
    # timeout (6 s here) then fails it, naming the dead process and its last step.
    procs = start(2, "save_twice", {"path": str(tmp_path), "mesh": MESH_2, "fail_on": 1, "action": "kill",
                                    "timeout": 6}, recoverable=True, heartbeat_s=3)
    out = wait(procs, 120, expect_exit=lambda i: i != 1)
    assert procs[1].popen.returncode == -9
    err = out[0]["error"]
    assert err is not None and "process 1 (last step: got 'cairn/save/1/token')" in err and "status" in err, err
    assert not os.path.exists(tmp_path / "bad")
    with pytest.raises(cairn.CheckpointNotFoundError):
        cairn.load(tmp_path / "bad")
    _check_numpy(cairn.load(tmp_path / "good"))


@pytest.mark.slow
def test_killed_primary_takes_the_group_down_and_leaves_nothing_visible(tmp_path):
    # Process 0 hosts the coordination service: when it dies mid-save the
    # whole group goes down with it. Whatever was written stays invisible.
    procs = start(2, "save_twice", {"path": str(tmp_path), "mesh": MESH_2, "fail_on": 0, "action": "kill",
                                    "timeout": 30}, recoverable=True, heartbeat_s=3)
    wait(procs, 120, expect_exit=lambda i: False)
    assert procs[0].popen.returncode == -9
    assert procs[1].popen.returncode != 0
    visible = [n for n in os.listdir(tmp_path) if not n.startswith(".")]
    assert visible == ["good"]
    with pytest.raises(cairn.CheckpointNotFoundError):
        cairn.load(tmp_path / "bad")
    _check_numpy(cairn.load(tmp_path / "good"))


def test_preemption_seen_by_one_process_stops_all_at_one_saved_step(tmp_path):
    """JAX's preemption service spreads a SIGTERM to every process; the manager saves one agreed step."""
    results = run(2, "preempt_one", {"directory": str(tmp_path / "run"), "mesh": MESH_2,
                                     "signal_process": 1, "signal_at": 5}, timeout=150)
    stopped = {r["stopped"] for r in results}
    assert len(stopped) == 1 and None not in stopped, results
    (step,) = stopped
    assert step >= 5
    assert all(r["steps"] == [step] for r in results), results
    loaded = cairn.load(str(tmp_path / "run" / f"step_{step:08d}"))
    np.testing.assert_array_equal(loaded["params"]["w"], scenarios.expected("w", *scenarios.LEAVES["w"][:2]))


STRESS = os.environ.get("CAIRN_STRESS") == "1"


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_kill_anywhere_in_a_two_process_save(tmp_path, victim):
    """SIGKILL one process before each of its storage operations in a save (all of them under
    CAIRN_STRESS=1, every third and the last otherwise): the earlier checkpoint always loads, the new one is
    either absent or complete, and a new save beside the leftovers succeeds."""
    probe = run(2, "kill_at_op", {"path": str(tmp_path / "probe"), "mesh": MESH_2, "victim": victim, "op": 10**6},
                timeout=120)
    total = probe[victim]["ops"]
    # at least a data file and its binary index part (the primary also writes indexes and the manifest)
    assert total >= 2 and all(r["error"] is None for r in probe)
    points = range(total) if STRESS else sorted({*range(0, total, 3), total - 1})
    outcomes = {"absent": 0, "complete": 0}
    for op in points:
        where = tmp_path / f"k{op}"
        procs = start(2, "kill_at_op", {"path": str(where), "mesh": MESH_2, "victim": victim, "op": op},
                      recoverable=True, heartbeat_s=3)
        wait(procs, 120, expect_exit=lambda i: False)
        assert procs[victim].popen.returncode == -9, f"op {op}: the victim was not killed"
        _check_numpy(cairn.load(where / "good"))
        assert sorted(n for n in os.listdir(where) if not n.startswith(".")) in (["good"], ["bad", "good"])
        try:
            out = cairn.load(where / "bad")
        except cairn.CheckpointNotFoundError:
            outcomes["absent"] += 1
        else:
            _check_numpy(out)
            outcomes["complete"] += 1
        cairn.save(where / "next", {"x": np.arange(3)})  # leftovers never block a new save
        assert cairn.load(where / "next")["x"].tolist() == [0, 1, 2]
    assert sum(outcomes.values()) == len(points)


def test_a_typed_key_per_device_across_processes(tmp_path):
    out = run(2, "keys_per_host", {"path": str(tmp_path / "keys"), "mesh": MESH_2})
    assert out == [{"same": 2, "replicated": 2}] * 2
    data = cairn.load(tmp_path / "keys")["rng"]  # numpy: the key data, uint32
    assert data.dtype == np.uint32 and data.shape == (4, 4)


@pytest.mark.parametrize("slow", [0, 1])
def test_continuous_checkpointing_skips_the_same_steps_on_every_process(tmp_path, slow):
    """One process writes slowly (its data writes take a second each): with continuous=True every
    process saves and skips the same steps, whichever process is slow, and what was saved commits."""
    out = run(2, "continuous_agree", {"directory": str(tmp_path / "run"), "mesh": MESH_2, "slow_process": slow})
    assert out[0] == out[1], out
    r = out[0]
    assert r["saved"][0] == 0 and 1 in r["skipped_steps"], r  # step 0's save is in flight at step 1
    assert r["saved"] == r["committed"] and r["skipped"] == 8 - len(r["saved"])
