"""The options of one load, carried as one frozen value.

`cairn.load`, `cairn.plan_load`, `CheckpointManager.restore` and the engine
take the same keywords; inside, they travel as one `LoadOptions`, so that a
new option is declared, checked and documented in one place. The numbers
are checked when the options are made, before any metadata is read (the
format name and the bandwidth figures where they are used: `_sources.registry`,
`_plan.routes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .casts import check_cast_option


@dataclass(frozen=True)
class LoadOptions:
    """What a load may be asked (see `cairn.load` for each option's meaning)."""

    partial: bool = False  # the checkpoint may hold leaves the target omits
    verify: bool = True  # check every block's CRC-32C
    threads: int = 8  # reader threads per process
    read_once: bool | None = None  # None: the cheaper route per leaf; True/False force one
    budget_bytes: int = 1 << 30  # host buffers in flight per process
    bandwidths: Mapping[str, float] | None = None  # declared GB/s figures pricing the routes
    coordinator: Any = None  # a `Coordinator`; None: JAX's, or a single process
    timeout: float = 1800.0  # each wait for the other processes, seconds
    format: str | None = None  # the source format; None: detected
    rename: Any = None  # source key path -> target key path (a function or regex pairs)
    drop: Any = None  # regexes of source key paths left out
    fill_missing: Any = False  # target leaves the checkpoint lacks keep their value (True or regexes)
    mesh: Any = None  # a jax Mesh: arrays the target gives no sharding take their saved PartitionSpec on it
    cast: str = "safe"  # "unsafe": casts that change values (float -> int, wrapping, overflow) are allowed

    def __post_init__(self) -> None:
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be a positive integer, got {self.threads!r}")
        if isinstance(self.budget_bytes, bool) or not isinstance(self.budget_bytes, int) or self.budget_bytes < 1:
            raise ValueError(f"budget_bytes must be a positive integer, got {self.budget_bytes!r}")
        if self.read_once not in (None, True, False):
            raise ValueError(f"read_once must be None, True or False, got {self.read_once!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive (seconds), got {self.timeout!r}")
        check_cast_option(self.cast)
        if self.mesh is not None and not (hasattr(self.mesh, "axis_names") and hasattr(self.mesh, "devices")):
            raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")

    def replace(self, **changes: Any) -> LoadOptions:
        """These options with `changes` (keyword names as in `cairn.load`); unknown names are a TypeError."""
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def transforms(self) -> dict[str, Any]:
        """The restore transforms, as `_sources.registry.open_source` takes them."""
        return {"rename": self.rename, "drop": self.drop, "fill_missing": self.fill_missing}


def options_of(options: LoadOptions | None, changes: dict[str, Any]) -> LoadOptions:
    """`options` (default: the defaults) with keyword `changes` applied."""
    return (options or _DEFAULT).replace(**changes)


_DEFAULT = LoadOptions()
