"""Noticing a preemption, at the same step on every process (for `CheckpointManager`).

Three sources, latched once any fires: SIGTERM (a handler installed from the
main thread, chaining to the one before it), a user `check`, and with several
processes under ``jax.distributed`` JAX's preemption service, which catches
SIGTERM itself and makes every process see the preemption at one common step
(`cairn._dist.coord.preemption_sync_manager`).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from .coord import preemption_sync_manager

log = logging.getLogger("cairn")


class PreemptionWatch:
    """Latches once a preemption is noticed; `detected(step)` asks every source.

    Example:

        watch = PreemptionWatch("/ckpt/run1", check=None, handle_sigterm=True, process_count=1)
        if watch.detected(step):
            ...   # save now, then stop
        watch.release()   # restores the SIGTERM handler it replaced
    """

    def __init__(self, where: str, check: Callable[[], bool] | None, handle_sigterm: bool, process_count: int):
        self.where = where
        self._check = check
        self._event = threading.Event()
        self._told = False
        self._prev_handler: Any = None
        self._installed = False
        # Several processes must agree on the step at which they save for a
        # preemption, or the save waits forever for the ones that did not see it.
        # JAX's preemption service does exactly that (it catches SIGTERM itself
        # and picks a common step), so use it when it runs.
        self._sync = preemption_sync_manager() if process_count > 1 else None
        if handle_sigterm and self._sync is None and threading.current_thread() is threading.main_thread():
            self._prev_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._event.set()
        prev = self._prev_handler
        if callable(prev) and prev not in (signal.SIG_DFL, signal.SIG_IGN):
            prev(signum, frame)

    def detected(self, step: int | None = None) -> bool:
        """Whether a preemption was noticed (at `step`, for JAX's service); logged once."""
        # reached_sync_point is true on every process at the same step, once any process was told.
        if not self._event.is_set() and self._sync is not None and step is not None \
                and self._sync.reached_sync_point(step):
            self._event.set()
        if not self._event.is_set() and self._check is not None and self._check():
            self._event.set()
        if self._event.is_set() and not self._told:
            self._told = True
            log.warning("cairn: preemption detected; the next save of %s writes and waits", self.where)
        return self._event.is_set()

    def release(self) -> None:
        """Put back the SIGTERM handler this watch replaced (if it is still ours)."""
        if self._installed and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._prev_handler)
            self._installed = False
