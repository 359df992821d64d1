"""Coordination between processes: index, count, barriers and small messages.

This is the only module that touches ``jax.distributed``. Everything here is
safe to call from background threads: it uses the coordination service's
key-value store and barriers (never device collectives), always with a
timeout. A timeout names the processes that did not arrive.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

from ._errors import CoordinationError, CoordinationTimeoutError


@runtime_checkable
class Coordinator(Protocol):
    process_index: int
    process_count: int

    def barrier(self, name: str, timeout: float) -> None:
        """Wait until every process reaches the barrier `name` (each name used once)."""

    def publish(self, key: str, value: bytes) -> None:
        """Make `value` readable by every process under `key` (each key written once)."""

    def fetch(self, key: str, timeout: float) -> bytes:
        """Wait for and return the value published under `key`."""

    def fetch_all(self, prefix: str, count: int, timeout: float) -> dict[str, bytes]:
        """Wait until `count` keys exist under ``prefix/`` and return them."""


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

    def fetch(self, key: str, timeout: float) -> bytes:
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
        with self._lock:
            for k in [k for k in self._kv if k.startswith(prefix)]:
                del self._kv[k]


class JaxCoordinator:
    """Coordination over the JAX distributed runtime's coordination service."""

    def __init__(self, client: object, process_index: int, process_count: int):
        self._client = client
        self.process_index = process_index
        self.process_count = process_count

    def barrier(self, name: str, timeout: float) -> None:
        # Publish arrival first, so that a timeout can say who is missing.
        self.publish(f"{name}/arrived/{self.process_index}", b"1")
        try:
            self._client.wait_at_barrier(name, int(timeout * 1000))  # type: ignore[attr-defined]
        except Exception as e:
            if not _is_timeout(e):
                raise CoordinationError(f"barrier {name!r} failed on process {self.process_index}: {e}") from e
            arrived = self._list(f"{name}/arrived")
            missing = sorted(set(range(self.process_count)) - {int(k.rsplit("/", 1)[1]) for k in arrived})
            raise CoordinationTimeoutError(
                f"barrier {name!r}: processes {missing} did not arrive within {timeout:g}s "
                f"(process {self.process_index} waited)"
            ) from None

    def publish(self, key: str, value: bytes) -> None:
        self._client.key_value_set_bytes(key, value)  # type: ignore[attr-defined]

    def fetch(self, key: str, timeout: float) -> bytes:
        try:
            return self._client.blocking_key_value_get_bytes(key, int(timeout * 1000))  # type: ignore[attr-defined]
        except Exception as e:
            if _is_timeout(e):
                raise CoordinationTimeoutError(f"no value under {key!r} within {timeout:g}s") from None
            raise CoordinationError(f"fetching {key!r} failed: {e}") from e

    def fetch_all(self, prefix: str, count: int, timeout: float) -> dict[str, bytes]:
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            got = self._dir(prefix)
            if len(got) >= count:
                return got
            if time.monotonic() > deadline:
                have = sorted(k.rsplit("/", 1)[1] for k in got)
                raise CoordinationTimeoutError(
                    f"only {len(got)} of {count} processes published under {prefix!r} within {timeout:g}s "
                    f"(present: {have})"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _dir(self, prefix: str) -> dict[str, bytes]:
        items = self._client.key_value_dir_get_bytes(prefix)  # type: ignore[attr-defined]
        return {k: v for k, v in items}

    def _list(self, prefix: str) -> list[str]:
        try:
            return list(self._dir(prefix))
        except Exception:
            return []


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
                    _default = JaxCoordinator(state.client, state.process_id, state.num_processes)
                return _default
        except ImportError:
            pass
    if not isinstance(_default, SingleProcess):
        _default = SingleProcess()
    return _default
