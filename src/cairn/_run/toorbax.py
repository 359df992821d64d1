"""A whole run back to Orbax: every cairn step of a manager's directory as an Orbax step folder.

The way back after a run continued with cairn: each cairn step is
written by `export_orbax` under Orbax's step naming (``step_prefix``,
``step_format_fixed_length``), in place or into a new directory, so Orbax's
own CheckpointManager lists every step of the run in order and resumes from
the newest; no step ever has two visible folders under one name.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from .._errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError
from .._exports.orbax import _local_or_gcs, export_orbax
from .._storage import Storage, open_storage
from . import steps as _steps

log = logging.getLogger("cairn")


def orbax_step_name(step: int, step_prefix: str | None = None, step_format_fixed_length: int | None = None) -> str:
    """The folder name Orbax's CheckpointManager gives `step` with these options (``ckpt_0010``)."""
    digits = f"{step:0{step_format_fixed_length}d}" if step_format_fixed_length else str(step)
    return f"{step_prefix}_{digits}" if step_prefix else digits


def export_orbax_run(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    step_prefix: str | None = None,
    step_format_fixed_length: int | None = None,
    step_format: str | None = None,
    json_items: Iterable[str] | None = None,
    mesh: Any = None,
    per_process: str = "keys",
) -> list[str]:
    """Turn every cairn step of the run in `directory` into an Orbax step, in place or into `out`.

    The way back to Orbax after a run continued with cairn: afterwards an
    Orbax ``CheckpointManager`` with the same `step_prefix` and
    `step_format_fixed_length` lists every step of the run, in order, Orbax's
    own and the exported ones, and resumes from the newest. Each cairn step
    (as a `CheckpointManager` with `step_format` names them; default: as a
    manager given none names them, cairn's default or the run's Orbax naming)
    is written by `export_orbax` (JSON items stay JSON, metrics and
    shardings are kept; `json_items`, `mesh` and `per_process` as there).
    The naming defaults to the one of the run's Orbax steps, else Orbax's
    default (``10``).

    In place (`out` None; a local directory), each step is exported into a
    hidden folder, then takes the place of the cairn folder: under the same
    name in one atomic swap; under another name the Orbax folder appears
    before the cairn one is deleted, so a crash in between leaves both, which
    a `CheckpointManager` refuses to guess between (it names both; delete
    the cairn one). With `out` (a new directory, local or ``gs://``) the
    steps are written there, Orbax's own steps copied, and `directory` is
    left as it is. Returns the Orbax step folders written, oldest first. One
    process only (each step's export may still use `mesh`).

    Example:

        cairn.export_orbax_run("/ckpt/run", step_prefix="ckpt")   # step_00000300 -> ckpt_300
        with ocp.CheckpointManager("/ckpt/run", options=ocp.CheckpointManagerOptions(step_prefix="ckpt")) as m:
            assert m.latest_step() == 300
    """
    import jax

    if jax.process_count() > 1:
        raise CheckpointError(f"{directory}: export_orbax_run runs on one process; export each step with "
                              "export_orbax(..., mesh=) on every process instead")
    root, storage = _steps.open_directory(directory)
    if out is None and storage.dirs is None:
        raise CheckpointError(f"{root}: an export in place needs a local directory (it swaps folders); pass out=")
    got = _steps.survey(storage, _steps.StepNames(step_format) if step_format else _steps.StepNames(follow_orbax=True))
    if not got.steps:
        raise CheckpointNotFoundError(f"{root} holds no committed step to export"
                                      + (f" (folders that look like steps: {got.strays[0].show()})" if got.strays else ""))
    if got.strays:
        log.warning("cairn: %s: folders that look like steps are left as they are: %s", root,
                    "; ".join(x.show() for x in got.strays[:5]))
    prefix, width = _orbax_naming(got, step_prefix, step_format_fixed_length)
    dest_root, dest = root, storage
    if out is not None:
        dest_root = _local_or_gcs(os.fspath(out)).rstrip("/")
        dest = open_storage(dest_root)
        if dest.list_dir(""):
            raise CheckpointExistsError(f"{dest_root} is not empty; export_orbax_run writes a new run there")
    written = []
    for step, folder in got.steps.items():
        name = orbax_step_name(step, prefix, width)
        if step in got.orbax:
            if out is not None:
                for key in storage.list(folder):  # Orbax's own step: copied as it is
                    dest.write(name + key[len(folder):], _chunks(storage, key))
                written.append(f"{dest_root}/{name}")
            elif folder != name:
                log.warning("cairn: %s: Orbax step %d is named %s, not %s; left as it is", root, step, folder, name)
            continue
        kw: dict[str, Any] = {"step_folder": True, "json_items": json_items, "mesh": mesh, "per_process": per_process}
        if out is not None:
            written.append(export_orbax(f"{root}/{folder}", f"{dest_root}/{name}", **kw))
            continue
        if name != folder and storage.list_dir(name):
            raise CheckpointExistsError(f"{root}/{name}: the Orbax name of step {step} is taken by another folder")
        dirs = storage.dirs
        assert dirs is not None  # checked above: an export in place swaps folders
        staged = f".{name}.cairn-export"
        storage.delete_prefix(staged)  # an export a crash interrupted: never visible, remade
        export_orbax(f"{root}/{folder}", f"{root}/{staged}", **kw)
        if name == folder:  # one atomic swap: the step's folder is cairn's or Orbax's, never missing
            dirs.rename_dir(staged, name, exchange=True)
            storage.delete_prefix(staged)
        else:  # Orbax's appears first: a crash in between leaves both, which a manager names
            dirs.rename_dir(staged, name)
            _steps.delete_step(storage, step, folder)
        log.info("cairn: %s: step %d is now the Orbax step folder %s", root, step, name)
        written.append(f"{root}/{name}")
    return written


def _chunks(storage: Storage, key: str, size: int = 64 << 20) -> Any:
    """The bytes of `key`, `size` at a time (a copy never holds a whole file)."""
    total = storage.size(key)
    reader = storage.open_read(key)
    try:
        for offset in range(0, total, size):
            buf = bytearray(min(size, total - offset))
            reader.read_into(offset, memoryview(buf))
            yield buf
    finally:
        reader.close()


def _orbax_naming(got: Any, prefix: str | None, width: int | None) -> tuple[str | None, int | None]:
    """The step_prefix and fixed length to name exported steps with: as asked, else as the run's Orbax steps."""
    if prefix is not None or width is not None or not got.orbax:
        return prefix, width
    names = [got.steps[s] for s in sorted(got.orbax)]
    prefix = _steps.orbax_name(names[0])[0] or None  # type: ignore[index]
    digits = [n.rsplit("_", 1)[-1] for n in names]
    padded = [d for d in digits if len(d) > 1 and d.startswith("0")]
    return prefix, len(padded[0]) if padded else None



__all__ = ["export_orbax_run"]
