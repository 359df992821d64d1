"""The blocking phase of an async save: protect every chunk this process writes.

Chunks are copied to host memory, in write order, while they fit in the
snapshot budget (None: no limit). Each remaining chunk of a `jax.Array` gets
an on-device copy instead, so a later donation, update or deletion of the
caller's array cannot touch it; the writer threads bring those copies to host
one chunk at a time and release them once written, so host memory stays
within the budget plus one chunk per writer thread.

Where the time goes, and what is done about it:
- Host copies go into buffers kept from the previous async save
  (`_buffers.snapshot_pool`): memory already touched copies at memcpy speed,
  fresh memory at the speed of first-touch page faults (several times slower
  on some hosts, and slowest for small buffers).
- Consecutive chunks of a file share one buffer (a *slab*) of at least
  `SLAB_BYTES`: one pool entry and one allocation per slab, not per chunk
  (measured on the 2-core VM: fresh 8 MiB buffers filled at 3.6-4.8 GiB/s,
  2 MiB ones at 1.4-1.8 GiB/s). The pool allocates them without numpy's
  transparent-huge-page advice, which made first touches slower there
  (`_buffers.aligned_empty`).
- The copies run on two threads, the caller's and one more, each copying
  half of the bytes in one go (numpy releases the GIL while it copies): no
  hand-off per chunk, which a state of thousands of small chunks would pay
  thousands of times.
- An incremental save decides first which chunks of unchanged `jax.Array`s
  its base holds (`incremental.Incremental.decide_unchanged`): those are
  never read, so they are not copied at all.
- Chunks on an accelerator are copied on the device, one jitted copy per
  chunk, where the device's memory has room (`shardings.device_snapshot`):
  the blocking phase dispatches the copies and returns (the copies run at
  the device memory's speed, and no transfer to host memory, 0.15-0.6 s for
  2 GiB on a TPU v5e, is waited for); the writers' host-copy pipeline
  (`HostPipeline`) brings them to host in the background and frees each
  device copy once its bytes are over.
- Where device memory has no room, they start all their device-to-host
  transfers in one batched ``device_put`` (`start_to_host`): into pinned host
  memory on GPUs, as Orbax does there, onto the CPU backend elsewhere
  (docs/performance-gpu.md). The blocking phase only starts them; the writer
  threads wait for each chunk's bytes.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._core.buffers import snapshot_pool
from .assign import Concat

#: Consecutive chunks of a file are copied into shared buffers of at least this size.
SLAB_BYTES = 8 << 20


def snapshot(job: Any, budget_bytes: int | None = None) -> None:
    """Protect the chunks of `job` (a `_save.SaveJob`), filling `job.stats` and `job.pooled`."""
    from .._tree import shardings
    from .._tree.shardings import device_copy, on_cpu, start_to_host

    t0 = time.perf_counter()
    if job.inc is not None:  # an incremental save: unchanged jax.Arrays the base holds need no copy
        from .incremental import UNCHANGED

        job.inc.decide_unchanged(job.items, job.loc.path)
    used = device_bytes = 0
    host: list[tuple[Any, int, tuple[int, int], Any, int]] = []  # (item, file, key, host-visible source, bytes)
    to_host: list[tuple[Any, tuple[int, int], Any]] = []  # accelerator chunks: (item, key, array)
    protected: list[Any] = []
    for item in job.items:
        sources = item.sources
        for k, slots in enumerate(item.files):
            for slot in slots:
                key = (slot.leaf, slot.cell)
                src = sources[key]
                if job.inc is not None and src is UNCHANGED:  # decided: never read (`decide_unchanged`)
                    continue
                nbytes = slot.nbytes
                merged = type(src) is Concat
                if type(src) is not np.ndarray and budget_bytes is not None and used + nbytes > budget_bytes:
                    copy = Concat([device_copy(p) for p in src.parts]) if merged else device_copy(src)
                    sources[key] = copy
                    protected.extend(copy.parts if merged else [copy])
                    device_bytes += nbytes
                    continue
                used += nbytes
                # numpy leaves are the caller's: they may change after save_async returns. A CPU
                # jax.Array's host view is its device buffer, which a donation may reuse.
                first = src.parts[0] if merged else src
                if type(first) is np.ndarray or (on_cpu(first) and shardings.DEVICE_SNAPSHOT != "always"):
                    host.append((item, k, key, src, nbytes))
                else:
                    to_host.append((item, key, src))
    if to_host:
        # The transfers make fresh host arrays (the copy): all of them start here and run on
        # while the host-visible chunks are copied below and after this returns. A transfer's
        # result is a new array that no later donation, update or deletion of its source can
        # change (the runtime orders them after it), so the blocking phase does not wait for
        # the bytes: the writer threads do, chunk by chunk (`shardings.host_view`).
        arrays = [p for _, _, a in to_host for p in (a.parts if type(a) is Concat else [a])]
        copies = shardings.device_snapshot(arrays)
        if copies is not None:  # on-device copies: the writers' host-copy pipeline brings them over
            job.stats.device_snapshot_bytes = sum(int(a.nbytes) for a in arrays)
            used -= job.stats.device_snapshot_bytes  # no host memory until the pipeline takes them
        hosts = iter(copies if copies is not None else start_to_host(arrays))
        for item, key, a in to_host:
            item.sources[key] = Concat([next(hosts) for _ in a.parts]) if type(a) is Concat else next(hosts)
    _copy(job, host)
    if protected:
        import jax

        # Wait for the copies, so that the caller may delete or donate the
        # originals the moment this returns.
        jax.block_until_ready(protected)
    snapshot_pool.reserve(used)
    job.stats.snapshot_bytes = used
    job.stats.device_copy_bytes = device_bytes
    job.stats.snapshot_s = time.perf_counter() - t0


def _copy(job: Any, host: list[tuple[Any, int, tuple[int, int], Any, int]]) -> None:
    """Copy host-visible chunks into slabs: consecutive chunks of one file, `SLAB_BYTES` or more each."""
    work: list[tuple[np.ndarray, int, Any, tuple[int, int], Any, int]] = []  # (slab, offset, item, key, src, n)
    i = 0
    while i < len(host):
        item, k = host[i][0], host[i][1]
        j, total = i, 0
        while j < len(host) and host[j][0] is item and host[j][1] == k and total < SLAB_BYTES:
            total += host[j][4]
            j += 1
        slab = snapshot_pool.take(total)
        job.pooled.setdefault((item.name, k), []).append(slab)
        pos = 0
        for _, _, key, src, n in host[i:j]:
            work.append((slab, pos, item, key, src, n))
            pos += n
        i = j
    half, acc, cut = sum(w[5] for w in work) / 2, 0, len(work)
    for i, w in enumerate(work):
        if acc >= half:
            cut = i
            break
        acc += w[5]

    def run(part: list[tuple[np.ndarray, int, Any, tuple[int, int], Any, int]]) -> None:
        for slab, pos, item, key, src, n in part:
            if type(src) is Concat:  # a merged chunk: its pieces one after another along axis 0
                vs = [np.asarray(p) for p in src.parts]
                if sum(v.nbytes for v in vs) != n:
                    item.sources[key] = np.concatenate(vs)  # the writer reports the size
                    continue
                at = pos
                for v in vs:
                    _copy_into(slab[at : at + v.nbytes], v)
                    at += v.nbytes
                shape = (sum(v.shape[0] for v in vs), *vs[0].shape[1:])
                item.sources[key] = slab[pos : pos + n].view(vs[0].dtype).reshape(shape) if n else np.concatenate(vs)
                continue
            v = np.asarray(src)
            # A chunk of other than its planned size gets a copy of its own; the writer reports it.
            item.sources[key] = _copy_into(slab[pos : pos + n], v) if v.nbytes == n else np.array(v)

    if 0 < cut < len(work):
        with ThreadPoolExecutor(1, thread_name_prefix="cairn-snapshot") as pool:
            second = pool.submit(run, work[cut:])
            run(work[:cut])
            second.result()
    else:
        run(work)


def _copy_into(dst: np.ndarray, src: np.ndarray) -> np.ndarray:
    """Copy `src` into the bytes `dst` (a uint8 buffer of its size); returns the copy as `src`'s array."""
    out = dst.view(src.dtype).reshape(src.shape) if src.nbytes else np.empty_like(src)
    if src.flags.c_contiguous:  # as bytes: one memcpy, whatever the dtype
        dst[...] = src.reshape(-1).view(np.uint8)
    else:
        np.copyto(out, src)
    return out


class HostPipeline:
    """Device-to-host copies of a blocking save's accelerator chunks, started ahead of their consumers.

    A blocking save has no snapshot: its writers (and, for a compressed save, the codec choosing)
    used to bring each device chunk to host when they reached it, one synchronous copy at a time,
    so choosing and coding waited on serial copies (on a TPU v5e host: 2.05 s of host
    copies in a 4.86 s data phase). Here the copies start in `order` (the order the consumers take
    the chunks: the save's files in turn, each file's chunks in slot order; `sizes` their bytes,
    `srcs` their device arrays), batched, as soon as the bytes started and not yet taken fit in
    `budget`; each `take` frees its bytes and starts the next ones. So the transfers of later
    chunks run while earlier ones are chosen, coded and written.

    - Bounded: the bytes started ahead and not yet taken never pass `budget` (but for one chunk
      when none is held, so that a chunk larger than the budget still moves).
    - Never a copy twice: a chunk is started at most once. A consumer that comes to a chunk not
      started yet (its writer ran ahead of the budget) gets None from `take` and copies it itself,
      and the pipeline skips it from then on (so does `peek`, the codec choosing's look).
    - Never a wait on the budget: a consumer waits only for a chunk already started, so the
      consumers' own order (a writer's coding window, the codec choosing) cannot deadlock with it.
    - Errors: a failure to start a batch is raised to every consumer of its chunks (and to the
      consumer whose `take` started it); a transfer's own failure surfaces where its bytes are read.

    `start` is `shardings.start_to_host` (a test passes its own)."""

    def __init__(self, order: list[Any], sizes: list[int], srcs: list[Any], budget: int, start: Any = None):
        import threading

        self._keys, self._sizes = order, sizes
        self._size = dict(zip(order, sizes))
        self._srcs: dict[Any, Any] = dict(zip(order, srcs))  # key -> its device array, until started
        self._budget = max(0, budget)
        self._start = start
        self._next = 0  # the first key of `order` not started or skipped
        self._state: dict[Any, Any] = {}  # key -> _PENDING (being started), a result, or an exception
        self._held = 0  # bytes started and not yet taken
        self._skip: set[Any] = set()  # keys a consumer copied itself
        self._cv = threading.Condition()
        self.started = 0  # chunks started (for tests and benchmarks)
        self.max_held = 0

    def fill(self) -> None:
        """Start the next chunks of `order` that fit in the budget (at least one when none is held)."""
        with self._cv:
            batch: list[Any] = []
            while self._next < len(self._keys):
                key, n = self._keys[self._next], self._sizes[self._next]
                if key in self._skip:
                    self._next += 1
                    continue
                if self._held + n > self._budget and (self._held or batch):
                    break
                self._held += n
                self._next += 1
                self._state[key] = _PENDING
                batch.append(key)
            self.max_held = max(self.max_held, self._held)
            srcs = [self._srcs.pop(k) for k in batch]
        # Started in runs of at most BATCH_BYTES (each run one batched call), so that the first chunks'
        # transfers are queued, and land, before later ones.
        runs: list[list[int]] = []
        size = BATCH_BYTES
        for j, k in enumerate(batch):
            if size >= BATCH_BYTES:
                runs.append([])
                size = 0
            runs[-1].append(j)
            size += self._size[k]
        for n_run, run in enumerate(runs):
            keys = [batch[j] for j in run]
            try:
                if self._start is None:
                    from .._tree.shardings import start_to_host

                    got: Any = start_to_host([srcs[j] for j in run])
                else:
                    got = self._start([srcs[j] for j in run])
                if len(got) != len(keys):
                    raise RuntimeError(f"started {len(got)} device-to-host copies for {len(keys)} chunks")
            except BaseException as e:
                with self._cv:  # this run's chunks and the later ones reserved with it
                    for k in (batch[j] for r in runs[n_run:] for j in r):
                        self._state[k] = e
                    self._cv.notify_all()
                raise
            with self._cv:
                for k, h in zip(keys, got):
                    self._state[k] = h
                self.started += len(keys)
                self._cv.notify_all()

    def __contains__(self, key: Any) -> bool:
        return key in self._srcs or key in self._state

    def _wait(self, key: Any) -> Any:
        while self._state.get(key) is _PENDING:
            self._cv.wait()
        got = self._state.get(key, _CLOSED)
        if got is _CLOSED:
            raise RuntimeError("the save's device-to-host copies were stopped (the save failed)")
        if isinstance(got, BaseException):
            raise got
        return got

    def peek(self, key: Any) -> Any:
        """The started transfer of `key` (kept for its `take`), or None where it has not started: then
        the caller copies `key` itself and the pipeline never starts it (the codec choosing ran
        ahead of the budget; its own copy serves the writer where it is kept)."""
        with self._cv:
            if key in self._state:
                return self._wait(key)
            if self._srcs.pop(key, None) is not None:
                self._skip.add(key)
            return None

    def take(self, key: Any, low_water: float = 0.875) -> Any:
        """The started transfer of `key`, its bytes freed from the budget (and the next chunks started
        once the held bytes fall under `low_water` of it), or None where it had not started: then the
        caller copies `key` itself and the pipeline never starts it."""
        with self._cv:
            if key not in self._state:
                if key in self._srcs:
                    self._skip.add(key)
                    self._srcs.pop(key)
                return None
            got = self._wait(key)
            del self._state[key]
            self._held -= self._size[key]
            refill = self._next < len(self._keys) and (self._held <= low_water * self._budget or not self._held)
        if refill:
            self.fill()
        return got

    def close(self) -> None:
        """Drop every transfer not taken (a failed save) and start nothing more."""
        with self._cv:
            self._next = len(self._keys)
            self._state.clear()
            self._srcs.clear()
            self._held = 0
            self._cv.notify_all()


_PENDING = object()
_CLOSED = object()

#: The host-copy pipeline starts its transfers in batched calls of at most this many bytes each.
BATCH_BYTES = 64 << 20
