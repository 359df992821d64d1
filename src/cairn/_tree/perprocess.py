"""Per-process values: `PerProcess`, and the check that undeclared host-local values agree.

A host-local leaf (a numpy array, bytes, a Python value: anything but a
``jax.Array``) is stored once, from process 0. That is right for a config or
a step counter, and silently wrong for a data iterator's position, which each
process has its own of. So a save with several processes checks: along with
the attempt-token exchange (no extra round trip), every process sends the
primary one CRC-32C per host-local leaf, and the primary refuses the save,
naming the leaves and the processes, when they differ (nothing is written).

Values that are each process's own are declared with `PerProcess`. Every
process writes its own value's leaves (inline values in the index, arrays and
bytes in its own data files), and the index holds a tree node
``{"per_process": [node_0, ..., node_(n-1)]}``: process p's value under the key
path ``<path>/<p>`` (docs/FORMAT.md §7.1). Only the primary needs the other
processes' leaf descriptions (for the index); it learns them in the same
exchange and tells every process where its leaves go in the item's numbering.
On load, process p gets value p back. On another process count, a target's
``PerProcess`` needs ``reshard=fn``; a load without a target returns the list
of every saved value there (what ``cairn.metadata`` shows), so a look at the
checkpoint from one process never fails.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._core.buffers import as_view
from .._core.checksum import crc32c
from .._dist.coord import Coordinator, gather_json
from .._errors import (
    CheckpointError,
    CoordinationError,
    MismatchError,
    UnsupportedTypeError,
    error_from_record,
    error_record,
)
from .._format.values import decode_value, dtype_from_name, dtype_name, encode_value
from .leaves import ArraySource, ValueSource, classify
from .pytree import (
    Structure,
    child_path,
    children,
    display_path,
    escape_key,
    flatten,
    join_path,
    map_with_path,
    unflatten,
)

Reshard = Callable[[list[Any], int, int], Any]


class PerProcess:
    """A value that each process saves for itself and gets back on restore.

    `value` is any tree of host-local leaves (numpy arrays, bytes, Python values,
    registered types; not ``jax.Array``): a data iterator's state, say. Each
    process stores its own, and a load returns process p's value to process p.
    Where a load target holds a ``PerProcess``, the result holds one too (so the
    restored state saves again as declared); without a target, the plain value.

    Restoring on a different number of processes needs ``reshard``, a function
    ``reshard(saved, index, count)`` from the list of saved values (indexed by the
    process that saved them) to this process's new value; give it in the target.
    Without a target, such a load returns that list itself, the same on every
    process. A `value` in a target is a template: the loaded value takes its
    containers.

    Example:

        cairn.save(path, {"params": params, "data": cairn.PerProcess(iterator.get_state())})
        restored = cairn.load(path, {"params": abstract, "data": cairn.PerProcess()})
        iterator.set_state(restored["data"].value)
    """

    __slots__ = ("reshard", "value")

    def __init__(self, value: Any = None, reshard: Reshard | None = None):
        self.value = value
        self.reshard = reshard

    def __repr__(self) -> str:
        return f"cairn.PerProcess({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerProcess) and _equal(self.value, other.value)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the containers it wraps


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(np.all(a == b)) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else bool(a == b)
    except Exception:  # values that cannot be compared are not equal
        return False


def is_per_process(x: Any) -> bool:
    return isinstance(x, PerProcess)


# ---------------------------------------------------------------------- structure nodes


def _map(node: Structure, fn: Callable[[Structure], Structure]) -> Structure:
    """`node` with `fn` applied to each of its children (leaves and placeholders map themselves)."""
    if "dict" in node:
        return {"dict": [[k, fn(c)] for k, c in node["dict"]]}
    for kind in ("list", "tuple"):
        if kind in node:
            return {kind: [fn(c) for c in node[kind]]}
    if "children" in node:
        return {**node, "children": [fn(c) for c in node["children"]]}
    return node


def _shift(node: Structure, by: int) -> Structure:
    if "leaf" in node:
        return {"leaf": node["leaf"] + by}
    return _map(node, lambda c: _shift(c, by))


def _fill(node: Structure, subs: list[list[Structure]]) -> Structure:
    """Placeholders ``{"per_process": j}`` replaced by ``{"per_process": subs[j]}``."""
    if "leaf" in node:
        return node
    if "per_process" in node:
        return {"per_process": subs[node["per_process"]]}
    return _map(node, lambda c: _fill(c, subs))


def leaf_numbers(node: Structure) -> list[int]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if "leaf" in n:
            out.append(n["leaf"])
        else:
            stack.extend(c for _, c in children(n))
    return out


def nodes_of(structure: Structure) -> dict[str, list[Structure]]:
    """The per-process nodes of a stored structure: key path -> one child per saving process."""
    out: dict[str, list[Structure]] = {}
    stack = [(structure, "")]
    while stack:
        node, path = stack.pop()
        if "per_process" in node:
            out[path] = node["per_process"]
        elif "leaf" not in node:
            stack.extend((c, child_path(path, k)) for k, c in children(node))
    return out


# ---------------------------------------------------------------------- export

#: What exports do with per-process values: each saved process's value under ``process_<p>``, none, or an error.
EXPORT_CHOICES = ("keys", "drop", "error")


def process_key(p: int) -> str:
    """The key an export gives saved process `p`'s value (``data/process_0/...``)."""
    return f"process_{p}"


def check_export_choice(per_process: str) -> None:
    if per_process not in EXPORT_CHOICES:
        raise ValueError(f"per_process must be one of {', '.join(EXPORT_CHOICES)}, got {per_process!r}")


def export_leaf_path(nodes: dict[str, list[Structure]], path: str) -> tuple[str, str] | None:
    """For a stored leaf path under a per-process node, (the node's path, the leaf's path with the
    saving process's component written ``process_<p>``); None for any other leaf.

    Stored, process p's leaves sit at ``<node>/<p>/...`` (FORMAT.md §7.1), which a reader of an
    exported file could not tell from a list index; the export names the process.
    """
    for node in nodes:
        if node and not (path == node or path.startswith(node + "/")):
            continue
        rest = path[len(node) + 1:] if node else path
        p, _, tail = rest.partition("/")
        named = join_path(node, process_key(int(p)))
        return node, join_path(named, tail) if tail else named
    return None


def refuse_per_process(nodes: dict[str, list[Structure]], where: str, item: str, per_process: str) -> None:
    """With ``per_process="error"``, the `UnsupportedTypeError` naming the first per-process node."""
    if per_process != "error" or not nodes:
        return
    path, subs = min(nodes.items())
    raise UnsupportedTypeError(
        f"{where}: {display_path(path, item)!r} holds per-process values (cairn.PerProcess, saved by "
        f"{len(subs)} process{'es' if len(subs) != 1 else ''}), which the export has no place for; "
        "per_process='keys' (--per-process keys) writes each saved process's value under process_<p>, "
        "'drop' leaves them out")


def _at(node: Structure, path: str, fn: Callable[[Structure], Structure]) -> Structure:
    """`node` with its descendant at key path `path` replaced by ``fn(descendant)``."""
    if not path:
        return fn(node)
    head, _, rest = path.partition("/")
    kids = [escape_key(str(k)) for k, _ in children(node)]
    if head not in kids:
        raise CheckpointError(f"no {head!r} in the loaded tree's structure")  # the caller's bug
    at = kids.index(head)
    count = iter(range(len(kids)))
    return _map(node, lambda c: _at(c, rest, fn) if next(count) == at else c)


def _const(node: Structure) -> Callable[[Structure], Structure]:
    return lambda _old: node


def export_tree(tree: Any, stored: Structure, where: str, item: str, per_process: str) -> Any:
    """`tree`, loaded without a target on one process, with each per-process node of `stored` (the
    item's stored structure) as `per_process` says: ``"keys"`` a mapping ``{"process_<p>": value}``
    over every saving process (one too), ``"drop"`` None, ``"error"`` an `UnsupportedTypeError`.

    A load on one process gives the value itself where one process saved it and the list of
    every saved value where several did; an export names the processes either way, so what it
    writes does not depend on how many processes saved.
    """
    nodes = nodes_of(stored)
    if not nodes:
        return tree
    refuse_per_process(nodes, where, item, per_process)
    structure, flat = flatten(tree)
    leaves = [leaf for _, leaf in flat]
    for path, subs in nodes.items():
        if per_process == "drop":
            leaves.append(None)
            structure = _at(structure, path, _const({"leaf": len(leaves) - 1}))
            continue

        def keyed(node: Structure, saved: int = len(subs)) -> Structure:
            values = [node] if saved == 1 else node["list"]
            return {"dict": [[process_key(p), c] for p, c in enumerate(values)]}

        structure = _at(structure, path, keyed)
    return unflatten(structure, leaves)


# ---------------------------------------------------------------------- save


_ELSEWHERE = ValueSource("", "none", None)  # a slot for another process's per-process leaf (not written here)


@dataclass
class _Own:
    """This process's per-process values of one item: a structure per node (leaf numbers local to `leaves`)."""

    nodes: list[Structure] = field(default_factory=list)
    leaves: list[ArraySource | ValueSource] = field(default_factory=list)


class HostValues:
    """One save's per-process values and the check of its other host-local leaves."""

    def __init__(self, coord: Coordinator, seq: int, where: str):
        self.coord, self.where = coord, where
        self.me, self.n = coord.process_index, coord.process_count
        self.base = f"cairn/save/{seq}"
        self.own: dict[str, _Own] = {}
        self.items: list[Any] = []  # the SaveItems, in order
        self.summary: dict[str, Any] = {"items": {}, "own": {}}
        self.gathered: dict[int, Any] = {}

    def split(self, item: str, structure: Structure, flat: list[tuple[str, Any]]) -> tuple[Structure, list[tuple[str, Any]]]:
        """Take the `PerProcess` leaves out of a flattened item: placeholders in the structure,
        their values flattened and classified (this process's key paths) for `place`."""
        if not any(isinstance(x, PerProcess) for _, x in flat):
            return structure, flat
        shared: list[tuple[str, Any]] = []
        values: list[tuple[str, Any]] = []

        def walk(node: Structure) -> Structure:
            if "leaf" not in node:
                return _map(node, walk)
            path, x = flat[node["leaf"]]
            if isinstance(x, PerProcess):
                values.append((path, x.value))
                return {"per_process": len(values) - 1}
            shared.append((path, x))
            return {"leaf": len(shared) - 1}

        structure = walk(structure)
        own = self.own[item] = _Own()
        for path, value in values:
            prefix = join_path(path, str(self.me))
            try:
                sub, sub_flat = flatten(value, is_leaf=is_per_process, item=item)
            except ValueError as e:
                raise UnsupportedTypeError(f"{self.where}: in cairn.PerProcess at {display_path(path, item)!r}: {e}") from None
            own.nodes.append(_shift(sub, len(own.leaves)))
            for rel, x in sub_flat:
                full = join_path(prefix, rel) if rel else prefix
                if isinstance(x, PerProcess):
                    raise UnsupportedTypeError(f"{self.where}: cairn.PerProcess inside cairn.PerProcess at "
                                               f"{display_path(full, item)!r}; declare only the outer one")
                src = classify(full, x, self.where, item)
                if isinstance(src, ArraySource):
                    if src.is_jax:
                        raise UnsupportedTypeError(
                            f"{self.where}: leaf {display_path(full, item)!r} of a cairn.PerProcess is a jax.Array; "
                            "per-process values are host-local (np.asarray it), sharded arrays are saved as they are")
                    src.owner = self.me
                own.leaves.append(src)
        return structure, shared

    def add(self, item: Any) -> None:
        """Note a classified item: its tree and host-local hashes (and per-process leaves) for the primary."""
        self.items.append(item)
        if self.n == 1:
            return
        kinds = "".join("j" if isinstance(s, ArraySource) and s.is_jax else "h" for s in item.leaves)
        tree = crc32c(json.dumps(item.structure).encode() + kinds.encode())
        hashes = [_hash(s) for s in item.leaves if not (isinstance(s, ArraySource) and s.is_jax)]
        # The digest of the hashes lets the primary compare each process in O(1) (leaf by leaf only on a mismatch).
        digest = crc32c(json.dumps(hashes).encode())
        self.summary["items"][item.name] = [f"{tree:08x}", hashes, f"{digest:08x}"]
        own = self.own.get(item.name)
        if own is not None:
            self.summary["own"][item.name] = {"nodes": own.nodes, "leaves": [_describe(s) for s in own.leaves]}

    def publish(self) -> None:
        self.coord.publish(f"{self.base}/hosts/{self.me}", json.dumps(self.summary).encode())

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """Around this process's validation: a failure is sent to the others (`failed`) and re-raised."""
        try:
            yield
        except BaseException as e:
            self.failed(e)
            raise

    def failed(self, e: BaseException) -> None:
        """Tell the others that this process cannot save, so that none of them waits for it."""
        if self.n == 1:
            return
        record = error_record(e, self.me)
        try:
            if self.me == 0:
                msg = {"error": record, "message": f"process 0: {record['message']}"}
                self.coord.publish(f"{self.base}/token", json.dumps(msg).encode())
            else:
                self.coord.publish(f"{self.base}/hosts/{self.me}", json.dumps({"error": record}).encode())
        except CoordinationError:
            pass  # the original error is what this process raises

    def gather(self, timeout: float) -> dict[str, Any]:
        """Primary: every process's summary; raise CheckpointError unless their host-local leaves agree.
        Returns, per item with per-process values, where each process's leaves start."""
        if self.n == 1:
            return {}
        self.publish()
        got = self.gathered = gather_json(self.coord, f"{self.base}/hosts", self.n, timeout)
        failed = sorted(p for p, s in got.items() if "error" in s)
        if failed:
            raise error_from_record(got[failed[0]]["error"], "; ".join(
                f"process {p}: {got[p]['error']['message']}" for p in failed))
        self._compare(got)
        offsets = {}
        for name in self.own:
            counts = [len(got[p]["own"][name]["leaves"]) for p in range(self.n)]
            offsets[name] = [sum(counts[:p]) for p in range(self.n)]
        return {"per_process": offsets}

    def _compare(self, got: dict[int, Any]) -> None:
        problems: list[str] = []
        names = list(self.summary["items"])
        other = [p for p in range(self.n) if list(got[p]["items"]) != names]
        if other:
            problems.append(f"{_plist(other)} save{'s' if len(other) == 1 else ''} other checkpointables than "
                            f"process 0 ({names})")
        for item in self.items:
            tree = self.summary["items"][item.name][0]
            other = [p for p in range(self.n) if got[p]["items"].get(item.name, [None])[0] != tree]
            if other:
                problems.append(f"{_plist(other)} save{'s' if len(other) == 1 else ''} another tree than process 0 "
                                f"in {item.name!r} (other containers or keys, or jax.Arrays against host values)")
                continue
            digest = self.summary["items"][item.name][2]
            if all(got[p]["items"][item.name][2:] == [digest] for p in range(self.n)):
                continue  # every process has the same host-local values: O(processes), not x leaves
            paths = [s.path for s in item.leaves if not (isinstance(s, ArraySource) and s.is_jax)]
            for k, path in enumerate(paths):
                groups: dict[str, list[int]] = {}
                for p in range(self.n):
                    groups.setdefault(got[p]["items"][item.name][1][k], []).append(p)
                if len(groups) > 1:
                    first, *rest = groups.values()
                    problems.append(f"{display_path(path, item.name)!r} ({_plist(first)} "
                                    f"{'has' if len(first) == 1 else 'have'} one value, "
                                    + ", ".join(f"{_plist(g, False)} another" for g in rest) + ")")
        if problems:
            more = f", and {len(problems) - 5} more" if len(problems) > 5 else ""
            raise CheckpointError(
                f"{self.where}: host-local values differ between processes: {'; '.join(problems[:5])}{more}. "
                "A host-local leaf (numpy array, bytes, Python value) is stored once, from process 0, so it must "
                "be equal on every process; declare values that are each process's own with cairn.PerProcess, "
                "e.g. {'data': cairn.PerProcess(iterator.get_state())}, and each process gets its own back on "
                "load. Nothing was saved.")

    def place(self, msg: dict[str, Any]) -> None:
        """Give this process's per-process leaves their numbers in each item (after the shared leaves,
        process by process); on the primary, add everyone's and the final structure."""
        offsets = msg.get("per_process") or {name: [0] for name in self.own}
        for item in self.items:
            own = self.own.get(item.name)
            if own is None:
                continue
            offs, n_shared = offsets[item.name], len(item.leaves)
            if self.me != 0:
                item.leaves.extend([_ELSEWHERE] * offs[self.me])
                item.leaves.extend(own.leaves)
                continue
            subs: list[list[Structure]] = [[] for _ in own.nodes]
            for q in range(self.n):
                nodes, leaves = own.nodes, own.leaves
                if q:
                    d = self.gathered[q]["own"][item.name]
                    nodes, leaves = d["nodes"], [_undescribe(x, q, self.where) for x in d["leaves"]]
                item.leaves.extend(leaves)
                for j, node in enumerate(nodes):
                    subs[j].append(_shift(node, n_shared + offs[q]))
            item.structure = _fill(item.structure, subs)


def _plist(ps: list[int], word: bool = True) -> str:
    shown = ", ".join(map(str, ps[:8])) + (f" and {len(ps) - 8} more" if len(ps) > 8 else "")
    return (("process " if len(ps) == 1 else "processes ") if word else "") + shown


def _hash(src: ArraySource | ValueSource) -> str:
    if isinstance(src, ValueSource):
        return f"{crc32c(json.dumps([src.kind, encode_value(src.kind, src.value)]).encode()):08x}"
    head = json.dumps([src.kind, dtype_name(src.dtype), list(src.shape), src.handler]).encode()
    data = np.ascontiguousarray(src.value).reshape(-1).view(np.uint8)
    return f"{crc32c(as_view(data), crc32c(head)):08x}"


def _describe(src: ArraySource | ValueSource) -> dict[str, Any]:
    if isinstance(src, ValueSource):
        return {"path": src.path, "kind": src.kind, "value": encode_value(src.kind, src.value)}
    return {"path": src.path, "kind": src.kind, "dtype": dtype_name(src.dtype), "shape": list(src.shape),
            "handler": src.handler}


def _undescribe(d: dict[str, Any], owner: int, where: str) -> ArraySource | ValueSource:
    """Another process's per-process leaf, as the primary needs it for the index (never written here)."""
    if "dtype" not in d:
        return ValueSource(d["path"], d["kind"], decode_value(d["kind"], d["value"], where))
    shape = tuple(d["shape"])
    placeholder = np.broadcast_to(np.zeros((), dtype_from_name(d["dtype"], where)), shape)  # shape and dtype only
    return ArraySource(d["path"], d["kind"], placeholder, False, d["handler"], owner=owner)


# ---------------------------------------------------------------------- load


class LoadView:
    """The per-process nodes of one stored item, as this process loads them."""

    def __init__(self, structure: Structure, item: str, where: str, me: int, n: int):
        self.nodes = nodes_of(structure)
        self.item, self.where, self.me, self.n = item, where, me, n
        self.covered: set[int] = set()  # leaves under the nodes a target claimed (read or not)

    def _counts(self, path: str, saved: int) -> MismatchError:
        return MismatchError(
            f"{self.where}: {display_path(path, self.item)!r} holds per-process values saved by {saved} "
            f"process{'es' if saved != 1 else ''}, and {self.n} {'are' if self.n != 1 else 'is'} loading; "
            "give the target cairn.PerProcess(reshard=fn) there, where fn(saved, index, count) makes this "
            "process's value from the list of saved ones (a load without a target returns that list)")

    def all_leaves(self, n_leaves: int) -> dict[int, Any]:
        """Without a target: every leaf but other processes' per-process ones. Where the checkpoint was
        saved by another number of processes, every process's (`pick` returns them all)."""
        wanted: dict[int, Any] = dict.fromkeys(range(n_leaves))
        for subs in self.nodes.values():
            if len(subs) != self.n:
                continue
            for q, sub in enumerate(subs):
                if q != self.me:
                    for i in leaf_numbers(sub):
                        del wanted[i]
        return wanted

    def claims(self, path: str, t: Any, wanted: dict[int, Any]) -> bool:
        """Whether target leaf `t` at `path` is a per-process node's (then its leaves are in `wanted`)."""
        subs = self.nodes.get(path)
        if subs is None:
            if isinstance(t, PerProcess):
                raise MismatchError(f"{self.where}: the target holds a cairn.PerProcess at "
                                    f"{display_path(path, self.item)!r}, but the checkpoint has no per-process "
                                    "values there (it was saved without cairn.PerProcess)")
            under = next((p for p in self.nodes if path.startswith(p + "/") or not p), None)
            if under is not None:
                raise MismatchError(f"{self.where}: {display_path(under, self.item)!r} was saved per process "
                                    "(cairn.PerProcess); put cairn.PerProcess() in the target there, not its contents")
            return False
        if len(subs) == self.n:
            take = [subs[self.me]]
        elif not isinstance(t, PerProcess) or t.reshard is not None:
            take = subs  # reshard's input, or (a None target leaf, as without a target) the list of them all
        else:
            raise self._counts(path, len(subs))
        for sub in take:
            wanted.update(dict.fromkeys(leaf_numbers(sub)))
        for sub in subs:
            self.covered.update(leaf_numbers(sub))
        return True

    def pick(self, subs: list[Structure], build: Callable[[Structure], Any]) -> Any:
        """`unflatten`'s choice at a per-process node (no target): this process's value where as many
        processes saved it as load it; else the list of every saved value, by the process that saved it
        (which of them is this process's is the caller's decision, as ``reshard``'s is)."""
        return build(subs[self.me]) if len(subs) == self.n else [build(c) for c in subs]

    def value(self, path: str, t: Any, results: dict[int, Any]) -> Any:
        """The loaded value for target leaf `t` at per-process node `path`."""
        subs = self.nodes[path]
        if len(subs) == self.n:
            v = unflatten(subs[self.me], results)
            if isinstance(t, PerProcess) and t.value is not None:
                v = self._like(path, t.value, v)
        elif isinstance(t, PerProcess):
            assert t.reshard is not None  # `claims` checked
            v = t.reshard([unflatten(sub, results) for sub in subs], self.me, self.n)
        else:
            return [unflatten(sub, results) for sub in subs]
        return PerProcess(v, t.reshard) if isinstance(t, PerProcess) else v

    def _like(self, path: str, template: Any, v: Any) -> Any:
        """`v` rebuilt with the containers of `template` (a dataclass or namedtuple state, say)."""
        _, flat = flatten(v)
        by_path = dict(flat)

        def take(rel: str, _t: Any) -> Any:
            if rel not in by_path:
                raise MismatchError(f"{self.where}: the cairn.PerProcess template at {display_path(path, self.item)!r} "
                                    f"has {rel!r}, which process {self.me}'s saved value lacks")
            return by_path[rel]

        return map_with_path(take, template)
