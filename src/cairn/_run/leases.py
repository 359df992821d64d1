"""Reader leases: an evaluator's claim on a step that the trainer's retention honours.

Files, written through the storage of the manager's directory, with hidden
names (never listed as a step, never taken for a leftover, skipped by
``cairn ls`` and ``cairn gc``):

- ``.cairn-leases/step_<N>.<reader>.lease``: JSON ``{"step", "reader",
  "host", "pid", "ttl_s", "expires_unix"}``, one per reader and step, put
  again (renewed) every ``ttl_s / 3`` seconds while the reader holds it,
  deleted on release. The folder appears once a reader has leased a step.
- ``.cairn-deleting.step_<N>``: the trainer's intent to delete step `N`,
  present only during the retention pass that deletes it.

The handshake is Dekker's: each side first writes its own flag, then reads
the other's.

- Reader (`take`): put the lease, then check that step `N` has no
  ``deleting`` marker and still has its manifest. If either check fails, it
  deletes its lease and does not read the step.
- Trainer (`spare_leased`): put a ``deleting`` marker for every step it
  means to delete, then list the leases, delete only the steps without a
  live lease, and remove the markers last.

Storage that shows every completed write to later reads and listings (POSIX,
and S3, GCS and Azure Blob, which are strongly consistent) makes at least
one side see the other's flag: either the trainer lists after the lease was
put, and spares the step, or the reader checks after the marker was put (or
after the deletion, which comes before the marker's removal), and backs off.
Both may back off at once; the step is then deleted on a later pass.

Clocks. A lease is live while ``expires_unix`` (the reader's clock at renewal
plus ``ttl_s``) is later than the trainer's clock. A reader renews every
``ttl_s / 3`` seconds, so its lease always has about ``2 * ttl_s / 3`` left:
the hosts' clocks must agree to well within that (40 s at the default
``ttl_s`` of 60; NTP keeps them within milliseconds). A reader that crashes
stops renewing, so its lease expires ``ttl_s`` later and no longer pins the
step; the trainer deletes the expired lease file on its next pass. A reader
that is stalled for longer than ``ttl_s`` (a suspended process) loses its
protection: `Lease.lost` then says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .._format import manifest as fmt
from .._storage import Storage
from .steps import ORBAX_STEP_METADATA, parse_step, step_dirname

log = logging.getLogger("cairn")

#: The hidden folder of lease files and deletion markers in a manager's directory.
LEASE_DIR = ".cairn-leases"
#: Default lease lifetime in seconds; a held lease is renewed every third of it.
DEFAULT_TTL_S = 60.0

_LEASE = re.compile(r"^(step_\d{8,})\.([A-Za-z0-9_-]{1,80})\.lease$")
_MARKER = ".cairn-deleting."


def _lease_key(step: int, reader: str) -> str:
    return f"{LEASE_DIR}/{step_dirname(step)}.{reader}.lease"


def _marker_key(step: int) -> str:
    return f"{_MARKER}{step_dirname(step)}"


def reader_id() -> str:
    """A name for this reader, unique across hosts and restarts: host, process id, random."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", platform.node())[:40] or "host"
    return f"{host}_{os.getpid()}_{secrets.token_hex(4)}"


@dataclass(frozen=True)
class LeaseRecord:
    """One lease file as the trainer reads it."""

    key: str
    step: int
    reader: str
    expires_unix: float

    def live(self, now: float) -> bool:
        return self.expires_unix > now


class Lease:
    """A reader's lease on one step, renewed on a daemon thread until `release`.

    Example:

        lease = take(storage, 100, "/ckpt/run1")
        if lease is not None:
            try:
                ...   # read step 100
            finally:
                lease.release()
    """

    def __init__(self, storage: Storage, step: int, where: str, ttl_s: float, reader: str):
        self.storage, self.step, self.where, self.ttl_s, self.reader = storage, step, where, ttl_s, reader
        self.key = _lease_key(step, reader)
        self._stop = threading.Event()
        self._last_renewed = 0.0  # time.monotonic() of the last successful put
        self._thread: threading.Thread | None = None

    def _put(self) -> None:
        now = time.time()
        body = {"step": self.step, "reader": self.reader, "host": platform.node(), "pid": os.getpid(),
                "ttl_s": self.ttl_s, "expires_unix": now + self.ttl_s}
        self.storage.put(self.key, json.dumps(body).encode())
        self._last_renewed = time.monotonic()

    def _start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, name=f"cairn-lease-{self.step}", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._put()
            except Exception as e:  # retried at the next period; `lost` tells the reader if it runs out
                log.warning("cairn: renewing the lease on step %d of %s failed: %s", self.step, self.where, e)

    @property
    def lost(self) -> bool:
        """Whether the lease may have expired: no renewal succeeded within `ttl_s`."""
        return not self._stop.is_set() and time.monotonic() - self._last_renewed >= self.ttl_s

    def release(self) -> None:
        """Stop renewing and delete the lease file (best effort: an expired lease pins nothing)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            self.storage.delete_prefix(self.key)
        except Exception as e:
            log.warning("cairn: releasing the lease on step %d of %s failed (it expires in %.0f s): %s",
                        self.step, self.where, self.ttl_s, e)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def take(storage: Storage, step: int, where: str, ttl_s: float = DEFAULT_TTL_S,
         reader: str | None = None, folder: str | None = None) -> Lease | None:
    """Lease committed `step`; None if it is gone or being deleted (then nothing is left behind).

    `where` (the directory) is for messages; `folder` is the step's folder
    (default: its canonical name; an Orbax step's counts when it holds
    ``_CHECKPOINT_METADATA``). The lease is renewed until released.
    """
    if not ttl_s > 0:
        raise ValueError(f"{where}: lease ttl_s must be > 0, got {ttl_s}")
    lease = Lease(storage, step, where, float(ttl_s), reader or reader_id())
    lease._put()
    # Only now look at the trainer's flag: see the module docstring.
    folder = folder or step_dirname(step)
    if storage.exists(_marker_key(step)) or not (storage.exists(f"{folder}/{fmt.MANIFEST}")
                                                  or storage.exists(f"{folder}/{ORBAX_STEP_METADATA}")):
        lease.release()
        return None
    lease._start_renewing()
    return lease


def leases(storage: Storage) -> list[LeaseRecord]:
    """Every lease file in the directory (unreadable ones as already expired)."""
    out = []
    for name in storage.list_dir(LEASE_DIR):
        m = _LEASE.match(name)
        step = parse_step(m.group(1)) if m else None
        if m is None or step is None:
            continue
        key = f"{LEASE_DIR}/{name}"
        try:
            expires = float(json.loads(storage.read(key))["expires_unix"])
        except FileNotFoundError:
            continue  # released meanwhile
        except Exception:
            expires = 0.0  # puts are atomic, so this is no lease of ours: it pins nothing
        out.append(LeaseRecord(key, step, m.group(2), expires))
    return out


@contextlib.contextmanager
def spare_leased(storage: Storage, doomed: Iterable[int], where: str) -> Iterator[list[int]]:
    """For the trainer: yields the steps of `doomed` that no live lease holds, to delete now.

    Puts a deletion marker for every doomed step first and removes the markers
    when the block exits (after the deletions), so a reader that leases a
    step meanwhile either is seen here or sees the marker. Expired lease files
    are removed. `where` (the directory) is for messages.
    """
    victims = sorted(set(doomed))
    marked = []
    try:
        for s in victims:
            storage.put(_marker_key(s), b"{}")
            marked.append(s)
        now = time.time()
        held: set[int] = set()
        for rec in leases(storage):
            if rec.live(now):
                held.add(rec.step)
            else:
                with contextlib.suppress(OSError):
                    storage.delete_prefix(rec.key)
                log.info("cairn: removed the expired lease of reader %s on step %d in %s", rec.reader, rec.step, where)
        for s in sorted(held & set(victims)):
            log.info("cairn: retention keeps step %d of %s for now: a reader holds a lease on it", s, where)
        yield [s for s in victims if s not in held]
    finally:
        for s in marked:
            try:
                storage.delete_prefix(_marker_key(s))
            except OSError as e:  # a stale marker only makes readers skip a step already doomed
                log.warning("cairn: could not remove the deletion marker of step %d in %s: %s", s, where, e)


def remove_stale_markers(storage: Storage) -> None:
    """Remove deletion markers a crashed retention pass left (the manager calls it when it opens)."""
    for name in storage.list_dir(""):
        if name.startswith(_MARKER):  # also what an interrupted put of one left (a local temporary)
            with contextlib.suppress(FileNotFoundError):
                storage.delete_prefix(name)
