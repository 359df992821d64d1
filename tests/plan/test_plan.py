"""The pure planner: chunk grids, writers, file layout, and reads that rebuild any box."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cairn._core.boxes import cell_box
from cairn._core.checksum import crc32c
from cairn._format import manifest as fmt
from cairn._plan.chunking import LayoutError, assign_files, chunk_layout
from cairn._plan.reads import overlapping_cells, plan_reads


def grid_boxes(shape, parts):
    """Boxes of a regular split of `shape` into `parts[a]` pieces per axis (numpy-style)."""
    cuts = [np.linspace(0, n, p + 1).astype(int).tolist() if n else [0, 0] for n, p in zip(shape, parts)]
    boxes = []
    for idx in np.ndindex(*parts):
        boxes.append(tuple((cuts[a][i], cuts[a][i + 1]) for a, i in enumerate(idx)))
    return boxes


def test_layout_one_writer_per_chunk_replicas_once():
    shape = (8, 6)
    boxes = grid_boxes(shape, (4, 1))
    # 8 devices, each chunk held by two devices (replica factor 2), 4 processes of 2 devices.
    device_boxes = boxes + boxes
    device_process = [d // 2 for d in range(8)]
    layout = chunk_layout(shape, device_boxes, device_process)
    assert layout.grid == ((0, 2, 4, 6, 8), (0, 6))
    assert layout.writer == (0, 0, 1, 1)  # the first holder of each chunk
    split = chunk_layout(shape, device_boxes, device_process, split_replicas=True)
    assert split.writer == (0, 2, 1, 3)  # replicas share the write load


def test_layout_rejects_irregular_boxes():
    with pytest.raises(LayoutError, match="regular grid"):
        chunk_layout((4, 4), [((0, 2), (0, 4)), ((2, 4), (0, 2)), ((2, 4), (2, 4)), ((0, 4), (0, 4))], [0] * 4)
    with pytest.raises(LayoutError, match="no device"):
        chunk_layout((4,), [((0, 2),)], [0])


def test_assign_files_balanced_and_contiguous():
    chunks = [(0, c, 10) for c in range(10)]
    files = assign_files(chunks, max_files=4, min_file_bytes=1)
    assert len(files) == 4
    assert sorted((s.leaf, s.cell) for f in files for s in f) == [(0, c) for c in range(10)]
    for f in files:
        assert [s.offset for s in f] == [10 * i for i in range(len(f))]
    assert max(sum(s.nbytes for s in f) for f in files) <= 30
    assert len(assign_files(chunks, max_files=4, min_file_bytes=60)) == 1
    assert assign_files([(0, 0, 0)], 4, 1) == []


# --------------------------------------------------------------------------- reads rebuild any box


def build_leaf(arr, parts, block, order_seed=0):
    """Lay `arr` out as the save engine would (chunks of a grid, shuffled in one file)."""
    shape = arr.shape
    boxes = grid_boxes(shape, parts)
    layout = chunk_layout(shape, boxes, [0] * len(boxes))
    rng = np.random.default_rng(order_seed)
    order = rng.permutation(len(layout.writer))
    data = bytearray()
    chunks = [None] * len(order)
    crcs = [None] * len(order)
    for cell in order:
        box = cell_box(layout.grid, int(cell))
        piece = np.ascontiguousarray(arr[tuple(slice(lo, hi) for lo, hi in box)]).tobytes()
        chunks[cell] = (0, len(data))
        crcs[cell] = tuple(crc32c(piece[o : o + block]) for o in range(0, len(piece), block))
        data += piece
    leaf = fmt.ArrayLeaf("x", arr.dtype, shape, layout.grid, tuple(chunks), tuple(crcs))
    return leaf, bytes(data)


def execute(reads, leaf, data, boxes):
    dests = [np.full(tuple(hi - lo for lo, hi in b), -1, dtype=leaf.dtype) for b in boxes]
    for r in reads:
        buf = np.frombuffer(data[r.start : r.end], dtype=np.uint8)
        for c in r.checks:
            assert crc32c(data[c.start : c.end]) == c.crc
            assert r.start <= c.start < c.end <= r.end
        for cp in r.copies:
            src = np.ndarray(cp.shape, dtype=leaf.dtype, buffer=buf, offset=cp.src_offset, strides=cp.src_strides)
            dests[cp.dest][tuple(slice(s, s + n) for s, n in zip(cp.dest_start, cp.shape))] = src
    return dests


@st.composite
def layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 12)) for _ in range(ndim))
    parts = tuple(draw(st.integers(1, n)) for n in shape)
    tparts = tuple(draw(st.integers(1, n)) for n in shape)
    block = draw(st.sampled_from([16, 64, 4096]))
    verify = draw(st.booleans())
    return shape, parts, tparts, block, verify


@settings(max_examples=150, deadline=None)
@given(layouts(), st.integers(0, 3), st.sampled_from([4 << 20, 64, 200]))
def test_reads_rebuild_every_target_box(case, seed, max_read):
    shape, parts, tparts, block, verify = case
    arr = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
    leaf, data = build_leaf(arr, parts, block, seed)
    boxes = grid_boxes(shape, tparts)
    reads = plan_reads(leaf, boxes, block, verify=verify, small_read=0, max_read=max_read)
    dests = execute(reads, leaf, data, boxes)
    for b, d in zip(boxes, dests):
        np.testing.assert_array_equal(d, arr[tuple(slice(lo, hi) for lo, hi in b)])
    # Every byte read is inside one of the chunks that overlap the targets.
    for r in reads:
        assert 0 <= r.start < r.end <= len(data)
    if not verify:
        total = sum(r.nbytes for r in reads)
        assert total <= len(data) * len(boxes)


def test_same_layout_reads_are_direct_and_exact():
    arr = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    leaf, _ = build_leaf(arr, (8, 1), 1 << 20)
    boxes = grid_boxes(arr.shape, (8, 1))
    reads = plan_reads(leaf, boxes, 1 << 20, max_read=256)  # chunks are 256 bytes
    assert len(reads) == 8 and all(r.direct is not None for r in reads)
    assert sum(r.nbytes for r in reads) == arr.nbytes
    merged = plan_reads(leaf, boxes, 1 << 20)  # small neighbours share one read
    assert len(merged) == 1 and len(merged[0].copies) == 8 and merged[0].nbytes == arr.nbytes


def test_column_split_reads_only_needed_rows_when_sparse():
    # Saved in row blocks, loaded as two column halves of a wide array: with
    # large rows, each target reads its half of every row, not whole chunks.
    arr = np.arange(4 * 1024 * 64, dtype=np.float32).reshape(4, 1024 * 64)
    leaf, data = build_leaf(arr, (1, 1), 4096)
    boxes = [((0, 4), (0, 1024))]  # a narrow column strip
    reads = plan_reads(leaf, boxes, 4096, verify=False, small_read=0)
    assert sum(r.nbytes for r in reads) == 4 * 1024 * 4
    reads_v = plan_reads(leaf, boxes, 4096, verify=True, small_read=0)
    assert sum(r.nbytes for r in reads_v) == 4 * 4096  # widened to one checksum block per row
    np.testing.assert_array_equal(execute(reads_v, leaf, data, boxes)[0], arr[:, :1024])


@pytest.mark.parametrize("verify", [True, False])
def test_column_strips_of_row_chunks_are_read_in_shared_row_slabs(verify):
    # Saved in row chunks, loaded as column strips (FSDP dim 0 -> dim 1): each chunk is read once,
    # in slabs of whole rows of about max_read bytes that every strip takes its copy from, rather
    # than in one read of the whole chunk (checked and scattered from memory, not from cache).
    arr = np.arange(256 * 512, dtype=np.float32).reshape(256, 512)  # rows of 2 KiB, 2 chunks of 256 KiB
    block = 8192  # 4 rows
    leaf, data = build_leaf(arr, (2, 1), block)
    boxes = grid_boxes(arr.shape, (1, 4))
    reads = plan_reads(leaf, boxes, block, verify=verify, max_read=24 << 10)
    rows = 12  # 24 KiB of 2 KiB rows, a whole number of 4-row blocks
    assert len(reads) == 2 * -(-128 // rows)
    assert sorted(len(r.copies) for r in reads) == [4] * len(reads)
    assert all(r.nbytes <= rows * 2048 for r in reads)
    assert sum(r.nbytes for r in reads) == arr.nbytes  # every byte read once
    spans = sorted((r.start, r.end) for r in reads)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    if verify:  # every slab starts on a checksum block of its chunk
        starts = sorted(off for _, off in leaf.chunks)
        assert all((r.start - max(o for o in starts if o <= r.start)) % block == 0 for r in reads)
    for b, d in zip(boxes, execute(reads, leaf, data, boxes)):
        np.testing.assert_array_equal(d, arr[tuple(slice(lo, hi) for lo, hi in b)])
    whole = plan_reads(leaf, boxes, block, verify=verify)  # up to 4 MiB: both chunks in one read, as before
    assert len(whole) == 1 and len(whole[0].copies) == 8


def test_overlapping_cells_bisection():
    grid = ((0, 4, 8, 12), (0, 5, 10))
    assert overlapping_cells(grid, ((3, 5), (0, 5))) == [(0, 0), (1, 0)]
    assert overlapping_cells(grid, ((4, 8), (5, 10))) == [(1, 1)]
    assert overlapping_cells(grid, ((0, 12), (9, 10))) == [(0, 1), (1, 1), (2, 1)]
    assert overlapping_cells(grid, ((2, 2), (0, 10))) == []


def test_large_replicated_chunks_are_split_between_their_holding_processes():
    # A (64, 10) array cut in 2 row blocks, each held by one device of every one of 4 processes.
    shape = (64, 10)
    boxes = grid_boxes(shape, (2, 1))
    device_boxes = [boxes[d % 2] for d in range(8)]
    device_process = [d // 2 for d in range(8)]
    layout = chunk_layout(shape, device_boxes, device_process, replica_offset=1, split_elems=100)
    # Each 32-row chunk splits into 4 pieces of 8 rows, one per holding process.
    assert layout.grid == ((0, 8, 16, 24, 32, 40, 48, 56, 64), (0, 10))
    assert layout.writer == (1, 2, 3, 0, 1, 2, 3, 0)
    for cell, (w, d) in enumerate(zip(layout.writer, layout.source)):
        assert device_process[d] == w
        box = cell_box(layout.grid, cell)
        (dlo, dhi), _ = device_boxes[d]
        assert dlo <= box[0][0] and box[0][1] <= dhi  # the source device holds the piece
    # Every process writes the same number of bytes; every byte once.
    per = [sum(math.prod(h - lo for lo, h in cell_box(layout.grid, c)) for c, w in enumerate(layout.writer) if w == p)
           for p in range(4)]
    assert per == [160] * 4


def test_small_or_unreplicated_chunks_stay_whole():
    shape = (64, 10)
    boxes = grid_boxes(shape, (2, 1))
    replicated = [boxes[d % 2] for d in range(8)]
    procs = [d // 2 for d in range(8)]
    assert chunk_layout(shape, replicated, procs, split_elems=1000).grid == ((0, 32, 64), (0, 10))
    # Replicas within one process only: nothing to spread.
    assert chunk_layout(shape, replicated, [0] * 8, split_elems=1).grid == ((0, 32, 64), (0, 10))
    # No axis long enough for 4 pieces.
    tiny = [((0, 2), (0, 3))] * 8
    assert chunk_layout((2, 3), tiny, procs, split_elems=1).grid == ((0, 2), (0, 3))


# --------------------------------------------------------------------------- plans shared by leaves of one layout


def _cells_touched(leaf, boxes):
    return len({cell for b in boxes for cell in overlapping_cells(leaf.grid, b)})


def _memo_keys_on(leaf, boxes, max_cells):
    """PlanMemo's bound, stated independently: box by box, the cells already seen plus the next box's
    cells (repeats counted) stay within `max_cells` (a cheap bound: no set of a large fan-in is built)."""
    seen: set = set()
    for b in boxes:
        mine = overlapping_cells(leaf.grid, b)
        if len(seen) + len(mine) > max_cells:
            return False
        seen.update(mine)
    return bool(seen)


def _second_leaf(arr, parts, block, seed, shift, file=0):
    """Another leaf of `arr`'s layout, other values, its chunks in the same order `shift` bytes further on."""
    other = arr + 1000
    leaf, data = build_leaf(other, parts, block, seed)
    leaf = fmt.ArrayLeaf("y", leaf.dtype, leaf.shape, leaf.grid,
                         tuple((file, o + shift) for _, o in leaf.chunks), leaf.crcs)
    return other, leaf, data


@settings(max_examples=120, deadline=None)
@given(layouts(), st.integers(0, 3), st.sampled_from([64, 256, 4 << 20]))
def test_plan_memo_gives_each_leaf_of_a_layout_its_own_exact_plan(case, seed, max_read):
    from cairn._plan.readmemo import MAX_CELLS, PlanMemo

    shape, parts, tparts, block, verify = case
    arr = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
    leaf_a, data_a = build_leaf(arr, parts, block, seed)
    other, leaf_b, data_b = _second_leaf(arr, parts, block, seed, len(data_a))
    data = data_a + data_b
    boxes = grid_boxes(shape, tparts)
    memo = PlanMemo()
    reads_a = memo.plan(leaf_a, boxes, block, verify, max_read)
    reads_b = memo.plan(leaf_b, boxes, block, verify, max_read)
    assert reads_a == plan_reads(leaf_a, boxes, block, verify, max_read=max_read)
    assert reads_b == plan_reads(leaf_b, boxes, block, verify, max_read=max_read)
    # The second leaf took the first one's template, unless the layout touches too many cells to key on
    # (with the memo's bound, which counts a cell once per box that touches it while it adds them up).
    assert (memo.misses, memo.hits) == ((1, 1) if _memo_keys_on(leaf_a, boxes, MAX_CELLS) else (0, 0))
    for reads, leaf, want in ((reads_a, leaf_a, arr), (reads_b, leaf_b, other)):
        for b, d in zip(boxes, execute(reads, leaf, data, boxes)):
            np.testing.assert_array_equal(d, want[tuple(slice(lo, hi) for lo, hi in b)])


def test_plan_memo_plans_afresh_when_the_layout_differs():
    from cairn._plan.readmemo import PlanMemo

    arr = np.arange(16 * 12, dtype=np.float32).reshape(16, 12)
    parts, block = (4, 3), 64
    leaf_a, data_a = build_leaf(arr, parts, block, order_seed=0)
    boxes = grid_boxes(arr.shape, (3, 2))
    memo = PlanMemo()
    memo.plan(leaf_a, boxes, block, True, 4 << 20)
    # Same grid, chunks in another order: other relative offsets, so no shared template.
    _, leaf_b, _ = _second_leaf(arr, parts, block, 1, len(data_a))
    assert memo.plan(leaf_b, boxes, block, True, 4 << 20) == plan_reads(leaf_b, boxes, block, True)
    # Chunks in two files: planned afresh too.
    _, leaf_c, _ = _second_leaf(arr, parts, block, 0, 0)
    chunks = list(leaf_c.chunks)
    chunks[-1] = (1, chunks[-1][1])
    leaf_c = fmt.ArrayLeaf("z", leaf_c.dtype, leaf_c.shape, leaf_c.grid, tuple(chunks), leaf_c.crcs)
    assert memo.plan(leaf_c, boxes, block, True, 4 << 20) == plan_reads(leaf_c, boxes, block, True)
    # Other target boxes, other checking: other keys.
    assert memo.plan(leaf_a, grid_boxes(arr.shape, (2, 2)), block, True, 4 << 20) == plan_reads(
        leaf_a, grid_boxes(arr.shape, (2, 2)), block, True)
    assert memo.plan(leaf_a, boxes, block, False, 4 << 20) == plan_reads(leaf_a, boxes, block, False)
    assert memo.hits == 0 and memo.misses == 4  # (the two-file leaf is planned without a template)


def test_plan_memo_plans_a_large_fan_in_afresh():
    from cairn._plan.readmemo import MAX_CELLS, PlanMemo

    arr = np.arange(96 * 4, dtype=np.float32).reshape(96, 4)
    leaf, _ = build_leaf(arr, (96, 1), 64)  # 96 row chunks
    boxes = grid_boxes(arr.shape, (1, 2))  # each box touches all 96
    assert _cells_touched(leaf, boxes) > MAX_CELLS
    memo = PlanMemo()
    assert memo.plan(leaf, boxes, 64, True, 4 << 20) == plan_reads(leaf, boxes, 64, True)
    assert (memo.hits, memo.misses) == (0, 0)
