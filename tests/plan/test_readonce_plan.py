"""The pure part of read-once restore: layouts, route choice, and the read estimate."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn._core.boxes import cell_box
from cairn._format import manifest as fmt
from cairn._plan.estimate import estimate_read_bytes
from cairn._plan.reads import plan_reads
from cairn._plan.routes import DIRECT_MAX, Layout, choose, refined_layout, staging_layout

MESH = ("x", "y"), (2, 4)


def _layout(*spec):
    return Layout(*MESH, tuple(tuple(e) for e in spec))


def test_refined_folds_replicated_axes_onto_the_leading_divisible_axis():
    assert refined_layout(_layout((), ()), (64, 8)) == _layout(("x", "y"), ())
    assert refined_layout(_layout((), ("y",)), (64, 8)) == _layout(("x",), ("y",))
    # Leading axis too small for the replicated axes: the next one takes them.
    assert refined_layout(_layout((), ()), (3, 16)) == _layout((), ("x", "y"))
    # Nothing replicated: the target itself. Nothing divides: None.
    assert refined_layout(_layout(("x",), ("y",)), (64, 8)) == _layout(("x",), ("y",))
    assert refined_layout(_layout((), ()), (3, 5)) is None


def test_staging_cuts_one_block_per_device():
    assert staging_layout(_layout((), ("y",)), (64, 8)) == _layout(("x", "y"), ())
    assert staging_layout(_layout((), ()), (6, 16)) == _layout((), ("x", "y"))
    assert staging_layout(_layout((), ()), (6, 6)) is None


def _costs(table):
    return lambda layout: table[layout]


def test_choose_keeps_the_direct_path_when_it_is_cheap():
    target = _layout(("x",), ("y",))
    plan = choose(target, (64, 8), 1000, _costs({target: 1100}), forced=False)
    assert plan.read == target and plan.steps == () and plan.cost == 1100


def test_choose_reads_the_refined_layout_for_replicas():
    target, refined = _layout((), ("y",)), _layout(("x",), ("y",))
    plan = choose(target, (64, 8), 1000, _costs({target: 2000, refined: 1000}), forced=False)
    assert plan.read == refined and plan.steps == (target,) and plan.cost == 1000


def test_choose_stages_through_the_refined_layout_when_both_are_strided():
    target, refined, stage = _layout((), ("y",)), _layout(("x",), ("y",)), _layout(("x", "y"), ())
    plan = choose(target, (64, 8), 1000, _costs({target: 4000, refined: 2000, stage: 1000}), forced=False)
    assert plan.read == stage and plan.steps == (refined, target) and plan.direct_cost == 4000


def test_choose_never_goes_straight_from_staged_to_a_retiled_replicated_target():
    # No fully tiled layout to pass through: XLA would replicate the whole array first.
    target = _layout((), ())
    plan = choose(target, (3, 5), 15, _costs({target: 30}), forced=False)
    assert plan.steps == () and plan.cost == 30 > DIRECT_MAX * 15


# ---------------------------------------------------------------------- the estimate


@st.composite
def leaves_and_boxes(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 24)) for _ in range(ndim))
    grid = tuple(tuple(sorted({0, n, *draw(st.lists(st.integers(0, n), max_size=3))})) for n in shape)
    chunks, crcs, off = [], [], 0
    for c in range(int(np.prod([len(g) - 1 for g in grid]))):
        nbytes = int(np.prod([hi - lo for lo, hi in cell_box(grid, c)])) * 4
        chunks.append((0, off))
        crcs.append((0,) * max(1, -(-nbytes // 4096)))
        off += nbytes
    leaf = fmt.ArrayLeaf("x", np.dtype(np.float32), shape, grid, tuple(chunks), tuple(crcs))
    boxes = []
    for _ in range(draw(st.integers(1, 4))):
        box = []
        for n in shape:
            lo = draw(st.integers(0, n - 1))
            box.append((lo, draw(st.integers(lo + 1, n))))
        boxes.append(tuple(box))
    return leaf, list(dict.fromkeys(boxes)), draw(st.booleans())


@settings(max_examples=200, deadline=None)
@given(leaves_and_boxes())
def test_estimate_matches_the_planner_on_small_overlaps(case):
    # Every overlap here is under the planner's 1 MiB "small" size, so it reads covering ranges,
    # which the estimate models exactly.
    leaf, boxes, verify = case
    exact = sum(r.nbytes for r in plan_reads(leaf, boxes, 4096, verify))
    assert estimate_read_bytes(leaf.grid, 4, boxes, 4096, verify) == exact


def test_estimate_bounds_the_planner_when_it_splits_sparse_overlaps():
    # One 4 MiB chunk of 1024 rows; the box wants 16 bytes of every row: the planner
    # splits row by row, the estimate charges the covering range (an upper bound).
    shape = (1024, 1024)
    leaf = fmt.ArrayLeaf("x", np.dtype(np.float32), shape, ((0, 1024), (0, 1024)), ((0, 0),), ((0,) * 4,))
    box = [((0, 1024), (0, 4))]
    exact = sum(r.nbytes for r in plan_reads(leaf, box, 1 << 20, False))
    est = estimate_read_bytes(leaf.grid, 4, box, 1 << 20, False)
    assert exact <= est <= 1024 * 1024 * 4


def test_representative_process_is_the_plain_walk_of_the_devices():
    """`_representative` (memoised; NamedSharding boxes by arithmetic) gives what walking
    `devices_indices_map` gives, with JAX's processes and with another process mapping."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    from cairn._load import readonce as _readonce
    from cairn._tree.shardings import slices_to_box

    def plain(sharding, shape, process_of=None):
        proc = (lambda d: d.process_index) if process_of is None else process_of
        dmap = sharding.devices_indices_map(shape)
        first = proc(next(iter(dmap)))
        return (len({proc(d) for d in dmap}),
                {slices_to_box(i, shape) for d, i in dmap.items() if proc(d) == first})

    mesh = jax.make_mesh((4, 2), ("x", "y"), devices=jax.devices()[::-1])
    pairs = lambda d: d.id // 2  # noqa: E731  (4 "processes" of 2 devices)
    cases = [(NamedSharding(mesh, PartitionSpec(*spec)), shape)
             for spec in (("x", "y"), ("y",), (("x", "y"),), (), (None, "x"))
             for shape in ((16, 8), (8, 4, 2))]
    cases.append((SingleDeviceSharding(jax.devices()[3]), (5, 3)))
    for sharding, shape in cases:
        for process_of in (None, pairs):
            got = _readonce._representative(sharding, shape, process_of)
            assert got == plain(sharding, shape, process_of), (sharding, shape, process_of)
            assert _readonce._representative(sharding, shape, process_of) is got  # memoised
