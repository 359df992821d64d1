"""cairn: JAX-native distributed checkpointing.

    import cairn
    cairn.save("/ckpt/step_1", {"params": params, "opt": opt_state})
    state = cairn.load("/ckpt/step_1", {"params": abstract_params})

The public API is exactly the names re-exported here.
"""

from ._api import load as load
from ._api import metadata as metadata
from ._api import save as save
from ._api import save_async as save_async
from ._async import SaveFuture as SaveFuture
from ._async import wait_all as wait_all
from ._buffers import release_snapshot_buffers as release_snapshot_buffers
from ._coord import Coordinator as Coordinator
from ._copy import copy as copy
from ._dryrun import LoadPlan as LoadPlan
from ._dryrun import plan_load as plan_load
from ._errors import CheckpointError as CheckpointError
from ._errors import CheckpointExistsError as CheckpointExistsError
from ._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._errors import CoordinationError as CoordinationError
from ._errors import CoordinationTimeoutError as CoordinationTimeoutError
from ._errors import CorruptCheckpointError as CorruptCheckpointError
from ._errors import MismatchError as MismatchError
from ._errors import UnsupportedTypeError as UnsupportedTypeError
from ._export import export_safetensors as export_safetensors
from ._leaves import register_type as register_type
from ._load import ArrayMetadata as ArrayMetadata
from ._localtier import LocalTier as LocalTier
from ._manager import CheckpointManager as CheckpointManager
from ._perprocess import PerProcess as PerProcess
from ._retention import CheckpointInfo as CheckpointInfo
from ._retention import KeepAll as KeepAll
from ._retention import KeepAny as KeepAny
from ._retention import KeepBest as KeepBest
from ._retention import KeepEvery as KeepEvery
from ._retention import KeepIf as KeepIf
from ._retention import KeepLatest as KeepLatest
from ._retention import KeepNewerThan as KeepNewerThan
from ._retention import KeepOnePer as KeepOnePer
from ._retention import RetentionPolicy as RetentionPolicy
from ._stats import LoadStats as LoadStats
from ._stats import SaveStats as SaveStats
from ._stats import StatsEvent as StatsEvent
from ._stats import add_listener as add_listener
from ._stats import remove_listener as remove_listener
from ._transforms import RestoreReport as RestoreReport
from ._version import __version__ as __version__

__all__ = [
    "ArrayMetadata",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CoordinationError",
    "CoordinationTimeoutError",
    "Coordinator",
    "CorruptCheckpointError",
    "KeepAll",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepIf",
    "KeepLatest",
    "KeepNewerThan",
    "KeepOnePer",
    "LoadPlan",
    "LoadStats",
    "LocalTier",
    "MismatchError",
    "PerProcess",
    "RestoreReport",
    "RetentionPolicy",
    "SaveFuture",
    "SaveStats",
    "StatsEvent",
    "UnsupportedTypeError",
    "__version__",
    "add_listener",
    "copy",
    "export_safetensors",
    "load",
    "metadata",
    "plan_load",
    "register_type",
    "release_snapshot_buffers",
    "remove_listener",
    "save",
    "save_async",
    "wait_all",
]
