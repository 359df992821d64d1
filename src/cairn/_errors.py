"""The error hierarchy. Every cairn error derives from `CheckpointError`.

Leaf errors also derive from the builtin a caller would naturally catch, so
``except FileNotFoundError`` keeps working for code that does not know cairn.
"""

from __future__ import annotations


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


class CoordinationError(CheckpointError, RuntimeError):
    """Another process failed, or processes disagreed, during a collective step."""


class CoordinationTimeoutError(CoordinationError, TimeoutError):
    """Some processes did not reach a barrier in time."""
