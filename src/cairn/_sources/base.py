"""What every reader of another format shares: the source description, rename, the tree.

A reader of a foreign checkpoint (`_hf`, `_dcp`, `_orbax`) describes it in
cairn's own terms, so that `_load` can run its usual matching, planning,
reading and assembly on it:

- its key paths, in order, without reading any data (`Format.paths`);
- for the leaves a load needs, `fmt.ArrayLeaf` (a grid of C-order chunks at
  file offsets, checksums absent) or `fmt.ValueLeaf` (`Format.leaves`);
- a reader for its bytes (`Format.reader`): cairn's `ChunkReader` where the
  bytes are plain runs in files, something else where they are not (Orbax's
  compressed zarr chunks go through tensorstore).

`open_format` turns that into a `FormatSource`, the `Source` (`_load/source.py`)
the engine reads: the manifest and indexes `_load` would have read, with the user's `rename` applied and the leaves the target
does not ask for left unresolved (a partial load of one tensor reads only
that tensor's metadata and bytes). Foreign data carries no checksums, so
loads of it are not verified.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .._errors import CheckpointError
from .._format import manifest as fmt
from .._format.values import value_kind
from .._load.reader import ChunkReader, LoadStats, read_box, slab_boxes
from .._load.source import checkpointables
from .._storage.location import Location
from .._tree.pytree import child_path, children, escape_key, map_with_path, unescape_key

FORMATS = ("cairn", "orbax", "dcp", "safetensors")

Rename = Callable[[str], "str | None"] | Sequence[tuple[str, "str | None"]]


@dataclass(frozen=True)
class FlatLocation(Location):
    """A location whose keys skip empty parts: foreign files sit at the top of their folder
    (``dir/file``, no checkpointable folder), or are the path itself (one safetensors file)."""

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.name, *parts) if p)


# ---------------------------------------------------------------------- rename


def regex_predicate(patterns: str | Sequence[str], error: str) -> Callable[[str], bool]:
    """A regex, or several, as a predicate on a '/'-joined key path (searched anywhere).

    Anything but strings is a `TypeError` of `error` followed by what was given.
    """
    listed = [patterns] if isinstance(patterns, str) else list(patterns)
    if not all(isinstance(x, str) for x in listed):
        raise TypeError(f"{error}, got {patterns!r}")
    rxs = [re.compile(x) for x in listed]
    return lambda path: any(rx.search(path) for rx in rxs)


def compile_drop(drop: str | Sequence[str] | None) -> Callable[[str], bool] | None:
    """`drop` (a regex, or several) as a predicate on the '/'-joined key path (searched anywhere)."""
    if drop is None:
        return None
    return regex_predicate(drop, "drop must be a regex or a sequence of regexes")


def compile_rename(rename: Rename | None) -> Callable[[str], str | None] | None:
    """`rename` as a function of the '/'-joined key path (None drops the leaf).

    A sequence of ``(pattern, replacement)`` pairs applies each ``re.sub`` in
    order; a pair whose replacement is None drops every key its pattern
    matches (searched anywhere in the path).
    """
    if rename is None or callable(rename):
        return rename
    pairs = []
    for pair in rename:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
                and (pair[1] is None or isinstance(pair[1], str))):
            raise TypeError(f"rename pairs must be (regex, replacement or None), got {pair!r}")
        pairs.append((re.compile(pair[0]), pair[1]))
    return RenameRules(pairs)


class RenameRules:
    """Compiled ``(regex, replacement)`` rename pairs, remembering which matched any key path:
    a rule that matched nothing is a typo the exports refuse and loads warn of (`unmatched`)."""

    def __init__(self, pairs: list[tuple[re.Pattern[str], str | None]]):
        self.pairs = pairs
        self.hit = [False] * len(pairs)

    def __call__(self, path: str) -> str | None:
        for k, (rx, rep) in enumerate(self.pairs):
            if rep is None:
                if rx.search(path):
                    self.hit[k] = True
                    return None
            else:
                path, n = rx.subn(rep, path)
                if n:
                    self.hit[k] = True
        return path

    def unmatched(self) -> list[str]:
        """The rules (as ``(pattern, replacement)`` reprs) that matched no key path so far."""
        return [repr((rx.pattern, rep)) for (rx, rep), hit in zip(self.pairs, self.hit) if not hit]


def unmatched_rules(fn: Any) -> list[str]:
    """The rules of a compiled `rename` that matched nothing ([] for a function: it cannot tell)."""
    return fn.unmatched() if isinstance(fn, RenameRules) else []


def split_name(name: str, sep: str = ".") -> str:
    """A flat name (``model.layers.0.weight``) as a key path (``model/layers/0/weight``)."""
    return "/".join(escape_key(c) for c in name.split(sep))


def join_name(path: str, sep: str = ".") -> str:
    """A key path back as a flat name: the inverse of `split_name`."""
    return sep.join(unescape_key(c) for c in path.split("/")) if path else ""


# ---------------------------------------------------------------------- the tree


def structure_of(paths: Sequence[str], kinds: dict[str, str] | None = None,
                 empty: dict[str, str] | None = None) -> Any:
    """The structure JSON of leaves at `paths` (leaf i at paths[i]): nested containers.

    `kinds` may say which containers are lists or tuples (by the container's
    path); all others are dicts, keyed by the components. `empty` holds empty
    containers (path -> "dict" | "list" | "tuple") that have no leaf.
    """
    kinds = kinds or {}
    root: dict[str, Any] = {}

    def node_at(parts: list[str], where: str) -> dict[str, Any]:
        node = root
        for part in parts:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise CheckpointError(f"{where}: key path {'/'.join(parts)!r} is both a leaf and a container")
            node = child
        return node

    items: list[tuple[str, dict[str, Any]]] = [(p, {"leaf": i}) for i, p in enumerate(paths)]
    items += [(p, {k: []}) for p, k in (empty or {}).items()]
    for path, leaf in items:
        parts = path.split("/") if path else []
        if not parts:
            if len(items) != 1:
                raise CheckpointError("a leaf at the root must be the only one")
            return leaf
        parent = node_at(parts[:-1], path)
        if parts[-1] in parent:
            raise CheckpointError(f"two leaves map to the key path {path!r}")
        parent[parts[-1]] = ("leaf", leaf)

    def build(node: Any, path: str) -> Any:
        if isinstance(node, tuple):
            return node[1]
        kind = kinds.get(path, "dict")
        keys = list(node)
        if kind in ("list", "tuple") and sorted(keys, key=_int_or_inf) == [str(i) for i in range(len(keys))]:
            return {kind: [build(node[str(i)], _join(path, str(i))) for i in range(len(keys))]}
        return {"dict": [[unescape_key(k), build(v, _join(path, k))] for k, v in node.items()]}

    return build(root, "")


def _int_or_inf(s: str) -> float:
    return int(s) if s.isdigit() else float("inf")


def _join(a: str, b: str) -> str:
    return f"{a}/{b}" if a else b


def _renamed(fn: Callable[[str], str | None], head: str, path: str, where: str) -> str | None:
    """`fn` of a leaf's full key path (its checkpointable first, as `cairn inspect` shows it)."""
    full = _join(head, path) if head else path
    q = fn(full)
    if q is None:
        return None
    if not isinstance(q, str):
        raise TypeError(f"rename must return a str or None, got {q!r} for {full!r}")
    if not head:
        return q
    if q != head and not q.startswith(head + "/"):
        raise CheckpointError(f"{where}: rename maps {full!r} to {q!r}, out of its checkpointable "
                              f"{unescape_key(head)!r}; rename keeps leaves in their checkpointable")
    return q[len(head) + 1 :]


def target_paths(target: Any) -> set[str]:
    """The key paths of a load target's leaves (as `_load` will match them)."""
    from .._load.engine import is_target_leaf

    out: set[str] = set()
    map_with_path(lambda p, _x: out.add(p), target, is_leaf=is_target_leaf)
    return out


def target_hollows(target: Any) -> set[str]:
    """The key paths of a load target's empty containers (optax's ``EmptyState()``, ``{}``, ``()``)."""
    from .._load.engine import is_target_leaf
    from .._tree.pytree import flatten

    out: set[str] = set()

    def walk(node: Any, path: str) -> None:
        if "leaf" in node or "per_process" in node:
            return
        pairs = children(node)
        if not pairs:
            out.add(path)
        for k, v in pairs:
            walk(v, child_path(path, k))

    try:
        structure, _ = flatten(target, is_leaf=is_target_leaf)
    except ValueError:
        return out  # `_load` reports what is wrong with the target
    walk(structure, "")
    return out


def placeholder(path: str) -> fmt.ArrayLeaf:
    """A leaf the load does not ask for: listed (for `partial` and its errors), never read."""
    return fmt.ArrayLeaf(path, np.dtype(np.uint8), (0,), ((0, 0),), ((0, 0),))


def one_chunk(path: str, dtype: np.dtype, shape: tuple[int, ...], file: int, offset: int,
              kind: str = "array") -> fmt.ArrayLeaf:
    """A tensor stored as one C-order run of bytes at `offset` of file number `file`."""
    return fmt.ArrayLeaf(path, np.dtype(dtype), tuple(shape), tuple((0, int(n)) for n in shape),
                         ((file, offset),), kind=kind)


def expand_value(path: str, x: Any, out: dict[str, fmt.Leaf], kinds: dict[str, str],
                 empty: dict[str, str]) -> None:
    """A plain Python value (JSON-like data) as leaves of the tree under `path`.

    Raises TypeError for anything but dicts with str/int keys, lists, tuples and
    the scalars and strings cairn stores inline.
    """
    if isinstance(x, dict):
        if not x:
            empty[path] = "dict"
        for k, v in x.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"dict key {k!r} at {path!r}")
            expand_value(_join(path, escape_key(str(k))), v, out, kinds, empty)
        return
    if isinstance(x, (list, tuple)):
        kind = "list" if isinstance(x, list) else "tuple"
        kinds[path] = kind
        if not x:
            empty[path] = kind
        for i, v in enumerate(x):
            expand_value(_join(path, str(i)), v, out, kinds, empty)
        return
    vkind = value_kind(x)
    if vkind is None:
        raise TypeError(f"a {type(x).__name__} at {path!r}")
    out[path] = fmt.ValueLeaf(path, vkind, x)


# ---------------------------------------------------------------------- formats and sources


class Format:
    """One opened foreign checkpoint, as a reader module describes it (see the module docstring)."""

    name = ""
    #: Whether its chunks carry checksums that a load verifies (only cairn's own).
    verified = False
    #: Files the chunks of `leaves` point into (FileInfo sizes: the bytes they must hold).
    files: tuple[fmt.FileInfo, ...] = ()

    def __init__(self, loc: Location):
        self.loc = loc  # where files are found: loc.key(file name)

    #: Whether `leaves` must find where every chunk's bytes start (False: for describing only).
    locate = True

    def item_files(self, item: str) -> tuple[fmt.FileInfo, ...]:
        return self.files

    def items(self) -> dict[str, list[str]]:
        """Checkpointable name -> its key paths in order ({"": [...]} for a plain tree)."""
        raise NotImplementedError

    @property
    def root(self) -> bool:
        return list(self.items()) == [""]

    def leaves(self, item: str, paths: list[str]) -> dict[str, fmt.Leaf]:
        """The leaves at `paths` of `item`, with their source paths."""
        raise NotImplementedError

    def structure(self, item: str) -> Any:
        """The source's own tree structure for its leaves in `items` order, if it records one."""
        return None

    def kinds(self, item: str) -> dict[str, str]:
        """Containers that are lists or tuples (path -> kind), when the source says so."""
        return {}

    def empty(self, item: str) -> dict[str, str]:
        """Empty containers of the source's tree (path -> "dict" | "list" | "tuple")."""
        return {}

    def nones(self, item: str) -> set[str]:
        """Paths of `None` values that stand for an empty node (Orbax writes optax's
        ``EmptyState()`` as None): an empty container of the target matches them."""
        return set()

    def reader(self, item: str, index: fmt.ItemIndex, verify: bool, pool: ThreadPoolExecutor,
               stats: LoadStats) -> ChunkReader:
        info = fmt.ItemInfo("", "", 0, len(index.leaves))
        return ChunkReader(self.loc, item, info, index, False, pool, stats)

    def read_box(self, reader: ChunkReader, leaf: fmt.ArrayLeaf, box: Any, pool: ThreadPoolExecutor) -> np.ndarray:
        return read_box(reader, leaf, box, pool, verify=False)

    def metadata(self) -> dict[str, Any]:
        """What the source records about itself (shown by `cairn inspect`)."""
        return {}

    def item_index(self, item: str, structure: Any, leaves: tuple[fmt.Leaf, ...]) -> fmt.ItemIndex:
        """The index `open_format` builds for `item` from its (renamed) tree and leaves."""
        return fmt.ItemIndex(structure, leaves, self.item_files(item))


@dataclass
class FormatSource:
    """A checkpoint described by a `Format` (another format's, or cairn's own under transforms) as the
    load's `Source` (`_load.source`): its manifest and every index built when opened.

    ``format.reader`` reads its bytes; a foreign format's carry no checksums, so nothing is verified.
    """

    format: Format
    loc: Location
    manifest: fmt.Manifest
    indexes: dict[str, fmt.ItemIndex] = field(default_factory=dict)
    verify: bool = False
    # Full key paths (checkpointable first) that `rename` moved, (from, to), or `drop` (or a None
    # rename) removed, (from, None); and the target's leaves filled from itself (`_transforms`).
    moved: list[tuple[str, str | None]] = field(default_factory=list)
    filled: list[str] = field(default_factory=list)
    added: set[str] = field(default_factory=set)  # checkpointables made of filled leaves only
    unmatched: list[str] = field(default_factory=list)  # rename rules that matched no key path

    @property
    def format_name(self) -> str:
        return self.format.name

    def indexes_of(self, names: Sequence[str], pool: ThreadPoolExecutor | None) -> list[fmt.ItemIndex]:
        return [self.indexes[name] for name in names]

    def reader(self, name: str, index: fmt.ItemIndex, verify: bool, pool: ThreadPoolExecutor,
               stats: LoadStats) -> ChunkReader:
        if name in self.added:  # nothing to read
            return ChunkReader(self.loc, name, self.manifest.items[name], index, False, pool, stats)
        return self.format.reader(name, index, verify and self.verify, pool, stats)

    def slabs(self, reader: ChunkReader, leaf: fmt.ArrayLeaf, max_bytes: int,
              pool: ThreadPoolExecutor) -> Iterator[np.ndarray]:
        """An array's values in C-order slabs of at most `max_bytes` (for conversion)."""
        for box in slab_boxes(leaf.shape, leaf.dtype.itemsize, max_bytes):
            yield self.format.read_box(reader, leaf, box, pool)


def open_format(f: Format, target: Any, rename: Rename | None, where: str,
                drop: str | Sequence[str] | None = None) -> FormatSource:
    """Describe `f` for a load of `target` (None: everything), without the leaves `drop` matches
    and with `rename` applied (both to the source's full key paths)."""
    fn = compile_rename(rename)
    dropped = compile_drop(drop)
    moved: list[tuple[str, str | None]] = []
    items = f.items()
    root = list(items) == [""]
    asked = dict(checkpointables(where, items, root, target))
    infos: dict[str, fmt.ItemInfo] = {}
    indexes: dict[str, fmt.ItemIndex] = {}
    for name, paths in items.items():
        skip = name not in asked  # described (its key paths listed), nothing resolved
        item_target = asked.get(name)
        renamed: list[tuple[str, str]] = []  # (source path, path in the user's tree)
        seen: dict[str, str] = {}
        head = "" if root else escape_key(name)
        for p in paths:
            if dropped is not None and dropped(_join(head, p)):
                moved.append((_join(head, p), None))
                continue
            q = _renamed(fn, head, p, where) if fn is not None else p
            if q != p:
                moved.append((_join(head, p), None if q is None else _join(head, q)))
            if q is None:
                continue
            if q in seen:
                raise CheckpointError(f"{where}: rename maps both {seen[q]!r} and {p!r} to {q!r}")
            seen[q] = p
            renamed.append((p, q))
        hollow: dict[str, str] = {}
        if skip:
            wanted: set[str] = set()
        elif item_target is None:
            wanted = {p for p, _ in renamed}
        else:
            paths_asked = target_paths(item_target)
            nones = f.nones(name)
            if nones:  # a None where the target has an empty node is that node, not a leaf it omits
                hollows = target_hollows(item_target)
                hollow = {q: "dict" for p, q in renamed if p in nones and q not in paths_asked and q in hollows}
                renamed = [(p, q) for p, q in renamed if q not in hollow]
            wanted = {p for p, q in renamed if q in paths_asked}
        resolved = f.leaves(name, [p for p, _ in renamed if p in wanted]) if wanted else {}
        leaves = [replace(resolved[p], path=q) if p in resolved else placeholder(q) for p, q in renamed]
        structure = f.structure(name) if fn is None and dropped is None else None
        if structure is None and fn is None and dropped is None:
            structure = structure_of([q for _, q in renamed], f.kinds(name), {**f.empty(name), **hollow})
        elif structure is None:
            structure = structure_of([q for _, q in renamed], empty=hollow)
        index = f.item_index(name, structure, tuple(leaves))
        indexes[name] = index
        nbytes = sum(leaf.nbytes for leaf in leaves if isinstance(leaf, fmt.ArrayLeaf))
        infos[name] = fmt.ItemInfo("", "", nbytes, len(leaves))
    manifest = fmt.Manifest(items=infos, root=root, metadata=f.metadata())
    return FormatSource(f, f.loc, manifest, indexes, verify=f.verified, moved=moved, unmatched=unmatched_rules(fn))
