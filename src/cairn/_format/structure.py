"""Pure: the tree structure of an index (docs/FORMAT.md §7), checked before anything is built from it."""

from __future__ import annotations

from typing import Any

from .._errors import corrupt

Structure = Any  # a JSON-encodable description of the containers (docs/FORMAT.md §7)


def children(node: Structure) -> list[tuple[Any, Structure]]:
    """(key, child) of each child of a structure node, in order; none for a leaf or a placeholder.

    The key is as stored: a dict key (``str`` or ``int``), a sequence index, a namedtuple field or
    a registered node's key, a saving process's number under a per-process node (§7.1). Its key-path
    component is ``escape_key(str(key))``. The node must be well formed (`check_structure`).

    >>> children({"dict": [["a", {"leaf": 0}], [1, {"leaf": 1}]]})
    [('a', {'leaf': 0}), (1, {'leaf': 1})]
    """
    if "dict" in node:
        return [(k, c) for k, c in node["dict"]]
    if "list" in node or "tuple" in node:
        return list(enumerate(node.get("list", node.get("tuple"))))
    if "namedtuple" in node or "node" in node:
        return list(zip(node.get("fields", node.get("keys")), node["children"]))
    if isinstance(node.get("per_process"), list):  # (a save's placeholder ``{"per_process": j}`` has none)
        return list(enumerate(node["per_process"]))
    return []


def escape_key(key: str) -> str:
    """Escape one key-path component so that it cannot contain ``/``."""
    return key.replace("%", "%25").replace("/", "%2F")


def unescape_key(component: str) -> str:
    return component.replace("%2F", "/").replace("%25", "%")


def join_path(parent: str, component: str) -> str:
    return component if not parent else f"{parent}/{component}"


def child_path(parent: str, key: Any) -> str:
    """The key path of the child under `key` (as `children` gives it) of the node at `parent`."""
    return join_path(parent, escape_key(str(key)))


def _leaf_number(v: Any, where: str, n_leaves: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= max(n_leaves - 1, 0):
        raise corrupt(where, f"expected an integer in [0, {max(n_leaves - 1, 0)}], found {v!r}")
    return v


def check_structure(node: Any, n_leaves: int, where: str) -> None:
    seen: set[int] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, dict) or len(n) == 0:
            raise corrupt(where, "malformed tree structure")
        if "leaf" in n:
            i = n["leaf"]
            if type(i) is not int or not 0 <= i < n_leaves:  # (a bool is not an int here)
                i = _leaf_number(i, where, n_leaves)
            if i in seen or n_leaves == 0:
                raise corrupt(where, f"tree structure names leaf {i} twice or out of range")
            seen.add(i)
        elif "dict" in n:
            for pair in n["dict"] if isinstance(n["dict"], list) else [None]:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int))):
                    raise corrupt(where, "malformed dict node in tree structure")
        elif "list" in n or "tuple" in n:
            if not isinstance(n.get("list", n.get("tuple")), list):
                raise corrupt(where, "malformed sequence node in tree structure")
        elif "namedtuple" in n or "node" in n:
            names = n.get("fields", n.get("keys"))
            kids = n.get("children")
            if not isinstance(names, list) or not isinstance(kids, list) or len(names) != len(kids):
                raise corrupt(where, "malformed node in tree structure")
        elif "per_process" in n:  # one child per saving process (docs/FORMAT.md §7.1)
            if not isinstance(n["per_process"], list) or not n["per_process"]:
                raise corrupt(where, "malformed per-process node in tree structure")
        else:
            raise corrupt(where, "unknown node in tree structure")
        if "leaf" not in n:
            stack.extend(c for _, c in children(n))
    if len(seen) != n_leaves:
        raise corrupt(where, f"tree structure names {len(seen)} of {n_leaves} leaves")
