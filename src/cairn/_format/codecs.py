"""Per-block codecs: compress and decompress one checksum block on its own.

Pure: no file or network I/O, no JAX. A block is at most one checksum block
(cairn writes 1 MiB) of little-endian array bytes, always a whole number of
elements; each is coded on its own so a range read of a chunk touches only the
blocks it needs. The stored layouts are specified in docs/FORMAT.md (drafted
in docs/compression.md); the codec library is `zstandard` (plain zstd frames,
so any zstd implementation decodes them); the optional ``"blosc2"`` codec is
written and read by python-blosc2 (C-Blosc2 chunks), imported on first use.

Codecs, by their stable names (recorded per leaf in the manifest):

- ``"none"``: the raw bytes.
- ``"zstd"``: one zstd frame of the raw bytes (level 1).
- ``"planes"``: byte planes. Byte p of every element goes to plane p (p = 0 is
  the least significant byte); planes that compress (the exponent-carrying
  ones of floats, the high bytes of small integers, zeros) are zstd frames,
  near-random planes (mantissa bytes) are stored raw without spending CPU on
  them. A 3-byte header plus one length per coded plane says which is which.
- ``"blosc2"``: one C-Blosc2 chunk of the block: byte shuffle (the same byte
  planes), each plane a zstd level-1 stream of its own (``ALWAYS_SPLIT``), all
  in C in one call that releases the GIL: 3x `planes`' decoding speed on many
  cores (docs/compression.md, "On many cores"). C-Blosc2 is called directly where
  `blosc2lib` shows it codes the same chunks (one context per thread, chunks coded
  into cairn's buffers and decoded into place), else through python-blosc2's
  `compress2` / `decompress2`. Needs python-blosc2, an optional
  extra (``pip install cairn-ckpt[fast]``); `choose` takes it only where that
  is importable (and a save only where it codes the leaf's element size faster on the host's
  cores: `choose_sized`'s `blosc2`), and a reader without it says so, naming the block.
- ``"blosc2-lz4"``: one C-Blosc2 chunk of the block as ``"blosc2"``, but with the bit shuffle then
  LZ4 at level 5 (`blosc2lib.SETTINGS`): 3-10% more bytes, coded 1.5-3x as fast. `choose` never
  takes it; a save's "auto" weighs it by predicted time (`_save.engine.decide_leaf`).

`choose` picks a leaf's codec by measuring the candidates on a sample of the
leaf (`sample` takes one). Everything heavy (zstd, numpy copies and integer
ops on plain dtypes) releases the GIL, so writer and reader threads run in
parallel. Compression contexts are per thread (zstandard's are not thread-safe).

Decoding never trusts a stored size: the caller passes the raw size it expects
(known from the index before decompressing), every header field is bounded by
it and by the stored length, and anything else raises `CorruptCheckpointError`
with `where` (the caller's checkpoint and key path) in the message. Memory
allocated while decoding is bounded by the raw size (plus zstd's fixed
working buffers), whatever a header says.
"""

from __future__ import annotations

import importlib.util
import itertools
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zstandard

from .._errors import CodecUnavailableError, CorruptCheckpointError
from . import blosc2lib

#: The codec names the format knows, in the order `choose` prefers them at equal size.
CODECS = ("none", "blosc2", "planes", "zstd", "blosc2-lz4")
#: The codecs whose blocks are C-Blosc2 chunks (`blosc2lib.SETTINGS`: how cairn codes each).
BLOSC2_CODECS = tuple(blosc2lib.SETTINGS)
#: The Blosc filters each C-Blosc2 codec's chunks may name (docs/FORMAT.md §6.4): 0 none, 1 the byte
#: shuffle, 2 the bit shuffle (a "blosc2-lz4" block: format version 6, §6.6).
_B2_FILTERS = {"blosc2": (0, 1), "blosc2-lz4": (0, 1, 2)}

#: `choose` keeps "none" unless a codec stores at most this fraction of the raw sample bytes.
MIN_SAVING = 0.04
#: Among codecs within this fraction of the smallest, `choose` takes the first of `CODECS`.
NEAR = 0.01
#: How many bytes of a leaf `sample` takes (in up to `SAMPLE_PIECES` pieces spread over it).
SAMPLE_BYTES = 256 << 10
SAMPLE_PIECES = 4

#: A plane is coded when its sampled order-0 entropy is below this many bits per byte
#: (about 6% under 8: a plane above it saves too little to pay for zstd's time).
PLANE_MAX_BITS = 7.5
#: A plane probe looks at this many bytes of the plane (evenly strided).
PLANE_PROBE = 4096
#: A block smaller than this is not probed: zstd tries every plane. Its own check of a
#: near-random plane costs less than the probe's numpy calls there (measured on trained states:
#: 2.5x faster for leaves under 64 KiB, 1.1-1.3x up to 1 MiB; docs/compression.md), and it runs
#: without the GIL where the probe's small numpy calls hold it: 256 KiB leaves of f32 moments
#: coded 7-10% faster on one thread unprobed, and stored 0.6% smaller.
PLANE_PROBE_MIN_BYTES = 512 << 10
#: A coded plane is stored raw after all when zstd saves less than this fraction.
PLANE_MIN_SAVING = 0.02
#: The largest raw block the format allows (FORMAT.md: block_size <= 2^30).
MAX_BLOCK = 1 << 30
#: The most planes a "planes" block can have (complex128's 16 bytes).
MAX_PLANES = 16

ZSTD_LEVEL = 1  # the "zstd" codec
#: `choose` takes "blosc2" (where it is a candidate: compression="fast") when its sample stores within this
#: fraction of the smallest codec's: it decodes 3x and encodes 1.3x as fast as "planes" on the TPU
#: host's 12 threads, and stores 0-2% more on f32 moments and 3% (1 MiB blocks) to 4.7% (32 KiB
#: chunks) more on bf16 parameters, whose exponent planes "planes" codes with zstd settings tuned for
#: them (docs/compression.md, "On one core").
BLOSC2_NEAR = 0.05
#: What to install for "blosc2" (pyproject's optional extra).
BLOSC2_EXTRA = "cairn-ckpt[fast]"
_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame's first 4 bytes


def _plane_params() -> zstandard.ZstdCompressionParameters:
    # zstd's fast strategy with the smallest hash table and the longest minimum match:
    # on exponent planes (2-3 bits of entropy a byte) level 1 spends its time finding short
    # matches that Huffman coding of the literals does better without; measured on trained
    # bf16/f32 states these settings compress 2-3x faster, decompress ~1.5x faster and store
    # fewer bytes than level 1 (docs/compression.md).
    return zstandard.ZstdCompressionParameters(
        strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6, search_log=1,
        min_match=7, target_length=0, write_content_size=True, write_checksum=False,
        write_dict_id=False)


_local = threading.local()


def _compressor(kind: str) -> zstandard.ZstdCompressor:
    c = getattr(_local, kind, None)
    if c is None:
        if kind == "planes":
            c = zstandard.ZstdCompressor(compression_params=_plane_params())
        else:
            c = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=False, write_content_size=True,
                                         write_dict_id=False)
        setattr(_local, kind, c)
    return c


def _decompressor(window: int) -> zstandard.ZstdDecompressor:
    log = max(10, (max(window, 1) - 1).bit_length())
    cache = getattr(_local, "d", None)
    if cache is None:
        cache = _local.d = {}
    d = cache.get(log)
    if d is None:
        d = cache[log] = zstandard.ZstdDecompressor(max_window_size=1 << log)
    return d


def _scratch(n: int, name: str = "scratch") -> np.ndarray:
    """A per-thread reusable byte buffer `name` of at least n bytes (fresh pages cost more than zstd)."""
    buf = getattr(_local, name, None)
    if buf is None or buf.nbytes < n:
        buf = np.empty(max(n, 1 << 16), np.uint8)
        setattr(_local, name, buf)
    return buf[:n]


_blosc2_module: Any = None
_blosc2_found: bool | None = None


def blosc2_available() -> bool:
    """Whether python-blosc2 can be imported (looked up once; not imported until a block is coded)."""
    global _blosc2_found
    if _blosc2_found is None:
        _blosc2_found = _blosc2_module is not None or importlib.util.find_spec("blosc2") is not None
    return _blosc2_found


def _blosc2(where: str = "", codec: str = "blosc2") -> Any:
    """python-blosc2, imported on first use (it takes a third of a second: not at `import cairn`), with
    `set_releasegil(True)`: without it every call holds the GIL and threads coding at once take turns.
    The setting is process-wide; it only lets C-Blosc2 calls without Python codecs or filters run
    outside the GIL. Missing: a `CheckpointError` naming `where`, the codec and the extra to install."""
    global _blosc2_module
    if _blosc2_module is None:
        try:
            import blosc2
        except ImportError:
            at = f"{where}: " if where else ""
            raise CodecUnavailableError(f"{at}the {codec!r} codec needs python-blosc2, which is not installed: "
                                  f"pip install '{BLOSC2_EXTRA}' (or pip install blosc2)") from None
        blosc2.set_releasegil(True)
        _blosc2_module = blosc2
    return _blosc2_module


def _blosc2_decoder(where: str = "", codec: str = "blosc2") -> blosc2lib.Direct | None:
    """C-Blosc2 called directly to decode (`blosc2lib.decoder`: found without importing python-blosc2,
    which a restart's first compressed load paid 1.3 s for on the TPU host), else None, python-blosc2
    imported: its functions decode. Missing: `_blosc2`'s error."""
    direct = blosc2lib.decoder()
    if direct is None:
        _blosc2(where, codec)
    return direct


def _blosc2_encoder(where: str = "", codec: str = "blosc2") -> blosc2lib.Direct | None:
    """C-Blosc2 called directly to code: found and checked without importing python-blosc2
    (`blosc2lib.encoder`: each probe chunk's header records cairn's settings), else through python-blosc2,
    checked against its `compress2` (`blosc2lib.load`); None: `compress2` codes. Missing: `_blosc2`'s error."""
    direct = blosc2lib.encoder()
    return direct if direct is not None else blosc2lib.load(_blosc2(where, codec))


_blosc2_kw: dict[tuple[str, int], dict[str, Any]] = {}


def _blosc2_params(codec: str, k: int) -> dict[str, Any]:
    """`compress2`'s keywords for `codec`'s chunks of elements of k bytes (`blosc2lib.SETTINGS`,
    docs/FORMAT.md §6.4): "blosc2" byte shuffle and zstd level 1, "blosc2-lz4" bit shuffle and LZ4 level
    5; every filtered byte stream compressed on its own, one thread (the caller's pool supplies the rest:
    C-Blosc2's own threads inside a 1 MiB chunk coded 5x slower on the TPU host)."""
    kw = _blosc2_kw.get((codec, k))
    if kw is None:
        b2 = _blosc2()
        st = blosc2lib.SETTINGS[codec]
        kw = _blosc2_kw[(codec, k)] = {"typesize": k, "codec": b2.Codec(st.compcode), "clevel": st.clevel,
                                       "filters": [b2.Filter(st.filter)], "splitmode": b2.SplitMode.ALWAYS_SPLIT,
                                       "nthreads": 1}
    return kw


def _as_u8(raw: Any) -> np.ndarray:
    return np.frombuffer(raw, np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1).view(np.uint8)


def _check_dtype(dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.hasobject or dt.fields is not None or dt.itemsize == 0 or dt.itemsize > MAX_PLANES:
        raise ValueError(f"no codec for dtype {dt}")
    return dt


# --------------------------------------------------------------------------------- encode


def encode(codec: str, raw: Any, dtype: Any) -> bytes:
    """The stored bytes of one block `raw` (little-endian bytes of whole elements of `dtype`)."""
    dt = _check_dtype(dtype)
    u8 = _as_u8(raw)
    if u8.nbytes % dt.itemsize:
        raise ValueError(f"a block of {u8.nbytes} bytes is not a whole number of {dt} elements")
    if codec == "none":
        return u8.tobytes()
    if codec == "zstd":
        return _compressor("zstd").compress(u8.data)
    if codec == "planes":
        return _encode_planes(u8, dt.itemsize)
    if codec in BLOSC2_CODECS:
        direct = _blosc2_encoder(codec=codec)
        if direct is None or not u8.nbytes:  # (an empty block: a header alone, which the batch path never codes)
            return _blosc2(codec=codec).compress2(u8, **_blosc2_params(codec, dt.itemsize))
        return bytes(_encode_blosc2_direct(direct, [(codec, u8, u8.nbytes, dt.itemsize)])[0][0])
    raise ValueError(f"unknown codec {codec!r} (known: {', '.join(CODECS)})")


def encode_run(codec: str, raw: Any, block: int, dtype: Any, threads: int = 1) -> list[Any]:
    """The stored forms of the consecutive `block`-byte blocks of `raw` (the last may be shorter),
    byte for byte what `encode` gives each block on its own, as bytes-like objects (memoryviews of
    one buffer the run's blocks share). `encode_runs` of one run."""
    return encode_runs([(codec, raw, block, dtype)], threads)[0]


def encode_runs(runs: Sequence[tuple[str, Any, int, Any]], threads: int = 1, coders: int = 1,
                alloc: Callable[[int], np.ndarray] | None = None) -> list[list[Any]]:
    """`encode_run` of each ``(codec, raw, block, dtype)`` of `runs`, coded as one batch; `coders`: how many
    threads code batches at once (a save's coder pool), from `BLOSC2_JOIN_MIN_CODERS` on "blosc2" chunks
    are gathered into shared buffers (`BLOSC2_JOIN_BYTES`). `alloc(n)`: where the buffers that hold the
    stored blocks come from (a uint8 array of n bytes; default a new one): a save lends them from a pool
    that takes each back once its blocks are written (`_core.buffers.SlabPool`).

    The work is a few large calls that release the GIL, not a dozen per block: the probes of every
    block and plane of a run are one gather and one bincount; the planes of all runs of one
    element size are split by one numpy pass per plane (several runs, such as many small leaves,
    first joined into one array); every plane (and every "zstd" block) of the batch is compressed
    by one `multi_compress_to_buffer` call of zstandard, in C, on `threads` threads of its own;
    and each run's stored blocks are joined into one buffer. Threads coding batches at once then
    scale over cores, where per-block numpy and zstd calls each had to take the GIL back
    (docs/compression.md, "On many cores").
    """
    checked = []
    for codec, raw, block, dtype in runs:
        dt = _check_dtype(dtype)
        u8 = _as_u8(raw)
        k = dt.itemsize
        if block <= 0 or block % k or u8.nbytes % k:
            raise ValueError(f"blocks of {block} bytes over {u8.nbytes} bytes are not whole {dt} elements")
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r} (known: {', '.join(CODECS)})")
        checked.append((codec, u8, block, k))
    out: list[list[Any]] = [[] for _ in checked]
    zstd_runs: list[int] = []
    planes_by_k: dict[int, list[int]] = {}
    blosc2_runs: list[int] = []
    for r, (codec, u8, block, k) in enumerate(checked):
        if codec == "none":
            out[r] = [u8[o:o + block].tobytes() for o in range(0, u8.nbytes, block)]
        elif codec in BLOSC2_CODECS:
            blosc2_runs.append(r)
        elif codec == "zstd" and u8.nbytes:
            zstd_runs.append(r)
        elif codec == "planes" and u8.nbytes:
            planes_by_k.setdefault(k, []).append(r)
    if zstd_runs:
        frames: list[Any] = [u8[o:o + block] for r in zstd_runs for _, u8, block, _ in [checked[r]]
                  for o in range(0, u8.nbytes, block)]
        coded = _compressor("zstd").multi_compress_to_buffer(frames, threads=max(1, threads))
        i = 0
        for r in zstd_runs:
            _, u8, block, _ = checked[r]
            nb = -(-u8.nbytes // block)
            out[r] = _joined([coded[j] for j in range(i, i + nb)], [1] * nb, alloc)
            i += nb
    for slot, (k, members) in enumerate(planes_by_k.items()):
        for r, blocks in zip(members, _encode_planes_runs([checked[r] for r in members], k, slot, threads, alloc)):
            out[r] = blocks
    if blosc2_runs:
        join = BLOSC2_JOIN_BYTES if coders >= BLOSC2_JOIN_MIN_CODERS else 0
        for r, blocks in zip(blosc2_runs, _encode_blosc2_runs([checked[r] for r in blosc2_runs], join, alloc)):
            out[r] = blocks
    return out


#: "blosc2" blocks coded in a batch are copied, as soon as this many stored bytes are gathered, into one
#: buffer by numpy (`_joined`: without the GIL), and the chunks python-blosc2 returned are freed at
#: once, so its next ones reuse their memory. python-blosc2 copies each chunk it codes into a new
#: bytes object while holding the GIL; held until written (a save's coders run ahead of its writers),
#: every chunk was fresh memory, whose first-touch page faults (slow under a sandbox such as gVisor)
#: then ran one thread at a time: 2,449 small leaves in one checkpointable coded at one core's speed
#: on the TPU host's 13 cores.
#: 0: each chunk kept as python-blosc2 returned it.
BLOSC2_JOIN_BYTES = 1 << 20
#: ...where at least this many threads code at once (`encode_runs`' `coders`): with fewer, the GIL is
#: seldom wanted by two coders at once, and the copy is a cost with nothing to win (on a 2-core VM the
#: one-checkpointable save of 2,449 small leaves was 5-10% slower gathered).
BLOSC2_JOIN_MIN_CODERS = 4


def _encode_blosc2_runs(runs: list[tuple[str, np.ndarray, int, int]], join: int,
                        alloc: Callable[[int], np.ndarray] | None = None) -> list[list[Any]]:
    """The "blosc2" blocks of each of `runs`: `_encode_blosc2_direct` where C-Blosc2 is called directly;
    else one `compress2` call per block (C-Blosc2, without the GIL), the stored chunks gathered into buffers
    of about `join` bytes (0: none; from `alloc`, `encode_runs`), each block a memoryview of one."""
    direct = _blosc2_encoder()
    if direct is not None:
        return _encode_blosc2_direct(direct, runs, alloc)
    b2 = _blosc2()
    out: list[list[Any]] = [[] for _ in runs]
    pending: list[Any] = []  # stored chunks not yet joined, and the run of each
    owners: list[int] = []
    size = 0
    for r, (codec, u8, block, k) in enumerate(runs):
        kw = _blosc2_params(codec, k)
        for o in range(0, u8.nbytes, block):
            z = b2.compress2(u8[o:o + block], **kw)
            if not join:
                out[r].append(z)
                continue
            pending.append(z)
            owners.append(r)
            size += len(z)
            if size >= join:
                _flush_blosc2(pending, owners, out, alloc)
                size = 0
    if pending:
        _flush_blosc2(pending, owners, out, alloc)
    return out


def _encode_blosc2_direct(direct: blosc2lib.Direct, runs: list[tuple[str, np.ndarray, int, int]],
                          alloc: Callable[[int], np.ndarray] | None = None) -> list[list[Any]]:
    """`_encode_blosc2_runs` through `blosc2lib`: every chunk of the batch coded by C-Blosc2 straight into
    one buffer (from `alloc`) with room for each block's worst case, each block a memoryview of it. Per
    block the GIL is held only for the call (no context made, no bytes allocated or copied), and the
    chunks lie back to back, so a writer writes the batch with one call (`engine._places`)."""
    srcs = [np.ascontiguousarray(u8) for _, u8, _, _ in runs]
    room = sum(u8.nbytes + -(-u8.nbytes // block) * blosc2lib.MAX_OVERHEAD for u8, (_, _, block, _) in zip(srcs, runs))
    buf = np.empty(room, np.uint8) if alloc is None else alloc(room)
    view = memoryview(buf)  # type: ignore[arg-type]  # a contiguous uint8 array exports its buffer
    base = blosc2lib.address(buf)[0]
    code = direct.compress_into
    out: list[list[Any]] = [[] for _ in runs]
    pos = 0
    for r, (u8, (codec, _, block, k)) in enumerate(zip(srcs, runs)):
        src, n = blosc2lib.address(u8)[0], u8.nbytes
        blocks = out[r]
        for o in range(0, n, block):
            m = min(block, n - o)
            z = code(k, src + o, m, base + pos, m + blosc2lib.MAX_OVERHEAD, codec)
            blocks.append(view[pos:pos + z])
            pos += z
    return out


def _flush_blosc2(pending: list[Any], owners: list[int], out: list[list[Any]],
                  alloc: Callable[[int], np.ndarray] | None = None) -> None:
    """Join `pending` chunks into one buffer (from `alloc`; numpy, without the GIL, however few bytes: this
    is what keeps fresh pages out of the GIL), append each as a view to its run's blocks in `out`, and
    empty both lists."""
    chunks = [np.frombuffer(z, np.uint8) for z in pending]
    whole = np.concatenate(chunks, out=None if alloc is None else alloc(sum(c.nbytes for c in chunks)))
    view = memoryview(whole)  # type: ignore[arg-type]  # a contiguous uint8 array exports its buffer
    o = 0
    for z, r in zip(pending, owners):
        out[r].append(view[o:o + len(z)])
        o += len(z)
    pending.clear()
    owners.clear()


#: A run's stored bytes from this size on are joined by numpy (which copies without the GIL), smaller
#: ones by bytes.join (fewer calls; it holds the GIL while it copies, about 10 GiB/s on the TPU host).
JOIN_NUMPY_BYTES = 256 << 10


def _joined(parts: list[Any], counts: list[int], alloc: Callable[[int], np.ndarray] | None = None) -> list[Any]:
    """`parts` joined into one buffer by one call (numpy's into a buffer from `alloc`, `encode_runs`), as
    one bytes-like object per block (block i is the next counts[i] parts)."""
    total = sum(len(p) for p in parts)
    if total >= JOIN_NUMPY_BYTES:
        whole: Any = np.concatenate([p if isinstance(p, np.ndarray) else np.frombuffer(p, np.uint8) for p in parts],
                                    out=None if alloc is None else alloc(total))
    else:
        whole = b"".join(parts)
    if len(counts) == 1:
        return [whole.data if isinstance(whole, np.ndarray) else whole]
    view = memoryview(whole)
    blocks, o, i = [], 0, 0
    for c in counts:
        n = 0
        for p in parts[i:i + c]:
            n += len(p)
        blocks.append(view[o:o + n])
        o, i = o + n, i + c
    return blocks


def _encode_planes_runs(runs: list[tuple[str, np.ndarray, int, int]], k: int, slot: int,
                        threads: int, alloc: Callable[[int], np.ndarray] | None = None) -> list[list[Any]]:
    """The "planes" blocks of each of `runs` (all of element size k); `slot`: which of this thread's
    split buffers holds their planes."""
    worth = [_planes_to_try(u8, k, block // k) for _, u8, block, _ in runs]
    whole = runs[0][1] if len(runs) == 1 else np.concatenate([u8 for _, u8, _, _ in runs])
    planes = _split(whole, k, scratch=True, slot=slot)
    spans = []  # per run, its blocks' element ranges in `planes`
    frames: list[Any] = []
    base = 0
    for (_, u8, block, _), w in zip(runs, worth):
        n_run, nb = u8.nbytes // k, block // k
        span = [(base + a, base + min(a + nb, n_run)) for a in range(0, n_run, nb)]
        for j, (a, b) in enumerate(span):
            frames.extend(planes[p, a:b] for p in range(k) if w[j, p])
        spans.append(span)
        base += n_run
    coded: Any = _compressor("planes").multi_compress_to_buffer(frames, threads=max(1, threads)) if frames else []
    i = 0
    parts: list[Any] = []  # every block of every run, joined by one call (`_joined`)
    for span, w in zip(spans, worth):
        for j, (a, b) in enumerate(span):
            limit = (b - a) * (1 - PLANE_MIN_SAVING)
            mask = 0
            lengths: list[int] = []
            head = len(parts)
            parts.append(b"")
            for p in range(k):
                if w[j, p]:
                    z = coded[i]
                    i += 1
                    if len(z) <= limit:
                        mask |= 1 << p
                        lengths.append(len(z))
                        parts.append(z)
                        continue
                parts.append(planes[p, a:b])
            parts[head] = struct.pack(f"<BH{len(lengths)}I", k, mask, *lengths)
    blocks = _joined(parts, [k + 1] * sum(len(span) for span in spans), alloc)
    out, o = [], 0
    for span in spans:
        out.append(blocks[o:o + len(span)])
        o += len(span)
    return out


def _split(u8: np.ndarray, k: int, scratch: bool = False, slot: int = 0) -> np.ndarray:
    """The planes of `u8`: a (k, n) uint8 array, row p the bytes p of every element. With
    `scratch`, in this thread's reusable buffer (valid until its next use): no fresh pages per
    block, which under a sandbox's slow page faults serialised threads coding at once."""
    n = u8.nbytes // k
    if k == 1:
        return u8.reshape(1, n)
    if scratch:  # buffer `slot` of this thread's (a batch of several element sizes holds several)
        bufs = getattr(_local, "split", None)
        if bufs is None:
            bufs = _local.split = {}
        buf = bufs.get(slot)
        if buf is None or buf.nbytes < k * n:
            buf = bufs[slot] = np.empty(max(k * n, 1 << 16), np.uint8)
        out = buf[:k * n].reshape(k, n)
    else:
        out = np.empty((k, n), np.uint8)
    if k == 2:  # integer shifts vectorise; a strided transpose copy runs ~3x slower here
        w = u8.view("<u2")
        np.copyto(out[0], w, casting="unsafe")
        np.right_shift(w, 8, out=out[1], casting="unsafe")
        return out
    if k in (4, 8):  # each plane one shift of the words, truncated into it: ~1.8x the transpose's speed
        w = u8.view(f"<u{k}")
        for p in range(k):
            np.right_shift(w, 8 * p, out=out[p], casting="unsafe")
        return out
    out[...] = u8.reshape(n, k).T
    return out


#: c * log2(c) for c = 0 .. PLANE_PROBE (0 for 0): a probe's entropy from its byte counts with one lookup.
_CLOGC = np.concatenate(([0.0], np.arange(1, PLANE_PROBE + 1) * np.log2(np.arange(1, PLANE_PROBE + 1))))


def _planes_to_try(u8: np.ndarray, k: int, n: int) -> np.ndarray:
    """Which planes of each n-element block of `u8` zstd is tried on, as a (blocks, k) bool array:
    every plane of a block under PLANE_PROBE_MIN_BYTES (the short last one too), the probe's answer
    (`_planes_worth_coding`) for the others."""
    total = u8.nbytes // k
    full, tail = divmod(total, n)
    worth = np.ones((full + (tail > 0), k), bool)
    if full and n * k >= PLANE_PROBE_MIN_BYTES:
        worth[:full] = _planes_worth_coding(u8[: full * n * k], k, n)
    if tail * k >= PLANE_PROBE_MIN_BYTES:
        worth[full] = _planes_worth_coding(u8[full * n * k :], k, tail)[0]
    return worth


def _planes_worth_coding(u8: np.ndarray, k: int, n: int) -> np.ndarray:
    """Whether each plane of each n-element block of `u8` (elements of k bytes; the last block may
    be shorter) is worth coding, as a (blocks, k) bool array: the order-0 entropy of up to
    PLANE_PROBE bytes sampled evenly from the plane (every ceil(m / PLANE_PROBE)-th of its m bytes)
    is under PLANE_MAX_BITS a byte, H = log2(N) - sum(c log2 c) / N over the N sampled bytes'
    counts c. The full blocks are one strided view, one add and one bincount; a short last block
    is probed the same way on its own (a fixed cost of a few numpy calls, not one per block or plane)."""
    total = u8.nbytes // k
    rows = u8.reshape(total, k)
    full = total // n
    parts = []
    if full:
        parts.append(_probe(rows[: full * n].reshape(full, n, k), n))
    if total > full * n:
        parts.append(_probe(rows[full * n :].reshape(1, total - full * n, k), total - full * n))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _probe(blocks: np.ndarray, size: int) -> np.ndarray:
    """`_planes_worth_coding` of (nb, size, k) equal blocks."""
    nb, _, k = blocks.shape
    # (nb, k, c), a view: the sampled bytes innermost, so numpy's loops run along them
    sample = blocks[:, :: -(-size // PLANE_PROBE) if size > PLANE_PROBE else 1, :].transpose(0, 2, 1)
    c = sample.shape[2]
    wide = np.uint16 if nb * k <= 256 else np.uint32
    offsets = ((np.arange(nb)[:, None] * k + np.arange(k)) * 256).astype(wide).reshape(nb, k, 1)
    keys = np.add(sample, offsets, dtype=wide)  # (block, plane, byte) as one histogram bin
    hist = np.bincount(keys.reshape(-1), minlength=256 * k * nb).reshape(nb, k, 256)
    bits = np.log2(c) - _CLOGC[hist].sum(axis=2) / c
    return bits < PLANE_MAX_BITS


def _encode_planes(u8: np.ndarray, k: int, worth: Any = None) -> bytes:
    """One block's "planes" form; `worth`: which planes to try zstd on (default: `_planes_to_try`)."""
    n = u8.nbytes // k
    if worth is None:
        worth = _planes_to_try(u8, k, n)[0] if n else [False] * k
    planes = _split(u8, k, scratch=True)
    mask = 0
    lengths: list[int] = []
    parts: list[Any] = []
    c = _compressor("planes")
    for p in range(k):
        plane = planes[p]
        if worth[p]:
            z = c.compress(plane)
            if len(z) <= n * (1 - PLANE_MIN_SAVING):
                mask |= 1 << p
                lengths.append(len(z))
                parts.append(z)
                continue
        parts.append(plane)
    header = struct.pack(f"<BH{len(lengths)}I", k, mask, *lengths)
    return b"".join([header, *parts])


# --------------------------------------------------------------------------------- decode


def _corrupt(where: str, codec: str, what: str) -> CorruptCheckpointError:
    at = f"{where}: " if where else ""
    return CorruptCheckpointError(f"{at}a {codec!r} block {what}")


def frame_content_size(stored: Any, limit: int, where: str, codec: str) -> int:
    """The content size that the single zstd frame `stored` declares, at most `limit` (checked as `decode`
    checks a frame, before anything is allocated): for a frame whose size its content tells (a delta's)."""
    src = memoryview(stored).cast("B") if not isinstance(stored, np.ndarray) else _as_u8(stored).data
    n = _frame_size(src, None, where, codec)
    if n > limit:
        raise _corrupt(where, codec, f"declares {n} decompressed bytes, more than the {limit} it can hold")
    _check_frame(src, n, where, codec)
    return n


def _frame_size(buf: memoryview, n: int | None, where: str, codec: str) -> int:
    """The length of the zstd frame at the start of `buf`, checking it declares n content bytes (with n
    None: the content size it declares, its header alone checked)."""
    if len(buf) < 6 or bytes(buf[:4]) != _MAGIC:
        raise _corrupt(where, codec, "does not start with a zstd frame")
    fhd = buf[4]
    fcs_flag, single, did_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    if fhd & 0x08:
        raise _corrupt(where, codec, "has a zstd frame header with the reserved bit set")
    if did_flag:
        raise _corrupt(where, codec, "names a zstd dictionary (cairn uses none)")
    fcs_size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if fcs_size == 0:
        raise _corrupt(where, codec, "has a zstd frame without its content size")
    pos = 5 + (0 if single else 1)
    if len(buf) < pos + fcs_size + 3:
        raise _corrupt(where, codec, "is truncated inside a zstd frame header")
    fcs = int.from_bytes(buf[pos:pos + fcs_size], "little") + (256 if fcs_size == 2 else 0)
    if n is None:
        return fcs
    if fcs != n:
        raise _corrupt(where, codec, f"declares {fcs} decompressed bytes where the index says {n}")
    pos += fcs_size
    while True:
        if len(buf) < pos + 3:
            raise _corrupt(where, codec, "is truncated inside a zstd frame")
        bh = int.from_bytes(buf[pos:pos + 3], "little")
        btype, bsize = (bh >> 1) & 3, bh >> 3
        if btype == 3:
            raise _corrupt(where, codec, "has a zstd block of the reserved type")
        pos += 3 + (1 if btype == 1 else bsize)
        if bh & 1:
            break
    pos += 4 if fhd & 0x04 else 0
    if pos > len(buf):
        raise _corrupt(where, codec, "is truncated inside a zstd frame")
    return pos


def _check_frame(stored: memoryview, n: int, where: str, codec: str) -> None:
    """`stored` is exactly one zstd frame declaring n content bytes (checked before allocating n)."""
    if _frame_size(stored, n, where, codec) != len(stored):
        raise _corrupt(where, codec, "has bytes after its zstd frame")


def _unzstd(stored: memoryview, into: Any, n: int, where: str, codec: str) -> None:
    """Decompress the zstd frame `stored` (checked by `_check_frame`) into `into` (n bytes)."""
    try:
        reader = _decompressor(n).stream_reader(stored, read_across_frames=False)
        got = reader.readinto(into) if n else 0
        more = reader.read(1)
    except zstandard.ZstdError as e:
        raise _corrupt(where, codec, f"does not decompress: {e}") from None
    if got != n or more:
        raise _corrupt(where, codec, f"decompresses to {'more than ' if more else ''}{got} bytes, not {n}")


def decode(codec: str, stored: Any, dtype: Any, raw_size: int, out: Any = None, where: str = "") -> Any:
    """The raw bytes of one block from its `stored` bytes.

    `raw_size` is the block's raw byte count from the index. With `out` (a
    writable buffer of exactly raw_size bytes) the bytes are decoded into it and
    `out` is returned; without, a new buffer (bytes or a uint8 array) is. An unknown
    codec, a malformed block, or one that does not decode to exactly raw_size
    bytes raises `CorruptCheckpointError` naming `where`.
    """
    try:
        dt = _check_dtype(dtype)
    except ValueError as e:
        raise _corrupt(where, codec, f"has {e}") from None
    k = dt.itemsize
    if not 0 <= raw_size <= MAX_BLOCK or raw_size % k:
        raise _corrupt(where, codec, f"has a raw size {raw_size} that is not a whole number of {dt} elements "
                                     f"up to {MAX_BLOCK}")
    src = memoryview(stored).cast("B") if not isinstance(stored, np.ndarray) else _as_u8(stored).data
    if out is not None:
        dst = np.frombuffer(out, np.uint8) if not isinstance(out, np.ndarray) else out.reshape(-1).view(np.uint8)
        if dst.nbytes != raw_size:
            raise ValueError(f"out has {dst.nbytes} bytes, the block {raw_size}")
    if codec == "none":
        if len(src) != raw_size:
            raise _corrupt(where, codec, f"has {len(src)} bytes where the index says {raw_size}")
        if out is None:
            return bytes(src)
        dst[:] = np.frombuffer(src, np.uint8)
        return out
    if codec not in ("zstd", "planes", *BLOSC2_CODECS):
        raise _corrupt(where, codec, f"names an unknown codec (known: {', '.join(CODECS)})")
    # every header field is checked against raw_size and len(stored) before anything is allocated
    if codec == "zstd":
        _check_frame(src, raw_size, where, codec)
    elif codec == "planes":
        layout = _planes_layout(src, raw_size, k, where)
    else:
        _blosc2_decoder(where, codec)  # (without python-blosc2: its error, before anything is allocated)
        _check_blosc2(src, raw_size, k, where, codec)
    if out is None:
        dst = np.empty(raw_size, np.uint8)
        out = dst
    if codec == "zstd":
        _unzstd(src, dst, raw_size, where, codec)
    elif codec == "planes":
        _decode_planes(src, dst, k, layout, where)
    elif raw_size:  # (an empty block is its checked header alone)
        _decode_blosc2_run([src], dt, [raw_size], dst, [0, raw_size], [where], codec)
    return out


#: A C-Blosc2 chunk's header (README_CHUNK_FORMAT.rst in C-Blosc2), the fields `_check_blosc2` reads.
_B2_HEADER = struct.Struct("<BBBBiii6sBB6sBB")
_B2_VERSION = 5  # BLOSC2_VERSION_FORMAT_STABLE: what C-Blosc2 2.x writes for a chunk of fixed-size blocks
_B2_CODECS = (0, 1, 3, 4)  # blosclz, lz4, zlib, zstd: C-Blosc2's own, never a user-defined (Python) one


def _check_blosc2(src: bytes | memoryview, raw_size: int, k: int, where: str, codec: str = "blosc2") -> None:
    """`src` is one C-Blosc2 chunk of `raw_size` bytes of k-byte elements, as docs/FORMAT.md §6.4 allows
    for `codec`: the extended header, its sizes equal to what the index says (so C-Blosc2 writes only
    `raw_size` bytes), no dictionary, no lazy or uninitialised chunk, and only built-in codecs and
    filters (the byte shuffle; for "blosc2-lz4" the bit shuffle too), so decoding can run no
    user-registered (Python) code."""
    if len(src) < _B2_HEADER.size:
        raise _corrupt(where, codec, f"of {len(src)} bytes is shorter than a {_B2_HEADER.size}-byte Blosc2 header")
    (version, _, flags, typesize, nbytes, blocksize, cbytes, filters, _, _, _, _,
     b2flags) = _B2_HEADER.unpack_from(src)
    if version != _B2_VERSION:
        raise _corrupt(where, codec, f"has Blosc format version {version}, not {_B2_VERSION} (C-Blosc2's stable chunks)")
    if flags & 0x05 != 0x05 or flags & 0x08:
        raise _corrupt(where, codec, f"has Blosc flags {flags:#04x}, not a Blosc2 chunk's with its extended header")
    if typesize != k:
        raise _corrupt(where, codec, f"has {typesize}-byte elements where its dtype has {k}-byte ones")
    if nbytes != raw_size:
        raise _corrupt(where, codec, f"declares {nbytes} decompressed bytes where the index says {raw_size}")
    if cbytes != len(src):
        raise _corrupt(where, codec, f"declares {cbytes} stored bytes, {len(src)} are stored")
    if not 0 < blocksize <= max(nbytes, 1):
        raise _corrupt(where, codec, f"has a Blosc block size {blocksize} outside 1..{max(nbytes, 1)}")
    if not flags & 0x02 and flags >> 5 not in _B2_CODECS:
        raise _corrupt(where, codec, f"names Blosc compressor {flags >> 5} (known: {_B2_CODECS})")
    allowed = _B2_FILTERS[codec]
    if any(f not in allowed for f in filters):
        raise _corrupt(where, codec, f"names Blosc filters {list(filters)} (cairn reads {allowed} in {codec!r} "
                                     "blocks: none, shuffle" + (", bit shuffle)" if 2 in allowed else ")"))
    if b2flags & 0x8F or (b2flags >> 4) & 7 > 3:
        raise _corrupt(where, codec, f"has Blosc2 flags {b2flags:#04x} (a dictionary, a lazy or uninitialised "
                                     "chunk, or one this reader does not know)")


def decode_run(codec: str, stored: Sequence[Any], dtype: Any, raw_sizes: Sequence[int], out: Any,
               wheres: Sequence[str] = (), threads: int = 1) -> None:
    """Decode consecutive blocks into `out`, their raw bytes back to back (``sum(raw_sizes)`` bytes):
    block i from ``stored[i]``, `raw_sizes[i]` raw bytes; ``wheres[i]`` names it in errors.

    The same checks and errors as `decode` of each block. For "planes" every coded plane of the
    run is decompressed by one `multi_decompress_to_buffer` call of zstandard (in C, on `threads`
    threads, outside the GIL) before the planes of each block are merged; other codecs decode
    block by block."""
    dst = np.frombuffer(out, np.uint8) if not isinstance(out, np.ndarray) else out.reshape(-1).view(np.uint8)
    if dst.nbytes != sum(raw_sizes) or len(stored) != len(raw_sizes):
        raise ValueError(f"out has {dst.nbytes} bytes, the {len(raw_sizes)} blocks {sum(raw_sizes)}")
    names = list(wheres) or [""] * len(raw_sizes)
    offsets = list(itertools.accumulate(raw_sizes, initial=0))  # (np.cumsum: 7 us a call, a piece is often one block)
    if codec in BLOSC2_CODECS:
        _decode_blosc2_run(stored, dtype, raw_sizes, dst, offsets, names, codec)
        return
    if codec != "planes" or len(stored) < 2:
        for i, s in enumerate(stored):
            decode(codec, s, dtype, raw_sizes[i], dst[offsets[i]:offsets[i + 1]], names[i])
        return
    try:
        k = _check_dtype(dtype).itemsize
    except ValueError as e:
        raise _corrupt(names[0], codec, f"has {e}") from None
    srcs, layouts, sizes = [], [], []
    frames: list[Any] = []
    for i, s in enumerate(stored):
        raw_size = raw_sizes[i]
        if not 0 <= raw_size <= MAX_BLOCK or raw_size % k:
            raise _corrupt(names[i], codec, f"has a raw size {raw_size} that is not a whole number of "
                                            f"{k}-byte elements up to {MAX_BLOCK}")
        src = memoryview(s).cast("B") if not isinstance(s, np.ndarray) else _as_u8(s).data
        layout = _planes_layout(src, raw_size, k, names[i])
        srcs.append(src)
        layouts.append(layout)
        for pos, ln, coded in layout:
            if coded:
                frames.append(src[pos:pos + ln])
                sizes.append(raw_size // k)
    planes_out: Any = ()
    if frames:
        try:
            planes_out = _decompressor(max(sizes)).multi_decompress_to_buffer(
                frames, decompressed_sizes=struct.pack(f"<{len(sizes)}Q", *sizes), threads=max(1, threads))
        except zstandard.ZstdError:  # a frame that does not decode: say which, block by block
            for i, s in enumerate(stored):
                decode(codec, s, dtype, raw_sizes[i], dst[offsets[i]:offsets[i + 1]], names[i])
            raise _corrupt(names[0], codec, "run does not decompress") from None
    j = 0
    for i, (src, layout) in enumerate(zip(srcs, layouts)):
        n = raw_sizes[i] // k
        planes = []
        for pos, _, coded in layout:
            if coded:
                seg = planes_out[j]
                j += 1
                if len(seg) != n:
                    raise _corrupt(names[i], codec, f"decompresses to {len(seg)} bytes, not {n}")
                planes.append(np.frombuffer(seg, np.uint8))
            else:
                planes.append(np.frombuffer(src, np.uint8, n, pos))
        _merge(planes, dst[offsets[i]:offsets[i + 1]], k)


def _decode_blosc2_run(stored: Sequence[Any], dtype: Any, raw_sizes: Sequence[int], dst: np.ndarray,
                       offsets: list[int], names: list[str], codec: str = "blosc2") -> None:
    """`decode_run` of "blosc2" (or "blosc2-lz4") blocks: `decode`'s checks, with as little Python per block as it can (each
    block's Python holds the GIL that the other threads' C calls wait to take back): per block, the header
    check (`_check_blosc2`, on a byte view) and one call that decodes the chunk straight into its place,
    C-Blosc2's own (`blosc2lib`, told it may write exactly the block's raw size there) where it is called
    directly, else python-blosc2's `decompress2` of the stored object itself. (Checking a run's headers
    at once as numpy columns, then decoding per block, decoded at 4.66 GiB/s on the TPU host's 12 threads
    against 7.54 for this form, in one run.)"""
    try:
        k = _check_dtype(dtype).itemsize
    except ValueError as e:
        raise _corrupt(names[0] if names else "", codec, f"has {e}") from None
    direct = _blosc2_decoder(names[0] if names else "", codec) if dst.flags.c_contiguous else None
    b2 = _blosc2(names[0] if names else "", codec) if direct is None else None
    base = blosc2lib.address(dst)[0] if direct is not None else 0
    for i, s in enumerate(stored):
        raw_size, where = raw_sizes[i], names[i]
        if not 0 <= raw_size <= MAX_BLOCK or raw_size % k:
            raise _corrupt(where, codec, f"has a raw size {raw_size} that is not a whole number of "
                                         f"{k}-byte elements up to {MAX_BLOCK}")
        src: Any = s if type(s) is bytes else (
            memoryview(s).cast("B") if not isinstance(s, np.ndarray) else _as_u8(s).data)
        _check_blosc2(src, raw_size, k, where, codec)
        if not raw_size:
            continue
        if direct is not None:
            at, _held = blosc2lib.address(src)
            got = direct.decompress_into(at, len(src), base + offsets[i], raw_size)
            if got != raw_size:
                raise _corrupt(where, codec, f"does not decompress (C-Blosc2 returned {got} for {raw_size} bytes)")
            continue
        try:
            assert b2 is not None
            b2.decompress2(src, dst=dst[offsets[i]:offsets[i + 1]], nthreads=1)
        except (ValueError, RuntimeError) as e:
            raise _corrupt(where, codec, f"does not decompress: {e}") from None


def _planes_layout(src: memoryview, raw_size: int, k: int, where: str) -> list[tuple[int, int, bool]]:
    """(offset, length, coded) of each plane of a "planes" block, every field checked."""
    codec = "planes"
    n = raw_size // k
    if len(src) < 3:
        raise _corrupt(where, codec, f"of {len(src)} bytes is shorter than its 3-byte header")
    got_k, mask = struct.unpack_from("<BH", src)
    if got_k != k:
        raise _corrupt(where, codec, f"has {got_k} planes where its dtype has {k}-byte elements")
    if mask >> k:
        raise _corrupt(where, codec, f"marks plane(s) beyond its {k} as coded (mask {mask:#06x})")
    coded = [p for p in range(k) if mask >> p & 1]
    head = 3 + 4 * len(coded)
    if len(src) < head:
        raise _corrupt(where, codec, "is truncated inside its header")
    lengths = dict(zip(coded, struct.unpack_from(f"<{len(coded)}I", src, 3)))
    total = head + sum(lengths.values()) + n * (k - len(coded))
    if total != len(src):
        raise _corrupt(where, codec, f"has {len(src)} bytes where its header adds up to {total}")
    layout = []
    pos = head
    for p in range(k):
        ln = lengths.get(p, n)
        if p in lengths:
            _check_frame(src[pos:pos + ln], n, where, codec)
        layout.append((pos, ln, p in lengths))
        pos += ln
    return layout


def _decode_planes(src: memoryview, dst: np.ndarray, k: int, layout: list[tuple[int, int, bool]],
                   where: str) -> None:
    n = dst.nbytes // k
    if k == 1:
        pos, ln, coded = layout[0]
        if coded:
            _unzstd(src[pos:pos + ln], dst, n, where, "planes")
        else:
            dst[:] = np.frombuffer(src, np.uint8, n, pos)
        return
    scratch = _scratch(n * sum(c for _, _, c in layout))
    planes: list[np.ndarray] = []
    s = 0
    for pos, ln, coded in layout:
        if coded:
            plane = scratch[s:s + n]
            _unzstd(src[pos:pos + ln], plane, n, where, "planes")
            s += n
        else:
            plane = np.frombuffer(src, np.uint8, n, pos)
        planes.append(plane)
    _merge(planes, dst, k)


def _merge(planes: list[np.ndarray], dst: np.ndarray, k: int) -> None:
    """Interleave planes (plane p = byte p of every element) into dst.

    One numpy call per block (k strided byte copies inside it, the GIL released throughout): on the
    TPU host's 12 threads it merges 1.6x faster than shifting and or-ing the planes as wide words,
    which takes 2k calls and as many passes over the block.
    """
    np.stack(planes, axis=1, out=dst.reshape(-1, k))


# --------------------------------------------------------------------------------- choose


def sample(a: np.ndarray, nbytes: int = SAMPLE_BYTES, pieces: int = SAMPLE_PIECES) -> np.ndarray:
    """Up to `nbytes` of `a`'s elements, in `pieces` contiguous runs spread evenly over it (flat)."""
    flat = np.ascontiguousarray(a).reshape(-1)
    per = max(1, nbytes // max(1, flat.itemsize) // pieces)
    if flat.size <= per * pieces:
        return flat
    starts = np.linspace(0, flat.size - per, pieces).astype(np.int64)
    return np.concatenate([flat[s:s + per] for s in starts])


def _sample_bytes(sample: np.ndarray, dt: np.dtype) -> np.ndarray:
    raw = np.ascontiguousarray(sample).reshape(-1).view(np.uint8)
    return raw[: raw.nbytes - raw.nbytes % dt.itemsize]


def stored_size(codec: str, dtype: Any, sample: np.ndarray) -> int:
    """How many bytes `sample` (elements of `dtype`) stores as under `codec`, cut into pieces of at most
    1 MiB, each coded as a block."""
    dt = _check_dtype(dtype)
    raw = _sample_bytes(sample, dt)
    step = (1 << 20) - (1 << 20) % dt.itemsize
    return sum(len(encode(codec, raw[i:i + step], dt)) for i in range(0, raw.nbytes, step))


def choose(dtype: Any, sample: np.ndarray) -> str:
    """The codec for a leaf of `dtype`, measured on `sample`: `choose_sized`'s codec."""
    return choose_sized(dtype, sample)[0]


def choose_sized(dtype: Any, sample: np.ndarray, blosc2: bool | None = None) -> tuple[str, int, int]:
    """The codec for a leaf of `dtype`, measured on `sample` (a few blocks' worth of its elements).

    Rule: encode the sample with each codec ("planes" and "zstd", and
    "blosc2" where python-blosc2 is importable and `blosc2` is not False: a
    save passes True only for compression="fast", where it codes faster than
    "planes" on the host's cores, `options.blosc2_faster`; the sample cut into pieces of
    at most 1 MiB, each coded as a block) and take the smallest stored size S.
    If S > (1 - MIN_SAVING) x the raw size (saving under 4%), "none". Else
    "blosc2" if its size is within BLOSC2_NEAR (5%) of S (it codes fastest on
    many cores); else the first of `CODECS` ("planes" before "zstd") whose
    size is within NEAR (1%) of S: planes is the faster of the two at equal
    size, since it skips near-random planes. Never by the dtype alone.
    Returns (codec, the sample's raw bytes, their stored size under that codec).
    """
    dt = _check_dtype(dtype)
    raw = _sample_bytes(sample, dt)
    if raw.nbytes == 0:
        return "none", 0, 0
    candidates = ("planes", "zstd", "blosc2") if blosc2 is not False and blosc2_available() else ("planes", "zstd")
    sizes = {c: stored_size(c, dt, raw) for c in candidates}
    best = min(sizes.values())
    if best > (1 - MIN_SAVING) * raw.nbytes:
        return "none", raw.nbytes, raw.nbytes
    if "blosc2" in sizes and sizes["blosc2"] <= best * (1 + BLOSC2_NEAR):
        return "blosc2", raw.nbytes, sizes["blosc2"]
    codec = next(c for c in CODECS if c in sizes and sizes[c] <= best * (1 + NEAR))
    return codec, raw.nbytes, sizes[codec]
