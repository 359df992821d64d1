"""`CheckpointManager.restore`: which tier and which step serve a restore, and the fallback.

The local tier serves what it can (`local_refusal` says why it cannot); the persistent tier's
steps are tried newest first where `fallback` allows, every process falling back or failing
together.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

from .._dist.coord import Coordinator
from .._errors import CheckpointNotFoundError, CorruptCheckpointError
from .._load.options import LoadOptions
from .._plan.routes import resolve_bandwidths
from .._run.steps import show_steps
from .._sources import registry as _sources
from .._tree.pytree import map_with_path

log = logging.getLogger("cairn")

#: `restore` keywords that are not `LoadOptions` (checked there): what a restore records.
_NOT_OPTIONS = ("stats", "report")


def local_refusal(target: Any, partial: bool, kw: dict[str, Any], coord: Coordinator) -> str | None:
    """Why the local tier cannot serve a restore with these keywords; None where it can.

    It serves every keyword that leaves what is restored alone: ``bandwidths``
    and ``read_once`` (they choose how a persistent checkpoint is read; the
    local tier's transfers are its own), ``verify``, ``threads`` and
    ``budget_bytes`` (its reads of the blobs take them), ``timeout`` (the
    persistent path's waits; the tier's exchanges wait as the manager's
    others do) and ``stats`` (left empty). ``mesh`` changes only arrays the
    target gives no sharding; the tier serves a target that gives each one.
    """
    if partial:
        return "partial=True (the local tier restores the whole target)"
    changed = [k for k in ("rename", "drop") if kw.get(k) is not None]
    changed += ["fill_missing"] if kw.get("fill_missing", False) is not False else []
    if changed:
        return f"{'=, '.join(changed)}= transform the saved tree, which the local tier does not"
    if kw.get("report") is not None:
        return "report= records what transforms did, which only the persistent path runs"
    if kw.get("format") not in (None, "cairn"):
        return f"format={kw['format']!r} names a persistent checkpoint's format"
    if kw.get("coordinator") not in (None, coord):
        return "coordinator= differs from the manager's own, which the local tier's exchanges use"
    if kw.get("mesh") is not None:
        if target is None:
            return "mesh= without a target (the local tier restores onto the target's shardings)"
        bare: list[str] = []

        def visit(path: str, x: Any) -> None:
            if x is None or type(x).__name__ == "ArrayMetadata" or (
                    hasattr(x, "shape") and hasattr(x, "dtype") and getattr(x, "sharding", None) is None
                    and type(x).__name__ == "ShapeDtypeStruct"):
                bare.append(path or "<root>")

        map_with_path(visit, target)
        if bare:
            return (f"mesh= places leaves the target gives no sharding ({', '.join(repr(b) for b in bare[:3])}"
                    f"{', ...' if len(bare) > 3 else ''}), which the local tier cannot")
    return None


def restore(mgr: Any, step: Any, target: Any, fallback: bool, partial: bool,
            transforms: dict[str, Any]) -> Any:
    """`mgr.restore(step, target, fallback=, partial=, **transforms)` of `CheckpointManager` `mgr` (see there)."""
    mgr._check_open()
    if step is not None and not isinstance(step, int) and not hasattr(step, "__index__") and target is None:
        step, target = None, step  # mgr.restore(abstract): a tree is never a step number
    if step is not None and not isinstance(step, int) and not hasattr(step, "__index__"):
        raise TypeError(f"{mgr.directory}: restore(step, target): the first argument is the step to restore, "
                        f"got a {type(step).__name__}; pass the tree as target= (mgr.restore(target=abstract), "
                        "or mgr.restore(step, abstract))")
    opts = LoadOptions(partial=partial).replace(**{k: v for k, v in transforms.items() if k not in _NOT_OPTIONS})
    if opts.bandwidths is not None:  # checked here too: the local tier, which prices no route, may serve
        resolve_bandwidths(opts.bandwidths, "local", "cpu")
    mgr.wait()
    steps = mgr.steps()
    if mgr.local:
        mgr.local.restored_step = None  # set again only if the local tier serves this restore
    if mgr.local and step is None:
        why = local_refusal(target, partial, transforms, mgr._coord)
        if why is None:
            reading = {k: transforms[k] for k in ("verify", "threads", "budget_bytes") if k in transforms}
            if got := mgr.local.restore(target, steps[-1] if steps else None, **reading):
                mgr.restored_step, out = got
                return out
        elif mgr._primary:
            log.info("cairn: not restoring from the local tier in %s: %s; restoring from the persistent "
                     "tier", mgr.directory, why)
    if step is not None:
        step = operator.index(step)
        if step not in steps:
            raise CheckpointNotFoundError(
                f"{mgr.directory}: step {step} has no committed checkpoint (committed steps: {show_steps(steps)})"
            )
        candidates = [step]
    elif not steps:
        raise CheckpointNotFoundError(f"{mgr.directory} holds no committed checkpoint")
    else:
        candidates = list(reversed(steps)) if fallback else [steps[-1]]
    failures: list[str] = []
    for s in candidates:
        error: BaseException | None = None
        try:
            # An Orbax step of the run is read as one whatever format was asked.
            out = _sources.load(mgr._location(s), target, opts.replace(format="orbax") if mgr._is_orbax(s)
                                else opts, report=transforms.get("report"), stats=transforms.get("stats"))
        except (CorruptCheckpointError, CheckpointNotFoundError) as e:
            error = e
        # Every process reads only its own bytes: one may find corruption the others do not.
        # All fall back together, or all fail together.
        bad = mgr._decisions.failures(f"restore-{s}", None if error is None else str(error))
        if bad and (not fallback or step is not None):
            if error is not None:
                raise error
            raise CorruptCheckpointError(
                f"{mgr.path(s)} does not verify on another process: "
                + "; ".join(f"process {p}: {e}" for p, e in bad.items())
            )
        if bad:
            why = "; ".join(f"process {p}: {e}" for p, e in bad.items())
            log.warning("cairn: step %d in %s does not verify (%s); trying an older step", s, mgr.directory, why)
            failures.append(f"step {s}: {why}")
            continue
        mgr.restored_step = s
        return out
    raise CorruptCheckpointError(
        f"{mgr.directory}: no committed checkpoint verifies; " + "; ".join(failures)
    )
