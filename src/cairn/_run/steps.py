"""Step folders of a manager's directory: naming, listing, deletion, leftovers.

Shared by `CheckpointManager` and the ``cairn ls`` / ``cairn gc`` commands, so
that both agree on what a step, a committed step and a leftover are. Every
function takes the storage whose root is the directory (`open_directory`).

Step `N` is the ordinary cairn checkpoint ``step_<N zero-padded to 8
digits>`` (another spelling with `StepNames`, e.g. Orbax's plain ``100``);
the manager records its step, metrics and user metadata in the manifest's
metadata under `META_KEY`. A step folder of an Orbax CheckpointManager (a
plain integer name holding ``_CHECKPOINT_METADATA``) is a step too
(`step_folders`), so a run Orbax began lists, restores and continues here;
it is never taken for a leftover. Creating, deleting and taking away folders goes
through the directory's commit strategy (`cairn._save.commit`).

Two notions of a leftover, one per caller:

- In a manager's directory (`leftovers`), the manager owns every canonical
  step name: a hidden attempt folder of a step, or a step folder (object
  stores: a step prefix) without a manifest, is an interrupted save or
  deletion, whatever it holds.
- In any directory (``cairn ls`` / ``cairn gc``), a hidden attempt folder of
  any name is one, but an entry without a manifest counts only if it holds
  files only a cairn save writes (`written_by_save`); other folders are
  neither listed nor ever removed.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .._format import manifest as fmt
from .._load.engine import read_manifest
from .._save.commit import strategy_for
from .._sources.orbax import step_metrics
from .._storage import Storage, open_storage
from .._storage.location import Location, resolve
from .retention import CheckpointInfo

#: The manifest metadata key under which the manager records step and metrics.
META_KEY = "cairn.manager"

_CANONICAL = re.compile(r"^step_(\d{8,})$")
_ORBAX_NAME = re.compile(r"^(?:(.+)_)?(\d+)$")  # Orbax's step folders: "100", "<step_prefix>_100"
_LENIENT = re.compile(r"^(?:step[_-]?)?(\d+)$")
# Names that say "checkpoint of step N" whatever the folder holds (what a stray of unknown content must be called).
_STEPLIKE = re.compile(r"^(?:(?:step|checkpoint|ckpt)[_-]?)?\d+$")
# Files only a cairn save writes: data files, per-attempt indexes, per-process partial indexes.
_CAIRN_FILE = re.compile(r"^(p\d{5}-\d+\.[0-9a-f]+\.bin|index\.[0-9a-f]+\.json|_index\.p\d{5}\.[0-9a-f]+\.json)$")


#: The file an Orbax CheckpointManager writes into each step folder it commits.
ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"
#: cairn's own spelling of step folders.
DEFAULT_STEP_FORMAT = "step_{step:08d}"
_FIELD = re.compile(r"\{step(?::0?(\d*)d)?\}")


def step_dirname(step: int) -> str:
    """The folder name of `step`: ``step_`` and the step zero-padded to 8 digits."""
    return f"step_{step:08d}"


class StepNames:
    """How a manager spells its step folders: a format string with one ``{step}`` field.

    ``"step_{step:08d}"`` (the default: ``step_00000100``), ``"{step}"``
    (Orbax's ``100``), ``"checkpoint_{step}"``, ... Only the exact spelling
    the format writes parses back (`parse`), so a folder the manager did not
    name is never taken for one of its steps.

    Example:

        StepNames("{step}").name(100)    # "100"
    """

    def __init__(self, format: str = DEFAULT_STEP_FORMAT, *, follow_orbax: bool = False):
        fields = _FIELD.findall(format) if isinstance(format, str) else []
        if len(fields) != 1 or "/" in format or format.startswith(".") or \
                format.count("{") != 1 or format.count("}") != 1:
            raise ValueError(f"step_format must be a folder name with one {{step}} field (e.g. 'step_{{step:08d}}' "
                             f"or '{{step}}'), got {format!r}")
        self.format = format
        head, tail = _FIELD.split(format, maxsplit=1)[0], _FIELD.split(format, maxsplit=1)[-1]
        self._rx = re.compile(f"^{re.escape(head)}(\\d+){re.escape(tail)}$")
        # A manager given no step_format names its steps as the run's Orbax steps are named, where the run
        # has any (`survey` finds the naming, `adopting` applies it), so that Orbax's CheckpointManager lists
        # them too; the steps it named in its own default spelling before stay steps of the run (`_also`).
        self.follow_orbax = follow_orbax
        self._also: StepNames | None = None

    def adopting(self, format: str | None) -> StepNames:
        """These names, following a run whose Orbax naming is `format`: new steps are named so, and
        steps in cairn's default spelling still parse. Unchanged where not following or `format` is None."""
        if not self.follow_orbax or format is None or format == self.format:
            return self
        out = StepNames(format, follow_orbax=True)
        out._also = DEFAULT_NAMES if format != DEFAULT_STEP_FORMAT else None
        return out

    def name(self, step: int) -> str:
        return self.format.format(step=step)

    def parse(self, name: str) -> int | None:
        m = self._rx.match(name)
        if m is None:
            return self._also.parse(name) if self._also is not None else None
        step = int(m.group(1))
        if self.name(step) == name:
            return step
        return self._also.parse(name) if self._also is not None else None

    def __repr__(self) -> str:
        return f"StepNames({self.format!r})"


DEFAULT_NAMES = StepNames()


def orbax_step(storage: Storage, name: str, names: StepNames | None = None) -> int | None:
    """The step of entry `name` if it is a committed Orbax CheckpointManager step folder, else None.

    Orbax names steps by their number (``100``; zero-padded with
    ``step_format_fixed_length``; ``<prefix>_100`` with ``step_prefix``: any
    of them, `orbax_name`, or the spelling of `names`) and writes
    ``_CHECKPOINT_METADATA`` into each; on a POSIX filesystem it renames the
    folder into place, on object stores it writes ``commit_success.txt`` last.
    """
    step = names.parse(name) if names is not None else None
    if step is None:
        on = orbax_name(name)
        step = on[1] if on is not None else None
    return step if step is not None and _orbax_committed(storage, name) else None


def parse_step(name: str) -> int | None:
    """The step whose folder is `name`, or None; what the manager uses.

    Only the canonical spelling counts (what `step_dirname` writes: ``step_``,
    at least 8 digits, no extra leading zeros), so a folder the manager did
    not write is never listed, restored, counted for retention or removed.
    """
    m = _CANONICAL.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dirname(step) == name else None


def guess_step(name: str) -> int | None:
    """A step number to show for entry `name` in ``cairn ls``, or None.

    Lenient: also ``step_12``, ``step12``, ``step-12`` (torchtitan's DCP folders) and ``12``, spellings of checkpoints
    saved without a manager. For display and sorting only; what is a step,
    what is kept and what is removed is decided by `parse_step`.
    """
    m = _LENIENT.match(name)
    return int(m.group(1)) if m else None


def step_metadata(step: int, metrics: Mapping[str, Any] | None, where: str,
                  user: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest metadata of `step` saved with `metrics` (numbers; non-finite ones stored as None)
    and the `user` metadata (a JSON-able mapping, under ``"user"``)."""
    clean: dict[str, float | None] = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str):
            raise TypeError(f"{where}: metric names must be strings, got {k!r}")
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"{where}: metric {k!r} is a {type(v).__name__}; metrics must be numbers") from None
        clean[k] = f if math.isfinite(f) else None  # JSON has no NaN; a NaN loss is never "best"
    out: dict[str, Any] = {"step": step, "metrics": clean}
    if user is not None:
        if not isinstance(user, Mapping) or not all(isinstance(k, str) for k in user):
            raise TypeError(f"{where}: metadata must be a mapping with str keys, got {user!r:.200}")
        try:
            out["user"] = json.loads(json.dumps(dict(user), allow_nan=False))
        except (TypeError, ValueError) as e:
            raise TypeError(f"{where}: metadata must be JSON-able (finite numbers, strings, lists, dicts): {e}") from None
    return {META_KEY: out}


def user_metadata(loc: Location) -> dict[str, Any]:
    """The user metadata saved with the manager's step at `loc` (`step_metadata`'s ``user``; {} if none)."""
    meta = read_manifest(loc).metadata.get(META_KEY, {})
    user = meta.get("user") if isinstance(meta, dict) else None
    return dict(user) if isinstance(user, dict) else {}


def saved_metadata(loc: Location) -> dict[str, Any]:
    """The user metadata of the checkpoint at `loc`, as given to its save: ``cairn.save(metadata=)``, a
    manager step's ``mgr.save(metadata=)`` (without the manager's own record), or an Orbax step folder's
    ``custom_metadata``; {} if none was given."""
    try:
        meta = read_manifest(loc).metadata
    except CheckpointNotFoundError:
        if not loc.storage.exists(loc.key(ORBAX_STEP_METADATA)):
            raise
        got = orbax_step_metadata(loc).get("custom_metadata")
        return dict(got) if isinstance(got, dict) else {}
    if META_KEY in meta and isinstance(meta[META_KEY], dict):
        return user_metadata(loc)
    return dict(meta)


def read_info(loc: Location, step: int) -> CheckpointInfo:
    """What retention sees of committed `step` at `loc`: its metrics (non-numbers as None) and commit time."""
    if not loc.storage.exists(loc.key(fmt.MANIFEST)) and loc.storage.exists(loc.key(ORBAX_STEP_METADATA)):
        return _orbax_info(loc, step)
    manifest = read_manifest(loc)
    meta = manifest.metadata.get(META_KEY, {})
    raw = meta.get("metrics", {}) if isinstance(meta, dict) else {}
    return CheckpointInfo(step, _numbers(raw), float(manifest.created_unix or 0.0))


def _numbers(raw: Any) -> MappingProxyType:
    metrics = {
        str(k): (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None)
        for k, v in (raw.items() if isinstance(raw, dict) else ())
    }
    return MappingProxyType(metrics)


def orbax_step_metadata(loc: Location) -> dict[str, Any]:
    """An Orbax step folder's ``_CHECKPOINT_METADATA`` (metrics, custom_metadata, timestamps)."""
    raw = fmt.parse_json(loc.storage.read(loc.key(ORBAX_STEP_METADATA)), f"{loc.path}/{ORBAX_STEP_METADATA}")
    return raw if isinstance(raw, dict) else {}


def _orbax_info(loc: Location, step: int) -> CheckpointInfo:
    meta = orbax_step_metadata(loc)
    t = meta.get("commit_timestamp_nsecs") or meta.get("init_timestamp_nsecs") or 0
    metrics = step_metrics(loc.storage, loc.name, loc.path)
    return CheckpointInfo(step, _numbers(metrics), float(t) / 1e9 if isinstance(t, (int, float)) else 0.0)


def open_directory(directory: str | os.PathLike[str], options: dict[str, Any] | None = None) -> tuple[str, Storage]:
    """The normalized text of `directory` (local paths made absolute) and the storage rooted there."""
    text = os.fspath(directory)
    if "://" not in text:
        text = os.path.abspath(os.path.expanduser(text))
    text = text.rstrip("/")
    return text, open_storage(text, options)


def attempt_of(storage: Storage, name: str) -> str | None:
    """For entry `name`: the checkpoint it is a hidden attempt (or deletion) folder of, else None."""
    return strategy_for(storage).attempt_of(name)


def written_by_save(keys: Iterable[str]) -> bool:
    """Whether any of `keys` is a file only a cairn save writes (data file, index, index part)."""
    return any(_CAIRN_FILE.match(k.rsplit("/", 1)[-1]) for k in keys)


def committed_steps(storage: Storage, names: StepNames = DEFAULT_NAMES, orbax: bool = False) -> list[int]:
    """The steps with a committed checkpoint (canonical name and a manifest), oldest first.

    With `orbax`, committed Orbax step folders count too (`step_folders`).
    """
    if orbax:
        return sorted(step_folders(storage, names))
    out = []
    for name in storage.list_dir(""):
        step = names.parse(name)
        if step is not None and storage.exists(f"{name}/{fmt.MANIFEST}"):
            out.append(step)
    return sorted(out)


def step_folders(storage: Storage, names: StepNames = DEFAULT_NAMES) -> dict[int, str]:
    """Committed step -> its folder: cairn's (named by `names`, with a manifest) and Orbax's (`survey`)."""
    return survey(storage, names).steps


def orbax_name(name: str) -> tuple[str, int] | None:
    """``(prefix, step)`` if `name` is one Orbax's CheckpointManager could give a step folder, else None.

    Orbax spells step 10 ``10``, ``0010`` (``step_format_fixed_length=4``),
    ``ckpt_10`` (``step_prefix="ckpt"``) or ``ckpt_0010``; the prefix of a
    plain number is ``""``. Its temporary folders (``10.orbax-checkpoint-tmp-...``) are not step names.
    """
    m = _ORBAX_NAME.match(name)
    return (m.group(1) or "", int(m.group(2))) if m else None


@dataclass(frozen=True)
class Stray:
    """A folder of a manager's directory that looks like a step but is not counted as one.

    `kind` is what it holds: ``"orbax"`` (an Orbax step the manager cannot
    place in the run), ``"cairn"`` (a cairn checkpoint named otherwise than
    the manager's `step_format`), ``"dcp"`` (a PyTorch DCP checkpoint) or
    ``"unknown"``; `why` says why it is not a step of the run.
    """

    name: str
    step: int
    kind: str
    why: str

    def show(self) -> str:
        return f"{self.name} ({self.kind}: {self.why})"


@dataclass
class Survey:
    """What a manager's directory holds: the run's committed steps and the step-like folders it does not count.

    `steps` maps each committed step to its folder (cairn's, named by the
    manager's `StepNames`, or Orbax's, under the one Orbax naming of the
    directory); `orbax` holds those that are Orbax's; `strays` the rest
    that look like steps (`Stray`), newest first.
    """

    steps: dict[int, str]
    orbax: set[int]
    strays: list[Stray]
    #: With names that follow Orbax (`StepNames.adopting`): the step_format of the run's Orbax naming, else None.
    naming: str | None = None


def orbax_format(names: Iterable[str]) -> str | None:
    """The step_format spelling Orbax step folders `names` (all of one step_prefix): ``"ckpt_{step}"``,
    ``"{step:04d}"`` where a zero-padded name shows ``step_format_fixed_length``; None if it cannot be one."""
    names = list(names)
    got = [orbax_name(n) for n in names]
    if not names or any(g is None for g in got):
        return None
    prefix = got[0][0]  # type: ignore[index]
    if "{" in prefix or "}" in prefix or "/" in prefix or prefix.startswith("."):
        return None
    digits = [n.rsplit("_", 1)[-1] if prefix else n for n in names]
    padded = [d for d in digits if len(d) > 1 and d.startswith("0")]
    field = f"{{step:0{len(padded[0])}d}}" if padded else "{step}"
    return f"{prefix}_{field}" if prefix else field


def _stray_kind(storage: Storage, name: str) -> str | None:
    if storage.exists(f"{name}/{fmt.MANIFEST}"):
        return "cairn"
    if storage.exists(f"{name}/.metadata"):
        return "dcp"
    if storage.exists(f"{name}/{ORBAX_STEP_METADATA}"):
        return None  # an Orbax save in progress on an object store (no commit_success.txt yet)
    if not _STEPLIKE.match(name):
        return None  # "eval_100", "samples_3": a folder of something else, not a checkpoint's name
    return "unknown" if storage.list(name) else None  # a plain file or an empty folder holds nothing


def survey(storage: Storage, names: StepNames = DEFAULT_NAMES) -> Survey:
    """The run in a manager's directory (see `Survey`): one listing, a few ``exists`` per step folder.

    Orbax's step folders count under any of its namings (`orbax_name`) when
    they hold ``_CHECKPOINT_METADATA`` (on object stores also
    ``commit_success.txt``). A directory should hold one Orbax naming:
    with several, the one `names` spells counts, or none (they are all
    strays). A step saved in two folders (two namings, or cairn's and
    Orbax's) is no step of the run but two strays, so that nothing picks one
    of them by chance.
    """
    cairn: dict[int, list[str]] = {}
    orbax: dict[str, dict[int, list[str]]] = {}
    named: dict[str, dict[int, list[str]]] = {}  # cairn checkpoints under an Orbax naming, by prefix
    strays: list[Stray] = []
    for name in storage.list_dir(""):
        if name.startswith("."):
            continue  # attempt folders, trash, leases, ...
        step = names.parse(name)
        if step is not None and storage.exists(f"{name}/{fmt.MANIFEST}"):
            cairn.setdefault(step, []).append(name)
            continue
        on = orbax_name(name)
        if on is not None and _orbax_committed(storage, name):
            orbax.setdefault(on[0], {}).setdefault(on[1], []).append(name)
            continue
        if step is not None:
            continue  # the manager's own spelling without a manifest: a leftover, cleaned up elsewhere
        if names.follow_orbax and on is not None and storage.exists(f"{name}/{fmt.MANIFEST}"):
            named.setdefault(on[0], {}).setdefault(on[1], []).append(name)  # placed once the naming is known
            continue
        guess = on[1] if on is not None else guess_step(name)
        kind = _stray_kind(storage, name) if guess is not None else None
        if guess is not None and kind is not None:
            why = {"cairn": f"a cairn checkpoint not named as step_format {names.format!r} spells",
                   "dcp": "a PyTorch DCP checkpoint", "unknown": "no checkpoint cairn recognizes"}[kind]
            strays.append(Stray(name, guess, kind, why))
    chosen: dict[int, list[str]] = {}
    if len(orbax) == 1:
        chosen = next(iter(orbax.values()))
    elif orbax:
        spelt = [p for p, got in orbax.items() if any(names.parse(n) is not None for ns in got.values() for n in ns)]
        chosen = orbax[spelt[0]] if len(spelt) == 1 else {}
        shown = ", ".join(repr(p) if p else "none" for p in sorted(orbax))
        for got in orbax.values():
            if got is not chosen:
                strays += [Stray(n, s, "orbax", f"Orbax steps under several step_prefix namings ({shown}); "
                                 "step_format spelling one of them picks it") for s, ns in got.items() for n in ns]
    naming = _run_naming(storage, names, chosen, named, bool(cairn))
    adopted = StepNames(naming) if naming is not None else None
    for got in named.values():
        for s, ns in got.items():
            for n in ns:
                if adopted is not None and adopted.parse(n) == s:
                    cairn.setdefault(s, []).append(n)  # a step this manager's naming gave it
                else:
                    strays.append(Stray(n, s, "cairn", f"a cairn checkpoint not named as step_format "
                                                       f"{names.format!r} spells"))
    steps: dict[int, str] = {}
    for s in sorted({*cairn, *chosen}):
        both = [*sorted(cairn.get(s, [])), *sorted(chosen.get(s, []))]
        if len(both) == 1:
            steps[s] = both[0]
            continue
        for n in both:
            kind = "cairn" if n in cairn.get(s, []) else "orbax"
            strays.append(Stray(n, s, kind, f"step {s} is saved in {len(both)} folders ({', '.join(both)}); "
                                "delete all but one"))
    strays.sort(key=lambda x: (-x.step, x.name))
    return Survey(steps, {s for s in steps if s in chosen}, strays, naming)


def _run_naming(storage: Storage, names: StepNames, chosen: dict[int, list[str]],
                named: dict[str, dict[int, list[str]]], own: bool) -> str | None:
    """For names that follow Orbax: the step_format of the run's Orbax naming. That of its Orbax steps; where
    none is left (retention deleted them) and no step is named in cairn's own spelling (`own`), that of the
    cairn steps a manager saved under one Orbax naming (each manifest records its step), so a run keeps
    its naming; else None."""
    if not names.follow_orbax:
        return None
    if chosen:
        return orbax_format(n for ns in chosen.values() for n in ns)
    if names.format != DEFAULT_STEP_FORMAT:
        return names.format  # adopted earlier by this manager
    if own or len(named) != 1:
        return None
    got = next(iter(named.values()))
    for s, ns in got.items():
        for n in ns:
            try:
                mine = read_manifest(Location(storage, n, storage.describe(n))).metadata.get(META_KEY)
            except CheckpointError:
                return None
            if not isinstance(mine, dict) or mine.get("step") != s:
                return None  # not saved by a manager as this step: not the run's naming
    return orbax_format(n for ns in got.values() for n in ns)


def _orbax_committed(storage: Storage, name: str) -> bool:
    if not storage.exists(f"{name}/{ORBAX_STEP_METADATA}"):
        return False
    return storage.dirs is not None or storage.exists(f"{name}/commit_success.txt")


def folders_of_step(storage: Storage, step: int, names: StepNames = DEFAULT_NAMES) -> list[str]:
    """The visible folders of the directory whose name reads as `step` in any naming (cairn's `names`,
    Orbax's, DCP's): where a save of `step` would make a second folder for it."""
    out = []
    for name in storage.list_dir(""):
        if name.startswith("."):
            continue
        got, own = names.parse(name), True
        if got is None:
            on, own = orbax_name(name), False
            got = on[1] if on is not None else guess_step(name)
        if got != step:
            continue  # one listing, and requests only for the folders of this step
        if own and not storage.exists(f"{name}/{fmt.MANIFEST}") and \
                not storage.exists(f"{name}/{ORBAX_STEP_METADATA}"):
            continue  # the manager's own spelling without a manifest: its leftover, not another naming
        if storage.list(name):
            out.append(name)
    return sorted(out)


def folder_of(storage: Storage, step: int, names: StepNames = DEFAULT_NAMES) -> str | None:
    """The folder of committed `step`: cairn's (spelt by `names`) or Orbax's (any naming), else None;
    `CheckpointError` if the step has several folders (nothing picks one by chance)."""
    found = folders_of_step(storage, step, names)
    if len(found) > 1:
        raise CheckpointError(f"{storage.describe('')}: step {step} has {len(found)} folders ({', '.join(found)}); "
                              "which is the step cannot be told: delete all but one")
    if not found:
        return None
    if names.parse(found[0]) == step and storage.exists(f"{found[0]}/{fmt.MANIFEST}"):
        return found[0]
    return found[0] if orbax_step(storage, found[0]) == step else None


def newest_committed(storage: Storage, after: int | None = None, names: StepNames = DEFAULT_NAMES,
                     orbax: bool = False) -> int | None:
    """The newest committed step newer than `after` (any, if None), or None.

    One listing, then one `exists` per candidate, newest first: usually one,
    so that polling an object store costs two requests. With `orbax`,
    committed Orbax step folders count too.
    """
    listed = storage.list_dir("")
    found: list[tuple[int, str]] = []
    for name in listed:
        s = names.parse(name)
        if s is None and orbax and (on := orbax_name(name)) is not None:
            s = on[1]
        if s is not None and (after is None or s > after):
            found.append((s, name))
    for step, name in sorted(found, reverse=True):
        if storage.exists(f"{name}/{fmt.MANIFEST}") or (orbax and orbax_step(storage, name) is not None):
            return step
    return None


def show_steps(steps: list[int]) -> str:
    """The newest few of `steps` for a message ("none" when empty)."""
    if not steps:
        return "none"
    return ", ".join(map(str, steps[-5:])) + (f" (and {len(steps) - 5} older)" if len(steps) > 5 else "")


def delete_step(storage: Storage, step: int, folder: str | None = None) -> None:
    """Delete committed `step` (in `folder`, default its canonical name): uncommitted in one step
    first, so a crash leaves only a leftover."""
    strategy_for(storage).delete(folder or step_dirname(step))


def trash_step(storage: Storage, folder: str, trash: str) -> str:
    """Move step `folder` into the folder `trash` of the directory in one rename (local directories);
    a name already there gets ``.1``, ``.2``, ... Returns its key in the trash."""
    dirs = storage.dirs
    assert dirs is not None
    dirs.makedirs(trash)
    dest, n = f"{trash}/{folder}", 0
    while storage.exists(dest) or storage.list_dir(dest):
        n += 1
        dest = f"{trash}/{folder}.{n}"
    dirs.rename_dir(folder, dest)
    return dest


def leftovers(storage: Storage, busy: Container[int] = (), names: StepNames = DEFAULT_NAMES) -> Iterator[str]:
    """The entries of a manager's directory that interrupted saves or deletions left.

    Steps in `busy` (saves in progress) are skipped; `busy` is consulted as
    each entry is checked, and each entry is checked only when the caller asks
    for it, so remove one before looking at the next.
    """
    for name in storage.list_dir(""):
        of = attempt_of(storage, name)
        if of is not None:
            step = names.parse(of)
            if step is None or step in busy:
                continue
        else:
            step = names.parse(name)
            if step is None or step in busy or storage.exists(f"{name}/{fmt.MANIFEST}"):
                continue
            if storage.exists(f"{name}/{ORBAX_STEP_METADATA}"):
                continue  # an Orbax step (step_format="{step}"): never ours to remove
        yield name


def remove_leftover(storage: Storage, name: str) -> None:
    """Remove leftover entry `name`, taken away in one step first where the storage can.

    A save still in progress there then fails its commit cleanly instead of
    committing a folder half deleted. May raise FileNotFoundError if it is gone meanwhile.
    """
    strategy_for(storage).remove_leftover(name)


# ---------------------------------------------------------------------- any directory (cairn ls / gc)


def scan(dir_path: str, storage_options: dict | None) -> tuple[Location, list[dict[str, Any]]]:
    """Every checkpoint-like entry of a directory, committed or not, for ``cairn ls`` and ``cairn gc``.

    Each entry is a dict: ``name``, ``key``, ``status`` (``committed``,
    ``broken``: committed, but a base checkpoint it refers to is not,
    ``corrupt``, ``temporary`` or ``uncommitted``), ``step`` (the manager's, or
    `guess_step`), ``age_s``, ``metrics``, ``created_unix``, ``files``,
    ``bytes``, ``format`` (``cairn``, or ``orbax`` for an Orbax step folder,
    ``dcp`` for a PyTorch DCP checkpoint) and ``of`` (temporary) or ``error``
    (corrupt, broken). Sorted by step.
    """
    loc = resolve(dir_path, storage_options)
    storage = loc.storage
    now = time.time()
    entries = []
    for child in storage.list_dir(loc.name):
        key = loc.key(child)
        of = attempt_of(storage, child)
        if child.startswith(".") and of is None:
            continue
        files = storage.list(key)
        if of is None and not files:
            continue  # a plain file, not a checkpoint folder
        e: dict[str, Any] = {"name": child, "key": key, "status": "", "step": None, "age_s": None,
                             "metrics": {}, "created_unix": None, "format": "cairn"}
        if of is not None:
            e["status"] = "temporary"
            e["of"] = of
        elif storage.exists(f"{key}/{fmt.MANIFEST}"):
            try:
                m = read_manifest(Location(storage, key, f"{loc.path.rstrip('/')}/{child}"))
            except CorruptCheckpointError as err:
                e["status"] = "corrupt"
                e["error"] = str(err)
            else:
                e["status"] = "committed"
                missing = [b for b in m.bases if not storage.exists(f"{loc.key(b)}/{fmt.MANIFEST}")]
                if missing:  # an incremental checkpoint whose base was deleted: it no longer loads
                    e["status"] = "broken"
                    e["error"] = (f"its base {', '.join(missing)} (incremental saves refer to its blocks) is not a "
                                  "committed checkpoint: deleted, or its manifest.json is")
                e["created_unix"] = m.created_unix
                e["age_s"] = now - m.created_unix if m.created_unix else None
                mgr = m.metadata.get(META_KEY)
                if isinstance(mgr, dict):
                    e["step"] = mgr.get("step")
                    e["metrics"] = mgr.get("metrics") or {}
                elif isinstance(m.metadata.get("metrics"), dict):
                    e["metrics"] = m.metadata["metrics"]
        elif (foreign := _foreign_step(storage, key, child, loc.path)) is not None:
            e.update(foreign)
        elif written_by_save(files) and not any(k.endswith(f"/{fmt.MANIFEST}") for k in files):
            # Written by a save that never committed (on object stores files go in place). A
            # folder with manifests below it holds checkpoints (another run's, a local tier's
            # process folder): it is not a leftover, whatever else it holds.
            e["status"] = "uncommitted"
        else:
            continue  # some other folder: neither listed nor ever removed
        if e["step"] is None:
            e["step"] = guess_step(e.get("of", child))
        e["files"] = len(files)
        e["bytes"] = sum(_size(storage, k) for k in files)
        if e["age_s"] is None:
            mtime = storage.dirs.mtime(key) if storage.dirs is not None else None  # object stores: unknown
            e["age_s"] = now - mtime if mtime is not None else None
        entries.append(e)
    entries.sort(key=lambda e: (e["step"] is None, e["step"] or 0, e["name"]))
    return loc, entries


def _foreign_step(storage: Storage, key: str, name: str, where: str) -> dict[str, Any] | None:
    """What ``cairn ls`` shows of a committed Orbax step folder or a DCP checkpoint folder, else None.

    Orbax: a folder holding ``_CHECKPOINT_METADATA`` (metrics and commit time
    from it; the step from a name like ``100`` or ``checkpoint_100``). DCP has no convention for step folders: any folder
    holding DCP's ``.metadata`` is listed, its step guessed from its name.
    """
    m = _ORBAX_NAME.match(name)  # not "100.orbax-checkpoint-tmp-...": a save in progress
    if m is not None and storage.exists(f"{key}/{ORBAX_STEP_METADATA}"):
        if storage.dirs is None and not storage.exists(f"{key}/commit_success.txt"):
            return None  # an Orbax save in progress on an object store
        loc = Location(storage, key, f"{where.rstrip('/')}/{name}")
        step = int(m.group(2))
        try:
            info = _orbax_info(loc, step or 0)
        except CorruptCheckpointError as err:
            return {"status": "corrupt", "format": "orbax", "error": str(err), "step": step}
        created = info.created_unix or None
        return {"status": "committed", "format": "orbax", "step": step, "created_unix": created,
                "age_s": time.time() - created if created else None, "metrics": dict(info.metrics)}
    if storage.exists(f"{key}/.metadata"):
        return {"status": "committed", "format": "dcp"}
    return None


def _size(storage: Storage, key: str) -> int:
    try:
        return storage.size(key)
    except (FileNotFoundError, NotADirectoryError):
        return 0  # removed while listing
