"""Measurement helpers: page cache, peak RSS per operation, sizes on disk, a run's JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_DROP = "/proc/sys/vm/drop_caches"


def write_rows(path: str | None, info: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Note the load average after the run in `info`, and write ``{"info": info, "rows": rows}`` to `path`
    as JSON (nothing written where `path` is None)."""
    info["load_after"] = os.getloadavg()
    if path:
        with open(path, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache; False when not allowed."""
    os.sync()
    try:
        with open(_DROP, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def settle() -> None:
    """Collect garbage and hand freed heap memory back to the OS before a measurement.

    Without the trim, memory freed while building the state stays resident
    (glibc keeps it) and would hide part of the next operation's peak.
    """
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def can_drop_caches() -> bool:
    return os.access(_DROP, os.W_OK)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def rss() -> int:
    return _status("VmRSS")


def _reset_hwm() -> bool:
    # Linux >= 4.0: writing 5 resets the peak RSS (VmHWM) to the current RSS.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


class PeakRSS:
    """Peak resident memory of this process during a `with` block.

    Uses the kernel's high-water mark (reset at entry, read at exit), so short
    spikes are counted; where the mark cannot be reset it falls back to
    sampling every 2 ms.
    """

    def __init__(self) -> None:
        self.base = 0
        self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        self.base = rss()
        if _reset_hwm():
            self.method = "VmHWM"
        else:
            self.method = "sampled"
            self.peak = self.base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss())
        else:
            self.peak = _status("VmHWM")


@dataclass
class Op:
    seconds: float
    peak_rss: int
    base_rss: int
    extra: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "peak_rss": self.peak_rss, "base_rss": self.base_rss, **self.extra}


def timed(fn: Callable[[], Any]) -> tuple[float, Any, PeakRSS]:
    with PeakRSS() as p:
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
    return dt, out, p


def dir_stats(path: str) -> tuple[int, int]:
    """(bytes, files) under `path`."""
    total = files = 0
    for dirpath, _dirs, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
                files += 1
            except FileNotFoundError:
                pass
    return total, files


class Worker:
    """A warm child process, ``python SCRIPT --worker``, with `path` first on its PYTHONPATH (a tree's
    sources, so that trees can be compared process by process) and `env` over this process's
    environment. A call sends one job as a JSON line and returns the answer's ``ok``; the worker answers
    ``{"error": ..., "tb": ...}`` for a job that failed, raised here with its traceback."""

    def __init__(self, name: str, script: str, path: list[str], env: dict[str, str] | None = None,
                 stop_timeout: float = 60) -> None:
        pythonpath = os.pathsep.join(p for p in (*path, os.environ.get("PYTHONPATH")) if p)
        self.name, self._stop_timeout = name, stop_timeout
        self.proc = subprocess.Popen([sys.executable, script, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": pythonpath, **(env or {})})

    def __call__(self, **job: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited")
        r = json.loads(line)
        if "error" in r:
            raise RuntimeError(f"worker {self.name}: {r['error']}\n{r['tb']}")
        return r["ok"]

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=self._stop_timeout)


def serve(handle: Callable[[dict[str, Any]], Any]) -> int:
    """A `Worker`'s side: ``handle(job)`` for each JSON line on stdin, its result answered as ``{"ok": ...}``
    on stdout, or ``{"error": ..., "tb": ...}`` where it raised (the driver raises it and stops)."""
    import traceback

    for line in sys.stdin:
        try:
            print(json.dumps({"ok": handle(json.loads(line))}), flush=True)
        except Exception as e:
            print(json.dumps({"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}), flush=True)
    return 0


def setting(s: str) -> Any:
    """A `compression=` value from the command line: "false" / "true" as booleans, else the string."""
    return {"false": False, "true": True}.get(s.lower(), s)
