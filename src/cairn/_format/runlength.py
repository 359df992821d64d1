"""Pure: format version 2's run encodings (docs/FORMAT.md §6.1): a grid axis as runs of equal
cell extents, and the cells' writers as runs of equal-sized groups with writers in arithmetic
progression. Both are O(1) for the shardings models use, where a list per cell is O(devices)."""

from __future__ import annotations

import itertools
import marshal
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._core.memo import Memo
from .._errors import corrupt


def writer_runs(writers: Sequence[int]) -> list[list[int]]:
    """`writers` (one process per cell) as runs ``[groups, first, step, length]``: `groups`
    consecutive groups of `length` cells each, group g written by ``first + g * step``.

    FSDP with one chunk per process is ``[[512, 0, 1, 1]]``, with 8 per process
    ``[[512, 0, 1, 8]]``; one process writing n cells is ``[[1, 0, 0, n]]``.
    """
    w = np.asarray(writers, dtype=np.int64)
    n = len(w)
    if n == 0:
        return []
    starts = np.concatenate([[0], np.flatnonzero(np.diff(w)) + 1])
    values = w[starts].tolist()
    lengths = np.diff(np.concatenate([starts, [n]])).tolist()
    runs: list[list[int]] = []
    k, entries = 0, len(values)
    while k < entries:
        length, first = lengths[k], values[k]
        j = k + 1
        if j < entries and lengths[j] == length:
            step = values[j] - first
            while j < entries and lengths[j] == length and values[j] - values[j - 1] == step:
                j += 1
        else:
            step = 0
        runs.append([j - k, first, step, length])
        k = j
    return runs


_expanded: Memo[np.ndarray] = Memo()


def expand_writers(runs: Any, n_cells: int, processes: int, where: object) -> np.ndarray:
    """The per-cell writer array of `runs`, checked: exactly `n_cells` cells, each in [0, processes).

    Memoised (read-only results): the leaves of one layout repeat the same runs.
    The memo's key is the marshalled JSON value, which tells ``true`` and
    ``1.0`` from ``1`` (a tuple of the runs would not, and would let a bad run
    through once a good one equal to it was seen).
    """
    key: Any = (marshal.dumps(runs), n_cells, processes)  # any JSON value marshals
    hit = _expanded.get(key)
    if hit is not None:
        return hit
    w = _expand(runs, n_cells, processes, where)
    w.flags.writeable = False
    _expanded.put(key, w)
    return w


def _expand(runs: Any, n_cells: int, processes: int, where: object) -> np.ndarray:
    if type(runs) is not list:
        raise corrupt(where, "'writers' must be a list of [groups, first, step, length] runs")
    parts, total = [], 0
    for r in runs:
        if type(r) is not list or len(r) != 4 or any(type(v) is not int for v in r) or r[0] < 1 or r[3] < 1:
            raise corrupt(where, f"bad writer run {r!r:.80}")
        groups, first, step, length = r
        total += groups * length
        if total > n_cells:
            break
        parts.append(np.repeat(first + step * np.arange(groups, dtype=np.int64), length))
    if total != n_cells:
        raise corrupt(where, f"writer runs cover {total} cells of a grid of {n_cells}")
    w = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if len(w) and (int(w.min()) < 0 or int(w.max()) >= processes):
        raise corrupt(where, f"a writer run names a process outside 0..{processes - 1}")
    return w


_grid_runs: Memo[list[list[int]]] = Memo()


def grid_runs(bounds: tuple[int, ...]) -> list[list[int]]:
    """One axis's boundaries as runs ``[count, extent]`` of equal cell extents (memoised per axis)."""
    hit = _grid_runs.get(bounds)
    if hit is not None:
        return hit
    out: list[list[int]] = []
    for lo, hi in itertools.pairwise(bounds):
        size = hi - lo
        if out and out[-1][1] == size:
            out[-1][0] += 1
        else:
            out.append([1, size])
    _grid_runs.put(bounds, out)
    return out


_bounds_cache: Memo[tuple[int, ...]] = Memo()


def bounds_from_runs(runs: Any, n: int, a: int, where: object) -> tuple[int, ...]:
    """Axis `a`'s boundaries from its runs, checked to tile 0..n (``[[1, 0]]`` for an empty axis)."""
    if type(runs) is not list or not runs:
        raise corrupt(where, f"grid axis {a} must be a non-empty list of [count, extent] runs")
    key = []
    for r in runs:
        if type(r) is not list or len(r) != 2 or type(r[0]) is not int or type(r[1]) is not int or r[0] < 1 \
                or r[1] < 0 or r[0] > (1 << 40):
            raise corrupt(where, f"grid axis {a}: bad run {r!r:.80}")
        key.append((r[0], r[1]))
    k = (n, tuple(key))
    hit = _bounds_cache.get(k)
    if hit is not None:
        return hit
    total = sum(c * s for c, s in key)
    if total != n or (n > 0 and any(s == 0 for _, s in key)) or (n == 0 and key != [(1, 0)]):
        raise corrupt(where, f"grid axis {a} runs {runs!r:.80} do not tile 0..{n} (an empty axis: [[1, 0]])")
    ext = np.repeat(np.array([s for _, s in key], dtype=np.int64), [c for c, _ in key])
    b = (0, *np.cumsum(ext).tolist())
    _bounds_cache.put(k, b)
    return b
