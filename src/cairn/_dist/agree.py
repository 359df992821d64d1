"""Decisions that every process of a multi-process program must see alike.

A `CheckpointManager` lists its directory, picks the step to restore and
falls back past corrupt steps. Done separately on each process, those can
differ (a listing taken a moment apart, a corrupt chunk that only one process
reads), and then processes load different steps. Each such decision is made
once here and shared through the coordinator:

- `shared`: the primary decides (lists the directory, say) and publishes
  the answer; the others take it.
- `settle`: the end of a save or an export. Every process reports how its
  part went; the primary commits if all went well (or cleans up if not) and
  every process learns the one outcome.
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
from collections.abc import Callable
from typing import Any

from .._errors import CoordinationError, error_record, first_failure
from .coord import Coordinator, agree, drop_keys, fetch_from

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

def settle(coord: Coordinator, prefix: str, status: dict[str, Any], timeout: float,
           finish: Callable[[dict[int, Any]], None], abort: Callable[[], None] = lambda: None,
           forget: str | None = None) -> dict[str, Any]:
    """The status -> primary -> outcome exchange that ends a save or an export (through `agree`).

    Every process sends its `status`: ``{"ok": True, ...}`` (what the primary needs of its part), or
    ``{"ok": False, "error": error_record(...)}``. The primary runs ``finish(statuses)`` (the commit)
    when every status is ok, and ``abort()`` when one is not, when `finish` raises, or when it could
    not gather them (a dead peer, a timeout: the error names the process). Every process returns the
    same outcome: ``{"ok": True}``, or ``{"ok": False, "error": record, "message": ...}`` where the
    record is the first failure's and the message names every failed process. A process that cannot
    hear the primary raises `CoordinationError`. Once every status is in, every process is past the
    previous operation of the kind, and the primary drops its keys (`forget`, a prefix).

    Example:

        outcome = settle(coord, f"cairn/save/{n}/status", {"ok": True}, 600, finish=commit, abort=clean)
    """
    decided = False

    def decide(statuses: dict[int, Any]) -> dict[str, Any]:
        nonlocal decided
        decided = True
        if forget is not None:
            drop_keys(coord, forget)
        failure = first_failure(statuses)
        if failure is not None:
            abort()
            return {"ok": False, "error": failure[0], "message": failure[1]}
        try:
            finish(statuses)
        except BaseException as e:
            abort()
            record = error_record(e, 0)
            return {"ok": False, "error": record, "message": f"process 0: {record['message']}"}
        return {"ok": True}

    try:
        outcome: dict[str, Any] = agree(coord, prefix, status, timeout, decide=decide)
    except CoordinationError as e:
        if coord.process_index != 0 or decided:
            raise
        abort()  # the primary could not gather the statuses; every process was told why
        return {"ok": False, "error": error_record(e), "message": str(e)}
    return outcome


#: How long a process waits for a decision of the others (dead peers are noticed sooner).
TIMEOUT = 600.0


class Decisions:
    """The shared decisions of one `CheckpointManager` (`scope`: its directory)."""

    def __init__(self, coord: Coordinator, scope: str):
        self.coord = coord
        instance = sequence(f"decisions:{scope}")  # two managers of one directory in one program stay apart
        self.base = f"cairn/agree/{zlib.crc32(scope.encode()):08x}.{instance}"

    @property
    def alone(self) -> bool:
        return self.coord.process_count == 1

    def shared(self, what: str, value: Any) -> Any:
        """The primary's `value` (JSON), on every process. Non-primaries' `value` is ignored."""
        if self.alone:
            return value
        key = f"{self.base}/{sequence(self.base)}/{what}"
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
        return agree(self.coord, f"{self.base}/{sequence(self.base)}/{what}", outcome, TIMEOUT)

    def decide(self, what: str, mine: Any, decide: Any) -> Any:
        """The primary's ``decide(values by process)`` of every process's `mine`, on every process
        (`agree`): what comes back is the decision, not everyone's values."""
        if self.alone:
            return json.loads(json.dumps(decide({0: json.loads(json.dumps(mine))})))
        return agree(self.coord, f"{self.base}/{sequence(self.base)}/{what}", mine, TIMEOUT, decide=decide)

    def each(self, what: str, mine: Any, decide: Any) -> Any:
        """This process's part of the primary's ``decide(values by process)``, which returns
        ``{process: part}``: a process receives its own part only (`agree` with ``each``)."""
        return agree(self.coord, f"{self.base}/{sequence(self.base)}/{what}", mine, TIMEOUT, decide=decide, each=True)

    def failures(self, what: str, error: str | None) -> dict[int, str]:
        """The processes whose `error` is not None, and their errors (the same on every process).

        As `gather`, but the primary sends back the failures only: a few bytes when all went well."""
        if self.alone:
            return {} if error is None else {0: error}
        found = agree(self.coord, f"{self.base}/{sequence(self.base)}/{what}", error, TIMEOUT,
                      decide=lambda got: {str(p): e for p, e in sorted(got.items()) if e is not None})
        return {int(p): e for p, e in found.items()}
