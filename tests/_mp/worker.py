"""One process of a multi-process scenario: ``worker.py INDEX SPEC_JSON RESULT_PATH``."""

from __future__ import annotations

import json
import os
import sys
import traceback


def main() -> None:
    index, spec, result_path = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    import jax

    jax.config.update("jax_enable_x64", True)
    n = spec["n"]
    if n > 1:
        if spec.get("recoverable"):
            # A dead peer must not abort the survivors: they report it instead.
            jax.config.update("jax_enable_recoverability", True)
        addr = f"127.0.0.1:{spec['port']}"
        jax.distributed.initialize(
            coordinator_address=addr,
            coordinator_bind_address=addr,
            num_processes=n,
            process_id=index,
            initialization_timeout=60,
            heartbeat_timeout_seconds=spec.get("heartbeat_s", 10),
            shutdown_timeout_seconds=10,
        )
        assert jax.process_index() == index and jax.process_count() == n
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import importlib

    # "name" runs scenarios.name; "module:name" a scenario of another module beside it.
    module, _, name = spec["scenario"].rpartition(":")
    fn = getattr(importlib.import_module(module or "scenarios"), name)
    try:
        out = fn(**spec["args"])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # skip the shutdown barrier: the others may be gone
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, result_path)
    sys.stdout.flush()
    if n > 1 and spec.get("sync_exit") is not None:
        _sync_exit(index, spec["sync_exit"])
    if n > 1 and not spec.get("natural_exit"):
        jax.distributed.shutdown()
    # natural_exit: leave as a script that just ends does (cairn's exit hooks, then the interpreter's)


def _sync_exit(index: int, survivors: list[int]) -> None:
    """Exit once every survivor has its result, without JAX's shutdown barrier (a dead peer makes it
    abort). Process 0 hosts the coordination service: it must be the last to go, or a survivor still
    connected loses the service and JAX aborts it. `cairn.shutdown` makes it so: a survivor leaves
    the service (after which nothing it does can be aborted by process 0's exit), and process 0
    waits until every survivor has left (not merely said it would). `survivors` are the processes
    expected to get here."""
    import cairn
    from cairn._dist import coord

    if index:
        cairn.shutdown()
        os._exit(0)
    # Process 0 knows which process died only if its own save named it; the harness knows for sure.
    dead = set(range(coord.default_coordinator().process_count)) - set(survivors)  # type: ignore[attr-defined]
    coord.default_coordinator().dead |= dead  # type: ignore[attr-defined]
    cairn.shutdown(timeout=120)
    os._exit(0)

if __name__ == "__main__":
    main()
