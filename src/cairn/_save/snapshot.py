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
- Chunks on an accelerator start all their device-to-host transfers in one
  batched ``device_put`` (`start_to_host`): into pinned host memory on GPUs,
  as Orbax does there (onto the CPU backend it ran at 0.6-2 GiB/s on an
  H200), onto the CPU backend elsewhere (on a TPU v5e it was 2.9x faster than
  pinned memory; docs/performance-gpu.md). The blocking phase only starts
  them; the writer threads wait for each chunk's bytes.
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
    from .._tree.shardings import device_copy, on_cpu, start_to_host

    t0 = time.perf_counter()
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
                if type(first) is np.ndarray or on_cpu(first):
                    host.append((item, k, key, src, nbytes))
                else:
                    to_host.append((item, key, src))
    if to_host:
        # The transfers make fresh host arrays (the copy): all of them start here and run on
        # while the host-visible chunks are copied below and after this returns. A transfer's
        # result is a new array that no later donation, update or deletion of its source can
        # change (the runtime orders them after it), so the blocking phase does not wait for
        # the bytes: the writer threads do, chunk by chunk (`shardings.host_view`).
        hosts = iter(start_to_host([p for _, _, a in to_host for p in (a.parts if type(a) is Concat else [a])]))
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
