"""CheckpointManager: when to save, which steps to keep, what to resume from.

A manager owns one directory (local or object store). Each step is one
ordinary cairn checkpoint in a folder named ``step_<step>``, the step number
zero-padded to at least 8 digits (``step_00000100``; ``step_123456789`` for
larger steps), or as ``step_format`` spells it (``"{step}"``: Orbax's
``100``). Only folders with that exact name and a committed
``manifest.json`` count as cairn steps, and Orbax's committed step folders
(``_CHECKPOINT_METADATA``, any Orbax naming) as Orbax steps of the same run
(`_steps.survey`); other folders that look like steps are named, never
passed over in silence (`_check_strays`). Interrupted saves are never listed,
restored or counted for retention, and the primary process removes them
(``.step_*.cairn-tmp-*`` folders, and on object stores step prefixes without a
manifest) when the manager opens and after each commit.

The manager works on the storage rooted at its directory: step folders
through `_steps` (naming, listing, deletion, leftovers), saves and loads
through the engine (`_async`, `_load` via `_sources.registry.load`) on a `Location` in that storage, so the
same code runs on local disk, ``memory://`` and object stores. Retention
policies live in `_retention`, preemption detection in `_preemption`, the
evaluator's polling in `_watch` and the reader leases retention honours in
`_leases`.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from .._core.renamed import renamed_keyword, renamed_method
from .._dist.agree import Decisions
from .._dist.coord import Coordinator, default_coordinator
from .._dist.preemption import PreemptionWatch
from .._errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
)
from .._format.manifest import MANIFEST
from .._local.tier import LocalTier
from .._run import leases as _leases
from .._run import refs as _refs
from .._run import steps as _steps
from .._run.retention import CheckpointInfo, KeepBest, RetentionPolicy, policy_from, retained
from .._run.steps import StepNames, show_steps
from .._save import future as _async
from .._save.options import SaveOptions
from .._storage.location import Location
from . import restoring as _restoring
from .arguments import cast_state, trash_dir_of
from .pacing import ManagerStats, Pacing
from .watch import StepWatch

log = logging.getLogger("cairn")


# ---------------------------------------------------------------------- the manager


@dataclass
class _Pending:
    step: int
    future: _async.SaveFuture
    settled: threading.Event  # set once the retention that follows its commit has run


class CheckpointManager(StepWatch):
    """Saves steps of a training run into one directory and keeps the right ones.

    `directory` is a local path or an object-store URL (``memory://``,
    ``s3://``, ...). Step `N` is saved as the cairn checkpoint
    ``<directory>/step_<N zero-padded to 8 digits>``; `step_format` spells it
    otherwise (a format string with one ``{step}`` field: ``"{step}"`` keeps
    Orbax's plain ``100``).

    - Orbax runs: the committed step folders of an Orbax CheckpointManager in
      `directory` (``<step>/_CHECKPOINT_METADATA``, under any of Orbax's
      namings: ``10``, ``0010`` with ``step_format_fixed_length``,
      ``ckpt_10`` with ``step_prefix="ckpt"``) are steps of the run too:
      `steps`, `latest_step`, `restore` (onto any mesh, as `cairn.load` reads
      them), `metrics`, `metadata` and `best_step` see them, and `save`
      continues the run in cairn's format beside them. Without a
      `step_format`, new steps are named as the run's Orbax steps are
      (``300``, ``ckpt_300``), so that Orbax's own CheckpointManager lists
      them and fails to restore them rather than resume from an older step;
      `cairn.export_orbax_run` turns the cairn steps into Orbax's for the
      way back.
    - One step, one folder: `save` raises `CheckpointExistsError` for a step
      that has a folder in any naming (Orbax's, cairn's under another
      `step_format`, DCP's ``step-10``), and a step saved in two folders is
      no step of the run until one is removed.
    - Folders that look like steps but are not steps of the run (a DCP
      checkpoint, a cairn checkpoint named otherwise, Orbax steps of two
      namings, ``step_10`` holding something else) are never passed over in
      silence: where one looks newer than the newest step (or there is no
      step at all), making the manager raises `CheckpointError` naming
      them, unless ``start_fresh=True`` (resume from the steps it counts,
      or from nothing); older ones are named in a warning.

    - `save_every`: `save` writes a step only when ``step % save_every == 0``
      (or with ``force=True``, or once preemption was detected), and then
      only if `save_interval_s` seconds have passed since this manager's last
      save began (Orbax's ``ContinuousCheckpointingPolicy``) and
      ``should_save_fn(step, last_saved_step)`` is true (Orbax's
      ``should_save_fn``), each where given. With several processes the
      primary judges both (clocks differ) and every process gets its answer.
    - `continuous`: continuous checkpointing. A step the schedule above says
      to save is saved only when no earlier save of this manager is still in
      flight; otherwise it is skipped (`save` returns False) and counted:
      ``mgr.stats.skipped``, the next save's ``SaveStats.skipped_steps``, and
      one warning in the log. `save` never waits for an earlier save then, so
      a save never stretches a step beyond its blocking phase; with
      `save_interval_s` it also saves at most that often (Orbax's
      ``ContinuousCheckpointingPolicy(minimum_interval_secs=)``). Every
      process makes the primary's decision.
    - `max_wait_s` (the default mode's back-pressure): at most two async
      saves hold snapshots at once (one writing, one queued), so when saves
      are slower than steps `save` waits for the oldest. It waits at most
      `max_wait_s` seconds (default 600), then raises `CheckpointError`
      naming the step in flight; waits are counted in ``mgr.stats``
      (``waited_s``, ``longest_wait_s``) and the first one over a second is
      logged. Use ``continuous=True`` to skip instead of waiting.
    - `compression`: as `cairn.save`'s, for every step (``"auto"``: on for
      object stores and network filesystems, off on local disks; ``True``: a codec per leaf;
      both read by every install; ``"fast"``: with the C-Blosc2 codecs, whose readers need the
      ``fast`` extra).
      `compression`, `threads` and `snapshot_budget_bytes` are checked as
      `cairn.save_async` checks them, when the manager is made (a
      ValueError naming the option), not at its first save.
    - Retention (combined: a step survives if any rule keeps it; the newest
      committed step always survives; without any rule every step is kept):
      `max_to_keep` newest, every step divisible by `keep_every`, the
      `keep_best` best by metric `best_metric` (`best_mode` ``"min"`` or
      ``"max"``), and any `retention` policies (see `RetentionPolicy`).
      The rules are a union, unlike Orbax's: with ``max_to_keep=3,
      keep_best=1`` the three newest steps and the best one survive (up to
      four steps); use ``retention=cairn.KeepLatest(3) & ...`` for an
      intersection. `best_step` names the best step.
      Retention runs after each commit, never before it, and skips steps
      an evaluator holds a reader lease on (until the lease is released or
      expires; see `new_steps` and `reading`). It counts and deletes cairn's
      steps only: a run's Orbax steps are the way back to Orbax, deleted by
      retention only with ``delete_orbax_steps=True`` (`delete` deletes any).
      With `trash_dir` (a folder name in a local `directory`, e.g.
      ``".trash"``), retention and `delete` move steps there in one rename
      instead of deleting them (Orbax's ``todelete_subdir``); emptying it is
      yours to do.
    - `read_only`: for an evaluator beside the trainer. It never saves,
      deletes or cleans up (the trainer's saves in progress look like
      interrupted ones) and installs no SIGTERM handler; use `wait_for_step`,
      `new_steps`, `reading` and `restore`.
    - `local`: a `LocalTier` (frequent per-host saves, peer replicas); `restore` prefers it when as new.
    - `incremental`: each save writes only the checksum blocks that differ
      from the previous save of this manager and refers to the rest (format
      version 4, see `cairn.save`'s `base`); every `full_every`-th save (and
      the first after the manager is made) is self-contained. A step that a
      kept step refers to is kept too, and `delete` refuses it.
    - `async_save`: saves return after the snapshot; the write and commit run
      in the background (see `cairn.save_async`). If a background save failed,
      the next `save` (or `wait`/`close`) raises its error.
    - Preemption: a SIGTERM (when `handle_sigterm`, installed from the main
      thread) or `preemption_check()` returning true makes the next `save`
      write its step whatever the interval and wait for the commit;
      `reached_preemption` then tells the loop to stop. With several processes
      under ``jax.distributed``, JAX's preemption service catches the signal
      instead and picks one step for every process (a signal seen by one
      process reaches all), so call `save` (or `should_save`) on every step.
      A `preemption_check` must then answer the same on every process.

    Example:

        with cairn.CheckpointManager("/ckpt/run1", max_to_keep=3, save_every=100) as mgr:
            start = 0
            if mgr.latest_step() is not None:
                state = mgr.restore()
                start = mgr.latest_step() + 1
            for step in range(start, num_steps):
                state = train_step(state)
                mgr.save(step, {"params": state.params, "opt": state.opt, "data": it.state_bytes()},
                         metrics={"loss": float(loss)})
                if mgr.reached_preemption(step):
                    break
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        retention: RetentionPolicy | Iterable[RetentionPolicy] | None = None,
        save_every: int = 1,
        async_save: bool = True,
        preemption_check: Callable[[], bool] | None = None,
        handle_sigterm: bool = True,
        snapshot_budget_bytes: int | None = None,
        storage_options: dict[str, Any] | None = None,
        coordinator: Coordinator | None = None,
        threads: int = 4,
        read_only: bool = False,
        local: LocalTier | None = None,
        step_format: str | None = None,
        compression: str | bool = "auto",
        start_fresh: bool = False,
        delete_orbax_steps: bool = False,
        save_interval_s: float | None = None,
        should_save_fn: Callable[[int, int | None], bool] | None = None,
        trash_dir: str | None = None,
        incremental: bool = False,
        full_every: int = 10,
        continuous: bool = False,
        max_wait_s: float | None = 600.0,
    ):
        if save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        # No step_format: cairn's own, or the naming of the run's Orbax steps (`StepNames.adopting`).
        self._names = StepNames(step_format) if step_format is not None else StepNames(follow_orbax=True)
        self.directory, self._storage = _steps.open_directory(directory, storage_options)
        self.policy = policy_from(max_to_keep, keep_every, keep_best, best_metric, best_mode, retention)
        self._best = (best_metric, best_mode) if best_metric is not None else None
        self._folders: dict[int, str] = {}  # committed step -> its folder, as last listed
        self.save_every = save_every
        self.async_save = async_save
        self._coord = coordinator or default_coordinator()
        self._primary = self._coord.process_index == 0
        self._decisions = Decisions(self._coord, self.directory)
        self._save_options = SaveOptions(coordinator=coordinator, threads=threads, compression=compression,
                                         snapshot_budget_bytes=snapshot_budget_bytes)  # checked here, not at a save
        self._preempt_saved: int | None = None  # step committed after preemption was detected
        # Incremental saves (`_save.incremental`): the previous save's folder, saves since a full one,
        # and the bases of saves in progress (retention keeps them, `_run.refs`).
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every must be a positive integer, got {full_every!r}")
        self.incremental, self.full_every = bool(incremental), full_every
        self._last_folder: str | None = None
        self._since_full = 0
        self._inflight_bases: dict[int, str] = {}
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()  # guards _inflight (held only briefly)
        self._retention_lock = threading.Lock()  # one retention / cleanup pass at a time
        self._inflight: set[int] = set()  # steps whose save has started and not finished
        self._infos: dict[int, CheckpointInfo] = {}  # committed checkpoints never change
        self._closed = False
        self.restored_step: int | None = None
        self.read_only = read_only
        self.local = local.attach(self._coord, threads) if local is not None and not read_only else None
        self._preemption = PreemptionWatch(self.directory, preemption_check, handle_sigterm and not read_only,
                                           self._coord.process_count)
        if self._primary and not read_only:
            with self._retention_lock:
                _leases.remove_stale_markers(self._storage)
                self._cleanup_uncommitted()
        self.start_fresh = start_fresh
        self.delete_orbax_steps = delete_orbax_steps
        if save_interval_s is not None and not (save_interval_s >= 0 and save_interval_s < float("inf")):
            raise ValueError(f"{self.directory}: save_interval_s must be a finite number of seconds >= 0, "
                             f"got {save_interval_s}")
        self.save_interval_s, self.should_save_fn = save_interval_s, should_save_fn
        self._last_save_t: float | None = None  # time.monotonic() when this manager's last save began
        self._last_saved_step: int | None = None
        self.trash_dir = trash_dir_of(trash_dir, self._storage, self.directory)
        self._orbax: set[int] = set()  # the run's steps that are Orbax step folders, as last listed
        self._pacing = Pacing(self.directory, continuous, max_wait_s, self._decisions, self._primary)
        self.continuous, self.max_wait_s = self._pacing.continuous, max_wait_s
        self._check_strays()

    def _survey(self) -> tuple[list[tuple[int, str, bool]], list[list[Any]]]:
        """The primary's `_steps.survey` on every process: (step, folder, is Orbax's) and the strays."""
        mine: Any = None
        if self._primary or self._decisions.alone:
            got = _steps.survey(self._storage, self._names)
            mine = [[[s, f, s in got.orbax] for s, f in got.steps.items()],
                    [[x.name, x.step, x.kind, x.why] for x in got.strays], got.naming]
        steps, strays, naming = self._decisions.shared("survey", mine)
        self._names = self._names.adopting(naming)  # every process names new steps alike
        pairs = [(int(s), str(f), bool(o)) for s, f, o in steps]
        self._folders = {s: f for s, f, _ in pairs}
        self._orbax = {s for s, _, o in pairs if o}
        return pairs, strays

    def _check_strays(self) -> None:
        """Refuse to start from nothing, or from an older step, beside folders that look like newer steps.

        Each such folder would otherwise be passed over in silence (`latest_step`
        None: the training loop starts again from step 0), so unless
        `start_fresh` the manager raises, naming them; older ones are named in
        a warning.
        """
        pairs, strays = self._survey()
        self._last_saved_step = pairs[-1][0] if pairs else None
        if not strays:
            if self._orbax and self._primary:
                self._tell_orbax_naming(pairs)
            return
        latest = pairs[-1][0] if pairs else None
        newer = [x for x in strays if latest is None or x[1] > latest]
        shown = "; ".join(f"{n} ({k}: {w})" for n, _, k, w in (newer or strays)[:5])
        more = f" and {len(newer or strays) - 5} more" if len(newer or strays) > 5 else ""
        if newer and not self.start_fresh:
            start = "no step it counts" if latest is None else f"steps up to {latest}"
            raise CheckpointError(
                f"{self.directory}: the manager finds {start}, but folders that look like "
                f"{'' if latest is None else 'newer '}steps: {shown}{more}. "
                "Resuming here would pass over them. Name the run's steps with step_format= (e.g. "
                "'checkpoint_{step}' for Orbax's step_prefix='checkpoint'), move the folders away, or pass "
                "start_fresh=True to start from " + ("nothing" if latest is None else f"step {latest}") +
                " anyway")
        if self._primary:
            log.warning("cairn: %s: these folders look like steps but are not steps of this run: %s%s",
                        self.directory, shown, more)

    def _tell_orbax_naming(self, pairs: list[tuple[int, str, bool]]) -> None:
        """Say how new steps beside the run's Orbax steps are named, and warn of cairn steps Orbax does not list."""
        newest = max(self._orbax)
        if not self._names.follow_orbax:  # the user's step_format: Orbax lists its steps only if it spells Orbax's
            log.info("cairn: %s holds Orbax steps (newest %d): they restore as steps of this run; new steps are "
                     "saved in cairn's format as %r; cairn.export_orbax_run(%r) makes them Orbax steps for the "
                     "way back", self.directory, newest, self._names.name(newest + 1), self.directory)
            return
        hidden = [(s, f) for s, f, o in pairs if not o and s > newest
                  and _steps.StepNames(self._names.format).parse(f) != s]
        log.info("cairn: %s holds Orbax steps (newest %d): they restore as steps of this run; new steps are saved "
                 "in cairn's format named as Orbax names them (%r), so an Orbax CheckpointManager lists them and "
                 "fails to restore them until cairn.export_orbax_run(%r) turns them into Orbax steps",
                 self.directory, newest, self._names.name(newest + 1), self.directory)
        if hidden:
            log.warning("cairn: %s: cairn steps %s are named otherwise than the run's Orbax steps, so an Orbax "
                        "CheckpointManager does not list them and would resume from step %d; run "
                        "cairn.export_orbax_run(%r) before going back to Orbax", self.directory,
                        ", ".join(f for _, f in hidden[-5:]), newest, self.directory)

    # ------------------------------------------------------------------ naming and listing

    def path(self, step: int) -> str:
        """The checkpoint path of `step` (whether or not it exists).

        Example:

            cairn.metadata(mgr.path(mgr.latest_step()))
        """
        return f"{self.directory}/{self._folder(step)}"

    def _folder(self, step: int) -> str:
        folder = self._folders.get(step)
        if folder is None:
            folder = _steps.folder_of(self._storage, step, self._names) or self._names.name(step)
        return folder

    def steps(self) -> list[int]:
        """The committed steps, oldest first. Interrupted saves are not listed.

        Committed Orbax step folders in the directory are steps too (see the class docstring).

        With several processes the primary lists and every process gets its
        list (call it on every process, as any collective step).

        Example:

            mgr.steps()    # [1000, 2800, 2900, 3000]
        """
        return [s for s, _, _ in self._survey()[0]]

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none.

        Example:

            start = 0 if mgr.latest_step() is None else mgr.latest_step() + 1
        """
        steps = self.steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> dict[str, float | None]:
        """The metrics saved with `step` (non-finite values read back as None).

        Example:

            mgr.save(100, state, metrics={"loss": 0.25}); mgr.wait()
            mgr.metrics(100)     # {"loss": 0.25}
        """
        return dict(self._info(step).metrics)

    def user_metadata(self, step: int | None = None) -> dict[str, Any]:
        """The user metadata saved with `step` (default: the newest), as given to `save(user_metadata=)`.

        For an Orbax step: its ``custom_metadata``. Raises
        `CheckpointNotFoundError` if `step` is not committed.

        Example:

            mgr.save(100, state, user_metadata={"data_epoch": 3, "git": "abc123"}); mgr.wait()
            mgr.user_metadata(100)    # {"data_epoch": 3, "git": "abc123"}
        """
        step = self._committed(step)
        loc = self._location(step)
        if self._is_orbax(step):
            got = _steps.orbax_step_metadata(loc).get("custom_metadata")
            return dict(got) if isinstance(got, dict) else {}
        return _steps.user_metadata(loc)

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """Deprecated (it goes in the next release): `user_metadata`, which this returns.

        (`cairn.metadata` describes a checkpoint's arrays; the user's own dict is `user_metadata`
        everywhere: docs/faq.md, "Names".)

        Example:

            mgr.user_metadata(100)    # not mgr.metadata(100)
        """
        renamed_method("CheckpointManager.metadata", "CheckpointManager.user_metadata")
        return self.user_metadata(step)

    def best_step(self, metric: str | None = None, mode: str | None = None) -> int | None:
        """The committed step with the best value of `metric`, or None if no step has it (finite).

        `metric` and `mode` (``"min"`` or ``"max"``) default to the manager's
        `best_metric` and `best_mode`. Ties go to the newer step, as `KeepBest`.

        Example:

            mgr = cairn.CheckpointManager(run, keep_best=2, best_metric="eval_loss")
            state = mgr.restore(mgr.best_step(), target=abstract_state)
        """
        metric = metric if metric is not None else (self._best[0] if self._best else None)
        mode = mode if mode is not None else (self._best[1] if self._best else "min")
        if metric is None:
            raise ValueError(f"{self.directory}: best_step needs a metric: pass metric= or create the manager "
                             "with best_metric=")
        if mode not in ("min", "max"):
            raise ValueError(f"{self.directory}: mode must be 'min' or 'max', got {mode!r}")
        best = KeepBest(1, metric, mode).keep([self._info(s) for s in self.steps()])
        return next(iter(best), None)

    def delete(self, step: int) -> None:
        """Delete committed `step` now (an Orbax step too), whatever the retention rules say.

        Waits for pending saves first. Raises `CheckpointNotFoundError` if it is
        not committed, `CheckpointError` on a read-only manager. Call it on
        every process; the primary deletes.

        Example:

            mgr.delete(1000)
        """
        self._check_open()
        if self.read_only:
            raise CheckpointError(f"{self.directory}: this CheckpointManager is read-only; it does not delete")
        self.wait()
        step = self._committed(operator.index(step))
        # Incremental: a step that others refer to stays (every process sees the same manifests).
        users = _refs.referrers(self._storage, _steps.step_folders(self._storage, self._names), step)
        if users:
            raise CheckpointError(f"{self.path(step)}: step {step} holds data that steps {show_steps(users)} "
                                  "refer to (incremental saves); delete those first")
        if self._primary:
            with self._retention_lock:
                self._delete_step(step, why="deleted")
        self._decisions.shared(f"deleted-{step}", True)  # every process returns once it is gone

    def _committed(self, step: int | None) -> int:
        steps = self.steps()
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(f"{self.directory} holds no committed checkpoint")
            return steps[-1]
        step = operator.index(step)
        if step not in steps:
            raise CheckpointNotFoundError(
                f"{self.directory}: step {step} has no committed checkpoint (committed steps: {show_steps(steps)})"
            )
        return step

    def _is_orbax(self, step: int) -> bool:
        folder = self._folder(step)
        return (not self._storage.exists(f"{folder}/{MANIFEST}")
                and self._storage.exists(f"{folder}/{_steps.ORBAX_STEP_METADATA}"))

    def _location(self, step: int) -> Location:
        folder = self._folder(step)
        return Location(self._storage, folder, f"{self.directory}/{folder}")

    def _info(self, step: int) -> CheckpointInfo:
        info = self._infos.get(step)
        if info is None:
            info = self._infos[step] = _steps.read_info(self._location(step), step)
        return info

    # ------------------------------------------------------------------ saving

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` would write: on the interval, or after preemption.

        Example:

            if mgr.should_save(step):
                state = expensive_gather(state)
        """
        return self._on_schedule(step) or self._preemption.detected(step)

    def _on_schedule(self, step: int) -> bool:
        """Whether the save policy writes `step`: `save_every`, then `save_interval_s` and `should_save_fn`.

        The time and the hook are the primary's to judge (clocks differ); every process gets its answer.
        """
        if step % self.save_every:
            return False
        if self.save_interval_s is None and self.should_save_fn is None:
            return True
        mine = None
        if self._primary or self._decisions.alone:
            mine = self._last_save_t is None or self.save_interval_s is None or \
                time.monotonic() - self._last_save_t >= self.save_interval_s
            if mine and self.should_save_fn is not None:
                mine = bool(self.should_save_fn(step, self._last_saved_step))
        return bool(self._decisions.shared(f"schedule-{step}", mine))

    @property
    def stats(self) -> ManagerStats:
        """A copy of this process's `ManagerStats`: saves, skipped steps, waits and blocking times.

        Example:

            s = mgr.stats
            print(f"{s.saves} saves, {s.skipped} steps skipped, {s.waited_s:.1f} s waited")
        """
        stats = self._pacing.stats
        return replace(stats, skipped_steps=list(stats.skipped_steps))

    def _in_flight(self) -> int | None:
        """The oldest step whose save has not finished (committed or failed), or None."""
        return next((p.step for p in self._pending if not p.future.done()), None)

    def is_saving_in_progress(self) -> bool:
        """Whether a background save of this manager has not finished yet (its commit and retention).

        Example:

            mgr.save(step, state)
            if not mgr.is_saving_in_progress():
                print("step", step, "is committed")
        """
        return any(not (p.future.done() and p.settled.is_set()) for p in self._pending)

    def reload(self) -> None:
        """Forget what the manager remembers of the directory and look again, as when it was made.

        For a directory another program writes too (an Orbax job, a second
        manager): cached metrics and folders are dropped, and step-like folders
        it does not count raise or warn as at construction (`start_fresh`).

        Example:

            mgr.reload(); mgr.latest_step()
        """
        self._check_open()
        self.wait()
        self._infos.clear()
        self._folders.clear()
        self._check_strays()

    def save(
        self, step: int, state: Any, metrics: Mapping[str, Any] | None = None, force: bool = False, *,
        metadata: Mapping[str, Any] | None = None, cast: Any = None, user_metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """Save `state` as `step` if the interval (or `force`, or preemption) says so.

        Returns False when the step is skipped. `state` is what `cairn.save`
        accepts, typically a mapping of named checkpointables (arrays, JSON-able
        config, ``bytes`` blobs, registered types). `metrics` (numbers) are
        stored in the checkpoint's manifest for `KeepBest` and `metrics`;
        `user_metadata` (a JSON-able mapping: data position, config, git hash) too,
        read back with `user_metadata` (``metadata=`` is its deprecated old spelling). After preemption the save is synchronous:
        it returns once committed.

        `cast` saves floating-point arrays in another floating-point dtype
        (Orbax's ``SaveArgs(dtype=)``), only where asked: a dtype for every
        floating-point array, or a mapping from key paths to dtypes
        (``{"params": jnp.bfloat16}``: the arrays under ``params``; the
        longest matching path wins). Integer and other leaves are left as
        they are; a cast to a non-float dtype, or a path that matches no
        array, is a ValueError before anything is saved.

        Raises `CheckpointExistsError` if `step` already has a folder in the
        directory, in any naming (cairn's, Orbax's, DCP's), or is being
        saved, and `CheckpointError` (before saving anything) if an earlier
        background save failed, or if `step` is older than the newest step
        of the run (committed or being saved): retention would delete it at
        once. (Orbax's manager skips such a save; cairn refuses it, so that
        a resume script restarted from an earlier step stops at its first
        save instead of training on with nothing kept.)

        Example:

            saved = mgr.save(step, {"params": params, "opt": opt}, metrics={"loss": loss})
            mgr.save(step, state, cast={"params": jnp.bfloat16})   # params stored as bfloat16
        """
        self._check_open()
        metadata = renamed_keyword("CheckpointManager.save", "user_metadata", user_metadata, "metadata", metadata)
        if self.read_only:
            raise CheckpointError(f"{self.directory}: this CheckpointManager is read-only; it does not save")
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"{self.directory}: step must be >= 0, got {step}")
        self._reap()
        preempted = self._preemption.detected(step)
        local_saved = self.local is not None and self.local.save(step, state)
        if not (force or preempted or self._on_schedule(step)):
            return local_saved
        if self.continuous and self.async_save and not (force or preempted) and self._pacing.skip(step, self._in_flight()):
            return local_saved
        meta = _steps.step_metadata(step, metrics, f"{self.directory} step {step}", metadata)
        if cast is not None:
            state = cast_state(state, cast, f"{self.directory} step {step}")
        mine = None
        if self._primary or self._decisions.alone:  # the step's folders, and the newest step saved or saving
            with self._lock:
                known = [*self._folders.copy(), *self._inflight, *(p.step for p in self._pending)]
            mine = [_steps.folders_of_step(self._storage, step, self._names), max(known, default=None)]
        taken, newest = self._decisions.shared(f"taken-{step}", mine)
        if taken:  # one step, one folder: never a second one in another naming
            raise CheckpointExistsError(
                f"{self.directory}/{taken[0]}: step {step} is already saved there"
                f"{' by Orbax' if self._storage.exists(f'{taken[0]}/{_steps.ORBAX_STEP_METADATA}') else ''}"
                f"{' (and in ' + ', '.join(taken[1:]) + ')' if taken[1:] else ''}; save a new step, or delete it "
                "first (mgr.delete for a step of this run)")
        if newest is not None and step < newest:  # retention would delete it at once: refused, not lost
            raise CheckpointError(
                f"{self.directory}/{self._names.name(step)}: step {step} is older than step {newest}, the newest "
                "this run has saved; "
                "steps are saved in order (with max_to_keep, retention would delete it at once; a resume script "
                f"started from an earlier step?). Resume from mgr.latest_step() ({newest}), delete the newer "
                "steps first (mgr.delete), or save into another directory")
        with self._lock:
            if step in self._inflight:
                raise CheckpointExistsError(f"{self.path(step)}: step {step} is already being saved")
            self._inflight.add(step)  # before any file exists, so cleanup leaves it alone
        loc = self._location(step)
        self._last_save_t, self._last_saved_step = time.monotonic(), step
        inc = self._incremental_for(step, loc)
        try:
            if self.async_save and not preempted:
                if not self.continuous:
                    self._pacing.wait_for_room(step, self.path(step), self._in_flight)
                fut = _async.save_async(loc, state, self._save_options, metadata=meta, incremental=inc)
                self._pacing.started(fut)
            else:
                self.wait()
                _async.save(loc, state, self._save_options, metadata=meta, incremental=inc)
        except BaseException:
            with self._lock:
                self._inflight.discard(step)
            self._inflight_bases.pop(step, None)
            self._last_folder = None  # the next save is self-contained
            raise
        if self.async_save and not preempted:
            pending = _Pending(step, fut, threading.Event())
            self._pending.append(pending)
            fut.add_done_callback(lambda _f: self._after_commit(pending))
        else:
            self._settle(step, ok=True)
            if preempted:
                self._preempt_saved = step
                log.warning("cairn: preemption: saved step %d to %s", step, loc.path)
        return True

    def _incremental_for(self, step: int, loc: Location) -> dict[str, Any] | None:
        """An incremental manager's save of `step`: against the previous save (a self-contained one
        every `full_every` saves), its base registered so that retention keeps it (`_run.refs`)."""
        if not self.incremental:
            return None
        base = self._last_folder if self._since_full % self.full_every else None
        self._since_full = self._since_full + 1 if base is not None else 1
        self._last_folder = loc.name
        if base is None:
            return {"hashes": True}
        with self._retention_lock:  # a retention pass in progress finishes first, then sees this base
            self._inflight_bases[step] = base
        return {"base": Location(self._storage, base, f"{self.directory}/{base}"), "hashes": True,
                "base_required": False}

    def _after_commit(self, pending: _Pending) -> None:
        """Runs on the background thread once the save is resolved."""
        try:
            ok = _async.error_of(pending.future) is None  # the manager raises it itself, later
            self._settle(pending.step, ok)
        finally:
            pending.settled.set()

    def _settle(self, step: int, ok: bool) -> None:
        with self._lock:
            self._inflight.discard(step)
        self._inflight_bases.pop(step, None)  # committed: its manifest protects its bases now
        if not (ok and self._primary):
            return
        with self._retention_lock:
            try:
                self._apply_retention()
                self._cleanup_uncommitted()
            except Exception as e:
                # Retention is housekeeping: a failure leaves extra checkpoints, never fewer.
                log.warning("cairn: retention in %s after step %d failed: %s", self.directory, step, e)

    def _apply_retention(self) -> None:
        """Delete the committed steps the policy does not keep (caller holds _retention_lock).

        Only the primary runs it (on the background thread), on its own listing: the
        decision is its alone, so nothing here is exchanged with the other processes.
        Steps under a live reader lease are spared; a later pass deletes them.
        """
        got = _steps.survey(self._storage, self._names)
        self._folders, self._orbax = got.steps, got.orbax
        # Another format's steps are the way back to it: deleted only when asked (`delete_orbax_steps`).
        steps = [s for s in self._folders if self.delete_orbax_steps or s not in self._orbax]
        infos = [self._info(s) for s in steps]
        keep = retained(self.policy, infos)
        # Incremental: steps that kept steps, or saves in progress, refer to stay (`_run.refs`).
        keep |= _refs.protected(self._storage, self._folders, keep, list(self._inflight_bases.values()))
        # Newest first: an incremental step refers only to older ones, so a crash between two
        # deletions never leaves a committed step whose base is gone.
        doomed = sorted((s for s in steps if s not in keep), reverse=True)
        if doomed:
            with _leases.spare_leased(self._storage, doomed, self.directory) as free:
                # A step a reader's lease spares keeps what it refers to, too.
                spared = _refs.protected(self._storage, self._folders, set(doomed) - set(free))
                for s in sorted(free, reverse=True):
                    if s not in spared:
                        self._delete_step(s)

    def _delete_step(self, step: int, why: str = "retention deleted") -> None:
        if self.trash_dir is not None:
            _steps.trash_step(self._storage, self._folder(step), self.trash_dir)
        else:
            _steps.delete_step(self._storage, step, self._folder(step))
        self._infos.pop(step, None)
        self._folders.pop(step, None)
        log.info("cairn: %s step %d from %s", why, step, self.directory)

    def _cleanup_uncommitted(self) -> None:
        """Remove interrupted saves and half-deleted steps (caller holds _retention_lock).

        A step joins `_inflight` before its save creates any file, so a save
        in progress is never mistaken for an interrupted one.
        """
        for name in _steps.leftovers(self._storage, self._inflight, self._names):
            try:
                _steps.remove_leftover(self._storage, name)
                log.info("cairn: removed the interrupted save %s from %s", name, self.directory)
            except FileNotFoundError:
                pass  # committed or removed meanwhile by another process
            except OSError as e:
                log.warning("cairn: could not remove %s from %s: %s", name, self.directory, e)

    def _reap(self) -> None:
        """Drop finished saves; raise the first failure among them."""
        done = [p for p in self._pending if p.future.done()]
        self._pending = [p for p in self._pending if not p.future.done()]
        self._raise_first([(p.step, p.future.exception()) for p in done])

    def _raise_first(self, outcomes: list[tuple[int, BaseException | None]]) -> None:
        failed = [(step, e) for step, e in outcomes if e is not None]
        if not failed:
            return
        step, e = failed[0]
        more = f" (and {len(failed) - 1} later saves failed too)" if len(failed) > 1 else ""
        raise CheckpointError(f"{self.directory}: the background save of step {step} failed: {e}{more}") from e

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save has committed and its retention has run.

        Raises the error of a failed save (and TimeoutError if `timeout` passes).

        Example:

            mgr.save(step, state); mgr.wait()    # now mgr.latest_step() == step
        """
        outcomes = []
        while self._pending:
            p = self._pending[0]
            e = p.future.exception(timeout)  # TimeoutError leaves it pending
            p.settled.wait(timeout)
            self._pending.pop(0)
            outcomes.append((p.step, e))
        self._raise_first(outcomes)
        if self.local is not None:
            self.local.wait()

    # ------------------------------------------------------------------ preemption

    def reached_preemption(self, step: int | None = None) -> bool:
        """True once preemption was detected and a checkpoint has been committed since
        (with `step`: one of a step at or before `step`, as Orbax's sync point asks).

        Call it after `save` in the loop and stop when it is true. A signal that
        arrives after this step's `save` returned yields False until the next
        `save` has written its step, so the loop never stops unsaved. Asked about
        an earlier step than the preemption's checkpoint, it says False: that
        step had not reached it.

        Example:

            mgr.save(step, state)
            if mgr.reached_preemption(step):
                break
        """
        saved = self._preempt_saved
        if not self._preemption.detected() or saved is None:
            return False
        return step is None or saved <= operator.index(step)

    # ------------------------------------------------------------------ restoring

    def restore(
        self, step: int | None = None, target: Any = None, *, fallback: bool = False, partial: bool = False,
        **transforms: Any,
    ) -> Any:
        """Load `step` (default: the newest committed one), whole or only what `target` asks.

        `target` is what `cairn.load` takes, e.g. ``{"params": abstract_params}``
        to read only that checkpointable; so are `transforms`: ``rename``,
        ``drop``, ``fill_missing``, ``report``, ``mesh`` (restore onto the saved
        shardings over that mesh), ``stats`` (a `cairn.LoadStats`, left
        empty when the local tier serves the restore) and the reading options
        of `cairn.load` (``verify``, ``threads``, ``budget_bytes``,
        ``read_once``, ``bandwidths``, ``timeout``); all are checked before
        any tier is asked.

        With a `LocalTier` and no `step`, the local tier serves what it can:
        the reading options (it reads its blobs with ``verify``, ``threads``
        and ``budget_bytes``; ``read_once`` and ``bandwidths`` choose how a
        persistent checkpoint is read and change nothing there), and ``mesh``
        where the target gives every array a sharding. ``partial``, the
        transforms (``rename``, ``drop``, ``fill_missing``, ``report``),
        ``format``, another ``coordinator`` and ``mesh`` for arrays the
        target leaves unsharded restore from the persistent tier, with one
        log line saying why. With ``fallback=True`` and no `step`, a
        checkpoint that fails verification (corrupt, or deleted meanwhile) is
        skipped, with a log line, for the next older one; `restored_step`
        records which step was loaded.

        A tree as the only positional argument is the target: ``mgr.restore(abstract)`` restores
        the newest step onto it.

        Raises `CheckpointNotFoundError` if there is no (such) committed step,
        `CorruptCheckpointError` if it (or, with `fallback`, every step) fails
        verification.

        Example:

            state = mgr.restore(target={"params": abstract_params}, fallback=True)
            print("resumed from", mgr.restored_step)
        """
        return _restoring.restore(self, step, target, fallback, partial, transforms)

    # ------------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self.directory}: the CheckpointManager is closed")

    def close(self) -> None:
        """Wait for pending saves (raising a failure), then release the SIGTERM handler.

        Example:

            mgr.close()    # or use the manager as a context manager
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._preemption.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # do not hide the error that is already propagating
            log.error("cairn: closing the manager of %s: %s", self.directory, e)

    def __repr__(self) -> str:
        return f"<cairn.CheckpointManager {self.directory!r} policy={self.policy!r}>"
