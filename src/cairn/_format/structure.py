"""Pure: the tree structure of an index (docs/FORMAT.md §7), checked before anything is built from it."""

from __future__ import annotations

from typing import Any

from .._errors import corrupt


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
                stack.append(pair[1])
        elif "list" in n or "tuple" in n:
            kids = n.get("list", n.get("tuple"))
            if not isinstance(kids, list):
                raise corrupt(where, "malformed sequence node in tree structure")
            stack.extend(kids)
        elif "namedtuple" in n or "node" in n:
            names = n.get("fields", n.get("keys"))
            kids = n.get("children")
            if not isinstance(names, list) or not isinstance(kids, list) or len(names) != len(kids):
                raise corrupt(where, "malformed node in tree structure")
            stack.extend(kids)
        elif "per_process" in n:  # one child per saving process (docs/FORMAT.md §7.1)
            kids = n["per_process"]
            if not isinstance(kids, list) or not kids:
                raise corrupt(where, "malformed per-process node in tree structure")
            stack.extend(kids)
        else:
            raise corrupt(where, "unknown node in tree structure")
    if len(seen) != n_leaves:
        raise corrupt(where, f"tree structure names {len(seen)} of {n_leaves} leaves")
