"""The manager's arguments checked or applied: `trash_dir`, and `save`'s `cast`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._run import steps as _steps
from .._tree.pytree import map_with_path


def trash_dir_of(name: str | None, storage: Any, where: str) -> str | None:
    """`trash_dir` checked: a plain folder name in the directory, on a filesystem that can move folders."""
    if name is None:
        return None
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{where}: trash_dir must be a folder name inside the directory (e.g. '.trash'), "
                         f"got {name!r}")
    if _steps.orbax_name(name) is not None or _steps.guess_step(name) is not None:
        raise ValueError(f"{where}: trash_dir {name!r} looks like a step folder; choose another name")
    if storage.dirs is None:
        raise ValueError(f"{where}: trash_dir needs a local directory (steps are moved there in one rename); "
                         "object stores have no rename")
    return name


def cast_state(state: Any, cast: Any, where: str) -> Any:
    """`state` with its floating-point arrays cast as `cast` says: a dtype for every one, or a mapping
    from key paths (``"params"``, ``"params/dense/kernel"``) to the dtype of the arrays under each."""
    import jax.numpy as jnp
    import numpy as np

    rules = dict(cast) if isinstance(cast, Mapping) else {"": cast}
    try:
        wanted = {str(k).strip("/"): np.dtype(v) for k, v in rules.items()}
    except TypeError as e:
        raise TypeError(f"{where}: cast must be a dtype or a mapping from key paths to dtypes: {e}") from None
    for k, dt in wanted.items():
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"{where}: cast {k or '<every array>'!r} to {dt}: only floating-point casts are "
                             "done on save (to an integer dtype, cast the arrays yourself)")
    used: set[str] = set()

    def visit(path: str, x: Any) -> Any:
        rule = max((k for k in wanted if k == "" or path == k or path.startswith(k + "/")), key=len, default=None)
        if rule is None or not hasattr(x, "dtype") or not hasattr(x, "astype"):
            return x
        used.add(rule)
        return x.astype(wanted[rule]) if jnp.issubdtype(x.dtype, jnp.floating) else x

    out = map_with_path(visit, state)
    unused = sorted(set(wanted) - used)
    if unused:
        raise ValueError(f"{where}: cast names {unused}, which match no array of the state")
    return out
