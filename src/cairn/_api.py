"""The public functions on paths: save, save_async, load, metadata, user_metadata.

A thin facade: each resolves the user's path into a `Location` and calls the
engine on it (`_async` for saves, `_load` for loads), as `CheckpointManager`
does on its own storage. `SaveFuture` and `wait_all` are `_async`'s own.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ._core.renamed import renamed_keyword
from ._core.stats import LoadStats, SaveStats
from ._dist.coord import Coordinator
from ._load import engine as _load
from ._load.options import LoadOptions
from ._run import steps as _steps
from ._save import future as _async
from ._save.future import SaveFuture
from ._save.options import SaveOptions
from ._sources import registry as _sources
from ._sources.registry import Rename
from ._sources.transforms import Patterns, RestoreReport
from ._storage.location import resolve

PathLike = str | os.PathLike[str]


def save(
    path: PathLike,
    state: Any,
    *,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    coordinator: Coordinator | None = None,
    threads: int = 4,
    split_replicas: bool = False,
    timeout: float = 1800.0,
    compression: str | bool = "auto",
    base: PathLike | None = None,
    user_metadata: dict[str, Any] | None = None,
) -> SaveStats:
    """Save `state` at `path` and return once it is committed.

    `state` is any pytree of ``jax.Array`` (typed PRNG keys too), numpy arrays, scalars, strings,
    bytes and ``None``. When it is a mapping with string keys, each key is a
    checkpointable stored (and loadable) on its own. Every process of a
    multi-process program calls `save` with its part of the same global state;
    each writes only the shards it owns.

    Example:

        cairn.save("/ckpt/step_100", {"params": params, "opt": opt_state, "step": 100})

    Raises `CheckpointExistsError` if `path` already holds a checkpoint (unless
    `overwrite`; even then `CheckpointError`, before anything is written, if
    incremental saves beside it name it as their `base`), `UnsupportedTypeError`
    for a leaf cairn cannot store, and
    `CheckpointError` (without saving) if an earlier async save failed and its
    error was never collected from its future.

    The `SaveStats` returned (for `save_async`, once committed) are also logged
    (INFO, logger ``cairn``), recorded as ``jax.monitoring`` events
    (``/cairn/save/...``) and passed to the listeners of `cairn.add_listener`.

    `compression` stores each checksum block compressed (format version 3):
    ``"auto"`` (the default) compresses a leaf where that is predicted to
    make a save and a load faster: the codecs' speed on this host's cores
    against the bytes saved at the storage's bandwidth (object stores and
    network filesystems, not local disks; docs/compression.md); ``True``
    chooses a codec per leaf by measuring a sample of it (runs of up to 64
    neighbouring leaves of one dtype whose chunks are at most 1 MiB, of one
    size class, share one measurement). Both pick only ``"zstd"`` and
    ``"planes"``, which every install reads. ``"fast"`` chooses as ``True``
    with the C-Blosc2 codecs among the candidates (``"blosc2"`` where it
    codes the leaf faster on this host's cores, ``"blosc2-lz4"`` where it is
    predicted to save and load the leaf sooner); it needs python-blosc2
    (``pip install 'cairn-ckpt[fast]'``), and so does every load of what it
    writes. ``"zstd"``, ``"planes"``, ``"blosc2"`` or ``"blosc2-lz4"`` use
    that codec for every array (the last two: readers need the ``fast``
    extra); ``False`` or ``"none"`` store raw bytes (format version 2).
    Loads need no option.

    `base` (an earlier committed checkpoint in the same folder or prefix as
    `path`) makes the save incremental (format version 4): each checksum block
    whose hash equals `base`'s block at the same position is not written but
    referred to (docs/incremental.md). Load it like any checkpoint; keep `base`
    while it is referred to (a `CheckpointManager` with ``incremental=True``
    does). A base saved without hashes (no `base` of its own, or format < 4)
    gives a save that writes every block, with hashes, for the next one.

        cairn.save("/ckpt/step_101", state, base="/ckpt/step_100")

    `user_metadata` (a JSON-able dict: data position, config, git hash) is stored in the manifest and
    read back with `cairn.user_metadata`. (``metadata=`` is its old spelling: deprecated, it goes in
    the next release; `cairn.metadata` is the arrays' metadata.)

        cairn.save("/ckpt/step_100", state, user_metadata={"data_epoch": 3})
    """
    metadata = renamed_keyword("save", "user_metadata", user_metadata, "metadata", metadata)
    opts = SaveOptions(overwrite=overwrite, coordinator=coordinator, threads=threads, split_replicas=split_replicas,
                       timeout=timeout, compression=compression)
    _async.raise_unreported()  # before resolving `path`, whatever is wrong with it
    return _async.save(resolve(path, storage_options), state, opts, metadata=metadata,
                       incremental=None if base is None else {"base": _base_of(path, base, storage_options)})


def save_async(
    path: PathLike,
    state: Any,
    *,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    coordinator: Coordinator | None = None,
    threads: int = 4,
    split_replicas: bool = False,
    timeout: float = 1800.0,
    snapshot_budget_bytes: int | None = None,
    compression: str | bool = "auto",
    base: PathLike | None = None,
    user_metadata: dict[str, Any] | None = None,
) -> SaveFuture:
    """Start saving `state` at `path`; return after validation and the snapshot.

    The arrays may be updated, deleted or donated as soon as this returns: the
    checkpoint holds their values at the time of the call. Writing, fsync and
    the commit run in the background, one save at a time per process, in the
    order requested; ``future.result()`` waits for them and raises their error.

    `snapshot_budget_bytes` bounds the host memory of the snapshot: shards
    beyond it are protected by on-device copies and brought to host while
    writing. `compression` is as for `save` (codecs run in the background
    writer threads, not in the blocking phase). With two saves already pending, this call first waits for the
    oldest to finish. If an earlier async save failed and nobody collected its
    error, this call raises that error instead of starting (it is also logged
    when it happens), so a failing disk cannot go unnoticed. `base` is as for `save`.

    Example:

        f = cairn.save_async(f"/ckpt/step_{step}", state)
        state = train_step(state)      # may donate the saved buffers
        f.result()

    `user_metadata` is as for `save` (``metadata=``, its old spelling, is deprecated).
    """
    t0 = time.perf_counter()
    metadata = renamed_keyword("save_async", "user_metadata", user_metadata, "metadata", metadata)
    opts = SaveOptions(overwrite=overwrite, coordinator=coordinator, threads=threads, split_replicas=split_replicas,
                       timeout=timeout, snapshot_budget_bytes=snapshot_budget_bytes, compression=compression)
    _async.admit()  # an uncollected error and back-pressure come before resolving `path`
    return _async.save_async(resolve(path, storage_options), state, opts, metadata=metadata, started=t0,
                             incremental=None if base is None else {"base": _base_of(path, base, storage_options)})


def _base_of(path: PathLike, base: PathLike, storage_options: dict[str, Any] | None) -> Any:
    """`base` as the `Location` of a sibling of `path` (incremental saves; ValueError otherwise)."""
    from ._read.metadata import base_beside

    return base_beside(resolve(path, storage_options), base, storage_options)


def load(
    path: PathLike,
    target: Any = None,
    *,
    partial: bool = False,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    threads: int = 8,
    framework: str = "numpy",
    read_once: bool | None = None,
    budget_bytes: int = 1 << 30,
    bandwidths: dict[str, float] | None = None,
    coordinator: Coordinator | None = None,
    timeout: float = 1800.0,
    format: str | None = None,
    rename: Rename | None = None,
    drop: Patterns | None = None,
    fill_missing: bool | Patterns = False,
    report: RestoreReport | None = None,
    stats: LoadStats | None = None,
    mesh: Any = None,
    cast: str = "safe",
) -> Any:
    """Load a checkpoint, whole or in part, onto any sharding.

    Without `target`, every checkpointable comes back as plain containers of
    numpy arrays and Python values. With `target` (a pytree, or for a named
    checkpoint a mapping of some checkpointable names to pytrees), leaves may
    be ``jax.ShapeDtypeStruct`` (with ``.sharding``), ``jax.Array`` or numpy
    templates, or ``jax.sharding.Sharding`` objects; each array comes back
    with that sharding and dtype (a different dtype is a cast), reading only
    the bytes its shards need. Typed PRNG keys (``jax.random.key``) come back
    as keys of their saved implementation for a key-dtype target (e.g. from
    ``jax.eval_shape``) or a sharding; without one, as their ``uint32`` key
    data (``jax.random.key_data``).

    A cast that would change values is a `MismatchError` naming the leaf,
    both dtypes and a value, unless ``cast="unsafe"``: float to integer,
    integers that do not fit the target (int8 -> uint8 with negatives,
    int64 -> int32 beyond its range) and overflows (1e6 into float16).
    Widening, float-to-float (float32 -> bfloat16) and int64 -> int32 casts
    whose values fit load silently:

        q = cairn.load(path, {"w": np.zeros(3, np.int8)}, cast="unsafe")  # wraps as numpy astype does

    Example:

        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params)
        params = cairn.load("/ckpt/step_100", {"params": abstract})["params"]

    `mesh` (a ``jax.sharding.Mesh``) restores onto the saved shardings: each
    array the target gives no sharding (no target, a None leaf, an
    `ArrayMetadata`, a ``ShapeDtypeStruct`` without one) comes back as a
    ``jax.Array`` with its saved ``PartitionSpec`` over `mesh`, whose axes need
    the saved names but may have other sizes (a ``MismatchError`` names the
    leaf when an axis is missing or does not divide it). Arrays saved
    without a ``NamedSharding`` come back replicated on `mesh`; numpy and
    per-process values stay numpy:

        state = cairn.load("/ckpt/step_100", mesh=jax.make_mesh((4, 2), ("data", "model")))

    Raises `CheckpointNotFoundError` if nothing is committed at `path`,
    `CorruptCheckpointError` if a checksum or the metadata is wrong, and
    `MismatchError` if the target does not fit (leaves the checkpoint lacks,
    or leaves it has that the target omits unless `partial=True`).

    ``framework="torch"`` returns ``torch.Tensor`` in place of arrays (sharing
    their memory; bfloat16 and float8 stay as they are), so PyTorch code can
    read a checkpoint saved from JAX. Loading needs no JAX unless the target
    asks for JAX arrays:

        sd = cairn.load("/ckpt/step_100", framework="torch")["params"]

    Across processes, each array takes the faster of two routes: every
    process reads its own shards (direct), or each byte leaves storage once,
    in distinct blocks, one per device, and XLA's collectives move them to
    the target sharding (read-once: worth it for a target replicated over
    processes, or cut across the saved chunks, when storage is slower than
    the interconnect). Each route's time is its storage bytes and requests
    at the storage's bandwidth, plus the bytes moved between processes at the
    interconnect's, plus the host's work (checking every byte read, copying
    out the reads that cannot land in place) at ``host_gbps``; `bandwidths`
    declares them per process, e.g. ``{"storage_gbps": 2.0,
    "interconnect_gbps": 100.0, "request_ms": 1.0, "host_gbps": 4.0}``
    (any subset); the rest default per storage kind (local disk, object
    store) and JAX platform (CPU collectives over gloo are slow, GPU and TPU
    fast); ``"interconnect_gbps": "measure"`` times one small all-gather on
    the target's mesh at the first such load (cached; every process takes the
    primary's figure). Every process must pass the same figures. ``read_once=False``
    always reads each process's own shards; ``True`` uses the collectives
    wherever that reads fewer bytes (then every process must call `load` with
    the same target, as for any multi-process array). `stats` reports each
    leaf's route. `budget_bytes` bounds the host buffers in flight per
    process; `timeout` bounds each wait for the other processes.

    Checkpoints of other formats load the same way, onto any mesh, with the
    same errors and `partial`: Hugging Face safetensors (one file, or a
    folder with ``model.safetensors.index.json``), PyTorch DCP (``.metadata``
    and ``.distcp`` files) and Orbax (an item or CheckpointManager step
    folder; needs tensorstore, the ``orbax`` extra). The format is detected;
    ``format=`` ("cairn", "orbax", "dcp", "safetensors") overrides it. Their
    keys are their own tree: Orbax's pytree, DCP's FQNs and safetensors
    names split on '.'. Safetensors and DCP tensors are read by byte range
    (only what each process's shards need), Orbax arrays through tensorstore
    (only the zarr chunks they overlap). They carry no checksums, so nothing
    of them is verified.

    `rename` maps each source key path ('/'-joined, e.g.
    ``model/layers/0/self_attn/q_proj/weight``) to where the target keeps it:
    a function returning the new path or None (drop the leaf), or
    ``(regex, replacement)`` pairs applied in order with ``re.sub`` (a None
    replacement drops what the regex matches). It works for cairn
    checkpoints too:

        params = cairn.load("hf_model/", target, rename=[(r"^model/", ""), (r"/self_attn/", "/attn/")])

    `drop` (a regex or several, searched in the checkpoint's key paths before
    renaming) leaves those leaves out: they are not read, and are no error
    without `partial`. `fill_missing` lets target leaves the checkpoint lacks
    keep the target's own value (a ``jax.Array`` or numpy array; a
    ``ShapeDtypeStruct`` has none, which is a `MismatchError`): True for any,
    or regexes of the target key paths allowed. Without it a missing leaf is
    a `MismatchError`. What was renamed, dropped and filled is logged (INFO,
    logger ``cairn``) and written into `report`, a `cairn.RestoreReport`:

        report = cairn.RestoreReport()
        state = cairn.load(old_ckpt, new_state, rename=[(r"/enc/", "/encoder/")], fill_missing=True, report=report)

    What the load cost on this process (bytes, requests, seconds per phase,
    GiB/s) is written into `stats`, a `cairn.LoadStats`, logged (INFO, logger
    ``cairn``), recorded as ``jax.monitoring`` events (``/cairn/load/...``)
    and passed to the listeners of `cairn.add_listener`:

        stats = cairn.LoadStats()
        state = cairn.load("/ckpt/step_100", target, stats=stats)
        print(stats.bytes_read, stats.reads, stats.read_s, stats.gib_per_s)
    """
    t0 = time.perf_counter()
    if framework not in ("numpy", "torch"):
        raise ValueError(f"framework must be 'numpy' or 'torch', got {framework!r}")
    opts = LoadOptions(partial=partial, verify=verify, threads=threads, read_once=read_once,
                       budget_bytes=budget_bytes, bandwidths=bandwidths, coordinator=coordinator, timeout=timeout,
                       format=format, rename=rename, drop=drop, fill_missing=fill_missing, mesh=mesh,
                       cast=cast)
    loc = resolve(path, storage_options)
    out = _sources.load(loc, target, opts, report=report, stats=stats, started=t0)
    if framework == "torch":
        from ._tree.torchconv import tree_to_torch

        out = tree_to_torch(out, loc.path)
    return out


def metadata(path: PathLike, *, storage_options: dict[str, Any] | None = None, format: str | None = None) -> Any:
    """The checkpoint's tree with `ArrayMetadata` (shape, dtype, nbytes, sharding) for arrays.

    Reads only the manifest and indexes, never array data. Checkpoints of
    the other formats `load` reads are described too (``format=`` as there).

    Example:

        info = cairn.metadata("/ckpt/step_100")
        info["params"]["w"].shape
    """
    return _load.metadata(_sources.open_source(resolve(path, storage_options), format=format, locate=False))


def user_metadata(path: PathLike, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The user metadata saved with the checkpoint at `path`: the ``user_metadata=`` its save was given.

    That is ``cairn.save(path, state, user_metadata=...)``'s dict; for a step of a
    `CheckpointManager` run, ``mgr.save(step, state, user_metadata=...)``'s (as
    ``mgr.user_metadata(step)``; the metrics are the manager's); for an Orbax
    ``CheckpointManager`` step folder, its ``custom_metadata``. A checkpoint
    saved without any gives ``{}``. Reads only the manifest. Raises
    `CheckpointNotFoundError` if nothing is committed at `path`.

    Example:

        cairn.save("/ckpt/step_100", state, user_metadata={"data_epoch": 3, "git": "abc123"})
        cairn.user_metadata("/ckpt/step_100")    # {"data_epoch": 3, "git": "abc123"}
    """
    return _steps.saved_metadata(resolve(path, storage_options))
