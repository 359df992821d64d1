"""Pytree <-> flat ``{key path: leaf}`` with a JSON-encodable structure.

cairn walks containers itself (dict, list, tuple, namedtuple) so that it can
record exactly which container each level was, and it defers to
``jax.tree_util`` only for other registered pytree nodes (flax dataclasses,
optax states, ...). ``None`` is a leaf here, unlike in JAX, so that a ``None``
in a state round-trips.

Key paths are strings: the components joined by ``/``, where a component is a
dict key, an attribute name or a sequence index. ``%`` and ``/`` inside a key
are percent-escaped, so a key like ``"a/b"`` or ``"../x"`` is one component
and can never be read as a path. Key paths are names in JSON only; they never
become file names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# Key paths are named the way the index stores them (docs/FORMAT.md §7); re-exported for the rooms above.
from .._format.structure import Structure as Structure
from .._format.structure import child_path as child_path
from .._format.structure import children as children
from .._format.structure import escape_key as escape_key
from .._format.structure import join_path as join_path
from .._format.structure import unescape_key as unescape_key


def display_path(path: str, item: str = "") -> str:
    """A key path as shown in messages, prefixed by its checkpointable's name.

    ``<root>`` stands for the root itself.
    """
    if item:
        path = join_path(escape_key(item), path) if path else escape_key(item)
    return path if path else "<root>"


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _jax_children(node: Any) -> tuple[list[tuple[str, Any]], Any] | None:
    """One level of a registered JAX pytree node: ((key, child) pairs, treedef).

    Returns None when `node` is not a registered node (it is a leaf), or when
    JAX is not installed.
    """
    try:
        import jax
    except ImportError:
        return None
    flat, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda y: y is not node)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # type: ignore[attr-defined]
        return None  # a leaf
    out = []
    for path, child in flat:
        if len(path) != 1:  # an empty subtree collapsed away; keep the key path honest
            raise ValueError(f"unexpected pytree key path {path!r} for {type(node).__name__}")
        out.append((_jax_key_str(path[0]), child))
    return out, treedef


def _jax_key_str(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _type_name(x: Any) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None,
            item: str = "") -> tuple[Structure, list[tuple[str, Any]]]:
    """Flatten `tree` into (structure, [(key path, leaf), ...]) in tree order.

    Raises ValueError naming the key path (shown under checkpointable `item`)
    for dict keys that are neither ``str`` nor ``int`` and for two leaves
    whose key paths would coincide.
    """
    leaves: list[tuple[str, Any]] = []
    seen: set[str] = set()

    def add_leaf(path: str, x: Any) -> Structure:
        if path in seen:
            raise ValueError(f"two leaves share the key path {display_path(path, item)!r}")
        seen.add(path)
        leaves.append((path, x))
        return {"leaf": len(leaves) - 1}

    def walk(x: Any, path: str) -> Structure:
        if x is None or (is_leaf is not None and is_leaf(x)):
            return add_leaf(path, x)
        if isinstance(x, Mapping):
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise ValueError(
                        f"dict key {k!r} at {display_path(path, item)!r} has type {type(k).__name__}; "
                        "only str and int keys can be saved"
                    )
                items.append([k, walk(v, join_path(path, escape_key(str(k))))])
            return {"dict": items}
        if _is_namedtuple(x):
            fields = list(type(x)._fields)
            kids = [walk(v, join_path(path, escape_key(f))) for f, v in zip(fields, x)]
            return {"namedtuple": type(x).__name__, "fields": fields, "children": kids}
        if isinstance(x, (list, tuple)):
            kind = "list" if isinstance(x, list) else "tuple"
            return {kind: [walk(v, join_path(path, str(i))) for i, v in enumerate(x)]}
        if _is_plain_leaf(x):
            return add_leaf(path, x)
        sub = _jax_children(x)
        if sub is None:
            return add_leaf(path, x)
        pairs, _ = sub
        keys = [k for k, _ in pairs]
        kids = [walk(c, join_path(path, escape_key(k))) for k, c in pairs]
        return {"node": _type_name(x), "keys": keys, "children": kids}

    structure = walk(tree, "")
    return structure, leaves


def _is_plain_leaf(x: Any) -> bool:
    # Fast path for the common leaves, so that JAX is never consulted for them.
    import numpy as np

    if isinstance(x, (str, bytes, int, float, complex, np.ndarray, np.generic)):
        return True
    t = type(x)
    return t.__module__.startswith(("jaxlib", "jax")) and t.__name__ in ("ArrayImpl", "Array")


def unflatten(structure: Structure, leaves: Mapping[int, Any] | list[Any], skip: object = None,
              per_process: Callable[[list[Structure], Callable[[Structure], Any]], Any] | None = None) -> Any:
    """Rebuild plain containers from a structure and leaves (by leaf number).

    Leaves whose value is the `skip` sentinel are dropped from their parent (used
    for partial loads); namedtuples and registered nodes come back as dicts. A
    per-process node (`_perprocess`) is ``per_process(children, build)``, by default
    the list of every process's value.
    """

    return _Rebuild(leaves, skip, per_process)(structure)


class _Rebuild:
    """`unflatten`'s recursion, as an object rather than a closure that calls itself: such a closure is
    a reference cycle that holds the leaves, so a loaded state's arrays would outlive the caller's last
    reference until the next garbage collection (which then freed 1 GiB inside the next load, 30-170 ms
    before its first GET)."""

    def __init__(self, leaves: Mapping[int, Any] | list[Any], skip: object,
                 per_process: Callable[[list[Structure], Callable[[Structure], Any]], Any] | None) -> None:
        self.leaves, self.skip, self.per_process = leaves, skip, per_process

    def __call__(self, node: Structure) -> Any:
        if "leaf" in node:
            return self.leaves[node["leaf"]]
        if "per_process" in node:
            subs = node["per_process"]
            return self.per_process(subs, self) if self.per_process is not None else [self(c) for c in subs]
        skip = self.skip
        kept = [(k, v) for k, v in ((k, self(c)) for k, c in children(node)) if skip is None or v is not skip]
        if "list" in node:
            return [v for _, v in kept]
        return tuple(v for _, v in kept) if "tuple" in node else dict(kept)


def map_with_path(fn: Callable[[str, Any], Any], tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """Apply ``fn(path, leaf)`` to every leaf, keeping `tree`'s own container types."""

    def walk(x: Any, path: str) -> Any:
        if x is None or (is_leaf is not None and is_leaf(x)):
            return fn(path, x)
        if isinstance(x, Mapping):
            pairs = [(k, walk(v, join_path(path, escape_key(str(k))))) for k, v in x.items()]
            return _rebuild_mapping(x, pairs)
        if _is_namedtuple(x):
            return type(x)(*[walk(v, join_path(path, escape_key(f))) for f, v in zip(type(x)._fields, x)])
        if isinstance(x, (list, tuple)):
            seq = [walk(v, join_path(path, str(i))) for i, v in enumerate(x)]
            return seq if isinstance(x, list) else tuple(seq)
        if _is_plain_leaf(x):
            return fn(path, x)
        sub = _jax_children(x)
        if sub is None:
            return fn(path, x)
        pairs, treedef = sub
        return treedef.unflatten([walk(c, join_path(path, escape_key(k))) for k, c in pairs])

    return walk(tree, "")


def _rebuild_mapping(original: Mapping, pairs: list[tuple[Any, Any]]) -> Any:
    if type(original) is dict:
        return dict(pairs)
    try:
        out = type(original)(pairs)  # type: ignore[call-arg]  # OrderedDict and dict-like mappings
    except TypeError:
        try:
            import copy

            out = copy.copy(original)  # defaultdict and friends keep their factory
            out.clear()  # type: ignore[attr-defined]
            out.update(pairs)  # type: ignore[attr-defined]
        except Exception:
            out = dict(pairs)
    return out
