"""The fast paths of save and load planning against the plain code that defines them: the numpy
layout (`_grid`), row merging (`_merge`) and the cells a load fetches (`_binindex.cells_in`)."""

from __future__ import annotations

import itertools
import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn._format.binindex import cells_in
from cairn._plan import chunking as _plan
from cairn._plan import reads as _reads
from cairn._plan import rowmerge as _merge
from cairn._plan.chunking import ChunkLayout, LayoutError, chunk_layout
from cairn._plan.grid import regular_layout, spec_boxes
from cairn._save import assign as _layout


def _loop_layout(*args):
    """`chunk_layout` by its loop alone (the numpy path switched off)."""
    with mock.patch.object(_plan, "regular_layout", lambda *a: None):
        return chunk_layout(*args)


def _outcome(fn):
    try:
        return fn()
    except LayoutError as e:
        return ("error", str(e))


@st.composite
def sharded(draw):
    """A shape, the boxes of its devices (some cut unevenly, some replicated, in any order), their
    processes, and sometimes a defect (a missing device, a stray box)."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 24), min_size=ndim, max_size=ndim)))
    cuts = []
    for n in shape:
        inner = draw(st.sets(st.integers(1, n - 1), max_size=min(4, n - 1))) if n > 1 else set()
        cuts.append(sorted({0, n, *inner}))
    cells = [tuple((c[i], c[i + 1]) for c, i in zip(cuts, idx))
             for idx in itertools.product(*(range(len(c) - 1) for c in cuts))]
    copies = draw(st.integers(1, 3))
    boxes = [box for box in cells for _ in range(copies)]
    boxes = draw(st.permutations(boxes))
    defect = draw(st.sampled_from(["none", "none", "none", "drop", "stray"]))
    if defect == "drop" and len(boxes) > 1:
        boxes = boxes[1:] if copies == 1 else boxes
    elif defect == "stray":
        a = draw(st.integers(0, ndim - 1))
        box = list(boxes[0])
        box[a] = (0, 1) if shape[a] > 1 and box[a] != (0, 1) else (0, shape[a])
        boxes = [tuple(box), *boxes[1:]]
    per_process = draw(st.sampled_from([1, 2, 3, 4]))
    procs = [d // per_process for d in range(len(boxes))]
    if draw(st.booleans()):
        procs = draw(st.permutations(procs))
    return shape, boxes, procs


@settings(max_examples=300, deadline=None)
@given(sharded(), st.booleans(), st.integers(-3, 7), st.sampled_from([0, 1, 4, 30, 10**9]))
def test_numpy_layout_equals_the_loop(case, split_replicas, offset, split_elems):
    shape, boxes, procs = case
    want = _outcome(lambda: _loop_layout(shape, boxes, procs, split_replicas, offset, split_elems))
    got = _outcome(lambda: chunk_layout(shape, boxes, procs, split_replicas, offset, split_elems))
    assert got == want
    fast = regular_layout(shape, boxes, procs, split_replicas, offset, split_elems)
    if fast is not None:  # the numpy path answers only what the loop accepts
        assert ChunkLayout(*fast) == want


def test_numpy_layout_leaves_odd_input_to_the_loop():
    assert regular_layout((), [(), ()], [0, 1], False, 0, 0) is None
    assert regular_layout((4, 0), [((0, 4), (0, 0))], [0], False, 0, 0) is None
    assert regular_layout((4,), [((0, 2),), ((0, 1), (2, 4))], [0, 0], False, 0, 0) is None  # ranks differ
    assert regular_layout((4,), [((0, 2, 3),), ((2,),)], [0, 0], False, 0, 0) is None  # not pairs
    assert regular_layout((4,), [((0, 2),), ((2, 4),)], [0], False, 0, 0) is None  # processes missing
    with pytest.raises(LayoutError, match="rank 2"):
        chunk_layout((4,), [((0, 4), (0, 1))], [0])


def _loop_merge(layout: ChunkLayout, itemsize: int, max_bytes: int) -> tuple:
    """Row groups as `merge_rows` defines them: row by row, greedily."""
    grid = layout.grid
    rows = len(grid[0]) - 1
    per_row = len(layout.writer) // rows
    other = 1
    for b in grid[1:]:
        other *= max(hi - lo for lo, hi in itertools.pairwise(b))
    groups, size = [[0]], (grid[0][1] - grid[0][0]) * other * itemsize
    for j in range(1, rows):
        row = (grid[0][j + 1] - grid[0][j]) * other * itemsize
        same = layout.writer[j * per_row : (j + 1) * per_row] == layout.writer[(j - 1) * per_row : j * per_row]
        if same and size + row <= max_bytes:
            groups[-1].append(j)
            size += row
        else:
            groups.append([j])
            size = row
    return tuple(map(tuple, groups))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=2, max_size=12), st.integers(1, 3),
       st.lists(st.integers(0, 2), min_size=12, max_size=36), st.integers(0, 200), st.sampled_from([1, 2, 4]),
       st.booleans())
def test_merged_rows_equal_the_loop(heights, cols, writers, max_bytes, itemsize, even):
    if even:  # the usual case, which `merge_rows` computes without a loop
        heights = [heights[0]] * len(heights)
    grid0 = tuple(itertools.accumulate([0, *heights]))
    grid = (grid0, tuple(range(0, 3 * cols + 1, 3)))
    n = len(heights) * cols
    writer = tuple((writers * 3)[:n])
    layout = ChunkLayout(grid, writer, tuple(range(n)))
    merged = _merge.merge_rows(layout, itemsize, max_bytes)
    groups = _loop_merge(layout, itemsize, max_bytes)
    if len(groups) == len(heights):
        assert merged is layout
        return
    assert merged.row_groups == groups
    assert merged.grid == ((*(grid0[g[0]] for g in groups), grid0[-1]), grid[1])
    rows = [slice(g[0] * cols, (g[0] + 1) * cols) for g in groups]
    assert merged.writer == tuple(w for r in rows for w in writer[r])
    assert merged.source == tuple(s for r in rows for s in layout.source[r])
    for cell in range(len(merged.writer)):  # every merged chunk is made of its rows' shards
        assert [src for _, src in _merge.pieces(merged, cell)] == [
            j * cols + cell % cols for j in groups[cell // cols]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=5), min_size=1, max_size=3), st.data())
def test_cells_in_are_the_cells_the_planner_overlaps(steps, data):
    grid = tuple(tuple(itertools.accumulate([0, *s])) for s in steps)
    shape = tuple(len(b) - 1 for b in grid)
    boxes = []
    for _ in range(data.draw(st.integers(0, 4))):
        box = []
        for b in grid:
            lo = data.draw(st.integers(0, b[-1]))
            box.append((lo, data.draw(st.integers(lo, b[-1]))))
        boxes.append(tuple(box))
    want = sorted({_plan.ravel(idx, shape) for box in boxes for idx in _reads.overlapping_cells(grid, box)})
    got = cells_in(grid, boxes)
    assert got.dtype == np.int64 and got.tolist() == want
    with pytest.raises(ValueError):
        cells_in(grid, [tuple((0, b[-1] + 1) for b in grid)])


def test_cells_in_a_box_over_many_cells():
    grid = ((0, *range(1, 101)), tuple(range(0, 101, 2)))  # 100 x 50 cells
    assert cells_in(grid, [((0, 100), (0, 100)), ((5, 6), (0, 1))]).tolist() == list(range(5000))
    assert cells_in(grid, [((10, 12), (3, 5)), ((0, 0), (0, 100))]).tolist() == [501, 502, 551, 552]


@settings(max_examples=300, deadline=None)
@given(sharded(), st.booleans(), st.integers(-3, 7), st.sampled_from([0, 1, 4, 30, 10**9]))
def test_layout_of_a_box_array_equals_that_of_the_box_list(case, split_replicas, offset, split_elems):
    """`spec_boxes`' array form gives the layout (or the error) the list of tuples gives."""
    shape, boxes, procs = case
    if any(len(b) != len(shape) for b in boxes):
        return
    array = np.array(boxes, dtype=np.int64).reshape(len(boxes), len(shape), 2)
    want = _outcome(lambda: chunk_layout(shape, boxes, procs, split_replicas, offset, split_elems))
    got = _outcome(lambda: chunk_layout(shape, array, np.array(procs, dtype=np.int64), split_replicas,
                                        offset, split_elems))
    assert got == want
    assert _layout._shared_cells(array, np.array(procs)) == _layout._shared_cells(list(boxes), np.array(procs))


def _mesh_shapes(n: int) -> list[tuple[int, ...]]:
    """Mesh shapes of `n` devices, axes of length 1 included."""
    return [s for k in (1, 2, 3) for s in itertools.product((1, 2, 4, 8), repeat=k) if math.prod(s) == n]


@st.composite
def named(draw):
    """A mesh over some of the 8 CPU devices (any order), a partition spec over its axes, and a
    shape: usually divisible by the spec's shard counts, sometimes not."""
    import jax

    n = draw(st.sampled_from([1, 2, 4, 8]))
    dims = draw(st.sampled_from(_mesh_shapes(n)))
    names = ("a", "b", "c")[: len(dims)]
    devices = draw(st.permutations(jax.devices()[:n]))
    ndim = draw(st.integers(1, 3))
    free = list(names)
    spec = []
    for _ in range(draw(st.integers(0, ndim))):
        k = draw(st.integers(0, min(2, len(free))))
        take = [free.pop(draw(st.integers(0, len(free) - 1))) for _ in range(k)]
        spec.append(None if not take else take[0] if len(take) == 1 and draw(st.booleans()) else tuple(take))
    size = dict(zip(names, dims))
    parts = [math.prod(size[x] for x in (() if e is None else (e,) if isinstance(e, str) else e)) for e in spec]
    parts += [1] * (ndim - len(spec))
    shape = tuple(p * draw(st.integers(1, 3)) + (draw(st.sampled_from([0, 0, 0, 1])) if p > 1 else 0)
                  for p in parts)
    return np.array(devices).reshape(dims), names, tuple(spec), shape


@settings(max_examples=200, deadline=None)
@given(named())
def test_named_sharding_boxes_by_arithmetic_are_jax_s(case):
    """`device_box_array`'s arithmetic (`_grid.spec_boxes`) gives JAX's `devices_indices_map`:
    the same devices in the same order, the same box on each."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from cairn._tree import shardings as _jaxutil

    mesh_devices, names, spec, shape = case
    sharding = NamedSharding(Mesh(mesh_devices, names), PartitionSpec(*spec))
    try:
        want_devices, want_boxes = _jaxutil.device_boxes(sharding, shape)
    except Exception as e:  # JAX refuses uneven shards: so must this (it asks JAX then)
        with pytest.raises(type(e)):
            _jaxutil.device_box_array(sharding, shape)
        assert spec_boxes(shape, mesh_devices.shape, names, spec) is None
        return
    devices, boxes, procs = _jaxutil.device_box_array(sharding, shape)
    assert list(devices) == want_devices
    assert procs.tolist() == [d.process_index for d in want_devices]
    divisible = spec_boxes(shape, mesh_devices.shape, names, spec) is not None
    assert isinstance(boxes, np.ndarray) == divisible
    got = [tuple(map(tuple, b)) for b in boxes.tolist()] if divisible else boxes
    assert got == want_boxes


def test_spec_boxes_leaves_what_it_does_not_know_to_jax():
    assert spec_boxes((4,), (2,), ("a",), ("b",)) is None  # no such axis
    assert spec_boxes((4, 4), (2,), ("a",), ("a", "a")) is None  # an axis twice
    assert spec_boxes((4,), (2,), ("a",), ("a", None)) is None  # more entries than axes
    assert spec_boxes((3,), (2,), ("a",), ("a",)) is None  # uneven
    assert spec_boxes((0,), (2,), ("a",), (None,)) is None  # empty
    assert spec_boxes((4,), (2,), ("a",), (object(),)) is None  # UNCONSTRAINED and the like
    assert spec_boxes((4, 6), (2, 3), ("a", "b"), (None, ("b",))).tolist() == [
        [[0, 4], [0, 2]], [[0, 4], [2, 4]], [[0, 4], [4, 6]]] * 2


def test_memo_is_bounded_and_skips_unhashable_keys():
    from cairn._core.memo import Memo

    m: Memo[int] = Memo(limit=3)
    assert m.put(("a", 1), 10) == 10 and m.get(("a", 1)) == 10
    assert m.put(["unhashable"], 5) == 5 and m.get(["unhashable"]) is None  # not cached, no error
    for i in range(3):
        m.put(i, i)
    assert m.get(("a", 1)) is None and m.get(2) == 2  # full: forgot everything before the newest
