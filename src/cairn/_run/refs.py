"""Which steps of a directory hold data that kept steps refer to (incremental checkpoints).

A version-4 checkpoint lists in its manifest's ``bases`` the sibling
checkpoints whose data files its blocks refer to (docs/FORMAT.md §6.5). The
rule retention, `CheckpointManager.delete` and ``cairn gc`` follow, counting
references from committed manifests only: **a step that a kept step refers
to is kept** (its folder is not deleted), and so, in turn, are the steps it
refers to, so that every step whose manifest exists stays loadable. A save
in progress protects its base the same way (the manager passes it in
`extra`); ``cairn gc`` removes only uncommitted folders, which no committed
manifest can name.
"""

from __future__ import annotations

from collections.abc import Iterable

from .._read.metadata import bases_of
from .._storage import Storage


def protected(storage: Storage, folders: dict[int, str], keep: Iterable[int], extra: Iterable[str] = ()) -> set[int]:
    """The steps of `folders` (step -> folder) that must stay: the `keep` steps, and those that they, or
    the folders in `extra` (bases of saves in progress), refer to, directly or through each other."""
    by_folder = {f: s for s, f in folders.items()}
    todo = [folders[s] for s in keep if s in folders] + list(extra)
    seen: set[str] = set()
    while todo:
        folder = todo.pop()
        if folder in seen or folder not in by_folder:
            continue
        seen.add(folder)
        todo.extend(bases_of(storage, folder))
    return {by_folder[f] for f in seen}


def referrers(storage: Storage, folders: dict[int, str], step: int) -> list[int]:
    """The committed steps whose manifests refer to `step`'s folder."""
    target = folders.get(step)
    return sorted(s for s, f in folders.items() if s != step and target in bases_of(storage, f))

