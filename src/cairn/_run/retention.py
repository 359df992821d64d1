"""Retention policies: which committed checkpoints of a manager's directory to keep.

A policy sees every committed checkpoint as a `CheckpointInfo` (its step,
the metrics saved with it, its commit time) and returns the steps to
preserve. `retained` adds the one rule no policy can switch off: the newest
committed step survives. Pure: no storage, no JAX, no clock (time-based
policies measure against the checkpoints' own commit times).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class CheckpointInfo:
    """What a retention policy sees of one committed checkpoint.

    `created_unix` is its commit time in seconds since the Unix epoch (the
    manifest's ``created_unix``, taken by the process that committed it); 0
    when unknown.
    """

    step: int
    metrics: Mapping[str, float | None] = field(default_factory=lambda: MappingProxyType({}))
    created_unix: float = 0.0


class RetentionPolicy:
    """Decides which committed checkpoints to preserve.

    Subclass it and implement `keep`, which receives every committed
    checkpoint (oldest first) and returns the steps to preserve. Policies
    combine with ``|`` (a checkpoint survives if any policy keeps it) and
    ``&`` (only if every policy keeps it). The manager always keeps the
    newest committed checkpoint as well, so the policies can never delete the
    only (or the latest) good checkpoint.

    Example:

        policy = cairn.KeepLatest(3) | cairn.KeepEvery(1000) | cairn.KeepIf(lambda c: c.step < 10)
        mgr = cairn.CheckpointManager("/ckpt", retention=policy)
        # the 3 newest, plus one per 6 hours but none older than 30 days:
        cairn.KeepLatest(3) | (cairn.KeepOnePer(hours=6) & cairn.KeepNewerThan(days=30))
    """

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        raise NotImplementedError

    def __or__(self, other: RetentionPolicy) -> RetentionPolicy:
        return KeepAny(self, other)

    def __and__(self, other: RetentionPolicy) -> RetentionPolicy:
        return KeepAll(self, other)


class KeepLatest(RetentionPolicy):
    """Keep the `n` newest checkpoints.

    Example:

        cairn.CheckpointManager("/ckpt", retention=cairn.KeepLatest(3))   # same as max_to_keep=3
    """

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"KeepLatest needs n >= 1, got {n}")
        self.n = n

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return set(sorted(c.step for c in checkpoints)[-self.n :])

    def __repr__(self) -> str:
        return f"KeepLatest({self.n})"


class KeepEvery(RetentionPolicy):
    """Keep every checkpoint whose step is a multiple of `n` (a permanent trail).

    Example:

        cairn.KeepEvery(1000)   # keeps steps 0, 1000, 2000, ...
    """

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"KeepEvery needs n >= 1, got {n}")
        self.n = n

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in checkpoints if c.step % self.n == 0}

    def __repr__(self) -> str:
        return f"KeepEvery({self.n})"


def _duration(policy: str, days: float, hours: float, minutes: float, seconds: float) -> float:
    total = ((float(days) * 24 + float(hours)) * 60 + float(minutes)) * 60 + float(seconds)
    if not (math.isfinite(total) and total > 0):
        raise ValueError(f"{policy} needs a positive, finite duration (days, hours, minutes, seconds), got {total} s")
    return total


def _show_duration(seconds: float) -> str:
    for unit, size in (("days", 86400.0), ("hours", 3600.0), ("minutes", 60.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{unit}={int(seconds / size)}"
    return f"seconds={seconds:g}"


class KeepOnePer(RetentionPolicy):
    """Keep one checkpoint per window of time: the first committed in each window.

    The duration is the sum of `days`, `hours`, `minutes` and `seconds`.
    Windows are fixed to the Unix epoch, not to the run: window ``k`` is
    ``[k * period, (k + 1) * period)`` in seconds since 1970-01-01 00:00 UTC
    (so with ``hours=6`` they start at 00:00, 06:00, 12:00 and 18:00 UTC).
    For each window holding any checkpoint, the one with the earliest commit
    time (`CheckpointInfo.created_unix`; ties: the lower step) is kept.
    Checkpoints whose commit time is unknown (0) are not kept by this policy.

    Because the windows never move and the checkpoint kept in a window is its
    first, adding or deleting other checkpoints never changes the choice: like
    `KeepEvery`, it leaves a permanent trail (unless combined with ``&``).

    Example:

        cairn.KeepLatest(3) | cairn.KeepOnePer(hours=6)   # plus the first of each 6 hours, forever
    """

    def __init__(self, *, days: float = 0, hours: float = 0, minutes: float = 0, seconds: float = 0):
        self.period_s = _duration("KeepOnePer", days, hours, minutes, seconds)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        first: dict[int, tuple[float, int]] = {}
        for c in checkpoints:
            t = c.created_unix
            if not (math.isfinite(t) and t > 0):
                continue
            window = math.floor(t / self.period_s)
            if window not in first or (t, c.step) < first[window]:
                first[window] = (t, c.step)
        return {step for _, step in first.values()}

    def __repr__(self) -> str:
        return f"KeepOnePer({_show_duration(self.period_s)})"


class KeepNewerThan(RetentionPolicy):
    """Keep every checkpoint committed within a duration of the newest one.

    The duration is the sum of `days`, `hours`, `minutes` and `seconds`. A
    checkpoint's age is the newest checkpoint's commit time minus its own
    (`CheckpointInfo.created_unix`), not the wall clock: retention runs right
    after a commit, so the two agree while a run saves, and the policy stays
    a pure function of the manifests. Checkpoints at most the duration old
    are kept, and so are those whose commit time is unknown (0): nothing is
    deleted for an age that cannot be told.

    Alone it keeps everything recent. To delete checkpoints older than the
    duration whatever other policies say, intersect with ``&``.

    Example:

        (cairn.KeepLatest(5) | cairn.KeepOnePer(days=1)) & cairn.KeepNewerThan(days=14)
    """

    def __init__(self, *, days: float = 0, hours: float = 0, minutes: float = 0, seconds: float = 0):
        self.max_age_s = _duration("KeepNewerThan", days, hours, minutes, seconds)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        known = [c.created_unix for c in checkpoints if math.isfinite(c.created_unix) and c.created_unix > 0]
        if not known:
            return {c.step for c in checkpoints}
        newest = max(known)
        return {c.step for c in checkpoints
                if not (math.isfinite(c.created_unix) and c.created_unix > 0)
                or newest - c.created_unix <= self.max_age_s}

    def __repr__(self) -> str:
        return f"KeepNewerThan({_show_duration(self.max_age_s)})"


class KeepBest(RetentionPolicy):
    """Keep the `n` checkpoints with the best value of `metric`.

    `mode` is ``"min"`` (lower is better) or ``"max"``. Checkpoints saved
    without the metric, or with a non-finite value, are never among the best.
    Ties go to the newer step. The metrics live in each checkpoint's manifest,
    so the choice stays right across restarts.

    Example:

        cairn.KeepBest(2, "eval_loss")               # the two lowest eval losses
        cairn.KeepBest(1, "accuracy", mode="max")
    """

    def __init__(self, n: int, metric: str, mode: str = "min"):
        if n < 1:
            raise ValueError(f"KeepBest needs n >= 1, got {n}")
        if mode not in ("min", "max"):
            raise ValueError(f"KeepBest mode must be 'min' or 'max', got {mode!r}")
        self.n, self.metric, self.mode = n, metric, mode

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        sign = 1.0 if self.mode == "min" else -1.0
        scored = []
        for c in checkpoints:
            v = c.metrics.get(self.metric)
            if v is not None and math.isfinite(v):
                scored.append((sign * v, -c.step))
        scored.sort()
        return {-neg_step for _, neg_step in scored[: self.n]}

    def __repr__(self) -> str:
        return f"KeepBest({self.n}, {self.metric!r}, mode={self.mode!r})"


class KeepIf(RetentionPolicy):
    """Keep every checkpoint for which `predicate(info)` is true.

    Example:

        cairn.KeepIf(lambda c: c.metrics.get("milestone") == 1.0)
    """

    def __init__(self, predicate: Callable[[CheckpointInfo], bool]):
        self.predicate = predicate

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in checkpoints if self.predicate(c)}

    def __repr__(self) -> str:
        return f"KeepIf({self.predicate!r})"


class KeepAny(RetentionPolicy):
    """Keep what any of `policies` keeps (what ``a | b`` builds).

    Example:

        cairn.KeepAny(cairn.KeepLatest(2), cairn.KeepBest(1, "loss"))
    """

    def __init__(self, *policies: RetentionPolicy):
        self.policies = policies

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= set(p.keep(checkpoints))
        return out

    def __repr__(self) -> str:
        return "(" + " | ".join(map(repr, self.policies)) + ")"


class KeepAll(RetentionPolicy):
    """Keep only what every one of `policies` keeps (what ``a & b`` builds).

    Evaluated on the checkpoints present at each pass (after each commit),
    like every policy.

    Example:

        cairn.KeepEvery(1000) & cairn.KeepNewerThan(days=7)   # multiples of 1000 from the last week
    """

    def __init__(self, *policies: RetentionPolicy):
        if not policies:
            raise ValueError("KeepAll needs at least one policy")
        self.policies = policies

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        out = set(self.policies[0].keep(checkpoints))
        for p in self.policies[1:]:
            out &= set(p.keep(checkpoints))
        return out

    def __repr__(self) -> str:
        return "(" + " & ".join(map(repr, self.policies)) + ")"


def retained(policy: RetentionPolicy | None, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
    """The steps that survive: what `policy` keeps, plus the newest; all of them without a policy."""
    steps = {c.step for c in checkpoints}
    if policy is None or not steps:
        return steps
    return (set(policy.keep(checkpoints)) & steps) | {max(steps)}


def policy_from(
    max_to_keep: int | None, keep_every: int | None, keep_best: int | None, best_metric: str | None,
    best_mode: str, retention: RetentionPolicy | Iterable[RetentionPolicy] | None,
) -> RetentionPolicy | None:
    """The one policy `CheckpointManager`'s retention arguments describe, or None to keep every step."""
    parts: list[RetentionPolicy] = []
    if max_to_keep is not None:
        parts.append(KeepLatest(max_to_keep))
    if keep_every is not None:
        parts.append(KeepEvery(keep_every))
    if keep_best is not None:
        if best_metric is None:
            raise ValueError("keep_best needs best_metric (the name of the metric to rank by)")
        parts.append(KeepBest(keep_best, best_metric, best_mode))
    elif best_metric is not None:
        raise ValueError("best_metric is set but keep_best is not; pass keep_best=N")
    if isinstance(retention, RetentionPolicy):
        parts.append(retention)
    elif retention is not None:
        for p in retention:
            if not isinstance(p, RetentionPolicy):
                raise TypeError(f"retention entries must be RetentionPolicy objects, got {type(p).__name__}")
            parts.append(p)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else KeepAny(*parts)
