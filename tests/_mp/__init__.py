"""A harness that runs a scenario in N real JAX processes on 127.0.0.1.

Each process is a fresh interpreter that joins one ``jax.distributed``
cluster (coordinator bound to loopback on a free port), gets its own virtual
CPU devices, runs a scenario function from `tests._mp.scenarios` and writes
its JSON result to a file. `run` returns the results in process order, or
fails with every process's output when any of them fails or a deadline
passes. Nothing here is part of cairn.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_WORKER = os.path.join(os.path.dirname(__file__), "worker.py")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    index: int
    popen: subprocess.Popen[bytes]
    log: str
    result: str

    def output(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return "<no output>"


class MultiProcessError(AssertionError):
    """A scenario failed: the message holds every process's exit status and output."""


def _report(procs: list[Proc], why: str) -> str:
    parts = [why]
    for p in procs:
        parts.append(f"----- process {p.index} (exit {p.popen.returncode}) -----\n{p.output()[-6000:]}")
    return "\n".join(parts)


def start(
    n: int,
    scenario: str,
    args: dict[str, Any] | None = None,
    *,
    devices_per_process: int = 2,
    recoverable: bool = False,
    heartbeat_s: int = 10,
    workdir: str | None = None,
    sync_exit: list[int] | None = None,
    natural_exit: bool = False,
) -> list[Proc]:
    """Start `n` processes running `scenario` (a function name in scenarios.py).

    `sync_exit`: the processes expected to finish (the others die on purpose); they exit once all
    of them have their result, skipping JAX's shutdown (which a dead peer makes abort).
    `natural_exit`: no shutdown call at all: each process ends as a script that returns does."""
    workdir = workdir or tempfile.mkdtemp(prefix="cairn-mp-")
    port = free_port()
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"])
    env["PYTHONPATH"] = os.pathsep.join([_REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # One BLAS/Eigen thread per process: the machine's cores are shared.
    env.setdefault("OMP_NUM_THREADS", "1")
    spec = {
        "n": n, "port": port, "scenario": scenario, "args": args or {},
        "recoverable": recoverable, "heartbeat_s": heartbeat_s, "sync_exit": sync_exit,
        "natural_exit": natural_exit,
    }
    procs = []
    for i in range(n):
        log = os.path.join(workdir, f"p{i}.log")
        result = os.path.join(workdir, f"p{i}.json")
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [sys.executable, _WORKER, str(i), json.dumps(spec), result],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True,
            )
        procs.append(Proc(i, popen, log, result))
    return procs


def kill(procs: list[Proc]) -> None:
    for p in procs:
        if p.popen.poll() is None:
            try:
                os.killpg(p.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass


def wait(procs: list[Proc], timeout: float, expect_exit: Callable[[int], bool] | None = None) -> list[Any]:
    """Wait for every process; return their results, or raise with every output.

    `expect_exit(i)` says whether process `i` must exit 0 and return a
    result (default: all must); the others may die, and their result is None.
    """
    deadline = time.monotonic() + timeout
    must = expect_exit or (lambda i: True)
    try:
        for p in procs:
            left = deadline - time.monotonic()
            try:
                p.popen.wait(max(left, 0.01))
            except subprocess.TimeoutExpired:
                stuck = [q.index for q in procs if q.popen.poll() is None]
                raise MultiProcessError(_report(procs, f"processes {stuck} still running after {timeout:g}s")) from None
            if must(p.index) and p.popen.returncode != 0:
                # A failed process makes the others wait for it: do not wait for them.
                time.sleep(0.5)
                raise MultiProcessError(_report(procs, f"process {p.index} exited with {p.popen.returncode}"))
        results = []
        for p in procs:
            if not must(p.index):
                results.append(None)
                continue
            try:
                with open(p.result) as f:
                    results.append(json.load(f))
            except (OSError, ValueError) as e:
                raise MultiProcessError(_report(procs, f"process {p.index} wrote no result ({e})")) from None
        return results
    finally:
        kill(procs)


def run(n: int, scenario: str, args: dict[str, Any] | None = None, *, timeout: float = 120, **kw: Any) -> list[Any]:
    """Run `scenario` on `n` processes and return each process's result (a JSON value)."""
    return wait(start(n, scenario, args, **kw), timeout)
