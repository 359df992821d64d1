"""The options of one save, carried as one frozen value: `LoadOptions`' twin.

`cairn.save`, `cairn.save_async`, `CheckpointManager` and `cairn.copy` (when it
recompresses) take the same keywords; inside, they travel as one
`SaveOptions`, so that a new option is declared, checked and documented in
one place. The options are checked when they are made, before the path is
resolved or anything is written; what depends on the state or the
destination (the metadata's JSON, the block size, whether the checkpoint
exists) is checked by the engine, which knows the path to name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: The values of `compression` (see `cairn.save`; `codecpolicy.resolve_compression` says what each means).
COMPRESSIONS: tuple[str | bool | None, ...] = ("auto", True, "fast", False, None, "none", "zstd", "planes",
                                                "blosc2", "blosc2-lz4")
#: The modes that choose a codec per leaf (`codecpolicy.resolve_compression`): "fast" is "choose" with the
#: C-Blosc2 codecs among the candidates, which every reader then needs (the `fast` extra).
CHOOSING = ("choose", "auto", "fast")


def bad_compression(value: Any) -> ValueError:
    """The error for a `compression` that is none of `COMPRESSIONS`, naming them all."""
    names = [repr(c) for c in COMPRESSIONS if c is not None]
    return ValueError(f"compression must be {', '.join(names[:-1])} or {names[-1]}, not {value!r}")


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


@dataclass(frozen=True)
class SaveOptions:
    """What a save may be asked (see `cairn.save` and `cairn.save_async` for each option's meaning)."""

    overwrite: bool = False  # replace a checkpoint committed at the path
    coordinator: Any = None  # a `Coordinator`; None: JAX's, or a single process
    threads: int = 4  # writer threads (and at most as many data files) per process
    split_replicas: bool = False  # replicated arrays: each replica writes a share, not the first one all
    timeout: float = 1800.0  # each wait for the other processes, seconds
    snapshot_budget_bytes: int | None = None  # save_async: host bytes of the snapshot; None: no limit
    compression: str | bool | None = "auto"  # "auto", True, "fast", False/None/"none", or a codec (`COMPRESSIONS`)

    def __post_init__(self) -> None:
        for name in ("overwrite", "split_replicas"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not _positive_int(self.threads):
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"timeout must be positive (seconds), got {self.timeout!r}")
        budget = self.snapshot_budget_bytes
        if budget is not None and not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0):
            raise ValueError(f"snapshot_budget_bytes must be None or a non-negative integer, got {budget!r}")
        if not any(self.compression is c or (isinstance(c, str) and self.compression == c) for c in COMPRESSIONS):
            raise bad_compression(self.compression)

    def replace(self, **changes: Any) -> SaveOptions:
        """These options with `changes` (keyword names as in `cairn.save_async`); unknown names are a TypeError."""
        return dataclasses.replace(self, **changes) if changes else self


def save_options_of(options: SaveOptions | None, changes: dict[str, Any]) -> SaveOptions:
    """`options` (default: the defaults) with keyword `changes` applied."""
    return (options or _DEFAULT).replace(**changes)


_DEFAULT = SaveOptions()
