"""A save planned before it runs: `plan_save` decides, per process, what `engine.SaveJob` then executes.

The plan (`SavePlan`) holds the checkpointables and, for each, every chunk this process writes with
its slot (file and offset, `assign`); the compression and what "auto" prices leaves with, agreed by all
processes; the attempt token; and, for an incremental save, its base. Each array leaf's codec is
decided here where it is fixed, or marked to be measured on its first chunk (`codec_decisions`; the
measuring is `codecpolicy.choose_codecs`', run by the job, since it reads host bytes). What an
incremental save refers to in its base is decided by the job as it hashes (`incremental`). `describe`
sums the plan for a dry run.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from .._core import buffers as _buffers
from .._core.gcpause import paused
from .._dist.agree import sequence
from .._dist.coord import Coordinator, default_coordinator, fetch_from
from .._errors import CheckpointError, UnsupportedTypeError, error_from_record, error_record
from .._format import manifest as fmt
from .._storage.location import Location
from .._tree.leaves import ArraySource, classify
from .._tree.perprocess import HostValues, is_per_process
from .._tree.pytree import flatten
from .assign import SaveItem, plan_item
from .codecpolicy import auto_prices, resolve_compression
from .commit import CommitStrategy, strategy_for
from .options import CHOOSING, SaveOptions, save_options_of

log = logging.getLogger("cairn")

#: A leaf's codec decision where "choose" or "auto" measures it on its first chunk (`SavePlan.codec_decisions`).
MEASURE = "measure on its first chunk"


@dataclass
class SavePlan:
    """What one process's part of a save will do, decided before anything is written (`plan_save`)."""

    loc: Location
    items: list[SaveItem]  # the checkpointables, each with this process's chunks in its files (`files`)
    root: bool
    token: str  # the attempt's token, agreed by every process
    seq: int
    coord: Coordinator
    overwrite: bool
    block_size: int
    timeout: float
    threads: int
    metadata: dict[str, Any]
    strategy: CommitStrategy
    # None: raw blocks; "choose"/"auto": a codec per leaf measured on a sample; else one codec (`codecpolicy`)
    compression: str | None
    prices: dict[str, Any] = field(default_factory=dict)  # what "auto" prices leaves with (`auto_prices`)
    base: Any = None  # an incremental save's base (a sibling's `Location`), or None
    hashes: bool = False  # an incremental save's block hashes, with or without a base
    base_required: bool = True
    started: float = field(default_factory=time.perf_counter)  # when planning began (the blocking time's start)

    def codec_decisions(self) -> dict[str, dict[int, str]]:
        """Per checkpointable, per array leaf this process writes a chunk of: its codec where the plan fixes
        it ("none" without compression), or `MEASURE` where "choose" or "auto" measures it on its first chunk
        (on the process that writes that chunk; the others learn its choice before they write)."""
        out: dict[str, dict[int, str]] = {}
        for item in self.items:
            mine = out[item.name] = {}
            written = {leaf for leaf, _cell in item.sources}
            for i, src in enumerate(item.leaves):
                if not isinstance(src, ArraySource) or i not in written:
                    continue
                if self.compression is None:
                    mine[i] = "none"
                elif self.compression in CHOOSING:
                    mine[i] = MEASURE
                else:
                    mine[i] = self.compression
        return out

    def describe(self) -> dict[str, Any]:
        """The plan summed, for a dry run: this process's files, chunks and bytes per checkpointable, its
        leaves by codec decision, the compression and, for an incremental save, its base."""
        decisions = self.codec_decisions()
        items: dict[str, Any] = {}
        for item in self.items:
            slots = [s for f in item.files for s in f]
            by_codec: dict[str, int] = {}
            for c in decisions[item.name].values():
                by_codec[c] = by_codec.get(c, 0) + 1
            items[item.name or "(root)"] = {"files": len(item.files), "chunks": len(slots),
                                            "bytes": sum(s.nbytes for s in slots), "leaves": by_codec}
        return {"path": self.loc.path, "process": self.coord.process_index, "token": self.token,
                "compression": self.compression or "raw", "block_size": self.block_size,
                "base": getattr(self.base, "path", None), "hashes": self.hashes, "items": items}


#: A save of more checkpointables than this says, once per process, what they cost (`_split_items`).
MANY_CHECKPOINTABLES = 256
_told_many = False


def _split_items(state: Any, where: str = "") -> tuple[bool, list[tuple[str, Any]]]:
    """(root, [(name, tree)]): a non-empty mapping with string keys is saved as named checkpointables,
    one per key, anything else as one root tree (docs/FORMAT.md §1)."""
    from collections.abc import Mapping

    global _told_many
    if isinstance(state, Mapping) and state and all(isinstance(k, str) for k in state):
        if len(state) > MANY_CHECKPOINTABLES and not _told_many:
            _told_many = True
            log.warning(
                "cairn: %s: saving %d checkpointables, one per key of the state's top-level mapping, each its own "
                "folder of up to three files written durably (an index, an index part, a data file). A flat mapping of "
                "many arrays (a state dict) saves and loads several times faster as one checkpointable: nest it "
                "under one key, e.g. {'model': state} (docs/PERFORMANCE.md, \"Thousands of checkpointables\"). "
                "Said once per process.", where or "a save", len(state))
        return False, list(state.items())
    return True, [("", state)]


def plan_save(
    loc: Location,
    state: Any,
    options: SaveOptions | None = None,
    *,
    block_size: int = fmt.DEFAULT_BLOCK_SIZE,
    min_file_bytes: int = 32 << 20,
    metadata: dict[str, Any] | None = None,
    base: Any = None,
    hashes: bool = False,
    base_required: bool = True,
    **changes: Any,
) -> SavePlan:
    """This process's plan of saving `state` at `loc`: `state` validated, its items and each chunk's slot
    in this process's files planned, the attempt token, the compression and "auto"'s prices agreed with
    the other processes (the primary checks the destination). Nothing is written.

    `options` with keyword `changes` to them (`SaveOptions`' names) say how to
    save; `block_size` and `min_file_bytes` are the format's knobs, for tests.
    `base` (a sibling checkpoint's path or `Location`) or `hashes` make the save
    incremental (format version 4, `incremental`); with `base_required` False a
    base that is not committed when the save runs gives a self-contained save.
    """
    t0 = time.perf_counter()
    opts = save_options_of(options, changes)
    _buffers.load_pool.clear()  # kept for a process's next load; a saving process needs the memory (as `cairn.load`)
    overwrite, threads, split_replicas, timeout = opts.overwrite, opts.threads, opts.split_replicas, opts.timeout
    coord = opts.coordinator or default_coordinator()
    me = coord.process_index
    if not fmt.MIN_BLOCK <= block_size <= fmt.MAX_BLOCK:
        raise ValueError(f"block_size must be in [{fmt.MIN_BLOCK}, {fmt.MAX_BLOCK}], got {block_size}")
    if metadata is not None:
        try:
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise UnsupportedTypeError(f"{loc.path}: metadata must be JSON-serializable ({e})") from None
    root, pairs = _split_items(state, loc.path)
    items = []
    seq = sequence("save")
    hosts = HostValues(coord, seq, loc.path)  # per-process values; the check that other host values agree
    with paused(), hosts.reporting():  # thousands of leaves make tens of thousands of live objects, none garbage
        for name, tree in pairs:
            where = loc.path
            try:
                structure, flat = flatten(tree, item=name, is_leaf=is_per_process)
            except ValueError as e:
                raise UnsupportedTypeError(f"{where}: {e}") from None
            structure, flat = hosts.split(name, structure, flat)
            leaves = [classify(path, x, where, name) for path, x in flat]
            item = SaveItem(name, fmt.ROOT_ITEM_DIR if root else fmt.item_dirname(name), structure, leaves)
            plan_item(item, me, split_replicas, threads, min_file_bytes, where)
            hosts.add(item)
            items.append(item)
    strategy = strategy_for(loc.storage)
    compression = resolve_compression(opts.compression, loc.storage)
    token, compression, prices = _agree_token(loc, strategy, coord, seq, overwrite, timeout, hosts, compression)
    for item in items:
        if item.name in hosts.own:  # its per-process leaves have their numbers now
            plan_item(item, me, split_replicas, threads, min_file_bytes, loc.path)
    return SavePlan(
        loc=loc, items=items, root=root, token=token, seq=seq, coord=coord, overwrite=overwrite,
        block_size=block_size, timeout=timeout, threads=threads, metadata=metadata or {}, strategy=strategy,
        compression=compression, prices=prices, base=base, hashes=hashes, base_required=base_required, started=t0,
    )


def _agree_token(loc: Location, strategy: CommitStrategy, coord: Coordinator, seq: int, overwrite: bool,
                 timeout: float, hosts: HostValues, compression: str | None) -> tuple[str, str | None, dict[str, Any]]:
    """The primary checks the destination and the processes' host values, and picks the attempt token,
    the compression and what "auto" prices leaves with (`auto_prices`: the storage's bandwidth, as
    declared or measured by the primary, and its codec factor; what "auto" means can depend on a
    process's mounts and measurements); all processes learn them."""
    key = f"cairn/save/{seq}/token"
    if coord.process_index == 0:
        msg: dict[str, Any] = {"token": secrets.token_hex(6), "compression": compression,
                               "prices": auto_prices(loc.storage)}
        try:
            strategy.check_destination(loc, overwrite)
            msg.update(hosts.gather(timeout))
        except CheckpointError as e:
            msg = {"error": error_record(e, 0), "message": str(e)}
        coord.publish(key, json.dumps(msg).encode())
    else:
        hosts.publish()
        msg = json.loads(fetch_from(coord, key, timeout, writer=0))
    if "error" in msg:
        raise error_from_record(msg["error"], msg["message"])
    hosts.place(msg)
    return msg["token"], msg.get("compression", compression), msg.get("prices") or auto_prices(loc.storage)
