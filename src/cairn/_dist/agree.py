"""Decisions that every process of a multi-process program must see alike.

A `CheckpointManager` lists its directory, picks the step to restore and
falls back past corrupt steps. Done separately on each process, those can
differ (a listing taken a moment apart, a corrupt chunk that only one process
reads), and then processes load different steps. Each such decision is made
once here and shared through the coordinator:

- `shared`: the primary decides (lists the directory, say) and publishes
  the answer; the others take it.
- `gather`: every process reports its own outcome (the step loaded, or the
  error it hit) and every process gets all of them, so all act on the same
  facts (fall back together). The outcomes go to the primary, which sends
  them back in one message (`failures`: only the failed ones): a process
  makes the same few requests at any process count.

Every process makes the same decisions in the same order (they are the same
program), so a per-scope counter names each decision without talking. The
same holds of a program's saves, exports, loads that move data between
processes and bandwidth measurements: `sequence(name)` numbers each kind.
"""

from __future__ import annotations

import itertools
import json
import threading
import zlib
from typing import Any

from .coord import Coordinator, agree, fetch_from

_counters: dict[str, itertools.count[int]] = {}
_lock = threading.Lock()


def sequence(name: str) -> int:
    """The number of this process's next operation of kind `name` (0, 1, 2, ...; thread-safe).

    Every process of a program runs its saves, exports, data-moving loads and
    managers in the same order, so these numbers agree without talking: they
    name the coordination keys of one operation (``cairn/save/<n>/...``). Each
    kind counts on its own, so an operation that some process skips desyncs
    only its own kind.

    Example:

        base = f"cairn/export/{sequence('export')}"
    """
    with _lock:
        counter = _counters.setdefault(name, itertools.count())
        return next(counter)

#: How long a process waits for a decision of the others (dead peers are noticed sooner).
TIMEOUT = 600.0


class Decisions:
    """The shared decisions of one `CheckpointManager` (`scope`: its directory)."""

    def __init__(self, coord: Coordinator, scope: str):
        self.coord = coord
        instance = sequence(f"decisions:{scope}")  # two managers of one directory in one program stay apart
        self.base = f"cairn/agree/{zlib.crc32(scope.encode()):08x}.{instance}"
        self._seq = itertools.count()

    @property
    def alone(self) -> bool:
        return self.coord.process_count == 1

    def shared(self, what: str, value: Any) -> Any:
        """The primary's `value` (JSON), on every process. Non-primaries' `value` is ignored."""
        if self.alone:
            return value
        key = f"{self.base}/{next(self._seq)}/{what}"
        if self.coord.process_index == 0:
            self.coord.publish(key, json.dumps(value).encode())
            return value
        return json.loads(fetch_from(self.coord, key, TIMEOUT, writer=0))

    def gather(self, what: str, outcome: Any) -> dict[int, Any]:
        """Every process's `outcome` (JSON), by process index.

        Through the primary: each process publishes its outcome and waits for the primary's one
        message of all of them (one publish and one blocking get, whatever the process count)."""
        if self.alone:
            return {0: outcome}
        return agree(self.coord, f"{self.base}/{next(self._seq)}/{what}", outcome, TIMEOUT)

    def decide(self, what: str, mine: Any, decide: Any) -> Any:
        """The primary's ``decide(values by process)`` of every process's `mine`, on every process
        (`agree`): what comes back is the decision, not everyone's values."""
        if self.alone:
            return json.loads(json.dumps(decide({0: json.loads(json.dumps(mine))})))
        return agree(self.coord, f"{self.base}/{next(self._seq)}/{what}", mine, TIMEOUT, decide=decide)

    def each(self, what: str, mine: Any, decide: Any) -> Any:
        """This process's part of the primary's ``decide(values by process)``, which returns
        ``{process: part}``: a process receives its own part only (`agree` with ``each``)."""
        return agree(self.coord, f"{self.base}/{next(self._seq)}/{what}", mine, TIMEOUT, decide=decide, each=True)

    def failures(self, what: str, error: str | None) -> dict[int, str]:
        """The processes whose `error` is not None, and their errors (the same on every process).

        As `gather`, but the primary sends back the failures only: a few bytes when all went well."""
        if self.alone:
            return {} if error is None else {0: error}
        found = agree(self.coord, f"{self.base}/{next(self._seq)}/{what}", error, TIMEOUT,
                      decide=lambda got: {str(p): e for p, e in sorted(got.items()) if e is not None})
        return {int(p): e for p, e in found.items()}
