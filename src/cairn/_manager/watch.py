"""The evaluator's side of a `CheckpointManager`: wait for new steps, read them under a lease.

An evaluator opens the trainer's directory with
``CheckpointManager(directory, read_only=True)`` (so it never cleans up the
trainer's saves in progress) and polls it. A poll is one listing of the
directory and one ``exists`` of the newest candidate's manifest, so only
committed steps are ever returned: a step folder without its manifest (an
object-store save in progress) or a hidden ``.cairn-tmp`` folder is not one.

Reading goes under a reader lease (`cairn._run.leases`) that the trainer's
retention honours, so a step handed out is never deleted while it is read.
With several processes, the primary polls and every process gets its answer
(`_agree.Decisions`); each process holds its own lease, and a step is read
only if every process got its lease.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from collections.abc import Callable, Iterator
from typing import Any

from .._dist.agree import Decisions
from .._errors import CheckpointNotFoundError
from .._run.leases import DEFAULT_TTL_S, Lease, take
from .._run.steps import newest_committed
from .._storage import Storage

log = logging.getLogger("cairn")

#: Seconds between two polls of the directory by default: gentle on object stores.
DEFAULT_POLL_S = 5.0


def _check(poll_s: float, timeout: float | None, where: str) -> None:
    if not 0 < poll_s <= 300:
        raise ValueError(f"{where}: poll_s must be in (0, 300] seconds, got {poll_s}")
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"{where}: timeout must be >= 0 seconds or None, got {timeout}")


class StepWatch:
    """`CheckpointManager`'s methods for evaluators (a mixin: the manager provides the attributes)."""

    directory: str
    _storage: Storage
    _decisions: Decisions
    _primary: bool
    _check_open: Callable[[], None]
    restore: Callable[..., Any]
    latest_step: Callable[[], int | None]
    path: Callable[[int], str]
    _folder: Callable[[int], str]
    _names: Any

    def wait_for_step(self, after: int | None = None, timeout: float | None = None, *,
                      poll_s: float = DEFAULT_POLL_S) -> int | None:
        """Wait for a committed step newer than `after` (any step, if None); return the newest one.

        Polls every `poll_s` seconds (one listing and usually one ``exists``
        per poll) and returns None once `timeout` seconds pass without one
        (``timeout=None`` waits forever; ``0`` looks once). The step is not
        leased: to read it safely, use `new_steps` or `reading`.

        Example:

            step = mgr.wait_for_step(after=last_seen, timeout=3600)
            if step is None:
                print("no new checkpoint for an hour")
        """
        self._check_open()
        _check(poll_s, timeout, self.directory)
        after = None if after is None else operator.index(after)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            found, expired = None, False
            if self._primary or self._decisions.alone:
                found = newest_committed(self._storage, after, self._names, orbax=True)
                expired = deadline is not None and time.monotonic() >= deadline
            # The primary decides when to give up too, so every process stops at the same poll.
            found, expired = self._decisions.shared("wait-for-step", [found, expired])
            if found is not None:
                return int(found)
            if expired:
                return None
            if self._primary or self._decisions.alone:
                left = poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic()))
                time.sleep(left)

    def new_steps(self, after: int | None = None, timeout: float | None = None, *,
                  poll_s: float = DEFAULT_POLL_S, lease: bool = True,
                  lease_ttl_s: float = DEFAULT_TTL_S) -> Iterator[int]:
        """Iterate over new committed steps, each under a reader lease while the loop body runs.

        Each iteration waits (as `wait_for_step`) for the newest committed
        step newer than the last one yielded (or than `after`); steps saved
        in between are skipped, so a slow evaluator always gets the latest.
        The iterator ends once `timeout` seconds pass without a new step.

        With `lease` (the default), the step is leased before it is yielded
        and the lease is held, renewed every ``lease_ttl_s / 3`` seconds,
        until the loop asks for the next step or stops (``break`` releases it
        as the iterator is dropped): the trainer's retention does not delete
        it meanwhile. A step deleted before its lease took is skipped.

        Example:

            evaluator = cairn.CheckpointManager("/ckpt/run1", read_only=True)
            for step in evaluator.new_steps(timeout=3600):
                state = evaluator.restore(step, target=abstract_state)
                log_eval(step, evaluate(state))
                if step >= final_step:
                    break
        """
        self._check_open()
        _check(poll_s, timeout, self.directory)
        return self._iterate(after, timeout, poll_s, lease, lease_ttl_s)

    def _iterate(self, after: int | None, timeout: float | None, poll_s: float, lease: bool,
                 ttl_s: float) -> Iterator[int]:
        last = after
        refused: int | None = None
        while True:
            step = self.wait_for_step(last, timeout, poll_s=poll_s)
            if step is None:
                return
            if not lease:
                last = step
                yield step
                continue
            held = self._lease(step, ttl_s)
            if held is None:
                # Retention deleted it (a newer step exists then); poll again, at once the first time.
                if refused == step:
                    time.sleep(poll_s)
                refused = step
                continue
            try:
                last = step
                yield step
            finally:
                self._release(held)

    @contextlib.contextmanager
    def reading(self, step: int | None = None, target: Any = None, *, partial: bool = False,
                lease_ttl_s: float = DEFAULT_TTL_S) -> Iterator[Any]:
        """Lease `step` (default: the newest committed), restore it, and hold the lease for the block.

        `target` and `partial` are those of `restore`. The trainer's
        retention does not delete the step until the block exits.

        Raises `CheckpointNotFoundError` if there is no such committed step,
        or retention deleted it before the lease took.

        Example:

            with evaluator.reading(step, target={"params": abstract_params}) as state:
                metrics = evaluate(state["params"])
        """
        self._check_open()
        held: Lease | None = None
        s = 0
        for _ in range(3):  # the newest step is never deleted; a retry finds the one after it
            newest = self.latest_step() if step is None else operator.index(step)
            if newest is None:
                raise CheckpointNotFoundError(f"{self.directory} holds no committed checkpoint")
            s = newest
            held = self._lease(s, lease_ttl_s)
            if held is not None or step is not None:
                break
        if held is None:
            raise CheckpointNotFoundError(
                f"{self.path(s)}: step {s} is not committed, or retention deleted it before it could be leased"
            )
        try:
            yield self.restore(s, target, partial=partial)
        finally:
            self._release(held)

    def _lease(self, step: int, ttl_s: float) -> Lease | None:
        """This process's lease on `step` if every process got one; else None (and nothing held)."""
        mine = take(self._storage, step, self.directory, ttl_s, folder=self._folder(step))
        outcomes = self._decisions.gather(f"lease-{step}", mine is not None)
        if all(outcomes.values()):
            return mine
        if mine is not None:
            mine.release()
        return None

    def _release(self, held: Lease) -> None:
        if held.lost:
            log.warning("cairn: the lease on step %d of %s was not renewed within %.0f s; retention may have "
                        "deleted the step while it was read", held.step, self.directory, held.ttl_s)
        held.release()
