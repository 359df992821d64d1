"""Unit tests of `_dist` (coordination between processes), in one process and fast.

The multi-process behaviour is tested with real processes in test_multiprocess.py and
test_agreement.py; here each piece is checked on its own: the single-process coordinator, the
sequence numbers, `agree` and `settle` (also with two "processes" that are two threads over one
key-value store, so the primary's side and the other's side both run), the manager's `Decisions`
alone (two threads of one process share its counters, so its two-process side is test_agreement's)
and the preemption watch.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cairn._dist.agree import Decisions, sequence, settle
from cairn._dist.coord import SingleProcess, agree, drop_keys, fetch_from, gather_json
from cairn._dist.preemption import PreemptionWatch
from cairn._errors import CoordinationError, MismatchError, error_record

# ---------------------------------------------------------------------- two processes as two threads


class _Store:
    """One key-value store shared by the `_Peer`s of a test, as the coordination service is."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.cond = threading.Condition()


class _Peer:
    """A user coordinator (the plain protocol) for process `index` of `count`, over a shared `_Store`."""

    def __init__(self, store: _Store, index: int, count: int):
        self.store, self.process_index, self.process_count = store, index, count

    def barrier(self, name: str, timeout: float) -> None:
        raise AssertionError("not used here")

    def publish(self, key: str, value: bytes) -> None:
        with self.store.cond:
            self.store.kv[key] = value
            self.store.cond.notify_all()

    def fetch(self, key: str, timeout: float) -> bytes:
        with self.store.cond:
            if not self.store.cond.wait_for(lambda: key in self.store.kv, timeout):
                raise CoordinationError(f"process {self.process_index}: timed out waiting for {key!r}")
            return self.store.kv[key]

    def fetch_all(self, prefix: str, count: int, timeout: float) -> dict[str, bytes]:
        def under() -> dict[str, bytes]:
            return {k: v for k, v in self.store.kv.items() if k.startswith(prefix + "/") and
                    k[len(prefix) + 1:].isdigit()}

        with self.store.cond:
            if not self.store.cond.wait_for(lambda: len(under()) >= count, timeout):
                raise CoordinationError(f"{len(under())} of {count} processes published under {prefix!r}")
            return under()

    def drop(self, prefix: str) -> None:
        with self.store.cond:
            for k in [k for k in self.store.kv if k == prefix or k.startswith(prefix + "/")]:
                del self.store.kv[k]


def _on_two(fn0, fn1, timeout: float = 30) -> tuple:
    """Run ``fn0(peer 0)`` and ``fn1(peer 1)`` at once; their results (or the exceptions they raised)."""
    store = _Store()
    peers = [_Peer(store, 0, 2), _Peer(store, 1, 2)]

    def call(fn, peer):
        try:
            return fn(peer)
        except Exception as e:  # returned, so that the test sees both sides
            return e

    pool = ThreadPoolExecutor(2)
    try:
        futures = [pool.submit(call, fn0, peers[0]), pool.submit(call, fn1, peers[1])]
        return tuple(f.result(timeout=timeout) for f in futures)
    finally:
        pool.shutdown(wait=False)  # a side stuck past `timeout` fails the test instead of hanging it


# ---------------------------------------------------------------------- SingleProcess


def test_single_process_coordinator_keeps_what_is_published_and_forgets_a_prefix():
    c = SingleProcess()
    assert (c.process_index, c.process_count) == (0, 1)
    c.publish("a/0", b"x")
    c.publish("a/1", b"y")
    c.publish("ab/0", b"z")  # not under "a/"
    assert c.fetch("a/0", 1) == b"x" and fetch_from(c, "a/1", 1, writer=0) == b"y"
    assert c.fetch_all("a", 2, 1) == {"a/0": b"x", "a/1": b"y"}
    with pytest.raises(CoordinationError, match="2 of 3 values under 'a'"):
        c.fetch_all("a", 3, 1)
    drop_keys(c, "a")
    with pytest.raises(CoordinationError, match="nothing was published under 'a/0'"):
        c.fetch("a/0", 1)
    assert c.fetch("ab/0", 1) == b"z"


def test_drop_keys_is_a_no_op_for_a_coordinator_without_drop():
    class NoDrop:
        process_index, process_count = 0, 1

    drop_keys(NoDrop(), "cairn/save/0")  # the protocol's drop is optional: nothing raised


def test_gather_json_reads_each_process_value_by_index():
    c = SingleProcess()
    c.publish("g/0", json.dumps({"ok": True}).encode())
    assert gather_json(c, "g", 1, 1) == {0: {"ok": True}}


# ---------------------------------------------------------------------- sequence


def test_sequence_counts_each_kind_on_its_own():
    a, b = f"test-a-{time.monotonic_ns()}", f"test-b-{time.monotonic_ns()}"
    assert [sequence(a) for _ in range(3)] == [0, 1, 2]
    assert sequence(b) == 0  # another kind starts at 0
    assert sequence(a) == 3


def test_sequence_is_thread_safe():
    kind = f"test-threads-{time.monotonic_ns()}"
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: sequence(kind), range(400)))
    assert sorted(got) == list(range(400))  # no number twice, none skipped


# ---------------------------------------------------------------------- agree


def test_agree_alone_decides_on_the_json_of_its_own_value():
    c = SingleProcess()
    assert agree(c, "x/0", (1, 2), 1) == {0: [1, 2]}  # what the others would see: JSON, a tuple as a list
    assert agree(c, "x/1", 3, 1, decide=lambda v: sum(v.values()) * 2) == 6
    assert agree(c, "x/2", 5, 1, decide=lambda v: {p: x + 1 for p, x in v.items()}, each=True) == 6


def test_agree_on_two_processes_gives_both_the_primarys_decision():
    r0, r1 = _on_two(lambda c: agree(c, "t/0", 1, 10, decide=lambda v: max(v.values())),
                     lambda c: agree(c, "t/0", 7, 10, decide=lambda v: max(v.values())))
    assert (r0, r1) == (7, 7)


def test_agree_each_gives_each_process_its_own_part():
    def decide(v):
        return {p: f"part of {p} from {sorted(v.values())}" for p in v}

    r0, r1 = _on_two(lambda c: agree(c, "e/0", "a", 10, decide=decide, each=True),
                     lambda c: agree(c, "e/0", "b", 10, decide=decide, each=True))
    assert (r0, r1) == ("part of 0 from ['a', 'b']", "part of 1 from ['a', 'b']")


def test_agree_a_missing_peer_fails_every_process_that_waits():
    r0, = _on_two(lambda c: agree(c, "m/0", 1, 0.3), lambda c: None)[:1]
    assert isinstance(r0, CoordinationError) and "1 of 2 processes published under 'm/0'" in str(r0)


# ---------------------------------------------------------------------- settle


def test_settle_alone_commits_when_all_went_well():
    calls = []
    out = settle(SingleProcess(), "s/0/status", {"ok": True, "n": 3}, 1,
                 finish=lambda st: calls.append(("finish", st)), abort=lambda: calls.append("abort"))
    assert out == {"ok": True}
    assert calls == [("finish", {0: {"ok": True, "n": 3}})]


def test_settle_alone_aborts_on_a_failed_status_without_finishing():
    calls = []
    status = {"ok": False, "error": error_record(MismatchError("leaf 'w': bad"), 0)}
    out = settle(SingleProcess(), "s/1/status", status, 1,
                 finish=lambda st: calls.append("finish"), abort=lambda: calls.append("abort"))
    assert calls == ["abort"]
    assert not out["ok"] and out["error"]["type"] == "MismatchError"
    assert out["message"].startswith("process 0: ") and "MismatchError: leaf 'w': bad" in out["message"]


def test_settle_aborts_when_the_commit_raises_and_says_so():
    calls = []

    def finish(_statuses):
        raise OSError(28, "No space left on device")

    out = settle(SingleProcess(), "s/2/status", {"ok": True}, 1, finish=finish, abort=lambda: calls.append("abort"))
    assert calls == ["abort"]
    assert not out["ok"] and "process 0: OSError" in out["message"] and "No space left" in out["message"]


def test_settle_forgets_the_previous_operations_keys_once_every_status_is_in():
    c = SingleProcess()
    c.publish("op/4/status/0", b"{}")
    c.publish("op/4/status/decision", b"{}")
    c.publish("op/40/status/0", b"{}")  # another operation, whose number starts alike
    settle(c, "op/5/status", {"ok": True}, 1, finish=lambda _: None, forget="op/4")
    with pytest.raises(CoordinationError):
        c.fetch("op/4/status/0", 1)
    assert c.fetch("op/40/status/0", 1) == b"{}"


def test_settle_on_two_processes_names_the_failed_one_on_both():
    aborted, finished = [], []
    bad = {"ok": False, "error": error_record(OSError("disk gone"), 1)}

    def side(status):
        return lambda c: settle(c, "two/status", status, 10, finish=lambda st: finished.append(st),
                                abort=lambda: aborted.append(c.process_index))

    r0, r1 = _on_two(side({"ok": True}), side(bad))
    assert r0 == r1 and not r0["ok"] and r0["message"].startswith("process 1: ") and "OSError: disk gone" in r0["message"]
    assert aborted == [0] and finished == []  # only the primary cleans up


def test_settle_on_two_processes_commits_once_with_every_status():
    finished = []

    def side(n):
        return lambda c: settle(c, "ok/status", {"ok": True, "files": n}, 10,
                                finish=lambda st: finished.append(st))

    r0, r1 = _on_two(side(2), side(5))
    assert r0 == r1 == {"ok": True}
    assert finished == [{0: {"ok": True, "files": 2}, 1: {"ok": True, "files": 5}}]


def test_settle_a_silent_peer_makes_the_primary_abort_and_fail():
    aborted = []
    r0, _ = _on_two(lambda c: settle(c, "dead/status", {"ok": True}, 0.3, finish=lambda _: None,
                                     abort=lambda: aborted.append(0)),
                    lambda c: None)
    assert aborted == [0]
    assert not r0["ok"] and "1 of 2 processes published under 'dead/status'" in r0["message"]


# ---------------------------------------------------------------------- Decisions


def test_decisions_alone_take_the_local_answer():
    d = Decisions(SingleProcess(), f"/run-{time.monotonic_ns()}")
    assert d.alone
    assert d.shared("steps", [1, 2]) == [1, 2]
    assert d.gather("loaded", 7) == {0: 7}
    assert d.decide("best", 3, lambda v: v[0] + 1) == 4
    assert d.failures("restore", None) == {} and d.failures("restore", "broken") == {0: "broken"}


def test_two_managers_of_one_directory_use_different_keys():
    scope = f"/run-{time.monotonic_ns()}"
    a, b = Decisions(SingleProcess(), scope), Decisions(SingleProcess(), scope)
    assert a.base != b.base and a.base.rsplit(".", 1)[0] == b.base.rsplit(".", 1)[0]


# ---------------------------------------------------------------------- preemption


def test_preemption_watch_latches_on_the_check_and_logs_once(caplog):
    seen = iter([False, True, False])
    watch = PreemptionWatch("/run", check=lambda: next(seen), handle_sigterm=False, process_count=1)
    with caplog.at_level(logging.WARNING, logger="cairn"):
        assert watch.detected(1) is False
        assert watch.detected(2) is True
        assert watch.detected(3) is True  # latched: the check is not asked again
    assert [r.getMessage() for r in caplog.records].count(
        "cairn: preemption detected; the next save of /run writes and waits") == 1
    watch.release()


def test_preemption_watch_catches_sigterm_and_release_puts_the_handler_back():
    before = signal.getsignal(signal.SIGTERM)
    got = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))  # the program's own handler still runs
    try:
        watch = PreemptionWatch("/run", check=None, handle_sigterm=True, process_count=1)
        assert watch.detected() is False
        signal.raise_signal(signal.SIGTERM)
        assert watch.detected() is True and got == [signal.SIGTERM]
        watch.release()
        assert signal.getsignal(signal.SIGTERM) is not watch._on_sigterm
        signal.raise_signal(signal.SIGTERM)  # the program's handler again, not the watch's
        assert got == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_preemption_watch_without_sigterm_handling_leaves_the_handler_alone():
    before = signal.getsignal(signal.SIGTERM)
    watch = PreemptionWatch("/run", check=None, handle_sigterm=False, process_count=1)
    assert signal.getsignal(signal.SIGTERM) == before and watch.detected(5) is False
    watch.release()
