"""Coordination between processes: index, count and small messages.

This is the only module that touches ``jax.distributed``. Everything here is
safe to call from background threads: it uses the coordination service's
key-value store (never device collectives), always with a
timeout. A timeout names the processes that did not arrive and the last step
each of them reached.

Only metadata travels through a coordinator (attempt tokens, statuses,
outcomes: a few hundred bytes per process per save); array bytes never do.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from .._errors import CoordinationError, CoordinationTimeoutError, error_from_record, error_record

_PROGRESS = "cairn/progress"
_ALIVE = "cairn/alive"
#: How long a peer may go without a heartbeat, or without progress inside a save or load,
#: before the processes waiting for it give up on it (seconds; env CAIRN_PEER_TIMEOUT).
PEER_TIMEOUT = 60.0


class Activity:
    """What this process is doing inside cairn, for its heartbeat: the operation and a counter
    that the engine advances as bytes move. A peer waiting for this process reads both."""

    def __init__(self) -> None:
        self.op: str | None = None
        self.progress = 0
        self._lock = threading.Lock()
        self._depth = 0

    def begin(self, op: str) -> None:
        with self._lock:
            self._depth += 1
            self.op = op
            self.progress += 1

    def end(self) -> None:
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if not self._depth:
                self.op = None
            self.progress += 1

    def advance(self, n: int = 1) -> None:
        self.progress += n  # a race loses a count at worst: it only has to change


activity = Activity()


@runtime_checkable
class Coordinator(Protocol):
    """What cairn needs from the processes of a multi-controller program.

    Implement it to run cairn under another launcher; cairn uses
    JAX's coordination service when ``jax.distributed`` is initialised and a
    trivial single-process one otherwise. Every key is used
    once per program run; every wait raises `CoordinationTimeoutError`
    after `timeout` seconds.

    Example:

        class MyCoordinator:
            process_index, process_count = rank, world_size
            def publish(self, key, value): ...
            def fetch(self, key, timeout): ...
            def fetch_all(self, prefix, count, timeout): ...
            def drop(self, prefix): ...  # optional

        cairn.save(path, state, coordinator=MyCoordinator())
    """

    process_index: int
    process_count: int

    def publish(self, key: str, value: bytes) -> None:
        """Make `value` readable by every process under `key` (each key written once)."""

    def fetch(self, key: str, timeout: float) -> bytes:
        """Wait for and return the value published under `key`."""

    def fetch_all(self, prefix: str, count: int, timeout: float) -> dict[str, bytes]:
        """Wait until `count` keys exist under ``prefix/`` and return them (full keys)."""

    def drop(self, prefix: str) -> None:
        """Forget every key under `prefix` (cairn drops a save's keys once every process is past it).

        Optional: without it, the keys of earlier saves and loads stay in the store."""


def drop_keys(coord: Any, prefix: str) -> None:
    """`coord.drop(prefix)`, where the coordinator has one (`Coordinator.drop` is optional)."""
    drop = getattr(coord, "drop", None)
    if drop is not None:
        drop(prefix)


class SingleProcess:
    """The coordinator of a single-controller program: every wait is immediate."""

    process_index = 0
    process_count = 1

    def __init__(self) -> None:
        self._kv: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def barrier(self, name: str, timeout: float) -> None:
        return None

    def publish(self, key: str, value: bytes) -> None:
        with self._lock:
            self._kv[key] = value

    def fetch(self, key: str, timeout: float, writer: int | None = None) -> bytes:
        with self._lock:
            if key not in self._kv:
                raise CoordinationError(f"nothing was published under {key!r}")
            return self._kv[key]

    def fetch_all(self, prefix: str, count: int, timeout: float) -> dict[str, bytes]:
        with self._lock:
            out = {k: v for k, v in self._kv.items() if k.startswith(prefix + "/")}
        if len(out) < count:
            raise CoordinationError(f"{len(out)} of {count} values under {prefix!r}")
        return out

    def drop(self, prefix: str) -> None:
        """Forget every key under ``prefix/`` (and `prefix` itself)."""
        with self._lock:
            for k in [k for k in self._kv if k == prefix or k.startswith(prefix + "/")]:
                del self._kv[k]


class JaxCoordinator:
    """Coordination over the JAX distributed runtime's coordination service.

    `client` is ``jax._src.distributed.global_state.client`` (a
    ``DistributedRuntimeClient``). Besides the values it is asked to publish,
    each process keeps one overwritten key, its last step, so that a timeout
    can say where the missing processes were.
    """

    def __init__(self, client: Any, process_index: int, process_count: int, peer_timeout: float | None = None):
        self._client = client
        self.process_index = process_index
        self.process_count = process_count
        env = os.environ.get("CAIRN_PEER_TIMEOUT")
        self.peer_timeout = float(peer_timeout if peer_timeout is not None else env or PEER_TIMEOUT)
        # Per peer: (its last heartbeat as read, when it changed, its last (op, progress), when that changed).
        self._seen: dict[int, tuple[str, float, str, float]] = {}
        self._last_check = 0.0
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="cairn-heartbeat", daemon=True)
        self._beat.start()
        #: Processes this one found dead (no heartbeat for peer_timeout): `shutdown` does not wait for them.
        self.dead: set[int] = set()
        # Stopped before the interpreter finalizes: a daemon thread caught inside a client call
        # then aborts the process ("terminate called ... exception not rethrown").
        atexit.register(self.close)
        if process_index == 0 and _recoverable():
            # Registered after `close`, so it runs before it (atexit is last in, first out).
            atexit.register(_wait_for_others_at_exit, self)

    def close(self) -> None:
        self._stop.set()
        if self._beat.is_alive() and self._beat is not threading.current_thread():
            self._beat.join(timeout=5)

    def _heartbeat(self) -> None:
        """Publish this process's heartbeat: a beat count, what it is doing and its progress."""
        beat = 0
        interval = max(0.2, min(5.0, self.peer_timeout / 6))
        while not self._stop.is_set():
            beat += 1
            value = json.dumps({"beat": beat, "op": activity.op, "progress": activity.progress})
            try:
                self._client.key_value_set_bytes(f"{_ALIVE}/{self.process_index}", value.encode(),
                                                 allow_overwrite=True)
            except Exception:
                if self._stop.wait(interval):
                    return
                continue  # the service is gone or shutting down: nothing to tell
            self._stop.wait(interval)

    def check_peers(self, processes: list[int], waiting_for: str) -> bool:
        """Raise `CoordinationError` if one of `processes` died (no heartbeat for `peer_timeout`)
        or, inside a save or load, made no progress for that long. Returns whether one of them
        was seen making progress."""
        now = time.monotonic()
        if now - self._last_check < min(1.0, self.peer_timeout / 10):
            return False  # a few requests per second at most, however fast the caller polls
        moving = False
        self._last_check = now
        beats = self._beats(processes)
        for p in processes:
            raw = beats.get(p)
            if raw is None:
                continue  # no heartbeat seen yet (it has not reached cairn): cannot judge
            state = json.loads(raw)
            doing = json.dumps([state.get("op"), state.get("progress")])
            old = self._seen.get(p)
            if old is None:
                self._seen[p] = (raw, now, doing, now)
                continue
            beat_at = now if raw != old[0] else old[1]
            doing_at = now if doing != old[2] else old[3]
            moving = moving or doing != old[2]
            self._seen[p] = (raw, beat_at, doing, doing_at)
            if now - beat_at > self.peer_timeout:
                self.dead.add(p)
                raise CoordinationError(
                    f"{self._whereabouts([p])} sent no heartbeat for {now - beat_at:.0f}s: it died or hangs "
                    f"entirely (process {self.process_index} was waiting for {waiting_for}; CAIRN_PEER_TIMEOUT "
                    f"is {self.peer_timeout:g}s)"
                )
            if state.get("op") and now - doing_at > self.peer_timeout:
                raise CoordinationError(
                    f"{self._whereabouts([p])} made no progress for {now - doing_at:.0f}s while "
                    f"{state['op']} (process {self.process_index} was waiting for {waiting_for}; "
                    f"CAIRN_PEER_TIMEOUT is {self.peer_timeout:g}s)"
                )
        return moving

    def _beats(self, processes: list[int]) -> dict[int, str]:
        """The heartbeats of `processes`: one request each for one or two, else one listing of all
        (one request, whatever the count; only the process that watches many, the primary, lists)."""
        out: dict[int, str] = {}
        if len(processes) <= 2:
            for p in processes:
                try:
                    out[p] = bytes(self._client.key_value_try_get_bytes(f"{_ALIVE}/{p}")).decode()
                except Exception:
                    pass
            return out
        wanted = set(processes)
        try:
            for k, v in self._client.key_value_dir_get_bytes(_ALIVE):
                last = _last(k)
                if last.isdigit() and int(last) in wanted:
                    out[int(last)] = bytes(v).decode()
        except Exception:
            pass
        return out

    # -------------------------------------------------------------- protocol

    def barrier(self, name: str, timeout: float) -> None:
        """Wait until every process reaches `name` (not part of the protocol: cairn's own tests and tools)."""
        # Publish arrival first, so that a timeout can say who is missing.
        self._client.key_value_set_bytes(f"{name}/arrived/{self.process_index}", b"1")
        self._mark(f"waiting at barrier {name!r}")
        try:
            self._client.wait_at_barrier(name, _ms(timeout))
        except Exception as e:
            if not _is_timeout(e):
                raise CoordinationError(f"barrier {name!r} failed on process {self.process_index}: {e}") from e
            arrived = {_last(k) for k in self._list(f"{name}/arrived")}
            missing = [p for p in range(self.process_count) if str(p) not in arrived]
            if not missing:
                # Everyone arrived, but too late for a process that gave up first:
                # the service fails the barrier for all of them.
                raise CoordinationTimeoutError(
                    f"barrier {name!r}: every process arrived, but not within {timeout:g}s of the "
                    f"first, so the barrier failed (process {self.process_index})"
                ) from None
            raise CoordinationTimeoutError(
                f"barrier {name!r}: {self._whereabouts(missing)} did not arrive within {timeout:g}s "
                f"(process {self.process_index} waited)"
            ) from None
        self._mark(f"passed barrier {name!r}")

    def publish(self, key: str, value: bytes) -> None:
        try:
            self._client.key_value_set_bytes(key, value)
        except Exception as e:
            raise CoordinationError(f"process {self.process_index} could not publish {key!r}: {e}") from e
        self._mark(f"published {key!r}")

    def fetch(self, key: str, timeout: float, writer: int | None = None) -> bytes:
        """Wait for `key`; `writer`, the process expected to publish it, improves the timeout error."""
        self._mark(f"waiting for {key!r}")
        deadline = time.monotonic() + timeout
        # Wait in slices, checking between them that the process expected to publish is alive.
        piece = max(0.2, min(2.0, self.peer_timeout / 10))
        while True:
            left = deadline - time.monotonic()
            try:
                value = self._client.blocking_key_value_get_bytes(key, _ms(max(min(piece, left), 0.001)))
                break
            except Exception as e:
                if not _is_timeout(e):
                    raise CoordinationError(f"process {self.process_index}: fetching {key!r} failed: {e}") from e
            if time.monotonic() >= deadline:
                who = f" from {self._whereabouts([writer])}" if writer is not None else ""
                raise CoordinationTimeoutError(
                    f"process {self.process_index} got no value under {key!r}{who} within {timeout:g}s"
                ) from None
            self.check_peers([writer] if writer is not None else self._others(), repr(key))
        self._mark(f"got {key!r}")
        return bytes(value)

    def fetch_all(self, prefix: str, count: int, timeout: float) -> dict[str, bytes]:
        """Poll ``prefix/`` until `count` keys exist (keys end in a process index)."""
        self._mark(f"waiting for {count} values under {prefix!r}")
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            got = self._dir(prefix)
            if len(got) >= count:
                self._mark(f"got {count} values under {prefix!r}")
                return got
            present = {_last(k) for k in got}
            missing = [p for p in range(self.process_count) if str(p) not in present]
            self.check_peers(missing, f"{count} values under {prefix!r}")
            if time.monotonic() > deadline:
                raise CoordinationTimeoutError(
                    f"{self._whereabouts(missing)} published nothing under {prefix!r} within "
                    f"{timeout:g}s ({len(got)} of {count} did; process {self.process_index} waited)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def collect(self, prefix: str, processes: list[int], timeout: float) -> dict[int, bytes]:
        """Wait for ``prefix/<p>`` of each of `processes`, by process index (the primary's gather).

        One blocking get per process, in slices; between slices the heartbeats of the processes
        still missing are checked (one listing), so a dead one is named within `peer_timeout`.
        No listing of the values: the requests and bytes are O(processes), each value read once.
        """
        self._mark(f"waiting for {len(processes)} values under {prefix!r}")
        deadline = time.monotonic() + timeout
        piece = max(0.2, min(2.0, self.peer_timeout / 10))
        got: dict[int, bytes] = {}
        for k, p in enumerate(processes):
            while True:
                left = deadline - time.monotonic()
                try:
                    got[p] = bytes(self._client.blocking_key_value_get_bytes(
                        f"{prefix}/{p}", _ms(max(min(piece, left), 0.001))))
                    activity.advance()  # the processes waiting for this one see it is not stuck
                    break
                except Exception as e:
                    if not _is_timeout(e):
                        raise CoordinationError(
                            f"process {self.process_index}: fetching '{prefix}/{p}' failed: {e}") from e
                missing = processes[k:]
                if time.monotonic() >= deadline:
                    raise CoordinationTimeoutError(
                        f"{self._whereabouts(missing)} published nothing under {prefix!r} within "
                        f"{timeout:g}s ({len(got)} of {len(processes)} did; process {self.process_index} waited)"
                    )
                if self.check_peers(missing, f"{len(processes)} values under {prefix!r}"):
                    activity.advance()  # waiting for peers that work: not stuck either
        self._mark(f"got {len(processes)} values under {prefix!r}")
        return got

    def drop(self, prefix: str) -> None:
        """Delete every key under `prefix` (the service deletes directories recursively)."""
        try:
            self._client.key_value_delete(prefix)
        except Exception:
            pass  # only memory in the service is at stake

    # -------------------------------------------------------------- helpers

    def _others(self) -> list[int]:
        return [p for p in range(self.process_count) if p != self.process_index]

    def _mark(self, step: str) -> None:
        try:
            self._client.key_value_set_bytes(
                f"{_PROGRESS}/{self.process_index}", step.encode(), allow_overwrite=True
            )
        except Exception:
            pass  # a diagnostic only: never let it fail the operation

    def _whereabouts(self, processes: list[int]) -> str:
        """'process 1 (last step: ...)' or 'processes 1, 3 (1: ...; 3: ...)', for an error message."""
        shown = processes[:8]
        steps = {}
        for p in shown:
            try:
                steps[p] = bytes(self._client.key_value_try_get_bytes(f"{_PROGRESS}/{p}")).decode(errors="replace")
            except Exception:
                steps[p] = "none reported"
        if len(processes) == 1:
            return f"process {processes[0]} (last step: {steps[processes[0]]})"
        more = f"; {len(processes) - len(shown)} more" if len(processes) > len(shown) else ""
        listed = ", ".join(map(str, shown)) + (f" and {len(processes) - len(shown)} more" if more else "")
        detail = "; ".join(f"{p}: {s}" for p, s in steps.items())
        return f"processes {listed} (last steps: {detail}{more})"

    def _dir(self, prefix: str) -> dict[str, bytes]:
        items = self._client.key_value_dir_get_bytes(prefix)
        return {k: bytes(v) for k, v in items}

    def _list(self, prefix: str) -> list[str]:
        try:
            return list(self._dir(prefix))
        except Exception:
            return []


#: How long process 0 waits at exit for the others to leave (seconds; env CAIRN_EXIT_TIMEOUT).
EXIT_TIMEOUT = 120.0


def _recoverable() -> bool:
    try:
        import jax

        return bool(getattr(jax.config, "jax_enable_recoverability", False))
    except (ImportError, AttributeError):
        return False


def shutdown(timeout: float | None = None) -> None:
    """Leave the JAX cluster so that every other process gets to finish: ``jax.distributed.shutdown``
    that cannot cut the others off.

    Process 0 hosts JAX's coordination service. With ``jax_enable_recoverability`` (which keeps the
    survivors of a dead peer alive), JAX's own shutdown does not wait for anyone, so when process 0
    exits, a process still running (say, in the handler of a `CoordinationError`: logging, a
    save to the local tier, a clean exit for the scheduler) loses the service and JAX aborts it.
    Here process 0 first waits until every other process has left (called this, or exited), at
    most `timeout` seconds (default ``CAIRN_EXIT_TIMEOUT``, 120), not waiting for processes cairn
    found dead; every other process leaves at once. Without recoverability JAX's shutdown already
    waits for every process, and this is ``jax.distributed.shutdown()``. Does nothing when
    ``jax.distributed`` is not initialised. Process 0 does the same wait at exit on its own, so a
    script that just raises or returns is safe too; call this where the program ends some other
    way (``os._exit``) or should leave the cluster early.

    Example:


        try:
            train()
        except cairn.CoordinationError:
            save_what_you_can()  # every survivor gets here, whenever process 0 exits
            raise
        finally:
            cairn.shutdown()
    """
    import sys

    if "jax" not in sys.modules:
        return
    from jax._src import distributed

    state = distributed.global_state
    if state.client is None:
        return
    coord = _default if isinstance(_default, JaxCoordinator) and _default._client is state.client else None
    if state.process_id == 0 and _recoverable():
        _wait_for_others(state.client, state.num_processes, coord.dead if coord else set(), timeout)
    if coord is not None:
        coord.close()
    import jax

    jax.distributed.shutdown()


def _wait_for_others(client: Any, count: int, dead: set[int], timeout: float | None) -> bool:
    """Process 0: wait until every process but the `dead` has left the coordination service, at most
    `timeout` seconds; whether they all did.

    JAX's live-node query returns once each live process it names has made the same query or left
    (disconnected, or found dead by the service): the others never make it, so it returns when they
    have all left. It cannot be given a deadline, so it runs in a daemon thread."""
    others = [p for p in range(1, count) if p not in dead]
    if not others:
        return True
    if timeout is None:
        timeout = float(os.environ.get("CAIRN_EXIT_TIMEOUT") or EXIT_TIMEOUT)
    done = threading.Event()

    def query() -> None:
        try:
            client.get_live_nodes([0, *others])
        except Exception:
            pass  # the service is going or gone: nothing left to wait for
        done.set()

    threading.Thread(target=query, name="cairn-exit-wait", daemon=True).start()
    if done.wait(timeout):
        return True
    import logging

    logging.getLogger("cairn").warning(
        "process 0 leaves the cluster after waiting %.0fs for processes %s to leave first (CAIRN_EXIT_TIMEOUT); "
        "those still running lose the coordination service", timeout, others)
    return False


def _wait_for_others_at_exit(coord: JaxCoordinator) -> None:
    """At process 0's exit (recoverability on): `_wait_for_others`, unless the cluster is already shut down."""
    try:
        from jax._src import distributed

        state = distributed.global_state
        if state.client is not coord._client:
            return  # shut down already (cairn.shutdown or jax.distributed.shutdown), or a new cluster
        _wait_for_others(state.client, state.num_processes or coord.process_count, coord.dead, None)
    except Exception:
        pass  # never turn an exit into a crash


def _ms(timeout: float) -> int:
    return max(1, int(timeout * 1000))


def _last(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _is_timeout(e: Exception) -> bool:
    text = str(e).lower()
    return "deadline" in text or "timed out" in text or "timeout" in text


_default: Coordinator | None = None


def default_coordinator() -> Coordinator:
    """The coordinator for this program: JAX's when ``jax.distributed`` is initialised."""
    global _default
    import sys

    if "jax" in sys.modules:
        try:
            from jax._src import distributed

            state = distributed.global_state
            if state.client is not None and (state.num_processes or 1) > 1:
                if not isinstance(_default, JaxCoordinator) or _default._client is not state.client:
                    if isinstance(_default, JaxCoordinator):
                        _default.close()  # a new cluster (jax.distributed re-initialised): stop the old heartbeat
                    _default = JaxCoordinator(state.client, state.process_id, state.num_processes)
                return _default
        except ImportError:
            pass
    if not isinstance(_default, SingleProcess):
        _default = SingleProcess()
    return _default


def fetch_from(coord: Coordinator, key: str, timeout: float, writer: int) -> bytes:
    """`coord.fetch`, telling cairn's own coordinators which process publishes `key`.

    User coordinators implement the plain protocol, without the hint.
    """
    if isinstance(coord, (JaxCoordinator, SingleProcess)):
        return coord.fetch(key, timeout, writer=writer)
    return coord.fetch(key, timeout)


def preemption_sync_manager() -> Any:
    """JAX's preemption sync manager, when ``jax.distributed`` runs with it; else None.

    Its ``reached_sync_point(step)`` is true on every process at the same
    step, once any process was told of a preemption (JAX catches SIGTERM).
    """
    import sys

    if "jax" not in sys.modules:
        return None
    try:
        from jax._src import distributed
    except ImportError:
        return None
    return getattr(distributed.global_state, "preemption_sync_manager", None)


def gather_json(coord: Coordinator, prefix: str, count: int, timeout: float) -> dict[int, Any]:
    """The JSON values processes ``0..count-1`` published under ``prefix/<process>``, by process index.

    Called by the primary alone (everything cairn gathers goes through it); cairn's own
    coordinator waits for each key in turn (`JaxCoordinator.collect`), others poll `fetch_all`."""
    if isinstance(coord, JaxCoordinator):
        return {p: json.loads(v) for p, v in coord.collect(prefix, list(range(count)), timeout).items()}
    raw = coord.fetch_all(prefix, count, timeout)
    return {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in raw.items()}


def agree(coord: Coordinator, prefix: str, mine: Any, timeout: float,
          decide: Callable[[dict[int, Any]], Any] | None = None, each: bool = False) -> Any:
    """Every process's JSON value `mine` goes to the primary, which sends one decision back.

    The decision is ``decide(values by process)`` (default: the values themselves, by process
    index). A non-primary process makes one publish and one blocking get, whatever the process
    count; the primary one get per process and one publish. If the primary cannot gather (a peer
    died, a timeout), every process raises its error, naming the process at fault.

    With `each`, `decide` returns each process's own part (``{process: part}``) and a process
    receives only its part (the primary publishes one per process): what a process reads stays
    the size of its part, whatever the process count.

    Example:

        worst = agree(coord, "cairn/x/7", my_loss, 60, decide=lambda v: max(v.values()))
    """
    n, me = coord.process_count, coord.process_index
    if each:
        assert decide is not None, "agree(each=True) needs a decide that returns each process's part"
        return _agree_each(coord, prefix, mine, timeout, decide)
    if n == 1:
        return _decided(decide, {0: json.loads(json.dumps(mine))})
    key = f"{prefix}/decision"
    if me:
        coord.publish(f"{prefix}/{me}", json.dumps(mine).encode())
        msg = json.loads(fetch_from(coord, key, timeout, writer=0))
    else:
        try:
            msg = {"ok": _decided(decide, _primary_gathers(coord, prefix, mine, n, timeout))}
        except CoordinationError as e:
            msg = {"error": error_record(e, 0), "message": str(e)}
        coord.publish(key, json.dumps(msg).encode())
        msg = json.loads(json.dumps(msg))  # the primary sees what the others see (string keys and all)
    if "error" in msg:
        raise error_from_record(msg["error"], msg["message"])
    out = msg["ok"]
    return {int(p): v for p, v in out.items()} if decide is None else out


def _primary_gathers(coord: Coordinator, prefix: str, mine: Any, n: int, timeout: float) -> dict[int, Any]:
    """On the primary: every process's JSON value under `prefix`, its own first (one blocking get per
    process through JAX's client; a gather of the keys through any other coordinator)."""
    values = {0: json.loads(json.dumps(mine))}
    if isinstance(coord, JaxCoordinator):
        values.update({p: json.loads(v) for p, v in coord.collect(prefix, list(range(1, n)), timeout).items()})
        return values
    coord.publish(f"{prefix}/0", json.dumps(mine).encode())
    return gather_json(coord, prefix, n, timeout)


def _agree_each(coord: Coordinator, prefix: str, mine: Any, timeout: float,
                decide: Callable[[dict[int, Any]], dict[int, Any]]) -> Any:
    n, me = coord.process_count, coord.process_index
    if n == 1:
        return json.loads(json.dumps(decide({0: json.loads(json.dumps(mine))})[0]))
    if me:
        coord.publish(f"{prefix}/{me}", json.dumps(mine).encode())
        msg = json.loads(fetch_from(coord, f"{prefix}/decision/{me}", timeout, writer=0))
    else:
        try:
            parts = decide(_primary_gathers(coord, prefix, mine, n, timeout))
            msgs = {p: {"ok": parts[p]} for p in range(n)}
        except CoordinationError as e:
            msgs = {p: {"error": error_record(e, 0), "message": str(e)} for p in range(n)}
        for p in range(1, n):
            coord.publish(f"{prefix}/decision/{p}", json.dumps(msgs[p]).encode())
        msg = json.loads(json.dumps(msgs[0]))
    if "error" in msg:
        raise error_from_record(msg["error"], msg["message"])
    return msg["ok"]


def announce(coord: Coordinator, prefix: str, decision: Any) -> None:
    """The primary's `decision` for the `agree` under `prefix`, published without gathering: for a
    primary that fails before it gathers and already knows what the others must be told."""
    coord.publish(f"{prefix}/decision", json.dumps({"ok": decision}).encode())


def _decided(decide: Callable[[dict[int, Any]], Any] | None, values: dict[int, Any]) -> Any:
    return values if decide is None else decide(values)
