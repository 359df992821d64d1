"""How a `CheckpointManager`'s saves meet its steps: continuous checkpointing, bounded waits, counts.

- Continuous checkpointing (``continuous=True``): a step is skipped while a save is in flight, as
  the primary sees it, on every process (`Pacing.skip`).
- The default mode's back-pressure: `save` waits for room at most `max_wait_s`, then raises
  (`Pacing.wait_for_room`).
- What both did, and what the saves' blocking phases took: `ManagerStats`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._dist.agree import Decisions
from .._errors import CheckpointError
from .._save import future as _async

log = logging.getLogger("cairn")


@dataclass
class ManagerStats:
    """What a `CheckpointManager`'s saves cost the training loop, on this process (`CheckpointManager.stats`).

    - `saves`: steps whose save started; `skipped`: steps on the save schedule not saved because
      a save was still in flight (``continuous=True``), `skipped_steps` the last 100 of them.
    - `waited_s`, `longest_wait_s`: how long `save` waited for earlier saves to make room (the
      back-pressure of the default mode, bounded by `max_wait_s`), in all and at most once.
    - `blocking_s`, `longest_blocking_s`: what the saves' blocking phases took (validation and
      the snapshot), in all and at most once.
    """

    saves: int = 0
    skipped: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    waited_s: float = 0.0
    longest_wait_s: float = 0.0
    blocking_s: float = 0.0
    longest_blocking_s: float = 0.0


#: A wait of `save` for earlier saves longer than this is logged (once per manager).
WAIT_WARN_S = 1.0


class Pacing:
    """The pacing of one manager's saves (`directory` names it in messages and logs)."""

    def __init__(self, directory: str, continuous: bool, max_wait_s: float | None, decisions: Decisions,
                 primary: bool):
        if max_wait_s is not None and not (max_wait_s >= 0 and max_wait_s < float("inf")):
            raise ValueError(f"{directory}: max_wait_s must be a finite number of seconds >= 0 (or None: "
                             f"wait as long as the save in flight takes), got {max_wait_s}")
        self.directory, self.continuous, self.max_wait_s = directory, bool(continuous), max_wait_s
        self._decisions, self._primary = decisions, primary
        self.stats = ManagerStats()
        self._skipped_since = 0  # steps skipped since the last save began (the next save's SaveStats)
        self._warned_skip = self._warned_wait = False

    def skip(self, step: int, in_flight: int | None) -> bool:
        """Continuous checkpointing: whether `step` is skipped because a save is in flight (the
        primary's view, on every process: a process whose own save is finishing saves then too)."""
        mine = in_flight if self._primary or self._decisions.alone else None
        busy = self._decisions.shared(f"busy-{step}", mine)
        if busy is None:
            return False
        self.stats.skipped += 1
        self.stats.skipped_steps = [*self.stats.skipped_steps, step][-100:]
        self._skipped_since += 1
        if not self._warned_skip:
            self._warned_skip = True
            log.warning("cairn: %s: step %d not saved, the save of step %d is still in flight (continuous "
                        "checkpointing); later skips are counted in CheckpointManager.stats and the next "
                        "save's SaveStats.skipped_steps", self.directory, step, busy)
        else:
            log.debug("cairn: %s: step %d skipped, the save of step %d is in flight", self.directory, step, busy)
        return True

    def wait_for_room(self, step: int, path: str, in_flight: Callable[[], int | None]) -> None:
        """The default mode's back-pressure: wait for earlier saves to make room, at most `max_wait_s`."""
        t0 = time.perf_counter()
        room = _async.wait_for_room(self.max_wait_s)
        waited = time.perf_counter() - t0
        self.stats.waited_s += waited
        self.stats.longest_wait_s = max(self.stats.longest_wait_s, waited)
        if not room:
            raise CheckpointError(
                f"{path}: step {step} was not saved: the save of step {in_flight()} is still "
                f"in flight after max_wait_s={self.max_wait_s} s (saves are slower than the steps, or the "
                "storage is stuck); pass continuous=True to skip steps while a save is in flight, or a "
                "larger save_every or max_wait_s")
        if waited > WAIT_WARN_S and not self._warned_wait:
            self._warned_wait = True
            log.warning("cairn: %s: the save of step %d waited %.1f s for earlier saves: saves take longer than "
                        "the steps between them (continuous=True skips steps instead; see "
                        "CheckpointManager.stats)", self.directory, step, waited)

    def started(self, future: Any) -> None:
        """Count a save that `save_async` started (its `SaveFuture`): its blocking time, and the
        steps skipped since the previous one in its ``SaveStats.skipped_steps``."""
        future.stats.skipped_steps, self._skipped_since = self._skipped_since, 0
        self.stats.saves += 1
        self.stats.blocking_s += future.stats.blocking_s
        self.stats.longest_blocking_s = max(self.stats.longest_blocking_s, future.stats.blocking_s)
