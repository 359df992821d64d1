"""Export a cairn checkpoint as an Orbax checkpoint, written by orbax-checkpoint itself.

Leaving cairn should be as easy as arriving: the checkpoint is loaded (numpy
arrays on the host, checksums verified; typed PRNG keys wrapped back into
keys) and handed to Orbax's own ``PyTreeCheckpointHandler``, so whatever
Orbax version is installed reads the result as its own. A plain tree becomes
an item folder (what ``StandardCheckpointer`` / ``PyTreeCheckpointer``
write); named checkpointables become the items of a step folder (what
Orbax's ``CheckpointManager`` writes for ``args.Composite``), so the output
can be the next step of an Orbax run: ``export_orbax(ck, "run/1000")``.

orbax-checkpoint is imported only here, only when called (the ``orbax``
extra). The export runs on one process and holds the whole state in host
memory; for a multi-host state, ``cairn.load`` it onto the mesh and save it
with Orbax directly.
"""

from __future__ import annotations

import os
from typing import Any

from .._errors import CheckpointError, CheckpointExistsError, UnsupportedTypeError
from .._format import manifest as fmt
from .._load import engine as _load
from .._load.metadata import open_checkpoint
from .._storage import split_url
from .._tree.perprocess import (
    check_export_choice,
    export_leaf_path,
    export_tree,
    nodes_of,
    refuse_per_process,
)
from .._tree.pytree import display_path, map_with_path

#: Leaf kinds Orbax has no place for.
_UNSUPPORTED = {"bytes": "bytes", "object": "an object of a registered type"}


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise CheckpointError("exporting to Orbax needs orbax-checkpoint: pip install 'cairn[orbax]' "
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
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write cairn checkpoint `path` as the Orbax checkpoint `out`, through orbax-checkpoint.

    A checkpoint of named checkpointables (``cairn.save(p, {"params": ...,
    "opt_state": ...})``) becomes an Orbax step folder with one PyTree item
    per checkpointable, as Orbax's CheckpointManager writes for
    ``args.Composite``; with ``step_folder=False`` (and by default where a
    checkpointable is a bare leaf) it becomes one PyTree item folder holding
    the whole mapping, as ``StandardCheckpointer`` writes. A plain tree
    becomes an item folder, or with ``step_folder=True`` a step folder whose
    one item is ``default`` (the name Orbax's manager gives an unnamed item). Arrays, Python scalars, strings, None and typed PRNG keys are
    written as Orbax writes them; bytes and registered objects have no place
    there (`UnsupportedTypeError` naming them). Needs orbax-checkpoint
    (imported lazily); runs on one process. Returns `out`.

    Orbax has no per-process values: a `cairn.PerProcess` value is exported
    as a mapping from ``process_<p>`` to the value process p saved, for
    every process that saved one (``{"data": {"process_0": ..., "process_1":
    ...}}``), however many processes saved and whichever exports.
    ``per_process="drop"`` writes None there instead, ``"error"`` refuses
    the checkpoint (`UnsupportedTypeError` naming the leaf).

    Raises `CheckpointExistsError` if `out` exists, unless `overwrite`.

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
        raise CheckpointError(f"{where}: export_orbax runs on one process; with {jax.process_count()} processes, "
                              "cairn.load the state onto the mesh and save it with Orbax")
    from etils import epath  # orbax-checkpoint's own path library

    if epath.Path(dest).exists() and not overwrite:
        raise CheckpointExistsError(f"{dest} exists; pass overwrite=True (cairn convert: --overwrite) to replace it")
    tree = _load.load(ck.loc, None, publish=False)
    items = {"": tree} if ck.manifest.root else dict(tree)
    keyed = {name: export_tree(_with_keys(items[name], ck.indexes[name]), ck.indexes[name].structure, where,
                               name, per_process) for name in items}
    if step_folder is None:  # Orbax's items are trees: checkpointables that are bare leaves stay one tree
        step_folder = not ck.manifest.root and all(
            isinstance(ck.indexes[n].structure, dict) and "leaf" not in ck.indexes[n].structure for n in keyed)
    if step_folder:
        named = {"default" if name == "" else name: t for name, t in keyed.items()}
        ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
        args = ocp.args.Composite(**{n: ocp.args.PyTreeSave(t) for n, t in named.items()})
    else:
        ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        args = ocp.args.PyTreeSave(keyed[""] if ck.manifest.root else keyed)
    try:
        ckptr.save(dest, args=args, force=overwrite)
        if hasattr(ckptr, "wait_until_finished"):
            ckptr.wait_until_finished()
    finally:
        ckptr.close()
    return dest


def _with_keys(tree: Any, index: fmt.ItemIndex) -> Any:
    """`tree` (loaded without a target) with each typed PRNG key's data wrapped back into a key."""
    impls = {leaf.path: leaf.impl for leaf in index.leaves
             if isinstance(leaf, fmt.ArrayLeaf) and leaf.kind == "prng_key"}
    if not impls:
        return tree
    import jax

    return map_with_path(lambda p, x: jax.random.wrap_key_data(x, impl=impls[p]) if p in impls else x, tree)


__all__ = ["export_orbax"]
