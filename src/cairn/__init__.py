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
from ._api import user_metadata as user_metadata
from ._core.buffers import release_snapshot_buffers as release_snapshot_buffers
from ._core.stats import LoadStats as LoadStats
from ._core.stats import ProgressStats as ProgressStats
from ._core.stats import SaveStats as SaveStats
from ._core.stats import StatsEvent as StatsEvent
from ._core.stats import add_listener as add_listener
from ._core.stats import remove_listener as remove_listener
from ._dist.coord import Coordinator as Coordinator
from ._dist.coord import shutdown as shutdown
from ._errors import CheckpointError as CheckpointError
from ._errors import CheckpointExistsError as CheckpointExistsError
from ._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._errors import CoordinationError as CoordinationError
from ._errors import CoordinationTimeoutError as CoordinationTimeoutError
from ._errors import CorruptCheckpointError as CorruptCheckpointError
from ._errors import MismatchError as MismatchError
from ._errors import UnsupportedTypeError as UnsupportedTypeError
from ._exports.copy import copy as copy
from ._exports.export import export_safetensors as export_safetensors
from ._exports.orbax import export_orbax as export_orbax
from ._load.engine import ArrayMetadata as ArrayMetadata
from ._local.tier import LocalTier as LocalTier
from ._manager.manager import CheckpointManager as CheckpointManager
from ._manager.pacing import ManagerStats as ManagerStats
from ._run.retention import CheckpointInfo as CheckpointInfo
from ._run.retention import KeepAll as KeepAll
from ._run.retention import KeepAny as KeepAny
from ._run.retention import KeepBest as KeepBest
from ._run.retention import KeepEvery as KeepEvery
from ._run.retention import KeepIf as KeepIf
from ._run.retention import KeepLatest as KeepLatest
from ._run.retention import KeepNewerThan as KeepNewerThan
from ._run.retention import KeepOnePer as KeepOnePer
from ._run.retention import RetentionPolicy as RetentionPolicy
from ._run.toorbax import export_orbax_run as export_orbax_run
from ._save.future import SaveFuture as SaveFuture
from ._save.future import wait_all as wait_all
from ._sources.dryrun import LoadPlan as LoadPlan
from ._sources.dryrun import plan_load as plan_load
from ._sources.transforms import RestoreReport as RestoreReport
from ._tree.leaves import register_type as register_type
from ._tree.perprocess import PerProcess as PerProcess
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
    "ManagerStats",
    "MismatchError",
    "PerProcess",
    "ProgressStats",
    "RestoreReport",
    "RetentionPolicy",
    "SaveFuture",
    "SaveStats",
    "StatsEvent",
    "UnsupportedTypeError",
    "__version__",
    "add_listener",
    "copy",
    "export_orbax",
    "export_orbax_run",
    "export_safetensors",
    "load",
    "metadata",
    "plan_load",
    "register_type",
    "release_snapshot_buffers",
    "remove_listener",
    "save",
    "save_async",
    "shutdown",
    "user_metadata",
    "wait_all",
]
