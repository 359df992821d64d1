"""The error hierarchy. Every cairn error derives from `CheckpointError`.

Leaf errors also derive from the builtin a caller would naturally catch, so
``except FileNotFoundError`` keeps working for code that does not know cairn.
"""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Root of every error cairn raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint at the path (absent, or present but uncommitted)."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint already exists where a save was asked to write."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """The checkpoint's bytes are not what its manifest promises.

    Raised for checksum mismatches, truncated files, malformed or out-of-range
    metadata and unknown format versions.
    """


class MismatchError(CheckpointError, ValueError):
    """The load target does not fit the checkpoint (tree, shape or dtype)."""


class UnsupportedTypeError(CheckpointError, TypeError):
    """A leaf of the state cannot be saved (no handler for its type)."""


class CodecUnavailableError(CheckpointError, ImportError):
    """A block's codec needs a library that is not installed (python-blosc2: the ``fast`` extra).

    Not damage: the checkpoint may be intact, it cannot be decoded here (``cairn verify`` exits 3).
    """


class CoordinationError(CheckpointError, RuntimeError):
    """Another process failed, or processes disagreed, during a collective step."""


class CoordinationTimeoutError(CoordinationError, TimeoutError):
    """Some processes did not reach a barrier in time."""


# ---------------------------------------------------------------------- across processes

_CLASSES: dict[str, type[CheckpointError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointError, CheckpointNotFoundError, CheckpointExistsError, CorruptCheckpointError,
        MismatchError, UnsupportedTypeError, CoordinationError, CoordinationTimeoutError, CodecUnavailableError,
    )
}


def corrupt(where: object, message: str) -> CorruptCheckpointError:
    """The error for a malformed or damaged part of a checkpoint: `where` (a path, a file and a key
    path, or an index position) first, then what was wrong. Callers raise it."""
    return CorruptCheckpointError(f"{where}: {message}")


def describe(e: BaseException) -> str:
    """``"Type: message (at file.py:123)"``: an error and where it was raised, in one line."""
    import os
    import traceback

    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return text + where


def error_record(e: BaseException, process: int | None = None) -> dict[str, Any]:
    """A JSON-serializable record of `e`, sent to the other processes through the coordinator."""
    return {"type": type(e).__name__, "message": describe(e), "process": process}


def error_from_record(record: dict[str, Any], message: str) -> CheckpointError:
    """The error to raise for `record` received from another process, with `message`.

    cairn's own error classes travel as themselves; anything else (an
    `OSError` on another host, say) arrives as a `CheckpointError`.
    """
    return _CLASSES.get(str(record.get("type")), CheckpointError)(message)


def first_failure(statuses: dict[int, dict[str, Any]]) -> tuple[dict[str, Any], str] | None:
    """For per-process statuses ``{"ok": bool, "error": record}``: the first failed process's
    record and every failure's message (``"process 1: ...; process 3: ..."``), or None."""
    failed = sorted(p for p, s in statuses.items() if not s["ok"])
    if not failed:
        return None
    return statuses[failed[0]]["error"], "; ".join(f"process {p}: {statuses[p]['error']['message']}" for p in failed)
