"""Export cairn checkpoints, and whole runs, as Orbax's, written by orbax-checkpoint itself.

Leaving cairn should be as easy as arriving: the checkpoint is loaded
(checksums verified; typed PRNG keys wrapped back into keys) and handed to
Orbax's own handlers, so whatever Orbax version is installed reads the result
as its own. A plain tree becomes an item folder (what ``StandardCheckpointer``
/ ``PyTreeCheckpointer`` write); named checkpointables become the items of a
step folder (what Orbax's ``CheckpointManager`` writes for
``args.Composite``): a checkpointable of JSON values only becomes a JSON item
(``JsonRestore`` reads it), the others PyTree items, and a manager step's
metrics become the ``metrics`` item Orbax's manager reads. So the output can
be the next step of an Orbax run: ``export_orbax(ck, "run/1000")``
(`cairn._run.toorbax` turns a whole run into Orbax's steps with it).

Arrays saved with a `NamedSharding` are loaded onto a mesh of the saved axis
names (`mesh`, or one built from the local devices where they suffice), so
Orbax records their shardings; in a multi-process job every process loads
only its own shards onto the global `mesh` and writes them through Orbax.
orbax-checkpoint is imported only here, only when called (the ``orbax`` extra).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

from .._core.stats import Progress
from .._errors import CheckpointError, CheckpointExistsError, UnsupportedTypeError
from .._format import manifest as fmt
from .._load import engine as _load
from .._load.source import CairnSource, open_checkpoint
from .._storage import split_url
from .._tree.perprocess import (
    check_export_choice,
    export_leaf_path,
    export_tree,
    nodes_of,
    refuse_per_process,
)
from .._tree.pytree import display_path, map_with_path

log = logging.getLogger("cairn")

#: Leaf kinds Orbax has no place for.
_UNSUPPORTED = {"bytes": "bytes", "object": "an object of a registered type"}
#: Value kinds JSON holds as they are: a checkpointable of these only is a JSON item.
_JSON_KINDS = {"none", "bool", "int", "float", "str"}
#: The item in which Orbax's CheckpointManager keeps a step's metrics.
_METRICS = "metrics"
#: Where a cairn CheckpointManager records a step's metrics in the manifest (`cairn._run.steps.META_KEY`).
MANAGER_KEY = "cairn.manager"


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise CheckpointError("exporting to Orbax needs orbax-checkpoint: pip install 'cairn-ckpt[orbax]' "
                              "orbax-checkpoint") from None
    return ocp


def _local_or_gcs(out: str) -> str:
    scheme, _ = split_url(out)
    if scheme in ("", "file"):
        return os.path.abspath(os.path.expanduser(out.removeprefix("file://")))
    if scheme == "gs":
        return out
    raise CheckpointError(f"{out}: Orbax writes to local paths and gs:// only, not {scheme}://")


def export_orbax(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step_folder: bool | None = None,
    overwrite: bool = False,
    per_process: str = "keys",
    json_items: Iterable[str] | None = None,
    mesh: Any = None,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> str:
    """Write cairn checkpoint `path` as the Orbax checkpoint `out`, through orbax-checkpoint.

    A checkpoint of named checkpointables (``cairn.save(p, {"params": ...,
    "opt_state": ...})``) becomes an Orbax step folder with one item per
    checkpointable, as Orbax's CheckpointManager writes for
    ``args.Composite``; with ``step_folder=False`` (and by default where a
    checkpointable is a bare leaf) it becomes one PyTree item folder holding
    the whole mapping, as ``StandardCheckpointer`` writes. A plain tree
    becomes an item folder, or with ``step_folder=True`` a step folder whose
    one item is ``default`` (the name Orbax's manager gives an unnamed item).

    In a step folder, a checkpointable that is a mapping or list of JSON values
    only (None, bools, ints, floats, strings; no arrays) is a JSON item, as
    ``args.JsonSave`` writes it (read back with ``args.JsonRestore``), and
    the others PyTree items; `json_items` names the JSON items instead (``()``:
    none). A step saved by a `CheckpointManager` keeps its metrics (Orbax's
    ``metrics`` item, which its manager's ``best_fn`` and ``metrics(step)``
    read) and its user metadata (``custom_metadata``); so does
    ``cairn.save(metadata=)``'s.

    Arrays saved with a `NamedSharding` keep it: they are loaded onto `mesh`
    (a `jax.sharding.Mesh` with the saved axis names; by default one of the
    saved shape built from the local devices, where they suffice) and Orbax
    records each sharding (its ``_sharding`` file, what Orbax's restore and
    ``metadata`` read). In a job of several processes pass the job's global
    `mesh` and call this on every process: each loads only its own shards
    and writes them through Orbax. Without a mesh, arrays are written from
    host memory with no sharding (a log line says so).

    Arrays, Python scalars, strings, None and typed PRNG keys are written as
    Orbax writes them; bytes and registered objects have no place there
    (`UnsupportedTypeError` naming them). Needs orbax-checkpoint (imported
    lazily). Returns `out`.

    Orbax has no per-process values: a `cairn.PerProcess` value is exported
    as a mapping from ``process_<p>`` to the value process p saved, for
    every process that saved one (``{"data": {"process_0": ..., "process_1":
    ...}}``), however many processes saved and whichever exports (from one
    process). ``per_process="drop"`` writes None there instead, ``"error"`` refuses
    the checkpoint (`UnsupportedTypeError` naming the leaf).

    Raises `CheckpointExistsError` if `out` exists, unless `overwrite`.

    Progress comes in two steps, since Orbax's save reports none of its own: `on_total(n)` gets
    twice the bytes of array data (read, then written), `progress(n)` half of that once the
    arrays are loaded and the other half once Orbax has written them; listeners added with
    ``progress=True`` get ``"export_orbax"`` events (a `ProgressStats`).

    Example:

        cairn.export_orbax("/ckpt/step_00001000", "/orbax/run/1000")
        with ocp.CheckpointManager("/orbax/run") as mgr:
            state = mgr.restore(1000, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    """
    check_export_choice(per_process)
    ck = open_checkpoint(path, storage_options)
    where = ck.loc.path
    dest = _local_or_gcs(os.fspath(out))
    for name, index in ck.indexes.items():
        nodes = nodes_of(index.structure)
        refuse_per_process(nodes, where, name, per_process)
        for leaf in index.leaves:
            under = export_leaf_path(nodes, leaf.path)
            if under is not None and per_process == "drop":
                continue
            if leaf.kind in _UNSUPPORTED:
                shown = under[1] if under is not None else leaf.path
                raise UnsupportedTypeError(
                    f"{where}: leaf {display_path(shown, name)!r} is {_UNSUPPORTED[leaf.kind]}, which Orbax "
                    "cannot store; " + ("per_process='drop' (--per-process drop) leaves the per-process value out"
                                        if under is not None else
                                        "load the checkpoint with cairn.load and save what Orbax holds with Orbax"))
    ocp = _orbax()
    import jax

    if jax.process_count() > 1:
        if mesh is None:
            raise CheckpointError(f"{where}: with {jax.process_count()} processes, pass mesh= (the job's global "
                                  "mesh): every process then loads its own shards onto it and writes them through "
                                  "Orbax")
        if any(nodes_of(index.structure) for index in ck.indexes.values()):
            raise UnsupportedTypeError(f"{where}: per-process values are exported from one process only "
                                       "(each process's value is read there); export this checkpoint from one")
    mesh = mesh if mesh is not None else _saved_mesh(ck)
    from etils import epath  # orbax-checkpoint's own path library

    if epath.Path(dest).exists() and not overwrite:
        raise CheckpointExistsError(f"{dest} exists; pass overwrite=True (cairn convert: --overwrite) to replace it")
    tracker = Progress("export_orbax", os.fspath(out))
    on_total, progress = tracker.wrap(on_total, progress)
    nbytes = sum(leaf.nbytes for index in ck.indexes.values() for leaf in index.leaves
                 if isinstance(leaf, fmt.ArrayLeaf))
    on_total(2 * nbytes)
    tree = _load.load(CairnSource(ck.loc, ck.manifest), None, publish=False, **({"mesh": mesh} if mesh is not None else {}))
    progress(nbytes)
    items = {"": tree} if ck.manifest.root else dict(tree)
    keyed = {name: export_tree(_with_keys(items[name], ck.indexes[name]), ck.indexes[name].structure, where,
                               name, per_process) for name in items}
    if step_folder is None:  # Orbax's items are trees: checkpointables that are bare leaves stay one tree
        step_folder = not ck.manifest.root and all(
            isinstance(ck.indexes[n].structure, dict) and "leaf" not in ck.indexes[n].structure for n in keyed)
    json_names = _json_items(ck, json_items, where)
    if json_names and not step_folder:
        raise ValueError(f"{where}: json_items={sorted(json_names)} needs a step folder (step_folder=True): "
                         "an item folder is one PyTree")
    metrics, custom = _step_metadata(ck)
    if step_folder:
        named = {"default" if name == "" else name: t for name, t in keyed.items()}
        if metrics and _METRICS in named:
            raise CheckpointError(f"{where}: checkpointable {_METRICS!r} has the name Orbax's manager keeps a step's "
                                  "metrics under; rename it before exporting (cairn.load, then cairn.save)")
        args = {n: ocp.args.JsonSave(t) if n in json_names else ocp.args.PyTreeSave(t) for n, t in named.items()}
        if metrics:
            args[_METRICS] = ocp.args.JsonSave(metrics)
        # Orbax's manager reads a step's metrics from the file "metrics" of that item.
        handlers = {n: ocp.JsonCheckpointHandler() if n in json_names else ocp.PyTreeCheckpointHandler()
                    for n in named}
        if metrics:
            handlers[_METRICS] = ocp.JsonCheckpointHandler(filename=_METRICS)
        ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers))
        save_args = ocp.args.Composite(**args)
    else:
        ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        save_args = ocp.args.PyTreeSave(keyed[""] if ck.manifest.root else keyed)
    try:
        ckptr.save(dest, args=save_args, force=overwrite, custom_metadata=custom or None)
        if hasattr(ckptr, "wait_until_finished"):
            ckptr.wait_until_finished()
    finally:
        ckptr.close()
    progress(nbytes)
    tracker.finish()
    return dest


def _json_items(ck: Any, asked: Iterable[str] | None, where: str) -> set[str]:
    """The checkpointables to write as JSON items: `asked`, or those holding JSON values only."""
    if ck.manifest.root:
        if asked:
            raise ValueError(f"{where}: json_items names checkpointables, but this checkpoint is one plain tree")
        return set()
    if asked is not None:
        names = {asked} if isinstance(asked, str) else set(asked)
        unknown = sorted(names - set(ck.indexes))
        if unknown:
            raise ValueError(f"{where}: json_items names {unknown}, which the checkpoint does not hold "
                             f"(checkpointables: {sorted(ck.indexes)})")
        for n in sorted(names):
            bad = [leaf.path for leaf in ck.indexes[n].leaves
                   if not isinstance(leaf, fmt.ValueLeaf) or leaf.kind not in _JSON_KINDS]
            if bad:
                raise UnsupportedTypeError(f"{where}: checkpointable {n!r} cannot be a JSON item: leaf "
                                           f"{display_path(bad[0], n)!r} is no JSON value")
        return names
    return {n for n, index in ck.indexes.items()
            if isinstance(index.structure, dict) and "leaf" not in index.structure
            and not nodes_of(index.structure)
            and all(isinstance(leaf, fmt.ValueLeaf) and leaf.kind in _JSON_KINDS for leaf in index.leaves)}


def _step_metadata(ck: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A manager step's metrics (non-finite ones left out: JSON has none) and the user metadata saved with it."""
    meta = dict(ck.manifest.metadata)
    mgr = meta.pop(MANAGER_KEY, None)
    if not isinstance(mgr, dict):
        return {}, meta
    raw = mgr.get("metrics")
    metrics = {str(k): v for k, v in (raw.items() if isinstance(raw, dict) else ())
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    user = mgr.get("user")
    return metrics, dict(user) if isinstance(user, dict) else {}


def _saved_mesh(ck: Any) -> Any:
    """A mesh of the one mesh shape and axis names the checkpoint's arrays were saved over, from the local
    devices; None where there is none, several, or too few devices (arrays then go from host memory)."""
    import jax

    meshes = {(tuple(leaf.sharding["mesh"]["axis_names"]), tuple(leaf.sharding["mesh"]["shape"]))
              for index in ck.indexes.values() for leaf in index.leaves
              if isinstance(leaf, fmt.ArrayLeaf) and isinstance(leaf.sharding, dict)
              and leaf.sharding.get("type") == "NamedSharding" and isinstance(leaf.sharding.get("mesh"), dict)}
    if not meshes:
        return None
    if len(meshes) == 1 and jax.process_count() == 1:
        (names, shape), = meshes
        if math.prod(shape) <= jax.device_count():
            return jax.make_mesh(shape, names, devices=jax.devices()[:math.prod(shape)])
    log.info("cairn: %s: arrays are exported without their shardings (saved over %s; %d local devices): pass "
             "mesh= to keep them", ck.loc.path, ", ".join(f"{dict(zip(n, s))}" for n, s in sorted(meshes)),
             jax.device_count())
    return None


def _with_keys(tree: Any, index: fmt.ItemIndex) -> Any:
    """`tree` (loaded without a target) with each typed PRNG key's data wrapped back into a key."""
    impls = {leaf.path: leaf.impl for leaf in index.leaves
             if isinstance(leaf, fmt.ArrayLeaf) and leaf.kind == "prng_key"}
    if not impls:
        return tree
    import jax

    def wrap(p: str, x: Any) -> Any:  # loaded onto a mesh, keys come back as keys already
        if p not in impls or jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            return x
        return jax.random.wrap_key_data(x, impl=impls[p])

    return map_with_path(wrap, tree)


__all__ = ["export_orbax"]
