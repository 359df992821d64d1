"""How a checkpoint becomes visible, and how it stops being one.

A checkpoint exists if and only if ``<name>/manifest.json`` exists. Two
strategies make that happen in one atomic step, each owning where an attempt
writes, the destination check, commit, abort, deletion and leftover cleanup:

- `RenameCommit` (POSIX): an attempt writes under a hidden sibling folder
  ``.<name>.cairn-tmp-<token>/``, fsyncs it, and renames it into place
  (``renameat2(RENAME_EXCHANGE)`` to replace a committed one atomically).
- `MarkerCommit` (object stores, ``memory://``): there is no rename, so an
  attempt writes in place under token-named files and the manifest is put
  last with a create-if-absent put. Files of other attempts are invisible
  because no manifest names them.

Every writer of checkpoints (the save engine, the safetensors importer, the
manager's retention and cleanup, ``cairn gc``) goes through `strategy_for`.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from .._format import manifest as fmt
from .._read.metadata import committed_manifest, sibling
from .._storage import LocalDirs, Storage
from .._storage.location import Location

log = logging.getLogger("cairn")


def at_once(fn: Any, xs: list[Any], name: str) -> list[Any]:
    """[fn(x) for x in xs], on up to 8 threads where there are several: each a durable step of a commit
    (a file written and fsync'd, a folder fsync'd, or a round trip to an object store), none waiting for
    another."""
    if len(xs) <= 1:
        return [fn(x) for x in xs]
    with ThreadPoolExecutor(min(8, len(xs)), thread_name_prefix=name) as pool:
        return list(pool.map(fn, xs))


class CommitStrategy:
    """The operations both strategies provide; see the module docstring."""

    name = ""

    def __init__(self, storage: Storage):
        self.storage = storage

    # ------------------------------------------------------------------ an attempt

    def attempt_root(self, name: str, token: str) -> str:
        """The folder (relative to the storage root) an attempt of checkpoint `name` writes under."""
        raise NotImplementedError

    def put_all(self, puts: list[tuple[str, bytes]], name: str) -> None:
        """Put each ``(key, bytes)`` of an attempt (keys under its `attempt_root`) durably, all at once
        (`at_once`, threads named `name`): one durable put each, a request to an object store."""
        at_once(lambda kv: self.storage.put(*kv), puts, name)

    def check_destination(self, loc: Location, overwrite: bool) -> None:
        """Refuse to start a save over something that must not be replaced: a committed checkpoint unless
        `overwrite`, and with it one that committed checkpoints beside it refer to (`refuse_replacing_a_base`)."""
        if self.storage.exists(loc.key(fmt.MANIFEST)):
            if not overwrite:
                raise CheckpointExistsError(f"{loc.path} already holds a checkpoint; pass overwrite=True to replace it")
            refuse_replacing_a_base(loc, "overwriting")

    def commit(self, loc: Location, token: str, manifest: bytes, needed: Iterable[str], *,
               overwrite: bool, discard: Iterable[str] = ()) -> None:
        """Make the attempt `token` the checkpoint at `loc`, in one atomic step.

        `needed`: the attempt's files the manifest names (keys under the
        storage root); a commit never names a missing file. `discard`: files
        of the attempt that are not part of the checkpoint (per-process index
        parts), removed where it is cheapest for the strategy.
        """
        raise NotImplementedError

    def abort(self, loc: Location, token: str) -> None:
        """Remove what attempt `token` wrote (best effort: leftovers are invisible anyway)."""
        raise NotImplementedError

    def write_whole(self, key: str, parts: Iterable[Any]) -> None:
        """Write one file that appears at `key` only once complete (a single-file export)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoints in a directory

    def delete(self, name: str) -> None:
        """Delete committed checkpoint `name`: uncommit it in one step, then remove the rest.

        A crash in between leaves an invisible leftover, never a checkpoint
        with missing files.
        """
        raise NotImplementedError

    @staticmethod
    def attempt_of(name: str) -> str | None:
        """For a directory entry: the checkpoint it is a hidden attempt (or deletion) folder of."""
        if name.startswith(".") and fmt.TMP_MARK in name:
            return name[1 : name.index(fmt.TMP_MARK)]
        return None

    def remove_leftover(self, name: str) -> None:
        """Remove the entry `name` left by an interrupted save or deletion."""
        self.storage.delete_prefix(name)

    # ------------------------------------------------------------------ shared

    def _check_complete(self, loc: Location, root: str, needed: Iterable[str], overwrite: bool) -> list[str]:
        """Never commit a checkpoint that names missing files; the keys under `root` now.

        Another process's cleanup (a second manager on this directory) may have
        removed files of this attempt while it was writing them.
        """
        listed = self.storage.list(root)
        gone = sorted(set(needed) - set(listed))
        if gone:
            raise CheckpointError(
                f"{loc.path}: {len(gone)} files of this save disappeared before its commit "
                f"(e.g. {gone[0]!r}); is another process cleaning up or saving in the same directory?"
            )
        return listed


def referrers(loc: Location) -> list[str]:
    """The committed checkpoints beside `loc` (in its folder or prefix) that name it as a base: incremental
    saves (docs/FORMAT.md §6.5) refer to their base's data files by its name beside them. One listing of
    the folder and one manifest read per entry in it, eight at a time; an entry that is not a committed
    cairn checkpoint (no manifest, or one that does not parse) refers to nothing."""
    storage = loc.storage
    names = [c for c in storage.list_dir("") if c != loc.name and not c.startswith(".")]

    def names_it(name: str) -> bool:
        try:
            manifest = committed_manifest(sibling(loc, name))
        except (CorruptCheckpointError, IsADirectoryError):
            return False
        return manifest is not None and loc.name in manifest.bases

    if not names:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(names))) as pool:
        return sorted(n for n, yes in zip(names, pool.map(names_it, names)) if yes)


def _foreign_checkpoint(storage: Storage, loc: Location, names: Iterable[str] | None = None) -> str | None:
    """What checkpoint of another library the folder at `loc` holds (named for a refusal), or None.
    `names`: the names directly under it, where a listing gave them (else each marker is looked up)."""
    listed = set(names) if names is not None else None

    def has(name: str) -> bool:
        return name in listed if listed is not None else storage.exists(loc.key(name))

    if has("_CHECKPOINT_METADATA"):
        return "an Orbax checkpoint (it holds _CHECKPOINT_METADATA: an Orbax CheckpointManager step, or a Checkpointer's)"
    if has("_METADATA") or has("manifest.ocdbt"):
        return "an Orbax checkpoint (it holds Orbax's _METADATA / manifest.ocdbt)"
    if has(".metadata"):
        return "a PyTorch DCP checkpoint (it holds .metadata)"
    return None


def _refuse_foreign(loc: Location, other: str) -> None:
    """Refuse a save onto `loc`, which holds `other` (`_foreign_checkpoint`), saying what would be lost."""
    raise CheckpointExistsError(
        f"{loc.path} is {other}; overwrite=True would delete it and save cairn's checkpoint in its "
        "place. Save elsewhere (cairn.load reads it where it is; `cairn convert` copies it to cairn's "
        "format)")


def refuse_replacing_a_base(loc: Location, doing: str, instead: str = "use another name") -> None:
    """Refuse `doing` ("overwriting", "moving") the committed checkpoint `loc` where `referrers` name it as
    their base: it would break every one of them (their loads would fail naming it). Nothing is written;
    the error says what to do `instead`."""
    named = referrers(loc)
    if named:
        shown = ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
        raise CheckpointError(
            f"{loc.path} is the base of {shown} (incremental saves beside it refer to its data files by its "
            f"name): {doing} it would break them. Instead {instead}, or make the checkpoints that refer to "
            "it self-contained first (cairn cp makes a self-contained copy)")


class RenameCommit(CommitStrategy):
    """POSIX: write a hidden sibling folder, fsync it, rename it into place."""

    name = "rename"

    def __init__(self, storage: Storage):
        dirs = storage.dirs
        if dirs is None:
            raise TypeError(f"{storage!r} cannot rename folders; use MarkerCommit")
        super().__init__(storage)
        self.dirs: LocalDirs = dirs

    def attempt_root(self, name: str, token: str) -> str:
        return fmt.tmp_dirname(name, token)

    def put_all(self, puts: list[tuple[str, bytes]], name: str) -> None:
        """Nothing reads the hidden attempt folder before its rename, so each file is written in place and
        fsync'd (no temporary name to rename, and no folder fsync after each), then each folder fsync'd
        once. A save of 2,449 checkpointables made five fsyncs per checkpointable with a put each (its
        data file, index part and index, and its folder after each put), four now."""
        at_once(lambda kv: self.storage.write(kv[0], [kv[1]]), puts, name)
        at_once(self.dirs.sync_dir, sorted({key.rsplit("/", 1)[0] for key, _ in puts}), name)

    def check_destination(self, loc: Location, overwrite: bool) -> None:
        storage, manifest = self.storage, loc.key(fmt.MANIFEST)
        # The manifest is looked at again after the listing: another save's folder renamed into place between
        # the first look and the listing is a committed checkpoint, not a foreign folder.
        if not overwrite and not storage.exists(manifest) and storage.list_dir(loc.name) \
                and not storage.exists(manifest):
            other = _foreign_checkpoint(storage, loc)
            if other is not None:  # say what would be lost: not "a folder", a checkpoint of another library
                _refuse_foreign(loc, other)
            raise CheckpointExistsError(
                f"{loc.path} exists and is not a committed cairn checkpoint; pass overwrite=True to replace it"
            )
        super().check_destination(loc, overwrite)
        if storage.exists(loc.name) and not self.dirs.is_dir(loc.name):
            raise CheckpointExistsError(f"{loc.path} exists and is a file, not a checkpoint folder")

    def commit(self, loc: Location, token: str, manifest: bytes, needed: Iterable[str], *,
               overwrite: bool, discard: Iterable[str] = ()) -> None:
        storage, root = self.storage, self.attempt_root(loc.name, token)
        for key in discard:  # before the rename: they must not become part of the checkpoint
            try:
                storage.delete_prefix(key)
            except OSError:
                pass  # a harmless extra file inside the checkpoint
        storage.put(f"{root}/{fmt.MANIFEST}", manifest)
        self.dirs.sync_dir(root)
        # Last step before the rename: a folder taken away after it makes the rename fail.
        self._check_complete(loc, root, [*needed, f"{root}/{fmt.MANIFEST}"], overwrite)
        self._rename_into_place(loc, root, token, overwrite)

    def _rename_into_place(self, loc: Location, tmp: str, token: str, overwrite: bool) -> None:
        name = loc.name
        try:
            self.dirs.rename_dir(tmp, name)
            return
        except FileExistsError:
            if not overwrite:
                raise CheckpointExistsError(f"{loc.path} already exists (another save committed it first)") from None
        # Swap the new checkpoint in atomically, then delete the old one.
        try:
            self.dirs.rename_dir(tmp, name, exchange=True)
        except OSError:
            if self.storage.exists(f"{name}/{fmt.MANIFEST}"):
                self._swap_manifest_into(loc, tmp, token)
                return
            # Nothing committed to protect (a foreign or half-deleted folder): move it aside.
            aside = fmt.tmp_dirname(name, token + "-old")
            self.dirs.rename_dir(name, aside)
            self.dirs.rename_dir(tmp, name)
            after_commit(loc, self.storage.delete_prefix, aside)
            return
        after_commit(loc, self.storage.delete_prefix, tmp)  # the old checkpoint, swapped out

    def _swap_manifest_into(self, loc: Location, tmp: str, token: str) -> None:
        """Overwrite committed `loc` without an atomic folder exchange.

        Moving the old folder aside and the new one in would leave an instant
        (a crash window) with no checkpoint at all. Instead the new attempt's
        files, whose names carry its token and so cannot clash, move into the
        existing folder, and then one rename replaces its manifest: before it
        the old checkpoint is whole, after it the new one is. The old
        attempt's files go last.
        """
        storage, name = self.storage, loc.name
        for key in storage.list(tmp):
            rel = key[len(tmp) + 1 :]
            if rel != fmt.MANIFEST:
                self.dirs.makedirs(f"{name}/{rel.rsplit('/', 1)[0]}")
                self.dirs.rename_dir(key, f"{name}/{rel}")
        self.dirs.rename_dir(f"{tmp}/{fmt.MANIFEST}", f"{name}/{fmt.MANIFEST}")
        after_commit(loc, storage.delete_prefix, tmp)
        after_commit(loc, delete_other_attempts, storage, name, token)

    def abort(self, loc: Location, token: str) -> None:
        try:
            self.storage.delete_prefix(self.attempt_root(loc.name, token))
        except Exception:
            pass

    def write_whole(self, key: str, parts: Iterable[Any]) -> None:
        tmp = f"{key}{fmt.TMP_MARK}{secrets.token_hex(4)}"
        try:
            self.storage.write(tmp, parts)
            self.dirs.rename_dir(tmp, key)
        finally:
            self.storage.delete_prefix(tmp)

    def delete(self, name: str) -> None:
        aside = fmt.tmp_dirname(name, "del-" + secrets.token_hex(4))
        self.dirs.rename_dir(name, aside)
        self.storage.delete_prefix(aside)

    def remove_leftover(self, name: str) -> None:
        of = self.attempt_of(name)
        doomed = name
        if of is not None:
            # Take it away in one step first. If it is a save still in progress
            # (another manager's), that save's rename then fails cleanly, instead
            # of committing a folder half deleted.
            doomed = fmt.tmp_dirname(of, "del-" + secrets.token_hex(4))
            self.dirs.rename_dir(name, doomed)
        self.storage.delete_prefix(doomed)


class MarkerCommit(CommitStrategy):
    """Object stores: write in place under token names, put the manifest last, create-if-absent.

    Every request of a commit waits for the one before it (a round trip each: 10 ms or more on a
    cloud link), so the commit sends only those the protocol needs, in this order: the listing that
    proves every file the manifest names is there, then the manifest. The files of other attempts
    (an interrupted save, the checkpoint being overwritten) are taken from that same listing and
    deleted after the commit in batched requests; a fresh save sends nothing after its manifest.
    The destination check before a save is one listing of the names directly under the checkpoint.
    """

    name = "marker"

    def attempt_root(self, name: str, token: str) -> str:
        return name

    def check_destination(self, loc: Location, overwrite: bool) -> None:
        # One request, not `exists`' HEAD and listing: only a manifest makes a checkpoint here, and a
        # listing (unlike a HEAD, whose 404 says nothing more) fails naming a missing bucket before
        # anything is written, overwrite or not.
        names = self.storage.list_dir(loc.name)
        if fmt.MANIFEST in names:
            if not overwrite:
                raise CheckpointExistsError(f"{loc.path} already holds a checkpoint; pass overwrite=True to replace it")
            refuse_replacing_a_base(loc, "overwriting")
        elif not overwrite and (other := _foreign_checkpoint(self.storage, loc, names)) is not None:
            _refuse_foreign(loc, other)  # its files would be mixed with cairn's under one prefix

    def commit(self, loc: Location, token: str, manifest: bytes, needed: Iterable[str], *,
               overwrite: bool, discard: Iterable[str] = ()) -> None:
        storage = self.storage
        listed = self._check_complete(loc, loc.name, needed, overwrite)
        try:
            storage.put(loc.key(fmt.MANIFEST), manifest, create=not overwrite)
        except FileExistsError:
            raise CheckpointExistsError(f"{loc.path}: another save committed this checkpoint first") from None
        # Committed. Files of other attempts (an interrupted save, or the overwritten checkpoint) are
        # housekeeping now: best effort. Those written after the listing belong to a rival attempt
        # still running (its commit will fail) and stay as invisible leftovers for `cairn gc`.
        others = [k for k in listed if not _is_mine(k, token)]
        if others:
            after_commit(loc, storage.delete_keys, others)
        for key in discard:
            try:
                storage.delete_prefix(key)
            except OSError:
                pass  # committed already: never fail the save for a leftover

    def _check_complete(self, loc: Location, root: str, needed: Iterable[str], overwrite: bool) -> list[str]:
        try:
            return super()._check_complete(loc, root, needed, overwrite)
        except CheckpointError:
            # The winner of a race for this path removes the other attempts' files after its commit,
            # so a manifest there now (looked for after the listing that missed the files) means we lost.
            if not overwrite and self.storage.exists(loc.key(fmt.MANIFEST)):
                raise CheckpointExistsError(f"{loc.path}: another save committed this checkpoint first") from None
            raise

    def abort(self, loc: Location, token: str) -> None:
        try:
            delete_attempt(self.storage, loc.name, token)
        except Exception:
            pass

    def write_whole(self, key: str, parts: Iterable[Any]) -> None:
        self.storage.write(key, parts)  # an object appears only once its upload completes

    def delete(self, name: str) -> None:
        self.storage.delete_prefix(f"{name}/{fmt.MANIFEST}")
        self.storage.delete_prefix(name)


def strategy_for(storage: Storage) -> CommitStrategy:
    """The commit strategy of `storage`: rename where folders rename atomically, else the marker."""
    if storage.atomic_rename and storage.dirs is not None:
        return RenameCommit(storage)
    return MarkerCommit(storage)


def after_commit(loc: Location, fn: Callable[..., Any], *args: Any) -> None:
    """Run post-commit cleanup. Its failure must not fail the save: an abort
    would then delete files of the checkpoint just committed (on object stores)."""
    try:
        fn(*args)
    except Exception as e:  # invisible leftovers: gc or the next overwrite removes them
        log.warning("cairn: %s is committed, but removing leftovers failed: %s", loc.path, e)


def delete_attempt(storage: Storage, name: str, token: str) -> None:
    """Delete the files of attempt `token` under `name` (object stores write in place): one listing,
    then batched deletes where the storage has them (`Storage.batch_deletes`), not a listing, a HEAD
    and a DELETE per file as `delete_prefix` would send."""
    storage.delete_keys([key for key in storage.list(name) if f".{token}." in key.rsplit("/", 1)[-1]])


def delete_other_attempts(storage: Storage, name: str, token: str) -> None:
    """Delete every file under `name` but the manifest and those of attempt `token`."""
    storage.delete_keys([key for key in storage.list(name) if not _is_mine(key, token)])


def _is_mine(key: str, token: str) -> bool:
    """Whether `key` is the manifest or a file of attempt `token` (its name carries the token)."""
    base = key.rsplit("/", 1)[-1]
    return base == fmt.MANIFEST or f".{token}." in base

