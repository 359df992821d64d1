"""Restore transforms: a checkpoint loaded into a tree that is not quite the one saved.

`rename` and `drop` act on the checkpoint's key paths (`_sources._base.open_format`
applies them while it describes the checkpoint); `fill_missing` acts on the
target's: a target leaf the checkpoint lacks keeps the target's own value, when
asked for it, instead of failing the load. Strict by default: without
`fill_missing` a missing leaf is a `MismatchError`, as it always was.

A fill is a value leaf added to the described checkpoint (its value: the target's
array), so `_load` matches, reads and assembles as for any checkpoint and returns
the target's own object there. What was renamed, dropped and filled is reported
in a `RestoreReport` and logged at INFO on the ``cairn`` logger.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .._errors import MismatchError
from .._format import manifest as fmt
from .._load import engine as _load
from .._load.source import Source
from .._tree.perprocess import PerProcess, nodes_of
from .._tree.pytree import display_path, map_with_path
from .base import Format, FormatSource, Rename, open_format, regex_predicate, structure_of

log = logging.getLogger("cairn")

Patterns = str | Sequence[str]


@dataclass
class RestoreReport:
    """What a load with `rename`, `drop` or `fill_missing` changed, filled in by `cairn.load`.

    Key paths are full ('/'-joined, the checkpointable's name first, as
    ``cairn inspect`` shows them). `renamed` pairs a checkpoint path with the
    target path it was loaded into; `dropped` lists checkpoint paths left out
    (by `drop`, or a rename to None); `filled` lists target paths that kept the
    target's own value because the checkpoint lacks them.

    Example:

        report = cairn.RestoreReport()
        params = cairn.load(path, target, rename=[(r"^params/enc/", "params/encoder/")],
                            fill_missing=True, report=report)
        assert report.filled == ["params/new_bias"]
    """

    renamed: list[tuple[str, str]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    filled: list[str] = field(default_factory=list)
    unmatched_rules: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.renamed or self.dropped or self.filled or self.unmatched_rules)

    def __str__(self) -> str:
        def few(xs: list[str]) -> str:
            return ", ".join(xs[:3]) + (f", ... ({len(xs) - 3} more)" if len(xs) > 3 else "")

        parts = []
        if self.renamed:
            parts.append(f"renamed {len(self.renamed)} ({few([f'{a} -> {b}' for a, b in self.renamed])})")
        if self.dropped:
            parts.append(f"dropped {len(self.dropped)} ({few(self.dropped)})")
        if self.filled:
            parts.append(f"filled {len(self.filled)} from the target ({few(self.filled)})")
        if self.unmatched_rules:
            parts.append(f"rename rules that matched nothing: {', '.join(self.unmatched_rules)}")
        return "; ".join(parts) or "nothing renamed, dropped or filled"


def wanted(rename: Rename | None, drop: Patterns | None, fill_missing: bool | Patterns) -> bool:
    """Whether a load asks for any transform (then a cairn checkpoint is read through its description)."""
    return rename is not None or drop is not None or fill_missing is not False


def describe(f: Format, target: Any, where: str, *, rename: Rename | None = None, drop: Patterns | None = None,
             fill_missing: bool | Patterns = False) -> FormatSource:
    """`f` described for a load of `target`: `drop` and `rename` applied, then the fills
    (`_sources.registry.open_source` calls it; `where` names the checkpoint in errors).

    A checkpointable of the target that the checkpoint lacks altogether is made of
    its filled leaves when `fill_missing` allows any of them (its other leaves are
    then missing leaves, reported as such by the load).
    """
    allowed = _fill_rule(fill_missing)
    new: dict[str, Any] = {}
    if allowed is not None and isinstance(target, Mapping) and not f.root:
        have = f.items()
        new = {k: v for k, v in target.items() if k not in have and _any_allowed(v, str(k), allowed)}
    src = open_format(f, {k: v for k, v in target.items() if k not in new} if new else target,
                      rename, where, drop)
    if allowed is None or target is None:
        return src
    for name, index in list(src.indexes.items()):
        item_target = target if src.manifest.root else target.get(name)
        if item_target is not None:
            src.indexes[name] = _fill(index, item_target, name, allowed, where, src.filled)
    for name, item_target in new.items():
        index = _fill(fmt.ItemIndex({"dict": []}, (), ()), item_target, name, allowed, where, src.filled)
        index = replace(index, structure=structure_of([leaf.path for leaf in index.leaves]))
        src.indexes[name] = index
        src.manifest.items[name] = fmt.ItemInfo("", "", 0, len(index.leaves))
        src.added.add(name)
    return src


def _any_allowed(target: Any, item: str, allowed: Any) -> bool:
    paths: list[str] = []
    map_with_path(lambda p, x: paths.append(display_path(p, item)), target, is_leaf=_load.is_target_leaf)
    return any(allowed(p) for p in paths)


def _fill_rule(fill_missing: bool | Patterns) -> Any:
    """`fill_missing` as a predicate on full target key paths (None: fill nothing)."""
    if fill_missing is True:
        return lambda path: True
    if fill_missing is False or fill_missing is None:
        return None
    return regex_predicate(fill_missing, "fill_missing must be a bool, a regex or a sequence of regexes")


def _fill(index: fmt.ItemIndex, target: Any, item: str, allowed: Any, where: str,
          filled: list[str]) -> fmt.ItemIndex:
    """`index` with a value leaf, the target's own value, for each allowed target leaf it lacks."""
    have = {leaf.path for leaf in index.leaves}
    per_process = nodes_of(index.structure) if index.structure is not None else {}
    extra: list[fmt.Leaf] = []

    def visit(path: str, t: Any) -> Any:
        if path in have or isinstance(t, PerProcess) or any(
                path == p or path.startswith(p + "/") or not p for p in per_process):
            return t  # present, or `_load`'s per-process matching decides
        shown = display_path(path, item)
        if not allowed(shown):
            return t  # `_load` raises its MismatchError for it
        if _load.is_target_leaf(t):
            raise MismatchError(
                f"{where}: leaf {shown!r} of the target is not in the checkpoint and cannot be filled: "
                f"its target is a {type(t).__name__}, which has no values; give a concrete array "
                "(jax.Array or numpy) there to keep, or leave it out of fill_missing")
        extra.append(fmt.ValueLeaf(path, "filled", t))
        filled.append(shown)
        return t

    map_with_path(visit, target, is_leaf=lambda x: _load.is_target_leaf(x) or isinstance(x, PerProcess))
    return replace(index, leaves=index.leaves + tuple(extra)) if extra else index


def report_of(src: Source) -> RestoreReport:
    """What `src`'s transforms did (an empty report without transforms)."""
    return RestoreReport([(a, b) for a, b in src.moved if b is not None], [a for a, b in src.moved if b is None],
                         list(src.filled), list(src.unmatched))


def finish(src: Source, where: str, report: RestoreReport | None) -> None:
    """After a load: fill the caller's `report` and log what changed."""
    got = report_of(src)
    if report is not None:
        report.renamed, report.dropped, report.filled = got.renamed, got.dropped, got.filled
        report.unmatched_rules = got.unmatched_rules
    for rule in got.unmatched_rules:
        log.warning("cairn: loading %s: the rename rule %s matched no key path of the checkpoint (a typo? "
                    "`cairn inspect` lists its key paths)", where, rule)
    if got:
        log.info("cairn: loading %s: %s", where, got)


def explained(src: Source, error: MismatchError) -> MismatchError:
    """`error` (a target that does not fit), naming the rename rules that matched nothing: where the
    load fails, such a rule is the likely cause (a typo, or another model's names)."""
    if not src.unmatched:
        return error
    rules = ", ".join(src.unmatched)
    return MismatchError(f"{error}; note that the rename rule{'s' if len(src.unmatched) > 1 else ''} {rules} "
                         "matched no key path of the checkpoint")


__all__ = ["Patterns", "RestoreReport", "describe", "explained", "finish", "wanted"]
