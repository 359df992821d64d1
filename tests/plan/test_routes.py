"""The load routes' cost model (`_plan.routes`): seconds per route, bandwidths, the choice."""

from __future__ import annotations

import numpy as np
import pytest

from cairn._plan.estimate import estimate_read_work, estimate_reads
from cairn._plan.routes import (
    HOST_DEFAULTS,
    INTERCONNECT_DEFAULTS,
    STORAGE_DEFAULTS,
    Bandwidths,
    Layout,
    choose,
    default_bandwidths,
    received_elements,
    resolve_bandwidths,
)

MESH = ("x", "y"), (2, 4)
MIB = 1 << 20


def _layout(*spec):
    return Layout(*MESH, tuple(tuple(e) for e in spec))


# Rows saved, columns wanted, 2 processes: the direct path rereads whole row chunks (2x the array),
# the staged route reads each byte once and moves a quarter of it between processes.
TARGET, STAGE = _layout((), ("x", "y")), _layout(("x", "y"), ())
NBYTES = 1024 * MIB
COSTS = {TARGET: (2 * NBYTES, 16), STAGE: (NBYTES, 8)}
MOVED = {(STAGE, TARGET): NBYTES // 2}


def _choose(bw, forced=False):
    return choose(TARGET, (4096, 4096), NBYTES, COSTS.__getitem__, forced, moved=lambda a, b: MOVED[a, b],
                  bandwidths=bw, processes=2)


def test_slow_interconnect_and_fast_disk_read_directly():
    plan = _choose(Bandwidths(storage_gbps=4.0, interconnect_gbps=1.0))
    assert plan.kind == "direct" and plan.steps == () and plan.by == "seconds"
    alts = {a.kind: a for a in plan.alternatives}
    # direct: 1 GiB per process at 4 GB/s; staged: 0.5 GiB at 4 GB/s + 256 MiB at 1 GB/s.
    assert alts["direct"].seconds == pytest.approx(NBYTES / 4e9)
    assert alts["staged"].seconds == pytest.approx(NBYTES / 2 / 4e9 + NBYTES / 4 / 1e9)
    assert alts["staged"].interconnect_bytes == NBYTES // 2 and alts["direct"].interconnect_bytes == 0


def test_object_store_and_fast_interconnect_read_once():
    plan = _choose(Bandwidths(storage_gbps=2.0, interconnect_gbps=100.0, request_ms=2.0))
    assert plan.kind == "staged" and plan.read == STAGE and plan.steps == (TARGET,)
    assert plan.cost == NBYTES and plan.interconnect == NBYTES // 2
    assert plan.seconds == min(a.seconds for a in plan.alternatives)


def test_requests_are_priced():
    # Equal bytes, equal interconnect: the route with fewer requests wins on its latency alone.
    costs = {TARGET: (NBYTES, 100_000), STAGE: (NBYTES, 8)}
    plan = choose(TARGET, (4096, 4096), NBYTES, costs.__getitem__, False, moved=lambda a, b: 0,
                  bandwidths=Bandwidths(2.0, 100.0, request_ms=1.0), processes=2)
    assert plan.kind == "staged"
    plan = choose(TARGET, (4096, 4096), NBYTES, costs.__getitem__, False, moved=lambda a, b: 0,
                  bandwidths=Bandwidths(2.0, 100.0, request_ms=0.0), processes=2)
    assert plan.kind == "direct"  # a tie in seconds: fewer collectives


def test_read_once_true_still_forces_the_fewest_bytes_and_prices_them():
    bw = Bandwidths(storage_gbps=4.0, interconnect_gbps=0.1)
    plan = _choose(bw, forced=True)
    assert plan.kind == "staged" and plan.by == "forced"
    alts = {a.kind: a for a in plan.alternatives}
    assert alts["staged"].seconds > alts["direct"].seconds  # slower, and taken because it was asked for


def test_without_bandwidths_routes_are_chosen_by_bytes():
    plan = _choose(None)
    assert plan.kind == "staged" and plan.by == "bytes" and all(a.seconds is None for a in plan.alternatives)


def test_defaults_per_backend_and_platform():
    local_cpu = default_bandwidths("local", "cpu")
    assert (local_cpu.storage_gbps, local_cpu.interconnect_gbps) == (STORAGE_DEFAULTS["local"][0],
                                                                     INTERCONNECT_DEFAULTS["cpu"])
    obj_gpu, obj_tpu = default_bandwidths("object", "gpu"), default_bandwidths("object", "tpu")
    assert obj_gpu.storage_gbps < local_cpu.storage_gbps and obj_gpu.request_ms > local_cpu.request_ms
    assert local_cpu.interconnect_gbps < local_cpu.storage_gbps < obj_gpu.interconnect_gbps <= obj_tpu.interconnect_gbps
    assert obj_gpu.source == "default: object storage, gpu interconnect"
    assert local_cpu.host_gbps == HOST_DEFAULTS["cpu"] > 0 and obj_tpu.host_gbps == HOST_DEFAULTS["tpu"] > 0
    # The two regimes, from the defaults alone: CPU hosts read directly, an object store
    # behind a GPU interconnect reads once.
    assert _choose(local_cpu).kind == "direct" and _choose(obj_gpu).kind == "staged"


def test_declared_bandwidths_override_the_defaults():
    bw = resolve_bandwidths({"interconnect_gbps": 100}, "local", "cpu")
    assert bw.interconnect_gbps == 100.0 and bw.storage_gbps == STORAGE_DEFAULTS["local"][0]
    assert bw.source.startswith("declared interconnect_gbps;")
    full = resolve_bandwidths({"storage_gbps": 1, "interconnect_gbps": 2, "request_ms": 0, "host_gbps": 0},
                              "object", "gpu")
    assert (full.storage_gbps, full.interconnect_gbps, full.request_ms, full.host_gbps, full.source) == (
        1.0, 2.0, 0.0, 0.0, "declared")
    assert resolve_bandwidths(Bandwidths(3.0, 4.0), "object", "tpu").storage_gbps == 3.0
    for bad in ({"storage": 1}, {"storage_gbps": 0}, {"interconnect_gbps": -1}, {"storage_gbps": "fast"},
                {"request_ms": float("nan")}, {"host_gbps": -1}, [("storage_gbps", 1)]):
        with pytest.raises(ValueError, match="bandwidths"):
            resolve_bandwidths(bad, "local", "cpu")


def test_received_elements_counts_each_device_less_what_its_process_holds():
    # Two devices of a process want columns 0-2 and 2-4 of a 4x4 array; the process holds rows 0-2.
    want = [((0, 4), (0, 2)), ((0, 4), (2, 4))]
    assert received_elements(want, [((0, 2), (0, 4))]) == 8
    assert received_elements(want, [((0, 4), (0, 4))]) == 0
    # Replicas on two devices of one process each receive their copy.
    assert received_elements([((0, 4), (0, 4))] * 2, [((0, 2), (0, 4))]) == 16


def test_estimate_counts_requests():
    grid = ((0, 8, 16), (0, 16))  # two row chunks of 8 x 16 float32 (512 bytes each)
    nbytes, requests = estimate_reads(grid, 4, [((0, 16), (0, 16))], block_size=4096, verify=True)
    assert (nbytes, requests) == (1024, 2)
    assert estimate_reads(grid, 4, [((0, 16), (0, 16))], 4096, True, max_read=128) == (1024, 8)
    assert estimate_reads(grid, 4, [], 4096) == (0, 0)


def test_estimate_of_a_compressed_leaf_counts_stored_blocks():
    """With `stored` (a compressed leaf), each range is widened to whole blocks, charged their stored
    sizes, and blocks that several boxes touch are charged once; requests still count raw ranges."""
    grid = ((0, 8, 16), (0, 16))  # two row chunks of 8 x 16 float32: 512 bytes, 4 blocks of 128 each
    sizes = {0: (10, 20, 30, 40), 1: (1, 2, 3, 4)}
    calls = []

    def stored(cell):
        calls.append(cell)
        return sizes[cell]

    # Rows 1..2 of chunk 0 (bytes 64..192: blocks 0 and 1), row 12 of chunk 1 (bytes 256..320: block 2).
    boxes = [((1, 3), (0, 16)), ((12, 13), (0, 16))]
    assert estimate_reads(grid, 4, boxes, 128, verify=False, stored=stored) == (10 + 20 + 3, 2)
    assert estimate_reads(grid, 4, boxes, 128, verify=False) == (128 + 64, 2)  # raw, unwidened
    # Two boxes sharing block 1 of chunk 0: charged once. Column boxes touch every block of their rows.
    assert estimate_reads(grid, 4, [((0, 3), (0, 16)), ((3, 4), (0, 16))], 128, stored=stored)[0] == 30
    assert estimate_reads(grid, 4, [((0, 16), (0, 4)), ((0, 16), (8, 12))], 128, stored=stored)[0] == 100 + 10
    assert sorted(set(calls)) == [0, 1]


def test_load_rejects_bad_bandwidths(tmp_path):
    import cairn

    cairn.save(tmp_path / "ck", {"a": np.arange(4)})
    with pytest.raises(ValueError, match="unknown keys"):
        cairn.load(tmp_path / "ck", bandwidths={"disk": 1})
    assert cairn.load(tmp_path / "ck", bandwidths={"storage_gbps": 1})["a"].tolist() == [0, 1, 2, 3]


def test_manager_restore_forwards_bandwidths(tmp_path):
    import cairn

    with cairn.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"a": np.arange(4)})
        mgr.wait()
        assert mgr.restore(bandwidths={"interconnect_gbps": 100})["a"].tolist() == [0, 1, 2, 3]
        with pytest.raises(ValueError, match="unknown keys"):
            mgr.restore(bandwidths={"network": 1})


def test_host_work_is_priced_and_can_change_the_route():
    # Direct reads read twice the bytes (all checked) and copy half of them out strided; the staged
    # route checks its bytes once and lands them in place. With a fast disk and a 1 GB/s interconnect
    # the bytes alone favour direct; the host's CRC and copies at 4 GB/s tip it to staged.
    costs = {TARGET: (2 * NBYTES, 16, 3 * NBYTES), STAGE: (NBYTES, 8, NBYTES)}

    def pick(host_gbps):
        return choose(TARGET, (4096, 4096), NBYTES, costs.__getitem__, False, moved=lambda a, b: MOVED[a, b],
                      bandwidths=Bandwidths(8.0, 1.0, host_gbps=host_gbps), processes=2)

    assert pick(0.0).kind == "direct"  # host work left out
    plan = pick(4.0)
    assert plan.kind == "staged"
    alts = {a.kind: a for a in plan.alternatives}
    assert alts["direct"].host_bytes == 3 * NBYTES and alts["staged"].host_bytes == NBYTES
    assert alts["direct"].seconds == pytest.approx(NBYTES / 8e9 + 1.5 * NBYTES / 4e9)
    assert alts["staged"].seconds == pytest.approx(NBYTES / 2 / 8e9 + NBYTES / 4 / 1e9 + NBYTES / 2 / 4e9)
    # The same inputs give the same route however often and in whatever order they are priced.
    assert {pick(4.0).kind for _ in range(3)} == {"staged"}


def test_estimate_counts_bytes_that_cannot_land_in_place():
    grid = ((0, 64, 128), (0, 32))  # two row chunks of 64 x 32 float32 (8 KiB each)
    strips = [((0, 128), (8 * i, 8 * (i + 1))) for i in range(4)]  # column strips: strided in every chunk
    work = estimate_read_work(grid, 4, strips, block_size=4096)
    assert work.nbytes == 2 * 8192 and work.scattered == 128 * 32 * 4
    rows = [((32 * i, 32 * (i + 1)), (0, 32)) for i in range(4)]  # row blocks: contiguous in chunk and box
    assert estimate_read_work(grid, 4, rows, block_size=4096).scattered == 0
    # Whole rows of a chunk into part of a wider box: contiguous in the chunk, strided in the box.
    assert estimate_read_work(((0, 128), (0, 16, 32)), 4, [((0, 4), (0, 32))], 4096).scattered == 4 * 32 * 4
    assert estimate_read_work(grid, 4, [((0, 1), (0, 32))], 4096).scattered == 0  # one row: one run
